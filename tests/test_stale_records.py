"""A rank's record that comes again, or overtaken by its later ones, seconds late (a
recording whose recorder restarted and wrote some of it twice, a producer's retry) is an
old record, not a step of its machine's clock: the rank side tells the two apart by the
step numbers (``RankStage._stale``), and a healthy job with such records raises nothing."""
from __future__ import annotations

import pytest

from trainguard import events as ev
from trainguard.detectors import RankStage
from trainguard.detectors.offline import analyze_events

from unseen_jobs import Shape, job_events


def _hb(ts, step, **kw):
    return ev.Heartbeat(job="j", ts=ts, node="n1", rank=0, pid=1, step=step,
                        phase=kw.pop("phase", "forward"), phase_since=kw.pop("since", ts - 0.1),
                        **kw)


def _step(ts, step):
    return ev.Step(job="j", ts=ts, node="n1", rank=0, step=step, step_time=1.0)


def _run(rs, events):
    return [[(s["k"], s.get("jump")) for s in rs.update(e)] for e in events]


def test_an_old_heartbeat_or_step_record_again_is_no_step_of_the_clock():
    rs = RankStage()
    live = [e for t in range(100, 120) for e in (_step(t + 0.9, t - 100), _hb(t + 0.5, t - 101))]
    for e in live:
        rs.update(e)
    # a heartbeat and a step record of ten seconds before come again
    assert _run(rs, [_hb(110.5, 9), _step(110.9, 10)]) == [[], [("step", None)]]
    # ... and what comes next goes on as before: no step forward either
    after = _run(rs, [_hb(120.5, 19), _step(120.9, 20), _hb(121.5, 20), _hb(126.5, 25)])
    assert [jump for out in after for _, jump in out] == [None] * sum(map(len, after))
    assert after[1] == [("step", None)] and after[3] == [("hb", None)]
    assert rs._last_step == 20


def test_a_heartbeat_from_before_the_first_step_after_it_is_old():
    rs = RankStage()
    rs.update(ev.Lifecycle(job="j", ts=99.0, node="n1", rank=0, event="start", pid=1))
    for e in (_hb(100.0, None, phase="init"), _hb(101.0, None, phase="init"),
              _step(110.0, 0), _step(111.0, 1), _hb(111.5, 1)):
        rs.update(e)
    assert _run(rs, [_hb(101.0, None, phase="init")]) == [[]]


def test_a_heartbeat_without_a_step_outside_init_is_not_taken_for_old():
    """A producer may send ``step: null`` all along (SPEC: int or null): a step of its clock
    back in a checkpoint is still told (a review's case: it was dropped as old)."""
    rs = RankStage()
    for t in range(100, 110):
        rs.update(_step(t + 0.9, t - 100))
    for t in range(110, 130):
        rs.update(_hb(float(t), None, phase="checkpoint", since=110.0))
    assert _run(rs, [_hb(100.0, None, phase="checkpoint", since=110.0)]) == [[("hb", -29.0)]]


def test_a_real_step_back_still_jumps():
    """Step numbers go on across a step of the clock: its records are new, and say how far."""
    rs = RankStage()
    for t in range(100, 120):
        rs.update(_step(t + 0.9, t - 100))
        rs.update(_hb(t + 0.5, t - 100))
    assert _run(rs, [_hb(90.5, 19)]) == [[("hb", -29.0)]]
    assert _run(rs, [_step(90.9, 20)]) == [[("step", None)]]    # on the new clock already
    rs = RankStage()
    for t in range(100, 120):
        rs.update(_hb(t + 0.5, t - 101))
        rs.update(_step(t + 0.9, t - 100))
    assert _run(rs, [_step(90.9, 20)]) == [[("step", -29.0)]]


def test_an_old_heartbeat_of_the_newest_step_that_comes_again_is_told_by_its_stamp():
    """In a long phase every heartbeat tells the same step, so step numbers cannot tell an
    old one written again from a step of the clock back; its stamp can: a copy carries one
    of the rank's last STAMPS_KEPT heartbeats' stamps, a clock that went back stamps anew.
    Before, the copy below was a step back of 9 s (and its machine silent at the job side)."""
    rs = RankStage()
    for t in range(100, 130):
        rs.update(_hb(float(t), 4, phase="checkpoint", since=99.0))
    assert _run(rs, [_hb(120.0, 4, phase="checkpoint", since=99.0)]) == [[]]
    assert _run(rs, [_hb(130.0, 4, phase="checkpoint", since=99.0)]) == [[("hb", None)]]
    assert rs._ts == 130.0
    # one older than the stamps kept is still taken for a step back (the limit)
    assert _run(rs, [_hb(110.0, 4, phase="checkpoint", since=99.0)])[0][0][1] == -20.0
    # ... and a real step back, stamped anew, is told as before
    rs = RankStage()
    for t in range(100, 130):
        rs.update(_hb(float(t), 4, phase="checkpoint", since=99.0))
    assert _run(rs, [_hb(119.7, 4, phase="checkpoint", since=99.0)])[0][0][1] == \
        pytest.approx(-9.3)


#: healthy jobs whose every record comes a second time with 5% (or 30%) odds, up to 15 s late
AGAIN = {
    "0.5s-steps": dict(steps=150, step_s=0.5),
    "2s-steps": dict(steps=80, step_s=2.0),
    "8s-steps": dict(steps=40, step_s=8.0, world=8),
    "tp2-pp2-clocks-3s-apart": dict(world=32, tp=2, pp=2, skew_s=3.0, steps=100, step_s=1.0),
}


@pytest.mark.parametrize("share", [0.05, 0.3])
@pytest.mark.parametrize("name", AGAIN)
def test_records_written_again_late_raise_nothing(name, share):
    """Before: false silents in 13 of these 16 recordings and a false hang in one more
    shape's (a checkpoint's), from steps of clocks that were none."""
    for seed in (0, 1):
        events = job_events(Shape(name=f"again-{name}", again=share, again_s=15.0, seed=seed,
                                  **AGAIN[name]))
        engine, _ = analyze_events(events)
        assert [(i["kind"], i["ranks"]) for i in engine.incidents()] == []


def test_a_copy_of_the_newest_heartbeat_or_of_one_before_a_step_back_is_no_jump():
    """A review's cases: the newest heartbeat again (a producer's retry) made the gap to the
    next one count from itself, so heartbeats 10 s apart looked like a step forward; a copy
    of one from before a step of the clock back looked like a step forward, and the next
    heartbeat like a step back again."""
    rs = RankStage()
    for t in range(100, 200, 10):
        rs.update(_hb(float(t), 4, phase="eval", since=99.0))
    assert _run(rs, [_hb(190.0, 4, phase="eval", since=99.0)]) == [[]]
    assert [j for out in _run(rs, [_hb(200.0, 4, phase="eval", since=99.0)])
            for _, j in out] == [None]
    rs = RankStage()
    for t in range(100, 130):
        rs.update(_hb(t + 0.5, 4, phase="checkpoint", since=99.0))
    assert _run(rs, [_hb(105.25, 4, phase="checkpoint", since=99.0)])[0][0][1] == -24.25
    assert _run(rs, [_hb(129.5, 4, phase="checkpoint", since=99.0)]) == [[]]   # a copy
    after = _run(rs, [_hb(106.25, 4, phase="checkpoint", since=99.0)])
    assert [j for out in after for _, j in out] in ([], [None])
