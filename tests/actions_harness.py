"""Helpers for the action-service, supervisor and end-to-end tests (and bench/bench_recovery).

- :data:`CHILD_SCRIPT`: a tiny "training" script that checkpoints a step counter, resumes from
  it when ``TRAINGUARD_RESUME=1``, logs every launch and step as JSON lines to ``$CHILD_LOG``,
  and crashes or hangs once (or always) when ``CHILD_MODE`` says so;
- :class:`Procs`: starts trainguard commands as subprocesses (each under ``timeout -s KILL``)
  and stops them all, SIGTERM then SIGKILL, whatever happens;
- Kafka helpers: produce events, collect events of a topic, wait for a condition;
- :class:`ListRecorder`: the action service's audit log kept in a list.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from trainguard import events as ev

REPO = Path(__file__).resolve().parents[1]


class ListRecorder:
    """A recorder (``write(action_event)``, ``flush()``) that keeps the action events in a
    list, for the pipeline and order-desk tests."""

    def __init__(self):
        self.events: list[ev.Action] = []

    def write(self, event: ev.Action) -> None:
        self.events.append(event)

    def flush(self) -> None:
        pass

PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv").exists() else sys.executable

CHILD_SCRIPT = r'''
import json, os, signal, subprocess, sys, time
ckpt = os.path.join(os.environ["TRAINGUARD_CHECKPOINT_DIR"], "step.json")
log = os.environ["CHILD_LOG"]
mode = os.environ.get("CHILD_MODE", "")
what, _, at = mode.partition("@")
at = int(at or 0)
marker = os.path.join(os.environ["TRAINGUARD_CHECKPOINT_DIR"], f"done-{what}")

def emit(**kw):
    kw["t"] = time.time()
    with open(log, "a") as f:
        f.write(json.dumps(kw) + "\n")

step = 0
if os.environ.get("TRAINGUARD_RESUME") == "1" and os.path.exists(ckpt):
    with open(ckpt) as f:
        step = json.load(f)["step"] + 1
if what == "ignore_term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                                  start_new_session=True)
    emit(event="grandchild", pid=grandchild.pid)
emit(event="start", step=step, pid=os.getpid(), resume=os.environ.get("TRAINGUARD_RESUME"),
     exclude=os.environ.get("TRAINGUARD_EXCLUDE_NODES"),
     restarts=os.environ.get("TRAINGUARD_RESTART_COUNT"),
     rollback=os.environ.get("TRAINGUARD_ROLLBACK_STEP"), job=os.environ.get("TRAINGUARD_JOB"),
     resume_step=os.environ.get("TRAINGUARD_RESUME_STEP"))
total = int(os.environ.get("CHILD_STEPS", "30"))
pause = float(os.environ.get("CHILD_STEP_S", "0.02"))
here = 0
while step < total:
    time.sleep(pause)
    if what == "crash" and step == at and not os.path.exists(marker):
        open(marker, "w").close()
        emit(event="crash", step=step)
        sys.exit(3)
    if what == "crash_always" and here == at:
        emit(event="crash", step=step)
        sys.exit(3)
    if what in ("hang", "ignore_term") and step == at and not os.path.exists(marker):
        open(marker, "w").close()
        emit(event="hang", step=step)
        while True:
            time.sleep(0.05)
    with open(ckpt + ".tmp", "w") as f:
        json.dump({"step": step}, f)
    os.replace(ckpt + ".tmp", ckpt)
    emit(event="step", step=step)
    step += 1
    here += 1
emit(event="end", step=step)
'''


def write_child(folder: Path) -> Path:
    path = Path(folder) / "child.py"
    path.write_text(CHILD_SCRIPT)
    return path


def read_log(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line]
    except FileNotFoundError:
        return []


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


class Procs:
    """Subprocesses of one test, each wrapped in ``timeout -s KILL``; ``stop_all`` in finally."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], env: dict | None = None, limit_s: int = 120,
              **kw) -> subprocess.Popen:
        out = open(self.folder / f"{name}.log", "ab")
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        proc = subprocess.Popen(["timeout", "-s", "KILL", str(limit_s), *argv], stdout=out,
                                stderr=subprocess.STDOUT, env=full_env, cwd=self.folder, **kw)
        self.procs.append((name, proc))
        return proc

    def trainguard(self, name: str, *args: str, env=None, limit_s: int = 120):
        return self.start(name, [PYTHON, "-m", "trainguard.cli", *args], env=env,
                          limit_s=limit_s)

    def log(self, name: str) -> str:
        try:
            return (self.folder / f"{name}.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop_all(self, grace: float = 5.0) -> None:
        for _, proc in self.procs:
            if proc.poll() is None:
                _signal_tree(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for _, proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_tree(proc, signal.SIGKILL)
                proc.wait(timeout=5)


def _signal_tree(proc: subprocess.Popen, sig: int) -> None:
    """Signal ``timeout``'s child too (``timeout`` passes TERM on, not KILL)."""
    from trainguard.launcher.supervisor import descendants

    pids = [proc.pid, *descendants(proc.pid)] if sig == signal.SIGKILL else [proc.pid]
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------------- Kafka
def producer(config):
    from confluent_kafka import Producer

    return Producer(config.kafka(**{"linger.ms": 0, "partitioner": "murmur2_random"}))


def produce(config, topic: str, *events: ev.Event) -> None:
    p = producer(config)
    for event in events:
        p.produce(topic, key=event.job.encode(), value=ev.encode(event))
    assert p.flush(10) == 0


def answer_captures(config, stop, ranks=4, stuck=2, node="hostA", jobs=None):
    """A stand-in node agent: answers capture_stacks (of ``jobs``, default all) with rank
    ``stuck`` in load_batch."""
    from trainguard.actions.topic_io import KafkaSource

    commands = KafkaSource(config, config.topics.commands, since=time.time() - 5)
    out = producer(config)
    try:
        while not stop.is_set():
            cmd = commands.poll(0.1)
            if not isinstance(cmd, ev.Command) or (jobs is not None and cmd.job not in jobs):
                continue
            replies = []
            for rank in range(ranks):
                fn = "load_batch" if rank == stuck else "all_reduce"
                frames = [{"function": fn, "file": "/w/train.py", "line": 1},
                          {"function": "main", "file": "/w/train.py", "line": 2}]
                replies.append(ev.Stack(job=cmd.job, ts=time.time(), node=node, rank=rank,
                                        capture_id=cmd.capture_id, pid=100 + rank,
                                        method="py-spy", threads=[
                                            {"name": "MainThread", "id": 1, "frames": frames}]))
            for reply in replies:
                out.produce(config.topics.stacks, key=reply.job.encode(), value=ev.encode(reply))
            out.flush(10)
    finally:
        commands.close()


class Collector:
    """Every event of a topic from its beginning; :meth:`wait` polls until ``predicate``."""

    def __init__(self, config, topic: str):
        from trainguard.actions.topic_io import KafkaSource

        self.source = KafkaSource(config, topic, since=0.0)
        self.events: list[ev.Event] = []

    def drain(self, seconds: float = 0.2) -> list[ev.Event]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            event = self.source.poll(0.05)
            if event is not None:
                self.events.append(event)
        return self.events

    def wait(self, predicate, timeout: float = 30.0, what: str = "events"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.drain(0.2)
            found = predicate(self.events)
            if found:
                return found
        seen = [(e.type, getattr(e, "action", ""), getattr(e, "status", ""))
                for e in self.events][-20:]
        raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; got {seen}")

    def close(self) -> None:
        self.source.close()


# ---------------------------------------------------------------------------- a deployment
TRAIN_SCRIPT = REPO / "examples" / "train.py"


class Deployment:
    """Worker, node agent and action service of one test, on their own topic prefix and
    ``TRAINGUARD_HOME``, plus jobs under ``trainguard run``; for the end-to-end tests and
    bench/bench_recovery.py::

        with Deployment(tmp_path, config) as d:
            d.start(policy={"capture": {"rounds": 1}})
            run = d.supervise("j1", d.torchrun(4, steps=60), chaos="hang@step=25,rank=2")
            ...
    """

    def __init__(self, folder: Path, config, limit_s: int = 600):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.config = config
        self.limit_s = limit_s
        self.procs = Procs(self.folder)
        self.home = self.folder / "home"
        from trainguard.signing import KEY_ENV, generate_key

        self.env = {"TRAINGUARD_BOOTSTRAP": config.bootstrap,
                    "TRAINGUARD_TOPIC_PREFIX": config.topics.prefix,
                    "TRAINGUARD_HOME": str(self.home),
                    KEY_ENV: generate_key()}  # every service signs or checks orders

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.procs.stop_all(grace=10.0)

    def start(self, policy: dict | None = None, worker: bool = True, agent: bool = True,
              actions: bool = True) -> None:
        from trainguard.broker import free_port

        if worker:
            self.procs.trainguard("worker", "worker", "--data-dir", str(self.folder / "worker"),
                                  "--web-port", str(free_port()), env=self.env,
                                  limit_s=self.limit_s)
        if agent:
            self.procs.trainguard("agent", "agent", env=self.env, limit_s=self.limit_s)
        if actions:
            args = ["actions", "--state", str(self.folder / "actions-state.json")]
            if policy is not None:
                path = self.folder / "policy.json"
                path.write_text(json.dumps(policy))
                args += ["--policy", str(path)]
            self.procs.trainguard("actions", *args, env=self.env, limit_s=self.limit_s)
        waits = [("agent", "listening for commands")] if agent else []
        waits += [("actions", "consuming")] if actions else []
        waits += [("worker", "telemetry")] if worker else []
        for name, words in waits:
            wait_for(lambda: words in self.procs.log(name), timeout=60,
                     what=f"{name} to start: {self.procs.log(name)[-500:]}")

    @staticmethod
    def torchrun(ranks: int = 4, steps: int = 60, checkpoint_every: int = 10,
                 step_sleep: float = 0.1, job: str = "e2e", extra: list | None = None) -> list:
        return [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                "--standalone", *Deployment.script(steps, checkpoint_every, step_sleep, job, extra)]

    @staticmethod
    def script(steps: int = 60, checkpoint_every: int = 10, step_sleep: float = 0.1,
               job: str = "e2e", extra: list | None = None) -> list:
        """examples/train.py and its arguments."""
        return [str(TRAIN_SCRIPT), "--job", job, "--steps", str(steps),
                "--checkpoint-every", str(checkpoint_every), "--step-sleep", str(step_sleep),
                "--timeout", "300", *(extra or [])]

    def supervise(self, job: str, cmd: list, chaos: str | None = None, max_restarts: int = 2,
                  grace: float = 5.0, name: str | None = None,
                  standby: tuple | None = None) -> subprocess.Popen:
        """``trainguard run`` of ``cmd``; ``standby=(nproc, k)``: ``--nproc nproc --standby
        k``, ``cmd`` being the Python script and its arguments."""
        ckpt = self.folder / f"ckpt-{job}"
        env = {**self.env, "TRAINGUARD_CHAOS_LOG": str(self.folder / f"chaos-{job}.jsonl"),
               "TRAINGUARD_SNAPSHOT_DIR": str(self.folder / f"snapshots-{job}")}
        if chaos:
            env["TRAINGUARD_CHAOS"] = chaos
        inplace = ["--nproc", str(standby[0]), "--standby", str(standby[1])] if standby else []
        return self.procs.trainguard(name or f"run-{job}", "run", "--job", job,
                                     "--max-restarts", str(max_restarts), "--checkpoint-dir",
                                     str(ckpt), "--grace", str(grace), *inplace, "--", *cmd,
                                     env=env, limit_s=self.limit_s)

    def chaos_log(self, job: str) -> list[dict]:
        return read_log(self.folder / f"chaos-{job}.jsonl")


def first(events, type_=None, after: float = 0.0, **match):
    """The earliest event of a type (and attribute values) with ``ts`` after ``after``."""
    found = [e for e in events if (type_ is None or e.type == type_) and e.ts >= after
             and all(getattr(e, k, None) == v for k, v in match.items())]
    return min(found, key=lambda e: e.ts) if found else None
