"""A rollback's resume step, carried to a *requeued* Slurm job by the job's own ``Comment``.

A requeued batch job runs again with the environment it was submitted with, so the Slurm
driver cannot hand it ``TRAINGUARD_RESUME_STEP`` as it does a resubmitted job (``sbatch
--export``). While the job is held between its two runs, the driver writes the token
``trainguard-resume-step=<step>@<restart>`` into the job's ``Comment`` (the rest of the
comment is kept), ``<restart>`` being the job's ``Restarts`` count, which the next run sees as
``SLURM_RESTART_COUNT``. At start, ``trainguard run`` (or a batch script, with
``export TRAINGUARD_RESUME_STEP=$(trainguard resume-step)``) reads the comment back with
``squeue -o %k`` and takes the step only when the token names this very run: the comment
outlives the run, and a later restart (by trainguard or by Slurm itself) must not roll back
again.

Why this channel: Slurm authenticates it (a job's comment can be changed only by the job's
owner and by Slurm operators, who can requeue or cancel the job anyway); it lives in the
job's record, which survives the requeue and a restart of ``slurmctld``; it needs no shared
file system between the action service and the job; and nothing of it passes through Kafka.

>>> with_resume_step("ablation 3", 40, 2)
'ablation 3 trainguard-resume-step=40@2'
>>> with_resume_step("ablation 3 trainguard-resume-step=40@2", 30, 5)
'ablation 3 trainguard-resume-step=30@5'
>>> comment_resume_step("ablation 3 trainguard-resume-step=30@5", restart=5)
30
>>> comment_resume_step("ablation 3 trainguard-resume-step=30@5", restart=6) is None
True
"""
from __future__ import annotations

import re
import subprocess
from typing import Callable, Mapping

__all__ = ["TOKEN", "with_resume_step", "comment_resume_step", "slurm_resume_step",
           "restart_count"]

TOKEN = "trainguard-resume-step"
_TOKEN = re.compile(rf"(?:^|\s){TOKEN}=(\d+)@(\d+)(?=\s|$)")
_ANY_TOKEN = re.compile(rf"(?:^|\s){TOKEN}=\S*")
NO_COMMENT = "(null)"   # what squeue prints for a job without one


def with_resume_step(comment: str | None, step: int, restart: int) -> str:
    """``comment`` with its trainguard token (if any) replaced by one for ``step`` at
    ``restart``."""
    rest = "" if comment in (None, NO_COMMENT) else _ANY_TOKEN.sub("", comment).strip()
    return f"{rest} {TOKEN}={step}@{restart}".strip()


def comment_resume_step(comment: str | None, restart: int) -> int | None:
    """The step of the token for run ``restart`` in ``comment``; None without one.

    >>> comment_resume_step("trainguard-resume-step=12@1 trainguard-resume-step=7@2", 2)
    7
    >>> comment_resume_step("trainguard-resume-step=-4@1", 1) is None
    True
    """
    for step, at in _TOKEN.findall(comment or ""):
        if int(at) == restart:
            return int(step)
    return None


def restart_count(show_job: str) -> int | None:
    """``Restarts`` of one-line ``scontrol show job -o`` output (after a requeue: the
    ``SLURM_RESTART_COUNT`` of the job's next run), None when absent.

    >>> restart_count("JobId=7 Requeue=1 Restarts=2 BatchFlag=1")
    2
    """
    found = re.search(r"(?:^|\s)Restarts=(\d+)(?=\s|$)", show_job or "")
    return int(found.group(1)) if found else None


def slurm_resume_step(environ: Mapping[str, str], *, squeue: str = "squeue",
                      runner: Callable[..., subprocess.CompletedProcess] = subprocess.run,
                      timeout: float = 20.0,
                      log: Callable[[str], None] = lambda message: None) -> int | None:
    """The resume step the Slurm driver left for this run of a requeued batch job, read from
    the job's comment; None outside a requeued Slurm job, without a token for this run, or
    when ``squeue`` does not answer (said through ``log``).

    >>> answer = lambda argv, **kw: subprocess.CompletedProcess(
    ...     argv, 0, "trainguard-resume-step=40@1\\n", "")
    >>> slurm_resume_step({"SLURM_JOB_ID": "17", "SLURM_RESTART_COUNT": "1"}, runner=answer)
    40
    >>> slurm_resume_step({"SLURM_JOB_ID": "17"}, runner=answer) is None  # the first run
    True
    """
    job = environ.get("SLURM_JOB_ID", "")
    try:
        restart = int(environ.get("SLURM_RESTART_COUNT", "0"))
    except ValueError:
        return None
    if restart < 1 or not re.fullmatch(r"[0-9]+", job):
        return None
    argv = [squeue, "-h", "-j", job, "-o", "%k"]
    try:
        done = runner(argv, shell=False, capture_output=True, text=True, timeout=timeout,
                      check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log(f"cannot read job {job}'s comment for a resume step ({exc}); resuming as usual")
        return None
    if done.returncode != 0:
        log(f"cannot read job {job}'s comment for a resume step (squeue exit "
            f"{done.returncode}: {' '.join((done.stderr or '').split())[-200:]}); resuming as usual")
        return None
    return comment_resume_step(done.stdout.rstrip("\n"), restart)
