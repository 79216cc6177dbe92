"""Issue 10 point 2: the hang clock starts after allowed phases, allowances are learned per
job and phase, the first step has its own budget, a stall after progress is a new incident."""
from __future__ import annotations

import pickle

from trainguard.detectors import Correlator, HangDetector, JobStage
from trainguard.detectors.base import to_anomaly

from peer_jobs import feed


def step(s, ts, rank=0):
    return {"k": "step", "rank": rank, "node": "n1", "ts": ts, "step": s}


def hb(ts, phase, since, s=None, rank=0):
    return {"k": "hb", "rank": rank, "node": "n1", "ts": ts, "step": s, "phase": phase,
            "phase_since": since}


def six_second_job(steps, checkpoint_at=None, checkpoint_s=45.0, hang_at=None):
    items, t = [(0.0, {"k": "life", "rank": 0, "ts": 0.0, "event": "start"})], 0.0
    items.append((0.5, hb(0.5, "init", 0.0)))
    t = 20.0                                        # 20 s to the first step
    for s in range(steps):
        if hang_at is not None and s == hang_at:
            items += [(t + k, hb(t + k, "forward", t, s - 1)) for k in range(1, 200)]
            return items, t
        t += 6.0
        items.append((t, step(s, t)))
        items.append((t - 5.0, hb(t - 5.0, "forward", t - 5.5, s - 1 if s else None)))
        if s == checkpoint_at:
            items.append((t + 0.5, hb(t + 0.5, "checkpoint", t + 0.1, s)))
            items += [(t + k, hb(t + k, "checkpoint", t + 0.1, s))
                      for k in range(5, int(checkpoint_s), 5)]
            t += checkpoint_s
            items.append((t + 0.5, hb(t + 0.5, "data", t + 0.2, s)))
    return items, t


def test_a_45s_checkpoint_between_6s_steps_is_no_hang():
    items, end = six_second_job(20, checkpoint_at=10)
    assert feed(HangDetector(), items, end + 5) == []


def test_first_step_has_its_own_budget_and_a_ten_minute_step_job_is_not_hung():
    d = HangDetector()
    items = [(0.0, hb(0.0, "init", 0.0))]
    t = 1500.0                                       # 25 minutes of compile
    for s in range(4):
        items.append((t, step(s, t)))
        t += 600.0                                   # 10-minute steps
    assert feed(d, items, t - 590.0, every=5.0) == []


def test_a_real_stall_after_steps_is_found_within_three_step_p99():
    items, stall = six_second_job(30, hang_at=25)
    found = feed(HangDetector(), items, stall + 150)
    assert [f.kind for f in found] == ["hang"]
    assert found[0].detected_ts - found[0].onset_ts <= max(30.0, 3 * 6.0) + 1


def test_user_phase_wrapped_around_the_loop_is_no_pause():
    d = HangDetector()
    items = []
    for s in range(40):
        t = 10.0 + s
        items.append((t, step(s, t)))
        items.append((t + 0.5, hb(t + 0.5, "train", 5.0, s)))     # the loop's own phase
    items += [(50.0 + k, hb(50.0 + k, "train", 5.0, 39)) for k in range(100)]
    found = feed(d, items, 150.0)
    assert [f.kind for f in found] == ["hang"] and found[0].detected_ts <= 49.0 + 21


def test_false_alarm_feedback_widens_the_phase_allowance_and_pickles():
    d = HangDetector(checkpoint_s=60.0)
    assert d.allowance("checkpoint") == 60.0
    d.note_false_alarm("checkpoint", 100.0)
    assert d.allowance("checkpoint") == 300.0
    d.note_false_alarm(None, 40.0)                  # between steps
    assert d.timeout() >= 60.0
    assert pickle.loads(pickle.dumps(d)).allowance("checkpoint") == 300.0
    stage = JobStage()
    stage.note_false_alarm("eval", 1000.0)
    assert stage.detectors["hang"].allowance("eval") == 3000.0


def test_a_stall_after_progress_resumed_is_a_new_incident():
    d = HangDetector()
    items, t = [], 0.0
    for s in range(30):
        t = 10.0 + s
        items.append((t, step(s, t)))
    # stall 1: 60 s, then progress again (a false alarm), then a real stall 100 s later
    for s in range(30, 60):
        t = 100.0 + s
        items.append((t, step(s, t)))
    found = feed(d, items, 300.0)
    assert len(found) == 2 and found[0].key != found[1].key
    c = Correlator()
    for f in found:
        c.add(to_anomaly("j", f))
    assert [i["kind"] for i in c.incidents()] == ["hang", "hang"]


def test_of_two_ranks_the_one_behind_in_the_step_is_blamed():
    d = HangDetector()
    for s in range(10):
        for r in (0, 1):
            d.update(step(s, 10.0 + s, rank=r))
    for t in (25.0, 44.0):
        d.update(hb(t, "backward", 20.5, 9, rank=0))    # waits in DDP's all-reduce
        d.update(hb(t, "data", 19.1, 9, rank=1))        # its data loader is stuck
    found = d.advance(45.0)
    assert [(f.kind, f.ranks) for f in found] == [("hang", [1])]


def test_min_intervals_zero_judges_from_the_first_interval_and_raises_nothing():
    """``min_intervals`` may be 0 (its range starts there): before any interval is known the
    first-step budget applies, as for any other value (it raised TypeError: the quantile of
    no interval is None)."""
    d = HangDetector(min_intervals=0, floor_s=10.0)
    d.update({"k": "step", "rank": 0, "ts": 0.0, "step": 0})
    assert d.advance(1.0) == [] and d.timeout() == d.allowance("first_step")
    for s in range(1, 4):
        d.update({"k": "step", "rank": 0, "ts": float(s), "step": s})
    assert d.timeout() == 10.0
    assert [f.kind for f in d.advance(20.0)] == ["hang"]
