"""Hugging Face ``transformers``: ``Trainer(..., callbacks=[TrainguardCallback()])``.

One line gives every rank's steps (numbered by ``state.global_step``, so a resumed run goes on
where its checkpoint was), phases (``data``, ``forward``, ``backward``, ``optimizer``,
``checkpoint``, ``eval``), the loss backward was called on, the grad norm of the Trainer's
clipping (``max_grad_norm``), the learning rate and the tokens (``input_ids``). The job id is
``TRAINGUARD_JOB`` (``trainguard run``), else ``TRAINGUARD_JOB_ID``, else ``args.run_name``.

Resume: when ``trainguard run`` relaunches the job, ``trainer.train()`` resumes from the
``checkpoint-N`` folder of ``args.output_dir`` that ``TRAINGUARD_RESUME_STEP`` names (the
newest at or before it), else from the newest; the script passes nothing. A first launch
keeps whatever the script passes.

Requires ``pip install trainguard[hf]``; importing this module imports ``transformers``.
"""
from __future__ import annotations

import logging
import os
import sys

from transformers import Trainer, TrainerCallback

from .callbacks import CallbackWatch, checkpoint_to_resume, in_phase, resuming, steps_in

__all__ = ["TrainguardCallback", "resume_checkpoint"]

log = logging.getLogger(__name__)


def resume_checkpoint(output_dir, given=None, environ=None):
    """The ``resume_from_checkpoint`` trainguard asks for in ``output_dir`` (see module doc)."""
    if given is True:  # the Trainer's own "newest checkpoint": ours, with the resume step
        given = None
        environ = {**(os.environ if environ is None else environ), "TRAINGUARD_RESUME": "1"}
    return checkpoint_to_resume(steps_in(output_dir, r"^checkpoint-(\d+)$"), given, environ)


class TrainguardCallback(TrainerCallback):
    """Watch a ``transformers.Trainer`` with trainguard (see the module docstring)."""

    def __init__(self, job: str | None = None, resume: bool = True):
        self.watch = CallbackWatch(job=job)
        self.resume = resume

    # -- set-up -------------------------------------------------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        trainer = _calling_trainer()
        if trainer is None:
            return
        if self.resume and not getattr(trainer, "_trainguard_resume", False):
            trainer.train = _resuming(trainer, trainer.train)
            trainer._trainguard_resume = True
        save = getattr(trainer, "_save_checkpoint", None)  # weights go through safetensors,
        if callable(save) and not getattr(save, "_trainguard", False):  # bound at its import
            trainer._save_checkpoint = in_phase(self.watch, "checkpoint", save)

    def on_train_begin(self, args, state, control, **kwargs):
        self.watch.start(run_name=getattr(args, "run_name", None),
                         world_size=getattr(args, "world_size", 1) or 1,
                         first_step=state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.watch.stop()

    # -- the step ---------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        self.watch.begin("forward")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.watch.call("phase", "optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.watch.call("phase", "step")

    def on_step_end(self, args, state, control, **kwargs):
        self.watch.end_step(step=max(0, state.global_step - 1), lr=_learning_rate(kwargs))

    # -- between steps ------------------------------------------------------------------------
    def on_prediction_step(self, args, state, control, **kwargs):
        self.watch.call("abandon")
        self.watch.call("phase", "eval")

    def on_evaluate(self, args, state, control, **kwargs):
        self.watch.call("phase", "idle")

    def on_save(self, args, state, control, **kwargs):
        self.watch.call("phase", "idle")


def _learning_rate(kwargs):
    scheduler = kwargs.get("lr_scheduler")
    try:
        if scheduler is not None:
            return float(scheduler.get_last_lr()[0])
        optimizer = kwargs.get("optimizer")
        return float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None
    except Exception:
        return None


def _calling_trainer():
    """The Trainer whose ``__init__`` is calling ``on_init_end`` (the callback is not given it)."""
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


def _resuming(trainer, train):
    return resuming(train, lambda given: resume_checkpoint(trainer.args.output_dir, given))
