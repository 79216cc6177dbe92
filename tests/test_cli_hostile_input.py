"""Issue 14 point 7: careless or hostile input gets one clear line and a non-zero exit, a
bound, or a mask, never a traceback or a hang."""
from __future__ import annotations

import base64
import gzip
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from http_receiver import HttpReceiver
from test_alerts import message

from trainguard.actions.alerts import AlertConfigError, Delivery, WebhookSink, build_sinks
from trainguard.diagnosis.flight_recorder import analyze_dir, check_plain_data, load_dump
from trainguard.cli import main
from trainguard.config import Config, ConfigError, _OncePerText

REPO = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"trainguard {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


# -- a pickle bomb in a Flight Recorder dump ------------------------------------------------

def bomb(levels: int = 9) -> bytes:
    """About 300 bytes that refer to one list from ten places, ``levels`` deep."""
    inner = [{"state": "scheduled", "pg_id": 0}]
    for _ in range(levels):
        inner = [inner] * 10
    return pickle.dumps({"entries": inner, "pg_status": {"0": inner}}, protocol=2)


def test_a_pickle_bomb_is_refused_before_anything_walks_it(tmp_path, capsys):
    data = bomb()
    assert len(data) < 400
    (tmp_path / "rank_0").write_bytes(data)
    code, out, _ = run_cli(capsys, "fr", "analyze", str(tmp_path), "--json")
    result = json.loads(out)
    assert code == 0 and result["missing"] == [0]
    assert "pickle bomb" in result["errors"][0]["error"]


def test_cycles_and_deep_nesting_are_refused(tmp_path):
    loop: list = []
    loop.append(loop)
    (tmp_path / "cycle_0").write_bytes(pickle.dumps({"entries": loop}))
    deep: list = []
    for _ in range(200):
        deep = [deep]
    (tmp_path / "deep_1").write_bytes(pickle.dumps({"entries": deep}))
    errors = {e["rank"]: e["error"] for e in analyze_dir(tmp_path)["errors"]}
    assert "cycle" in errors[0] and "nested more than" in errors[1]


def test_shared_but_small_data_is_fine():
    shared = {"ranks": [0, 1, 2, 3]}
    check_plain_data({"a": [shared] * 1000, "b": shared})


def test_an_oversized_dump_is_refused_without_reading_it(tmp_path, monkeypatch):
    import trainguard.diagnosis.flight_recorder as fr

    monkeypatch.setattr(fr, "MAX_DUMP_BYTES", 100)
    path = tmp_path / "rank_0"
    path.write_bytes(pickle.dumps({"entries": list(range(100))}))
    with pytest.raises(ValueError, match="more than a dump's 100"):
        load_dump(path)


# -- recordings: corrupt, truncated, output paths -------------------------------------------

def recording_lines(n=200) -> bytes:
    return b"".join(json.dumps({"v": 1, "type": "step", "job": "j", "ts": 100.0 + s,
                                "node": "n1", "rank": 0, "step": s, "step_time": 1.0}).encode()
                    + b"\n" for s in range(n))


@pytest.mark.parametrize("name,content", [
    ("not-gzip.jsonl.gz", lambda: b"garbage" * 40),
    ("bad-deflate.jsonl.gz", lambda: (lambda g: g[:20] + bytes(30) + g[50:])(
        gzip.compress(recording_lines()))),
    ("cut.jsonl.gz", lambda: gzip.compress(recording_lines())[:300]),
    ("not-zstd.jsonl.zst", lambda: b"garbage" * 40),
    ("cut.jsonl.zst", lambda: (lambda z: z[:len(z) // 2])(zstd(recording_lines()))),
])
def test_a_corrupt_or_truncated_recording_is_one_line(tmp_path, capsys, name, content):
    path = tmp_path / name
    path.write_bytes(content())
    code, out, err = run_cli(capsys, "analyze", str(path))
    assert code == 2 and out == ""
    assert "cannot read" in one_error_line(err, "analyze")


def zstd(data: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor().compress(data)


def test_truncated_zst_names_the_truncation(tmp_path, capsys):
    whole = zstd(recording_lines(3000))
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(whole[:-10])
    code, _, err = run_cli(capsys, "analyze", str(path))
    assert code == 2 and "truncated" in err


def test_zst_of_several_frames_reads_them_all(tmp_path, capsys):
    path = tmp_path / "two.jsonl.zst"
    path.write_bytes(zstd(recording_lines(50)) + zstd(recording_lines(70)))
    code, out, _ = run_cli(capsys, "analyze", str(path), "--json")
    assert code == 0 and json.loads(out)["events"] == 120


def test_report_and_out_pointing_at_a_folder(tmp_path, capsys):
    good = tmp_path / "good.jsonl"
    good.write_bytes(recording_lines(5))
    folder = tmp_path / "somewhere"
    folder.mkdir()
    code, _, err = run_cli(capsys, "analyze", str(good), "--report", str(folder))
    assert code == 2 and "is a folder" in one_error_line(err, "analyze")
    assert list(folder.iterdir()) == []
    dir_named_like_a_file = tmp_path / "out.jsonl"
    dir_named_like_a_file.mkdir()
    code, _, err = run_cli(capsys, "record", "--out", str(dir_named_like_a_file),
                           "--bootstrap", "127.0.0.1:1")
    assert code == 2 and "is a folder" in one_error_line(err, "record")


# -- flags and settings -----------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--partitions", "--telemetry-partitions"])
def test_topics_with_zero_partitions(capsys, flag):
    code, _, err = run_cli(capsys, "topics", "create", flag, "0", "--bootstrap", "127.0.0.1:1")
    line = one_error_line(err, "topics")
    assert code == 2 and "0 is below the minimum 1" in line and f"flag {flag}" in line


@pytest.mark.parametrize("line,expected", [
    ("no.such.key=1", 'No such configuration property: "no.such.key"'),
    ("security.protocol=FOO", 'Invalid value "FOO"'),
])
def test_a_bad_kafka_config_is_named_up_front(tmp_path, capsys, line, expected):
    path = tmp_path / "client.properties"
    path.write_text(line + "\n")
    code, _, err = run_cli(capsys, "topics", "create", "--kafka-config", str(path))
    assert code == 2 and expected in one_error_line(err, "topics")


@pytest.mark.parametrize("bootstrap", ["127.0.0.1:99999", "127.0.0.1:0", "h:1,h2:70000"])
def test_a_port_out_of_range_is_refused_not_wrapped(capsys, bootstrap):
    code, _, err = run_cli(capsys, "topics", "create", "--bootstrap", bootstrap)
    assert code == 2 and "is not 1-65535" in one_error_line(err, "topics")
    with pytest.raises(ConfigError):
        Config(bootstrap=bootstrap)


def test_extra_labels_must_be_a_table():
    with pytest.raises(AlertConfigError, match="extra_labels must be a table"):
        build_sinks({"ops": {"type": "alertmanager", "url": "http://127.0.0.1:9093",
                             "extra_labels": ["cluster"]}}, {})


# -- an unreachable broker: the clear error, not librdkafka's retries -----------------------

def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_unreachable_broker_is_one_line(capfd):
    code = main(["topics", "create", "--bootstrap", f"127.0.0.1:{closed_port()}"])
    _, err = capfd.readouterr()
    assert code == 2
    assert "cannot reach Kafka" in one_error_line(err, "topics")


def test_librdkafka_lines_are_passed_once_per_text():
    import logging

    now = [0.0]
    once = _OncePerText(every=600.0, clock=lambda: now[0])

    def line(text, level=logging.ERROR):
        return once.filter(logging.LogRecord("k", level, "", 0, text, (), None))

    refused = "FAIL [rdkafka#producer-1] Connect to 127.0.0.1:{} failed (after {}ms)"
    passed = [line(refused.format(1, ms)) for ms in range(500)]
    assert passed.count(True) == 1
    assert not line("debug chatter", logging.DEBUG)
    now[0] = 601.0
    assert line(refused.format(1, 3))


# -- credentials a receiver echoes ------------------------------------------------------------

@pytest.mark.parametrize("password", ["pw", "a-much-longer-password-0123"])
def test_basic_credentials_echoed_by_a_receiver_are_masked(password):
    with HttpReceiver() as rx:
        cred = base64.b64encode(f"admin:{password}".encode()).decode()
        echo = (f"denied: Authorization: Basic {cred} (user admin:{password}, "
                f"password {password})").encode()
        rx.script([(401, echo)])
        url = rx.url("/hook").replace("127.0.0.1", f"admin:{password}@127.0.0.1")
        sink = WebhookSink(url=url, delivery=Delivery(retries=0, timeout=5))
        result = sink.send(message())
    assert not result.ok
    text = str(result.error)
    assert password not in text and cred not in text and "Basic ***" in text, text


# -- the worker: loopback by default, TRAINGUARD_HOME made with its parents ------------------

@pytest.mark.broker
@pytest.mark.slow
def test_worker_listens_on_loopback_and_makes_its_home(kafka_bootstrap, topic_prefix,
                                                        tmp_path):
    from trainguard.broker import free_port

    home = tmp_path / "not" / "yet" / "there"
    port = free_port()
    config = tmp_path / "tg.toml"      # the port comes from the configuration file
    config.write_text(f"[worker]\nweb_port = {port}\n[detectors.hang]\nfloor_s = 60.0\n")
    env = {**os.environ, "TRAINGUARD_HOME": str(home), "TRAINGUARD_BOOTSTRAP": kafka_bootstrap}
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "worker", "--prefix",
                             topic_prefix, "--config", str(config)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        listening = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None and listening is None:
            listening = _listener(port)
            time.sleep(0.5)
        assert listening == "127.0.0.1", proc.stdout.read() if proc.poll() is not None else ""
        assert (home / "worker").is_dir()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _listener(port: int) -> str | None:
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:
            raw = bytes.fromhex(address)[::-1]
            return socket.inet_ntoa(raw)
    return None
