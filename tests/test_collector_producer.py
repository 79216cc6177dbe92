"""BackgroundProducer: bounded, never blocking, fork-safe, and it delivers to a real broker."""
from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from trainguard.collectors.producer import TELEMETRY_SETTINGS, BackgroundProducer

from collector_harness import closed_port


class FakeClient:
    """A confluent_kafka.Producer stand-in whose local queue holds ``capacity`` messages."""

    def __init__(self, settings, capacity=10**9):
        self.settings = settings
        self.capacity = capacity
        self.messages = []

    def produce(self, topic, value, key=None):
        if len(self.messages) >= self.capacity:
            raise BufferError("Local: Queue full")
        self.messages.append((topic, value, key))

    def poll(self, timeout=0):
        return 0

    def flush(self, timeout=0):
        return 0

    def purge(self, *args):
        pass


def test_full_queue_drops_and_counts():
    p = BackgroundProducer(settings={}, topic="t", max_events=5, producer_factory=FakeClient)
    p._thread = object()  # keep the thread from draining: only the bound is under test
    accepted = [p.produce(b"x") for _ in range(8)]
    assert accepted == [True] * 5 + [False] * 3 and p.dropped == 3


def test_byte_bound():
    p = BackgroundProducer(settings={}, topic="t", max_bytes=100, record_size=40,
                           producer_factory=FakeClient)
    p._thread = object()
    assert [p.produce(b"a" * 60), p.produce(b"b" * 60), p.produce(("rec",))] == [True, False,
                                                                                  True]
    assert p.produce(("rec",)) is False and p.dropped == 2


def test_records_are_encoded_in_the_background_thread():
    clients = []

    def factory(settings):
        clients.append(FakeClient(settings))
        return clients[-1]

    import threading

    threads = []

    def encode(record):
        threads.append(threading.current_thread().name)
        return repr(record).encode()

    p = BackgroundProducer(settings={"bootstrap.servers": "x:1"}, topic="t", encode=encode,
                           poll_interval=0.01, producer_factory=factory, name="bg")
    p.produce(("step", 1), b"j/0")
    p.close()
    assert clients[0].messages == [("t", b"('step', 1)", b"j/0")]
    assert threads == ["bg"]
    assert clients[0].settings["linger.ms"] == TELEMETRY_SETTINGS["linger.ms"]
    assert clients[0].settings["acks"] == "all"          # issue 23: lose none to a broker's death
    assert clients[0].settings["enable.idempotence"] is False   # (producer.py says why)


def test_librdkafka_queue_full_and_bad_records_are_dropped_not_raised(caplog):
    def encode(record):
        if record == "bad":
            raise TypeError("cannot encode")
        return record

    p = BackgroundProducer(settings={}, topic="t", encode=encode, poll_interval=0.01,
                           producer_factory=lambda s: FakeClient(s, capacity=2))
    with caplog.at_level(logging.WARNING):
        for record in (b"1", "bad", b"2", b"3", b"4"):
            p.produce(record)
        p.close()
    assert p.sent == 2 and p.dropped == 3


def test_unusable_client_settings_disable_sending_once(caplog):
    def factory(settings):
        raise ValueError("bad setting")

    p = BackgroundProducer(settings={}, topic="t", poll_interval=0.01, producer_factory=factory)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            p.produce(b"x")
            time.sleep(0.03)
        p.close()
    assert p.dropped == 3
    assert sum("telemetry disabled" in r.message for r in caplog.records) == 1


def test_unreachable_broker_never_blocks_and_close_is_bounded():
    p = BackgroundProducer(settings={"bootstrap.servers": f"127.0.0.1:{closed_port()}"},
                           topic="tg.telemetry", max_events=1000, flush_timeout=1.0)
    t0 = time.monotonic()
    for i in range(5000):
        p.produce(b'{"i":%d}' % i, b"j/0")
    produce_s = time.monotonic() - t0
    overflowed = p.dropped
    t0 = time.monotonic()
    lost = p.close()
    close_s = time.monotonic() - t0
    print(f"5000 produce calls: {produce_s * 1e3:.1f} ms; close: {close_s:.2f} s")
    assert close_s < 5.0
    assert p.dropped == 5000  # the queue overflowed, the rest could not be delivered
    assert lost == 5000 - overflowed and lost > 0    # ... which close() says it lost
    assert p.close() == 0


@pytest.mark.broker
def test_delivers_to_the_broker_keyed(kafka_config):
    p = BackgroundProducer(settings=kafka_config.kafka(), topic=kafka_config.topics.telemetry,
                           poll_interval=0.02)
    for i in range(20):
        p.produce(b'{"n":%d}' % i, b"job-a/%d" % (i % 4))
    p.close()
    assert p.dropped == 0 and p.sent == 20
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": kafka_config.bootstrap, "group.id": "tp-keyed",
                         "auto.offset.reset": "earliest"})
    consumer.subscribe([kafka_config.topics.telemetry])
    got, partitions = [], {}
    deadline = time.monotonic() + 20
    while len(got) < 20 and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and not msg.error():
            got.append(msg.value())
            partitions.setdefault(msg.key(), set()).add(msg.partition())
    consumer.close()
    assert sorted(got) == sorted(b'{"n":%d}' % i for i in range(20))
    assert all(len(parts) == 1 for parts in partitions.values())  # one rank, one partition


@pytest.mark.broker
def test_a_forked_child_gets_its_own_client(kafka_config):
    topic = kafka_config.topics.telemetry
    p = BackgroundProducer(settings=kafka_config.kafka(), topic=topic, poll_interval=0.02)
    p.produce(b'{"from":"parent-1"}')
    time.sleep(0.3)  # the parent's thread and client now exist
    assert p._client is not None
    pid = os.fork()
    if pid == 0:  # child: a fresh queue, thread and client; the parent's are not touched
        code = 1
        try:
            signal.alarm(20)  # never outlive the test, whatever happens in the child
            ok = p.queued == 0 and p._client is None and p.dropped == 0
            p.produce(b'{"from":"child"}')
            p.close(timeout=5)
            code = 0 if ok and p.dropped == 0 and p.sent == 1 else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 25
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child did not finish")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    p.produce(b'{"from":"parent-2"}')
    p.close()
    assert p.dropped == 0
    values = {e.extra.get("from") if not isinstance(e, Exception) else None
              for e in consume_raw(kafka_config.bootstrap, topic, 3)}
    assert values == {"parent-1", "child", "parent-2"}


def consume_raw(bootstrap, topic, count):
    import json
    import uuid

    from confluent_kafka import Consumer

    class Raw:
        def __init__(self, value):
            self.extra = json.loads(value)

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                         "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    out = []
    deadline = time.monotonic() + 20
    while len(out) < count and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and not msg.error():
            out.append(Raw(msg.value()))
    consumer.close()
    return out
