"""What the framework callbacks share: :class:`CallbackWatch` and :func:`checkpoint_to_resume`.

A callback starts (or joins) the process's :class:`~.torch_hooks.TorchHooks` in callback mode:
the hooks still see the loss, the gradients, collectives, data fetches and saves, but the
framework's own step counter ends steps (it survives a resume). Under ``--instrument`` the
callback takes over the hooks already installed, so nothing is counted twice.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import threading

from trainguard.collectors.resume import requested_resume_step, resume_requested, resume_step

from .torch_hooks import TorchHooks, installed
from .watcher import StepWatcher, job_id

__all__ = ["CallbackWatch", "checkpoint_to_resume", "steps_in", "resuming", "in_phase"]

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
