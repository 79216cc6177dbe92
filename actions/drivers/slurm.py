"""Slurm: restart a batch job off bad machines, drain those machines. Argv lists, no shell.

``mode="requeue"`` (default) keeps the job id. The job is requeued *held*, and once its old run
has finished (the job leaves ``COMPLETING``) its exclusion list and start time are set and it
is released::

    scontrol requeuehold <job>
    scontrol show job -o <job>          (repeated until JobState=PENDING: op "wait")
    scontrol update JobId=<job> [ExcNodeList=<n1,n2>] StartTime=now
    scontrol release <job>

A rollback (``resume_step``) reads the job's comment between the wait and the update
(``squeue -h -j <job> -o %k``: op "read_comment") and the update writes it back with
``trainguard-resume-step=<step>@<Restarts>`` added: a requeued job keeps the environment it was
submitted with, and ``trainguard run`` (or ``trainguard resume-step`` in the batch script)
finds the step there (see :mod:`.slurm_comment`). A job held by ``requeuehold`` is always
released, whatever became of the calls between.

Why: a job's ``ExcNodeList`` can be changed only while it is pending; and when Slurm requeues
a job it sets the job's begin time to ``cred_expire + 1`` seconds (120 s by default, see
``AuthInfo`` in slurm.conf) after the old run finished, then waits for the next periodic
scheduling pass (``sched_interval``, 60 s by default), showing ``Reason=BeginTime``.
``StartTime=now`` set *after* the old run finished (set earlier, Slurm overwrites it) and a
release, which wakes the scheduler, start the job at once. The update is made at least one
second after the old run was seen finished: Slurm rejects a launch credential that is not
newer, in whole seconds, than the revocation of the old run's. ``wait_s`` bounds the wait; a
job still completing then keeps Slurm's own delay.

``mode="resubmit"`` cancels the job and submits its script again (a new job id: the
``output`` of the ``sbatch --parsable`` call; later restarts of the old id act on the new
one)::

    scancel <job>
    sbatch --parsable --exclude=<n1,n2> --export=ALL,TRAINGUARD_RESUME=1,\
        TRAINGUARD_RESTART_COUNT=<n>[,TRAINGUARD_RESUME_STEP=<step>] [sbatch_args...] <script>

``evict(nodes)`` drains the machines (``scontrol update NodeName=<n1,n2> State=DRAIN
Reason=<reason>``, which needs Slurm operator rights; ``drain=False`` skips it) and remembers
them: every later restart of this driver excludes all machines evicted or excluded before.

>>> d = SlurmDriver(dry_run=True)
>>> [c.describe() for c in d.restart("4242")]
['scontrol requeuehold 4242', 'scontrol update JobId=4242 StartTime=now', 'scontrol release 4242']
>>> [c.describe() for c in d.evict(["gpu-07"], reason="trainguard: Xid 79 (incident i1)")]
['scontrol update NodeName=gpu-07 State=DRAIN Reason=trainguard: Xid 79 (incident i1)']
>>> for c in d.restart("4242", exclude_nodes=["gpu-03"]):
...     print(c.status, c.argv)
dry_run ['scontrol', 'requeuehold', '4242']
dry_run ['scontrol', 'update', 'JobId=4242', 'ExcNodeList=gpu-03,gpu-07', 'StartTime=now']
dry_run ['scontrol', 'release', '4242']
>>> [c.describe() for c in d.restart("4242", resume_step=40)][1:3]
['squeue -h -j 4242 -o %k', 'scontrol update JobId=4242 ExcNodeList=gpu-03,gpu-07 StartTime=now Comment=<comment> trainguard-resume-step=40@<Restarts>']
"""
from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterable

from .base import DriverCall, InvalidTarget, check_names, cut
from .slurm_comment import TOKEN, restart_count, with_resume_step

__all__ = ["SlurmDriver", "JOB_ID", "NODE_NAME", "job_state"]

JOB_ID = re.compile(r"[0-9]+(?:[_+][0-9]+)?")
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
MODES = ("requeue", "resubmit")


def job_state(show_job: str) -> str | None:
    """``JobState`` of one-line ``scontrol show job -o`` output, None when absent.

    >>> job_state("JobId=7 JobName=t JobState=COMPLETING Reason=None")
    'COMPLETING'
    >>> job_state("slurm_load_jobs error: Invalid job id specified") is None
    True
    """
    found = re.search(r"(?:^|\s)JobState=(\S+)", show_job or "")
    return found.group(1) if found else None


@dataclass(kw_only=True)
class SlurmDriver:
    """Recovery through the Slurm command-line tools, which must be on ``PATH`` (or given)."""

    dry_run: bool = False
    mode: str = "requeue"
    script: str | None = None
    sbatch_args: tuple = ()
    drain: bool = True
    reason: str = "trainguard evict"
    scontrol: str = "scontrol"
    sbatch: str = "sbatch"
    scancel: str = "scancel"
    squeue: str = "squeue"
    timeout: float = 30.0
    wait_s: float = 60.0
    poll_s: float = 0.2
    runner: Callable[..., subprocess.CompletedProcess] = subprocess.run
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    excluded: set = field(default_factory=set)
    resubmitted: dict = field(default_factory=dict)
    restarts: dict = field(default_factory=dict)

    KIND: ClassVar[str] = "slurm"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "resubmit" and not self.script:
            raise ValueError("mode='resubmit' needs script= (the batch script to submit)")
        if not all(isinstance(a, str) for a in self.sbatch_args):
            raise ValueError("sbatch_args must be strings, one argv element each")
        _one_line(self.reason)
        self.excluded = set(check_names(self.excluded, NODE_NAME, "node", "a Slurm node name"))

    def current(self, job_ref: str) -> str:
        """The job id a restart of ``job_ref`` acts on: the last resubmission of it."""
        seen = set()
        while job_ref in self.resubmitted and job_ref not in seen:
            seen.add(job_ref)
            job_ref = self.resubmitted[job_ref]
        return job_ref

    # ----------------------------------------------------------------- plans (argv lists)
    def plan_restart(self, job_ref: str, exclude_nodes: Iterable[str] = (),
                     resume_step: int | None = None, *, restart: int | None = None,
                     comment: str | None = None) -> list[list[str]]:
        """The argv lists of a restart; for a requeue with ``resume_step``, ``restart`` (the
        job's ``Restarts`` once requeued) and ``comment`` (its comment) fill in the
        ``Comment=`` of the update (placeholders when not known, as in a dry run)."""
        [job] = check_names([self.current(job_ref)], JOB_ID, "Slurm job id",
                            "digits, e.g. 4242 or 4242_7")
        avoid = sorted(self.excluded | set(check_names(exclude_nodes, NODE_NAME, "node",
                                                       "a Slurm node name")))
        step = _resume_step(resume_step)
        if self.mode == "resubmit":
            exclude = [f"--exclude={','.join(avoid)}"] if avoid else []
            count = self.restarts.get(job_ref, 0) + 1
            export = f"--export=ALL,TRAINGUARD_RESUME=1,TRAINGUARD_RESTART_COUNT={count}"
            if step is not None:
                export += f",TRAINGUARD_RESUME_STEP={step}"
            return [[self.scancel, job],
                    [self.sbatch, "--parsable", *exclude, export, *self.sbatch_args,
                     self.script]]
        exclude = [f"ExcNodeList={','.join(avoid)}"] if avoid else []
        update = [self.scontrol, "update", f"JobId={job}", *exclude, "StartTime=now"]
        if step is None:
            return [[self.scontrol, "requeuehold", job], update,
                    [self.scontrol, "release", job]]
        if restart is None:
            update.append(f"Comment=<comment> {TOKEN}={step}@<Restarts>")
        else:
            update.append(f"Comment={with_resume_step(comment, step, restart)}")
        return [[self.scontrol, "requeuehold", job], [self.squeue, "-h", "-j", job, "-o", "%k"],
                update, [self.scontrol, "release", job]]

    def plan_evict(self, nodes: Iterable[str], reason: str | None = None) -> list[list[str]]:
        names = check_names(nodes, NODE_NAME, "node", "a Slurm node name")
        if not names or not self.drain:
            return []
        return [[self.scontrol, "update", f"NodeName={','.join(names)}", "State=DRAIN",
                 f"Reason={_one_line(reason or self.reason)}"]]

    # ----------------------------------------------------------------- the interface
    def restart(self, job_ref: str, exclude_nodes: Iterable[str] = (),
                resume_step: int | None = None) -> list[DriverCall]:
        """``resume_step`` (a rollback's) reaches a resubmitted job as
        ``TRAINGUARD_RESUME_STEP``, a requeued one through its comment (module docstring)."""
        plan = self.plan_restart(job_ref, exclude_nodes, resume_step)
        if self.mode == "resubmit":
            calls = self._run(list(zip(["cancel", "submit"], plan)))
            if calls[-1].op == "submit" and calls[-1].status == "done":
                self.restarts[job_ref] = self.restarts.get(job_ref, 0) + 1
                new = calls[-1].output.split(";")[0].strip()
                if JOB_ID.fullmatch(new):
                    self.resubmitted[self.current(job_ref)] = new
        else:
            calls = self._requeue(job_ref, exclude_nodes, resume_step, plan)
        self.excluded |= set(check_names(exclude_nodes, NODE_NAME, "node", "a Slurm node name"))
        return calls

    def _requeue(self, job_ref, exclude_nodes, resume_step, plan) -> list[DriverCall]:
        ops = ["requeuehold", "read_comment", "update", "release"] if len(plan) == 4 else \
            ["requeuehold", "update", "release"]
        if self.dry_run:
            return self._run(list(zip(ops, plan)))
        hold, release = plan[0], plan[-1]
        calls = self._run([("requeuehold", hold)])
        if calls[-1].status != "done":
            return calls
        wait, restart = self._wait_finished(hold[-1])
        calls.append(wait)
        update = plan[-2]
        if resume_step is not None:
            read = plan[1]
            if restart is None:
                calls.append(DriverCall(
                    driver=self.KIND, op="read_comment", argv=read, status="failed",
                    error="the job's Restarts count is unknown, so the resume step cannot be "
                          "tied to its next run; the step was not passed on"))
            else:
                call, comment = self._call("read_comment", read)
                calls.append(call)
                call.output = ""  # the job owner's text: not for the audit record
            if calls[-1].status == "done":
                update = self.plan_restart(job_ref, exclude_nodes, resume_step, restart=restart,
                                           comment=comment.rstrip("\n"))[-2]
            else:  # requeued all the same: off the machines, without the step (and said so)
                update = [a for a in update if not a.startswith("Comment=")]
        calls += self._run([("update", update)])
        # Always: a job held by requeuehold would otherwise stay held for good.
        calls += self._run([("release", release)])
        return calls

    def evict(self, nodes: Iterable[str], reason: str | None = None) -> list[DriverCall]:
        """Drain ``nodes``; ``reason`` (one line, e.g. naming the incident) replaces the
        configured one."""
        plan = self.plan_evict(nodes, reason)
        calls = self._run([("drain", argv) for argv in plan])
        self.excluded |= set(check_names(nodes, NODE_NAME, "node", "a Slurm node name"))
        return calls

    def _wait_finished(self, job: str) -> tuple[DriverCall, int | None]:
        """Poll ``scontrol show job`` until the requeued job's old run has finished; then
        let the wall clock pass a whole second (see the module docstring). Returns the call
        and the job's ``Restarts`` count as last seen."""
        argv = [self.scontrol, "show", "job", "-o", job]
        call = DriverCall(driver=self.KIND, op="wait", argv=argv, status="done")
        start = self.clock()
        state = restarts = None
        while True:
            try:
                done = self.runner(argv, shell=False, capture_output=True, text=True,
                                   timeout=self.timeout, check=False)
                state = job_state(done.stdout)
                restarts = restart_count(done.stdout)
            except (OSError, subprocess.TimeoutExpired):
                state = None
            waited = self.clock() - start
            if state != "COMPLETING" or waited >= self.wait_s:
                break
            self.sleep(self.poll_s)
        if state == "COMPLETING":
            call.output = (f"still COMPLETING after {waited:.1f} s; Slurm starts the job "
                           "after its own delay (cred_expire)")
        elif state is None:
            call.output = "job state unknown; not waiting"
        else:
            self.sleep(1.0)
            call.output = f"old run finished after {waited:.1f} s (JobState={state})"
        return call, restarts

    def _run(self, steps: list[tuple[str, list[str]]]) -> list[DriverCall]:
        calls = []
        for op, argv in steps:
            call, _ = self._call(op, argv)
            calls.append(call)
            if call.status == "failed":
                break
        return calls

    def _call(self, op: str, argv: list[str]) -> tuple[DriverCall, str]:
        """One command (planned only, in dry run): its record and its whole stdout."""
        call = DriverCall(driver=self.KIND, op=op, argv=argv,
                          status="dry_run" if self.dry_run else "planned")
        if self.dry_run:
            return call, ""
        try:
            done = self.runner(argv, shell=False, capture_output=True, text=True,
                               timeout=self.timeout, check=False)
        except FileNotFoundError:
            call.status, call.error = "failed", (
                f"{argv[0]} not found; install the Slurm client tools on this machine "
                f"or give its path in the driver configuration")
            return call, ""
        except subprocess.TimeoutExpired:
            call.status, call.error = "failed", f"no answer within {self.timeout} s"
            return call, ""
        call.output = cut(done.stdout)
        if done.returncode != 0:
            call.status = "failed"
            call.error = f"exit {done.returncode}: {cut(done.stderr) or call.output}"
        else:
            call.status = "done"
        return call, done.stdout or ""


def _resume_step(step) -> int | None:
    if step is None:
        return None
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidTarget(f"resume step {step!r} is not an integer >= 0")
    return step


def _one_line(reason: str) -> str:
    if not reason or not isinstance(reason, str) or "\n" in reason:
        raise ValueError("reason must be one non-empty line")
    return reason
