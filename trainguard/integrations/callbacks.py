"""What the framework callbacks share: :class:`CallbackWatch`, :func:`checkpoint_to_resume` and
:class:`CallbackSnapshots`.

A callback starts (or joins) the process's :class:`~.torch_hooks.TorchHooks` in callback mode:
the hooks still see the loss, the gradients, collectives, data fetches and saves, but the
framework's own step counter ends steps (it survives a resume). Under ``--instrument`` the
callback takes over the hooks already installed, so nothing is counted twice.

With ``snapshot_every=N`` a callback also takes in-memory snapshots through
:mod:`trainguard.checkpoint` (docs/RECOVERY.md) and restores the newest at the start of training.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import threading

from trainguard.checkpoint.snapshot import SnapshotConfig, default_dir
from trainguard.collectors.resume import (requested_resume_step, resume_requested, resume_step,
                                          rollback_identity)

from .torch_hooks import TorchHooks, installed
from .watcher import StepWatcher, job_id

__all__ = ["CallbackWatch", "CallbackSnapshots", "checkpoint_to_resume", "steps_in", "resuming",
           "in_phase"]

log = logging.getLogger(__name__)


class CallbackWatch:
    """The hooks and watcher of one callback. ``job``: the job id (default: ``TRAINGUARD_JOB``,
    else the environment, else the run name given to :meth:`start`)."""

    def __init__(self, job: str | None = None, environ=None):
        self.job = job
        self.environ = environ
        self.hooks: TorchHooks | None = None
        self.owned = False

    @property
    def watcher(self) -> StepWatcher | None:
        return self.hooks.watcher if self.hooks is not None else None

    def start(self, run_name: str | None = None, world_size: int = 1,
              first_step: int = 0) -> None:
        try:
            hooks = installed()
            if hooks is None:
                topology = {"tp": 1, "pp": 1, "dp": world_size} if world_size > 1 else None
                watcher = StepWatcher(lambda: self._collector(run_name, topology))
                hooks = TorchHooks(watcher, end_steps_on_optimizer=False).install()
                self.owned = True
            hooks.end_steps_on_optimizer = False
            hooks.watcher.thread_id = threading.get_ident()
            hooks.watcher.next_step = first_step
            hooks.watcher.stop_clock()  # the run's first step starts at its first mark
            self.hooks = hooks
            hooks.watcher.live()
        except Exception as exc:
            log.warning("trainguard: not watching this run: %s", exc)

    def _collector(self, run_name, topology):
        from trainguard.collectors.api import init, running

        collector = running()
        if collector is not None:
            return collector
        environ = os.environ if self.environ is None else self.environ
        job = self.job or job_id(environ, run_name=run_name)
        return init(job=job, topology=topology, environ=environ)

    def stop(self) -> None:
        hooks, self.hooks = self.hooks, None
        if hooks is None:
            return
        try:
            hooks.watcher.flush()
            if self.owned:
                hooks.uninstall()
        except Exception as exc:
            log.debug("trainguard: stopping the watch failed: %s", exc)

    # the marks, each safe to call at any time
    def call(self, name: str, *args):
        hooks = self.hooks
        if hooks is None:
            return None
        watcher = hooks.watcher
        if not watcher.active:
            return None
        try:
            return getattr(watcher, name)(*args)
        except Exception as exc:
            log.debug("trainguard: %s failed: %s", name, exc)
            return None

    def begin(self, phase: str) -> None:
        """A step begins (if none has yet) in ``phase``."""
        hooks = self.hooks
        if hooks is None or not hooks.watcher.active:
            return
        try:
            watcher = hooks.watcher
            if not watcher.in_step:
                watcher.begin()
            watcher.phase(phase)
        except Exception as exc:
            log.debug("trainguard: begin failed: %s", exc)

    def end_step(self, step: int, **values) -> None:
        hooks = self.hooks
        if hooks is None or not hooks.watcher.active:
            return
        try:
            hooks.end_step(step=step, **values)
        except Exception as exc:
            log.debug("trainguard: step end failed: %s", exc)


def steps_in(folder, pattern: str) -> dict[int, str]:
    """``{step: path}`` of the entries of ``folder`` whose name matches ``pattern`` (its first
    group is the step), e.g. ``checkpoint-(\\d+)`` for Hugging Face."""
    found: dict[int, str] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return found
    regex = re.compile(pattern)
    for name in names:
        match = regex.search(name)
        if match:
            found[int(match.group(1))] = os.path.join(folder, name)
    return found


def checkpoint_to_resume(available: dict[int, str], given=None, environ=None):
    """The checkpoint to hand to the framework: with ``TRAINGUARD_RESUME_STEP`` the newest at or
    before it (trainguard's order wins over ``given``); on a relaunch by ``trainguard run``
    without one, ``given`` or else the newest; on a first launch, ``given``."""
    if requested_resume_step(environ) is not None:
        step = resume_step(available, environ=environ)
        if step is None:
            log.warning("trainguard: no checkpoint at or before TRAINGUARD_RESUME_STEP=%s; "
                        "starting without one", requested_resume_step(environ))
            return None
        return available[step]
    if given is None and resume_requested(environ):
        step = resume_step(available, environ=environ)
        return available[step] if step is not None else None
    return given


def resuming(original, choose, applies=lambda: True):
    """``original(checkpoint, ...)`` with its first argument replaced by ``choose(given)``
    (the framework's resume entry point: HF ``train``, Lightning ``resume_start``), while
    ``applies()``; a failing choice keeps what was given."""
    @functools.wraps(original)
    def wrapper(given=None, *args, **kwargs):
        for name in ("resume_from_checkpoint", "checkpoint_path"):  # given by keyword
            if name in kwargs:
                given = kwargs.pop(name)
        if not applies():
            return original(given, *args, **kwargs)
        try:
            chosen = choose(given)
        except Exception as exc:
            log.warning("trainguard: cannot pick the checkpoint to resume from: %s", exc)
            chosen = given
        if chosen is not None and chosen != given:
            log.warning("trainguard: resuming from %s", chosen)
        return original(chosen, *args, **kwargs)
    wrapper._trainguard = True
    return wrapper


def in_phase(watch: CallbackWatch, phase: str, original):
    """``original`` run in ``phase`` (Hugging Face's ``Trainer._save_checkpoint`` in
    ``checkpoint``: the framework has no callback before a save)."""
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        previous = watch.call("phase", phase)
        try:
            return original(*args, **kwargs)
        finally:
            watch.call("restore", previous)
    wrapper._trainguard = True
    return wrapper


class CallbackSnapshots:
    """The in-memory snapshots of a framework callback (docs/RECOVERY.md): off unless ``every``
    (or ``config.every``) is above 0.

    The callback calls :meth:`find` as training starts (the newest step every rank has, to be
    loaded the framework's way), :meth:`start` once the optimizer exists, :meth:`before_update`
    before each optimizer step, :meth:`after_step` after it and :meth:`close` at the end. Given
    only ``every``, the snapshot folder is ``TRAINGUARD_SNAPSHOT_DIR`` (else
    ``/dev/shm/trainguard-snapshots``), read when training starts. A snapshot that fails (a state
    that is not tensors and plain data) stops the snapshots with one warning; training goes on.

    >>> CallbackSnapshots().enabled, CallbackSnapshots(every=10).enabled
    (False, True)
    """

    def __init__(self, every: int = 0, config: SnapshotConfig | None = None, environ=None):
        if config is not None and every and every != config.every:
            raise ValueError(f"snapshot_every {every} and snapshot_config.every {config.every} "
                             "differ: give one")
        self.config = config if config is not None else SnapshotConfig(every=every)
        self.dir_from_env = config is None
        self.environ = environ
        self.checkpoint = None        # the InMemoryCheckpoint of this run of training
        self.group, self._grouped = None, False
        self.stopped = False
        self._done = -1

    @property
    def enabled(self) -> bool:
        return self.config.every > 0 and not self.stopped

    def open(self, job: str):
        """This rank's :class:`~trainguard.checkpoint.InMemoryCheckpoint` for a new run of
        training (the previous one closed). Every rank calls it (it may form a gloo group)."""
        from dataclasses import replace

        from trainguard.checkpoint import InMemoryCheckpoint
        from trainguard.checkpoint.restore import agreement_group
        from trainguard.collectors.nodename import node_name

        self.close()
        environ = os.environ if self.environ is None else self.environ
        config = (replace(self.config, dir=default_dir(environ)) if self.dir_from_env
                  else self.config)
        rank, world = _rank_and_world(environ)
        if not self._grouped:         # once: a gloo group beside NCCL
            self.group, self._grouped = agreement_group(), True
        self.checkpoint = InMemoryCheckpoint(config, job=job, rank=rank, world=world,
                                             node=node_name(environ))
        self._done = -1
        return self.checkpoint

    def find(self, job: str, disk_step: int = -1):
        """The :class:`~trainguard.checkpoint.Restored` snapshot to resume from: the newest step
        every rank has (at most ``TRAINGUARD_RESUME_STEP``), read and verified, when on every
        rank it is at least ``disk_step`` (the step of the checkpoint the framework would load;
        -1: none); else None. After a rollback the snapshots past the step resumed go, so that
        a later restart cannot bring the abandoned branch back. A collective: every rank calls
        it as training starts."""
        from trainguard.checkpoint.restore import all_min

        checkpoint = self.open(job)
        restored = checkpoint.find(group=self.group,
                                   at_most=requested_resume_step(self.environ),
                                   rollback=rollback_identity(self.environ))
        if restored is None:          # the same on every rank
            return None
        if not all_min(1 if restored.step >= disk_step else 0, self.group):
            log.warning("trainguard: the checkpoint of step %d is newer than the in-memory "
                        "snapshot of step %d; resuming from the checkpoint", disk_step,
                        restored.step)
            return None
        log.warning("trainguard: resuming from the in-memory snapshot: %s",
                    checkpoint.describe(restored))
        return restored

    def start(self, job: str, *, first_step: int = 0, model=None, optimizer=None,
              scheduler=None, extra=None, sharded_by: str | None = None) -> None:
        """Name what each snapshot holds (see ``InMemoryCheckpoint.track``); training starts
        with ``first_step`` steps done (that step is not snapshotted again). ``sharded_by``:
        what shards the model in a way the framework's callback does not snapshot (one line,
        and training goes on without snapshots)."""
        if not self.enabled:
            return
        if sharded_by:
            self.stopped = True
            log.warning("trainguard: in-memory snapshots of a model sharded by %s are not "
                        "supported by this callback; training goes on without them",
                        sharded_by)
            return
        checkpoint = self.checkpoint if self.checkpoint is not None else self.open(job)
        checkpoint.track(model=model, optimizer=optimizer, scheduler=scheduler, extra=extra)
        self._done = first_step

    def before_update(self) -> None:
        if self.checkpoint is not None:
            self.checkpoint.before_update()

    def after_step(self, done: int) -> None:
        """After the optimizer step that made ``done`` steps (again for each micro-batch of
        gradient accumulation: a step is snapshotted once)."""
        checkpoint = self.checkpoint
        if checkpoint is None or not self.enabled or done == self._done:
            return
        self._done = done
        try:
            checkpoint.after_step(done)
        except Exception as exc:
            self.stopped = True
            log.warning("trainguard: in-memory snapshot of step %d failed, no more are taken: "
                        "%s", done, exc)

    def close(self) -> None:
        checkpoint, self.checkpoint = self.checkpoint, None
        if checkpoint is not None:
            checkpoint.close()


def _rank_and_world(environ) -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(environ.get("RANK") or 0), int(environ.get("WORLD_SIZE") or 1)
