"""A broker killed (SIGKILL) in the middle of a 2-rank torchrun job whose rank 1 crashes,
with ``trainguard worker`` and ``trainguard actions`` running (tests/broker_loss_scenario.py):
on a three-broker cluster (replication factor 3, ``min.insync.replicas`` 2, idempotent
``acks=all`` producers) against a single broker in the same run, whose death is an outage.

Figures per set-up: rank 0's steps sent (its step log) and seen on the telemetry topic, the
job's telemetry events, duplicates, the largest ``dropped`` a rank reported, what the worker
read against what the topic holds, the crash anomalies, the actions taken and their duplicate
records, and, after the broker returned, the seconds until every partition had its replicas
in sync again (``isr_full_s``) and until the worker had read every telemetry message
(``worker_caught_up_s``). Each set-up brings its own brokers (own ports and data folders)."""
from __future__ import annotations

import sys
import tempfile
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

KEEP = ("replicas", "down_s", "fault_while_down", "acted_while_down", "victim_led_partitions",
        "partitions", "events_sent_rank0_steps", "events_seen_rank0_steps",
        "rank0_steps_missing", "rank0_steps_extra", "telemetry_events_of_job",
        "duplicate_telemetry_records", "max_dropped_reported", "telemetry_in_topic",
        "worker_events_in", "worker_consumer_lag", "crash_anomalies", "anomalies",
        "actions_taken", "action_records", "duplicate_action_records", "restarts_planned",
        "restarts_per_incident", "launches", "last_step_seen", "job_exit_code", "isr_full_s",
        "worker_caught_up_s", "wall_s")


def _scenario(folder: Path, brokers: int) -> dict:
    from broker_loss_scenario import broker_loss_run, leaders

    from trainguard.broker import free_port, local_broker, local_cluster
    from trainguard.config import Config, Topics
    from trainguard.topics import TopicPlan, create_topics

    if brokers > 1:
        ports = set()
        while len(ports) < brokers:
            ports.add(free_port())
        kafka = local_cluster(brokers=brokers, data=folder / "cluster", ports=sorted(ports))
    else:
        kafka = local_broker(port=free_port(), data=folder / "broker")
    try:
        kafka.start(log=lambda m: None)
        config = Config(bootstrap=kafka.bootstrap,
                        topics=Topics(prefix=f"b{uuid.uuid4().hex[:8]}"))
        create_topics(config, TopicPlan(telemetry_partitions=4, other_partitions=2))
        if brokers > 1:
            lead = leaders(config, config.topics.prefix)
            victim = kafka.node(max(sorted(lead), key=lambda node: lead[node]))
        else:
            victim = kafka
        result = broker_loss_run(folder / "run", config, victim, replicas=min(brokers, 3))
    finally:
        kafka.stop(grace=10)
    out = {k: result.get(k) for k in KEEP}
    out["crash_anomalies"] = [list(r) for r in out["crash_anomalies"] or []]
    out["actions_taken"] = [list(a) for a in out["actions_taken"] or []]
    return out


def run() -> dict:
    with tempfile.TemporaryDirectory(prefix="tg-bench-broker-loss-") as tmp:
        tmp = Path(tmp)
        cluster = _scenario(tmp / "three", 3)
        single = _scenario(tmp / "one", 1)
    return {"three_brokers": cluster, "single_broker": single,
            "lost_rank0_steps": {"three_brokers": cluster["rank0_steps_missing"],
                                 "single_broker": single["rank0_steps_missing"]}}
