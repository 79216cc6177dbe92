"""``/metrics`` of every long-running service: the shared registry and server, then the action
service, ``trainguard run`` and the node agent as real processes on the real broker, each
scraped after real activity."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from trainguard import events as ev
from trainguard.broker import free_port
from trainguard.errors import UserError
from trainguard.metrics import Metric, Registry, parse_exposition, serve
from trainguard.service_metrics import SERVICES, ActionMetrics, AgentMetrics, RunMetrics

from http_receiver import HttpReceiver

TRAINGUARD = str(Path(sys.executable).parent / "trainguard")
XID_LINE = ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, "
            "GPU has fallen off the bus.\n")


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        return parse_exposition(reply.read().decode())


def scrape_until(port: int, predicate, timeout: float = 60.0, proc=None) -> dict:
    deadline, values = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        assert proc is None or proc.poll() is None, f"the service exited: {proc.returncode}"
        try:
            values = scrape(port)
        except (urllib.error.URLError, ConnectionError) as exc:
            values = {"error": repr(exc)}
            time.sleep(0.3)
            continue
        if predicate(values):
            return values
        time.sleep(0.3)
    raise AssertionError(f"metrics never matched; last scrape: {values}")


class Service:
    """A trainguard command as a real process; stderr kept for the failure message."""

    def __init__(self, *argv):
        self.proc = subprocess.Popen([TRAINGUARD, *argv], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.lines: list = []
        threading.Thread(target=lambda: self.lines.extend(self.proc.stderr),
                         daemon=True).start()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def kafka_flags(config) -> list:
    return ["--bootstrap", config.bootstrap, "--prefix", config.topics.prefix]


# ------------------------------------------------------------------ registry and server
def test_registry_checks_labels_and_escapes_values():
    r = Registry([Metric("alerts", "counter", "x", labels=("sink", "status"))])
    with pytest.raises(ValueError):
        r.inc("alerts", sink="slack")
    with pytest.raises(KeyError):
        r.inc("nope")
    r.inc("alerts", sink='a"b\\c\nd', status="sent")
    assert 'trainguard_alerts_total{sink="a\\"b\\\\c\\nd",status="sent"} 1.0' in r.exposition()


def test_unlabelled_counters_show_zero_before_anything_happens():
    values = parse_exposition(Registry(RunMetrics().registry.metrics.values()).exposition())
    assert values["trainguard_restarts_total"] == 0


def test_server_answers_metrics_only_and_a_busy_port_is_one_user_error():
    r = Registry([Metric("x_seconds", "gauge", "x")])
    r.set("x_seconds", 2.5)
    assert serve(r, 0) is None                                    # 0: metrics off
    server = serve(r, free_port())
    try:
        values = scrape(server.port)
        assert {k: v for k, v in values.items() if k.startswith("trainguard_")} == {
            "trainguard_x_seconds": 2.5}
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/other", timeout=5)
        assert err.value.code == 404
        with pytest.raises(UserError, match="--metrics-port"):
            serve(r, server.port)
    finally:
        server.close()
    with pytest.raises(UserError, match="0-65535"):
        serve(r, 70000)


def test_a_busy_port_leaves_the_service_running_without_metrics():
    from argparse import Namespace

    from trainguard.service_metrics import start_metrics

    r = Registry([Metric("x_seconds", "gauge", "x")])
    taken = serve(r, free_port())
    try:
        said = []
        assert start_metrics(r, Namespace(metrics_port=taken.port), "agent", said.append) is None
        assert len(said) == 1 and "running without /metrics" in said[0]
        assert start_metrics(r, Namespace(metrics_port=0), "agent", said.append) is None
        with pytest.raises(UserError):
            start_metrics(r, Namespace(metrics_port=-1), "agent")
    finally:
        taken.close()


def test_every_service_declares_distinct_names():
    seen = {}
    for service, (_, _, declarations) in SERVICES.items():
        for m in declarations():
            assert m.full_name not in seen, f"{m.full_name}: {service} and {seen[m.full_name]}"
            seen[m.full_name] = service


def test_action_metrics_count_orders_answers_and_their_delays():
    m = ActionMetrics()
    base = dict(job="j1", incident="i1", targets={}, reason="r")
    m.record(ev.Action(ts=100.0, action="evict", status="planned",
                       extra={"detected_ts": 97.0, "order_id": "o1"}, **base))
    m.record(ev.Action(ts=104.0, action="evict", status="failed",
                       extra={"order_id": "o1", "code": "no_ack"}, **base))
    m.order_sent("restart", "o2", 200.0, 199.0)        # where the order desk sends
    m.order_answered("restart", "already_satisfied", key="o2", ts=200.5)
    m.alert("slack", "rate_limited")
    v = parse_exposition(m.registry.exposition())
    assert v['trainguard_orders_sent_total{op="evict"}'] == 1
    assert v['trainguard_order_answers_total{op="evict",status="no_ack"}'] == 1
    assert v['trainguard_order_answers_total{op="restart",status="already_satisfied"}'] == 1
    assert v["trainguard_order_ack_seconds_count"] == 2
    assert v["trainguard_order_ack_seconds_sum"] == pytest.approx(4.5)
    assert v["trainguard_detection_to_order_seconds_sum"] == pytest.approx(4.0)
    assert v['trainguard_actions_total{action="evict",status="planned"}'] == 1
    assert v['trainguard_alerts_total{sink="slack",status="rate_limited"}'] == 1


def _crash(job="j1", id="a1", now=100.0):
    return ev.Anomaly(job=job, ts=now, id=id, kind="crash", severity="critical", ranks=[1],
                      nodes=["n1"], onset_ts=now - 1.0, detected_ts=now, detector="crash",
                      summary="rank 1 exited with code 1")


def test_the_action_service_is_counted_around_its_pipeline():
    from types import SimpleNamespace

    from trainguard.actions.alerts.base import SendResult
    from trainguard.actions.pipeline import build_pipeline

    from actions_harness import ListRecorder
    from trainguard.actions.policy import Policy
    from trainguard.actions.state import ServiceState
    from trainguard.service_metrics import instrument_action_service

    audit = ListRecorder()
    pipeline = build_pipeline(policy=Policy(), state=ServiceState(), recorder=audit,
                              notify=lambda message: [SendResult(sink="slack", status="sent")])
    service = SimpleNamespace(pipeline=pipeline)
    m = ActionMetrics()
    instrument_action_service(service, m)
    instrument_action_service(service, ActionMetrics())      # a recorder is wrapped once
    pipeline.process(_crash(), now=101.0)
    pipeline.process(_crash(), now=102.0)                   # a duplicate
    v = parse_exposition(m.registry.exposition())
    assert v['trainguard_anomalies_total{outcome="handled"}'] == 1
    assert v['trainguard_anomalies_total{outcome="dropped"}'] == 1
    assert v['trainguard_orders_sent_total{op="restart"}'] == 1
    assert v['trainguard_alerts_total{sink="slack",status="sent"}'] == 1
    assert v['trainguard_actions_total{action="alert",status="done"}'] == 1
    assert len(audit.events) == 2
    # the action service tells every outcome in one place: handled, dropped by the pipeline
    # or by its scheduler's full backlog, each once
    from trainguard.actions.policy import BacklogSettings
    from trainguard.actions.service import ActionService

    audit = ListRecorder()
    state = ServiceState()
    service = ActionService(pipeline=build_pipeline(policy=Policy(), state=state,
                                                    recorder=audit),
                            state=state, clock=lambda: 101.0, log=lambda line: None,
                            settings=BacklogSettings(max_queued=1))
    m = ActionMetrics()
    instrument_action_service(service, m)
    service.handle(_crash())
    service.handle(_crash())                                # a duplicate
    service.scheduler.submit(_crash(job="j2", id="w1"))
    service.scheduler.submit(_crash(job="j3", id="w2"))     # the older one is dropped
    service.scheduler.tick()
    v = parse_exposition(m.registry.exposition())
    assert (v['trainguard_anomalies_total{outcome="handled"}'],
            v['trainguard_anomalies_total{outcome="dropped"}']) == (2, 2)
    assert v['trainguard_actions_total{action="none",status="rate_limited"}'] == 1
    assert service.counts["dropped_duplicate"] == 1 and service.counts["dropped_backlog_full"] == 1


def test_run_metrics_count_launches_exits_and_acks():
    m = RunMetrics()
    life = dict(job="j1", node="n1", rank=None)
    m.event(ev.Lifecycle(ts=1.0, event="start", extra={"source": "supervisor",
                                                       "incarnation": 0}, **life))
    m.event(ev.Lifecycle(ts=2.0, event="exit", signal="SIGKILL",
                         extra={"source": "supervisor", "incarnation": 0}, **life))
    m.event(ev.Lifecycle(ts=2.0, event="exit", extra={"source": "supervisor",
                                                      "incarnation": 0, "restart": True},
                         **life))                  # a restart's announcement: not an exit
    m.event(ev.Lifecycle(ts=3.0, event="start", extra={"source": "supervisor",
                                                       "incarnation": 1}, **life))
    v = parse_exposition(m.registry.exposition())
    assert v['trainguard_launches_total{kind="first"}'] == 1
    assert v['trainguard_launches_total{kind="relaunch"}'] == 1
    assert v["trainguard_restarts_total"] == 1
    assert v['trainguard_exits_total{code="SIGKILL"}'] == 1
    assert sum(val for k, val in v.items() if k.startswith("trainguard_exits_total")) == 1


def test_agent_metrics_count_stack_captures():
    m = AgentMetrics()
    stack = dict(job="j1", ts=1.0, node="n1", capture_id="c", pid=1, method="py-spy", threads=[])
    m.stack(ev.Stack(rank=0, **stack))
    m.stack(ev.Stack(rank=1, error="py-spy failed", **stack))
    v = parse_exposition(m.registry.exposition())
    assert v['trainguard_stack_captures_total{status="ok"}'] == 1
    assert v['trainguard_stack_captures_total{status="error"}'] == 1


# ------------------------------------------------------------------ the real services
CHILD = """
import os, sys, time
if os.environ.get("TRAINGUARD_RESUME") == "1":
    time.sleep(60)              # the relaunch runs on until trainguard run stops it
time.sleep(60)
"""


@pytest.mark.broker
@pytest.mark.slow
def test_action_service_and_run_metrics_after_a_crash_restart_and_an_alert(kafka_config,
                                                                          tmp_path):
    """A crash anomaly of a job under ``trainguard run``: the service orders a restart and
    alerts a webhook, ``trainguard run`` relaunches; both /metrics say so."""
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    actions_port, run_port = free_port(), free_port()
    with HttpReceiver() as hook:
        policy = tmp_path / "policy.json"
        policy.write_text(json.dumps({"alerts": {"webhook": {"url": hook.url("/hook"),
                                                             "retries": 1}}}))
        service = Service("actions", *kafka_flags(kafka_config), "--policy", str(policy),
                          "--state", str(tmp_path / "state.json"),
                          "--metrics-port", str(actions_port))
        run = Service("run", "--job", "jm", "--grace", "1", "--metrics-port", str(run_port),
                      *kafka_flags(kafka_config), "--", sys.executable, str(child))
        try:
            scrape_until(run_port, lambda v: v.get('trainguard_launches_total{kind="first"}'),
                         proc=run.proc)
            before = scrape_until(actions_port, lambda v: True, proc=service.proc)
            assert before["trainguard_detection_to_order_seconds_count"] == 0
            time.sleep(3.0)     # both consumers assigned; the crash begins after the launch
            now = time.time()
            from confluent_kafka import Producer

            producer = Producer(kafka_config.kafka())
            anomaly = ev.Anomaly(job="jm", ts=now, id="crash-1", kind="crash",
                                 severity="critical", ranks=[0], nodes=[], onset_ts=now - 0.5,
                                 detected_ts=now, detector="crash",
                                 summary="rank 0 exited with code 1")
            producer.produce(kafka_config.topics.anomalies, key=b"jm", value=ev.encode(anomaly))
            producer.flush(10)
            got = scrape_until(actions_port, lambda v: v.get(
                'trainguard_anomalies_total{outcome="handled"}'), proc=service.proc)
            assert got['trainguard_alerts_total{sink="webhook",status="sent"}'] == 1
            assert got['trainguard_orders_sent_total{op="restart"}'] == 1
            assert got['trainguard_anomalies_total{outcome="handled"}'] == 1
            assert got['trainguard_actions_total{action="restart",status="planned"}'] == 1
            assert got["trainguard_detection_to_order_seconds_count"] == 1
            ran = scrape_until(run_port, lambda v: v.get("trainguard_restarts_total"),
                               proc=run.proc)
            assert ran['trainguard_launches_total{kind="relaunch"}'] == 1
            assert ran["trainguard_remaining_restarts"] == 2
            assert sum(v for k, v in ran.items() if k.startswith("trainguard_exits_total")) == 1
        except AssertionError:
            print("".join(service.lines), "".join(run.lines))
            raise
        finally:
            run.stop()
            service.stop()
    assert "metrics on http://127.0.0.1:" in "".join(service.lines)


@pytest.mark.broker
@pytest.mark.slow
def test_agent_metrics_after_samples_and_an_xid(kafka_config, tmp_path):
    kmsg = tmp_path / "kmsg.log"
    kmsg.write_text("")
    port = free_port()
    agent = Service("agent", *kafka_flags(kafka_config), "--node", "n1", "--job", "j1",
                    "--runtime-dir", str(tmp_path / "run"), "--interval", "0.2",
                    "--kmsg-extra", str(kmsg), "--metrics-port", str(port))
    try:
        scrape_until(port, lambda v: any(k.startswith("trainguard_gpu_samples_total")
                                         for k in v), proc=agent.proc)
        time.sleep(1.0)                  # the follower is at the end of the file
        with kmsg.open("a") as f:
            f.write(XID_LINE)
        got = scrape_until(port, lambda v: any(k.startswith("trainguard_xid_lines_total")
                                               for k in v), proc=agent.proc)
        assert sum(v for k, v in got.items() if k.startswith("trainguard_xid_lines_total")) == 1
        assert got["trainguard_events_sent_total"] >= 2       # samples and the Xid
        if got.get('trainguard_gpu_samples_total{status="unavailable"}'):  # no GPU here
            assert got['trainguard_nvml_errors_total{call="sample"}'] >= 1
    finally:
        assert agent.stop() == 0
    assert any("metrics on" in line for line in agent.lines)
