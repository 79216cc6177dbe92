"""PyTorch Lightning: ``Trainer(..., callbacks=[TrainguardCallback()])``.

One line gives every rank's steps (numbered by ``trainer.global_step``, restored on resume),
phases (``data``, ``forward``, ``backward``, ``optimizer``, ``checkpoint``, ``eval``), the loss
``training_step`` returned, the grad norm when ``gradient_clip_val`` clips by norm, the learning
rate of the first optimizer and the tokens (``input_ids`` or a 2-D integer batch). The job id is
``TRAINGUARD_JOB`` (``trainguard run``), else ``TRAINGUARD_JOB_ID``, else the logger's name.

Resume: when ``trainguard run`` relaunches the job and ``trainer.fit`` gets no ``ckpt_path``,
the fit resumes from the checkpoint of the ``ModelCheckpoint`` folder whose name carries
``step=N`` (Lightning's default names) that ``TRAINGUARD_RESUME_STEP`` names (the newest at or
before it), else from the newest. With ``TRAINGUARD_RESUME_STEP`` set, that choice also
replaces a ``ckpt_path`` the script passes.

In-memory snapshots (docs/RECOVERY.md), off by default: with
``TrainguardCallback(snapshot_every=N)`` every N optimizer steps (``trainer.global_step``) each
rank's model, optimizers, LR schedulers, RNG states, the fit loop's progress (global step,
epoch, batch; a stateful dataloader's position) and the precision plugin's state are
snapshotted into host memory held by the node agent (``TRAINGUARD_SNAPSHOT_DIR``, else
/dev/shm/trainguard-snapshots; or ``snapshot_config=SnapshotConfig(...)``), copied off the
training thread. Every ``trainer.fit`` starts by looking for the newest step every rank has
(at most ``TRAINGUARD_RESUME_STEP``), in this machine's memory, else the buddy machine's, else
on disk; when it is at least as new as the checkpoint the fit would load (or there is none),
Lightning restores it as it restores a checkpoint file (``trainer.ckpt_path`` reads
``in-memory snapshot of step N``). As with Lightning's own mid-epoch checkpoints, a dataloader
without ``state_dict`` starts its epoch again. Not in a snapshot: the callbacks' states (e.g.
``ModelCheckpoint``'s best model) and the datamodule's. A model sharded with FSDP2 or tensor
parallel (``ModelParallelStrategy``: DTensor parameters) is snapshotted shard by shard, each
rank its own shards and optimizer state, and restored into the sharded model. Not covered:
DeepSpeed and the older ``FSDPStrategy`` (FSDP1: flat parameters, not DTensors): the
snapshots stay off, with a warning.

Requires ``pip install trainguard[lightning]``; importing this module imports ``lightning``
(or ``pytorch_lightning`` where only that is installed).
"""
from __future__ import annotations

import functools
import logging
import os
import re

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback

from trainguard.checkpoint.snapshot import SnapshotConfig
from trainguard.checkpoint.state import apply, is_sharded

from .callbacks import CallbackSnapshots, CallbackWatch, checkpoint_to_resume, resuming, steps_in
from .watcher import count_tokens, job_id

__all__ = ["TrainguardCallback", "resume_checkpoint"]

log = logging.getLogger(__name__)


def resume_checkpoint(trainer, given=None, environ=None):
    """The ``ckpt_path`` trainguard asks for (see the module docstring), or ``given``."""
    folder = getattr(getattr(trainer, "checkpoint_callback", None), "dirpath", None)
    if not folder:
        return given
    return checkpoint_to_resume(steps_in(folder, r"step=(\d+)"), given, environ)


class TrainguardCallback(Callback):
    """Watch a Lightning ``Trainer`` with trainguard (see the module docstring).

    ``job``: the job id (default: ``TRAINGUARD_JOB``, else ``TRAINGUARD_JOB_ID``, else the
    logger's name, else the script's name); it also names the in-memory snapshots, so it must
    stay the same across restarts. ``resume``: pick the checkpoint to resume from on a
    relaunch. ``snapshot_every``: in-memory snapshots every that many optimizer steps (0: off);
    ``snapshot_config``: all their settings (``trainguard.checkpoint.SnapshotConfig``).
    """

    def __init__(self, job: str | None = None, resume: bool = True, snapshot_every: int = 0,
                 snapshot_config: SnapshotConfig | None = None):
        super().__init__()
        self.watch = CallbackWatch(job=job)
        self.resume = resume
        self.snapshots = CallbackSnapshots(snapshot_every, snapshot_config)

    # -- set-up -------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage):
        if stage != "fit" or not (self.resume or self.snapshots.enabled):
            return
        connector = getattr(trainer, "_checkpoint_connector", None)
        start = getattr(connector, "resume_start", None)
        if start is None or getattr(start, "_trainguard", False):
            if start is None:
                log.warning("trainguard: this Lightning version has no resume_start; "
                            "TRAINGUARD_RESUME_STEP is not passed on and in-memory snapshots "
                            "are not restored")
            return
        if self.resume:
            start = _resuming(trainer, start)
        if self.snapshots.enabled:
            start = self._resume_start(trainer, connector, start)
        connector.resume_start = start

    def on_train_start(self, trainer, pl_module):
        logger = getattr(trainer, "logger", None)
        self.watch.start(run_name=getattr(logger, "name", None),
                         world_size=getattr(trainer, "world_size", 1) or 1,
                         first_step=trainer.global_step)
        if self.snapshots.enabled:
            # a sharded model's optimizers go to torch's get_state_dict as they are
            sharded = is_sharded(pl_module)
            self.snapshots.start(
                self._job(trainer), first_step=trainer.global_step, model=pl_module,
                optimizer=list(trainer.optimizers) if sharded
                else _Each(lambda: trainer.optimizers), sharded_by=_sharded_by(trainer),
                scheduler=_Each(lambda: [c.scheduler for c in trainer.lr_scheduler_configs]),
                extra=lambda done: _progress(trainer))

    def on_train_end(self, trainer, pl_module):
        self.watch.stop()
        self.snapshots.close()

    # -- the step ---------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.watch.begin("forward")
        self.watch.call("add_tokens", _tokens(batch))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.snapshots.before_update()
        self.watch.call("phase", "optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        self.snapshots.after_step(step)    # once per optimizer step
        watcher = self.watch.watcher
        if watcher is None or step <= watcher.next_step:
            return  # accumulating gradients: the optimizer has not stepped yet
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        self.watch.end_step(step=max(0, step - 1), loss=loss, lr=_learning_rate(trainer))

    # -- between steps ------------------------------------------------------------------------
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx,
                                  dataloader_idx=0):
        self.watch.call("abandon")
        self.watch.call("phase", "eval")

    def on_validation_end(self, trainer, pl_module):
        self.watch.call("phase", "idle")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.watch.call("phase", "checkpoint")

    # -- in-memory snapshots ------------------------------------------------------------------
    def _job(self, trainer) -> str:
        logger = getattr(trainer, "logger", None)
        return self.watch.job or job_id(self.watch.environ,
                                        run_name=getattr(logger, "name", None))

    def _resume_start(self, trainer, connector, start):
        """``resume_start`` that loads the in-memory snapshot, as Lightning loads a checkpoint
        file, when it is at least as new as the checkpoint ``start`` would load."""
        @functools.wraps(start)
        def wrapper(checkpoint_path=None, *args, **kwargs):
            if "checkpoint_path" in kwargs:
                checkpoint_path = kwargs.pop("checkpoint_path")
            if not _fitting(trainer):
                return start(checkpoint_path, *args, **kwargs)
            disk = checkpoint_path
            if self.resume:
                try:
                    disk = resume_checkpoint(trainer, checkpoint_path)
                except Exception:
                    pass                      # start() warns and keeps what it was given
            disk_step, loaded = _step_of(disk), False
            if disk_step is None:             # no step in its name (last.ckpt): read it
                start(checkpoint_path, *args, **kwargs)
                disk_step = int((connector._loaded_checkpoint or {}).get("global_step", -1))
                loaded = True
            restored = self.snapshots.find(self._job(trainer), disk_step=disk_step)
            if restored is None:
                return None if loaded else start(checkpoint_path, *args, **kwargs)
            connector._ckpt_path = f"in-memory snapshot of step {restored.step}"
            connector._loaded_checkpoint = _checkpoint(restored.tree)
            if restored.tree.get("sharded"):   # the strategy loads none of it: done here
                apply({k: restored.tree[k] for k in ("sharded", "model", "optimizer")
                       if k in restored.tree},
                      model=trainer.lightning_module, optimizer=list(trainer.optimizers))
            apply({"rng": restored.tree.get("rng", {})})
            return None
        wrapper._trainguard = True
        return wrapper


def _tokens(batch):
    try:
        return count_tokens((batch,), None)
    except Exception:
        return None


def _learning_rate(trainer):
    try:
        return float(trainer.optimizers[0].param_groups[0]["lr"])
    except Exception:
        return None


def _sharded_by(trainer) -> str | None:
    """The strategy, when it shards the model without DTensors (flat parameters, ZeRO); a
    model with DTensor parameters is snapshotted shard by shard."""
    name = type(getattr(trainer, "strategy", None)).__name__
    return name if name in ("FSDPStrategy", "DeepSpeedStrategy") else None


def _fitting(trainer) -> bool:
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return getattr(fn, "value", fn) == "fit"


def _resuming(trainer, start):
    return resuming(start, lambda given: resume_checkpoint(trainer, given),
                    lambda: _fitting(trainer))


class _Each:
    """The state dicts of several objects as one list (the trainer's optimizers, schedulers)."""

    def __init__(self, objects):
        self.objects = objects

    def state_dict(self) -> list:
        return [o.state_dict() for o in self.objects()]


def _progress(trainer) -> dict:
    """What a Lightning checkpoint holds besides the model, optimizers and schedulers."""
    precision = trainer.precision_plugin
    state = precision.state_dict()
    return {"epoch": trainer.current_epoch, "global_step": trainer.global_step,
            "loops": {"fit_loop": trainer.fit_loop.state_dict()},
            "precision": {type(precision).__qualname__: state} if state else {}}


def _checkpoint(tree: dict) -> dict:
    """A snapshot as the checkpoint dict Lightning loads (``dump_checkpoint``'s keys)."""
    extra = tree.get("extra") or {}
    sharded = tree.get("sharded")           # model and optimizers loaded by the callback
    return {"epoch": extra.get("epoch", 0), "global_step": extra.get("global_step", tree["step"]),
            "pytorch-lightning_version": pl.__version__,
            "state_dict": {} if sharded else tree["model"], "loops": extra.get("loops", {}),
            "optimizer_states": [] if sharded else list(tree.get("optimizer") or []),
            "lr_schedulers": list(tree.get("scheduler") or []), "callbacks": {},
            **(extra.get("precision") or {})}


def _step_of(path) -> int | None:
    """The step in a checkpoint's file name (``step=N``); -1: no checkpoint; None: unknown."""
    if path is None:
        return -1
    match = re.search(r"step=(\d+)", os.path.basename(str(path)))
    return int(match.group(1)) if match else None
