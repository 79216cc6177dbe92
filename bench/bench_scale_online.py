"""Issue 21: the four faults of a large job through the real broker, with one and two workers.

The recording is the scenario library's large job (``large_job`` in tests/scenario_library.py:
TP 8 x PP 4 x DP, 8 ranks per machine, 1 s steps) of ``RANKS`` ranks with issue 21's four
faults: a slow rank, a rank hung in its data loader (trainguard restarts the job), a lost
machine (restarted onto a spare) and a rank whose loss goes NaN. Its time stamps are moved so
that it ends a minute ago, and it is produced to the telemetry topic, each message stamped with
its event's time, keyed as the collectors key them, as fast as the producer goes (the 4,096-rank
recording covers 126 s of the job, 2,186 events/s; the workers drain it 6 to 8 times as fast).

For one worker, then two workers with one ``--id`` (each time on fresh topics, the workers
started and owning their partitions first), the bench measures:

- ``events_per_s``: the events over the seconds from the first produce call until both sides
  of every worker went through all of them, and ``events_per_worker_cpu_s``;
- ``faults``: each fault's incident as the workers published it on the anomalies topic (the
  latest version of each incident), scored as the library scores ``trainguard analyze``
  (tests/scenario_scoring.py): found, localized exactly, its latency;
- ``false_incidents``: the incidents that match no fault;
- ``same_as_offline``: whether the incidents' kinds and ranks are those of
  ``trainguard analyze`` on the same recording (``offline``);
- ``job_side``: the workers' job-side gauges at the end (summed): step records that came
  after their step closed (``late_step_records``), items still held, items released
  before the partition they waited for reached them, partitions said to be behind.

Uses ``$TRAINGUARD_BOOTSTRAP`` or starts its own broker; ``TG_SCALE_ONLINE_RANKS`` (default
4,096, a multiple of 32) for another size. ``python bench/run.py scale_online --json``.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import bench_stream_throughput as st  # noqa: E402

RANKS = int(os.environ.get("TG_SCALE_ONLINE_RANKS", "4096"))
PARTITIONS = st.PARTITIONS      # the telemetry topic's, as stream_throughput makes it
#: seconds of quiet after the drain for the last advances and incidents
SETTLE_S = 8.0


def shifted(events, shift: float) -> list:
    """``events`` with every time stamp moved by ``shift`` seconds."""
    out = []
    for e in events:
        if e.TYPE == "heartbeat" and e.phase_since is not None:
            out.append(e.replace(ts=e.ts + shift, phase_since=e.phase_since + shift))
        else:
            out.append(e.replace(ts=e.ts + shift))
    return out


def messages(events) -> list:
    """``(key, value, ts_ms)`` as the collectors send them."""
    from trainguard import events as ev
    from trainguard.detectors.parallel import event_key

    return [(event_key(e) or e.job.encode(), ev.encode(e), int(e.ts * 1000))
            for e in events]     # trainguard run keys its own lifecycle events by job


def incidents(config) -> list[dict]:
    """The latest version of each incident on the anomalies topic, as ``analyze`` dicts."""
    from confluent_kafka import Consumer, TopicPartition

    from trainguard import events as ev

    consumer = Consumer(config.kafka(**{"group.id": uuid.uuid4().hex}))
    meta = consumer.list_topics(timeout=10).topics[config.topics.anomalies]
    consumer.assign([TopicPartition(config.topics.anomalies, p, 0) for p in meta.partitions])
    latest: dict = {}
    idle = 0
    while idle < 3:
        batch = consumer.consume(1000, 1.0)
        idle = 0 if batch else idle + 1
        for m in batch:
            if m.error() or not m.value():
                continue
            e = ev.decode(m.value())
            if e.TYPE == "incident":
                latest[e.id] = ev.to_dict(e)
    consumer.close()
    return list(latest.values())


def _scored(found: list, rec: dict) -> dict:
    from scenario_scoring import score

    result = score(found, rec["truth"], rec["step_ends"])
    return {"faults": [{k: r[k] for k in ("kind", "found", "exact", "latency_s",
                                          "latency_steps")} for r in result["results"]],
            "false_incidents": [(i["kind"], i["ranks"][:8]) for i in
                                result["false_incidents"]],
            "all_found_exactly": all(r["found"] and r["exact"] for r in result["results"])
            and not result["false_incidents"]}


def _identity(found: list) -> list:
    return sorted((i["kind"], tuple(i["ranks"]), tuple(i["nodes"])) for i in found)


def one_run(bootstrap: str, workers: int, msgs: list, rec: dict, offline: list) -> dict:
    config = st._fresh_config(bootstrap)
    tmp = Path(tempfile.mkdtemp(prefix="tg-scale-online-"))
    running = [st.Worker(config, "scale", tmp) for _ in range(workers)]
    try:
        st._wait_ready(running, config, PARTITIONS)
        cpu = [w.cpu_s() for w in running]
        began = time.monotonic()
        st._produce(config, msgs)
        done = st._drain(running, len(msgs))
        cpu = [w.cpu_s() - c for w, c in zip(running, cpu)]
        time.sleep(SETTLE_S)
        found = incidents(config)
        seen = [w.metrics() for w in running]
    finally:
        for w in running:
            w.stop()
    out = {"workers": workers, "events": len(msgs),
           "events_per_s": int(len(msgs) / (done - began)),
           "events_per_worker_cpu_s": int(len(msgs) / sum(cpu)),
           "worker_cpu_s": [round(c, 1) for c in cpu], **_scored(found, rec),
           # the job side: step records that came after their step closed, items held for
           # a partition behind, and those that went on before it reached them
           "job_side": {name: int(sum(m.get(f"trainguard_{name}", 0) for m in seen))
                        for name in ("late_step_records", "held_records",
                                     "released_early_records", "behind_partitions")}}
    out["same_as_offline"] = _identity(found) == _identity(offline)
    if not out["same_as_offline"]:
        out["incidents"] = [(i["kind"], i["ranks"][:8], i["summary"][:160]) for i in found]
    return out


def run() -> dict:
    from scenario_library import large_job
    from scenarios import recording

    from trainguard.detectors.offline import analyze_events

    rec = recording(large_job(RANKS // 32))
    shift = time.time() - 60.0 - rec["events"][-1].ts
    events = shifted(rec["events"], shift)
    rec = {"truth": [t.__class__(**{**t.__dict__, "onset_ts": t.onset_ts + shift})
                     for t in rec["truth"]],
           "step_ends": [t + shift for t in rec["step_ends"]]}
    engine, _ = analyze_events(events)
    offline = engine.incidents()
    msgs = messages(events)
    del events, engine
    bootstrap = os.environ.get("TRAINGUARD_BOOTSTRAP")
    broker = None
    if not bootstrap:
        from trainguard.broker import free_port, local_broker

        broker = local_broker(port=free_port(),
                              data=Path(tempfile.mkdtemp(prefix="tg-scale-broker-")))
        broker.start(log=lambda m: None)
        bootstrap = broker.bootstrap
    try:
        runs = [one_run(bootstrap, n, msgs, rec, offline) for n in (1, 2)]
    finally:
        if broker is not None:
            broker.stop()
    return {"ranks": RANKS, "partitions": PARTITIONS, "events": len(msgs),
            "offline": _scored(offline, rec), "runs": runs}
