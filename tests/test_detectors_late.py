"""Records that reach the job stage after their step was closed: with several rank workers,
one may lag behind the others by more than ``step_window`` steps (tests/test_steps_by_number.py:
within the window they still count)."""
from __future__ import annotations

import math

from trainguard import events as ev
from trainguard.detectors import JobStage, RankStage


def _summaries(rank: int, steps, nan_at=None) -> list[dict]:
    stage = RankStage()
    out = []
    for s in steps:
        loss = math.nan if s == nan_at else 2.0 + 0.01 * s
        out += stage.update(ev.Step(job="j", ts=100.0 + s, node=f"n{rank // 4}", rank=rank,
                                    step=s, step_time=1.0, compute_time=0.8, loss=loss,
                                    grad_norm=1.0))
    return out


def test_a_nan_in_a_late_record_is_still_found_and_blames_its_rank():
    job = JobStage()
    found = []
    for s in range(10):                               # all eight ranks in step
        for r in range(8):
            found += job.update(_summaries(r, [s])[0])
    for s in range(10, 50):                           # rank 7's worker falls behind
        for r in range(7):
            found += job.update(_summaries(r, [s])[0])
    assert not found
    for item in _summaries(7, range(10, 50), nan_at=12):   # ... and catches up
        found += job.update(item)
    assert [(a.kind, a.ranks, a.step) for a in found] == [("nan", [7], 12)]
    assert "came after the step was closed" in found[0].summary
    assert job.steps.late > 0


def test_late_records_feed_no_step_statistics():
    job = JobStage()
    for s in range(30):
        for r in range(8):
            job.update(_summaries(r, [s])[0])
    straggler = job.detectors["straggler"]
    seen = {r: len(straggler._paces.history(r)) for r in range(8)}
    late = _summaries(3, [5])[0]                      # step 5 again, long closed
    assert job.update(late) == []
    assert {r: len(straggler._paces.history(r)) for r in range(8)} == seen


def test_a_lagging_rank_that_stays_nan_is_one_finding():
    job = JobStage()
    found = []
    stage7 = RankStage()

    def rank7(s):
        loss = math.nan if s >= 12 else 2.0
        return stage7.update(ev.Step(job="j", ts=100.0 + s, node="n1", rank=7, step=s,
                                     step_time=1.0, loss=loss, grad_norm=1.0))

    for s in range(40):
        for r in range(7):
            found += job.update(_summaries(r, [s])[0])
        if s >= 5:                                    # rank 7 runs five steps behind
            for item in rank7(s - 5):
                found += job.update(item)
    for s in range(35, 40):                           # ... catches up, still NaN
        for item in rank7(s):
            found += job.update(item)
    assert [(a.kind, a.ranks) for a in found] == [("nan", [7])]
