"""Issue 24: learning from outcomes. A false alarm closed with ``trainguard feedback`` is not
raised again for the same job shape (through the worker's job side: its JobProcessor's stage
and the feedback feed), a confirmed fault is kept, a reset forgets, and a forged or unsigned
feedback is refused and dead-lettered."""
from __future__ import annotations

import json
import time

from trainguard import events as ev
from trainguard.config import Topics
from trainguard.detectors import Engine, JobStage
from trainguard.signing import SigningKeys, Verifier, generate_key, sign
from trainguard.streams.feedback_feed import FeedbackFeed
from trainguard.streams.processors import JobProcessor

from scenarios import Fault, Scenario, generate
from test_false_alarms import Producer

# an epoch boundary bumps the loss 1.6x every 300 steps: a loss_spike the first time
SHAPE = Scenario(name="epoch-bumps", dp=8, steps=900, step_time=1.0, checkpoint_every=0,
                 faults=(Fault(kind="spike", step=300, factor=1.6),
                         Fault(kind="spike", step=600, factor=1.6)), seed=3)


def worker_job_side(keys):
    jobs = JobProcessor(JobStage)
    stage = jobs._slot("j", 0).stage
    engine = Engine()
    engine._jobs["j"] = stage
    feed = FeedbackFeed(kafka={}, topics=Topics(prefix="tg"), processor=jobs,
                        verifier=Verifier(keys), keys=keys)
    feed.producer = Producer()
    return engine, stage, feed


def play(engine, events):
    for e in events:
        engine.update(e)
        engine.advance(e.ts)


def feedback(keys, verdict="false_alarm", incident=None, **kw):
    return sign(ev.Feedback(job="j", ts=time.time(), feedback_id=kw.pop("fid", "f1"),
                            verdict=verdict, incident=incident, by="alice@login1", **kw),
                keys)


def test_a_false_alarm_is_not_raised_again_for_the_same_job_shape():
    keys = SigningKeys.parse(generate_key())
    events, _ = generate(SHAPE)
    cut = next(e.ts for e in events if e.type == "step" and e.step == 450)
    half = [e for e in events if e.ts < cut]
    rest = events[len(half):]

    control, _, _ = worker_job_side(keys)
    play(control, events)
    assert [i["kind"] for i in control.incidents()] == ["loss_spike", "loss_spike"]

    engine, stage, feed = worker_job_side(keys)
    play(engine, half)
    [first] = engine.incidents()
    wire = ev.encode(feedback(keys, incident=first["id"]))
    learned = feed.handle(b"j", wire, 0, 7)
    assert learned["kind"] == "loss_spike"
    assert stage.detectors["loss_spike"].min_ratio > 1.6
    play(engine, rest)
    assert [i["id"] for i in engine.incidents()] == [first["id"]]   # not raised again

    [(topic, key, value)] = feed.producer.sent          # what it learned, on the audit log
    audit = ev.decode(value)
    assert topic == "tg.actions" and audit.extra["code"] == "feedback"
    assert Verifier(keys).check_signature(value) is None
    widened = audit.targets["learned"]["widened"]
    assert widened["loss_spike.min_ratio"] == {"was": 1.1, "now": learned["changes"][
        "loss_spike.min_ratio"][1]}
    assert json.loads(json.dumps(audit.targets)) == audit.targets

    assert feed.handle(b"j", ev.encode(feedback(keys, verdict="reset", fid="f2")), 0, 8)
    assert stage.detectors["loss_spike"].min_ratio == 1.1
    assert stage.lessons.summary()["widened"] == {}


def test_a_confirmed_fault_is_kept_and_the_examples_are_bounded():
    keys = SigningKeys.parse(generate_key())
    _, stage, feed = worker_job_side(keys)
    for n in range(30):
        feed.handle(b"j", ev.encode(feedback(keys, "confirmed", f"inc-{n}", kind="straggler",
                                             fid=f"c{n}")), 0, n)
    summary = stage.lessons.summary()
    assert len(summary["confirmed"]) == 20 and summary["confirmed"][-1]["incident"] == "inc-29"
    assert stage.detectors["straggler"].ratio == 1.2            # a fault widens nothing
    for n in range(6):                                          # widening is capped
        feed.handle(b"j", ev.encode(feedback(keys, incident=f"inc-s{n}", kind="straggler",
                                             fid=f"s{n}")), 1, n)
    assert stage.lessons.widenings["straggler"] <= 3
    assert stage.detectors["straggler"].ratio == 2.0            # ... and never past its cap
    assert len(stage.lessons.summary()["false_alarms"]) == 6


def test_forged_unsigned_and_unknown_feedback_is_refused_and_dead_lettered():
    keys = SigningKeys.parse(generate_key())
    _, stage, feed = worker_job_side(keys)
    before = stage.detectors["straggler"].ratio
    unsigned = ev.encode(feedback(None, incident="inc-1", kind="straggler", fid="u1"))
    forged = ev.encode(feedback(keys, incident="inc-1", kind="straggler", fid="g1")).replace(
        b'"straggler"', b'"throughput_drop"')
    other_key = ev.encode(feedback(SigningKeys.parse(generate_key()), incident="inc-1",
                                   kind="straggler", fid="k1"))
    unknown = ev.encode(feedback(keys, incident="inc-nowhere", fid="n1"))
    for n, wire in enumerate((unsigned, forged, other_key, unknown)):
        assert feed.handle(b"j", wire, 0, n) is None
    assert stage.detectors["straggler"].ratio == before
    assert stage.detectors["throughput"].ratio == 1.25
    reasons = [json.loads(v)["reason"] for t, _, v in feed.producer.sent]
    assert all(t == "tg.deadletter" for t, _, _ in feed.producer.sent)
    assert [r.split(":")[1].strip() for r in reasons] == [
        "unsigned", "bad_signature", "unknown_key", "unknown_incident"]
    assert feed.refused == 4 and feed.learned == 0


def test_orders_acks_and_other_jobs_are_left_alone():
    keys = SigningKeys.parse(generate_key())
    _, stage, feed = worker_job_side(keys)
    order = sign(ev.Order(job="j", ts=time.time(), order_id="o1", op="restart", targets={}),
                 keys)
    assert feed.handle(b"j", ev.encode(order), 0, 1) is None
    other = sign(ev.Feedback(job="k", ts=time.time(), feedback_id="x1", verdict="confirmed",
                             incident="inc-1", kind="nan"), keys)
    assert feed.handle(b"k", ev.encode(other), 0, 2) is None
    assert feed.producer.sent == [] and stage.lessons.summary()["confirmed"] == []


def test_the_action_service_and_the_recorder_know_feedback_belongs_on_the_orders_topic():
    """The action service watches the orders topic too: a feedback is the worker's, not a
    stray event to dead-letter; a recording of the orders topic replays it there."""
    from types import SimpleNamespace

    from trainguard.actions.service import _OrderWatcher
    from trainguard.streams.recorder import topic_for

    keys = SigningKeys.parse(generate_key())
    raw = ev.encode(feedback(keys, incident="inc-1", kind="straggler"))
    dead = []
    watcher = _OrderWatcher.__new__(_OrderWatcher)
    watcher.desk, watcher.started = None, 0.0
    watcher.deadletter = lambda msg, reason: dead.append(reason)
    msg = SimpleNamespace(error=lambda: None, value=lambda: raw, timestamp=lambda: (1, 2e12))
    watcher._one(msg)
    assert dead == []
    stray = ev.encode(ev.Xid(job="j", ts=time.time(), xid=79, source="kmsg", message="x"))
    watcher._one(SimpleNamespace(error=lambda: None, value=lambda: stray,
                                 timestamp=lambda: (1, 2e12)))
    assert dead == ["a xid event does not belong on the orders topic"]
    assert topic_for(ev.decode(raw), Topics(prefix="tg")) == "tg.orders"
