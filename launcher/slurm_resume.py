"""Where a requeued Slurm batch job learns a rollback's step: the job's comment, which the
Slurm driver wrote while the job was held between its runs (the channel is described in
:mod:`trainguard.actions.drivers.slurm_comment`).

``trainguard run`` asks at start (:func:`slurm_rollback_step`) and gives its launches
``TRAINGUARD_RESUME_STEP``; a batch script without it asks with ``trainguard resume-step``::

    export TRAINGUARD_RESUME_STEP=$(trainguard resume-step)
"""
from __future__ import annotations

import os

from trainguard.actions.drivers.slurm_comment import slurm_resume_step
from trainguard.collectors.resume import requested_resume_step
from trainguard.logs import service_logger

__all__ = ["slurm_rollback_step", "resume_step_main"]


_log = service_logger("trainguard.run.slurm", "trainguard")


def slurm_rollback_step(environ, log=_log, **kw) -> int | None:
    """The step a rollback asked this run of a requeued Slurm batch job to resume from;
    None elsewhere, and when the environment already says (``TRAINGUARD_RESUME_STEP``, as a
    resubmitted job has it).

    >>> import subprocess
    >>> answer = lambda argv, **kw: subprocess.CompletedProcess(
    ...     argv, 0, "nightly trainguard-resume-step=40@2\\n", "")
    >>> env = {"SLURM_JOB_ID": "17", "SLURM_RESTART_COUNT": "2"}
    >>> slurm_rollback_step(env, runner=answer, log=print)
    rollback: job 17 was requeued to resume from step 40 (its comment)
    40
    >>> slurm_rollback_step({**env, "TRAINGUARD_RESUME_STEP": "30"}, runner=answer) is None
    True
    """
    if requested_resume_step(environ) is not None:
        return None
    step = slurm_resume_step(environ, log=log, **kw)
    if step is not None:
        log(f"rollback: job {environ.get('SLURM_JOB_ID')} was requeued to resume from step "
            f"{step} (its comment)")
    return step


def resume_step_main(args=None) -> int:
    """``trainguard resume-step``: print the step this batch job resumes from (a requeued
    job's rollback step, else ``TRAINGUARD_RESUME_STEP``), or nothing."""
    step = slurm_rollback_step(os.environ)
    if step is None:
        step = requested_resume_step(os.environ)
    if step is not None:
        print(step)
    return 0
