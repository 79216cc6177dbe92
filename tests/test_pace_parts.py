"""Issue 21 point 1 (step 4 of docs/WORKER.md's plan): the straggler's rules applied with each
partition's ranks in a book of their own and only sketches between (detectors/pace_parts.py)
name the ranks that one book names, on random jobs (the scenario library:
tests/test_step_partials.py)."""
from __future__ import annotations

import copy
import random
from dataclasses import asdict

import pytest

from trainguard.detectors import straggler
from trainguard.detectors.base import make_jobstep
from trainguard.detectors.pace_parts import PaceParts
from trainguard.detectors.straggler import StragglerDetector

from test_straggler_books import _job


def _job2(seed: int):
    """More shapes than ``_job``: ranks that join late or leave, the pipeline layout changed
    mid-job, steps whose world is not whole stages, times on a coarse grid (ties at the
    median), many zeros, ranks slow from the start, ``min_ranks`` 2 to 4."""
    rng = random.Random(seed)
    n = rng.choice([6, 8, 12, 16, 24, 48, 64])
    k_n = rng.choice([4, 6, 10])
    settings = dict(k=min(rng.choice([2, 3, 6]), k_n), n=k_n, settle=rng.choice([0, 1, 2]),
                    warmup=rng.choice([2, 3, 5, 10]), min_ranks=rng.choice([2, 3, 4]))

    def layout(ts):
        pp = rng.choice([p for p in (2, 3, 4, 6) if n % p == 0])
        return {"k": "life", "job": "j", "rank": 0, "node": "n0", "ts": ts, "event": "start",
                "world_size": n, "topology": {"tp": 1, "pp": pp, "dp": n // pp}}

    items = [layout(1.0)] if rng.random() < 0.6 else []
    change_at = rng.randrange(10, 70) if rng.random() < 0.4 else None
    late = set(rng.sample(range(n), rng.choice([0, 1, 2, n // 4])))
    late_from = rng.randrange(5, 50)
    gone = set(rng.sample(range(n), rng.choice([0, 0, 1, 2])))
    gone_from = rng.randrange(5, 70)
    slow = set(rng.sample(range(n), rng.choice([0, 1, 1, 2, 3, n // 2])))
    slow_from = rng.choice([0, 0, rng.randrange(0, 40)])
    grid = rng.choice([None, None, 0.01, 0.05])
    zeros = rng.choice([0.0, 0.03, 0.2])
    usual = [rng.choice([0.5, 0.5, 0.5, rng.uniform(0.3, 1.0)]) for _ in range(n)]
    for s in range(80):
        if s == change_at:
            items.append(layout(100.0 + s - 0.5))
        times = []
        for r in range(n):
            t = usual[r] * (1 + rng.gauss(0, rng.choice([0.0, 0.01, 0.05, 0.2])))
            if r in slow and s >= slow_from and rng.random() < 0.9:
                t *= rng.choice([1.3, 1.6, 2.5])
            if grid:
                t = round(t / grid) * grid
            u = rng.random()
            times.append(0.0 if u < zeros else None if u < zeros + 0.03 else t)
            if (r in late and s < late_from) or (r in gone and s >= gone_from):
                times[-1] = None
        js = make_jobstep(s, 100.0 + s, compute_time=[0.5 if t is None else t for t in times])
        for r, t in enumerate(times):
            if t is None:
                del js["ranks"][r]
        if rng.random() < 0.05:
            js["world"] = n + 1
        if rng.random() < 0.05:
            keep = rng.sample(sorted(js["ranks"]), max(1, len(js["ranks"]) // 3))
            js["ranks"] = {r: js["ranks"][r] for r in sorted(keep)}
        items.append(js)
    return settings, items, rng.choice([2, 3, 5, 7, n + 3])


def _named(settings, items, paces=None):
    """Every finding, evidence and all."""
    d = StragglerDetector(**settings)
    if paces is not None:
        d._paces = paces
    out = []
    for item in copy.deepcopy(items):
        out += [asdict(f) for f in d.update(item)]
    return out


def _jobs():
    for seed in range(40):
        settings, items = _job(seed)
        yield f"books-{seed}", settings, items, 4
    for seed in (*range(40), 557):     # 557: a group's median share, sent as exp(level) and
        yield (f"shapes-{seed}", *_job2(seed))    # read back as log, differed in its last bit


JOBS = list(_jobs())


@pytest.mark.parametrize("name,settings,items,partitions", JOBS, ids=[j[0] for j in JOBS])
def test_random_jobs_name_the_same_ranks_split_and_whole(name, settings, items, partitions,
                                                         monkeypatch):
    """Random jobs (test_straggler_books' and more shapes), split with every value kept:
    over books of dicts, the loop book's findings, evidence to the last bit; over books of
    arrays, the numpy book's."""
    monkeypatch.setattr(straggler, "ARRAYS_FROM", 1 << 30)
    assert _named(settings, items, PaceParts(partitions, exact_upto=None)) == \
        _named(settings, items)
    monkeypatch.setattr(straggler, "ARRAYS_FROM", 0)
    assert _named(settings, items, PaceParts(partitions, exact_upto=None, arrays=True,
                                             n=settings["n"])) == _named(settings, items)
