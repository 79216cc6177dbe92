"""Issue 21 point 1 (step 1 of docs/WORKER.md's plan): the step aggregator with its ranks kept
in one book per telemetry partition (detectors/steps.py, ``partitions``) closes the same
steps with the same records, late records and restarts included, as with one book, on random
jobs whose ranks lag, skip steps, send late, restart, change the world size and are expired
by the job's clock."""
from __future__ import annotations

import random

import pytest

from trainguard.detectors.steps import StepAggregator


def _job(seed: int) -> list:
    """``[(kind, item or now)]``: ``"step"`` records, ``"life"`` starts, ``"expire"`` times."""
    rng = random.Random(seed)
    world = rng.choice([2, 3, 5, 8, 13])
    told = rng.random() < 0.6                  # a lifecycle start tells the world size
    lag = {r: rng.choice([0, 0, 0, 1, 2, 5, 40]) for r in range(world)}
    skip = {r: rng.random() < 0.1 for r in range(world)}
    out, t = [], 0.0
    if told:
        out += [("life", {"k": "life", "event": "start", "rank": r, "ts": t,
                          "world_size": world}) for r in range(world)]
    pending: list = []
    steps = rng.randint(5, 60)
    restart = rng.randint(3, steps) if rng.random() < 0.3 else None
    for step in range(steps):
        t += rng.choice([0.1, 0.5, 1.0, 3.0])
        if step == restart:
            again = rng.choice([world, world + 1]) if told else None
            out += [("life", {"k": "life", "event": "start", "rank": r, "ts": t,
                              **({"world_size": again} if again else {})})
                    for r in range(again or world)]
            world = again or world
            lag = {r: lag.get(r, 0) for r in range(world)}
            skip = {r: skip.get(r, False) for r in range(world)}
        for r in range(world):
            if skip[r] and rng.random() < 0.5:
                continue
            number = step - restart if restart is not None and step >= restart else step
            rec = {"k": "step", "job": "j", "rank": r, "step": number,
                   "ts": t + rng.uniform(0, 0.05)}
            pending.append((step + lag[r] + rng.choice([0, 0, 1]), rec))
        due = sorted((p for p in pending if p[0] <= step), key=lambda p: p[0])
        pending = [p for p in pending if p[0] > step]
        rng.shuffle(due)
        out += [("step", rec) for _, rec in due]
        if rng.random() < 0.3:
            out.append(("expire", t + rng.choice([0.0, 2.0, 6.0])))
    out += [("step", rec) for _, rec in pending]
    out.append(("expire", t + 100.0))
    return out


def _closed(aggregator: StepAggregator, job: list) -> list:
    out = []
    for kind, x in job:
        if kind == "life":
            aggregator.life(dict(x))
        else:
            closed = aggregator.add(dict(x)) if kind == "step" else aggregator.expire(x)
            out += [(js["step"], js["ts"], js["first_ts"], js["world"], js.get("late"),
                     sorted(js["ranks"].items())) for js in closed]
    return out + [("late", aggregator.late)]


@pytest.mark.parametrize("seed", range(60))
def test_the_step_aggregator_split_by_partition_closes_what_one_book_does(seed):
    job = _job(seed)
    want = _closed(StepAggregator(window=6, window_s=5.0), job)
    for partitions in (2, 5):
        assert _closed(StepAggregator(window=6, window_s=5.0, partitions=partitions),
                       job) == want


def test_the_random_jobs_close_steps_every_way():
    """The jobs above close steps by every rule: complete, by the window, by the roster, by
    the job's clock; they also have late records and restarts."""
    late = restarts = 0
    for seed in range(60):
        job = _job(seed)
        closed = _closed(StepAggregator(window=6, window_s=5.0), job)
        late += closed[-1][1] > 0
        restarts += any(k == "life" and i > 0 and job[i - 1][0] != "life"
                        for i, (k, _) in enumerate(job))
    assert late >= 10 and restarts >= 10
