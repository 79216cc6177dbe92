"""Machines for the recovery tests: node agents holding snapshots, and torchrun per machine.

Each "machine" is a node name, its own snapshot folder under /dev/shm and its own node agent
(``trainguard agent --snapshot-dir``) on a loopback port: several machines on one host, told
apart by name, folder and port (not network namespaces). Its ranks are one torchrun with
``--nnodes``/``--node-rank`` and ``NODE_NAME`` set to the machine's name.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"
TRAINGUARD = REPO / ".venv" / "bin" / "trainguard"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRAINGUARD_", "TORCHELASTIC_", "MASTER_", "NODE_NAME",
                                "SLURMD_"))}
    env.update(TRAINGUARD_BOOTSTRAP="127.0.0.1:1", TRAINGUARD_HOME=str(tmp / "home"),
               PYTHONUNBUFFERED="1")
    return env


class Machine:
    def __init__(self, name: str, root: Path, port: int):
        self.name, self.dir, self.port = name, root / name, port
        self.agent = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start_agent(self, peers: list, env: dict, log: Path) -> "Machine":
        others = ",".join(f"{m.name}={m.address}" for m in peers if m is not self)
        cmd = [str(TRAINGUARD), "agent", "--node", self.name, "--interval", "30",
               "--metrics-port", "0", "--runtime-dir", str(self.dir.parent / f"{self.name}.run"),
               "--snapshot-dir", str(self.dir), "--snapshot-listen", self.address,
               "--snapshot-peers", others]
        self.agent = subprocess.Popen(cmd, env=env, stdout=open(log, "wb"),
                                      stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while not (self.dir / "agent.sock").exists():
            assert self.agent.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "agent did not start"
            time.sleep(0.1)
        return self

    def lose(self) -> None:
        """The machine is gone: its agent killed and its memory dropped."""
        if self.agent is not None and self.agent.poll() is None:
            os.killpg(self.agent.pid, signal.SIGKILL)
            self.agent.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def stop_agent(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            os.killpg(self.agent.pid, signal.SIGTERM)
            try:
                self.agent.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.agent.pid, signal.SIGKILL)
                self.agent.wait()

    def steps(self, job: str, rank: int, folder: str) -> list:
        """Complete steps of (job, rank) in this machine's ``own`` or ``replica`` folder."""
        out = []
        for m in (self.dir / folder / job / f"rank{rank}").glob("*.json"):
            try:
                out.append(json.loads(m.read_text())["step"])
            except (OSError, ValueError, KeyError):
                pass
        return sorted(out)


def torchrun(args: list, env: dict, *, nproc: int, nnodes: int = 1, node_rank: int = 0,
             port: int = 0, max_restarts: int = 0, log: Path) -> subprocess.Popen:
    where = (["--standalone"] if nnodes == 1 else
             ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr",
              "127.0.0.1", "--master-port", str(port)])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--max-restarts", str(max_restarts), *where, str(TRAIN), *args]
    return subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def descendants(pid: int) -> list:
    """The processes below ``pid`` (torchrun starts its ranks in sessions of their own)."""
    children: dict = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            pass
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every process below it."""
    if proc.poll() is None:
        for pid in [proc.pid, *descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    proc.wait()


def restored_lines(out: str) -> dict:
    """``{rank: (newest, restored, source)}`` from the ``[snapshot]`` lines of train.py."""
    pattern = re.compile(r"\[snapshot\] rank (\d+) on \S+: newest (-?\d+), restored step "
                         r"(\d+) from (\S+) in")
    return {int(m[1]): (int(m[2]), int(m[3]), m[4]) for m in pattern.finditer(out)}
