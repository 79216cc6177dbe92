"""``trainguard run``: launch a training command, keep it running, obey the action service.

The command runs as its own process group (its own session). The supervisor publishes the
job's ``lifecycle`` (``start``/``exit`` of the whole command, rank null, extra fields
``source: "supervisor"`` and ``incarnation``; before tearing the command down to restart it,
an ``exit`` with ``restart: true`` and no code, so that the detectors take the ranks' exits
that follow for what they are) to ``<prefix>.telemetry``, and reads the
``order`` events of its job on ``<prefix>.orders`` (SPEC §6) from the moment it started:

- ``evict``: the machines join the exclusion list. It takes effect only where ``trainguard
  run`` can place the job: when the command is an ``srun`` (``trainguard run`` inside a Slurm
  allocation, the allocation's unused nodes being warm spares), every later launch runs it
  with ``--exclude=<the list>`` inserted after ``srun``, and the eviction is acked ``done``
  (``excluded``). Any other command runs where ``trainguard run`` runs, which it cannot leave:
  the eviction is acked ``not_applicable`` (``cannot_exclude``) with the reason, never
  ``done``;
- ``restart`` / ``rollback``: SIGTERM to the process group, ``grace`` seconds, SIGKILL to the
  group and to every process that descended from the command (torchrun starts its workers
  in sessions of their own), then relaunch. Under ``--standby`` no relaunch where warm
  standbys can take over: a restart kills only the ranks it names, a rollback asks the
  standby launcher to stop every rank and restore at or before the step
  (:mod:`trainguard.launcher.inplace_status`);
- ``stop``: the command is stopped as on SIGTERM and the supervisor exits.

Each order is answered by one ``ack`` on the same topic, whose ``status`` and ``code`` say
what became of it (:data:`trainguard.actions.orders.ACK_CODES`). Before anything is done,
an order passes :class:`~trainguard.signing.Verifier` (with a signing key: signed by it;
always: not stale, not from the future, its ``order_id`` not seen before) and
:func:`~trainguard.actions.orders.check_targets` (node names, steps). A refused order is
never carried out: it goes to ``<prefix>.deadletter`` with the reason and is acked
``rejected``.

Each relaunch gets ``TRAINGUARD_RESUME=1``, ``TRAINGUARD_CHECKPOINT_DIR``,
``TRAINGUARD_EXCLUDE_NODES`` (comma list, accumulated; for the command's information: the
exclusion itself is the ``srun --exclude`` above), ``TRAINGUARD_RESTART_COUNT`` and, the
launch right after a rollback, ``TRAINGUARD_RESUME_STEP`` (SPEC §6; also as
``TRAINGUARD_ROLLBACK_STEP``); every launch gets ``TRAINGUARD_JOB``. A non-zero exit is
restarted too, and recorded on ``<prefix>.actions`` (extra ``trigger: "exit"``).
Every relaunch, whatever its cause, spends one of ``max_restarts``; once they are spent, a
crash ends the supervisor with the command's exit code and a restart order is acked
``failed`` (code ``budget_exhausted``). SIGINT and SIGTERM are passed on to the command (a
second one kills it at once) and the supervisor exits with the command's code; should the
supervisor itself be killed, the command gets SIGTERM (``PR_SET_PDEATHSIG``).

Its Kafka ends (the order feed, the publisher) are :mod:`trainguard.launcher.order_feed`.

Never two restarts for one incident: a restart of an incident it already restarted for is
acked ``already_satisfied`` (``incident_restarted``). So is a restart whose incident began
(``targets.onset_ts``) before the current launch, which already runs with the exclusions and
rollback asked for (``relaunched_since_onset``): the process that had the problem is gone
(typically, a crash that the supervisor restarted by itself before the order arrived).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from functools import lru_cache
from pathlib import Path

from trainguard import events as ev
from trainguard.actions.orders import InvalidTarget, ack_of, check_targets
from trainguard.collectors.nodename import node_name
from trainguard.collectors.resume import RESUME_STEP_VARS, requested_resume_step
from trainguard.errors import UserError
from trainguard.launcher.inplace_status import StandbyLink
from trainguard.launcher.order_feed import Delivery, OrderFeed, OrderPublisher
from trainguard.launcher.order_feed import log as _log
from trainguard.logs import context as log_context
from trainguard.signing import Refusal, Verifier

__all__ = ["Supervisor", "main", "descendants", "guess_world_size",
           "exit_status", "with_exclusions"]


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


def with_exclusions(cmd: list, nodes) -> list | None:
    """``cmd`` launched off ``nodes``: an ``srun`` gets ``--exclude`` right after it; None
    when ``cmd`` is not an ``srun`` (it runs on this machine, which it cannot leave).

    >>> with_exclusions(["srun", "-N2", "torchrun", "t.py"], {"tg2", "tg1"})
    ['srun', '--exclude=tg1,tg2', '-N2', 'torchrun', 't.py']
    >>> with_exclusions(["/usr/bin/srun", "t.sh"], set())
    ['/usr/bin/srun', 't.sh']
    >>> with_exclusions(["torchrun", "t.py"], {"tg2"}) is None
    True
    """
    if not cmd or os.path.basename(str(cmd[0])) != "srun":
        return None
    return [cmd[0], f"--exclude={','.join(sorted(nodes))}", *cmd[1:]] if nodes else list(cmd)


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


class Supervisor:
    """One supervised command. ``publish`` (an event -> None), ``orders`` (an object with
    ``poll(timeout) -> Delivery | None``) and ``deadletter`` (``(delivery, reason) -> None``)
    are the Kafka ends; each may be None. ``verifier`` checks every order before it is
    obeyed (default: no signing key, so signatures are not checked). ``resume_step``: the step
    a rollback decided before this supervisor started asks to resume from (a requeued Slurm
    job's, see :mod:`trainguard.launcher.slurm_resume`); the launches get it as a rollback's."""

    def __init__(self, *, job: str, cmd: list, max_restarts: int = 3,
                 checkpoint_dir: str | None = None, grace_s: float = 10.0,
                 environ: dict | None = None, node: str | None = None, publish=None,
                 orders=None, verifier: Verifier | None = None, deadletter=None,
                 clock=time.time, log=_log, poll_s: float = 0.1,
                 world_size: int | None = None, instrument: bool = False,
                 resume_step: int | None = None, inplace_status: str | None = None):
        self.job = job
        self.cmd = list(cmd)
        self.max_restarts = max_restarts
        self.checkpoint_dir = checkpoint_dir
        self.grace_s = grace_s
        self.environ = dict(os.environ if environ is None else environ)
        self.node = node or node_name(self.environ)
        self.publish = publish
        self.orders = orders
        self.verifier = verifier or Verifier(clock=clock)
        self.deadletter = deadletter
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
        # a rollback's step from before this run (a resubmitted Slurm job's environment
        # carries it): the first launch resumes at or before it; the ones after resume the
        # newest, or a restart would roll the progress since back again each time
        inherited = requested_resume_step(self.environ)
        for name in RESUME_STEP_VARS:
            self.environ.pop(name, None)
        if resume_step is None:
            resume_step = inherited
        self.rollback_step: int | None = resume_step
        self.resume_once = resume_step  # ... given to the next launch only
        self.restarted_incidents: set[str] = set()
        self._stop_signal: int | None = None
        self._signals = 0
        #: the standby launcher, through its --status file (``trainguard run --standby``)
        self.inplace = StandbyLink(inplace_status) if inplace_status else None

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
            if self.inplace is not None:
                self._inplace_news()
            code = self.proc.poll()
            if code is not None:
                if self.inplace is not None:
                    self._inplace_news()           # its last words: why it gave up
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
                                 f"{self.max_restarts} restart(s) of --max-restarts are spent",
                                 code="budget_exhausted")
                    self.log(f"command exited with {what}; restart budget "
                             f"({self.max_restarts}) spent, giving up")
                    return status
                self.log(f"command exited with {what}; restarting")
                why = self.inplace.fallback if self.inplace is not None else None
                fallback = f" (no restart in place: {why}; the fallback)" if why else ""
                self._relaunch()
                self._record(incident, "restart", self._targets(), "done",
                             f"exit: the command exited with {what}; relaunched "
                             f"(restart {self.restarts} of {self.max_restarts}){fallback}",
                             code="relaunched")
                continue
            delivery = self.orders.poll(self.poll_s) if self.orders else None
            if delivery is None:
                if not self.orders:
                    time.sleep(self.poll_s)
                continue
            self.take(delivery)

    # ------------------------------------------------------------------ orders
    def take(self, delivery: Delivery) -> str | None:
        """Check one order of this job and carry it out; returns the ack status sent, or
        None for a message that is not an order of this job."""
        order = delivery.event
        if not isinstance(order, ev.Order) or order.job != self.job:
            return None
        refusal = self.verifier.check(delivery.raw, order.order_id)
        targets = None
        if refusal is None:
            try:
                targets = check_targets(order.op, order.targets)
            except InvalidTarget as exc:
                refusal = Refusal("invalid_target", str(exc))
        if refusal is not None:
            self.log(f"order {order.order_id[:80]} ({order.op}) refused: {refusal}")
            if self.deadletter is not None:
                try:
                    self.deadletter(delivery, f"order refused: {refusal}")
                except Exception as exc:  # the refusal stands whatever Kafka does
                    self.log(f"cannot dead-letter order {order.order_id[:80]}: {exc}")
            return self._ack(order, "rejected", refusal.code, f"refused: {refusal.reason}")
        return self.obey(order, targets)

    def obey(self, order: ev.Order, targets: dict) -> str:
        """Carry out a checked order (``targets`` from :func:`check_targets`); returns the
        ack status sent."""
        if order.op == "stop":
            self.request_stop(signal.SIGTERM)
            return self._ack(order, "done", "stopping", "stopping the command as on SIGTERM")
        if order.op == "evict":
            if with_exclusions(self.cmd, self.excluded) is None:
                self.excluded |= set(targets["nodes"])  # TRAINGUARD_EXCLUDE_NODES, for information
                return self._ack(order, "not_applicable", "cannot_exclude", (
                    f"trainguard run starts {os.path.basename(self.cmd[0])} on this machine "
                    f"({self.node}) and cannot keep the job off "
                    f"{', '.join(targets['nodes']) or 'any machine'}; nothing was excluded (use "
                    "a cluster driver, or an srun command inside a Slurm allocation)"))
            new = set(targets["nodes"]) - self.excluded
            if not new:
                return self._ack(order, "already_satisfied", "already_excluded", (
                    f"{', '.join(targets['nodes']) or 'nothing'} already excluded; exclusion "
                    f"list {sorted(self.excluded)}"))
            self.excluded |= new
            return self._ack(order, "done", "excluded", (
                f"excluded {', '.join(sorted(new))} from the next launch (srun "
                f"--exclude={','.join(sorted(self.excluded))})"))
        incident = order.incident or order.order_id
        if incident in self.restarted_incidents:
            return self._ack(order, "already_satisfied", "incident_restarted", (
                f"incident {incident} was already restarted for; not restarted again"))
        self.excluded |= set(targets["exclude_nodes"])
        rollback = targets.get("rollback_step") if order.op == "rollback" else None
        onset = targets.get("onset_ts")
        if (onset is not None and onset < self.launched_ts
                and self.excluded <= self.active_excluded
                and (order.op != "rollback" or rollback == self.rollback_step)):
            self.restarted_incidents.add(incident)
            return self._ack(order, "already_satisfied", "relaunched_since_onset", (
                f"launch {self.incarnation} started {self.launched_ts - onset:.1f}s after "
                "the incident began, with the exclusions asked for; not restarted again"))
        if self.inplace is not None:     # a takeover under way: judge the order after it
            self.inplace.settle(alive=lambda: self.proc is not None and self.proc.poll() is None)
            self._inplace_news()
        # machines to exclude need a relaunch, where a relaunch can exclude (an srun)
        excluding = not self.excluded <= self.active_excluded \
            and with_exclusions(self.cmd, set()) is not None
        if (order.op == "restart" and onset is not None and self.inplace is not None
                and onset < self.inplace.inplace_ts and not excluding):
            self.restarted_incidents.add(incident)
            return self._ack(order, "already_satisfied", "restarted_in_place", (
                f"warm standbys took the ranks over in place "
                f"{self.inplace.inplace_ts - onset:.1f}s after the incident began; not "
                "relaunched"))
        if order.op == "restart" and not excluding:
            killed = self._kill_ranks(targets.get("ranks") or [])
            if killed:
                self.restarted_incidents.add(incident)
                return self._ack(order, "done", "restarted_in_place", (
                    f"killed the process of rank(s) {', '.join(map(str, killed))}; warm "
                    "standbys take the ranks over in place, no relaunch"))
        answer = self._rollback_in_place(order, rollback) if order.op == "rollback" \
            and not excluding else None
        if answer is not None and answer.get("event") == "rollback":
            self.restarted_incidents.add(incident)
            self.rollback_step = rollback
            return self._ack(order, "done", "restarted_in_place", (
                f"rollback to step {rollback}: every rank stopped; warm standbys take the ranks "
                "over in place and restore the newest snapshot at or before it, no relaunch"))
        if self.restarts >= self.max_restarts:
            return self._ack(order, "failed", "budget_exhausted", (
                f"all {self.max_restarts} restart(s) of --max-restarts are spent; not "
                "restarted"))
        self.restarted_incidents.add(incident)
        if order.op == "rollback":
            self.rollback_step = self.resume_once = rollback
        try:
            self._relaunch()
        except OSError as exc:
            return self._ack(order, "failed", "launch_failed", f"relaunch failed: {exc}")
        return self._ack(order, "done", "relaunched", (
            f"{order.op}: relaunched as launch {self.incarnation} (pid {self.proc.pid}, "
            f"restart {self.restarts} of {self.max_restarts})"))

    def _ack(self, order: ev.Order, status: str, code: str, reason: str) -> str:
        self._emit(ack_of(order, status, code, reason, ts=self.clock(), node=self.node))
        with log_context(incident=order.incident):
            self.log(f"{order.op} order {order.order_id[:80]} (incident {order.incident}): "
                     f"{status} ({reason})")
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
        if self.resume_once is not None:     # the launch after a rollback; the ones after
            env["TRAINGUARD_RESUME_STEP"] = str(self.resume_once)    # it resume the newest
            env["TRAINGUARD_ROLLBACK_STEP"] = str(self.resume_once)
        from trainguard.integrations.instrument import enabled, instrument_env

        if self.instrument or enabled(env):
            env.update(instrument_env(env))
        return env

    def _launch(self, resume: bool) -> None:
        if self.checkpoint_dir:
            Path(self.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        cmd = with_exclusions(self.cmd, self.excluded) or self.cmd
        self.proc = subprocess.Popen(cmd, env=self._env(resume), start_new_session=True,
                                     preexec_fn=_die_with_parent())
        self.resume_once = None
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
            self._publish_exit(None, restart=True)    # announced first: the ranks' exits
            self._terminate(signal.SIGTERM)           # that follow are ours, not a crash
            self._publish_exit(self.proc.returncode, restart=True)
        if self.inplace is not None:       # what the torn-down launcher wrote is no news
            self.inplace.forget()
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
        if getattr(self, "metrics", None) is not None:  # trainguard.service_metrics.RunMetrics
            self.metrics.event(event)
        if self.publish is None:
            return
        try:
            self.publish(event)
        except Exception as exc:  # the training must go on whatever Kafka does
            self.log(f"cannot publish {event.type}: {exc}")

    def _publish_exit(self, code: int | None, restart: bool = False) -> None:
        status, name = exit_status(code) if code is not None else (None, None)
        extra = {"source": "supervisor", "incarnation": self.incarnation}
        if restart:
            extra["restart"] = True
        self._emit(ev.Lifecycle(job=self.job, ts=self.clock(), node=self.node, rank=None,
                                event="exit", exit_code=None if name else status, signal=name,
                                extra=extra))

    def _record(self, incident: str, action: str, targets: dict, status: str, reason: str,
                code: str, trigger: str = "exit") -> None:
        """An audit record of the supervisor's own restart of a command that exited (or of
        the standby launcher's restart in place)."""
        self._emit(ev.Action(job=self.job, ts=self.clock(), node=self.node, incident=incident,
                             action=action, targets=targets, status=status, reason=reason,
                             extra={"action_id": f"{incident}:{action}", "source": "supervisor",
                                    "trigger": trigger, "code": code,
                                    "incarnation": self.incarnation}))

    def _kill_ranks(self, ranks: list) -> list:
        """SIGKILL the processes of ``ranks`` under the standby launcher; the ranks killed."""
        if self.inplace is None or self.proc is None or self.proc.poll() is not None:
            return []
        pids = self.inplace.pids_of(ranks, set(descendants(self.proc.pid)))
        for pid in pids:
            _kill(pid, signal.SIGKILL)
        return list(ranks) if pids else []

    def _rollback_in_place(self, order: ev.Order, step) -> dict | None:
        """Ask the standby launcher to roll back to ``step`` in place; its answer, or None."""
        if self.inplace is None or type(step) is not int or self.proc is None:
            return None
        answer = self.inplace.rollback(step, order.order_id[:200],
                                       alive=lambda: self.proc.poll() is None)
        if answer is not None and answer.get("event") != "rollback":
            self.log(f"no rollback in place: {str(answer.get('reason'))[:200]}; relaunching")
        return answer

    def _inplace_news(self) -> None:
        """Record the standby launcher's restarts in place."""
        for record in self.inplace.news():
            generation = record.get("generation")
            rollback = record.get("rollback_step")
            why = (f"a rollback to step {rollback} stopped every rank" if type(rollback) is int
                   else f"rank {record.get('rank')} exited with status {record.get('status')}")
            self._record(f"{self.job}:inplace:{self.incarnation}:{generation}", "restart",
                         self._targets(), "done",
                         f"{why}; warm standbys took the ranks over in place (generation "
                         f"{generation}), no relaunch", code="restarted_in_place",
                         trigger="inplace")


@lru_cache(maxsize=1)
def _die_with_parent():
    """What the child runs before exec: SIGTERM it when the supervisor dies, even by SIGKILL
    (Linux ``PR_SET_PDEATHSIG``), so a killed supervisor does not leave the job running
    unwatched; torchrun passes the SIGTERM on to its workers. ``prctl`` is looked up here, in
    the parent: between fork and exec a child of a threaded process must not import or
    ``dlopen`` (another thread may have held the loader's lock at the fork). None where
    there is no ``prctl``."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    term = int(signal.SIGTERM)

    def set_pdeathsig() -> None:
        prctl(1, term)  # PR_SET_PDEATHSIG = 1

    return set_pdeathsig


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


def main(args, config, keys=None) -> int:
    """``trainguard run [options] -- CMD...``; ``keys`` (default: from the environment, see
    :func:`~trainguard.signing.signing_key_from_env`) check the orders and sign the acks."""
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
    from trainguard.signing import KEY_ENV, signing_key_from_env, warn_if_unsigned

    status, world_size = None, None
    standby, nproc = getattr(args, "standby", None), getattr(args, "nproc", None)
    if nproc is not None and standby is None:
        raise UserError("--nproc goes with --standby (without it, give torchrun its own "
                        "--nproc-per-node)")
    if standby is not None:
        if standby < 0 or (nproc is not None and nproc < 1):
            raise UserError(f"--standby must be 0 or more and --nproc 1 or more, got "
                            f"{standby} and {nproc}")
        import sys
        import tempfile

        world_size = nproc or 1
        status = os.path.join(tempfile.mkdtemp(prefix="trainguard-run-"), "inplace.jsonl")
        cmd = [sys.executable, "-m", "trainguard.launcher.inplace", "--nproc",
               str(world_size), "--standby", str(standby), "--max-restarts",
               str(args.max_restarts), "--status", status, "--", *cmd]
    keys = keys if keys is not None else signing_key_from_env()
    warn_if_unsigned(keys, "run", f"orders on {config.topics.orders}")
    started = time.time()
    from .slurm_resume import slurm_rollback_step

    resume_step = slurm_rollback_step(os.environ, log=_log)
    publish = OrderPublisher(config, keys)
    feed = OrderFeed(config, args.job, since=started)
    feed.start()
    # the training command never sees the key: it could sign orders with it
    environ = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    supervisor = Supervisor(job=args.job, cmd=cmd, max_restarts=args.max_restarts,
                            checkpoint_dir=args.checkpoint_dir, grace_s=args.grace,
                            environ=environ, publish=publish, orders=feed,
                            verifier=Verifier(keys), deadletter=publish.deadletter,
                            instrument=getattr(args, "instrument", False),
                            resume_step=resume_step, world_size=world_size,
                            inplace_status=status)
    old = {s: signal.signal(s, lambda signum, frame: supervisor.request_stop(signum))
           for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        from trainguard.service_metrics import serve_run_metrics

        serve_run_metrics(supervisor, args, log=_log)
        return supervisor.run()
    except FileNotFoundError as exc:
        raise UserError(f"cannot run {cmd[0]!r}: {exc.strerror}; check the command after --")
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        feed.stop()
        publish.close()
        if getattr(supervisor, "metrics", None) is not None:
            supervisor.metrics.close()
        if status is not None:
            import shutil

            shutil.rmtree(os.path.dirname(status), ignore_errors=True)
