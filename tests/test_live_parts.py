"""Issue 21 point 1 (step 2 of docs/WORKER.md's plan, its first detector): the silent
detector with its ranks' state split by partition (detectors/live_parts.py) reports what the
detector with one book reports, evidence and all, on random jobs whose ranks and machines
stop, come back, exit, go quiet one after another, and whose whole job pauses."""
from __future__ import annotations

import random
from dataclasses import asdict

import pytest

from trainguard.detectors.live_parts import SilentParts
from trainguard.detectors.liveness import SilentDetector


def _job(seed: int):
    """``(timeout_s, [(t, item or None)])``: items of 4 to 24 ranks on machines of 2 to 8,
    a look (None) every half second."""
    rng = random.Random(seed)
    ranks = rng.choice([4, 8, 12, 16, 24])
    per = min(rng.choice([2, 4, 8]), ranks)
    timeout = rng.choice([5.0, 10.0, 15.0])
    stops = {r: rng.uniform(5, 80) for r in rng.sample(range(ranks), rng.randint(0, ranks // 2))}
    machine = rng.randrange(ranks // per)
    if rng.random() < 0.5:               # a machine whose ranks stop one after another
        at = rng.uniform(10, 60)
        for i, r in enumerate(range(machine * per, machine * per + per)):
            stops[r] = at + i * rng.choice([0.0, 1.0, 3.0, 6.0])
    back = {r: t + rng.uniform(5, 40) for r, t in stops.items() if rng.random() < 0.4}
    exits = {r: rng.uniform(5, 90) for r in rng.sample(range(ranks), rng.randint(0, 2))}
    pause = (rng.uniform(20, 70), rng.choice([0.0, 25.0, 40.0]))     # the whole job quiet
    out = []
    for tick in range(200):
        t = tick * 0.5
        if pause[0] <= t < pause[0] + pause[1]:
            continue
        for r in range(ranks):
            if r in stops and stops[r] <= t < back.get(r, 1e9):
                continue
            if r in exits and t > exits[r]:
                continue
            node = f"n{r // per}"
            if r in exits and exits[r] <= t < exits[r] + 0.5:
                out.append((t, {"k": "life", "rank": r, "node": node, "ts": t,
                                "event": "exit"}))
            elif rng.random() < 0.8:
                out.append((t, {"k": "hb", "rank": r, "node": node,
                                "ts": t + rng.uniform(0, 0.4)}))
        if rng.random() < 0.3:
            out.append((t, {"k": "gpu", "node": f"n{rng.randrange(ranks // per)}", "ts": t}))
        out.append((t, None))
    return timeout, out


def _findings(detector, items) -> list:
    found = []
    for t, item in items:
        if item is None:
            found += [asdict(f) for f in detector.advance(t)]
        else:
            detector.update(dict(item))
    return found


@pytest.mark.parametrize("seed", range(80))
def test_the_silent_detector_split_by_partition_reports_what_one_book_does(seed):
    timeout, items = _job(seed)
    want = _findings(SilentDetector(timeout_s=timeout), items)
    for partitions in (2, 5):
        assert _findings(SilentParts(partitions, timeout_s=timeout), items) == want


def test_some_random_jobs_find_machines_going_quiet_one_rank_after_another():
    """The generator reaches the cases: findings that name a machine, and ranks alone."""
    kinds = set()
    for seed in range(80):
        timeout, items = _job(seed)
        for f in _findings(SilentDetector(timeout_s=timeout), items):
            kinds.add("machine" if f["nodes"] else "ranks")
    assert kinds == {"machine", "ranks"}


def test_a_lifecycle_item_that_is_not_an_exit_ends_one_in_both():
    """A rank that exited and then sends a lifecycle item telling no event is no longer
    taken for exited (as before the detector's per-rank half moved into methods)."""
    items = []
    for t in range(12):
        items.append((float(t), {"k": "hb", "rank": 0, "node": "n0", "ts": float(t)}))
        if t < 3:
            items.append((float(t), {"k": "hb", "rank": 1, "node": "n1", "ts": float(t)}))
        items.append((float(t), None))
    items.insert(9, (3.0, {"k": "life", "rank": 1, "node": "n1", "ts": 3.0, "event": "exit"}))
    items.insert(12, (4.0, {"k": "life", "rank": 1, "node": "n1", "ts": 4.0}))
    want = _findings(SilentDetector(timeout_s=5.0), items)
    assert [(f["ranks"], f["detected_ts"]) for f in want] == [([1], 9.0)]
    assert _findings(SilentParts(3, timeout_s=5.0), items) == want


def test_a_split_silent_detector_clones_with_its_partitions_and_settings():
    d = SilentParts(4, timeout_s=7.0)
    twin = d.clone()
    assert (type(twin), twin.partitions, twin.timeout_s) == (SilentParts, 4, 7.0)
    assert repr(d) == "SilentParts(timeout_s=7.0)"


def test_a_job_stamped_below_zero_is_judged_as_any_other():
    """Stamps before -1 (a simulator's relative time) are a rank's last seen too: the
    finding once raised a KeyError for them (the view started its ranks at -1.0)."""
    items = []
    for t in range(-40, -20):
        for r in range(4):
            if r < 2 or t < -35:
                items.append((float(t), {"k": "hb", "rank": r, "node": f"n{r // 2}",
                                         "ts": float(t)}))
        items.append((float(t), None))
    found = _findings(SilentDetector(timeout_s=5.0), items)
    assert [(f["nodes"], f["ranks"], f["onset_ts"]) for f in found] == [(["n1"], [2, 3], -36.0)]
    assert _findings(SilentParts(2, timeout_s=5.0), items) == found
