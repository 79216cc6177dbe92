"""Children that trainguard starts and must clean up: `up` and `demo` run the worker, the
action service and the node agent as processes of their own, and stop every one of them on
exit, Ctrl-C included."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log: Path


@dataclass
class ServiceSet:
    """Started processes, each in its own session so that a stop reaches its whole tree."""

    log_dir: Path
    children: list = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict | None = None) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})},
                                    start_new_session=True)
        child = Child(name=name, proc=proc, log=log)
        self.children.append(child)
        return child

    def start_trainguard(self, name: str, args: list[str], env: dict | None = None) -> Child:
        return self.start(name, [sys.executable, "-m", "trainguard.cli", *args], env=env)

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    def stop(self, grace: float = 8.0) -> None:
        for child in reversed(self.children):
            _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in reversed(self.children):
            remaining = max(0.1, deadline - time.monotonic())
            try:
                child.proc.wait(remaining)
            except subprocess.TimeoutExpired:
                pass
            _signal_group(child.proc, signal.SIGKILL)
            try:
                child.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        self.children.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"
