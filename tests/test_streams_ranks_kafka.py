"""The rank side against the real broker: a rebalance while flow control holds partitions
paused. librdkafka keeps a partition paused when a rebalance gives it back to the same
consumer, while the rank side forgets the partitions it loses; it must read them again
(found by the two-worker benchmark, where one worker stopped for good with 32,000 records
left)."""
from __future__ import annotations

import time

from confluent_kafka import Consumer, Producer, TopicPartition

from trainguard import events as ev
from trainguard.detectors import RankStage
from trainguard.streams.metrics import Metrics
from trainguard.streams.processors import RankProcessor
from trainguard.streams.rank_side import RankService
from trainguard.streams.settings import WorkerSettings
from trainguard.streams.worker import WorkerTopics
from trainguard.topics import TopicPlan, create_topics

PARTITIONS = 4            # the kafka_config fixture's telemetry topic
RANKS, STEPS = 24, 120


def _topics(config, settings) -> WorkerTopics:
    return WorkerTopics(telemetry=config.topics.telemetry, anomalies=config.topics.anomalies,
                        deadletter=config.topics.deadletter, summaries=settings.summaries_topic,
                        rank_state=settings.rank_state_topic)


def _backlog(config) -> int:
    """Steps of every rank, rank r in partition r % PARTITIONS."""
    producer = Producer(config.kafka(**{"linger.ms": 20}))
    producer.list_topics(config.topics.telemetry, timeout=10)     # learn the partitions
    n = 0
    for r in range(RANKS):
        for s in range(STEPS):
            e = ev.Step(job="j", ts=1000.0 + s, node=f"n{r % PARTITIONS}", rank=r, step=s,
                        step_time=1.0)
            producer.produce(config.topics.telemetry, ev.encode(e), f"j/{r}".encode(),
                             partition=r % PARTITIONS)
            n += 1
    producer.flush(30)
    return n


def test_partitions_paused_at_a_rebalance_are_read_again(kafka_config):
    settings = WorkerSettings(prefix=kafka_config.topics.prefix, worker_id="w",
                              snapshot_interval_s=3600.0, batch_max=200)
    topics = _topics(kafka_config, settings)
    create_topics(kafka_config, TopicPlan(telemetry_partitions=PARTITIONS, other_partitions=2),
                  extra={topics.summaries: 1, topics.rank_state: 1})
    n = _backlog(kafka_config)
    metrics = Metrics()
    svc = RankService(kafka=kafka_config.kafka(**{"max.partition.fetch.bytes": 4096}),
                      settings=settings, topics=topics, processor=RankProcessor(RankStage),
                      metrics=metrics, state_partitions=1)
    svc.connect()
    other = None
    try:
        deadline = time.monotonic() + 60
        while not metrics.counters["events_in"] and time.monotonic() < deadline:
            svc.poll_once(0.2)
        # Flow control's state at its most extreme: every partition paused as too far ahead.
        parts = [TopicPartition(topics.telemetry, p) for p in range(PARTITIONS)]
        svc.consumer.pause(parts)
        svc.paused = set(range(PARTITIONS))
        # A second member joins: every partition is revoked, and some come back.
        other = Consumer(kafka_config.kafka(**{"group.id": settings.rank_group,
                                               "enable.auto.commit": False,
                                               "auto.offset.reset": "latest"}))
        other.subscribe([topics.telemetry])
        deadline = time.monotonic() + 60
        mine: set = set()
        while time.monotonic() < deadline:
            other.consume(100, 0.1)              # stays in the group, applies nothing
            svc.poll_once(0.1)
            mine = {tp.partition for tp in svc.consumer.assignment()}
            if mine and len(mine) < PARTITIONS and svc.lag() == 0 and not len(svc.aligner):
                break
        assert mine and len(mine) < PARTITIONS, "the rebalance did not happen"
        assert svc.lag() == 0, f"{svc.lag()} records left on partitions {sorted(mine)}"
        assert metrics.counters["events_in"] >= n * len(mine) // PARTITIONS
    finally:
        if other is not None:
            other.close()
        svc.consumer.close()
