"""Slurm: restart a batch job off bad machines, drain those machines. Argv lists, no shell.

``mode="requeue"`` (default) keeps the job id. With no machine to avoid it is one
``scontrol requeue <job>``. With machines to avoid, the exclusion can only be changed while
the job is pending, so the job is requeued *held*, its exclusion list set, then released::

    scontrol requeuehold <job>
    scontrol update JobId=<job> ExcNodeList=<n1,n2>
    scontrol release <job>

``mode="resubmit"`` cancels the job and submits its script again (a new job id: the
``output`` of the ``sbatch --parsable`` call)::

    scancel <job>
    sbatch --parsable --exclude=<n1,n2> [sbatch_args...] <script>

``evict(nodes)`` drains the machines (``scontrol update NodeName=<n1,n2> State=DRAIN
Reason=<reason>``, which needs Slurm operator rights; ``drain=False`` skips it) and remembers
them: every later restart of this driver excludes all machines evicted or excluded before.

>>> d = SlurmDriver(dry_run=True)
>>> [c.describe() for c in d.restart("4242")]
['scontrol requeue 4242']
>>> [c.describe() for c in d.evict(["gpu-07"])]
['scontrol update NodeName=gpu-07 State=DRAIN Reason=trainguard evict']
>>> for c in d.restart("4242", exclude_nodes=["gpu-03"]):
...     print(c.status, c.argv)
dry_run ['scontrol', 'requeuehold', '4242']
dry_run ['scontrol', 'update', 'JobId=4242', 'ExcNodeList=gpu-03,gpu-07']
dry_run ['scontrol', 'release', '4242']
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Iterable

from .base import DriverCall, check_names, cut

__all__ = ["SlurmDriver", "JOB_ID", "NODE_NAME"]

JOB_ID = re.compile(r"[0-9]+(?:[_+][0-9]+)?")
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")
MODES = ("requeue", "resubmit")


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
    runner: Callable[..., subprocess.CompletedProcess] = subprocess.run
    excluded: set = field(default_factory=set)

    KIND: ClassVar[str] = "slurm"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.mode == "resubmit" and not self.script:
            raise ValueError("mode='resubmit' needs script= (the batch script to submit)")
        if not all(isinstance(a, str) for a in self.sbatch_args):
            raise ValueError("sbatch_args must be strings, one argv element each")
        if not self.reason or "\n" in self.reason:
            raise ValueError("reason must be one non-empty line")
        self.excluded = set(check_names(self.excluded, NODE_NAME, "node", "a Slurm node name"))

    # ----------------------------------------------------------------- plans (argv lists)
    def plan_restart(self, job_ref: str, exclude_nodes: Iterable[str] = ()) -> list[list[str]]:
        [job] = check_names([job_ref], JOB_ID, "Slurm job id", "digits, e.g. 4242 or 4242_7")
        avoid = sorted(self.excluded | set(check_names(exclude_nodes, NODE_NAME, "node",
                                                       "a Slurm node name")))
        if self.mode == "resubmit":
            exclude = [f"--exclude={','.join(avoid)}"] if avoid else []
            return [[self.scancel, job],
                    [self.sbatch, "--parsable", *exclude, *self.sbatch_args, self.script]]
        if not avoid:
            return [[self.scontrol, "requeue", job]]
        return [[self.scontrol, "requeuehold", job],
                [self.scontrol, "update", f"JobId={job}", f"ExcNodeList={','.join(avoid)}"],
                [self.scontrol, "release", job]]

    def plan_evict(self, nodes: Iterable[str]) -> list[list[str]]:
        names = check_names(nodes, NODE_NAME, "node", "a Slurm node name")
        if not names or not self.drain:
            return []
        return [[self.scontrol, "update", f"NodeName={','.join(names)}", "State=DRAIN",
                 f"Reason={self.reason}"]]

    # ----------------------------------------------------------------- the interface
    def restart(self, job_ref: str, exclude_nodes: Iterable[str] = ()) -> list[DriverCall]:
        plan = self.plan_restart(job_ref, exclude_nodes)
        ops = (["cancel", "submit"] if self.mode == "resubmit" else
               ["requeue"] if len(plan) == 1 else ["requeuehold", "exclude", "release"])
        calls = self._run(list(zip(ops, plan)))
        self.excluded |= set(check_names(exclude_nodes, NODE_NAME, "node", "a Slurm node name"))
        return calls

    def evict(self, nodes: Iterable[str]) -> list[DriverCall]:
        plan = self.plan_evict(nodes)
        calls = self._run([("drain", argv) for argv in plan])
        self.excluded |= set(check_names(nodes, NODE_NAME, "node", "a Slurm node name"))
        return calls

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
