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

Requires ``pip install trainguard[lightning]``; importing this module imports ``lightning``
(or ``pytorch_lightning`` where only that is installed).
"""
from __future__ import annotations

import logging

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    from pytorch_lightning.callbacks import Callback

from .callbacks import CallbackWatch, checkpoint_to_resume, resuming, steps_in
from .watcher import count_tokens

__all__ = ["TrainguardCallback", "resume_checkpoint"]

log = logging.getLogger(__name__)


def resume_checkpoint(trainer, given=None, environ=None):
    """The ``ckpt_path`` trainguard asks for (see the module docstring), or ``given``."""
    folder = getattr(getattr(trainer, "checkpoint_callback", None), "dirpath", None)
    if not folder:
        return given
    return checkpoint_to_resume(steps_in(folder, r"step=(\d+)"), given, environ)


class TrainguardCallback(Callback):
    """Watch a Lightning ``Trainer`` with trainguard (see the module docstring)."""

    def __init__(self, job: str | None = None, resume: bool = True):
        super().__init__()
        self.watch = CallbackWatch(job=job)
        self.resume = resume

    # -- set-up -------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage):
        if stage != "fit" or not self.resume:
            return
        connector = getattr(trainer, "_checkpoint_connector", None)
        start = getattr(connector, "resume_start", None)
        if start is None or getattr(start, "_trainguard", False):
            if start is None:
                log.warning("trainguard: this Lightning version has no resume_start; "
                            "TRAINGUARD_RESUME_STEP is not passed on")
            return
        connector.resume_start = _resuming(trainer, start)

    def on_train_start(self, trainer, pl_module):
        logger = getattr(trainer, "logger", None)
        self.watch.start(run_name=getattr(logger, "name", None),
                         world_size=getattr(trainer, "world_size", 1) or 1,
                         first_step=trainer.global_step)

    def on_train_end(self, trainer, pl_module):
        self.watch.stop()

    # -- the step ---------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.watch.begin("forward")
        self.watch.call("add_tokens", _tokens(batch))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.watch.call("phase", "optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
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


def _resuming(trainer, start):
    def fitting():
        fn = getattr(getattr(trainer, "state", None), "fn", None)
        return getattr(fn, "value", fn) == "fit"
    return resuming(start, lambda given: resume_checkpoint(trainer, given), fitting)
