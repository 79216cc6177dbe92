"""Issue 23 point 5: a three-broker KRaft cluster loses a broker (SIGKILL of its JVM) in the
middle of a 2-rank torchrun job whose rank 1 crashes: no event is lost, no action is taken
twice, the crash is still found and acted on, and the worker is caught up once the broker is
back. Its own cluster (own ports and data), never the session broker; about 1.5 minutes.
The scenario is tests/broker_loss_scenario.py (bench/bench_broker_loss.py runs it too)."""
from __future__ import annotations

import time
import uuid

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.broker]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from trainguard.broker import free_port, local_cluster

    ports = set()
    while len(ports) < 3:
        ports.add(free_port())
    cluster = local_cluster(brokers=3, data=tmp_path_factory.mktemp("cluster"),
                            ports=sorted(ports))
    try:
        cluster.start(log=lambda m: None)   # stops what it launched if it fails
        yield cluster
    finally:
        cluster.stop(grace=10)


def test_cluster_topics_are_replicated(cluster):
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, ConfigResource

    from trainguard.config import Config, Topics
    from trainguard.topics import TopicPlan, create_topics

    config = Config(bootstrap=cluster.bootstrap, topics=Topics(prefix=f"r{uuid.uuid4().hex[:8]}"))
    create_topics(config, TopicPlan(telemetry_partitions=2, other_partitions=1))
    admin = AdminClient(config.kafka())
    # create_topics saw the topics on one broker; the one this client asks may learn of
    # them a moment later (KRaft brokers follow the controller's metadata log)
    deadline = time.monotonic() + 30
    while (meta := admin.list_topics(timeout=10).topics.get(config.topics.telemetry)) is None \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert meta is not None, f"{config.topics.telemetry} not listed 30 s after its creation"
    assert {len(p.replicas) for p in meta.partitions.values()} == {3}
    resource = ConfigResource(ConfigResource.Type.TOPIC, config.topics.telemetry)
    while True:           # ... and the broker asked for its configs, later still
        try:
            conf = admin.describe_configs([resource])[resource].result(timeout=10)
            break
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART or \
                    time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert conf["min.insync.replicas"].value == "2"
    assert cluster.answering() == [1, 2, 3]
    assert all(": running" in line for line in cluster.status())


def test_a_broker_dies_mid_run(cluster, tmp_path):
    from broker_loss_scenario import broker_loss_run, leaders

    from trainguard.config import Config, Topics
    from trainguard.topics import TopicPlan, create_topics

    config = Config(bootstrap=cluster.bootstrap, topics=Topics(prefix=f"l{uuid.uuid4().hex[:8]}"))
    create_topics(config, TopicPlan(telemetry_partitions=4, other_partitions=2))
    # the victim: the broker that leads the most of this test's partitions
    deadline = time.monotonic() + 30      # topics just created: their leaders come shortly
    while not (lead := leaders(config, config.topics.prefix)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert lead, "no leader known for the test's topics 30 s after creating them"
    victim = cluster.node(max(sorted(lead), key=lambda node: lead[node]))
    r = broker_loss_run(tmp_path, config, victim, replicas=3)
    logs = {k: r.pop(k) for k in ("job_log", "worker_log", "actions_log")}
    print(r)
    context = f"{r}\n" + "\n".join(f"--- {k}\n{v}" for k, v in logs.items())
    assert r["job_exit_code"] == 0, context
    # the fault was found and acted on, once
    assert r["crash_anomalies"], context
    assert r["restarts_planned"] >= 1 and r["restarts_per_incident"] == 1, context
    assert r["duplicate_action_records"] == 0, context
    assert r["launches"] == 2, context           # one restart, not one per dead rank
    assert r["acted_while_down"], context
    # the worker did not say it reads the partitions the dead broker led, until they had
    # a leader again (streams/partition_leaders.py)
    # (counted: the gauge, polled, missed the 3 s in CI ci76)
    if r["victim_led_telemetry"] and (r["failover_s"] or 0) >= 1.0:
        assert r["partitions_unreadable_total"] >= 1, context
    # no event lost once the cluster failed over, none lost unsaid, none written twice
    assert r["events_sent_rank0_steps"] > 0, context
    assert r["rank0_steps_missing"] <= r["rank0_undelivered_said"], context
    if r["crash_after_failover_s"] is not None and r["crash_after_failover_s"] > 0:
        assert r["rank0_steps_missing"] == 0, context
    else:  # the crash came inside the fail-over window: what rank 0 lost is said
        print("crash inside the fail-over window: rank 0 lost", r["rank0_steps_missing"])
    # telemetry is acks=all but not idempotent (collectors/producer.py): a retry after the
    # fail-over may write a step twice, which the detectors take as at-least-once delivery
    print("duplicate telemetry records:", r["duplicate_telemetry_records"],
          "extra rank-0 steps:", r["rank0_steps_extra"])
    assert r["max_dropped_reported"] == 0, context
    assert r["last_step_seen"] == 39, context
    # the worker read every telemetry message, and caught up once the broker was back
    assert r["worker_events_in"] >= r["telemetry_in_topic"] > 0, context
    assert r["worker_consumer_lag"] == 0, context
    assert "worker_caught_up_s" in r and "isr_full_s" in r, context
