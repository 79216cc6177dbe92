"""What the worker's side readers of other topics share (the config topic's overrides, the
action service's false alarms, people's feedback): their clients, a polling loop, a producer
for what they write back, counters, closing."""
from __future__ import annotations

import time
import uuid

__all__ = ["FeedClient"]

MAX_PER_POLL = 500


class FeedClient:
    """Base of a feed that reads one topic (``TOPIC``, a :class:`~trainguard.config.Topics`
    attribute) from its newest record, as consumer group ``GROUP``-<random>, and hands each
    record to ``handle(key, value, partition, offset)``. ``processor`` is the job side's
    ``JobProcessor``; ``verifier`` a :class:`~trainguard.signing.Verifier`."""

    TOPIC = ""
    GROUP = ""
    consumer = None
    producer = None
    metrics = None

    def __init__(self, *, kafka: dict, topics, processor, verifier, metrics=None,
                 clock=time.time, consumer_factory=None, producer_factory=None):
        self.kafka = kafka
        self.topics = topics
        self.processor = processor
        self.verifier = verifier
        self.metrics = metrics
        self.clock = clock
        self.consumer_factory = consumer_factory
        self.producer_factory = producer_factory
        self.consumer = None
        self.producer = None
        self.learned = 0
        self.refused = 0

    def _clients(self, offset_reset: str = "latest"):
        """The producer (set) and a new consumer (returned, not yet subscribed)."""
        from confluent_kafka import Consumer, Producer

        Consumer = self.consumer_factory or Consumer
        Producer = self.producer_factory or Producer
        self.producer = Producer({**self.kafka, "linger.ms": 5, "acks": "all",
                                  "enable.idempotence": True})
        return Consumer({**self.kafka, "group.id": f"{self.GROUP}-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "auto.offset.reset": offset_reset})

    def start(self) -> None:
        self.consumer = self._clients()
        self.consumer.subscribe([getattr(self.topics, self.TOPIC)])

    def poll(self) -> int:
        """Handle what came since (without waiting); returns the records read."""
        if self.consumer is None:
            return 0
        msgs = self.consumer.consume(MAX_PER_POLL, timeout=0)
        for msg in msgs:
            if not msg.error():
                self.handle(msg.key(), msg.value(), msg.partition(), msg.offset())
        self.producer.poll(0)
        return len(msgs)

    def handle(self, key, value, partition: int, offset: int):
        raise NotImplementedError

    def _produce(self, topic, key, value) -> None:
        try:
            self.producer.produce(topic, value, key)
        except BufferError:
            self.producer.poll(1.0)
            self.producer.produce(topic, value, key)

    def _count(self, name: str) -> None:
        if self.metrics is not None:
            self.metrics.inc(name)

    def close(self) -> None:
        if self.producer is not None:
            self.producer.flush(5)
        if self.consumer is not None:
            self.consumer.close()
            self.consumer = None
