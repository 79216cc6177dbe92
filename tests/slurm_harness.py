"""A real Slurm cluster (Debian 12's ``slurmctld``/``slurmd``, Slurm 22.05) on loopback for tests.

One ``slurmctld`` and several ``slurmd`` daemons on this machine: one ``NodeName`` per daemon,
all ``NodeAddr=127.0.0.1`` with a port each, each daemon started as ``slurmd -N <name>``. No
munge: ``AuthType=auth/none``, ``CredType=cred/none``. State, spool, logs and pid files live in
one temporary folder; the daemons and every job step are stopped when the cluster is left
(``scancel`` of all jobs, then SIGTERM / SIGKILL to the daemons and their process trees).

The Slurm tools find this cluster through ``SLURM_CONF`` (:attr:`SlurmCluster.env`).

Why a requeued job waits: when Slurm requeues a batch job it sets the job's begin time to
``now + cred_expire + 1`` once the old allocation has finished completing, so that the
credentials of the old run are revoked before the new one starts; ``cred_expire`` (set by
``AuthInfo=cred_expire=<s>``) defaults to 120 s. The job
meanwhile shows ``PENDING`` with ``Reason=BeginTime``; once eligible it waits for the next
periodic scheduling pass (``sched_interval``, 60 s). The driver's restart does not wait for
either (see actions/drivers/slurm.py and docs/DRIVERS.md, "How fast Slurm brings a job
back"); this cluster keeps Slurm's defaults for both, as a stock cluster has them.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from trainguard.launcher.supervisor import descendants as _descendants

DAEMONS = ("slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "srun", "scancel")
PATHS = {name: shutil.which(name) or (f"/usr/sbin/{name}" if Path(f"/usr/sbin/{name}").exists()
                                      else None) for name in DAEMONS}
MISSING = [name for name, path in PATHS.items() if path is None]
WHY_MISSING = (f"no Slurm ({', '.join(MISSING)} missing): apt-get install slurmctld slurmd "
               f"slurm-client (scripts/test.sh does it when run as root)")
NOT_ROOT = "the Slurm daemons of the test cluster must run as root"

CONF = """\
ClusterName=tg{tag}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={first_port}
AuthType=auth/none
CredType=cred/none
{auth_info}SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/linear
SchedulerType=sched/builtin
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=5
CompleteWait=0
MinJobAge=300
MessageTimeout=5
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
Waittime=0
{nodes}
PartitionName=tg Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=EXCLUSIVE
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SlurmCluster:
    """A running test cluster; made by :func:`slurm_cluster`."""

    root: Path
    nodes: list
    conf: Path
    env: dict
    procs: dict = field(default_factory=dict)

    def run(self, *argv: str, check: bool = True, timeout: float = 20.0,
            env: dict | None = None) -> str:
        """A Slurm command (``scontrol``, ``squeue``...) against this cluster; its stdout."""
        done = subprocess.run([PATHS.get(argv[0]) or argv[0], *argv[1:]],
                              env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} exited {done.returncode}: "
                                 f"{done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    def sbatch(self, script: Path, *args: str) -> str:
        return self.run("sbatch", "--parsable", *args, str(script)).strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        """``scontrol show job`` as a dict (``JobState``, ``Reason``, ``NodeList``, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        return _fields(out)

    def node(self, name: str) -> dict:
        return _fields(self.run("scontrol", "show", "node", "-o", name))

    def wait_job(self, job_id: str, states, timeout: float = 60.0) -> dict:
        states = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        info: dict = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} not {sorted(states)} within {timeout} s: {info}\n"
                             f"{self.log_tail()}")

    def wait_idle(self, names=None, timeout: float = 30.0) -> None:
        names = list(names or self.nodes)
        deadline = time.monotonic() + timeout
        states: dict = {}
        while time.monotonic() < deadline:
            states = {n: self.node(n).get("State", "") for n in names}
            if all(s.split("+")[0] == "IDLE" for s in states.values()):
                return
            time.sleep(0.2)
        raise AssertionError(f"nodes not idle within {timeout} s: {states}\n{self.log_tail()}")

    def resume_nodes(self, names) -> None:
        """Undo drains (a node that is not drained is left as it is)."""
        for name in names:
            if "DRAIN" in self.node(name).get("State", ""):
                self.run("scontrol", "update", f"NodeName={name}", "State=RESUME")

    def log_tail(self, chars: int = 1500) -> str:
        out = []
        for path in sorted((self.root / "log").glob("*.log")):
            out.append(f"--- {path.name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(out)

    def cancel_all(self) -> None:
        self.run("scancel", "--full", "--user=root", check=False)


def _fields(text: str) -> dict:
    """``Key=Value Key2=Value2`` (one-line ``scontrol show -o`` output) as a dict.

    >>> _fields("JobId=7 JobState=PENDING Reason=BeginTime Dependency=(null)")
    {'JobId': '7', 'JobState': 'PENDING', 'Reason': 'BeginTime', 'Dependency': '(null)'}
    """
    out: dict = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep:
            out[key] = value
    return out


def _stop(proc: subprocess.Popen) -> None:
    tree = _descendants(proc.pid)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    for pid in tree + _descendants(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _stray_steps(root: Path) -> list[int]:
    """Processes of this cluster left behind (slurmstepd, job scripts), found by the
    cluster's folder in their command line or environment."""
    found = []
    marker = str(root).encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if marker in cmd or marker in environ:
            found.append(int(entry))
    return found


def skip_reason() -> str | None:
    if MISSING:
        return WHY_MISSING
    if os.geteuid() != 0:
        return NOT_ROOT
    return None


@contextlib.contextmanager
def slurm_cluster(tmp_path: Path, nodes: int = 3, cpus: int = 2, cred_expire: int | None = None):
    """Yields a running :class:`SlurmCluster` of ``nodes`` idle nodes ``tg1..tgN``;
    ``cred_expire`` None keeps Slurm's default (120 s), as a stock cluster has it."""
    why = skip_reason()
    if why:
        pytest.skip(why)
    root = Path(tmp_path) / "slurm"
    for sub in ("state", "spool", "log"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    names = [f"tg{i + 1}" for i in range(nodes)]
    ports = [free_port() for _ in names]
    lines = [f"NodeName={n} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} Port={p} "
             f"CPUs={cpus} State=UNKNOWN" for n, p in zip(names, ports)]
    conf = root / "slurm.conf"
    conf.write_text(CONF.format(tag=os.getpid() % 10000, ctld_port=free_port(),
                                first_port=ports[0], root=root,
                                auth_info=f"AuthInfo=cred_expire={cred_expire}\n"
                                if cred_expire else "",
                                nodes="\n".join(lines)))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    for leaked in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURMD_NODENAME"):
        env.pop(leaked, None)
    cluster = SlurmCluster(root=root, nodes=names, conf=conf, env=env)
    devnull = subprocess.DEVNULL
    try:
        cluster.procs["slurmctld"] = subprocess.Popen(
            [PATHS["slurmctld"], "-D", "-i", "-f", str(conf)], env=env, stdin=devnull,
            stdout=devnull, stderr=open(root / "log" / "slurmctld.err", "wb"),
            start_new_session=True)
        _wait(lambda: cluster.run("scontrol", "ping", check=False).count("UP") > 0,
              cluster, 20, "slurmctld to answer")
        for n in names:
            cluster.procs[n] = subprocess.Popen(
                [PATHS["slurmd"], "-D", "-N", n, "-f", str(conf)], env=env, stdin=devnull,
                stdout=devnull, stderr=open(root / "log" / f"slurmd-{n}.err", "wb"),
                start_new_session=True)
        cluster.wait_idle(timeout=30)
        yield cluster
    finally:
        with contextlib.suppress(Exception):
            cluster.cancel_all()
        for name in reversed(list(cluster.procs)):
            _stop(cluster.procs[name])
        for pid in _stray_steps(root):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def _wait(predicate, cluster: SlurmCluster, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in cluster.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited with {proc.returncode}:\n"
                                     f"{cluster.log_tail()}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            if predicate():
                return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{cluster.log_tail()}")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """One test cluster of three nodes for a test module (import this fixture into it)."""
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


def sleeper(folder: Path, name: str = "sleeper.sh", first: str | None = None) -> Path:
    """A batch script that runs ``first`` (shell lines; by default: record each start,
    ``SLURM_RESTART_COUNT`` and node list, in ``starts.txt`` next to it) and then sleeps,
    leaving quickly on SIGTERM."""
    if first is None:
        first = (f'echo "$SLURM_JOB_ID ${{SLURM_RESTART_COUNT:-0}} $SLURM_JOB_NODELIST '
                 f'$(date +%s.%N)" >> {folder}/starts.txt')
    script = folder / name
    script.write_text(f"#!/bin/bash\n{first}\ntrap 'exit 143' TERM\nsleep 600 & wait\n")
    script.chmod(0o755)
    return script
