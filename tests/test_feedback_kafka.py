"""Issue 24 online: `trainguard feedback` through the real broker to a real `trainguard worker`.

A job whose loss bumps 1.6x every 300 steps (an epoch boundary: no fault) runs through the
worker, which reports the first bump as a ``loss_spike``. ``trainguard feedback INC
--false-alarm`` (a CLI subprocess, signed with the shared key, the job looked up from the
incident on the anomalies topic) reaches the worker on the orders topic; the rest of the same
job then raises no ``loss_spike`` again (offline, the same recording raises two). A feedback
without a signature and a forged one are dead-lettered with their reasons, and teach nothing.
``trainguard config show --job`` shows what was learned, and ``trainguard feedback --reset
--job`` forgets it.
"""
from __future__ import annotations

import json
import os
import subprocess
import time
import uuid

import pytest

from scenarios import Fault, Scenario, _skewed, generate
from test_streams_worker import TRAINGUARD, TopicReader, WorkerProcess, produce
from trainguard import events as ev
from trainguard.detectors import Engine
from trainguard.signing import KEY_ENV, SigningKeys, sign

pytestmark = [pytest.mark.broker, pytest.mark.slow]

KEY = "5f1c0ffee0ddba11cafe5eed0b5e55ed"
STEP_TIME = 0.1
CUT = 450          # the feedback comes between the two bumps


def shape(job: str) -> Scenario:
    return Scenario(name="epoch-bumps", job=job, dp=8, steps=900, step_time=STEP_TIME,
                    checkpoint_every=0, seed=3,
                    faults=(Fault(kind="spike", step=300, factor=1.6),
                            Fault(kind="spike", step=600, factor=1.6),
                            Fault(kind="nan", step=880, ranks=(5,))))   # the end marker


def at(events: list, first_ts: float) -> list:
    """``events`` moved in time so that the first is at ``first_ts`` (wall time)."""
    offset = first_ts - events[0].ts
    return [_skewed(e, offset) for e in events]


def feed_paced(kafka_config, events: list, steps_per_batch: int = 10,
               pause_s: float = 0.2) -> None:
    """``events`` sent as collectors send them, a few steps at a time (twice real time
    here), not as one backlog: this test is about feedback. A backlog of hundreds of steps
    that reaches the worker at once over several partitions goes beyond a step's window
    (``detectors.stages.step_window``), and a partition not heard of yet cannot hold the job's
    clock back (docs/WORKER.md, "Scaling")."""
    batch, first_step = [], None
    for e in events:
        step = getattr(e, "step", None)
        if step is not None and first_step is None:
            first_step = step
        if step is not None and step - first_step >= steps_per_batch:
            produce(kafka_config, batch)
            time.sleep(pause_s)
            batch, first_step = [], step
        batch.append(e)
    if batch:
        produce(kafka_config, batch)


def cli(kafka_config, *args, timeout=60) -> subprocess.CompletedProcess:
    argv = [TRAINGUARD, *args, "--bootstrap", kafka_config.bootstrap, "--prefix",
            kafka_config.topics.prefix]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, KEY_ENV: KEY})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def config_show(kafka_config, job: str, capsys) -> str:
    from trainguard.cli import main

    capsys.readouterr()
    assert main(["config", "show", "--job", job, "--bootstrap", kafka_config.bootstrap,
                 "--prefix", kafka_config.topics.prefix]) == 0
    return capsys.readouterr().out


def progress(worker) -> str:
    """The worker's counters that say how far it got (for a failure's message)."""
    values = worker.metrics() or {}
    return ", ".join(f"{k.removeprefix('trainguard_')}={v:g}" for k, v in sorted(values.items())
                     if k.startswith("trainguard_") and k.endswith("_total") and v)


def decoded(reader: TopicReader, suffix: str, job: str) -> list:
    return [e for topic, _, value in reader.seen if topic.endswith(suffix)
            for e in [ev.decode(value)] if e.job == job]


def test_feedback_through_the_broker_teaches_the_worker_and_forgeries_do_not(
        kafka_config, tmp_path, monkeypatch, capsys):
    started = time.monotonic()
    monkeypatch.setenv(KEY_ENV, KEY)           # the worker's key (the CLI gets it too)
    job = f"fb-{uuid.uuid4().hex[:8]}"
    events, _ = generate(shape(job))
    offline, found = Engine(), []
    for e in events:
        found += offline.update(e) + offline.advance(e.ts)
    assert sorted({a.step for a in found if a.kind == "loss_spike"}) == [300, 600]  # both

    topics = kafka_config.topics
    worker = WorkerProcess(kafka_config, f"fb{uuid.uuid4().hex[:8]}", tmp_path / "data",
                           tmp_path / "worker.log").start()
    reader = TopicReader(kafka_config, topics.anomalies, topics.actions, topics.deadletter)
    try:
        worker.wait_ready()
        cut = next(i for i, e in enumerate(events) if e.type == "step" and e.step == CUT)
        first = at(events[:cut], time.time() - (events[cut - 1].ts - events[0].ts))
        feed_paced(kafka_config, first)
        try:
            spike = reader.wait_for(lambda r: [a for a in decoded(r, ".anomalies", job)
                                               if a.type == "anomaly"
                                               and a.kind == "loss_spike"],
                                    "the first loss_spike", timeout=90, worker=worker)[0]
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nworker counters: {progress(worker)}") from None
        incident = reader.wait_for(lambda r: [i for i in decoded(r, ".anomalies", job)
                                              if i.type == "incident"
                                              and spike.id in i.anomalies],
                                   "its incident", worker=worker)[0]

        # people's verdict, a real CLI process; the job is looked up from the incident
        said = cli(kafka_config, "feedback", incident.id, "--false-alarm").stdout
        assert f"job {job}: incident {incident.id}: false alarm" in said and "(signed)" in said
        # an unsigned and a forged verdict on the same incident, straight onto the topic
        unsigned = ev.Feedback(job=job, ts=time.time(), feedback_id="unsigned-1",
                               verdict="false_alarm", incident=incident.id, by="mallory")
        forged = ev.encode(sign(ev.Feedback(
            job=job, ts=time.time(), feedback_id="forged-1", verdict="confirmed",
            incident=incident.id, kind="nan", by="alice"), SigningKeys.parse(KEY)))
        forged = forged.replace(b'"confirmed"', b'"reset"')
        from confluent_kafka import Producer

        p = Producer(kafka_config.kafka())
        p.produce(topics.orders, ev.encode(unsigned), job.encode())
        p.produce(topics.orders, forged, job.encode())
        assert p.flush(10) == 0

        audit = reader.wait_for(lambda r: [a for a in decoded(r, ".actions", job)
                                           if a.extra.get("code") == "feedback"],
                                "the worker's record of what it learned", worker=worker)
        assert audit[0].targets["feedback"]["verdict"] == "false_alarm"
        widened = audit[0].targets["learned"]["widened"]
        assert widened["loss_spike.min_ratio"]["now"] > 1.6 > widened[
            "loss_spike.min_ratio"]["was"]

        # the rest of the same job: the second bump is not raised again
        rest = at(events[cut:], time.time())
        feed_paced(kafka_config, rest)
        reader.wait_for(lambda r: [a for a in decoded(r, ".anomalies", job)
                                   if a.type == "anomaly" and a.kind == "nan"],
                        "the nan at the end of the job", worker=worker)
        found = decoded(reader, ".anomalies", job)
        spikes = [a for a in found if a.type == "anomaly" and a.kind == "loss_spike"]
        assert {a.id for a in spikes} == {spike.id}, [(a.step, a.summary) for a in spikes]
        latest = [i for i in found if i.type == "incident" and i.id == incident.id][-1]
        assert latest.anomalies == [spike.id]

        dead = reader.wait_for(
            lambda r: [rec for t, _, v in r.seen if t == topics.deadletter
                       for rec in [json.loads(v)] if rec["topic"] == topics.orders]
            if len([1 for t, _, v in r.seen if t == topics.deadletter
                    and b"feedback refused" in v]) >= 2 else None,
            "the two refusals on the dead-letter topic", worker=worker)
        reasons = sorted(rec["reason"] for rec in dead)
        assert reasons[0].startswith("feedback refused: bad_signature")
        assert reasons[1].startswith("feedback refused: unsigned")

        shown = config_show(kafka_config, job, capsys)
        assert "learned from feedback:" in shown and "detectors.loss_spike.min_ratio: 1.1 ->" \
            in shown and "false alarms: 1, confirmed faults: 0" in shown

        said = cli(kafka_config, "feedback", "--reset", "--job", job).stdout
        assert "reset" in said
        reader.wait_for(lambda r: [a for a in decoded(r, ".actions", job)
                                   if a.extra.get("code") == "feedback"
                                   and a.targets["feedback"]["verdict"] == "reset"],
                        "the record of the reset", worker=worker)
        assert "learned from feedback: nothing" in config_show(kafka_config, job, capsys)
        metrics = worker.wait_until(
            lambda m: m.get("trainguard_feedback_learned_total") == 2
            and m.get("trainguard_feedback_refused_total") == 2, "the feedback counters")
        assert metrics["trainguard_feedback_learned_total"] == 2
    finally:
        reader.close()
        assert worker.stop(grace=15) in (0, -15), worker.tail()
    print(f"feedback online test: {time.monotonic() - started:.1f}s")
