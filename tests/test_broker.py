"""`trainguard broker` against the real Apache Kafka it fetches and runs."""
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

from trainguard import events as ev
from trainguard.broker import free_port

from events_factory import examples

TRAINGUARD = [sys.executable, "-m", "trainguard.cli"]


def tg(*args, env=None, timeout=180):
    return subprocess.run([*TRAINGUARD, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def produce_and_consume(bootstrap, topic, value, group):
    producer = Producer({"bootstrap.servers": bootstrap})
    producer.produce(topic, value)
    assert producer.flush(15) == 0
    return consume_one(bootstrap, topic, group)


def consume_one(bootstrap, topic, group, timeout=20):
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                         "auto.offset.reset": "earliest"})
    consumer.subscribe([topic])
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and not message.error():
                return message.value()
        return None
    finally:
        consumer.close()


@pytest.mark.slow
def test_start_status_stop_and_data_survives(tmp_path):
    port = free_port()
    data = tmp_path / "broker"
    started = tg("broker", "start", "--port", str(port), "--data", str(data))
    assert started.returncode == 0, started.stderr
    try:
        assert tg("broker", "status", "--port", str(port), "--data", str(data)).returncode == 0
        again = tg("broker", "start", "--port", str(port), "--data", str(data))
        assert again.returncode == 0 and "already running" in again.stdout
        bootstrap = f"127.0.0.1:{port}"
        assert AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).brokers
        topic = f"new-{uuid.uuid4().hex[:8]}"
        value = ev.encode(examples()[0])
        got = produce_and_consume(bootstrap, topic, value, "g1")
        assert ev.decode(got).type == "step"
    finally:
        stopped = tg("broker", "stop", "--port", str(port), "--data", str(data))
    assert stopped.returncode == 0, stopped.stderr
    assert not (data / "broker.pid").exists()
    assert tg("broker", "status", "--port", str(port), "--data", str(data)).returncode != 0

    assert tg("broker", "start", "--port", str(port), "--data", str(data)).returncode == 0
    try:
        assert consume_one(f"127.0.0.1:{port}", topic, "g2") == value
    finally:
        tg("broker", "stop", "--port", str(port), "--data", str(data))


def test_status_and_stop_of_a_data_folder_use_the_port_it_was_started_with(tmp_path):
    """``--data`` alone names the broker: its server.properties holds the port (before,
    status looked on 9092, and stop said it stopped the broker on 9092, whatever port the
    folder's broker used)."""
    from trainguard.broker import SERVER_PROPERTIES

    (tmp_path / "server.properties").write_text(SERVER_PROPERTIES.format(
        port=39411, controller_port=39412, log_dirs=tmp_path / "kraft-logs"))
    status = tg("broker", "status", "--data", str(tmp_path), timeout=60)
    assert status.returncode == 1
    assert status.stdout.strip() == "no broker answers on 127.0.0.1:39411"


def test_port_used_by_another_program_is_a_one_line_error(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = tg("broker", "start", "--port", str(port), "--data", str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "already in use" in result.stderr
    assert "Traceback" not in result.stderr


def _path_without(*programs):
    keep = [d for d in os.environ["PATH"].split(os.pathsep)
            if not any((Path(d) / p).exists() for p in programs)]
    return os.pathsep.join(keep)


def test_java_missing_is_a_one_line_error(tmp_path):
    env = {"PATH": _path_without("java"), "JAVA_HOME": ""}
    result = tg("broker", "start", "--port", str(free_port()), "--data", str(tmp_path), env=env)
    assert result.returncode == 2 and "Java not found" in result.stderr
    assert result.stderr.count("\n") == 1


def test_old_java_is_refused(tmp_path):
    fake = tmp_path / "jdk" / "bin"
    fake.mkdir(parents=True)
    (fake / "java").write_text('#!/bin/sh\necho \'openjdk version "11.0.2" 2019-01-15\' >&2\n')
    (fake / "java").chmod(0o755)
    env = {"PATH": _path_without("java"), "JAVA_HOME": str(tmp_path / "jdk")}
    result = tg("broker", "start", "--port", str(free_port()), "--data", str(tmp_path), env=env)
    assert result.returncode == 2 and "Java 11" in result.stderr and "17" in result.stderr


def test_maven_missing_with_empty_cache_is_a_one_line_error(tmp_path):
    java = shutil.which("java")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "java").symlink_to(java)
    env = {"PATH": f"{bin_dir}{os.pathsep}{_path_without('mvn', 'java')}",
           "TRAINGUARD_HOME": str(tmp_path / "home")}
    result = tg("broker", "start", "--port", str(free_port()), "--data", str(tmp_path / "d"),
                env=env)
    assert result.returncode == 2 and "Maven is not installed" in result.stderr
    assert result.stderr.count("\n") == 1


@pytest.mark.slow
def test_broker_exiting_during_start_reports_its_log(tmp_path):
    from trainguard.broker import BrokerError, local_broker

    broker = local_broker(port=free_port(), data=tmp_path / "b")
    broker.start(log=lambda m: None)
    broker.stop()
    text = broker.properties.read_text().replace("node.id=1", "node.id=7")
    broker.properties.write_text(text)
    with pytest.raises(BrokerError, match="exited during start|did not answer|last log lines"):
        broker.start(log=lambda m: None, timeout=40)
    assert broker.pid() is None


@pytest.mark.parametrize("event", examples(), ids=lambda e: e.type)
def test_every_event_type_through_kafka(kafka_config, event):
    value = ev.encode(event)
    got = produce_and_consume(kafka_config.bootstrap, kafka_config.topics.telemetry, value,
                              f"rt-{uuid.uuid4().hex[:6]}")
    assert got == value
    assert ev.decode(got).type == event.type


def test_cluster_id_never_reads_as_an_option(monkeypatch):
    from trainguard import broker

    # 0xfb... encodes to a leading '-' in url-safe base64; the storage tool took it for an option
    ids = iter([uuid.UUID(bytes=b"\xfb" + bytes(15)), uuid.UUID(bytes=b"\x01" * 16)])
    monkeypatch.setattr(broker.uuid, "uuid4", lambda: next(ids))
    cluster_id = broker._kafka_cluster_id()
    assert cluster_id == "AQEBAQEBAQEBAQEBAQEBAQ" and len(cluster_id) == 22
