"""Issue 13 point 1: one configuration tree (TOML file, environment, flags), ``trainguard
config show|check``, ``--config`` on every command, analyze with the worker's thresholds."""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from trainguard import configsections as cs
from trainguard.cli import build_parser, main
from trainguard.config import ConfigError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for var in list(os.environ):
        if var.startswith("TRAINGUARD_") and var != "TRAINGUARD_HOME":
            monkeypatch.delenv(var)
    # `--config FILE` exports TRAINGUARD_CONFIG for the processes a command starts: restored
    # after each test, whatever a test's command set
    monkeypatch.setenv("TRAINGUARD_CONFIG", "")


def write(tmp_path, text: str, name="tg.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# -- derivation: one default, written in the component ---------------------------------------

def test_detector_sections_are_the_detectors_constructor_arguments():
    from trainguard.detectors import DETECTORS, DetectorConfig

    tree = cs.load()
    for cls in DETECTORS:
        for name, default in cls()._get_params().items():
            key = f"detectors.{cls.PREFIX}.{name}"
            assert tree.value(key) == default, key
            assert tree.keys[key].help, f"{key} has no meaning"
    assert cs.detector_config(tree) == DetectorConfig()


def test_every_key_has_a_meaning_and_every_section_a_dataclass():
    tree = cs.load()
    assert all(k.help for k in tree.keys.values())
    sections = {".".join(p.split(".")[:2]) if p.startswith(("detectors.", "policy.limits",
                                                          "policy.capture")) else
                p.split(".")[0] for p in tree.keys if "." in p}
    for section in sections:
        cls = cs.section_class(section)
        instance = cls(**tree.section(section))
        assert dataclasses.is_dataclass(instance)
        with pytest.raises(TypeError):          # kw_only
            cls(1)


def test_the_sections_build_the_existing_settings_objects(tmp_path):
    from trainguard.streams.settings import WorkerSettings
    from trainguard.topics import TopicPlan

    tree = cs.load(write(tmp_path, """
[kafka]
bootstrap = "b1:9092,b2:9093"
client = { "client.id" = "tg-ops" }
[topics]
prefix = "ops"
telemetry_partitions = 48
[worker]
web_port = 7070
batch_max = 100
"""))
    config = cs.kafka_config(tree)
    assert config.bootstrap == "b1:9092,b2:9093" and config.topics.prefix == "ops"
    assert config.client_settings == {"client.id": "tg-ops"}
    assert cs.topic_plan(tree) == TopicPlan(telemetry_partitions=48)
    settings = cs.worker_settings(tree)
    assert isinstance(settings, WorkerSettings)
    assert (settings.prefix, settings.web_port, settings.batch_max) == ("ops", 7070, 100)
    assert settings.web_bind == "127.0.0.1"


# -- precedence and where each value came from ---------------------------------------------

def test_file_then_environment_then_flags(tmp_path, capsys, monkeypatch):
    path = write(tmp_path, """
[kafka]
bootstrap = "from-file:9092"
[topics]
prefix = "file"
[detectors.hang]
floor_s = 30
checkpoint_s = 1800
""")
    monkeypatch.setenv("TRAINGUARD_CONFIG", path)
    monkeypatch.setenv("TRAINGUARD_TOPIC_PREFIX", "env")
    monkeypatch.setenv("TRAINGUARD_DETECTORS__HANG__FLOOR_S", "45")
    code, out, err = run_cli(capsys, "config", "show", "--json", "--bootstrap", "flag:9092")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["kafka.bootstrap"] == {"value": "flag:9092", "source": "flag --bootstrap"}
    assert shown["topics.prefix"] == {"value": "env", "source": "env TRAINGUARD_TOPIC_PREFIX"}
    assert shown["detectors.hang.floor_s"] == {
        "value": 45.0, "source": "env TRAINGUARD_DETECTORS__HANG__FLOOR_S"}
    assert shown["detectors.hang.checkpoint_s"] == {"value": 1800.0, "source": path}
    assert shown["detectors.hang.window"] == {"value": 500, "source": "default"}


def test_show_as_text_names_the_source_of_each_line(tmp_path, capsys):
    path = write(tmp_path, "[worker]\nweb_port = 7070\n")
    code, out, _ = run_cli(capsys, "config", "show", "--config", path)
    lines = {line.split(" = ")[0]: line for line in out.splitlines()}
    assert code == 0
    assert lines["worker.web_port"].endswith(f"# {path}") and "7070" in lines["worker.web_port"]
    assert lines["worker.poll_ms"].endswith("# default")


def test_a_typed_flag_wins_over_the_file_and_a_default_flag_does_not(tmp_path):
    from trainguard.configcli import apply_config

    path = write(tmp_path, "[worker]\nweb_port = 7070\nworker_id = \"from-file\"\n")
    parser = build_parser()
    for argv, port in ((["worker", "--config", path], 7070),
                       (["worker", "--config", path, "--web-port", "6066"], 6066),
                       (["worker", "--config", path, "--web-port=6100"], 6100)):
        args = parser.parse_args(argv)
        apply_config(parser, argv, args)
        assert args.web_port == port and args.worker_settings.web_port == port
        assert args.id == "from-file" and args.worker_settings.worker_id == "from-file"


# -- secrets ----------------------------------------------------------------------------------

def test_signing_key_is_exposed_and_masked_when_shown(tmp_path, capsys, monkeypatch):
    path = write(tmp_path, """
[security]
signing_key = "k3y-0123456789abcdef"
[kafka]
client = { "sasl.username" = "tg", "sasl.password" = "hunter2" }
[alerts.slack]
url = "https://hooks.slack.com/services/T/B/xyz"
""")
    tree = cs.load(path)
    assert cs.signing_key(tree) == "k3y-0123456789abcdef"
    code, out, _ = run_cli(capsys, "config", "show", "--config", path)
    assert code == 0
    for secret in ("k3y-0123456789abcdef", "hunter2", "hooks.slack.com"):
        assert secret not in out
    assert '"sasl.username": "tg"' in out
    monkeypatch.setenv("TRAINGUARD_SIGNING_KEY", "from-the-env-0123")
    assert cs.signing_key(cs.load(path, {"TRAINGUARD_SIGNING_KEY": "from-the-env-0123"})) \
        == "from-the-env-0123"
    code, out, _ = run_cli(capsys, "config", "show", "--json")
    assert json.loads(out)["security.signing_key"] == {
        "value": "***", "source": "env TRAINGUARD_SIGNING_KEY"}


# -- config check -----------------------------------------------------------------------------

def test_check_accepts_a_good_file(tmp_path, capsys):
    path = write(tmp_path, """
[detectors.straggler]
k = 5
n = 6
[policy]
over_evict = "tp"
require_approval = ["evict"]
[policy.ladder]
hang = ["capture", "restart"]
[driver]
type = "slurm"
""")
    code, out, err = run_cli(capsys, "config", "check", path)
    assert code == 0 and err == "" and "valid" in out


@pytest.mark.parametrize("text,expected", [
    ("[worker]\nweb_port = 0", "worker.web_port: 0 is below the minimum 1"),
    ("[worker]\nloglevel = 'loud'", "worker.loglevel: 'loud' is not one of crit, error"),
    ("[detectors.hang]\nfloor_s = 'soon'", "detectors.hang.floor_s: expected a number, "
                                            "got 'soon'"),
    ("[detectors.hang]\nfloor = 3", "detectors.hang.floor: unknown key in detectors.hang"),
    ("[detectors.nope]\nx = 1", "detectors.nope: unknown key in detectors"),
    ("[detectors.straggler]\nk = 20", "detectors.straggler.k (20) must be between 1 and "
                                      "detectors.straggler.n (10)"),
    ("[detectors.straggler]\nwarmup = 1", "detectors.straggler.warmup: 1 is below the minimum 2"),
    ("[detectors.hang]\nquantile = 1.5", "detectors.hang.quantile must be in (0, 1], got 1.5"),
    ("[policy]\nover_evict = 'xx'", "policy.over_evict: 'xx' is not one of tp, pp, dp"),
    ("[policy.ladder]\nhang = ['explode']", "ladder.hang: unknown step(s) ['explode']"),
    ("[kafka]\nbootstrap = 'h:99999'", "kafka.bootstrap = 'h:99999'"),
    ("[kafka]\nclient = { 'no.such' = '1' }", 'No such configuration property: "no.such"'),
    ("[driver]\ntype = 'pbs'", "driver.type = 'pbs': must be one of"),
    ("[alerts.ops]\ntype = 'alertmanager'\nurl = 'http://x:9093'\nextra_labels = ['a']",
     "alerts.ops: extra_labels must be a table"),
    ("[nonsense]\nx = 1", "nonsense: unknown key in the top level"),
    ("bad = = toml", "is not valid TOML"),
])
def test_check_names_the_key_the_value_and_what_is_allowed(tmp_path, capsys, text, expected):
    path = write(tmp_path, text + "\n")
    code, out, err = run_cli(capsys, "config", "check", path)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("trainguard config: error: ") and expected in lines[0], err


def test_a_bad_environment_value_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("TRAINGUARD_WORKER__WEB_PORT", "abc")
    code, _, err = run_cli(capsys, "config", "show")
    assert code == 2 and "TRAINGUARD_WORKER__WEB_PORT='abc' is not an integer" in err
    monkeypatch.delenv("TRAINGUARD_WORKER__WEB_PORT")
    monkeypatch.setenv("TRAINGUARD_WORKER__NO_SUCH", "1")
    code, _, err = run_cli(capsys, "config", "show")
    assert code == 2 and "TRAINGUARD_WORKER__NO_SUCH names no configuration key" in err


# -- every command, and analyze with the worker's thresholds --------------------------------

def test_every_command_takes_config():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        if name == "config":
            continue
        assert any("--config" in a.option_strings for a in command._actions), name


def hang_recording(path: Path) -> str:
    """Two ranks step every second for 30 s, then keep sending heartbeats for 60 s."""
    lines = [{"v": 1, "type": "step", "job": "j", "ts": 100.0 + s, "node": "n1", "rank": r,
              "step": s, "step_time": 1.0} for s in range(30) for r in range(2)]
    lines += [{"v": 1, "type": "heartbeat", "job": "j", "ts": 100.0 + t, "node": "n1",
               "rank": r, "pid": 10 + r, "phase": "collective", "phase_since": 129.0,
               "dropped": 0, "step": min(t, 29)} for t in range(90) for r in range(2)]
    lines.sort(key=lambda x: x["ts"])
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_analyze_uses_the_thresholds_of_the_file(tmp_path, capsys, monkeypatch):
    recording = hang_recording(tmp_path / "hang.jsonl")
    code, out, _ = run_cli(capsys, "analyze", recording, "--json")
    assert code == 0 and [i["kind"] for i in json.loads(out)["incidents"]] == ["hang"]
    patient = write(tmp_path, "[detectors.hang]\nfloor_s = 300.0\n")
    code, out, _ = run_cli(capsys, "analyze", recording, "--json", "--config", patient)
    assert code == 0 and json.loads(out)["incidents"] == []
    monkeypatch.setenv("TRAINGUARD_CONFIG", patient)
    code, out, _ = run_cli(capsys, "analyze", recording, "--json")
    assert json.loads(out)["incidents"] == []


def test_the_worker_gets_the_same_thresholds(tmp_path):
    from trainguard.configcli import apply_config
    from trainguard.config import Config
    from trainguard.streams.worker import settings_from_args

    path = write(tmp_path, "[detectors.hang]\nfloor_s = 300.0\n[worker]\nbatch_max = 77\n")
    parser = build_parser()
    argv = ["worker", "--config", path]
    args = parser.parse_args(argv)
    apply_config(parser, argv, args)
    assert args.detector_config.hang.floor_s == 300.0
    analyze_args = parser.parse_args(["analyze", "x.jsonl", "--config", path])
    apply_config(parser, ["analyze", "x.jsonl", "--config", path], analyze_args)
    assert analyze_args.detector_config == args.detector_config
    assert settings_from_args(args, Config()).batch_max == 77


def test_every_flag_of_a_configured_command_reaches_its_settings():
    """A flag that the tree does not map would be parsed and then silently ignored."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    plain = {"help", "config", "func", "log_format", *cs.KAFKA_FLAGS}  # trainguard.logs
    for name in ("worker",):
        dests = {a.dest for a in sub.choices[name]._actions} - plain
        assert dests <= set(cs.COMMAND_FLAGS[name]), (name, dests - set(cs.COMMAND_FLAGS[name]))


def test_worker_memory_flags_win_over_the_defaults(tmp_path):
    from trainguard.configcli import apply_config
    from trainguard.config import Config
    from trainguard.streams.worker import settings_from_args

    parser = build_parser()
    argv = ["worker", "--max-live-jobs", "1", "--max-live-ranks", "4", "--evict-idle-s", "9"]
    args = parser.parse_args(argv)
    apply_config(parser, argv, args)
    settings = settings_from_args(args, Config())
    assert (settings.max_live_jobs, settings.max_live_ranks, settings.evict_idle_s) == (1, 4, 9.0)


def test_the_action_service_gets_policy_alerts_and_driver(tmp_path):
    from trainguard.configcli import apply_config

    path = write(tmp_path, """
[policy.limits]
max_restarts = 5
page_cooldown_s = 60
[policy.ladder]
nan = ["alert", "rollback"]
[policy.incidents]
wait_s = 5
[driver]
type = "slurm"
""")
    json_policy = tmp_path / "policy.json"
    json_policy.write_text(json.dumps({"limits": {"max_restarts": 7}}))
    parser = build_parser()
    argv = ["actions", "--config", path, "--policy", str(json_policy), "--dry-run"]
    args = parser.parse_args(argv)
    apply_config(parser, argv, args)
    policy, alerts, driver = args.service_config
    assert policy.limits.max_restarts == 7          # --policy FILE over the tree
    assert policy.limits.page_cooldown_s == 60      # the tree where the JSON is silent
    assert policy.ladder["nan"] == ("alert", "rollback") and policy.dry_run
    assert driver == {"type": "slurm"} and alerts == {}
    assert (policy.incidents.wait_s, policy.incidents.expect_s) == (5, 3600.0)


def test_an_unreadable_config_file_is_one_line(tmp_path, capsys):
    code, _, err = run_cli(capsys, "analyze", "x.jsonl", "--config", str(tmp_path / "no.toml"))
    assert code == 2 and "cannot read config file" in err and len(err.splitlines()) == 1


# -- docs/CONFIG.md -----------------------------------------------------------------------------

def test_config_reference_is_current():
    from trainguard.configcli import reference_markdown

    current = (REPO / "docs" / "CONFIG.md").read_text()
    assert current == reference_markdown(), (
        "docs/CONFIG.md is out of date: run `trainguard config docs > docs/CONFIG.md`")
    for key in cs.all_keys():
        assert f"`{key.path}`" in current


def test_a_training_process_reads_the_collector_section(tmp_path):
    import socket

    import trainguard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    path = write(tmp_path, "[collector]\nheartbeat_interval = 0.25\nreport_every = 4\n")
    environ = {"TRAINGUARD_CONFIG": path, "TRAINGUARD_BOOTSTRAP": f"127.0.0.1:{closed}"}
    tg = trainguard.init(job="cfg-job", environ=environ, runtime_dir=tmp_path / "run",
                         handle_signals=False, stack_signal=None, flush_timeout=0.2,
                         report_every=2)
    try:
        assert tg.settings.heartbeat_interval == 0.25     # from the file
        assert tg.settings.report_every == 2              # given by the caller: kept
    finally:
        tg.close(timeout=0.5)


def test_flags_of_the_training_command_are_not_trainguards(tmp_path):
    from trainguard.configcli import apply_config

    path = write(tmp_path, "[kafka]\nbootstrap = \"from-file:9092\"\n")
    parser = build_parser()
    for argv in (["run", "--job", "j", "--config", path, "--", "python", "t.py", "--bootstrap",
                  "x:1"],
                 ["run", "--job", "j", "--config", path, "python", "t.py", "--prefix", "p"]):
        args = parser.parse_args(argv)
        apply_config(parser, argv, args)
        assert args.tree.value("kafka.bootstrap") == "from-file:9092"
        assert args.tree.source("topics.prefix") == "default"
