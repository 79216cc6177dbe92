"""Where a (re)started training script should resume: SPEC §6 ``trainguard.resume_step``.

``trainguard run`` passes ``TRAINGUARD_RESUME_STEP`` (the step to resume from when the action
service ordered a rollback; older launchers call it ``TRAINGUARD_ROLLBACK_STEP``) to the
command. A script lists the steps it has checkpoints of and loads the one this returns:

>>> resume_step([100, 200, 300], environ={})
300
>>> resume_step([100, 200, 300], environ={"TRAINGUARD_RESUME_STEP": "250"})
200
>>> resume_step([100, 200], environ={"TRAINGUARD_RESUME_STEP": "50"}) is None
True
>>> resume_step([], environ={}) is None
True
"""
from __future__ import annotations

import logging
import os
from typing import Iterable

__all__ = ["resume_step", "requested_resume_step", "resume_requested", "rollback_identity"]

log = logging.getLogger(__name__)

RESUME_STEP_VARS = ("TRAINGUARD_RESUME_STEP", "TRAINGUARD_ROLLBACK_STEP")


def requested_resume_step(environ=None) -> int | None:
    """The step trainguard asks to resume from (``TRAINGUARD_RESUME_STEP``), or None.

    A value that is not an integer >= 0 is ignored with a warning (it came from outside).
    """
    environ = os.environ if environ is None else environ
    for name in RESUME_STEP_VARS:
        raw = environ.get(name)
        if raw in (None, ""):
            continue
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value >= 0:
            return value
        log.warning("trainguard: ignoring %s=%r (not an integer >= 0)", name, raw)
    return None


def rollback_identity(environ=None) -> str | None:
    """What tells this rollback from another to the same step, or None (not known): the
    environment of a job resubmitted or requeued after a rollback is the same for every
    restart inside it (a plain ``torchrun --max-restarts``), so a restart finds that its
    rollback was applied already (:meth:`~trainguard.checkpoint.InMemoryCheckpoint.restore`)
    instead of rolling back again. ``TRAINGUARD_ROLLBACK_ID`` when set; else the restart
    count trainguard passed (``TRAINGUARD_RESTART_COUNT``: each resubmission and relaunch
    has its own); else Slurm's job id and restart count (a requeue).

    >>> rollback_identity({"TRAINGUARD_RESTART_COUNT": "2", "SLURM_JOB_ID": "42"})
    'restart-2'
    >>> rollback_identity({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1"})
    'slurm-42-1'
    >>> rollback_identity({}) is None
    True
    """
    environ = os.environ if environ is None else environ
    explicit = environ.get("TRAINGUARD_ROLLBACK_ID")
    if explicit:
        return f"id-{explicit[:128]}"
    count = environ.get("TRAINGUARD_RESTART_COUNT")
    if count:
        return f"restart-{count[:32]}"
    job = environ.get("SLURM_JOB_ID")
    if job:
        return f"slurm-{job[:32]}-{environ.get('SLURM_RESTART_COUNT', '0')[:32]}"
    return None


def resume_requested(environ=None) -> bool:
    """Whether this launch is a relaunch by ``trainguard run`` or carries a resume step."""
    environ = os.environ if environ is None else environ
    return environ.get("TRAINGUARD_RESUME") == "1" or requested_resume_step(environ) is not None


def resume_step(available_steps: Iterable[int], environ=None) -> int | None:
    """The checkpoint step to load: the newest of ``available_steps`` at or before
    ``TRAINGUARD_RESUME_STEP`` when that is set, else the newest; None when none fits."""
    steps = sorted({int(s) for s in available_steps if s is not None and int(s) >= 0})
    limit = requested_resume_step(environ)
    if limit is not None:
        steps = [s for s in steps if s <= limit]
    return steps[-1] if steps else None
