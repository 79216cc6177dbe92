"""The action service and the supervisor through the real broker."""
import base64
import json
import os
import sys
import threading
import time

import pytest

from actions_harness import (PYTHON, Collector, Procs, answer_captures, produce, read_log,
                             wait_for, write_child)
from trainguard import events as ev
from trainguard.actions.policy import CaptureSettings, Policy
from trainguard.actions.service import build_service
from trainguard.actions.topic_io import read_back
from trainguard.actions.state import ServiceState

pytestmark = pytest.mark.broker


def anomaly(kind="crash", id="a1", ranks=(1,), nodes=("n1",), job="j1", onset=None):
    now = time.time()
    return ev.Anomaly(job=job, ts=now, id=id, kind=kind, severity="critical",
                      ranks=list(ranks), nodes=list(nodes), step=7,
                      onset_ts=onset if onset is not None else now - 1, detected_ts=now,
                      detector=kind, summary=f"{kind} in the test")


class InProcessService:
    """build_service() + run_kafka() in a thread, as ``trainguard actions`` runs them."""

    def __init__(self, config, state, policy=Policy()):
        self.stop = threading.Event()
        self.service, self.deadletter, self.close_io = build_service(
            config, policy, state, stop=self.stop, log=lambda m: None)
        self.thread = threading.Thread(target=self.service.run_kafka,
                                       args=(config, self.stop, self.deadletter), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(15)
        self.close_io()


def restarts(events, status="planned"):
    return [e for e in events if isinstance(e, ev.Action) and e.action == "restart"
            and e.status == status]


def test_service_consumes_an_anomaly_and_records_actions(kafka_config, tmp_path):
    actions = Collector(kafka_config, kafka_config.topics.actions)
    try:
        state = ServiceState.load(tmp_path / "state.json")
        with InProcessService(kafka_config, state):
            produce(kafka_config, kafka_config.topics.anomalies, anomaly())
            got = actions.wait(lambda es: [e for e in es if e.action == "alert"],
                               what="the alert record")
        kinds = [(e.action, e.status) for e in actions.events]
        assert kinds == [("restart", "planned"), ("alert", "done")]
        restart = actions.events[0]
        assert restart.job == "j1" and restart.incident == "inc-a1"  # correlated incident
        assert restart.extra["action_id"] == "inc-a1:restart" and got
        assert restart.extra["anomalies"] == ["a1"]
        assert "a1" in json.loads((tmp_path / "state.json").read_text())["seen"]
    finally:
        actions.close()


def dead_letters(collector, timeout: float = 20.0, more_s: float = 0.0) -> list[dict]:
    """The first dead-letter record(s) on ``collector``'s topic (JSON, not an event), and
    those that follow within ``more_s``."""
    deadline = time.monotonic() + timeout
    raw = []
    while time.monotonic() < deadline:
        msg = collector.source.consumer.poll(0.2)
        if msg is not None and not msg.error():
            raw.append(json.loads(msg.value()))
            if len(raw) == 1:
                deadline = min(deadline, time.monotonic() + more_s)
    return raw


def test_invalid_messages_go_to_the_dead_letter_topic(kafka_config, tmp_path):
    from confluent_kafka import Producer

    dead = Collector(kafka_config, kafka_config.topics.deadletter)
    try:
        with InProcessService(kafka_config, ServiceState()):
            p = Producer(kafka_config.kafka())
            p.produce(kafka_config.topics.anomalies, value=b'{"v": 1, "type": "anomaly"}')
            p.flush(10)
            raw = dead_letters(dead)
        assert raw and raw[0]["topic"] == kafka_config.topics.anomalies
        assert base64.b64decode(raw[0]["raw_b64"]) == b'{"v": 1, "type": "anomaly"}'
        assert "missing required field" in raw[0]["reason"]
    finally:
        dead.close()


def test_a_restarted_service_with_a_lost_state_file_does_not_restart_again(kafka_config,
                                                                          tmp_path):
    actions = Collector(kafka_config, kafka_config.topics.actions)
    try:
        first = anomaly(kind="gpu_fault")
        with InProcessService(kafka_config, ServiceState(tmp_path / "one.json")):
            produce(kafka_config, kafka_config.topics.anomalies, first)
            actions.wait(lambda es: restarts(es), what="the first restart")
        # the state file is lost; the new service reads the actions topic back
        state = ServiceState(tmp_path / "two.json")
        count = read_back(kafka_config, kafka_config.topics.actions, time.time() - 3600,
                          state.absorb)
        assert count >= 3 and state.seen_anomaly("a1")
        with InProcessService(kafka_config, state):
            produce(kafka_config, kafka_config.topics.anomalies, first)
            produce(kafka_config, kafka_config.topics.anomalies,
                    anomaly(kind="crash", id="a2", onset=first.onset_ts))
            actions.wait(lambda es: [e for e in es if e.incident == "inc-a2"
                                     and e.action == "restart"], what="the second incident")
        assert [e.incident for e in restarts(actions.events, "planned")] == ["inc-a1"]
        second = [e for e in actions.events if e.incident == "inc-a2"
                  and e.action == "restart"][0]
        assert second.status == "rate_limited" and second.extra["code"] == "covered"
    finally:
        actions.close()


@pytest.mark.slow
def test_hang_capture_restart_and_resume_through_kafka(kafka_config, tmp_path):
    """anomaly -> `trainguard actions` (capture through Kafka) -> signed orders on the orders
    topic -> `trainguard run` restarts the hung child, which resumes from its checkpoint; its
    acks come back and the service records their outcome (`done`) on the audit log."""
    script = write_child(tmp_path)
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"capture": {"rounds": 2, "interval_s": 0.5,
                                              "deadline_s": 5, "quiet_s": 0.5}}))
    env = {"TRAINGUARD_BOOTSTRAP": kafka_config.bootstrap,
           "TRAINGUARD_TOPIC_PREFIX": kafka_config.topics.prefix,
           "TRAINGUARD_SIGNING_KEY": "a-shared-test-key-of-the-deployment",
           "CHILD_LOG": str(tmp_path / "child.jsonl"), "CHILD_MODE": "hang@5",
           "CHILD_STEPS": "12", "CHILD_STEP_S": "0.05"}
    procs, stop = Procs(tmp_path), threading.Event()
    agent = threading.Thread(target=answer_captures, args=(kafka_config, stop), daemon=True)
    actions = Collector(kafka_config, kafka_config.topics.actions)
    telemetry = Collector(kafka_config, kafka_config.topics.telemetry)
    try:
        agent.start()
        procs.trainguard("actions", "actions", "--policy", str(policy), "--state",
                         str(tmp_path / "state.json"), env=env)
        run = procs.trainguard("run", "run", "--job", "jh", "--max-restarts", "2",
                               "--checkpoint-dir", str(tmp_path / "ckpt"), "--grace", "2",
                               "--", PYTHON, str(script), env=env)
        log = tmp_path / "child.jsonl"
        hang = wait_for(lambda: [e for e in read_log(log) if e["event"] == "hang"],
                        timeout=30, what="the child's hang")
        produce(kafka_config, kafka_config.topics.anomalies,
                anomaly(kind="hang", id="hang-1", ranks=[], nodes=[], job="jh",
                        onset=hang[0]["t"]))
        done = actions.wait(lambda es: [e for e in es if e.action == "restart"
                                        and e.status == "done"], timeout=40,
                            what="the acked outcome")
        assert run.wait(timeout=30) == 0, procs.log("run")
        starts = [e for e in read_log(log) if e["event"] == "start"]
        assert [(s["step"], s["resume"]) for s in starts] == [(0, None), (5, "1")]
        assert [e["step"] for e in read_log(log) if e["event"] == "step"] == list(range(12))
        by = {(e.action, e.status, e.extra.get("ack_status")) for e in actions.events}
        assert ("capture_stacks", "done", None) in by
        assert ("evict", "planned", None) in by  # one machine: nothing to exclude
        assert ("evict", "not_applicable", "not_applicable") in by
        assert not [e for e in actions.events if e.action == "evict" and e.status == "done"]
        assert ("restart", "planned", None) in by
        assert {e.extra.get("source") for e in actions.events} == {"actions"}
        assert "WARNING: no signing key" not in procs.log("run") + procs.log("actions")
        capture = [e for e in actions.events if e.action == "capture_stacks"][0]
        assert capture.targets["suspects"] == [2]
        assert done[0].extra["action_id"] == "inc-hang-1:restart"
        assert done[0].extra["order_id"] == [e for e in actions.events if e.action == "restart"
                                             and e.status == "planned"][0].extra["order_id"]
        assert starts[1]["exclude"] == "hostA"
        life = telemetry.wait(lambda es: [e for e in es if isinstance(e, ev.Lifecycle)
                                          and e.job == "jh" and e.event == "exit"
                                          and e.exit_code == 0], what="the exit lifecycle")
        assert life[0].rank is None
    finally:
        stop.set()
        procs.stop_all()
        actions.close()
        telemetry.close()
        agent.join(5)


def test_a_hang_is_not_kept_behind_unanswered_captures_of_other_jobs(kafka_config):
    """50 junk hangs whose captures nobody answers (20 s each) arrive first; the real hang,
    whose stacks come back, is restarted long before the first junk capture gives up."""
    topics = kafka_config.topics
    policy = Policy(capture=CaptureSettings(rounds=1, deadline_s=20.0))
    stop = threading.Event()
    agent = threading.Thread(target=answer_captures, args=(kafka_config, stop),
                             kwargs={"jobs": {"real"}}, daemon=True)
    actions = Collector(kafka_config, topics.actions)
    try:
        agent.start()
        with InProcessService(kafka_config, ServiceState(), policy=policy):
            junk = [anomaly(kind="hang", id=f"junk-{i}", ranks=[], nodes=[], job=f"junk-{i}")
                    for i in range(50)]
            produce(kafka_config, topics.anomalies, *junk,
                    anomaly(kind="hang", id="real-1", ranks=[], nodes=[], job="real"))
            actions.wait(lambda es: restarts([e for e in es if e.job == "real"]), timeout=40,
                         what="the real hang's restart")
            junk_records = [e for e in actions.events if e.job.startswith("junk")]
        mine = [(e.action, e.status) for e in actions.events if e.job == "real"]
        assert mine[:3] == [("capture_stacks", "done"), ("evict", "planned"),
                            ("restart", "planned")]
        assert not [e for e in junk_records if e.action == "restart"]  # still waiting
    finally:
        stop.set()
        agent.join(5)
        actions.close()


def test_empty_messages_neither_stop_the_watchers_nor_get_lost(kafka_config):
    """Empty messages on the telemetry topic are skipped (the steps behind them still reach
    the service, which then knows the job moved on: a false alarm, no restart); one on the
    anomalies topic is dead-lettered. The worker's incident events beside the anomalies
    (SPEC §6) are neither handled nor dead-lettered."""
    from confluent_kafka import Producer

    topics = kafka_config.topics
    dead = Collector(kafka_config, topics.deadletter)
    actions = Collector(kafka_config, topics.actions)
    try:
        with InProcessService(kafka_config, ServiceState()) as svc:
            p = Producer(kafka_config.kafka())
            for _ in range(20):
                p.produce(topics.telemetry, key=b"jx/0", value=None)
                p.produce(topics.telemetry, key=b"jx/0", value=b"")
            p.produce(topics.anomalies, key=b"jx", value=None)
            assert p.flush(10) == 0
            now = time.time()
            produce(kafka_config, topics.telemetry,
                    ev.Step(job="jx", ts=now - 60, rank=0, node="n0", step=40, step_time=1.0),
                    ev.Step(job="jx", ts=now - 2, rank=0, node="n0", step=41, step_time=1.0))
            confirm = next(s for s in svc.service.pipeline.stages if s.name == "confirm")
            wait_for(lambda: confirm.progress.progress_after("jx", 40, 0.0), timeout=20,
                     what="the steps behind the empty messages")
            hang = ev.Anomaly(job="jx", ts=now, id="hx", kind="hang", severity="critical",
                              ranks=[], nodes=[], step=40, onset_ts=now - 60, detected_ts=now,
                              detector="hang", summary="no step for 60s")
            incident = ev.Incident(job="jx", ts=now, id="hx", kind="hang", severity="critical",
                                   ranks=[], nodes=[], onset_ts=now - 60, detected_ts=now,
                                   summary="no step for 60s", anomalies=["hx"], step=40)
            produce(kafka_config, topics.anomalies, hang, incident)
            got = actions.wait(lambda es: [e for e in es if e.job == "jx"], timeout=20,
                               what="the false alarm")
        assert [(e.action, e.status) for e in got] == [("none", "rate_limited")]
        assert got[0].targets["false_alarm"]["resumed_step"] == 41
        raw = dead_letters(dead, more_s=2.0)  # the incident event's had its chance
        assert len(raw) == 1
        assert raw[0]["reason"] == "empty message" and raw[0]["raw_b64"] is None
        assert raw[0]["topic"] == topics.anomalies
    finally:
        dead.close()
        actions.close()


def test_offsets_of_finished_anomalies_are_committed(kafka_config):
    """A second service of the same consumer group, with an empty ledger, does not see the
    anomalies the first one finished: their offsets were committed."""
    actions = Collector(kafka_config, kafka_config.topics.actions)
    try:
        with InProcessService(kafka_config, ServiceState()):
            produce(kafka_config, kafka_config.topics.anomalies, anomaly(id="first"))
            actions.wait(lambda es: restarts(es), what="the first restart")
            time.sleep(1.5)  # a commit round (every 0.5 s)
        with InProcessService(kafka_config, ServiceState()):
            produce(kafka_config, kafka_config.topics.anomalies,
                    anomaly(kind="gpu_fault", id="second", job="j2"))
            actions.wait(lambda es: restarts([e for e in es if e.job == "j2"]),
                         what="the second anomaly's restart")
        assert [e.incident for e in restarts(actions.events)] == ["inc-first", "inc-second"]
    finally:
        actions.close()


def test_the_service_groups_anomalies_by_the_workers_incident_events(kafka_config):
    """The worker's output, as it publishes it (streams/processors.py ``_with_incidents``,
    streams/app.py ``emit``): each anomaly, then the incident it opened or grew, keyed by
    job, on the anomalies topic. The service's own fallback correlator is off, so any
    grouping comes from the incident events: the crash gets one restart, and the hang it
    caused is dropped as part of the same incident."""
    from confluent_kafka import Producer

    from streams.shorten import encode_finding
    from trainguard.detectors.correlate import Correlator

    actions = Collector(kafka_config, kafka_config.topics.actions)
    told = []
    stop = threading.Event()
    service, deadletter, close = build_service(kafka_config, Policy(), ServiceState(),
                                               stop=stop, log=told.append)
    correlate = next(s for s in service.pipeline.stages if s.name == "correlate")
    correlate.correlator = None                 # no grouping but the worker's
    thread = threading.Thread(target=service.run_kafka, args=(kafka_config, stop, deadletter),
                              daemon=True)
    thread.start()
    try:
        worker = Correlator()
        out = Producer(kafka_config.kafka(**{"linger.ms": 5}))
        earlier = worker.add(anomaly(kind="straggler", id="s0", job="j0"))
        out.produce(kafka_config.topics.anomalies, key=b"j0",
                    value=encode_finding(ev.Incident.of(earlier)))
        out.flush(10)       # the worker was publishing incidents before: they are expected
        wait_for(lambda: service.counts["incidents"] == 1, what="the earlier incident")
        for a in (anomaly(id="c1"), anomaly(kind="hang", id="h1", ranks=(), nodes=())):
            found = worker.add(a)
            for event in (a, ev.Incident.of(found)):
                out.produce(kafka_config.topics.anomalies, key=event.job.encode(),
                            value=encode_finding(event))
        assert out.flush(10) == 0
        wait_for(lambda: any("anomaly h1" in m for m in told), what="the hang's outcome")
        actions.wait(lambda es: [e for e in es if e.action == "alert"], what="the alert")
        assert [(e.action, e.status, e.incident) for e in actions.events] == [
            ("restart", "planned", "inc-c1"), ("alert", "done", "inc-c1")]
        hang = next(m for m in told if "anomaly h1" in m)
        assert "dropped: duplicate: incident inc-c1 already has a restart" in hang
        assert service.counts["incidents"] == 3 and service.book.incident_id("h1") == "inc-c1"
    finally:
        stop.set()
        thread.join(15)
        close()
        actions.close()
