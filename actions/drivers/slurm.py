"""Slurm: restart a batch job off bad machines, drain those machines. Argv lists, no shell.

``mode="requeue"`` (default) keeps the job id. The job is requeued *held*, and once its old run
has finished (the job leaves ``COMPLETING``) its exclusion list and start time are set and it
is released::

    scontrol requeuehold <job>
    scontrol show job -o <job>          (repeated until JobState=PENDING: op "wait")
    scontrol update JobId=<job> [ExcNodeList=<n1,n2>] StartTime=now
    scontrol release <job>

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
"""
from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterable

from .base import DriverCall, check_names, cut

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
                     resume_step: int | None = None) -> list[list[str]]:
        [job] = check_names([self.current(job_ref)], JOB_ID, "Slurm job id",
                            "digits, e.g. 4242 or 4242_7")
        avoid = sorted(self.excluded | set(check_names(exclude_nodes, NODE_NAME, "node",
                                                       "a Slurm node name")))
        if self.mode == "resubmit":
            exclude = [f"--exclude={','.join(avoid)}"] if avoid else []
            count = self.restarts.get(job_ref, 0) + 1
            export = f"--export=ALL,TRAINGUARD_RESUME=1,TRAINGUARD_RESTART_COUNT={count}"
            if isinstance(resume_step, int) and not isinstance(resume_step, bool) \
                    and resume_step >= 0:
                export += f",TRAINGUARD_RESUME_STEP={resume_step}"
            return [[self.scancel, job],
                    [self.sbatch, "--parsable", *exclude, export, *self.sbatch_args,
                     self.script]]
        exclude = [f"ExcNodeList={','.join(avoid)}"] if avoid else []
        return [[self.scontrol, "requeuehold", job],
                [self.scontrol, "update", f"JobId={job}", *exclude, "StartTime=now"],
                [self.scontrol, "release", job]]

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
        ``TRAINGUARD_RESUME_STEP``; a requeued job keeps the environment it was submitted
        with (Slurm gives it ``SLURM_RESTART_COUNT``)."""
        plan = self.plan_restart(job_ref, exclude_nodes, resume_step)
        if self.mode == "resubmit":
            calls = self._run(list(zip(["cancel", "submit"], plan)))
            if calls[-1].op == "submit" and calls[-1].status == "done":
                self.restarts[job_ref] = self.restarts.get(job_ref, 0) + 1
                new = calls[-1].output.split(";")[0].strip()
                if JOB_ID.fullmatch(new):
                    self.resubmitted[self.current(job_ref)] = new
        else:
            hold, update, release = plan
            calls = self._run([("requeuehold", hold)])
            if calls[-1].status == "done":
                calls.append(self._wait_finished(hold[-1]))
                calls += self._run([("update", update), ("release", release)])
            elif calls[-1].status == "dry_run":
                calls += self._run([("update", update), ("release", release)])
        self.excluded |= set(check_names(exclude_nodes, NODE_NAME, "node", "a Slurm node name"))
        return calls

    def evict(self, nodes: Iterable[str], reason: str | None = None) -> list[DriverCall]:
        """Drain ``nodes``; ``reason`` (one line, e.g. naming the incident) replaces the
        configured one."""
        plan = self.plan_evict(nodes, reason)
        calls = self._run([("drain", argv) for argv in plan])
        self.excluded |= set(check_names(nodes, NODE_NAME, "node", "a Slurm node name"))
        return calls

    def _wait_finished(self, job: str) -> DriverCall:
        """Poll ``scontrol show job`` until the requeued job's old run has finished; then
        let the wall clock pass a whole second (see the module docstring)."""
        argv = [self.scontrol, "show", "job", "-o", job]
        call = DriverCall(driver=self.KIND, op="wait", argv=argv, status="done")
        start = self.clock()
        state = None
        while True:
            try:
                done = self.runner(argv, shell=False, capture_output=True, text=True,
                                   timeout=self.timeout, check=False)
                state = job_state(done.stdout)
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
        return call

    def _run(self, steps: list[tuple[str, list[str]]]) -> list[DriverCall]:
        calls = []
        for op, argv in steps:
            call = DriverCall(driver=self.KIND, op=op, argv=argv,
                              status="dry_run" if self.dry_run else "planned")
            calls.append(call)
            if self.dry_run:
                continue
            try:
                done = self.runner(argv, shell=False, capture_output=True, text=True,
                                   timeout=self.timeout, check=False)
            except FileNotFoundError:
                call.status, call.error = "failed", (
                    f"{argv[0]} not found; install the Slurm client tools on this machine "
                    f"or give its path in the driver configuration")
                break
            except subprocess.TimeoutExpired:
                call.status, call.error = "failed", f"no answer within {self.timeout} s"
                break
            call.output = cut(done.stdout)
            if done.returncode != 0:
                call.status = "failed"
                call.error = f"exit {done.returncode}: {cut(done.stderr) or call.output}"
                break
            call.status = "done"
        return calls


def _one_line(reason: str) -> str:
    if not reason or not isinstance(reason, str) or "\n" in reason:
        raise ValueError("reason must be one non-empty line")
    return reason
