"""The action service's Kafka ends: :class:`KafkaSource` reads one topic's events from a
point in time without a consumer group, :func:`read_back` replays a topic's recent past,
:class:`KafkaRecorder` writes events keyed by job (signed when a key is given), and
:func:`check_kafka` says in one line what is missing before the service starts."""
from __future__ import annotations

import logging
import os
import time

from trainguard import events as ev
from trainguard.errors import UserError
from trainguard.logs import service_logger
from trainguard.signing import sign

__all__ = ["KafkaSource", "KafkaRecorder", "read_back", "check_kafka", "quiet_logger", "log"]


#: a line of the action service (trainguard.logs; before its set-up, on stderr)
log = service_logger("trainguard.actions", "trainguard actions")


def quiet_logger() -> logging.Logger:
    """Where librdkafka's own log lines go: nowhere by default (an unreachable broker would
    print a line every few milliseconds); trainguard says what matters itself."""
    logger = logging.getLogger("trainguard.actions.kafka")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
        logger.propagate = False
    return logger


def check_kafka(config, topics: list[str], timeout: float = 10.0) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(config.kafka())
    try:
        existing = admin.list_topics(timeout=timeout).topics
    except Exception:
        raise UserError(f"cannot reach Kafka at {config.bootstrap}; start one with "
                        "`trainguard broker start` or set --bootstrap") from None
    missing = [t for t in topics if t not in existing]
    if missing:
        raise UserError(f"topics {missing} do not exist on {config.bootstrap}; create them "
                        f"with `trainguard topics create --prefix {config.topics.prefix}`")


def _partitions(consumer, topic: str, timeout: float = 10.0, wait_s: float = 10.0) -> list[int]:
    """The topic's partitions; [] when it has none ``wait_s`` seconds on (in a cluster, the
    broker asked may learn of a topic just created a moment after the one that created it)."""
    deadline = time.monotonic() + wait_s
    while True:
        meta = consumer.list_topics(topic, timeout=timeout).topics.get(topic)
        if meta and meta.partitions and not meta.error:
            return sorted(meta.partitions)
        if time.monotonic() >= deadline:
            return []
        time.sleep(0.2)


def _retrying(call, seconds: float = 15.0):
    """``call()``, retried while the broker answers with a passing error (a new topic's
    partitions without a leader yet, ...)."""
    from confluent_kafka import KafkaException

    deadline = time.monotonic() + seconds
    while True:
        try:
            return call()
        except KafkaException:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)


def _start_offsets(consumer, topic: str, since: float | None) -> list:
    """Per partition: the first offset at or after ``since`` (its end where there is none),
    or, with ``since`` None, the current end."""
    from confluent_kafka import TopicPartition

    parts = _retrying(lambda: _partitions(consumer, topic))
    if since is None:
        return [TopicPartition(topic, p, _retrying(lambda p=p: consumer.get_watermark_offsets(
            TopicPartition(topic, p), timeout=10)[1])) for p in parts]
    wanted = [TopicPartition(topic, p, int(since * 1000)) for p in parts]
    return _retrying(lambda: consumer.offsets_for_times(wanted, timeout=10)) if wanted else []


class KafkaSource:
    """Decoded events of one topic, from all its partitions, read without a consumer group,
    starting at ``since`` (Unix time) or, with ``since`` None, at the current end."""

    def __init__(self, config, topic: str, since: float | None = None,
                 want: tuple[bytes, ...] | None = None):
        from confluent_kafka import Consumer

        self.topic = topic
        self.want = want
        self.invalid = 0
        self.consumer = Consumer(config.kafka(**{
            "group.id": f"trainguard-unused-{os.getpid()}", "enable.auto.commit": False,
            "enable.auto.offset.store": False, "auto.offset.reset": "earliest"}),
            logger=quiet_logger())
        # librdkafka's fetch.wait.max.ms (500) is kept: the broker answers a waiting fetch as
        # soon as a record arrives, so a shorter wait adds no speed, only idle fetches
        self.consumer.assign(_start_offsets(self.consumer, topic, since))

    def poll(self, timeout: float) -> ev.Event | None:
        msg = self.consumer.poll(timeout)
        if msg is None or msg.error():
            return None
        value = msg.value()
        if not value:  # an empty message (a tombstone, or a careless client): not an event
            self.invalid += 1
            return None
        if self.want and not any(w in value for w in self.want):
            return None
        try:
            return ev.decode(value)
        except ev.InvalidEvent:
            self.invalid += 1
            return None

    def close(self) -> None:
        self.consumer.close()


def read_back(config, topic: str, since: float, apply, timeout: float = 30.0,
              accept=None) -> int:
    """Feed every valid event of ``topic`` from ``since`` up to its current end to ``apply``
    (only those whose bytes ``accept`` approves, when given); returns how many."""
    from confluent_kafka import Consumer

    consumer = Consumer(config.kafka(**{"group.id": f"trainguard-readback-{os.getpid()}",
                                        "enable.auto.commit": False}), logger=quiet_logger())
    try:
        ends = {tp.partition: tp.offset for tp in _start_offsets(consumer, topic, None)}
        starts = _start_offsets(consumer, topic, since)
        todo = {tp.partition for tp in starts
                if tp.offset >= 0 and tp.offset < ends[tp.partition]}
        consumer.assign([tp for tp in starts if tp.partition in todo])
        count, deadline = 0, time.monotonic() + timeout
        while todo and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            try:
                if accept is None or accept(msg.value()):
                    apply(ev.decode(msg.value()))
                    count += 1
            except ev.InvalidEvent:
                pass
            if msg.offset() + 1 >= ends[msg.partition()]:
                todo.discard(msg.partition())
        return count
    finally:
        consumer.close()


class KafkaRecorder:
    """Writes events to a topic, keyed by job (so one job's records stay in order), signed
    with ``keys`` when given. With ``deferred``, :meth:`flush` only serves delivery reports:
    the records go out within the producer's ``linger.ms`` all the same, and whoever commits
    the consumer's offsets calls :meth:`flush_now` first (waiting for acks after every
    anomaly would make a burst of anomalies wait on the broker's round trips one by one)."""

    def __init__(self, producer, topic: str, flush_timeout: float = 10.0, keys=None,
                 deferred: bool = False):
        self.producer = producer
        self.topic = topic
        self.flush_timeout = flush_timeout
        self.keys = keys
        self.deferred = deferred

    def write(self, event: ev.Event) -> None:
        """Writes ``event``, signed with ``keys`` when given."""
        self.producer.produce(self.topic, key=event.job.encode(),
                              value=ev.encode(sign(event, self.keys)))
        self.producer.poll(0)

    def flush(self) -> None:
        if self.deferred:
            self.producer.poll(0)
        else:
            self.flush_now()

    def flush_now(self) -> int:
        """Wait for every record's delivery; returns how many are still unsent."""
        left = self.producer.flush(self.flush_timeout)
        if left:
            log(f"{left} record(s) to {self.topic} still unsent after "
                 f"{self.flush_timeout:g}s")
        return left
