"""``trainguard worker`` against hostile and careless input, through the real broker
(issue 14): hostile pickles on its state topics across a restart, a 900 KB invalid message,
a 600 KB exit signal, poisoned timestamps and steps followed by a real hang, and a job
evicted from memory that speaks again."""
from __future__ import annotations

import os
import pickle
import time
import uuid

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from trainguard import events as ev
from trainguard.deadletter import parse_deadletter
from trainguard.streams.settings import WorkerSettings

from test_streams_worker import (TopicReader, WorkerProcess, new_config, produce, steps,  # noqa: F401
                                 worker_env)

pytestmark = [pytest.mark.broker, pytest.mark.slow]


class Exploit:
    """Unpickling it runs ``touch <marker>``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def partitions_of(config, topic: str) -> list:
    meta = AdminClient(config.kafka()).list_topics(timeout=10).topics
    return sorted(meta[topic].partitions)


def write_everywhere(config, topic: str, key: bytes, value: bytes) -> None:
    producer = Producer(config.kafka())
    for p in partitions_of(config, topic):
        producer.produce(topic, value, key, partition=p)
    assert producer.flush(15) == 0


def test_hostile_pickles_on_both_state_topics_run_nothing_across_a_restart(kafka_bootstrap,
                                                                          tmp_path):
    config = new_config(kafka_bootstrap)
    worker_id = f"h{uuid.uuid4().hex[:8]}"
    names = WorkerSettings(prefix=config.topics.prefix, worker_id=worker_id)
    marker = tmp_path / "pwned"
    hostile = pickle.dumps(Exploit(marker))
    job = f"victim-{uuid.uuid4().hex[:6]}"
    reader = TopicReader(config, config.topics.anomalies)
    workers = []

    def start():
        w = WorkerProcess(config, worker_id, tmp_path / "data", tmp_path / "worker.log")
        workers.append(w.start())
        w.wait_ready()
        return w

    try:
        start().stop()                  # creates the worker's internal topics
        write_everywhere(config, names.job_changelog_topic, job.encode(), hostile)
        for rank in range(4):
            write_everywhere(config, names.rank_state_topic, f"{job}/{rank}".encode(), hostile)
        w = start()
        # the hostile job snapshot is met when the job side loads its table, the rank ones
        # when the rank side restores its partitions; then the forged keys get telemetry
        w.wait_until(lambda m: m["trainguard_restore_failures_total"] >= 2,
                     "the hostile snapshots discarded")
        t0 = time.time()
        produce(config, steps(job, t0, 0, 9, nan_at=(6, 1)))
        nan = reader.wait_for(lambda r: [a for a in r.anomalies(job) if a.kind == "nan"],
                              "the nan of the job whose state was forged", worker=w)
        assert nan[0].ranks == [1] and nan[0].step == 6     # its stages started afresh
        assert "snapshot of" in w.tail() and "discarded" in w.tail()
        assert not marker.exists(), "a pickle from Kafka ran code"
        assert w.metrics()["trainguard_restore_failures_total"] >= 2
    finally:
        reader.close()
        for w in workers:
            w.stop(grace=5)
    assert not marker.exists()


def dead_letters(reader) -> list:
    return [parse_deadletter(v) for t, k, v in reader.seen if t.endswith(".deadletter")]


def test_a_900kb_invalid_message_reaches_the_deadletter_topic_shortened(worker_env):
    config, worker, reader = worker_env
    job = f"big-{uuid.uuid4().hex[:6]}"
    raw = b'{"v":1,"type":"step","job":"' + job.encode() + b'","junk":"' + b"x" * 900_000
    produce(config, [(f"{job}/0".encode(), raw)])
    records = reader.wait_for(
        lambda r: [d for d in dead_letters(r) if d.get("raw_bytes") == len(raw)],
        "the shortened dead letter", worker=worker)
    record = records[0]
    assert record["truncated"] is True and record["reason"]
    assert record["key_b64"] and record["topic"] == config.topics.telemetry
    worker.wait_until(lambda m: m["trainguard_deadletters_out_total"] >= 1, "the delivery")


def test_an_exit_with_a_600kb_signal_yields_an_anomaly_on_the_topic(worker_env):
    config, worker, reader = worker_env
    job = f"sig-{uuid.uuid4().hex[:6]}"
    t0 = time.time()
    exit_event = ev.Lifecycle(job=job, ts=t0 + 3.0, node="n0", rank=2, event="exit",
                              exit_code=None, signal="SIG" + "X" * 600_000)
    before = worker.metrics()["trainguard_anomalies_out_total"]
    produce(config, steps(job, t0, 0, 5) + [exit_event])
    crash = reader.wait_for(lambda r: [a for a in r.anomalies(job) if a.kind == "crash"],
                            "the crash anomaly", worker=worker)
    assert crash[0].ranks == [2] and crash[0].evidence["truncated"] is True
    assert "truncated from" in crash[0].summary
    worker.wait_until(lambda m: m["trainguard_anomalies_out_total"] >= before + 1,
                      "the delivery counted")
    assert worker.metrics()["trainguard_anomalies_failed_total"] == 0


def test_poisoned_steps_and_times_are_dead_lettered_and_a_real_hang_is_still_found(
        worker_env):
    """Live: 4 ranks step every 0.5 s; among them a step 2**62 (normal ts), a step stamped
    ts=1.0 and a heartbeat ten years ahead. No hang while the job steps; then rank 2 stops
    in its data loader while every rank keeps sending heartbeats: one hang, naming rank 2,
    and no silent finding."""
    config, worker, reader = worker_env
    job = f"poison-{uuid.uuid4().hex[:6]}"
    before = worker.metrics()["trainguard_time_rejected_total"]

    def beat(rank, ts, step, phase, since=None):
        return ev.Heartbeat(job=job, ts=ts, node=f"n{rank // 2}", rank=rank, pid=100 + rank,
                            step=step, phase=phase,
                            phase_since=ts - 0.2 if since is None else since)

    def one(rank, s, ts):
        return ev.Step(job=job, ts=ts, node=f"n{rank // 2}", rank=rank, step=s,
                       step_time=0.5, compute_time=0.4, loss=2.0, grad_norm=1.0)

    future = 10 * 365 * 86400.0
    poison = {10: lambda now: [one(0, 2 ** 62, now)],
              20: lambda now: [one(1, 21, 1.0)],
              30: lambda now: [beat(3, now + future, 30, "forward")]}
    start = time.time()
    step = 0
    while time.time() - start < 30.0:              # 30 s of healthy stepping, in real time
        now = time.time()
        batch = [one(r, step, now) for r in range(4)]
        if step % 2 == 0:
            batch += [beat(r, now, step, "forward") for r in range(4)]
        batch += poison.get(step, lambda now: [])(now)
        produce(config, batch)
        step += 1
        time.sleep(max(0.0, start + step * 0.5 - time.time()))
    reader.poll(3.0)
    assert reader.anomalies(job) == [], "a finding while the job was stepping"
    last = step - 1
    stuck = time.time()       # the phases begin once and last: a hung job does not move on
    while time.time() - start < 80.0:              # rank 2 hangs in its data loader
        now = time.time()
        produce(config, [beat(r, now, last, "data" if r == 2 else "collective", stuck)
                         for r in range(4)])
        reader.poll(1.0)
        if [a for a in reader.anomalies(job) if a.kind == "hang"]:
            break
    hang = reader.wait_for(lambda r: [a for a in r.anomalies(job) if a.kind == "hang"],
                           "the real hang", timeout=30.0, worker=worker)
    assert hang[0].ranks == [2] and hang[0].severity == "critical"
    assert hang[0].step == last
    assert [a.kind for a in reader.anomalies(job) if a.kind != "hang"] == []
    refused = [d for d in dead_letters(reader) if job.encode() in
               __import__("base64").b64decode(d["raw_b64"] or "")]
    assert len(refused) == 3 and all(d["reason"].startswith("implausible") for d in refused)
    assert worker.metrics()["trainguard_time_rejected_total"] == before + 3


def test_an_evicted_job_is_restored_with_its_state_when_it_speaks_again(kafka_bootstrap,
                                                                       tmp_path):
    """With room for one job stage, job A is evicted when job B arrives; A's next steps
    are judged with what A learned before (its NaN episode is remembered, not reported
    again, and the step statistics go on), and A's crash is found."""
    config = new_config(kafka_bootstrap)
    w = WorkerProcess(config, f"e{uuid.uuid4().hex[:8]}", tmp_path / "data",
                      tmp_path / "worker.log")
    w.extra_args = ["--max-live-jobs", "1", "--max-live-ranks", "4"]
    reader = TopicReader(config, config.topics.anomalies)
    try:
        w.start()
        w.wait_ready()
        t0 = time.time()
        a, b = f"a-{uuid.uuid4().hex[:6]}", f"b-{uuid.uuid4().hex[:6]}"
        produce(config, steps(a, t0, 0, 5, nan_at=(3, 1)))
        reader.wait_for(lambda r: [x for x in r.anomalies(a) if x.kind == "nan"],
                        "job A's nan", worker=w)
        produce(config, steps(b, t0, 0, 5))
        w.wait_until(lambda m: m["trainguard_evictions_total"] >= 1
                     and m["trainguard_job_stages"] <= 1, "job A evicted")
        # A speaks again: rank 0 exits (its rank stage must remember step 5), then rank
        # 1's NaN record of step 3 comes again, late: A's job stage, restored, knows that
        # anomaly was sent (a fresh one would report it a second time)
        produce(config, [ev.Lifecycle(job=a, ts=t0 + 3.0, node="n0", rank=0, event="exit",
                                      exit_code=1)])
        crash = reader.wait_for(lambda r: [x for x in r.anomalies(a) if x.kind == "crash"],
                                "job A's crash after its restore", worker=w)
        assert "after step 5" in crash[0].summary
        produce(config, [s for s in steps(a, t0, 3, 3, nan_at=(3, 1)) if s.rank == 1])
        reader.poll(8.0)
        assert [x.step for x in reader.anomalies(a) if x.kind == "nan"] == [3]
        values = w.metrics()
        assert values["trainguard_restore_failures_total"] == 0
        assert values["trainguard_evictions_total"] >= 2
    finally:
        reader.close()
        w.stop(grace=5)


def set_max_message_bytes(config, topic: str, size: int) -> None:
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource

    resource = ConfigResource("topic", topic, incremental_configs=[ConfigEntry(
        "max.message.bytes", str(size), incremental_operation=AlterConfigOpType.SET)])
    admin = AdminClient(config.kafka())
    for future in admin.incremental_alter_configs([resource]).values():
        future.result(timeout=15)


def committed(config, group: str, topic: str) -> int:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(config.kafka(**{"group.id": group, "enable.auto.commit": False}))
    try:
        parts = [TopicPartition(topic, p) for p in partitions_of(config, topic)]
        return sum(max(0, tp.offset) for tp in consumer.committed(parts, timeout=10))
    finally:
        consumer.close()


def end_offset(config, topic: str) -> int:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(config.kafka(**{"group.id": "trainguard-unused-watermarks"}))
    try:
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                   for p in partitions_of(config, topic))
    finally:
        consumer.close()


def test_failed_deliveries_hold_the_commits_until_they_go_through(kafka_bootstrap, tmp_path):
    """The broker refuses the worker's summaries, then its anomaly (a topic limit far too
    small): the offsets behind them are not committed, nothing is counted as sent, and
    once the limits are lifted the same messages go through and the anomaly arrives."""
    config = new_config(kafka_bootstrap)
    worker_id = f"d{uuid.uuid4().hex[:8]}"
    names = WorkerSettings(prefix=config.topics.prefix, worker_id=worker_id)
    w = WorkerProcess(config, worker_id, tmp_path / "data", tmp_path / "worker.log")
    reader = TopicReader(config, config.topics.anomalies)
    job = f"held-{uuid.uuid4().hex[:6]}"
    try:
        w.start()
        w.wait_ready()
        set_max_message_bytes(config, names.summaries_topic, 64)
        set_max_message_bytes(config, config.topics.anomalies, 64)
        produce(config, steps(job, time.time(), 0, 9, nan_at=(6, 1)))
        w.wait_until(lambda m: m["trainguard_deliveries_failed_total"] >= 2
                     and m["trainguard_snapshot_failures_total"] >= 2, "refused summaries")
        assert committed(config, names.rank_group, config.topics.telemetry) == 0
        set_max_message_bytes(config, names.summaries_topic, 1048588)
        w.wait_until(lambda m: m["trainguard_anomalies_failed_total"] >= 2, "a refused anomaly")
        assert w.metrics()["trainguard_anomalies_out_total"] == 0
        assert committed(config, names.rank_group, config.topics.telemetry) == 40
        # summaries that found nothing may be committed before the one that found the nan
        # arrives (the refused ones go again one by one); from then on nothing is
        held = committed(config, names.app_id, names.summaries_topic)
        assert held < end_offset(config, names.summaries_topic)
        failures = w.metrics()["trainguard_snapshot_failures_total"]
        w.wait_until(lambda m: m["trainguard_snapshot_failures_total"] >= failures + 2,
                     "two more checkpoints held back")
        assert committed(config, names.app_id, names.summaries_topic) == held
        assert reader.anomalies(job) == []
        set_max_message_bytes(config, config.topics.anomalies, 1048588)
        nan = reader.wait_for(lambda r: [a for a in r.anomalies(job) if a.kind == "nan"],
                              "the nan once the limit is lifted", worker=w)
        assert nan[0].ranks == [1] and nan[0].step == 6
        w.wait_until(lambda m: m["trainguard_anomalies_out_total"] >= 1, "the anomaly counted")
        end = end_offset(config, names.summaries_topic)
        w.wait_until(lambda m: committed(config, names.app_id, names.summaries_topic) >= end,
                     "the job side's commit")
    finally:
        reader.close()
        w.stop(grace=5)


def test_a_month_old_recording_replayed_is_judged_not_dead_lettered(worker_env, tmp_path):
    import subprocess
    import sys

    from trainguard.recording import RecordingWriter

    config, worker, reader = worker_env
    job = f"old-{uuid.uuid4().hex[:6]}"
    path = tmp_path / "old.jsonl"
    with RecordingWriter(path) as out:
        for e in steps(job, time.time() - 30 * 86400.0, 0, 9, nan_at=(6, 3)):
            out.write_raw(ev.encode(e))
    before = worker.metrics()["trainguard_time_rejected_total"]
    replay = subprocess.run(
        [sys.executable, "-m", "trainguard.cli", "replay", str(path), "--speed", "0",
         "--bootstrap", config.bootstrap, "--prefix", config.topics.prefix],
        capture_output=True, text=True, timeout=120)
    assert replay.returncode == 0, replay.stderr
    nan = reader.wait_for(lambda r: [a for a in r.anomalies(job) if a.kind == "nan"],
                          "the nan of the old recording", worker=worker)
    assert nan[0].ranks == [3] and nan[0].step == 6
    assert worker.metrics()["trainguard_time_rejected_total"] == before


def test_the_worker_learns_from_a_false_alarm_on_the_actions_topic(worker_env):
    """Issue 10 point 6, live: after the action service's false-alarm record (a 45 s pause
    between steps was no hang), the same job pausing 30 s (beyond the 20 s step timeout it
    had) is not reported; the record is counted as learned."""
    config, worker, reader = worker_env
    job = f"learn-{uuid.uuid4().hex[:6]}"
    before = worker.metrics()["trainguard_false_alarms_learned_total"]
    start = time.time()
    step = 0
    while time.time() - start < 8.0:               # 0.5 s steps: a 20 s step timeout
        produce(config, [ev.Step(job=job, ts=time.time(), node="n0", rank=r, step=step,
                                 step_time=0.5, compute_time=0.4, loss=2.0) for r in range(2)])
        step += 1
        time.sleep(0.5)
    record = ev.Action(job=job, ts=time.time(), incident="inc-x", action="none",
                       status="rate_limited", reason="false_alarm: moved on",
                       targets={"job": job, "false_alarm": {"kind": "hang", "phase": None,
                                                            "stalled_s": 45.0}},
                       extra={"code": "false_alarm", "action_id": uuid.uuid4().hex})
    producer = Producer(config.kafka())
    producer.produce(config.topics.actions, ev.encode(record), job.encode())
    assert producer.flush(15) == 0
    worker.wait_until(lambda m: m["trainguard_false_alarms_learned_total"] >= before + 1,
                      "the false alarm learned")
    pause = time.time()
    while time.time() - pause < 32.0:              # heartbeats only, the phase unchanged
        produce(config, [ev.Heartbeat(job=job, ts=time.time(), node="n0", rank=r, pid=10 + r,
                                      step=step - 1, phase="data", phase_since=pause)
                         for r in range(2)])
        reader.poll(1.0)
    assert [a.kind for a in reader.anomalies(job)] == []
    produce(config, [ev.Step(job=job, ts=time.time(), node="n0", rank=r, step=step,
                             step_time=30.0, loss=2.0) for r in range(2)])
