"""``trainguard run``'s Kafka ends: :class:`OrderFeed` queues its job's orders from
``<prefix>.orders`` (each a :class:`Delivery`: the event and its bytes), and
:class:`OrderPublisher` writes its lifecycle, action records, acks and dead letters."""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

from trainguard import events as ev
from trainguard.logs import service_logger
from trainguard.signing import sign

__all__ = ["Delivery", "OrderFeed", "OrderPublisher", "log"]


#: a line of ``trainguard run`` (trainguard.logs; before its set-up, on stderr)
log = service_logger("trainguard.run", "trainguard run")


@dataclass(kw_only=True)
class Delivery:
    """One message of the orders topic: its decoded event and its bytes (the signature is
    checked over those), and where it was, for a dead-letter record."""

    event: ev.Event | None
    raw: bytes
    key: bytes | None = None
    topic: str = ""
    partition: int = -1
    offset: int = -1

    @classmethod
    def of(cls, event: ev.Event) -> "Delivery":
        return cls(event=event, raw=ev.encode(event), key=event.job.encode())


class OrderFeed(threading.Thread):
    """Reads ``<prefix>.orders`` from ``since`` in a daemon thread and queues the orders of
    one job (as :class:`Delivery`); keeps trying while Kafka is unreachable (training never
    waits). Messages that do not decode are left to the action service, which dead-letters
    them."""

    def __init__(self, config, job: str, since: float, log=log, retry_s: float = 5.0):
        super().__init__(name="trainguard-order-feed", daemon=True)
        self.config, self.job, self.since, self.log = config, job, since, log
        self.retry_s = retry_s
        self.queue: queue.Queue = queue.Queue(maxsize=10_000)
        self.stopped = threading.Event()
        self.ready = threading.Event()
        self.invalid = 0

    def run(self) -> None:
        from trainguard.actions.topic_io import KafkaSource

        topic = self.config.topics.orders
        source, warned = None, False
        while not self.stopped.is_set():
            if source is None:
                try:
                    source = KafkaSource(self.config, topic, since=self.since)
                    if not source.consumer.assignment():
                        source.close()
                        source = None
                        raise LookupError(f"topic {topic} does not exist; create it with "
                                          "`trainguard topics create`")
                    self.ready.set()
                except Exception as exc:
                    if not warned:
                        self.log(f"cannot read {topic} yet ({exc}); supervising locally, "
                                 "retrying")
                        warned = True
                    self.stopped.wait(self.retry_s)
                    continue
            msg = source.consumer.poll(0.2)
            if msg is None or msg.error() or msg.value() is None:
                continue
            try:
                event = ev.decode(msg.value())
            except ev.InvalidEvent:
                self.invalid += 1
                continue
            if isinstance(event, ev.Order) and event.job == self.job:
                delivery = Delivery(event=event, raw=msg.value(), key=msg.key(),
                                    topic=msg.topic(), partition=msg.partition(),
                                    offset=msg.offset())
                try:
                    self.queue.put_nowait(delivery)
                except queue.Full:
                    self.log(f"order {event.order_id}: dropped, {self.queue.maxsize} orders "
                             "are waiting")
        if source is not None:
            source.close()

    def poll(self, timeout: float):
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def stop(self) -> None:
        self.stopped.set()


class OrderPublisher:
    """Lifecycle to the telemetry topic, action records to the actions topic, acks to the
    orders topic (those two signed with ``keys``), refused orders to the dead-letter topic."""

    def __init__(self, config, keys=None):
        from confluent_kafka import Producer

        from trainguard.actions.topic_io import quiet_logger

        self.config = config
        self.keys = keys
        self.producer = Producer(config.kafka(**{
            "linger.ms": 5, "partitioner": "murmur2_random", "message.timeout.ms": 15000,
            "acks": "all", "enable.idempotence": True,   # lose none, write none twice
            "socket.timeout.ms": 5000}), logger=quiet_logger())

    def __call__(self, event: ev.Event) -> None:
        topics = self.config.topics
        if isinstance(event, (ev.Ack, ev.Action)):
            event = sign(event, self.keys)
        topic = topics.orders if isinstance(event, ev.Ack) else \
            topics.actions if isinstance(event, ev.Action) else topics.telemetry
        self.producer.produce(topic, key=event.job.encode(), value=ev.encode(event))
        self.producer.poll(0)
        if isinstance(event, (ev.Action, ev.Ack)):
            self.producer.flush(1.0)

    def deadletter(self, delivery: Delivery, reason: str) -> None:
        from trainguard.deadletter import deadletter_record

        self.producer.produce(self.config.topics.deadletter, key=delivery.key,
                              value=deadletter_record(
                                  reason=reason, topic=delivery.topic,
                                  partition=delivery.partition, offset=delivery.offset,
                                  key=delivery.key, raw=delivery.raw, ts=time.time()))
        self.producer.flush(1.0)

    def close(self) -> None:
        self.producer.flush(2.0)
