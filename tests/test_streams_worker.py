"""``trainguard worker`` end to end through the real broker: faults in, anomalies out,
malformed messages dead-lettered, /metrics, and kill -9 with a restart.

One worker serves the module's first tests; the kill test runs its own. Every worker is a
subprocess killed in a finally block (SIGTERM, then SIGKILL after a few seconds).
"""
from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from trainguard import events as ev
from trainguard.config import Config, Topics
from trainguard.detectors import Engine
from trainguard.deadletter import original_value, parse_deadletter
from trainguard.streams.metrics import parse_exposition
from trainguard.topics import TopicPlan, create_topics

pytestmark = [pytest.mark.broker, pytest.mark.slow]
TRAINGUARD = str(Path(sys.executable).with_name("trainguard"))
WAIT_S = 60.0          # bound on any wait for the worker (startup, a rebalance, a finding)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_config(bootstrap: str) -> Config:
    config = Config(bootstrap=bootstrap, topics=Topics(prefix=f"w{uuid.uuid4().hex[:10]}"))
    create_topics(config, TopicPlan(telemetry_partitions=4, other_partitions=2))
    return config


class WorkerProcess:
    """``trainguard worker`` as a subprocess, with its /metrics."""

    def __init__(self, config: Config, worker_id: str, data_dir: Path, log: Path):
        self.config = config
        self.worker_id = worker_id
        self.data_dir = data_dir
        self.log = log
        self.port = None
        self.proc = None
        self.extra_args: list = []

    def start(self) -> "WorkerProcess":
        self.port = free_port()
        cmd = [TRAINGUARD, "worker", "--bootstrap", self.config.bootstrap,
               "--prefix", self.config.topics.prefix, "--id", self.worker_id,
               "--web-port", str(self.port), "--data-dir", str(self.data_dir),
               "--loglevel", "warn", *self.extra_args]
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        out.close()
        return self

    def metrics(self) -> dict | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics",
                                        timeout=3) as reply:
                return parse_exposition(reply.read().decode())
        except OSError:
            return None

    def wait_until(self, predicate, what: str, timeout: float = WAIT_S) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"worker exited:\n{self.tail()}"
            values = self.metrics()
            if values is not None and predicate(values):
                return values
            time.sleep(0.3)
        seen = {k: v for k, v in (values or {}).items() if not k.startswith("trainguard_assigned")}
        raise AssertionError(f"worker never got {what}:\n{self.tail()}\nmetrics: {seen}")

    def wait_ready(self) -> dict:
        telemetry = self.config.topics.telemetry
        return self.wait_until(
            lambda m: m.get(f'trainguard_assigned_partitions{{topic="{telemetry}"}}', 0) > 0
            and any(k.startswith("trainguard_assigned_partitions") and "summaries" in k and v > 0
                    for k, v in m.items()), "its partitions")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def kill9(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, grace: float = 25.0) -> int:
        """SIGTERM; SIGKILL after ``grace`` seconds. Returns the exit code."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            return -9


class TopicReader:
    """Everything on some topics from the beginning, kept as (topic, key, value)."""

    def __init__(self, config: Config, *topics: str):
        self.consumer = Consumer(config.kafka(**{"group.id": f"r{uuid.uuid4().hex}",
                                                 "enable.auto.commit": False}))
        meta = self.consumer.list_topics(timeout=10).topics
        self.consumer.assign([TopicPartition(t, p, 0) for t in topics for p in meta[t].partitions])
        self.seen: list = []

    def poll(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            for m in self.consumer.consume(1000, max(0.0, min(left, 0.5))):
                if not m.error():
                    self.seen.append((m.topic(), m.key(), m.value()))
            if left <= 0:
                return

    def incidents(self, job: str) -> list:
        return [e for topic, _, value in self.seen if topic.endswith(".anomalies")
                for e in [ev.decode(value)] if e.job == job and e.TYPE == "incident"]

    def anomalies(self, job: str) -> list:
        out = []
        for topic, key, value in self.seen:
            if topic.endswith(".anomalies"):
                a = ev.decode(value)
                if a.job == job and a.TYPE == "anomaly":
                    out.append(a)
        return out

    def wait_for(self, predicate, what: str, timeout: float = WAIT_S, worker=None):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll(0.5)
            found = predicate(self)
            if found:
                return found
            if worker is not None:
                assert worker.proc.poll() is None, f"worker exited:\n{worker.tail()}"
        seen = {k: v for k, v in (worker.metrics() or {}).items()
                if "assigned" in k or k.endswith("_total")} if worker else {}
        raise AssertionError(f"no {what} within {timeout:.0f}s"
                             + (f"\n{worker.tail()}\nmetrics: {seen}" if worker else ""))

    def close(self):
        self.consumer.close()


def produce(config: Config, items) -> None:
    """``items``: events, or (key, raw bytes) pairs for what is not an event. Compressed
    with lz4, as the collectors send."""
    producer = Producer(config.kafka(**{"linger.ms": 5, "compression.type": "lz4"}))
    for item in items:
        if isinstance(item, ev.Event):
            key = f"{item.job}/{item.rank}".encode() if item.rank is not None else None
            producer.produce(config.topics.telemetry, ev.encode(item), key)
        else:
            producer.produce(config.topics.telemetry, item[1], item[0])
        producer.poll(0)
    assert producer.flush(15) == 0


def steps(job: str, t0: float, first: int, last: int, ranks: int = 4, nan_at=None):
    out = []
    for s in range(first, last + 1):
        for r in range(ranks):
            loss = math.nan if (s, r) == nan_at else 2.0 - s / 100
            out.append(ev.Step(job=job, ts=t0 + s * 0.5, node=f"n{r // 2}", rank=r, step=s,
                               step_time=0.5, compute_time=0.4, loss=loss, grad_norm=1.0))
    return out


def offline_ids(events, kind: str) -> set:
    engine = Engine()
    return {a.id for e in events for a in engine.update(e) if a.kind == kind}


@pytest.fixture(scope="module")
def worker_env(kafka_bootstrap, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("worker")
    config = new_config(kafka_bootstrap)
    worker = WorkerProcess(config, f"t{uuid.uuid4().hex[:8]}", tmp / "data", tmp / "worker.log")
    worker.start()
    reader = TopicReader(config, config.topics.anomalies, config.topics.deadletter)
    try:
        worker.wait_ready()
        yield config, worker, reader
    finally:
        reader.close()
        worker.stop(grace=10)


def test_metrics_endpoint_answers_in_prometheus_text(worker_env):
    config, worker, _ = worker_env
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.port}/metrics", timeout=5) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    for name in ("trainguard_events_in_total", "trainguard_invalid_total",
                 "trainguard_anomalies_out_total", "trainguard_consumer_lag_messages"):
        assert f"# TYPE {name} " in text
    assert f'trainguard_consumer_lag_messages{{topic="{config.topics.telemetry}"}}' in text


def test_nan_and_crash_reach_the_anomalies_topic(worker_env):
    config, worker, reader = worker_env
    t0 = time.time()
    nan_job, crash_job = f"nan-{uuid.uuid4().hex[:6]}", f"crash-{uuid.uuid4().hex[:6]}"
    nan_events = steps(nan_job, t0, 0, 9, nan_at=(6, 2))
    crash_events = ([ev.Lifecycle(job=crash_job, ts=t0, node="n0", rank=r, event="start",
                                  pid=100 + r, world_size=4) for r in range(4)]
                    + steps(crash_job, t0, 0, 3)
                    + [ev.Lifecycle(job=crash_job, ts=t0 + 2.1, node="n0", rank=1,
                                    event="exit", exit_code=None, signal="SIGKILL")])
    produce(config, nan_events + crash_events)
    nan = reader.wait_for(lambda r: [a for a in r.anomalies(nan_job) if a.kind == "nan"],
                          "nan anomaly", worker=worker)
    assert nan[0].ranks == [2] and nan[0].step == 6
    assert {a.id for a in nan} == offline_ids(nan_events, "nan")
    crash = reader.wait_for(lambda r: [a for a in r.anomalies(crash_job) if a.kind == "crash"],
                            "crash anomaly", worker=worker)
    assert crash[0].ranks == [1] and crash[0].severity == "critical"
    # counted once the broker confirms delivery, which the worker learns on a later poll
    deadline = time.monotonic() + 20
    values = worker.metrics()
    while values["trainguard_anomalies_out_total"] < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
        values = worker.metrics()
    assert values["trainguard_anomalies_out_total"] >= 2
    assert values["trainguard_events_in_total"] >= len(nan_events) + len(crash_events)
    # SPEC §6: the incident of each, beside its anomalies, as analyze correlates it
    incident = reader.wait_for(lambda r: r.incidents(nan_job), "the nan's incident",
                               worker=worker)[-1]
    assert (incident.kind, incident.ranks, incident.anomalies) == ("nan", [2], [nan[0].id])
    assert incident.id == "inc-" + nan[0].id and incident.anomaly_count == 1


def test_thousands_of_malformed_messages_are_dead_lettered_and_detection_goes_on(worker_env):
    config, worker, reader = worker_env
    job = f"dl-{uuid.uuid4().hex[:6]}"
    t0 = time.time()
    bad = []
    for i in range(3000):
        kind = i % 6
        bad.append([b"not json %d" % i, b"\xff\xfe%d" % i, b"[%d]" % i,
                    b'{"v":1,"type":"step","job":"j","idx":%d}' % i,
                    b'{"v":1,"type":"nope","job":"j","ts":%d}' % i,
                    b'{"v":1,"type":"step","job":"bad job","ts":1,"step":%d,"step_time":1}' % i,
                    ][kind])
    good = (steps(job, t0, 0, 5)
            + [ev.Lifecycle(job=job, ts=t0 + 3.0, node="n1", rank=3, event="exit",
                            exit_code=137, signal=None)])
    stream = []
    for i, raw in enumerate(bad):
        stream.append((f"{job}/{i % 4}".encode(), raw))
        if i % 120 == 0 and good:
            stream.append(good.pop(0))
    stream += good
    produce(config, stream)
    crash = reader.wait_for(lambda r: [a for a in r.anomalies(job) if a.kind == "crash"],
                            "crash anomaly among malformed messages", worker=worker)
    assert crash[0].ranks == [3]
    wanted = set(bad)

    def dead_lettered(r):
        got = [parse_deadletter(v) for t, k, v in r.seen if t.endswith(".deadletter")]
        mine = [rec for rec in got if original_value(rec) in wanted]
        return mine if len(mine) >= len(wanted) else None

    records = reader.wait_for(dead_lettered, "3000 dead letters", worker=worker)
    assert {original_value(rec) for rec in records} == wanted
    assert all(rec["reason"] and rec["topic"] == config.topics.telemetry for rec in records)
    assert worker.proc.poll() is None
    assert worker.metrics()["trainguard_invalid_total"] >= 3000


def test_kill_9_and_restart_emit_the_anomaly_once_with_the_same_id(kafka_bootstrap, tmp_path):
    """Killed before the fault and again right after reporting it: after de-duplication by
    id there is exactly one anomaly, with the id the offline engine gives it."""
    config = new_config(kafka_bootstrap)
    worker_id = f"k{uuid.uuid4().hex[:8]}"
    job = f"k9-{uuid.uuid4().hex[:6]}"
    t0 = time.time()
    first, rest = steps(job, t0, 0, 5), steps(job, t0, 6, 13, nan_at=(8, 2))
    expected = offline_ids(first + rest, "nan")
    reader = TopicReader(config, config.topics.anomalies)
    workers = []

    def start():
        w = WorkerProcess(config, worker_id, tmp_path / "data", tmp_path / "worker.log")
        workers.append(w.start())
        return w

    try:
        w1 = start()
        w1.wait_ready()
        produce(config, first)
        snaps = w1.wait_until(lambda m: m["trainguard_items_applied_total"] >= len(first),
                              "the first steps")["trainguard_snapshots_total"]
        w1.wait_until(lambda m: m["trainguard_snapshots_total"] >= snaps + 2, "a checkpoint")
        w1.kill9()                                        # mid-scenario, before the fault
        produce(config, rest)
        w2 = start()
        # the killed member holds its partitions until its session ends, then the new one
        # rebalances in: with the suite's lanes side by side that took longer than WAIT_S
        reader.wait_for(lambda r: [a for a in r.anomalies(job) if a.kind == "nan"],
                        "nan anomaly after the restart", timeout=2 * WAIT_S, worker=w2)
        w2.kill9()                                        # right after reporting it
        w3 = start()
        w3.wait_ready()
        w3.wait_until(lambda m: m["trainguard_snapshots_total"] >= 2, "a checkpoint")
        reader.poll(2.0)
        nan = [a for a in reader.anomalies(job) if a.kind == "nan"]
        assert {a.id for a in nan} == expected and len(expected) == 1
        assert all(a.ranks == [2] and a.step == 8 for a in nan)
        assert w3.stop() == 0, w3.tail()                  # SIGTERM: clean exit
    finally:
        reader.close()
        for w in workers:
            w.stop(grace=5)
