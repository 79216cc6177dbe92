"""A PyTorch Lightning job (a small MLP regressor on random data, DDP over gloo), watched by
trainguard with one line: ``callbacks=[TrainguardCallback()]``.

    trainguard run --job pl --checkpoint-dir ckpt -- \
        torchrun --nproc-per-node 2 examples/lightning_job.py --steps 60

Checkpoints ``step=N.ckpt`` go to ``--checkpoint-dir`` (default
``$TRAINGUARD_CHECKPOINT_DIR``, else ``./pl-ckpt``) every ``--save-steps``; a relaunch by
``trainguard run`` resumes from the one trainguard names, with no ``ckpt_path`` in the script.
Faults for tests as in plain_ddp.py (``FAULT_SLOW``, ``FAULT_SLOW_DATA``, ``FAULT_HANG``,
``FAULT_KILL``).
"""
from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
import torch.nn as nn
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from plain_ddp import Batches, Net, fault
from trainguard.integrations.lightning import TrainguardCallback


class Regressor(LightningModule):
    def __init__(self, width: int, rank: int, ckpt: Path):
        super().__init__()
        self.net = Net(width, fault("FAULT_SLOW"), rank)
        self.rank_, self.ckpt, self.kill = rank, ckpt, fault("FAULT_KILL")

    def training_step(self, batch, batch_idx):
        if self.kill and self.kill[0] == self.rank_ and self.trainer.global_step >= self.kill[1]:
            marker = self.ckpt / f"kill-fired-{self.rank_}"
            if not marker.exists():
                marker.touch()
                print(f"[pl] rank {self.rank_} SIGKILLs itself", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--checkpoint-dir", default=os.environ.get("TRAINGUARD_CHECKPOINT_DIR")
                   or "pl-ckpt")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rank, local_world = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    ckpt = Path(args.checkpoint_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(Batches(rank, 0, args.steps * 2, 32, args.width, ckpt),
                                       batch_size=None, shuffle=False)
    trainer = Trainer(
        accelerator="cpu", devices=local_world, num_nodes=1, max_steps=args.steps,
        strategy=DDPStrategy(process_group_backend="gloo"), logger=False,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
        use_distributed_sampler=False, num_sanity_val_steps=0,
        callbacks=[TrainguardCallback(),
                   ModelCheckpoint(dirpath=str(ckpt), every_n_train_steps=args.save_steps,
                                   save_top_k=-1, filename="{step}")])
    trainer.fit(Regressor(args.width, rank, ckpt), train_dataloaders=data)
    if rank == 0:
        print(f"[pl] done at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
