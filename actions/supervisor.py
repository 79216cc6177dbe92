"""``trainguard run``: launch a training command, keep it running, obey the action service.

The command runs as its own process group (its own session). The supervisor publishes the
job's ``lifecycle`` (``start``/``exit`` of the whole command, rank null, extra fields
``source: "supervisor"`` and ``incarnation``) to ``<prefix>.telemetry``, and reads
``<prefix>.actions`` from the moment it started. It obeys ``planned`` actions of its job:

- ``evict``: the machines join the exclusion list (it takes effect at the next launch);
- ``restart`` / ``rollback``: SIGTERM to the process group, ``grace`` seconds, SIGKILL to the
  group and to every process that descended from the command (torchrun starts its workers
  in sessions of their own), then relaunch.

Each relaunch gets ``TRAINGUARD_RESUME=1``, ``TRAINGUARD_CHECKPOINT_DIR``,
``TRAINGUARD_EXCLUDE_NODES`` (comma list, accumulated), ``TRAINGUARD_RESTART_COUNT`` and, for
a rollback, ``TRAINGUARD_ROLLBACK_STEP``; every launch gets ``TRAINGUARD_JOB``. A non-zero
exit is restarted too. Every relaunch, whatever its cause, spends one of ``max_restarts``;
once they are spent, a crash ends the supervisor with the command's exit code and a restart
action is answered ``rate_limited``. SIGINT and SIGTERM are passed on to the command (a
second one kills it at once) and the supervisor exits with the command's code; should the
supervisor itself be killed, the command gets SIGTERM (``PR_SET_PDEATHSIG``).

Never two restarts for one incident: the supervisor writes ``done`` (or ``failed``,
``rate_limited``) with the action's ``action_id``, ignores an ``action_id`` it has seen, and
ignores a restart of an incident it already restarted for. A restart whose incident began
(``targets.onset_ts``) before the current launch, which already runs with the exclusions and
rollback asked for, is answered ``done`` with reason ``already_satisfied`` and not carried
out: the process that had the problem is gone (typically, a crash that the supervisor
restarted by itself before the service's restart arrived).
"""
from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from trainguard import events as ev
from trainguard.errors import UserError

__all__ = ["Supervisor", "ActionFeed", "main", "descendants", "guess_world_size",
           "exit_status"]

OBEYED = ("restart", "evict", "rollback")


def _log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} trainguard run: {message}", file=sys.stderr,
          flush=True)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren, ...), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def guess_world_size(cmd: list[str], environ=None) -> int:
    """World size of a command: torchrun's ``--nnodes`` x ``--nproc-per-node``, else
    ``WORLD_SIZE``, else 1.

    >>> guess_world_size(["torchrun", "--nnodes=2", "--nproc-per-node", "4", "train.py"])
    8
    >>> guess_world_size(["python", "train.py"], {})
    1
    """
    environ = os.environ if environ is None else environ
    text = " ".join(cmd)
    nproc = re.search(r"--nproc[-_]per[-_]node[= ](\d+)", text)
    nnodes = re.search(r"--nnodes[= ](\d+)(?::(\d+))?", text)
    if nproc:
        nodes = int(nnodes.group(2) or nnodes.group(1)) if nnodes else 1
        return int(nproc.group(1)) * nodes
    try:
        return max(1, int(environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def exit_status(returncode: int) -> tuple[int, str | None]:
    """``(shell exit code, signal name)`` of a Popen return code.

    >>> exit_status(3), exit_status(-9)
    ((3, None), (137, 'SIGKILL'))
    """
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"SIG{-returncode}"
        return 128 - returncode, name
    return returncode, None


class ActionFeed(threading.Thread):
    """Reads ``<prefix>.actions`` from ``since`` in a daemon thread and queues the planned
    actions of one job; keeps trying while Kafka is unreachable (training never waits)."""

    def __init__(self, config, job: str, since: float, log=_log, retry_s: float = 5.0):
        super().__init__(name="trainguard-action-feed", daemon=True)
        self.config, self.job, self.since, self.log = config, job, since, log
        self.retry_s = retry_s
        self.queue: queue.Queue = queue.Queue()
        self.stopped = threading.Event()
        self.ready = threading.Event()

    def run(self) -> None:
        from trainguard.actions.service import KafkaSource

        source, warned = None, False
        while not self.stopped.is_set():
            if source is None:
                try:
                    source = KafkaSource(self.config, self.config.topics.actions,
                                         since=self.since)
                    self.ready.set()
                except Exception as exc:
                    if not warned:
                        self.log(f"cannot read {self.config.topics.actions} yet ({exc}); "
                                 "supervising locally, retrying")
                        warned = True
                    self.stopped.wait(self.retry_s)
                    continue
            event = source.poll(0.2)
            if (isinstance(event, ev.Action) and event.job == self.job
                    and event.status == "planned" and event.action in OBEYED):
                self.queue.put(event)
        if source is not None:
            source.close()

    def poll(self, timeout: float):
        try:
            return self.queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def stop(self) -> None:
        self.stopped.set()


class Supervisor:
    """One supervised command. ``publish`` (an event -> None) and ``actions`` (an object with
    ``poll(timeout) -> ev.Action | None``) are the Kafka ends; both may be None."""

    def __init__(self, *, job: str, cmd: list, max_restarts: int = 3,
                 checkpoint_dir: str | None = None, grace_s: float = 10.0,
                 environ: dict | None = None, node: str | None = None, publish=None,
                 actions=None, clock=time.time, log=_log, poll_s: float = 0.1,
                 world_size: int | None = None, instrument: bool = False):
        self.job = job
        self.cmd = list(cmd)
        self.max_restarts = max_restarts
        self.checkpoint_dir = checkpoint_dir
        self.grace_s = grace_s
        self.environ = dict(os.environ if environ is None else environ)
        self.node = node or socket.gethostname()
        self.publish = publish
        self.actions = actions
        self.clock = clock
        self.log = log
        self.poll_s = poll_s
        self.world_size = world_size or guess_world_size(self.cmd, self.environ)
        self.instrument = instrument
        self.proc: subprocess.Popen | None = None
        self.incarnation = -1
        self.restarts = 0
        self.launched_ts = 0.0
        self.excluded: set[str] = set()
        self.active_excluded: set[str] = set()
        self.rollback_step: int | None = None
        self.seen_ids: set[str] = set()
        self.restarted_incidents: set[str] = set()
        self._stop_signal: int | None = None
        self._signals = 0

    # ------------------------------------------------------------------ the loop
    def request_stop(self, signum: int) -> None:
        """From a signal handler: pass ``signum`` on (a second request kills at once)."""
        self._stop_signal = signum
        self._signals += 1

    def run(self) -> int:
        self._launch(resume=False)
        while True:
            if self._stop_signal is not None:
                return self._shut_down()
            code = self.proc.poll()
            if code is not None:
                status, name = exit_status(code)
                self._publish_exit(code)
                if code == 0:
                    self.log(f"command finished (exit 0) after {self.restarts} restart(s)")
                    return 0
                incident = f"{self.job}:exit:{self.incarnation}:{int(self.launched_ts)}"
                what = f"signal {name}" if name else f"code {code}"
                if self.restarts >= self.max_restarts:
                    self._record(incident, "restart", {"job": self.job}, "rate_limited",
                                 f"budget_exhausted: the command exited with {what}; all "
                                 f"{self.max_restarts} restart(s) of --max-restarts are spent")
                    self.log(f"command exited with {what}; restart budget "
                             f"({self.max_restarts}) spent, giving up")
                    return status
                self.log(f"command exited with {what}; restarting")
                self._relaunch()
                self._record(incident, "restart", self._targets(), "done",
                             f"exit: the command exited with {what}; relaunched "
                             f"(restart {self.restarts} of {self.max_restarts})")
                continue
            action = self.actions.poll(self.poll_s) if self.actions else None
            if action is None:
                if not self.actions:
                    time.sleep(self.poll_s)
                continue
            self.obey(action)

    # ------------------------------------------------------------------ actions
    def obey(self, action: ev.Action) -> str | None:
        """Carry out one planned action if it is for this job and not done yet; returns the
        status written, or None when the action was ignored."""
        if action.job != self.job or action.status != "planned" or action.action not in OBEYED:
            return None
        action_id = (action.extra or {}).get("action_id") or \
            f"{action.incident}:{action.action}"
        if action_id in self.seen_ids:
            return None
        self.seen_ids.add(action_id)
        targets = action.targets or {}
        if action.action == "evict":
            nodes = set(targets.get("nodes") or []) | set(targets.get("exclude_nodes") or [])
            self.excluded |= nodes
            return self._reply(action, action_id, "done",
                               f"excluded {', '.join(sorted(nodes)) or 'nothing'} from the "
                               f"next launch; exclusion list {sorted(self.excluded)}")
        if action.incident in self.restarted_incidents:
            self.log(f"ignoring {action.action} {action_id}: incident {action.incident} was "
                     "already restarted for")
            return None
        self.excluded |= set(targets.get("exclude_nodes") or [])
        rollback = targets.get("rollback_step") if action.action == "rollback" else None
        onset = targets.get("onset_ts")
        if (isinstance(onset, (int, float)) and onset < self.launched_ts
                and self.excluded <= self.active_excluded
                and (action.action != "rollback" or rollback == self.rollback_step)):
            self.restarted_incidents.add(action.incident)
            return self._reply(action, action_id, "done", (
                f"already_satisfied: launch {self.incarnation} started "
                f"{self.launched_ts - onset:.1f}s after the incident began, with the "
                f"exclusions asked for; not restarted again"))
        if self.restarts >= self.max_restarts:
            return self._reply(action, action_id, "rate_limited", (
                f"budget_exhausted: all {self.max_restarts} restart(s) of --max-restarts are "
                "spent; not restarted"))
        self.restarted_incidents.add(action.incident)
        if action.action == "rollback":
            self.rollback_step = rollback
        try:
            self._relaunch()
        except OSError as exc:
            return self._reply(action, action_id, "failed", f"relaunch failed: {exc}")
        return self._reply(action, action_id, "done", (
            f"{action.action}: relaunched as launch {self.incarnation} (pid {self.proc.pid}, "
            f"restart {self.restarts} of {self.max_restarts}); {action.reason}"))

    def _reply(self, action: ev.Action, action_id: str, status: str, reason: str) -> str:
        self._record(action.incident, action.action, {**(action.targets or {}),
                                                      **self._targets()}, status, reason,
                     action_id=action_id)
        self.log(f"{action.action} for incident {action.incident}: {status} ({reason})")
        return status

    def _targets(self) -> dict:
        out = {"job": self.job, "exclude_nodes": sorted(self.excluded)}
        if self.rollback_step is not None:
            out["rollback_step"] = self.rollback_step
        return out

    # ------------------------------------------------------------------ processes
    def _env(self, resume: bool) -> dict:
        env = dict(self.environ)
        env["TRAINGUARD_JOB"] = self.job
        env["TRAINGUARD_RESTART_COUNT"] = str(self.restarts)
        if resume:
            env["TRAINGUARD_RESUME"] = "1"
        if self.checkpoint_dir:
            env["TRAINGUARD_CHECKPOINT_DIR"] = str(Path(self.checkpoint_dir).resolve())
        if self.excluded:
            env["TRAINGUARD_EXCLUDE_NODES"] = ",".join(sorted(self.excluded))
        if self.rollback_step is not None:
            env["TRAINGUARD_ROLLBACK_STEP"] = str(self.rollback_step)
        if self.instrument or env.get("TRAINGUARD_INSTRUMENT") == "1":
            from trainguard.integrations.instrument import instrument_env

            env.update(instrument_env(env))
        return env

    def _launch(self, resume: bool) -> None:
        if self.checkpoint_dir:
            Path(self.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.cmd, env=self._env(resume), start_new_session=True,
                                     preexec_fn=_die_with_parent)
        self.incarnation += 1
        self.launched_ts = self.clock()
        self.active_excluded = set(self.excluded)
        self.log(f"launch {self.incarnation}: pid {self.proc.pid}" +
                 (f", excluding {sorted(self.excluded)}" if self.excluded else ""))
        self._emit(ev.Lifecycle(job=self.job, ts=self.launched_ts, node=self.node, rank=None,
                                event="start", pid=self.proc.pid, world_size=self.world_size,
                                argv=[str(c) for c in self.cmd],
                                extra={"source": "supervisor",
                                       "incarnation": self.incarnation}))

    def _relaunch(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._terminate(signal.SIGTERM)
            self._publish_exit(self.proc.returncode)
        self.restarts += 1
        self._launch(resume=True)

    def _terminate(self, sig: int) -> int:
        """``sig`` to the group, ``grace_s``, then SIGKILL to the group and every
        descendant; returns the command's return code."""
        proc = self.proc
        tree = set(descendants(proc.pid))
        _killpg(proc.pid, sig)
        deadline = time.monotonic() + self.grace_s
        while proc.poll() is None and time.monotonic() < deadline:
            if self._signals > 1:
                break
            tree |= set(descendants(proc.pid))
            time.sleep(0.05)
        tree |= set(descendants(proc.pid)) if proc.poll() is None else set()
        _killpg(proc.pid, signal.SIGKILL)
        for pid in tree:
            _kill(pid, signal.SIGKILL)
        return proc.wait()

    def _shut_down(self) -> int:
        sig = self._stop_signal
        self.log(f"{signal.Signals(sig).name}: passing it on to the command")
        code = self.proc.poll()
        if code is None:
            code = self._terminate(sig)
        self._publish_exit(code)
        return exit_status(code)[0]

    # ------------------------------------------------------------------ Kafka
    def _emit(self, event: ev.Event) -> None:
        if self.publish is None:
            return
        try:
            self.publish(event)
        except Exception as exc:  # the training must go on whatever Kafka does
            self.log(f"cannot publish {event.type}: {exc}")

    def _publish_exit(self, code: int) -> None:
        status, name = exit_status(code)
        self._emit(ev.Lifecycle(job=self.job, ts=self.clock(), node=self.node, rank=None,
                                event="exit", exit_code=None if name else status, signal=name,
                                extra={"source": "supervisor",
                                       "incarnation": self.incarnation}))

    def _record(self, incident: str, action: str, targets: dict, status: str, reason: str,
                action_id: str | None = None) -> None:
        self._emit(ev.Action(job=self.job, ts=self.clock(), node=self.node, incident=incident,
                             action=action, targets=targets, status=status, reason=reason,
                             extra={"action_id": action_id or f"{incident}:{action}",
                                    "source": "supervisor", "incarnation": self.incarnation}))


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the supervisor dies, even by SIGKILL (Linux
    ``PR_SET_PDEATHSIG``), so a killed supervisor does not leave the job running unwatched;
    torchrun passes the SIGTERM on to its workers."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Publisher:
    """Lifecycle to the telemetry topic, action records to the actions topic."""

    def __init__(self, config):
        from confluent_kafka import Producer

        from trainguard.actions.service import quiet_logger

        self.config = config
        self.producer = Producer(config.kafka(**{
            "linger.ms": 5, "partitioner": "murmur2_random", "message.timeout.ms": 10000,
            "socket.timeout.ms": 5000}), logger=quiet_logger())

    def __call__(self, event: ev.Event) -> None:
        topics = self.config.topics
        topic = topics.actions if isinstance(event, ev.Action) else topics.telemetry
        self.producer.produce(topic, key=event.job.encode(), value=ev.encode(event))
        self.producer.poll(0)
        if isinstance(event, ev.Action):
            self.producer.flush(1.0)

    def close(self) -> None:
        self.producer.flush(2.0)


def main(args, config) -> int:
    """``trainguard run [options] -- CMD...``."""
    cmd = list(args.cmd or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UserError("no command to run; give it after --, e.g. "
                        "`trainguard run --job j1 -- torchrun --nproc-per-node 4 train.py`")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    if args.grace < 0:
        raise UserError(f"--grace must be 0 or more seconds, got {args.grace}")
    if not re.fullmatch(ev.JOB_PATTERN, args.job):
        raise UserError(f"--job {args.job!r} must be 1-128 of [A-Za-z0-9._-]")
    started = time.time()
    publish = _Publisher(config)
    feed = ActionFeed(config, args.job, since=started)
    feed.start()
    supervisor = Supervisor(job=args.job, cmd=cmd, max_restarts=args.max_restarts,
                            checkpoint_dir=args.checkpoint_dir, grace_s=args.grace,
                            environ=dict(os.environ), publish=publish, actions=feed,
                            instrument=getattr(args, "instrument", False))
    old = {s: signal.signal(s, lambda signum, frame: supervisor.request_stop(signum))
           for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return supervisor.run()
    except FileNotFoundError as exc:
        raise UserError(f"cannot run {cmd[0]!r}: {exc.strerror}; check the command after --")
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        feed.stop()
        publish.close()
