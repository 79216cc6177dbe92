"""``trainguard record`` / ``trainguard replay``: the pure parts, and one round trip through
the real broker (produce, record, replay under another prefix and job, read back)."""
from __future__ import annotations

import gzip
import json
import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from trainguard import cli
from trainguard import events as ev
from trainguard.config import Config, Topics
from trainguard.recording import ReadStats, read_events
from trainguard.streams.recorder import (Pacer, RecordFilter, message_key, rewrite, topic_for)
from trainguard.topics import TopicPlan, create_topics

from events_factory import examples

TOPICS = Topics(prefix="tg")


def test_every_type_goes_to_its_topic_with_the_collectors_key():
    where = {e.type: (topic_for(e, TOPICS), message_key(e)) for e in examples()}
    assert where["step"] == ("tg.telemetry", b"j1/0")
    assert where["gpu"][0] == where["xid"][0] == where["lifecycle"][0] == "tg.telemetry"
    assert where["xid"][1] == b"j1/n1"
    assert where["command"][0] == "tg.commands" and where["stack"] == ("tg.stacks", b"j1/2")
    assert where["anomaly"] == ("tg.anomalies", b"j1")
    assert where["action"] == ("tg.actions", b"j1")


def test_rewrite_moves_job_and_every_timestamp():
    for event in examples():
        moved = rewrite(event, job="replayed", shift=100.0)
        assert moved.job == "replayed" and moved.ts == event.ts + 100.0
        assert ev.encode(ev.decode(ev.encode(moved))) == ev.encode(moved)
        if event.type == "anomaly":
            assert moved.id != event.id and moved.onset_ts == event.onset_ts + 100.0
            assert moved.detected_ts == event.detected_ts + 100.0
            assert rewrite(event, job="replayed").id == moved.id       # deterministic
        if event.type == "action":
            assert moved.incident != event.incident
        if event.type == "heartbeat":
            assert moved.phase_since == event.phase_since + 100.0
    same = examples()[0]
    assert rewrite(same) is same and rewrite(same, job=same.job) is same


def test_pacer_follows_recorded_time_divided_by_speed():
    now = [0.0]
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    pacer = Pacer(speed=4.0, clock=lambda: now[0], sleep=sleep)
    for ts in (10.0, 12.0, 11.0, 18.0):          # out-of-order ts never sleeps backwards
        pacer.wait(ts)
    assert slept == [0.5, 1.5]
    fast = Pacer(speed=0.0, clock=lambda: 0.0, sleep=slept.append)
    fast.wait(1.0)
    fast.wait(1000.0)
    assert slept == [0.5, 1.5]


def test_record_filter_keeps_valid_envelopes_of_the_job_on_one_line():
    keep = RecordFilter(job="j1")
    pretty = json.dumps(ev.to_dict(examples()[4]), indent=2).encode()   # valid, multi-line
    lines = [keep.line(raw) for raw in
             (pretty, b"garbage", None, ev.encode(examples()[0].replace(job="j2")))]
    assert lines[1:] == [None, None, None]
    assert b"\n" not in lines[0] and ev.decode(lines[0]) == examples()[4]
    assert (keep.kept, keep.invalid, keep.other_jobs) == (1, 2, 1)


def _read_all(config: Config, topics: list[str], want: int, timeout: float = 30.0) -> list:
    consumer = Consumer(config.kafka(**{"group.id": uuid.uuid4().hex}))
    meta = consumer.list_topics(timeout=10).topics
    consumer.assign([TopicPartition(t, p, 0) for t in topics for p in meta[t].partitions])
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < want and time.monotonic() < deadline:
        out += [(m.topic(), m.key(), m.value()) for m in consumer.consume(1000, 0.5)
                if not m.error()]
    consumer.close()
    return out


@pytest.mark.broker
@pytest.mark.slow
def test_record_and_replay_round_trip_through_the_broker(kafka_config, kafka_bootstrap, tmp_path,
                                                         capsys):
    source = kafka_config
    events = [e for e in examples()] + [e.replace(job="other") for e in examples()]
    producer = Producer(source.kafka(**{"compression.type": "lz4"}))
    for e in events:
        producer.produce(topic_for(e, source.topics), ev.encode(e), message_key(e))
    producer.produce(source.topics.telemetry, b"not an event", b"j1/0")
    assert producer.flush(10) == 0

    out = tmp_path / "rec.jsonl.gz"
    base = ["--bootstrap", kafka_bootstrap, "--prefix", source.topics.prefix]
    assert cli.main(["record", "--out", str(out), "--job", "j1", "--seconds", "3",
                     "--from-beginning", *base]) == 0
    assert "1 invalid" in capsys.readouterr().err
    recorded = list(read_events(out))
    mine = [e for e in events if e.job == "j1"]
    assert sorted(map(ev.encode, recorded)) == sorted(map(ev.encode, mine))
    def where(e):
        return topic_for(e, source.topics), message_key(e)

    for place in {where(e) for e in mine}:            # per topic and key: in order
        assert [ev.encode(e) for e in recorded if where(e) == place] == \
               [ev.encode(e) for e in mine if where(e) == place]

    with gzip.open(out, "ab") as f:
        f.write(b"{broken line\n")
    target = Config(bootstrap=kafka_bootstrap, topics=Topics(prefix=f"r{uuid.uuid4().hex[:9]}"))
    create_topics(target, TopicPlan(telemetry_partitions=4, other_partitions=2))
    began = time.time()
    assert cli.main(["replay", str(out), "--speed", "0", "--job", "again", "--retime",
                     "--bootstrap", kafka_bootstrap, "--prefix", target.topics.prefix]) == 0
    report = capsys.readouterr().err
    assert f"{len(mine)} events" in report and "1 invalid lines skipped" in report
    names = [target.topics.telemetry, target.topics.commands, target.topics.stacks,
             target.topics.anomalies, target.topics.actions, target.topics.orders]
    got = _read_all(target, names, len(mine))
    assert len(got) == len(mine)
    for topic, key, value in got:
        e = ev.decode(value)
        assert e.job == "again" and topic == topic_for(e, target.topics)
        assert key == message_key(e) and abs(e.ts - began) < 60
    stats = ReadStats()
    list(read_events(out, stats))
    assert stats.invalid == 1
