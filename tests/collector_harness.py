"""Helpers for the collector tests: run the example job under torchrun, read back events."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from trainguard import events as ev

REPO = Path(__file__).resolve().parents[1]
PYTHON = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv").exists() else sys.executable
JOB_SCRIPT = str(REPO / "examples" / "instrumented_job.py")


#: packages each framework's example job needs, named by the extra that installs them
FRAMEWORKS = {"hf": ("transformers", "accelerate"), "lightning": ("lightning",)}


def with_framework(name: str):
    """``name`` as a test parameter, skipped with the reason when its framework's packages
    are not installed (found without importing them)."""
    missing = [p for p in FRAMEWORKS.get(name, ()) if importlib.util.find_spec(p) is None]
    return pytest.param(name, marks=pytest.mark.skipif(
        bool(missing), reason=f"{', '.join(missing)} not installed (pip install "
                              f"-e '.[{name}]')"))


def closed_port() -> int:
    """A local port nobody listens on (bound, then released)."""
    from trainguard.broker import free_port

    return free_port()


def job_env(bootstrap: str, prefix: str, home: Path, **extra) -> dict:
    env = {**os.environ, "TRAINGUARD_BOOTSTRAP": bootstrap, "TRAINGUARD_TOPIC_PREFIX": prefix,
           "TRAINGUARD_HOME": str(home), "OMP_NUM_THREADS": "1", **extra}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def start(argv: list, env: dict, timeout: float) -> subprocess.Popen:
    return subprocess.Popen(["timeout", "-s", "KILL", str(int(timeout)), *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(5)


def torchrun(nproc: int, job_args: list, env: dict, timeout: float = 120) -> tuple[int, str]:
    """Run the example job under ``torch.distributed.run``; returns (exit code, output)."""
    return torchrun_script([JOB_SCRIPT, *job_args], nproc, env, timeout)


def rank_results(out_dir: Path, nproc: int) -> dict[int, dict]:
    return {r: json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)}


def consume(bootstrap: str, topic: str, done=None, timeout: float = 30.0,
            idle: float = 3.0) -> list:
    """Decoded events of ``topic`` from the start, until ``done(events)``, ``idle`` s without a
    message after the first one, or ``timeout``. Invalid messages come back as InvalidEvent."""
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"t-{uuid.uuid4().hex}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    consumer.subscribe([topic])
    events: list = []
    deadline = time.monotonic() + timeout
    last = None
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.3)
            if msg is None:
                if last is not None and time.monotonic() - last > idle and done is None:
                    break
                continue
            if msg.error():
                continue
            last = time.monotonic()
            try:
                event = ev.decode(msg.value())
                event.extra["_key"] = msg.key()
                events.append(event)
            except ev.InvalidEvent as exc:
                events.append(exc)
            if done is not None and done(events):
                break
    finally:
        consumer.close()
    return events


def by_type(events: list, kind: str) -> list:
    return [e for e in events if not isinstance(e, Exception) and e.type == kind]


def torchrun_script(script: list, nproc: int, env: dict, timeout: float) -> tuple[int, str]:
    """Run ``script`` (a path under the repository and its arguments) under
    ``torch.distributed.run``; returns (exit code, output)."""
    from trainguard.broker import free_port

    argv = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-port", str(free_port()), "--monitor-interval", "0.1",
            str(REPO / script[0]), *script[1:]]
    proc = start(argv, env, timeout)
    try:
        out, _ = proc.communicate(timeout=timeout + 5)
    finally:
        stop(proc)
    return proc.returncode, out


def watched_run(bootstrap: str, tmp: Path, job: str, script: list, nproc: int, *,
                instrument: bool, extra_env=None, timeout: float = 240) -> tuple[int, str, list]:
    """Run a job under torchrun on its own topics of the real broker, watched by
    ``--instrument``'s environment (``instrument``) or by what the script does itself; returns
    (exit code, output, the telemetry events read back until every rank's exit arrived)."""
    from trainguard.config import Config, Topics
    from trainguard.integrations.instrument import instrument_env
    from trainguard.topics import TopicPlan, create_topics

    prefix = f"tint{uuid.uuid4().hex[:8]}"
    config = Config(bootstrap=bootstrap, topics=Topics(prefix=prefix))
    create_topics(config, TopicPlan(telemetry_partitions=3, other_partitions=1))
    env = job_env(bootstrap, prefix, tmp / "home", TRAINGUARD_JOB=job,
                  TRAINGUARD_CHECKPOINT_DIR=str(tmp / "ckpt"), **(extra_env or {}))
    if instrument:
        env.update(instrument_env(env))
    code, out = torchrun_script(script, nproc, env, timeout)
    if code != 0:
        return code, out, []

    def complete(events):
        return len([e for e in by_type(events, "lifecycle") if e.event == "exit"]) >= nproc

    return code, out, consume(bootstrap, config.topics.telemetry, done=complete, timeout=40)


def write_recording(events: list, path: Path) -> Path:
    """The valid events, in event time, as a live ``trainguard record`` would have written
    them (for ``trainguard analyze``)."""
    lines = []
    for e in sorted((e for e in events if not isinstance(e, Exception)), key=lambda e: e.ts):
        key = e.extra.pop("_key", None)
        lines.append(ev.encode(e).decode() + "\n")
        e.extra["_key"] = key
    path.write_text("".join(lines))
    return path
