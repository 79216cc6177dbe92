"""Per-job overrides through a real broker: `trainguard config set|unset|overrides`, the
compacted config topic, and the worker's ConfigFeed (signed records applied to a live job
stage and recorded on the audit log; forged ones dead-lettered, not applied)."""
import json
import time

import pytest

from actions_harness import Collector, producer, wait_for
from trainguard import events as ev
from trainguard.detectors import DetectorConfig, JobStage
from trainguard.overrides import OverrideBook, make_record
from trainguard.setting import with_values
from trainguard.signing import KEY_ENV, SigningKeys, Verifier

pytestmark = pytest.mark.broker

KEY = "0123456789abcdef0123456789abcdef"
BASE = with_values(DetectorConfig(), {"hang.checkpoint_s": 3.0})


def cli(kafka_config, *args):
    from trainguard.cli import main

    return main(["config", *args, "--bootstrap", kafka_config.bootstrap, "--prefix",
                 kafka_config.topics.prefix])


def test_the_config_topic_is_compacted(kafka_config):
    from confluent_kafka.admin import AdminClient, ConfigResource

    admin = AdminClient(kafka_config.kafka())
    resource = ConfigResource("topic", kafka_config.topics.config)
    configs = admin.describe_configs([resource])[resource].result(timeout=20)
    assert configs["cleanup.policy"].value == "compact"


def test_set_unset_and_list_through_the_topic(kafka_config, monkeypatch, capsys):
    monkeypatch.setenv(KEY_ENV, KEY)
    assert cli(kafka_config, "set", "--job", "j1", "detectors.hang.checkpoint_s=600",
               "detectors.silent.timeout_s=40") == 0
    assert "detectors.hang.checkpoint_s = 600.0 (was 1800.0)" in capsys.readouterr().out
    assert cli(kafka_config, "set", "--job", "j1", "detectors.hang.eval_s=900") == 0
    capsys.readouterr()
    assert cli(kafka_config, "overrides", "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["j1"]["values"] == {"detectors.hang.checkpoint_s": 600.0,
                                      "detectors.silent.timeout_s": 40.0,
                                      "detectors.hang.eval_s": 900.0}
    assert cli(kafka_config, "unset", "--job", "j1", "detectors.silent.timeout_s") == 0
    capsys.readouterr()
    assert cli(kafka_config, "overrides", "--json") == 0
    assert set(json.loads(capsys.readouterr().out)["j1"]["values"]) == {
        "detectors.hang.checkpoint_s", "detectors.hang.eval_s"}
    # a forged record on the topic is not taken as the job's current overrides
    p = producer(kafka_config)
    p.produce(kafka_config.topics.config, json.dumps(make_record(
        job="j1", values={"detectors.hang.checkpoint_s": 1.0}, ts=time.time(),
        override_id="forged", by="mallory")).encode(), b"j1")
    p.flush(10)
    assert cli(kafka_config, "overrides") == 0
    out = capsys.readouterr().out
    assert "detectors.hang.checkpoint_s = 600.0" in out and "1 records on the topic were " \
        "refused" in out
    assert cli(kafka_config, "unset", "--job", "j1") == 0
    capsys.readouterr()
    assert cli(kafka_config, "overrides") == 0
    assert "no per-job overrides" in capsys.readouterr().out


def test_the_feed_applies_a_signed_override_in_place_and_dead_letters_a_forged_one(
        kafka_config, monkeypatch):
    from trainguard.streams.config_feed import ConfigFeed
    from trainguard.streams.processors import JobProcessor

    keys = SigningKeys.parse(KEY)
    topics = kafka_config.topics
    book = OverrideBook(base=BASE)
    jobs = JobProcessor(lambda: JobStage(BASE), tune_stage=book.tune)
    live = JobStage(BASE)
    live.detectors["hang"]._n_intervals = 7            # something it learned
    from trainguard.streams.processors import JobSlot

    jobs.state.put(b"j1", JobSlot(live, 0))
    actions, deadletters = Collector(kafka_config, topics.actions), None
    from confluent_kafka import Consumer

    dead = Consumer(kafka_config.kafka(**{"group.id": "t-dead", "auto.offset.reset":
                                          "earliest"}))
    dead.subscribe([topics.deadletter])
    feed = ConfigFeed(kafka=kafka_config.kafka(), topics=topics, book=book, processor=jobs,
                      verifier=Verifier(keys), worker="w1", keys=keys)
    try:
        feed.start()
        assert feed.catch_up(5) == 0
        monkeypatch.setenv(KEY_ENV, KEY)
        assert cli(kafka_config, "set", "--job", "j1", "detectors.hang.checkpoint_s=60") == 0
        wait_for(lambda: feed.poll() or feed.applied, timeout=20, what="the override")
        hang = live.detectors["hang"]
        assert hang.checkpoint_s == 60.0 and hang._n_intervals == 7
        audit = actions.wait(lambda es: [e for e in es if e.extra.get("code") ==
                                         "config_override"], what="the audit record")
        assert audit[0].targets["changes"] == {
            "detectors.hang.checkpoint_s": {"old": 3.0, "new": 60.0}}
        assert audit[0].status == "done" and audit[0].targets["live_stages"] == 1
        assert Verifier(keys).check_signature(ev.encode(audit[0])) is None
        # forged: an unsigned record setting it back to 1 s
        p = producer(kafka_config)
        p.produce(topics.config, json.dumps(make_record(
            job="j1", values={"detectors.hang.checkpoint_s": 1.0}, ts=time.time(),
            override_id="forged", by="mallory")).encode(), b"j1")
        p.flush(10)
        wait_for(lambda: feed.poll() or feed.refused, timeout=20, what="the refusal")
        assert hang.checkpoint_s == 60.0
        deadline, record = time.monotonic() + 20, None
        while record is None and time.monotonic() < deadline:
            msg = dead.poll(0.5)
            if msg is not None and not msg.error():
                record = json.loads(msg.value())
        assert record["reason"].startswith("config override refused: unsigned")
        assert record["topic"] == topics.config
        # a fresh feed (a restarted worker) reads the topic from the beginning
        book2 = OverrideBook(base=BASE)
        feed2 = ConfigFeed(kafka=kafka_config.kafka(), topics=topics, book=book2,
                           processor=JobProcessor(lambda: JobStage(BASE)),
                           verifier=Verifier(keys), worker="w2", keys=keys)
        feed2.start()
        assert feed2.catch_up(10) == 2 and feed2.refused == 1
        assert book2.wanted("j1")["detectors.hang.checkpoint_s"] == 60.0
        feed2.close()
    finally:
        feed.close()
        dead.close()
        actions.close()
