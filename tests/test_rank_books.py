"""Issue 21 point 1 (step 2 of docs/WORKER.md's plan): the hang and crash detectors with their
ranks' books split by partition (detectors/live_parts.py) report what they report with one
book, evidence and all, on random jobs: ranks stuck in a step or in a checkpoint, the whole
job stalled, ranks gone quiet, exits, tear-downs, restarts of ours and of the launcher."""
from __future__ import annotations

import random
from dataclasses import asdict

import pytest

from trainguard.detectors.live_parts import CrashParts, DataPositionParts, HangParts
from trainguard.detectors.liveness import CrashDetector, HangDetector, SilentDetector
from trainguard.detectors.view import JobView

STEP_PHASES = ("data", "forward", "backward", "optimizer", "collective")


def _hang_job(seed: int):
    """``(settings, [(t, item or None)])``: 2 to 16 ranks stepping with heartbeats through a
    step's phases, checkpoints and a user phase; one fault or none; a look (None) every half
    second."""
    rng = random.Random(seed)
    ranks = rng.choice([2, 3, 4, 8, 12, 16])
    per = min(rng.choice([1, 2, 4, 8]), ranks)
    step_s = rng.choice([1.0, 2.0, 3.0])
    every = rng.choice([3, 5, 8])                      # a checkpoint every few steps
    ckpt_s = rng.choice([3.0, 6.0])
    fault = rng.choice(["none", "stuck_data", "stuck_ckpt", "stall", "quiet", "exit",
                        "restart", "two_phases"])
    at = rng.uniform(15, 45)
    victims = rng.sample(range(ranks), rng.choice([1, 1, 2]) if ranks > 3 else 1)
    out, step, t, since = [], 0, 0.0, {}
    for r in range(ranks):
        out.append((0.0, {"k": "life", "rank": r, "node": f"n{r // per}", "ts": 0.0,
                          "event": "start"}))
    while t < 90.0:
        stalled = fault in ("stuck_data", "stuck_ckpt", "stall") and t >= at
        in_ckpt = step % every == every - 1
        for r in range(ranks):
            node = f"n{r // per}"
            if fault == "quiet" and r in victims and t >= at:
                continue
            if fault == "exit" and r in victims and t >= at:
                if at <= t < at + step_s:
                    out.append((t, {"k": "life", "rank": r, "node": node, "ts": t,
                                    "event": "exit", "exit_code": rng.choice([0, 1])}))
                continue
            if fault == "restart" and at <= t < at + step_s:
                out.append((t, {"k": "life", "rank": r, "node": node, "ts": t,
                                "event": "start"}))
            jitter = rng.uniform(0, 0.3)
            if stalled and (fault == "stall" or r in victims):
                phase = "checkpoint" if fault == "stuck_ckpt" else (
                    "data" if fault == "stuck_data" else rng.choice(STEP_PHASES))
            elif stalled:
                phase = "collective"
            elif in_ckpt and (r == 0 or rng.random() < 0.7):
                phase = "checkpoint"
            elif fault == "two_phases" and r in victims and step % 7 == 3:
                phase = "eval"
            else:
                phase = rng.choice(STEP_PHASES)
            key = (r, phase, step if not stalled else -1)
            since.setdefault(key, t + jitter * 0.5)
            if rng.random() < 0.85:
                out.append((t, {"k": "hb", "rank": r, "node": node, "ts": t + jitter,
                                "step": step - 1 if step else None, "phase": phase,
                                "phase_since": since[key]}))
            if not stalled and rng.random() < 0.97:
                out.append((t, {"k": "step", "rank": r, "node": node, "ts": t + jitter,
                                "step": step, "step_time": step_s * rng.uniform(0.8, 1.0)}))
        for k in range(int(step_s / 0.5)):
            out.append((t + 0.5 * k, None))
        t += step_s + (ckpt_s if in_ckpt and not (fault in ("stuck_data", "stuck_ckpt", "stall")
                                                   and t >= at) else 0.0)
        if not (fault in ("stuck_data", "stuck_ckpt", "stall") and t >= at):
            step += 1
    settings = {"floor_s": rng.choice([5.0, 10.0, 20.0]), "stale_s": rng.choice([4.0, 10.0]),
                "min_intervals": rng.choice([2, 5])}
    return settings, out


def _crash_job(seed: int):
    """``(grace_s, [(t, item or None)])``: ranks stepping; a tear-down (ranks SIGTERMed, some
    failing with a code, one vanishing), trainguard's restart word or none, a start again."""
    rng = random.Random(seed)
    ranks = rng.choice([2, 4, 8, 12])
    per = min(rng.choice([1, 2, 4]), ranks)
    at = rng.uniform(10, 30)
    vanish = rng.sample(range(ranks), rng.choice([0, 1, 2]) if ranks > 2 else 1)
    failed = rng.sample(range(ranks), rng.choice([0, 0, 1]))
    torn = [r for r in range(ranks) if r not in vanish and r not in failed
            and rng.random() < rng.choice([0.3, 1.0])]
    ours = rng.random() < 0.3
    restart_at = at + rng.choice([2.0, 8.0, 30.0])
    out, events = [], []
    for t10 in range(600):
        t = t10 / 10
        if t10 % 10 == 0:
            for r in range(ranks):
                node = f"n{r // per}"
                if at <= t < restart_at and (r in vanish or r in failed or r in torn):
                    continue
                if t >= restart_at and r in vanish and rng.random() < 0.5:
                    continue
                out.append((t, {"k": "step" if rng.random() < 0.7 else "hb", "rank": r,
                                "node": node, "ts": t + rng.uniform(0, 0.2),
                                "step": int(t)}))
        out.append((t, None))
    if ours:
        events.append((at - 0.1, {"k": "life", "rank": None, "ts": at - 0.1, "event": "exit",
                                  "restart": True}))
    for r in failed:
        events.append((at, {"k": "life", "rank": r, "node": f"n{r // per}", "ts": at,
                            "event": "exit", "exit_code": 1, "signal": None, "step": int(at)}))
    for r in torn:
        ts = at + rng.uniform(0.1, 1.5)
        events.append((ts, {"k": "life", "rank": r, "node": f"n{r // per}", "ts": ts,
                            "event": "exit", "exit_code": None,
                            "signal": rng.choice(["SIGTERM", "SIGINT"]), "step": int(at)}))
    for r in range(ranks):
        if rng.random() < 0.8:
            events.append((restart_at, {"k": "life", "rank": r, "node": f"n{r // per}",
                                        "ts": restart_at, "event": "start"}))
    out += events
    out.sort(key=lambda ti: (ti[0], ti[1] is None))
    return rng.choice([1.0, 3.0]), out


def _findings(detector, items, finish: bool = False) -> list:
    found = []
    t = 0.0
    for t, item in items:
        if item is None:
            found += [asdict(f) for f in detector.advance(t)]
        else:
            found += [asdict(f) for f in detector.update(dict(item))]
    if finish:
        found += [asdict(f) for f in detector.finish(t + 60.0)]
    return found


@pytest.mark.parametrize("seed", range(60))
def test_the_hang_detector_split_by_partition_reports_what_one_book_does(seed):
    settings, items = _hang_job(seed)
    want = _findings(HangDetector(**settings), items)
    for partitions in (2, 5):
        assert _findings(HangParts(partitions, **settings), items) == want


@pytest.mark.parametrize("seed", range(40))
def test_the_crash_detector_split_by_partition_reports_what_one_book_does(seed):
    grace, items = _crash_job(seed)
    want = _findings(CrashDetector(grace_s=grace), items, finish=True)
    for partitions in (2, 5):
        assert _findings(CrashParts(partitions, grace_s=grace), items, finish=True) == want


def test_the_random_jobs_reach_each_rule():
    """The generators reach the cases the merges serve: ranks left behind in a step and in
    a pause, timeouts with suspects, crashes of vanished, failed and torn-down ranks, and
    stops from outside."""
    rules, crashes = set(), set()
    for seed in range(60):
        settings, items = _hang_job(seed)
        for f in _findings(HangDetector(**settings), items):
            rules.add((f["evidence"]["rule"], bool(f["ranks"])))
    for seed in range(40):
        grace, items = _crash_job(seed)
        for f in _findings(CrashDetector(grace_s=grace), items, finish=True):
            crashes.add("vanished" if f["evidence"].get("vanished") else "outside" if
                        f["evidence"].get("external_stop") else f["severity"])
    assert {("left_behind", True), ("timeout", True)} <= rules
    assert {"vanished", "outside", "critical"} <= crashes


def test_split_detectors_clone_with_their_partitions_and_settings():
    for d in (HangParts(4, floor_s=7.0), CrashParts(4, grace_s=2.0)):
        twin = d.clone()
        assert (type(twin), twin.partitions, twin._get_params()) == \
            (type(d), 4, d._get_params())
    assert DataPositionParts(4).clone().partitions == 4


def test_odd_ranks_and_steps_are_judged_as_before_the_books():
    """Stamps the schema refuses but the detectors took (a float rank, a heartbeat's step
    as text) raise nothing (a review found both raising TypeError once in books)."""
    d = CrashDetector(grace_s=1.0)
    for r in (0.0, 1.0):
        d.update({"k": "step", "rank": r, "ts": 9.0, "step": 5})
    d.update({"k": "life", "rank": 0.0, "ts": 10.0, "event": "exit", "exit_code": None,
              "signal": "SIGTERM"})
    d.update({"k": "step", "rank": 1.0, "ts": 10.5, "step": 6})
    assert [f.summary for f in d.advance(12.0)] == [
        "rank 0.0 exited by signal SIGTERM after step 5 while rank 1.0 went on"]
    h = HangDetector()
    h.update({"k": "step", "rank": 0, "ts": 0.0, "step": 0})
    for r, step in ((0, "3"), (1, 4)):
        h.update({"k": "hb", "rank": r, "ts": 5.0, "step": step, "phase": "checkpoint",
                  "phase_since": 4.0})
    assert h.advance(6.0) == []
    s, found = SilentDetector(timeout_s=5.0), []   # a machine with a rank named by text
    for t in range(40):
        for r in (0, "1", 2):
            if not (r == 0 and t > 10):
                s.update({"k": "hb", "rank": r, "node": "n0" if r != 2 else "n1",
                          "ts": float(t)})
        found += [f.summary for f in s.advance(float(t))]
    assert found == ["rank 0 on n0 stopped sending 5s ago while the rest of the job goes on"]


@pytest.mark.parametrize("seed", range(20))
def test_the_job_view_split_by_partition_answers_as_one_book(seed):
    """Ranks that move between machines, stamps out of order, jobsteps naming machines: a
    view of 5 books answers every question as a view of one."""
    rng = random.Random(seed)
    one, split = JobView(), JobView(partitions=5)
    ranks = rng.randint(1, 40)
    for _ in range(300):
        r = rng.randrange(ranks)
        item = {"k": rng.choice(["step", "hb", "life"]), "rank": r,
                "node": rng.choice([f"n{r // 4}", f"n{rng.randrange(12)}", None, ""]),
                "ts": rng.uniform(0, 100)}
        if rng.random() < 0.05:
            item = {"k": "jobstep", "ranks": {q: {"node": f"n{rng.randrange(12)}"}
                                              for q in rng.sample(range(ranks), 3 if ranks > 2 else 1)}}
        one.learn(item)
        split.learn(item)
    assert split.where == one.where and split.last_seen == one.last_seen
    chosen = rng.sample(range(ranks + 3), rng.randint(0, ranks))
    for q in ("rank_nodes", "nodes_of", "whole_nodes"):
        assert getattr(split, q)(chosen) == getattr(one, q)(chosen), q
    where = one.where          # as the functions over the whole map answered before books
    by_node: dict = {}
    for rank, node in where.items():
        by_node.setdefault(node, []).append(rank)
    assert one.whole_nodes(chosen) == sorted(
        n for n, rs in by_node.items() if n and all(r in chosen for r in rs))
    assert one.rank_nodes(chosen) == {str(r): where[r] for r in sorted(chosen) if where.get(r)}
    for node in [f"n{i}" for i in range(13)] + [None]:
        assert sorted(split.ranks_on(node)) == sorted(one.ranks_on(node))
    assert split.node_stages(3) == one.node_stages(3)
    skip = set(rng.sample(range(ranks), ranks // 2))
    for now in (50.0, 100.0, 130.0):
        assert split.heard_within(now, 20.0, skip.__contains__) == \
            one.heard_within(now, 20.0, skip.__contains__)
    assert all(split.seen(r) == one.seen(r) and split.node_of(r) == one.node_of(r)
               for r in range(ranks + 3))
