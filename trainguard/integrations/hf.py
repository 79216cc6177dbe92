"""Hugging Face ``transformers``: ``Trainer(..., callbacks=[TrainguardCallback()])``.

One line gives every rank's steps (numbered by ``state.global_step``, so a resumed run goes on
where its checkpoint was), phases (``data``, ``forward``, ``backward``, ``optimizer``,
``checkpoint``, ``eval``), the loss given to accelerate's backward, the grad norm of the Trainer's
clipping (``max_grad_norm``), the learning rate and the tokens (``input_ids``). The job id is
``TRAINGUARD_JOB`` (``trainguard run``), else ``TRAINGUARD_JOB_ID``, else ``args.run_name``.

Resume: when ``trainguard run`` relaunches the job, ``trainer.train()`` resumes from the
``checkpoint-N`` folder of ``args.output_dir`` that ``TRAINGUARD_RESUME_STEP`` names (the
newest at or before it), else from the newest; the script passes nothing. A first launch
keeps whatever the script passes.

In-memory snapshots (docs/RECOVERY.md), off by default: with
``TrainguardCallback(snapshot_every=N)`` every N optimizer steps each rank's model, optimizer,
LR scheduler, RNG states and ``TrainerState`` (global step, epoch, tokens seen) are snapshotted
into host memory held by the node agent (``TRAINGUARD_SNAPSHOT_DIR``, else
/dev/shm/trainguard-snapshots; or ``snapshot_config=SnapshotConfig(...)`` for the folder and
the disk copies), copied off the training thread. Every ``trainer.train()`` starts by looking
for the newest step every rank has (at most ``TRAINGUARD_RESUME_STEP``), in this machine's
memory, else the buddy machine's, else on disk; when it is at least as new as the
``checkpoint-N`` it would resume from (or there is none), the Trainer resumes from the
snapshot the way it resumes from a checkpoint: global step and epoch from the snapshot's
``TrainerState``, the batches already trained skipped, the model, optimizer, scheduler and RNG
loaded from memory instead of the folder. Not covered: DeepSpeed, FSDP and other sharded
models (the snapshots stay off, with a warning), the gradient scaler of fp16.

Requires ``pip install trainguard[hf]``; importing this module imports ``transformers``.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import shutil
import sys
import tempfile

from transformers import Trainer, TrainerCallback

from trainguard.checkpoint.snapshot import SnapshotConfig
from trainguard.checkpoint.state import apply, is_sharded

from .callbacks import (CallbackSnapshots, CallbackWatch, checkpoint_to_resume, in_phase,
                        resuming, steps_in)
from .watcher import job_id

__all__ = ["TrainguardCallback", "resume_checkpoint"]

log = logging.getLogger(__name__)


def resume_checkpoint(output_dir, given=None, environ=None):
    """The ``resume_from_checkpoint`` trainguard asks for in ``output_dir`` (see module doc)."""
    if given is True:  # the Trainer's own "newest checkpoint": ours, with the resume step
        given = None
        environ = {**(os.environ if environ is None else environ), "TRAINGUARD_RESUME": "1"}
    return checkpoint_to_resume(steps_in(output_dir, r"^checkpoint-(\d+)$"), given, environ)


#: the Trainer's loaders of a checkpoint folder that a snapshot replaces, and what each loads
_LOADERS = {"_load_from_checkpoint": ("model",), "_load_optimizer_and_scheduler":
            ("optimizer", "scheduler"), "_load_rng_state": ("rng",)}


class TrainguardCallback(TrainerCallback):
    """Watch a ``transformers.Trainer`` with trainguard (see the module docstring).

    ``job``: the job id (default: ``TRAINGUARD_JOB``, else ``TRAINGUARD_JOB_ID``, else
    ``args.run_name``, else the script's name); it also names the in-memory snapshots, so it
    must stay the same across restarts. ``resume``: pick the ``checkpoint-N`` to resume from on a
    relaunch. ``snapshot_every``: in-memory snapshots every that many optimizer steps (0: off);
    ``snapshot_config``: all their settings (``trainguard.checkpoint.SnapshotConfig``).
    """

    def __init__(self, job: str | None = None, resume: bool = True, snapshot_every: int = 0,
                 snapshot_config: SnapshotConfig | None = None):
        self.watch = CallbackWatch(job=job)
        self.resume = resume
        self.snapshots = CallbackSnapshots(snapshot_every, snapshot_config)
        self._resuming_from = None    # (folder, Restored) while a snapshot is being loaded

    # -- set-up -------------------------------------------------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        trainer = _calling_trainer()
        if trainer is None:
            if self.snapshots.enabled:
                log.warning("trainguard: the Trainer was not found; in-memory snapshots are "
                            "taken but not restored")
            return
        if (self.resume or self.snapshots.enabled) and \
                not getattr(trainer, "_trainguard_resume", False):
            trainer.train = resuming(trainer.train, lambda given: self._choose(trainer, given))
            trainer._trainguard_resume = True
        if self.snapshots.enabled:
            for name in _LOADERS:
                loader = getattr(trainer, name, None)
                if callable(loader) and not getattr(loader, "_trainguard", False):
                    setattr(trainer, name, self._loading(trainer, name, loader))
        accelerator = getattr(trainer, "accelerator", None)
        backward = getattr(accelerator, "backward", None)
        if callable(backward) and not getattr(backward, "_trainguard", False):
            accelerator.backward = given_loss(self.watch, backward)
        save = getattr(trainer, "_save_checkpoint", None)  # weights go through safetensors,
        if callable(save) and not getattr(save, "_trainguard", False):  # bound at its import
            trainer._save_checkpoint = in_phase(self.watch, "checkpoint", save)

    def on_train_begin(self, args, state, control, **kwargs):
        self.watch.start(run_name=getattr(args, "run_name", None),
                         world_size=getattr(args, "world_size", 1) or 1,
                         first_step=state.global_step)
        if self.snapshots.enabled:
            self.snapshots.start(self._job(args), first_step=state.global_step,
                                 model=kwargs.get("model"),
                                 optimizer=kwargs.get("optimizer"),
                                 scheduler=kwargs.get("lr_scheduler"),
                                 extra=lambda done: {"trainer_state": _plain_state(state)},
                                 sharded_by=_sharded_by(args, kwargs.get("model")))

    def on_train_end(self, args, state, control, **kwargs):
        self.watch.stop()
        self.snapshots.close()
        self._forget()

    # -- the step ---------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        self.watch.begin("forward")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.snapshots.before_update()
        self.watch.call("phase", "optimizer")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.watch.call("phase", "step")

    def on_step_end(self, args, state, control, **kwargs):
        self.snapshots.after_step(state.global_step)
        self.watch.end_step(step=max(0, state.global_step - 1), lr=_learning_rate(kwargs))

    # -- between steps ------------------------------------------------------------------------
    def on_prediction_step(self, args, state, control, **kwargs):
        self.watch.call("abandon")
        self.watch.call("phase", "eval")

    def on_evaluate(self, args, state, control, **kwargs):
        self.watch.call("phase", "idle")

    def on_save(self, args, state, control, **kwargs):
        self.watch.call("phase", "idle")

    # -- in-memory snapshots ------------------------------------------------------------------
    def _job(self, args) -> str:
        return self.watch.job or job_id(self.watch.environ, run_name=getattr(args, "run_name",
                                                                             None))

    def _choose(self, trainer, given):
        """The ``resume_from_checkpoint`` of ``trainer.train``: the ``checkpoint-N`` folder
        (:func:`resume_checkpoint`), or a folder holding only the ``trainer_state.json`` of the
        in-memory snapshot when that is at least as new; the Trainer's loaders then take the
        rest from the snapshot (:meth:`_loading`)."""
        output_dir = trainer.args.output_dir
        chosen = resume_checkpoint(output_dir, given) if self.resume else given
        if not self.snapshots.enabled:
            return chosen
        self._forget()
        disk = chosen
        if disk is True:
            found = steps_in(output_dir, r"^checkpoint-(\d+)$")
            disk = found[max(found)] if found else None
        restored = self.snapshots.find(self._job(trainer.args), disk_step=_step_of(disk))
        if restored is None:
            return chosen
        trainer_state = (restored.tree.get("extra") or {}).get("trainer_state")
        folder = tempfile.mkdtemp(prefix=f"trainguard-snapshot-step{restored.step}-")
        with open(os.path.join(folder, "trainer_state.json"), "w") as f:
            json.dump(trainer_state or {"global_step": restored.step}, f)
        self._resuming_from = (folder, restored)
        return folder

    def _loading(self, trainer, name, original):
        """``trainer.<name>`` that loads its part of the snapshot being resumed from, and the
        folder it is given otherwise."""
        @functools.wraps(original)
        def load(checkpoint=None, *args, **kwargs):
            resuming_from = self._resuming_from
            if resuming_from is None or checkpoint != resuming_from[0]:
                return original(checkpoint, *args, **kwargs)
            tree = resuming_from[1].tree or {}
            part = {key: tree[key] for key in _LOADERS[name] if key in tree}
            if name == "_load_from_checkpoint":
                model = args[0] if args else kwargs.get("model")
                apply(part, model=model if model is not None else trainer.model)
            elif name == "_load_optimizer_and_scheduler":
                apply(part, optimizer=trainer.optimizer, scheduler=trainer.lr_scheduler)
            else:
                apply(part)
                resuming_from[1].tree = None     # all loaded: let the state go
            return None
        load._trainguard = True
        return load

    def _forget(self) -> None:
        resuming_from, self._resuming_from = self._resuming_from, None
        if resuming_from is not None:
            shutil.rmtree(resuming_from[0], ignore_errors=True)


def _learning_rate(kwargs):
    scheduler = kwargs.get("lr_scheduler")
    try:
        if scheduler is not None:
            return float(scheduler.get_last_lr()[0])
        optimizer = kwargs.get("optimizer")
        return float(optimizer.param_groups[0]["lr"]) if optimizer is not None else None
    except Exception:
        return None


def given_loss(watch: CallbackWatch, original):
    """``Accelerator.backward`` telling the watcher the loss it was given, summed over the
    step's micro-batches (the Trainer gives each its share): the step's loss, not the tensor
    backward is called on, which fp16 scales (a GradScaler, DeepSpeed's loss scaler: x 65536
    at first, doubling every thousand steps or so, halved at each overflow)."""
    @functools.wraps(original)
    def backward(loss, *args, **kwargs):
        watch.call("note_given_loss", loss)
        return original(loss, *args, **kwargs)
    backward._trainguard = True
    return backward


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


def _sharded_by(args, model) -> str | None:
    """What shards the model, where the snapshots do not cover it: DeepSpeed, the Trainer's
    FSDP, or DTensor parameters set up by hand (the Trainer restores none of them here)."""
    if getattr(args, "deepspeed", None):
        return "DeepSpeed"
    if getattr(args, "fsdp", None):
        return "FSDP"
    return "DTensor" if is_sharded(model) else None


def _plain_state(state) -> dict:
    """The ``TrainerState`` as ``trainer_state.json`` holds it (``save_to_json``)."""
    return json.loads(json.dumps(dataclasses.asdict(state)))


def _step_of(folder) -> int:
    """The global step of a ``checkpoint-N`` folder (-1: none)."""
    if folder is None:
        return -1
    try:
        with open(os.path.join(folder, "trainer_state.json")) as f:
            return int(json.load(f)["global_step"])
    except (OSError, ValueError, KeyError, TypeError):
        match = re.search(r"checkpoint-(\d+)$", str(folder).rstrip("/"))
        return int(match.group(1)) if match else -1
