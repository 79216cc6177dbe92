"""The straggler's two books of paces (detectors/straggler.py) give the same findings: the loop
over a step's ranks (small jobs) and numpy over all of them (from ARRAYS_FROM ranks on), on
random jobs with slow ranks, noisy ranks, missing and unusable times, pipeline stages and a
job that grows from one to the other mid-stream; and the arrays survive a snapshot."""
from __future__ import annotations

import copy
import random
from dataclasses import asdict

import pytest

from detector_checks import snapshot_round_trip
from trainguard.detectors import straggler
from trainguard.detectors.base import make_jobstep
from trainguard.detectors.straggler import PaceArrays, PaceDicts, StragglerDetector


def _job(seed: int):
    """``(settings, items)``: a random job's settings and its lifecycle start and steps."""
    rng = random.Random(seed)
    n = rng.choice([3, 4, 6, 8, 16, 32, 64, 96])
    k_n = rng.choice([4, 6, 10])
    settings = dict(k=min(rng.choice([2, 3, 6]), k_n), n=k_n, settle=rng.choice([0, 1, 2]),
                    warmup=rng.choice([2, 3, 10]))
    items = []
    if rng.random() < 0.5 and n % 4 == 0:
        items.append({"k": "life", "job": "j", "rank": 0, "node": "n0", "ts": 1.0,
                      "event": "start", "world_size": n,
                      "topology": {"tp": 1, "pp": 2, "dp": n // 2}})
    slow = set(rng.sample(range(n), rng.choice([0, 1, 1, 2, 3, n // 2])))
    slow_from = rng.randrange(0, 40)
    usual = [rng.uniform(0.3, 1.0) if rng.random() < 0.3 else 0.5 for _ in range(n)]
    for s in range(80):
        times = []
        for r in range(n):
            t = usual[r] * (1 + rng.gauss(0, rng.choice([0.01, 0.05, 0.2])))
            if r in slow and s >= slow_from and rng.random() < 0.9:
                t *= rng.choice([1.3, 1.6, 2.5])
            u = rng.random()
            times.append(float("nan") if u < 0.02 else 0.0 if u < 0.03 else
                         None if u < 0.05 else t)
        js = make_jobstep(s, 100.0 + s, compute_time=[0.5 if t is None else t for t in times])
        for r, t in enumerate(times):
            if t is None:
                del js["ranks"][r]
        if rng.random() < 0.05:
            js["ranks"] = dict(list(js["ranks"].items())[: n // 2])
        items.append(js)
    return settings, items


def _findings(settings, items, arrays_from, monkeypatch, grows_at=None):
    """The findings of ``items``, and the detector; from item ``grows_at`` on the job is
    taken as large (ARRAYS_FROM 0)."""
    monkeypatch.setattr(straggler, "ARRAYS_FROM", arrays_from)
    d = StragglerDetector(**settings)
    out = []
    for i, item in enumerate(copy.deepcopy(items)):
        if i == grows_at:
            monkeypatch.setattr(straggler, "ARRAYS_FROM", 0)
        out += [asdict(f) for f in d.update(item)]
    return out, d


@pytest.mark.parametrize("seed", range(30))
def test_the_arrays_find_what_the_loop_finds(seed, monkeypatch):
    settings, items = _job(seed)
    by_loop, d = _findings(settings, items, 10**9, monkeypatch)
    assert type(d._paces) is PaceDicts
    by_arrays, d = _findings(settings, items, 0, monkeypatch)
    assert type(d._paces) is PaceArrays
    assert by_arrays == by_loop
    # a job that grows past ARRAYS_FROM mid-stream moves its paces over and goes on alike
    moved, d = _findings(settings, items, 10**9, monkeypatch, grows_at=5 + seed % 50)
    assert type(d._paces) is PaceArrays
    assert moved == by_loop


def test_a_job_moves_to_arrays_at_its_first_large_step_and_they_survive_a_snapshot(
        monkeypatch):
    settings, items = _job(7)
    expected, _ = _findings(settings, items, 10**9, monkeypatch)
    assert expected, "the job has a straggler to find"
    half = len(items) // 2
    monkeypatch.setattr(straggler, "ARRAYS_FROM", 0)
    d = StragglerDetector(**settings)
    found = []
    for item in copy.deepcopy(items[:half]):
        found += [asdict(f) for f in d.update(item)]
    assert type(d._paces) is PaceArrays
    d = snapshot_round_trip(d)
    for item in copy.deepcopy(items[half:]):
        found += [asdict(f) for f in d.update(item)]
    assert found == expected


def test_the_default_moves_at_128_ranks():
    d = StragglerDetector()
    d.update(make_jobstep(0, 1.0, compute_time=[0.5] * 127))
    assert type(d._paces) is PaceDicts
    d.update(make_jobstep(1, 2.0, compute_time=[0.5] * 128))
    assert type(d._paces) is PaceArrays
    d.update(make_jobstep(2, 3.0, compute_time=[0.5] * 8))     # for good
    assert type(d._paces) is PaceArrays


def test_the_random_jobs_have_stragglers_to_find(monkeypatch):
    """The comparison above is not of empty lists: most of its jobs have findings."""
    found = [_findings(*_job(seed), 10**9, monkeypatch)[0] for seed in range(30)]
    assert sum(1 for f in found if f) >= 15, [len(f) for f in found]
