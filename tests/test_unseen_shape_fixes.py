"""Regressions of the false incidents that tests/unseen_jobs.py found on healthy jobs:

- the fp16 loss scaler's start-up search (a scale of 2^32 halved until gradients fit, dozens
  of skipped steps with an infinite gradient norm) is no ``nan``; a run of them once the job
  trained, or a search that goes nowhere, still is;
- a job whose step times vary by 60% from step to step (variable-length batches) is no
  ``throughput_drop``; a real drop of such a job is still found, and a quiet job's as before;
- a heartbeat delivered twice or reordered in transit (a checkpoint heartbeat behind the step
  that ended the checkpoint, an idle heartbeat from before it inside it) does not make the
  checkpoint phase "a phase that wraps steps" (after which every later checkpoint was a hang
  20 s in);
- a step that takes twice as long because it carries twice the tokens (a sequence-length
  curriculum) is no ``throughput_drop``; the same step time with the same tokens still is;
- (recall, found on the way) a sudden job-wide slowdown of 2x or more (NCCL falling back to
  sockets) is a ``throughput_drop``: the test fired before the recent median moved, started
  afresh on the new level and never fired again;
- a machine whose clock runs 11 s behind the others' is not silent while steps are long (its
  ranks' summaries come every 5 s, stamped 8 s in the past).
"""
from __future__ import annotations

import math
import random

from trainguard.detectors.hang import HangDetector
from trainguard.detectors.liveness import SilentDetector
from trainguard.detectors.timing import ThroughputDetector, make_jobstep
from trainguard.detectors.training import NanDetector

INF = float("inf")


def nan_findings(steps, restart_at=None):
    """``steps``: (grad_norm, loss_scale) per step, 4 ranks with a finite loss."""
    d = NanDetector()
    out = []
    for s, (grad, scale) in enumerate(steps):
        if s == restart_at:
            d.update({"k": "life", "rank": 0, "ts": float(s), "event": "start"})
        out += [(f.step, f.summary) for f in d.update(make_jobstep(
            s, float(s), loss=[9.0] * 4, grad_norm=[grad] * 4, loss_scale=[scale] * 4))]
    return out


def megatron_search(start=32, good=14):
    """Two overflows per halving from 2^start down to 2^good, then training."""
    return [(INF, 2.0 ** (start - k // 2)) for k in range(2 * (start - good))]


def test_the_loss_scalers_start_up_search_is_no_nan():
    assert nan_findings(megatron_search() + [(1.5, 2.0 ** 14)] * 50) == []


def test_a_search_after_a_restart_is_none_either():
    trained = megatron_search() + [(1.5, 2.0 ** 14)] * 50
    assert nan_findings(trained + megatron_search(), restart_at=len(trained)) == []


def test_overflows_once_the_job_trained_are_still_a_nan_after_the_patience():
    steps = [(1.5, 2.0 ** 14)] * 30 + [(INF, 2.0 ** (14 - k)) for k in range(12)]
    assert [s for s, _ in nan_findings(steps)] == [30]


def test_a_search_that_goes_nowhere_is_a_nan():
    stuck = [(INF, 65536.0)] * 20         # the scale does not fall: no search
    found = nan_findings(stuck)
    assert len(found) == 1 and found[0][0] <= 12


def test_a_search_below_a_scale_of_one_is_a_nan():
    falling = [(INF, 2.0 ** (16 - k)) for k in range(40)]    # halved every step, forever
    found = nan_findings(falling)
    assert len(found) == 1 and found[0][0] <= 17 + 8


def throughput(sigma, factor, seed, at=300, steps=500):
    rng = random.Random(seed)
    d = ThroughputDetector()
    out = []
    for s in range(steps):
        t = 0.3 * math.exp(rng.gauss(0, sigma)) * (factor if s >= at else 1.0)
        out += d.update(make_jobstep(s, float(s), step_time=[t] * 8, compute_time=[t * 0.8] * 8))
    return [f.evidence["detected_step"] for f in out]


def test_step_times_varying_by_sixty_percent_are_no_throughput_drop():
    assert [throughput(0.6, 1.0, seed) for seed in range(6)] == [[]] * 6


def test_such_a_jobs_real_drop_is_found_and_a_quiet_jobs_as_before():
    for seed in range(4):
        assert [s - 300 <= 45 for s in throughput(0.6, 2.5, seed)] == [True]
        assert [s - 300 for s in throughput(0.02, 1.3, seed)] in ([19], [20])


def test_a_checkpoint_heartbeat_behind_its_step_leaves_the_next_checkpoint_a_pause():
    d = HangDetector()
    t = 0.0
    for cycle in range(2):
        for _ in range(30):                # 0.5 s steps
            t += 0.5
            d.update({"k": "step", "rank": 0, "ts": t, "step": int(t * 2)})
        start = t
        d.update({"k": "hb", "rank": 0, "ts": t + 1, "step": int(t * 2), "phase": "checkpoint",
                  "phase_since": start})
        t += 120.0                         # a 2-minute checkpoint
        if cycle == 0:
            d.update({"k": "step", "rank": 0, "ts": t + 0.5, "step": int(start * 2) + 1})
            # its last heartbeat, sent before that step, arrives after it
            d.update({"k": "hb", "rank": 0, "ts": t - 0.2, "step": int(start * 2),
                      "phase": "checkpoint", "phase_since": start})
            t += 0.5
        else:
            assert d.advance(t) == []      # 2 minutes into the second checkpoint
            assert d.deadline() >= start + 1800.0


def silent_findings(behind_s, stops_at=None):
    """Two machines of two ranks, summaries every 5 s; n2's clock ``behind_s`` behind."""
    d = SilentDetector()
    out = []
    for k in range(400):
        t = 1000.0 + 0.5 * k
        if k % 10 == 0:
            for r in range(4):
                node = "n1" if r < 2 else "n2"
                if node == "n2" and stops_at is not None and t >= stops_at:
                    continue
                skew = -behind_s if node == "n2" else 0.0
                d.update({"k": "hb", "rank": r, "node": node, "ts": t + skew})
        out += [(f.ranks, t) for f in d.advance(t)]
    return out


def test_a_machine_whose_clock_runs_behind_is_not_silent():
    assert silent_findings(behind_s=11.0) == []


def test_a_machine_that_stops_is_silent_as_before():
    assert silent_findings(behind_s=0.0, stops_at=1100.0) == [([2, 3], 1110.0)]
    assert silent_findings(behind_s=11.0, stops_at=1100.0) == [([2, 3], 1110.0)]


def token_run(tokens_after, factor=2.0, at=200, steps=320):
    d = ThroughputDetector()
    out = []
    for s in range(steps):
        t = 0.5 * (factor if s >= at else 1.0) * (1.0 + 0.01 * ((s * 7) % 5))
        n = 4096 if s < at else tokens_after
        out += d.update(make_jobstep(s, float(s), step_time=[t] * 8, compute_time=[t * 0.8] * 8,
                                     tokens=[n] * 8))
    return [(f.evidence["detected_step"], f.evidence["per_token"]) for f in out]


def test_twice_the_time_for_twice_the_tokens_is_no_throughput_drop():
    assert token_run(tokens_after=8192) == []


def test_twice_the_time_for_the_same_tokens_still_is():
    assert [(s - 200 <= 25, per_token) for s, per_token in token_run(4096)] == [(True, True)]


def test_a_sudden_job_wide_slowdown_of_two_or_more_is_found():
    for factor in (2.0, 3.0, 8.0):
        d = ThroughputDetector()
        out = []
        for s in range(320):
            t = 0.5 * (factor if s >= 200 else 1.0)
            out += d.update(make_jobstep(s, float(s), step_time=[t] * 8,
                                         compute_time=[t * 0.8] * 8))
        assert [f.evidence["detected_step"] - 200 <= 20 for f in out] == [True], factor


def test_an_old_heartbeat_delivered_again_inside_a_checkpoint_leaves_it_a_pause():
    d = HangDetector()
    for s in range(60):
        d.update({"k": "step", "rank": 0, "ts": 0.5 * s, "step": s})
    idle = {"k": "hb", "rank": 0, "ts": 29.0, "step": 58, "phase": "idle", "phase_since": 29.0}
    d.update(idle)
    d.update({"k": "hb", "rank": 0, "ts": 30.0, "step": 59, "phase": "checkpoint",
              "phase_since": 29.6})
    d.update(idle)                          # at-least-once delivery: the idle one again
    d.update({"k": "hb", "rank": 0, "ts": 35.0, "step": 59, "phase": "checkpoint",
              "phase_since": 29.6})
    assert d.advance(29.6 + 300.0) == [] and d.deadline() >= 29.6 + 1800.0
