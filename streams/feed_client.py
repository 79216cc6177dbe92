"""What the worker's side readers of other topics share (the config topic's overrides, the
action service's false alarms): a producer for what they write back, counters, closing."""
from __future__ import annotations

__all__ = ["FeedClient"]


class FeedClient:
    """Base of a feed that owns ``self.consumer``, ``self.producer`` and ``self.metrics``."""

    consumer = None
    producer = None
    metrics = None

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
