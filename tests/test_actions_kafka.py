"""The action service and the supervisor through the real broker."""
import base64
import json
import os
import sys
import threading
import time

import pytest

from actions_harness import (PYTHON, Collector, Procs, produce, read_log, wait_for,
                             write_child)
from trainguard import events as ev
from trainguard.actions.policy import CaptureSettings, Policy
from trainguard.actions.service import build_service, read_back
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


def test_invalid_messages_go_to_the_dead_letter_topic(kafka_config, tmp_path):
    from confluent_kafka import Producer

    dead = Collector(kafka_config, kafka_config.topics.deadletter)
    try:
        with InProcessService(kafka_config, ServiceState()):
            p = Producer(kafka_config.kafka())
            p.produce(kafka_config.topics.anomalies, value=b'{"v": 1, "type": "anomaly"}')
            p.flush(10)
            deadline = time.monotonic() + 20
            raw = []
            while not raw and time.monotonic() < deadline:
                msg = dead.source.consumer.poll(0.2)
                if msg is not None and not msg.error():
                    raw.append(json.loads(msg.value()))
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


def answer_captures(config, stop, ranks=4, stuck=2, node="hostA"):
    """A stand-in node agent: answers capture_stacks with rank ``stuck`` in load_batch."""
    from trainguard.actions.service import KafkaSource

    commands = KafkaSource(config, config.topics.commands, since=time.time() - 5)
    try:
        while not stop.is_set():
            cmd = commands.poll(0.1)
            if not isinstance(cmd, ev.Command):
                continue
            replies = []
            for rank in range(ranks):
                fn = "load_batch" if rank == stuck else "all_reduce"
                frames = [{"function": fn, "file": "/w/train.py", "line": 1},
                          {"function": "main", "file": "/w/train.py", "line": 2}]
                replies.append(ev.Stack(job=cmd.job, ts=time.time(), node=node, rank=rank,
                                        capture_id=cmd.capture_id, pid=100 + rank,
                                        method="py-spy", threads=[
                                            {"name": "MainThread", "id": 1, "frames": frames}]))
            produce(config, config.topics.stacks, *replies)
    finally:
        commands.close()


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
