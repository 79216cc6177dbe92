"""Progress on a terminal for analyze, replay, record and the demo's set-up: drawn on a tty,
never when the output is not a terminal or with --json, fed per chunk and throttled."""
from __future__ import annotations

import gzip
import io
import json
import os
import pty
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainguard import progress, recording
from trainguard.cli import main


def write_recording(path: Path, steps: int = 200) -> Path:
    lines = [json.dumps({"v": 1, "type": "step", "job": "j", "ts": 100.0 + s, "node": "n1",
                         "rank": r, "step": s, "step_time": 1.0})
             for s in range(steps) for r in range(2)]
    data = ("\n".join(lines) + "\n").encode()
    if path.name.endswith(".gz"):
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_is_wanted_on_a_terminal_only(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    assert progress.wanted(stream=Tty())
    assert not progress.wanted(stream=io.StringIO())
    assert not progress.wanted(json_output=True, stream=Tty())
    monkeypatch.setenv("TERM", "dumb")
    assert not progress.wanted(stream=Tty())


def test_disabled_progress_draws_nothing_and_hands_out_no_callback(tmp_path, capsys):
    path = write_recording(tmp_path / "r.jsonl")
    with progress.reading(path, "analyze", enabled=False) as on_read:
        assert on_read is None
    with progress.counting("record", enabled=False, seconds=5) as show:
        assert show is None
    with progress.Stages("set-up", enabled=False) as setup:
        setup.stage("broker")
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("name", ["r.jsonl", "r.jsonl.gz"])
def test_reading_reports_positions_in_the_file_on_disk(tmp_path, monkeypatch, name):
    monkeypatch.setattr(recording, "_CHUNK", 4096)
    path = write_recording(tmp_path / name, steps=400)
    positions = []
    events = list(recording.read_events(path, on_read=positions.append))
    assert len(events) == 800
    assert len(positions) >= 2 and positions == sorted(positions)
    assert positions[-1] == path.stat().st_size


def test_updates_are_throttled_by_time():
    now = [0.0]
    throttle = progress._Throttle(every=0.1, clock=lambda: now[0])
    due = []
    for _ in range(30):
        due.append(throttle.due())
        now[0] += 0.01
    assert due.count(True) == 3


def test_analyze_draws_no_progress_when_not_a_terminal(tmp_path, capsys):
    path = write_recording(tmp_path / "r.jsonl")
    assert main(["analyze", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("400 events") and err == ""
    assert main(["analyze", str(path), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["events"] == 400 and err == ""


def run_in_terminal(argv: list[str], cwd: Path, timeout: float = 60.0) -> bytes:
    """What ``argv`` writes to a terminal (a pseudo-terminal for stdout and stderr)."""
    leader, follower = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "120"}
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower,
                            env=env, cwd=cwd)
    os.close(follower)
    out = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = os.read(leader, 65536)
        except OSError:        # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    proc.wait(10)
    return out


def test_analyze_draws_progress_on_a_terminal_but_not_with_json(tmp_path):
    path = write_recording(tmp_path / "r.jsonl")
    cli = [sys.executable, "-m", "trainguard.cli", "analyze", str(path)]
    drawn = run_in_terminal(cli, tmp_path)
    assert b"analyze" in drawn and b"100%" in drawn
    plain = run_in_terminal([*cli, "--json"], tmp_path)
    assert json.loads(plain.decode())["events"] == 400


def test_set_up_stages_and_counts_draw_on_a_terminal(tmp_path):
    code = ("from trainguard.progress import Stages, counting, wanted\n"
            "with Stages('demo set-up', enabled=wanted()) as setup:\n"
            "    setup.stage('topics')\n"
            "with counting('record', wanted(), seconds=1.0) as show:\n"
            "    show(42, '0 invalid')\n")
    drawn = run_in_terminal([sys.executable, "-c", code], tmp_path)
    assert b"demo set-up: topics" in drawn
    assert b"42 events, 0 invalid" in drawn
