"""Issue 23 points 2 and 3: every service's metrics through prometheus_client (the process
collectors, a unit in every name, one ``--metrics-port``, a taken port is one line and the
service goes on) and its logs through ``logging`` (``--log-level`` and ``--log-format`` on
every command, JSON lines with the job, rank and incident)."""
from __future__ import annotations

import argparse
import io
import json
import logging
import re
import subprocess
import sys
import urllib.request
from argparse import Namespace

import pytest

from trainguard import logs
from trainguard.broker import free_port
from trainguard.cli import build_parser
from trainguard.metrics import UNITS, Metric, Registry, check_name, parse_exposition, serve
from trainguard.service_metrics import (SERVICES, ActionMetrics, AgentMetrics, RunMetrics,
                                        start_metrics)

SERVICE_COMMANDS = ("worker", "actions", "agent", "run")


def scrape(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return parse_exposition(reply.read().decode())


def commands(parser=None, path=()):
    """``(path, parser)`` of every command the CLI runs (``config show`` and its siblings
    included, not ``config`` itself)."""
    parser = parser or build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = [a for a in sub._actions if isinstance(a, argparse._SubParsersAction)]
                if nested:
                    yield from commands(sub, (*path, name))
                else:
                    yield (*path, name), sub


def options(parser) -> dict:
    return {o: a for a in parser._actions for o in a.option_strings}


# ------------------------------------------------------------------------------ logs
def test_every_command_has_log_level_and_log_format():
    seen = list(commands())
    assert len(seen) >= 15 and ("config", "show") in [p for p, _ in seen]
    for path, parser in seen:
        opts = options(parser)
        assert "--log-level" in opts and "--log-format" in opts, path
        assert set(logs.LEVELS) <= set(opts["--log-level"].choices), path
        assert tuple(opts["--log-format"].choices) == logs.FORMATS, path
    args = build_parser().parse_args(["analyze", "f.jsonl", "--log-level", "debug",
                                      "--log-format", "json"])
    assert (args.log_level, args.log_format) == ("debug", "json")


def test_the_workers_loglevel_stays_an_alias():
    parser = build_parser()
    for flag in ("--loglevel", "--log-level"):
        args = parser.parse_args(["worker", flag, "info"])
        assert args.loglevel == "info"
    assert parser.parse_args(["worker", "--log-level", "warning"]).loglevel == "warning"
    assert parser.parse_args(["worker"]).loglevel == "warn"       # its old default


def test_json_lines_carry_job_rank_and_incident():
    out = io.StringIO()
    handler = logs.setup("actions", "info", "json", stream=out, fields={"job": "proc-job"})
    try:
        log = logging.getLogger("trainguard.actions.test")
        log.info("plain line")
        with logs.context(job="j7", incident="inc-3"):
            log.warning("restart of %s", "j7", extra={"rank": 5})
        log.debug("not at info")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            log.exception("failed")
        logging.getLogger("aiokafka").error("a library's line")
    finally:
        logs.teardown(handler)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 4
    for line in lines:
        assert {"ts", "level", "service", "logger", "message", "job", "rank",
                "incident"} <= set(line), line
        assert line["service"] == "actions"
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["ts"])
    plain, restart, failed, library = lines
    assert (plain["job"], plain["rank"], plain["incident"]) == ("proc-job", None, None)
    assert restart == {**restart, "level": "warning", "message": "restart of j7",
                       "job": "j7", "rank": 5, "incident": "inc-3",
                       "logger": "trainguard.actions.test"}
    assert failed["level"] == "error" and "RuntimeError: boom" in failed["exc"]
    assert library["logger"] == "aiokafka" and library["message"] == "a library's line"


def test_text_lines_are_the_services_lines_of_before():
    out = io.StringIO()
    handler = logs.setup("actions", "info", "text", stream=out)
    try:
        logs.service_logger("trainguard.actions", "trainguard actions")("consuming tg.x")
        logging.getLogger("confluent_kafka").warning("broker down")
        logging.getLogger("trainguard.worker.banner").info("trainguard actions up: here")
    finally:
        logs.teardown(handler)
    first, second, third = out.getvalue().splitlines()
    assert re.fullmatch(r"\d\d:\d\d:\d\d trainguard actions: consuming tg\.x", first)
    assert second.endswith(" trainguard actions: confluent_kafka: broker down")
    assert re.fullmatch(r"\d\d:\d\d:\d\d trainguard actions up: here", third)


def test_before_setup_a_service_line_goes_to_stderr_as_before(capsys):
    assert not logs.configured()
    logs.service_logger("trainguard.actions.state", "trainguard actions", stamp=False)("x y")
    assert capsys.readouterr().err == "trainguard actions: x y\n"


def test_setup_replaces_its_handler_and_teardown_restores_the_root():
    root = logging.getLogger()
    level, count = root.level, len(root.handlers)
    first = logs.setup("run", "debug", "text", stream=io.StringIO())
    second = logs.setup("run", "error", "json", stream=io.StringIO())
    assert len(root.handlers) == count + 1 and root.level == logging.ERROR
    logs.teardown(second)
    logs.teardown(first)
    assert len(root.handlers) == count and root.level == level


def test_a_rank_never_configures_logging_nor_imports_prometheus_client():
    code = ("import logging, sys\n"
            "import trainguard, trainguard.collectors.api\n"
            "import trainguard.integrations\n"
            "assert not logging.getLogger().handlers, logging.getLogger().handlers\n"
            "assert 'prometheus_client' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr


def test_run_logs_json_and_goes_on_when_its_metrics_port_is_taken():
    """A real ``trainguard run`` (no broker: it supervises locally) on a taken port: one
    warning line, as JSON, with the job; the training command still runs and its exit code
    comes back."""
    taken = serve(Registry([]), free_port())
    try:
        done = subprocess.run(
            [sys.executable, "-m", "trainguard.cli", "run", "--job", "j-json", "--bootstrap",
             "127.0.0.1:1", "--max-restarts", "0", "--metrics-port", str(taken.port),
             "--log-format", "json", "--", sys.executable, "-c", "raise SystemExit(3)"],
            capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert done.returncode == 3, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    assert len(lines) == len(done.stderr.splitlines()), done.stderr   # JSON only
    said = [line for line in lines if "without /metrics" in line["message"]]
    assert len(said) == 1, done.stderr
    assert said[0]["message"].startswith(f"--metrics-port {taken.port}: cannot serve")
    assert all(line["job"] == "j-json" and line["service"] == "run" for line in lines)


# --------------------------------------------------------------------------- metrics
def test_every_service_has_metrics_port_and_the_worker_keeps_web_port():
    parsers = dict(commands())
    for service in SERVICE_COMMANDS:
        assert "--metrics-port" in options(parsers[(service,)]), service
        assert "--metrics-bind" in options(parsers[(service,)]), service
    worker = options(parsers[("worker",)])
    assert worker["--metrics-port"] is worker["--web-port"]
    assert worker["--metrics-bind"] is worker["--web-bind"]
    parser = build_parser()
    assert parser.parse_args(["worker", "--web-port", "7001"]).web_port == 7001
    assert parser.parse_args(["worker", "--metrics-port", "7002"]).web_port == 7002
    assert parser.parse_args(["actions", "--metrics-port", "7003"]).metrics_port == 7003


@pytest.mark.parametrize("service", list(SERVICES))
def test_a_taken_port_is_one_line_and_the_service_goes_on(service):
    taken = serve(Registry([]), free_port())
    try:
        said = []
        args = Namespace(metrics_port=taken.port)
        port = taken.port if service == "worker" else None     # the worker's is web_port
        assert start_metrics(Registry([]), args, service, said.append, port=port) is None
        assert said == [f"--metrics-port {taken.port}: cannot serve metrics on 127.0.0.1:"
                        f"{taken.port}: Address already in use; running without /metrics"]
    finally:
        taken.close()


def test_a_taken_port_without_a_log_is_one_warning_record(caplog):
    taken = serve(Registry([]), free_port())
    try:
        with caplog.at_level(logging.INFO, logger="trainguard.metrics"):
            assert start_metrics(Registry([]), Namespace(metrics_port=taken.port),
                                 "agent") is None
    finally:
        taken.close()
    [record] = [r for r in caplog.records if r.name == "trainguard.metrics"]
    assert record.levelno == logging.WARNING and "running without /metrics" in record.message


def _sources():
    from trainguard.streams.metrics import Metrics

    run = RunMetrics()
    agent = AgentMetrics()
    return {"worker": Metrics(), "actions": ActionMetrics().registry, "agent": agent.registry,
            "run": run.registry}


@pytest.mark.parametrize("service", list(SERVICES))
def test_every_scrape_has_the_process_and_python_collectors(service):
    server = serve(_sources()[service], free_port())
    try:
        values = scrape(server.port)
    finally:
        server.close()
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes",
                 "process_virtual_memory_bytes", "process_open_fds",
                 "process_start_time_seconds"):
        assert values.get(name, 0) > 0, name
    assert any(k.startswith("python_info{") for k in values)
    assert any(k.startswith("python_gc_collections_total{") for k in values)
    assert any(k.startswith("trainguard_") for k in values)


def test_every_trainguard_metric_name_has_its_unit():
    declared = [(m.full_name, m.kind) for _, (_, _, decl) in SERVICES.items() for m in decl()]
    assert len(declared) >= 50
    suffixes = tuple("_" + u for u in UNITS)
    for name, kind in declared:
        assert name.startswith("trainguard_"), name
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert name.endswith(suffixes), f"{name} ({kind}) has no unit"
    for service, source in _sources().items():     # and what a scrape shows, series too
        from trainguard.metrics import exposition

        for line in exposition(source).splitlines():
            if line.startswith("# TYPE trainguard_"):
                _, _, name, kind = line.split()
                check_name(name, kind)
    with pytest.raises(ValueError, match="ends in its unit"):
        Metric("consumer_lag", "gauge", "no unit")


def test_no_trainguard_metric_has_a_job_label():
    for _, (_, _, declarations) in SERVICES.items():
        for m in declarations():
            assert "job" not in m.labels, m.full_name


def test_alertmanager_names_the_training_job_training_job():
    from trainguard.actions.alerts import AlertMessage, AlertmanagerSink

    sink = AlertmanagerSink(url="http://127.0.0.1:9")
    message = AlertMessage(incident="i1", job="llama", kind="hang", severity="critical",
                           summary="s", ranks=[1], nodes=["n1"], ts=100.0)
    labels = sink.payload(message)[0]["labels"]
    assert labels["training_job"] == "llama" and "job" not in labels
    with pytest.raises(ValueError, match="extra label 'job'"):
        AlertmanagerSink(url="http://127.0.0.1:9", extra_labels={"job": "x"})
