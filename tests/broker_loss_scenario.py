"""A broker killed in the middle of a run with a real fault in it (issue 23 point 5), for
tests/test_broker_loss.py and bench/bench_broker_loss.py.

:func:`broker_loss_run`: on the given Kafka (a 3-broker :class:`~trainguard.broker.LocalCluster`
or a single broker), ``trainguard worker`` and ``trainguard actions`` (the
:class:`~actions_harness.Deployment`), and a 2-rank torchrun job (examples/train.py, gloo)
under ``trainguard run`` whose rank 1 is SIGKILLed by chaos at step ``crash_at``. Once the
job has reported ``kill_at_step`` steps, the ``victim`` broker's JVM is SIGKILLed; it stays
dead until the service has acted on the crash (at least ``min_down_s``) or for ``max_down_s``,
then is started again. Returns what was sent and seen, the actions and their duplicates, and
the times to catch up after the broker returned.

The crash comes several seconds after the kill, once the cluster has failed over (a dead
broker is fenced after 3 s; 4-5 s when it was the active controller): a rank that exits
inside that window flushes for only 3 s (the collector's ``flush_timeout``) and can lose what
it sent since the broker died (measured: 7 of rank 0's steps with the crash 3 s after the
kill; all 22 with two test lanes loading the machine). docs/OPERATIONS.md, "Three brokers",
says so, and the rank says how many it lost. ``failover_s`` is when the metadata first gave
every partition a leader other than the victim, ``crash_after_failover_s`` how long after that
the crash came.
"""
from __future__ import annotations

import collections
import json
import re
import time
import urllib.request
from pathlib import Path

from actions_harness import Collector, Deployment, read_log, wait_for

FAST_CAPTURE = {"rounds": 1, "interval_s": 0.5, "deadline_s": 3.0}
JOB = "bloss"


def topic_totals(config, prefix: str) -> dict[str, int]:
    """Messages (high minus low watermark) in each topic whose name starts with ``prefix``."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(config.kafka(**{"group.id": "trainguard-unused-watermarks"}))
    try:
        totals = {}
        for name, meta in consumer.list_topics(timeout=10).topics.items():
            if not name.startswith(prefix):
                continue
            totals[name] = 0
            for p in meta.partitions:
                low, high = consumer.get_watermark_offsets(TopicPartition(name, p), timeout=10)
                totals[name] += high - low
        return totals
    finally:
        consumer.close()


def under_replicated(config, prefix: str, replicas: int) -> int:
    """Partitions of the ``prefix`` topics whose in-sync replicas are fewer than ``replicas``."""
    from confluent_kafka.admin import AdminClient

    topics = AdminClient(config.kafka()).list_topics(timeout=10).topics
    return sum(1 for name, meta in topics.items() if name.startswith(prefix)
               for p in meta.partitions.values() if len(p.isrs) < replicas)


def leaders(config, prefix: str) -> collections.Counter:
    """How many partitions of the ``prefix`` topics each broker leads (a partition with no
    leader elected yet, -1, is left out)."""
    from confluent_kafka.admin import AdminClient

    topics = AdminClient(config.kafka()).list_topics(timeout=10).topics
    return collections.Counter(p.leader for name, meta in topics.items()
                               if name.startswith(prefix) for p in meta.partitions.values()
                               if p.leader >= 0)


def _failed_over(config, prefix: str, victim: int) -> bool:
    """Every partition of the ``prefix`` topics has a leader, and none is ``victim``; False
    while the metadata cannot be read."""
    from confluent_kafka.admin import AdminClient

    try:
        topics = AdminClient(config.kafka()).list_topics(timeout=2).topics
    except Exception:
        return False
    return all(p.leader >= 0 and p.leader != victim for name, meta in topics.items()
               if name.startswith(prefix) for p in meta.partitions.values())


def worker_metrics(port: int) -> dict[str, float]:
    """The worker's counters and gauges by metric name, summed over their labels; {} when it
    does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as r:
            text = r.read().decode()
    except Exception:
        return {}
    values: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if match and not line.startswith("#"):
            try:
                values[match.group(1)] += float(match.group(3))
            except ValueError:
                pass
    return dict(values)


def metric(values: dict, stem: str) -> float | None:
    """The value of the first metric whose name starts with ``trainguard_<stem>`` (the names
    gain units over time: ``events_in_total``, ``consumer_lag_messages``)."""
    for name in sorted(values):
        if name.startswith(f"trainguard_{stem}") and not name.endswith(("_created",)):
            return values[name]
    return None


def _web_port(deployment: Deployment) -> int:
    for name, proc in deployment.procs.procs:
        if name == "worker":
            args = list(proc.args)
            for flag in ("--metrics-port", "--web-port"):
                if flag in args:
                    return int(args[args.index(flag) + 1])
    raise AssertionError("the worker's metrics port is not among its arguments")


def broker_loss_run(folder: Path, config, victim, *, replicas: int, steps: int = 40,
                    crash_at: int = 26, kill_at_step: int = 4, min_down_s: float = 8.0,
                    max_down_s: float = 25.0, step_sleep: float = 0.2) -> dict:
    """Run the scenario on ``config`` (topics already created); ``victim`` is the broker to
    kill (a :class:`~trainguard.broker.LocalBroker`). See the module docstring."""
    folder = Path(folder)
    topics = config.topics
    collectors = {name: Collector(config, getattr(topics, name))
                  for name in ("telemetry", "anomalies", "actions")}
    step_log = folder / "steps-rank0.jsonl"
    result: dict = {"replicas": replicas}
    began = time.monotonic()
    try:
        with Deployment(folder / "d", config, limit_s=300) as d:
            d.start(policy={"capture": FAST_CAPTURE}, agent=False)
            port = _web_port(d)
            result["services_ready_s"] = round(time.monotonic() - began, 1)
            run = d.supervise(JOB, d.torchrun(2, steps=steps, checkpoint_every=5,
                                              step_sleep=step_sleep, job=JOB,
                                              extra=["--step-log", str(step_log)]),
                              chaos=f"crash@step={crash_at},rank=1", max_restarts=2)
            collectors["telemetry"].wait(
                lambda es: [e for e in es if e.type == "step" and e.job == JOB
                            and e.step >= kill_at_step], timeout=120,
                what=f"step {kill_at_step} of the job")
            lead = leaders(config, topics.prefix)
            result["victim_led_partitions"] = lead.get(victim.node_id, 0)
            result["victim_led_telemetry"] = leaders(config, topics.telemetry).get(
                victim.node_id, 0)
            result["partitions"] = sum(lead.values())
            killed = time.time()
            result["victim_pid"] = victim.kill()

            def acted(events):
                return [a for a in events if a.job == JOB and a.action == "restart"]

            failover = None  # when every partition first has a leader other than the victim
            while True:
                down = time.time() - killed
                if failover is None and _failed_over(config, topics.prefix, victim.node_id):
                    failover = time.time()
                if (down >= min_down_s and acted(collectors["actions"].drain(0.3))) \
                        or down >= max_down_s:
                    break
                collectors["actions"].drain(0.3)
            crash = [c for c in d.chaos_log(JOB) if c.get("kind") == "crash"]
            result["fault_while_down"] = bool(crash and crash[0]["injected_ts"] > killed)
            result["failover_s"] = round(failover - killed, 1) if failover else None
            result["crash_after_failover_s"] = round(crash[0]["injected_ts"] - failover, 1) \
                if crash and failover else None
            result["acted_while_down"] = bool(acted(collectors["actions"].events))
            restarts = sorted(a.ts for a in acted(collectors["actions"].events))
            result["crash_to_restart_s"] = round(restarts[0] - crash[0]["injected_ts"], 1) \
                if crash and restarts else None
            victim.start(log=lambda m: None)
            returned = time.time()
            result["down_s"] = round(returned - killed, 1)

            # catching up: the returned broker back in every ISR, the worker's lag at zero
            caught = {}
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and len(caught) < 2:
                if "isr_full_s" not in caught and \
                        under_replicated(config, topics.prefix, replicas) == 0:
                    caught["isr_full_s"] = round(time.time() - returned, 2)
                values = worker_metrics(port)
                lag = metric(values, "consumer_lag")
                seen = metric(values, "events_in")
                total = topic_totals(config, topics.telemetry)[topics.telemetry]
                if "worker_caught_up_s" not in caught and lag == 0 and seen is not None \
                        and seen >= total:
                    caught["worker_caught_up_s"] = round(time.time() - returned, 2)
                time.sleep(0.25)
            result.update(caught)

            wait_for(lambda: run.poll() is not None, timeout=150, interval=0.5,
                     what="the job's end")
            result["job_exit_code"] = run.returncode
            # the last events through the pipeline: the worker reads every one of them
            totals = {}

            def drained():
                totals.update(topic_totals(config, topics.telemetry))
                values = worker_metrics(port)
                seen = metric(values, "events_in")
                return seen is not None and seen >= totals[topics.telemetry] \
                    and metric(values, "consumer_lag") == 0 and values

            try:
                values = wait_for(drained, timeout=30, interval=0.5, what="the worker's catch-up")
            except AssertionError:
                values = worker_metrics(port)
            result["telemetry_in_topic"] = totals.get(topics.telemetry)
            result["worker_events_in"] = metric(values, "events_in")
            result["partitions_unreadable_total"] = metric(values, "partitions_unreadable")
            result["worker_consumer_lag"] = metric(values, "consumer_lag")
            job_log = d.procs.log(f"run-{JOB}")
            result["rank0_undelivered_said"] = sum(map(int, re.findall(
                rf"rank 0 of job {JOB}: (\d+) telemetry events were not delivered", job_log)))
            result["job_log"] = job_log[-1500:]
            result["worker_log"] = d.procs.log("worker")[-1500:]
            result["actions_log"] = d.procs.log("actions")[-1500:]
    finally:
        for c in collectors.values():
            c.drain(1.0)
            c.close()
    result.update(_tally(collectors, step_log))
    result["wall_s"] = round(time.monotonic() - began, 1)
    return result


def _tally(collectors, step_log: Path) -> dict:
    telemetry = [e for e in collectors["telemetry"].events if e.job == JOB]
    steps = [e for e in telemetry if e.type == "step"]
    # rank 0's step log: the steps it completed, each launch's (a relaunch repeats a few)
    logged = collections.Counter(line["step"] for line in read_log(step_log))
    seen0 = collections.Counter(e.step for e in steps if e.rank == 0)
    missing = sum((logged - seen0).values())
    extra = sum((seen0 - logged).values())
    beats = [e for e in telemetry if e.type == "heartbeat"]
    keys = collections.Counter((e.type, e.rank, getattr(e, "step", None), e.ts)
                               for e in telemetry)
    actions = [a for a in collectors["actions"].events if a.job == JOB]
    records = collections.Counter(json.dumps({"a": a.action, "s": a.status, "ts": a.ts,
                                              "x": a.extra}, sort_keys=True, default=str)
                                  for a in actions)
    restarts = [a for a in actions if a.action == "restart" and a.status == "planned"]
    incidents = collections.Counter(a.extra.get("action_id") for a in restarts)
    anomalies = [a for a in collectors["anomalies"].events
                 if a.job == JOB and a.type == "anomaly"]
    launches = [e for e in telemetry if e.type == "lifecycle" and e.rank is None
                and e.event == "start"]
    return {
        "events_sent_rank0_steps": sum(logged.values()),
        "events_seen_rank0_steps": sum(seen0.values()),
        "rank0_steps_missing": missing,
        "rank0_steps_extra": extra,
        "telemetry_events_of_job": len(telemetry),
        "duplicate_telemetry_records": sum(n - 1 for n in keys.values() if n > 1),
        "max_dropped_reported": max((getattr(b, "dropped", 0) or 0 for b in beats), default=0),
        "crash_anomalies": sorted({tuple(a.ranks) for a in anomalies if a.kind == "crash"}),
        "anomalies": len(anomalies),
        "anomaly_kinds": sorted({(a.kind, tuple(a.ranks)) for a in anomalies}),
        "actions_taken": sorted({(a.action, a.status) for a in actions}),
        "action_records": len(actions),
        "duplicate_action_records": sum(n - 1 for n in records.values() if n > 1),
        "restarts_planned": len(restarts),
        "restarts_per_incident": max(incidents.values(), default=0),
        "launches": len(launches),
        "last_step_seen": max((e.step for e in steps), default=None),
    }
