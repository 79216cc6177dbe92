"""Issue 10 point 6: the worker's hang detector learns from the action service's false
alarms (streams/false_alarms.py), and nothing unsigned, forged or out of range teaches it."""
from __future__ import annotations

import time

from trainguard import events as ev
from trainguard.detectors import JobStage
from trainguard.signing import SigningKeys, Verifier, generate_key, sign
from trainguard.streams.false_alarms import FalseAlarmFeed
from trainguard.streams.processors import JobProcessor
from trainguard.config import Topics


class Producer:
    def __init__(self):
        self.sent = []

    def produce(self, topic, value, key=None):
        self.sent.append((topic, key, value))

    def poll(self, timeout=0):
        return 0

    def flush(self, timeout=0):
        return 0


def false_alarm(job="j", phase="checkpoint", stalled_s=52.0, kind="hang", ts=None, **extra):
    return ev.Action(job=job, ts=ts if ts is not None else time.time(), incident="inc-1",
                     action="none", status="rate_limited", reason="false_alarm: ...",
                     targets={"job": job, "false_alarm": {"kind": kind, "phase": phase,
                                                          "stalled_s": stalled_s}},
                     extra={"code": "false_alarm", "action_id": extra.get("action_id", "a1")})


def feed_with_stage(keys=None):
    jobs = JobProcessor(JobStage)
    stage = jobs._slot("j", 0).stage
    feed = FalseAlarmFeed(kafka={}, topics=Topics(prefix="tg"), processor=jobs,
                          verifier=Verifier(keys))
    feed.producer = Producer()
    return feed, stage


def test_a_signed_false_alarm_widens_that_phase_allowance():
    keys = SigningKeys.parse(generate_key())
    feed, stage = feed_with_stage(keys)
    hang = stage.detectors["hang"]
    before = hang.allowance("checkpoint")
    raw = ev.encode(sign(false_alarm(phase="checkpoint", stalled_s=2400.0), keys))
    assert feed.handle(b"j", raw, 0, 7)
    assert hang.allowance("checkpoint") == hang.phase_factor * 2400.0 > before
    assert feed.learned == 1 and feed.producer.sent == []
    assert not feed.handle(b"j", raw, 0, 7)       # the same record again: a replay
    assert feed.refused == 1


def test_between_steps_the_step_timeout_grows():
    feed, stage = feed_with_stage()
    for s in range(12):                           # one-second steps: a 20 s step timeout
        stage.update({"k": "step", "job": "j", "rank": 0, "node": "n1", "ts": 100.0 + s,
                      "step": s, "step_time": 1.0})
    hang = stage.detectors["hang"]
    assert hang.timeout() == hang.floor_s == 20.0
    assert feed.handle(b"j", ev.encode(false_alarm(phase=None, stalled_s=45.0)), 0, 1)
    assert hang.timeout() == 45.0


def test_unsigned_forged_and_absurd_records_teach_nothing_and_are_dead_lettered():
    keys = SigningKeys.parse(generate_key())
    other = SigningKeys.parse(generate_key())
    feed, stage = feed_with_stage(keys)
    hang = stage.detectors["hang"]
    before = hang.allowance("checkpoint")
    bad = [ev.encode(false_alarm(action_id="u")),                            # unsigned
           ev.encode(sign(false_alarm(action_id="f"), other)),               # another key
           ev.encode(sign(false_alarm(stalled_s=1e9, action_id="b"), keys)),  # out of range
           ev.encode(sign(false_alarm(ts=time.time() - 3600, action_id="s"), keys))]  # stale
    for i, raw in enumerate(bad):
        assert not feed.handle(b"j", raw, 0, i)
    assert hang.allowance("checkpoint") == before
    assert feed.refused == len(bad) and feed.learned == 0
    assert [t for t, _, _ in feed.producer.sent] == ["tg.deadletter"] * len(bad)


def test_other_records_and_other_jobs_are_left_alone():
    feed, stage = feed_with_stage()
    plain = ev.Action(job="j", ts=time.time(), incident="i", action="restart", status="done",
                      reason="restarted", targets={})
    assert not feed.handle(b"j", ev.encode(plain), 0, 1)
    assert not feed.handle(b"x", ev.encode(false_alarm(job="elsewhere")), 0, 2)
    assert not feed.handle(b"j", ev.encode(false_alarm(kind="silent")), 0, 3)
    assert not feed.handle(b"j", b"not json, but false_alarm", 0, 4)
    assert feed.learned == 0 and feed.refused == 0
