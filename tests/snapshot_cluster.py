"""Machines for the recovery tests: node agents holding snapshots, and torchrun per machine.

Each "machine" is a node name, its own snapshot folder under /dev/shm and its own node agent
(``trainguard agent --snapshot-dir``). Its ranks are one torchrun with
``--nnodes``/``--node-rank`` and ``NODE_NAME`` set to the machine's name. On a
:class:`Network` each machine is a network namespace of its own with its own address on a
bridge (its agent, its ranks and its gloo connections live there, and a lost machine leaves
the network); without one, the machines share the loopback and are told apart by port.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
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


class Network:
    """Network namespaces for machines: a bridge in this namespace and, per machine, a
    namespace with one veth (``eth0``, 198.18-19.x.<n>/24) on it. ``Network.create()`` is None
    where namespaces cannot be made (not root, no ``ip``): the machines then share the
    loopback. ``close()`` deletes what it made. Networks made at once (test lanes side by
    side) get different subnets: one is chosen and its bridge addressed under a file lock."""

    def __init__(self, subnet: str = "198.18.0"):
        self.tag = uuid.uuid4().hex[:6]
        self.bridge = f"tgb{self.tag}"
        self.subnet = subnet
        self.spaces: list = []
        self.links: list = []

    @classmethod
    def create(cls) -> "Network | None":
        net = cls()
        try:
            with open("/tmp/trainguard-test-networks.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                net.subnet = free_subnet()
                net._ip("link", "add", net.bridge, "type", "bridge")
                net._ip("addr", "add", f"{net.subnet}.254/24", "dev", net.bridge)
            net._ip("link", "set", net.bridge, "up")
            probe = f"tg{net.tag}probe"           # namespaces need more rights than links
            net._ip("netns", "add", probe)
            net._ip("netns", "del", probe)
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"no network namespaces here ({exc}): machines share the loopback")
            net.close()
            return None
        return net

    @staticmethod
    def _ip(*args, ns: str | None = None) -> None:
        cmd = ["ip", *(["-n", ns] if ns else []), *args]
        subprocess.run(cmd, check=True, capture_output=True, timeout=30)

    def join(self, machine: "Machine") -> None:
        n = len(self.spaces) + 1
        ns, veth = f"tg{self.tag}{machine.name}", f"tgv{self.tag}{n}"
        self._ip("netns", "add", ns)
        self.spaces.append(ns)
        self._ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}b")
        self.links.append(f"{veth}b")
        self._ip("link", "set", f"{veth}b", "master", self.bridge)
        self._ip("link", "set", f"{veth}b", "up")
        self._ip("link", "set", veth, "netns", ns)
        self._ip("link", "set", veth, "name", "eth0", ns=ns)
        self._ip("addr", "add", f"{self.subnet}.{n}/24", "dev", "eth0", ns=ns)
        self._ip("link", "set", "eth0", "up", ns=ns)
        self._ip("link", "set", "lo", "up", ns=ns)
        machine.ns, machine.ip = ns, f"{self.subnet}.{n}"

    def leave(self, machine: "Machine") -> None:
        """The machine drops off the network (its namespace and its link go)."""
        if machine.ns in self.spaces:
            subprocess.run(["ip", "netns", "del", machine.ns], capture_output=True, timeout=30)
            self.spaces.remove(machine.ns)

    def close(self) -> None:
        for ns in list(self.spaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        for link in self.links:                # gone with their namespace, unless a join failed
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)
        self.spaces, self.links = [], []
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)


def free_subnet() -> str:
    """The first /24 of 198.18.0.0/15 (set aside for network tests, RFC 2544, never a real
    network's) that no interface of this namespace has an address in."""
    shown = subprocess.run(["ip", "-o", "-4", "addr", "show"], check=True, capture_output=True,
                           text=True, timeout=30).stdout
    taken = set(re.findall(r"inet (198\.1[89]\.\d+)\.\d+/", shown))
    for subnet in (f"198.{a}.{b}" for a in (18, 19) for b in range(256)):
        if subnet not in taken:
            return subnet
    raise OSError("every /24 of 198.18.0.0/15 is in use")


class Machine:
    def __init__(self, name: str, root: Path, port: int, network: Network | None = None):
        self.name, self.dir, self.port = name, root / name, port
        self.agent = None
        self.ns, self.ip = None, "127.0.0.1"
        self.network = network
        if network is not None:
            network.join(self)

    @property
    def address(self) -> str:
        return f"{self.ip}:{self.port}"

    def inside(self, cmd: list) -> list:
        """``cmd`` run on this machine (in its network namespace)."""
        return ["ip", "netns", "exec", self.ns, *cmd] if self.ns else cmd

    def env(self, env: dict) -> dict:
        """``env`` for a process on this machine: its node name, its snapshot folder, and
        gloo on its own interface."""
        out = {**env, "NODE_NAME": self.name, "TRAINGUARD_SNAPSHOT_DIR": str(self.dir)}
        if self.ns:
            out["GLOO_SOCKET_IFNAME"] = "eth0"
        return out

    def start_agent(self, peers: list, env: dict, log: Path) -> "Machine":
        others = ",".join(f"{m.name}={m.address}" for m in peers if m is not self)
        cmd = [str(TRAINGUARD), "agent", "--node", self.name, "--interval", "30",
               "--metrics-port", "0", "--runtime-dir", str(self.dir.parent / f"{self.name}.run"),
               "--snapshot-dir", str(self.dir), "--snapshot-listen", self.address,
               "--snapshot-peers", others]
        self.agent = subprocess.Popen(self.inside(cmd), env=env, stdout=open(log, "wb"),
                                      stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 30
        while not (self.dir / "agent.sock").exists():
            assert self.agent.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "agent did not start"
            time.sleep(0.1)
        return self

    def lose(self) -> None:
        """The machine is gone: its agent killed, its memory dropped, off the network."""
        if self.agent is not None and self.agent.poll() is None:
            os.killpg(self.agent.pid, signal.SIGKILL)
            self.agent.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.network is not None:
            self.network.leave(self)

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
             port: int = 0, max_restarts: int = 0, log: Path, on: Machine | None = None,
             master: str = "127.0.0.1") -> subprocess.Popen:
    """``on``: the machine it runs on (its namespace and environment); ``master``: the
    address of node rank 0's machine."""
    where = (["--standalone"] if nnodes == 1 else
             ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr",
              master, "--master-port", str(port)])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--max-restarts", str(max_restarts), *where, str(TRAIN), *args]
    if on is not None:
        cmd, env = on.inside(cmd), on.env(env)
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


def standby_launcher(m: Machine, role: list, *, master: str, args: list, env: dict, log: Path,
                     nproc: int = 2, nnodes: int = 2, extra=()) -> subprocess.Popen:
    """Machine ``m``'s standby launcher (``role``: ``--node-rank R`` or ``--spare``; ``extra``:
    more of its options) of train.py with ``args``, one warm standby per rank, the store at
    ``master``."""
    cmd = [sys.executable, "-m", "trainguard.launcher.inplace", "--nproc", str(nproc),
           "--standby", str(nproc), "--nnodes", str(nnodes), *role, "--master", master,
           "--node", m.name, *extra, "--", str(TRAIN), *args]
    return subprocess.Popen(m.inside(cmd), env=m.env(env), cwd=REPO, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def copied_elsewhere(machines: list, job: str, ranks) -> int:
    """The newest step that each of ``ranks`` has a replica of on one of ``machines``."""
    return min(max((s for m in machines for s in m.steps(job, r, "replica")), default=0)
               for r in ranks)


def tear_down(procs, machines: list, network: "Network | None") -> None:
    """Kill ``procs`` (and what they started), stop the machines' agents, remove the
    network."""
    for proc in procs:
        kill(proc)
    for m in machines:
        m.stop_agent()
    if network is not None:
        network.close()


def restored_lines(out: str) -> dict:
    """``{rank: (newest, restored, source)}`` from the ``[snapshot]`` lines of train.py."""
    pattern = re.compile(r"\[snapshot\] rank (\d+) on \S+: newest (-?\d+), restored step "
                         r"(\d+) from (\S+) in")
    return {int(m[1]): (int(m[2]), int(m[3]), m[4]) for m in pattern.finditer(out)}
