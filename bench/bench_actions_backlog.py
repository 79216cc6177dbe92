"""Actions backlog: seconds from the anomaly of a real hang to its order (the restart), when it
arrives behind 1,000 junk anomalies of other jobs whose stack captures nobody answers, against
the same hang alone, in the same run.

Everything on the real path: a Kafka broker (``$TRAINGUARD_BOOTSTRAP``, else one started here
with the project's broker module), topics of a fresh prefix with *one* partition for the
anomalies (so that the hang really is the 1,001st message the service reads), and the real
``trainguard actions`` process with the default policy (two capture rounds 2 s apart, a 10 s
deadline per round). A thread stands in for the node agent of the hang's job (as in
tests/test_actions_kafka.py): it answers that job's ``capture_stacks`` commands with four
ranks' stacks, rank 2 stuck in its data loading. The hang's job has telemetry of its own on the
telemetry topic (its ranks' lifecycle starts, steps up to 40 and none after), so the service
knows its world size and that it is still stalled (confirm before acting). The junk
anomalies are critical hangs of 1,000 other jobs that sent nothing else: each one's capture
waits out its whole deadline, and then gets its own restart order. The clock stops at the
restart ``order`` on the orders topic (SPEC §6; its ``ts`` is when the service sent it).

A subprocess, not the pipeline in process: so the number includes reading the anomalies from
Kafka, the scheduler, sending commands, reading the stacks topic and writing the records, as
the service does them, with its own interpreter (and GIL).

``alone_s``   the hang alone: from writing its anomaly to its restart order;
``behind_s``  the same for a hang written right after 1,000 junk anomalies (the clock
              starts before the junk is written);
``ratio``     ``behind_s / alone_s``.
Each is measured three times, each time with a fresh service on fresh topics (the hang
alone first, then the other hang behind the junk), and the medians are reported beside
every value. The target is ``behind_s`` ≤
5 s. ``junk_done_s``: when the last junk anomaly of a batch got its restart order (its
capture deadline included); ``junk_restarts_before_the_hang``: junk restarts ordered before
the hang's (none: the hang did not wait for the junk).
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

JUNK = 1000
REPEATS = 3
TARGET_S = 5.0
TIMEOUT_S = 120.0


def _hang(job: str, now: float):
    from trainguard import events as ev

    return ev.Anomaly(job=job, ts=now, id=f"hang-{job}", kind="hang", severity="critical",
                      ranks=[], nodes=[], step=40, onset_ts=now - 60.0, detected_ts=now,
                      detector="hang", summary=f"the job made no progress for 60s ({job})")


def _telemetry(job: str, now: float) -> list:
    """Four ranks that started and stepped up to step 40, a minute ago."""
    from trainguard import events as ev

    events = [ev.Lifecycle(job=job, ts=now - 120.0, node="hostA", rank=r, event="start",
                           pid=100 + r, world_size=4) for r in range(4)]
    events += [ev.Step(job=job, ts=now - 100.0 + step, node="hostA", rank=r, step=step,
                       step_time=1.0) for step in range(41) for r in range(4)]
    return events


def _restarts(events, jobs) -> list:
    """The restart orders of ``jobs`` among ``events`` (of the orders topic)."""
    return [e for e in events if e.type == "order" and e.op == "restart" and e.job in jobs]


def _restart_ts(orders, job: str, timeout: float = TIMEOUT_S) -> float:
    found = orders.wait(lambda es: _restarts(es, {job}), timeout=timeout,
                        what=f"the restart order of {job}")
    return found[0].ts


def _alone(config, orders, job: str) -> float:
    from actions_harness import produce

    start = time.time()
    produce(config, config.topics.anomalies, _hang(job, start))
    return _restart_ts(orders, job) - start


def _behind(config, orders, job: str, batch: int) -> dict:
    from actions_harness import producer
    from trainguard import events as ev

    p = producer(config)
    junk = [f"junk{batch}-{i:04d}" for i in range(JUNK)]
    start = time.time()
    for name in junk:
        p.produce(config.topics.anomalies, key=name.encode(), value=ev.encode(_hang(name, start)))
    p.produce(config.topics.anomalies, key=job.encode(), value=ev.encode(_hang(job, time.time())))
    assert p.flush(30) == 0
    behind = _restart_ts(orders, job) - start
    mine = set(junk)
    before = sum(1 for e in _restarts(orders.events, mine) if e.ts <= start + behind)
    orders.wait(lambda es: len({e.job for e in _restarts(es, mine)}) >= JUNK,
                 timeout=TIMEOUT_S, what="every junk anomaly's restart order")
    return {"behind_s": behind, "junk_restarts_before": before,
            "junk_done_s": max(e.ts for e in _restarts(orders.events, mine)) - start}


def _one_round(bootstrap: str, folder: Path, n: int) -> tuple[float, dict]:
    """A fresh service on fresh topics: the hang alone, then behind the junk."""
    from actions_harness import Collector, Procs, answer_captures, produce, wait_for
    from trainguard.config import Config, Topics
    from trainguard.topics import TopicPlan, create_topics

    folder = folder / f"round-{n}"
    folder.mkdir()
    procs = Procs(folder)
    stop = threading.Event()
    config = Config(bootstrap=bootstrap, topics=Topics(prefix=f"bench{uuid.uuid4().hex[:8]}"))
    create_topics(config, TopicPlan(telemetry_partitions=2, other_partitions=1))
    topics = config.topics
    orders = None
    try:
        now = time.time()
        produce(config, topics.telemetry, *_telemetry("alone", now), *_telemetry("behind", now))
        agent = threading.Thread(target=answer_captures, args=(config, stop), daemon=True,
                                 kwargs={"jobs": {"alone", "behind"}})
        agent.start()
        orders = Collector(config, topics.orders)
        env = {"TRAINGUARD_BOOTSTRAP": bootstrap, "TRAINGUARD_TOPIC_PREFIX": topics.prefix,
               "TRAINGUARD_HOME": str(folder / "home")}
        procs.trainguard("actions", "actions", "--state", str(folder / "state.json"), env=env,
                         limit_s=600)
        wait_for(lambda: "consuming" in procs.log("actions"), timeout=60,
                 what=f"the action service: {procs.log('actions')[-500:]}")
        time.sleep(2.0)  # its telemetry watcher reads the steps of the jobs
        return _alone(config, orders, "alone"), _behind(config, orders, "behind", n)
    finally:
        stop.set()
        procs.stop_all()
        if orders is not None:
            orders.close()


def run() -> dict:
    from bench_collector_overhead import _broker

    bootstrap, stop_broker = _broker()
    folder = Path(tempfile.mkdtemp(prefix="tg-bench-actions-backlog-"))
    try:
        rounds = [_one_round(bootstrap, folder, n) for n in range(REPEATS)]
    finally:
        stop_broker()
    alone = [a for a, _ in rounds]
    behind = [b for _, b in rounds]
    median_alone = statistics.median(alone)
    median_behind = statistics.median(b["behind_s"] for b in behind)
    return {"junk": JUNK, "repeats": REPEATS,
            "alone_s": round(median_alone, 2), "behind_s": round(median_behind, 2),
            "ratio": round(median_behind / median_alone, 2),
            "each_alone_s": [round(a, 2) for a in alone],
            "each_behind_s": [round(b["behind_s"], 2) for b in behind],
            "junk_restarts_before_the_hang": [b["junk_restarts_before"] for b in behind],
            "junk_done_s": [round(b["junk_done_s"], 2) for b in behind],
            "capture": "default policy: 2 rounds 2 s apart, 10 s deadline per round",
            "target_behind_s": TARGET_S, "ok": median_behind <= TARGET_S}


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
