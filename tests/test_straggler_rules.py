"""The straggler detector's rules on plain per-step compute times (detectors/straggler.py):

- a shared CPU's noise, with ranks steadily ~12% slower than the others, is no straggler;
- a rank slow from its first step is found by the peer comparison;
- a heterogeneous job (several ranks steadily several times slower from the start) is not;
- a noisy rank whose pace wanders is judged against its own spread;
- ranks falling behind together a few steps apart are named together.
"""
from __future__ import annotations

import math
import random

import pytest

from trainguard.detectors.straggler import StragglerDetector, make_jobstep


def run(times_of_step, steps, seed=0):
    """Findings of a fresh detector over ``steps`` steps; ``times_of_step(step, rng)`` gives
    the per-rank compute times."""
    d = StragglerDetector()
    rng = random.Random(seed)
    out = []
    for s in range(steps):
        out += d.update(make_jobstep(s, 100.0 + s, compute_time=times_of_step(s, rng)))
    return out


def noisy(rng, base, sd):
    return base * math.exp(rng.gauss(0, sd)) * math.exp(abs(rng.gauss(0, 0.1)))


@pytest.mark.parametrize("seed", range(6))
def test_shared_cpu_noise_with_ranks_twelve_percent_slower_is_no_straggler(seed):
    factors = [1.12, 1.0, 1.0, 1.12]
    found = run(lambda s, rng: [noisy(rng, 0.05 * f, 0.12) for f in factors], 600, seed)
    assert found == []


@pytest.mark.parametrize("seed", range(4))
def test_the_true_straggler_among_shared_cpu_noise_is_named_alone(seed):
    def times(s, rng):
        factors = [1.12, 1.6 if s >= 12 else 1.0, 1.0, 1.12]
        return [noisy(rng, 0.05 * f, 0.12) for f in factors]
    found = run(times, 300, seed)
    assert found and {tuple(f.ranks) for f in found} == {(1,)}
    assert found[0].evidence["detected_step"] <= 12 + 30


@pytest.mark.parametrize("seed", range(4))
def test_a_rank_slow_from_its_first_step_is_found(seed):
    def times(s, rng):
        return [0.5 * math.exp(rng.gauss(0, 0.02)) * (1.6 if r == 5 else 1.0) for r in range(8)]
    found = run(times, 200, seed)
    assert [(f.ranks, f.evidence["detected_step"] <= 30) for f in found] == [([5], True)]


def test_a_heterogeneous_job_slow_in_half_its_ranks_from_the_start_is_not_stragglers():
    levels = [280, 58, 58, 58, 123, 236, 219, 265, 254, 58]     # alibaba-pai job 4's workers
    found = run(lambda s, rng: [v * math.exp(rng.gauss(0, 0.06)) for v in levels], 400)
    assert found == []


def test_a_rank_whose_pace_wanders_is_judged_against_its_own_spread():
    # rank 0 wanders by +-25% in runs of a dozen steps; the others are steady
    def times(s, rng):
        wander = 1.0 + 0.22 * math.sin(s / 6.0)
        return [0.3 * wander * math.exp(rng.gauss(0, 0.08))] + [
            0.3 * math.exp(rng.gauss(0, 0.02)) for _ in range(9)]
    assert run(times, 800) == []


def test_ranks_falling_behind_a_few_steps_apart_are_named_together():
    def times(s, rng):
        out = [0.7 * math.exp(rng.gauss(0, 0.03)) for _ in range(10)]
        for r, start in ((6, 100), (7, 101), (8, 106), (9, 108)):
            if s >= start:
                out[r] *= 1.3
        return out
    found = run(times, 160)
    assert [f.ranks for f in found] == [[6, 7, 8, 9]]
    assert found[0].evidence["detected_step"] <= 100 + 30


@pytest.mark.parametrize("arrays", [False, True])
def test_a_stage_short_of_peers_in_some_steps_is_not_judged_against_the_other_stage(
        arrays, monkeypatch):
    """Two pipeline stages, the second 1.3x slower by design. After a restart whose clock
    offsets are not learned yet, steps close with the first stage whole and one rank of the
    second (mixed-2 with a machine's clock stepped while the job was down): that rank is
    not compared with the faster stage, as if it were a straggler."""
    from trainguard.detectors import straggler

    if arrays:
        monkeypatch.setattr(straggler, "ARRAYS_FROM", 0)
    d = StragglerDetector()
    d.update({"k": "life", "job": "j", "rank": 0, "node": "n0", "ts": 1.0, "event": "start",
              "world_size": 8, "topology": {"tp": 2, "pp": 2, "dp": 2}})
    rng = random.Random(3)
    out = []
    for s in range(80):
        times = [noisy(rng, 1.0 if r < 4 else 1.3, 0.02) for r in range(8)]
        js = make_jobstep(s, 100.0 + 2 * s, compute_time=times)
        if s >= 40:
            for r in (5, 6, 7):
                del js["ranks"][r]
        out += d.update(js)
    assert out == []
    # the whole stage slowing down relative to its usual pace is still a straggler: rank 4
    # slower than its own stage, once the stage is whole again
    for s in range(80, 110):
        times = [noisy(rng, 1.0 if r < 4 else 1.3, 0.02) for r in range(8)]
        times[4] *= 1.6
        out += d.update(make_jobstep(s, 100.0 + 2 * s, compute_time=times))
    assert [f.ranks for f in out] == [[4]]


@pytest.mark.parametrize("arrays", [False, True])
def test_after_a_resize_that_told_no_topology_the_old_stages_are_not_used(arrays, monkeypatch):
    """16 ranks in two stages of 8, then a restart on 9 ranks whose starts tell no topology:
    the old stage size leaves rank 8 alone in its stage; it is compared across the job, and
    found when it falls behind."""
    from trainguard.detectors import straggler

    if arrays:
        monkeypatch.setattr(straggler, "ARRAYS_FROM", 0)
    d = StragglerDetector()
    start = {"k": "life", "job": "j", "rank": 0, "node": "n0", "ts": 1.0, "event": "start",
             "world_size": 16, "topology": {"tp": 1, "pp": 2, "dp": 8}}
    d.update(start)
    rng = random.Random(5)
    out = []
    for s in range(30):
        out += d.update(make_jobstep(s, 100.0 + s, compute_time=[
            noisy(rng, 1.0, 0.02) for _ in range(16)]))
    d.update({**start, "ts": 200.0, "world_size": 9, "topology": None})
    for s in range(30, 90):
        times = [noisy(rng, 1.0, 0.02) for _ in range(9)]
        if s >= 60:
            times[8] *= 1.6
        out += d.update(make_jobstep(s, 200.0 + s, compute_time=times))
    assert [f.ranks for f in out] == [[8]]
    assert "their peers" in out[0].summary


@pytest.mark.parametrize("warmup", [2, 10])
def test_a_healthy_job_of_two_speeds_compared_as_a_whole_names_nobody(warmup):
    """Two pipeline stages, one 30% slower by design, the layout not told: each rank learns
    its usual share against the job. A one-step warm-up learned no noise and the share of a
    single step against the other speed, and named the fast half at step 1; the setting's
    minimum is 2 (``trainguard config check`` refuses 1, tests/test_config_tree.py)."""
    d = StragglerDetector(k=3, n=4, settle=0, warmup=warmup)
    out = []
    for s in range(40):
        out += d.update(make_jobstep(s, 10.0 + s, compute_time=[
            1.0 + 0.001 * r if r < 4 else 1.3 + 0.001 * r for r in range(8)]))
    assert out == []
