"""`trainguard demo` stops every process it started when interrupted (Ctrl-C or SIGTERM)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("signum", [signal.SIGINT])
def test_interrupted_demo_leaves_nothing_running(kafka_bootstrap, tmp_path, signum):
    out = tmp_path / "demo-out"
    demo = subprocess.Popen([sys.executable, "-m", "trainguard.cli", "demo", "--json",
                             "--no-baseline", "--minutes", "3", "--out", str(out),
                             "--bootstrap", kafka_bootstrap],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        steps = out / "trainguard" / "steps.jsonl"
        while time.monotonic() < deadline and not (steps.exists() and steps.stat().st_size):
            assert demo.poll() is None, demo.stderr.read().decode()[-2000:]
            time.sleep(1)
        assert steps.exists(), "training never started"
        assert len(processes_mentioning(str(out))) >= 5   # services, run, torchrun, ranks
        demo.send_signal(signum)
        assert demo.wait(60) == 130
        time.sleep(2)
        assert processes_mentioning(str(out)) == []
    finally:
        for pid in processes_mentioning(str(out)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
