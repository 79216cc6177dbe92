"""A Kafka producer that cannot hurt the training loop.

:meth:`BackgroundProducer.produce` only appends to a bounded in-memory queue (a count and a
byte limit); when the queue is full it drops the record and counts it in ``dropped``. It never
touches the network, never blocks on it and never raises because of Kafka. One daemon thread
drains the queue: it encodes records (so JSON encoding stays off the training thread), hands
them to a ``confluent_kafka.Producer`` that it alone owns, and serves its callbacks.

The Kafka client is created lazily by that thread, after any fork. torchrun and DataLoader
workers fork; threads do not survive a fork and a librdkafka handle copied into a child is
unusable, so a forked child gets a fresh, empty queue and its own thread and client on its first
``produce`` (the parent's copied handle is left untouched: destroying it in the child would
wait for threads that do not exist there).

:meth:`close` sends what is queued and flushes for at most ``flush_timeout`` seconds;
whatever is still unsent then is counted as dropped.

librdkafka settings for telemetry (:data:`TELEMETRY_SETTINGS`; ``Config.client_settings``,
e.g. SASL, and the ``settings`` argument override them):

``linger.ms=50``
    batch messages for 50 ms: one request per batch rather than per event, at a latency far
    below the second-scale detection the detectors need.
``compression.type=lz4``
    telemetry JSON compresses several-fold; lz4 costs the least CPU on the training machine
    (zstd compresses more at more CPU).
``acks=all``, ``enable.idempotence=false``
    a record is acknowledged once every in-sync replica has it (``min.insync.replicas`` 2 of
    3 on a replicated cluster: docs/OPERATIONS.md, "Three brokers"), so the death of a
    leader loses none. Not idempotent: with it, the exit events of Lightning ranks torn down
    by torchrun went missing in 3 of 4 runs of tests/test_integrations_e2e.py (0 of 1
    without), and telemetry tolerates the rare duplicate that a retry after a fail-over may
    write (steps are identified by job, rank and step).
``message.timeout.ms=15000``
    a message that cannot be delivered within 15 s (broker down) fails and counts as dropped,
    so memory stays bounded and stale telemetry is not sent minutes late; 15 s outlasts a
    replicated cluster's fail-over (a dead broker is fenced after ``broker.session.timeout.ms``,
    9 s by default, 3 s in ``trainguard broker start --brokers 3``).
``queue.buffering.max.messages=20000``, ``queue.buffering.max.kbytes=8192``
    librdkafka's own queue is bounded too; when it is full a record is dropped.
``socket.timeout.ms=5000``, ``socket.connection.setup.timeout.ms=3000``
    dead connections are noticed in seconds, not minutes.
``reconnect.backoff.ms=100``, ``reconnect.backoff.max.ms=2000``
    a restarted broker is found again within about 2 s.
``retry.backoff.ms=100``, ``retry.backoff.max.ms=1000``
    retries stay inside the short message timeout.
``delivery.report.only.error=true``
    the thread hears only about failures (counted as dropped), not about every delivery.
``partitioner=murmur2_random``
    the Java client's partitioner, so a key lands on the same partition whichever client
    (confluent-kafka, aiokafka, Kafka Streams) produces it.

Librdkafka's own log lines (connection refused, ...) go to the ``trainguard.collectors.kafka``
logger at DEBUG; the first error of an outage is logged once at WARNING.

>>> p = BackgroundProducer(settings={"bootstrap.servers": "127.0.0.1:1"}, topic="tg.telemetry",
...                        max_events=2)
>>> [p.produce(b"x", b"job/0") for _ in range(3)]
[True, True, False]
>>> p.dropped
1
>>> p.close(timeout=0.2)   # the broker is unreachable: returns after at most 0.2 s of flush,
2
>>> p.dropped              # ... with the records it lost meanwhile
3
"""
from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

__all__ = ["BackgroundProducer", "TELEMETRY_SETTINGS"]

log = logging.getLogger(__name__)
kafka_log = logging.getLogger("trainguard.collectors.kafka")

TELEMETRY_SETTINGS: dict[str, Any] = {
    "linger.ms": 50,
    "compression.type": "lz4",
    "enable.idempotence": False,
    "acks": "all",
    "message.timeout.ms": 15000,
    "queue.buffering.max.messages": 20000,
    "queue.buffering.max.kbytes": 8192,
    "socket.timeout.ms": 5000,
    "socket.connection.setup.timeout.ms": 3000,
    "reconnect.backoff.ms": 100,
    "reconnect.backoff.max.ms": 2000,
    "retry.backoff.ms": 100,
    "retry.backoff.max.ms": 1000,
    "delivery.report.only.error": True,
    "partitioner": "murmur2_random",
    "log.connection.close": False,
}

# librdkafka handles inherited across fork(): kept alive forever in the child, because
# destroying them there would join threads that only exist in the parent.
_FORK_ORPHANS: list = []
_PURGED = (-152, -151)  # KafkaError._PURGE_QUEUE, _PURGE_INFLIGHT


class _DebugLogger:
    """librdkafka log lines, all at DEBUG (they would otherwise flood the training log)."""

    def log(self, level, msg, *args, **kwargs):
        kafka_log.debug(msg, *args)


class BackgroundProducer:
    """A bounded queue in front of one ``confluent_kafka.Producer`` owned by a daemon thread.

    ``settings`` are librdkafka settings (``bootstrap.servers`` at least) laid over
    :data:`TELEMETRY_SETTINGS`. ``encode(record) -> bytes`` turns a queued record into the
    message value in the background thread (default: records are already bytes).
    ``record_size`` is the byte estimate charged to the queue for a record that is not bytes.
    ``producer_factory`` makes the client from the final settings (tests pass fakes).
    """

    def __init__(self, *, settings: dict, topic: str, encode: Callable[[Any], bytes] | None = None,
                 max_events: int = 10000, max_bytes: int = 8 << 20, record_size: int = 512,
                 poll_interval: float = 0.1, flush_timeout: float = 3.0,
                 name: str = "trainguard-producer", producer_factory: Callable | None = None):
        if max_events < 1 or max_bytes < 1 or record_size < 1:
            raise ValueError("max_events, max_bytes and record_size must be positive")
        if poll_interval <= 0 or flush_timeout < 0:
            raise ValueError("poll_interval must be positive and flush_timeout not negative")
        self.settings = settings
        self.topic = topic
        self.encode = encode
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.record_size = record_size
        self.poll_interval = poll_interval
        self.flush_timeout = flush_timeout
        self.name = name
        self.producer_factory = producer_factory
        self.sent = 0      # handed to librdkafka (delivery failures later count as dropped)
        self._dropped = 0
        self._reset()
        self._pid = os.getpid()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (p := ref()) is not None and p._after_fork())

    def _reset(self) -> None:
        self._lock = threading.RLock()  # re-entrant: a signal handler may produce mid-produce
        self._queue: deque = deque()
        self._queued_bytes = 0
        self._closed = False
        self._close_deadline = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client = None
        self._warned: set = set()

    def _after_fork(self) -> None:
        if self._client is not None:
            _FORK_ORPHANS.append(self._client)
        self._reset()
        self._pid = os.getpid()
        self.sent = 0
        self._dropped = 0

    # -- training-thread side --------------------------------------------------------------
    @property
    def dropped(self) -> int:
        """Records dropped so far: queue full, encoding failed, undeliverable, left at close."""
        return self._dropped

    @property
    def queued(self) -> int:
        return len(self._queue)

    def produce(self, record, key: bytes | None = None) -> bool:
        """Queue one record; False (and ``dropped`` + 1) when the queue is full or closed."""
        size = len(record) if type(record) is bytes else self.record_size
        with self._lock:
            if (self._closed or len(self._queue) >= self.max_events
                    or self._queued_bytes + size > self.max_bytes):
                self._dropped += 1
                return False
            self._queue.append((record, key, size))
            self._queued_bytes += size
        if self._thread is None:
            self.start()
        return True

    def start(self) -> "BackgroundProducer":
        """Start the background thread (``produce`` does so on first use)."""
        with self._lock:
            if self._thread is not None or self._closed:
                return self
            thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread = thread
        try:
            thread.start()
        except RuntimeError:  # interpreter shutting down: close() sends synchronously
            pass
        return self

    def close(self, timeout: float | None = None) -> int:
        """Send what is queued, flush for at most ``timeout`` (default ``flush_timeout``) s;
        returns how many records were lost in the meantime (not sent or not delivered in
        time: no later report will count them)."""
        timeout = self.flush_timeout if timeout is None else max(0.0, timeout)
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._closed:
                return 0
            self._closed = True
            dropped = self._dropped
            self._close_deadline = deadline
            thread = self._thread
        if thread is not None and thread.is_alive():
            self._stop.set()
            thread.join(timeout + 1.0)
        elif self._queue:
            self._run(deadline=deadline)  # no thread could run: do the work here
        with self._lock:
            if self._queue:  # the thread did not get to them in time
                self._dropped += len(self._queue)
                self._queue.clear()
                self._queued_bytes = 0
            return self._dropped - dropped

    # -- background thread -----------------------------------------------------------------
    def _run(self, deadline: float | None = None) -> None:
        if deadline is None:  # the background thread: until close()
            while not self._stop.wait(self.poll_interval):
                self._send_queued()
                if self._client is not None:
                    self._client.poll(0)
            deadline = self._close_deadline
        self._send_queued()
        client = self._client
        if client is None:
            return
        try:
            left = client.flush(max(0.0, deadline - time.monotonic()))
            if left:
                self._count_dropped(left)
                client.purge()
                client.poll(0)
        except Exception as exc:  # never let a client failure escape the thread
            self._warn_once("flush", "telemetry flush failed: %s", exc)

    def _send_queued(self) -> None:
        with self._lock:
            if not self._queue:
                return
            batch, self._queue = self._queue, deque()
            self._queued_bytes = 0
        client = self._client or self._create_client()
        if client is None:
            self._count_dropped(len(batch))
            return
        encode, topic = self.encode, self.topic
        for record, key, _size in batch:
            try:
                value = record if encode is None else encode(record)
                client.produce(topic, value, key)
                self.sent += 1
            except BufferError:
                self._count_dropped(1)
                self._warn_once("full", "telemetry queue of librdkafka full: dropping events")
                client.poll(0)
            except Exception as exc:  # an unencodable record, a message too large, ...
                self._count_dropped(1)
                self._warn_once(type(exc).__name__, "telemetry event dropped: %s", exc)
        client.poll(0)

    def _create_client(self):
        if "failed" in self._warned:
            return None
        settings = {**TELEMETRY_SETTINGS, **self.settings, "logger": _DebugLogger(),
                    "error_cb": self._on_error, "on_delivery": self._on_delivery}
        try:
            if self.producer_factory is not None:
                self._client = self.producer_factory(settings)
            else:
                from confluent_kafka import Producer
                self._client = Producer(settings)
        except Exception as exc:
            self._warn_once("failed", "telemetry disabled, cannot create Kafka producer: %s", exc)
            return None
        return self._client

    def _on_error(self, err) -> None:
        self._warn_once("error", "telemetry: Kafka at %s: %s (events are dropped while it "
                        "lasts; training is not affected)",
                        self.settings.get("bootstrap.servers"), err)
        kafka_log.debug("kafka error: %s", err)

    def _on_delivery(self, err, msg) -> None:
        if err is not None and err.code() not in _PURGED:  # purged ones were counted at close
            self._count_dropped(1)

    def _count_dropped(self, count: int) -> None:
        with self._lock:
            self._dropped += count

    def _warn_once(self, what: str, msg: str, *args) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)
