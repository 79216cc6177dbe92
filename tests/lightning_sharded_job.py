"""A 2-rank Lightning fit of an FSDP2-sharded model (``ModelParallelStrategy``) on CPU/gloo
for tests/test_integrations_snapshots.py, with the trainguard callback's in-memory snapshots:

1. snapshots every 2 steps, a crash before step 6 (every rank);
2. snapshots off, uninterrupted, to step 8;
3. snapshots on, a model with other initial weights: it resumes at step 4 from memory, its
   sharded weights and optimizer state those of the first fit at step 4, and runs to step 8,
   where all of it is the uninterrupted fit's (dropout's RNG and the loops restored too).

    torchrun --nproc-per-node 2 --standalone tests/lightning_sharded_job.py SNAPSHOT_DIR OUT

Each rank writes ``OUT/rank<R>.json``: ``{"rank", "resumed", "ckpt_path", "differences", ...}``
(the ranks' lines on one stdout can run into each other).
"""
import json
import logging
import sys

import torch
import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

from trainguard.checkpoint import SnapshotConfig
from trainguard.integrations.callbacks import CallbackWatch
from trainguard.integrations.lightning import TrainguardCallback

STEPS, EVERY, CRASH_AT = 8, 2, 5
CallbackWatch.start = lambda self, *a, **k: None      # no telemetry: this is about snapshots
CallbackWatch.stop = lambda self: None


class Crash(Exception):
    pass


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(16, 1))

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def full_state(trainer, module) -> dict:
    """Every rank's view of the whole state: each DTensor gathered (a collective)."""
    model = {k: v.full_tensor().clone() for k, v in module.state_dict().items()}
    opt = trainer.optimizers[0]
    moments = [{k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
                for k, v in opt.state[p].items()} for p in module.parameters()]
    return {"global_step": trainer.global_step, "model": model, "optimizer": moments}


def fit(folder: str, seed: int, crash: bool, snapshots: bool = True):
    seen = {}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, module):
            if trainer.global_step:
                seen["start"] = full_state(trainer, module)

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if crash and trainer.global_step == CRASH_AT:
                raise Crash(f"before step {CRASH_AT + 1}")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen[trainer.global_step] = full_state(trainer, module)

    g = torch.Generator().manual_seed(123)
    x = torch.randn(16, 4, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                       batch_size=2, shuffle=False)
    torch.manual_seed(seed)
    callback = TrainguardCallback(job="pl-sharded", snapshot_config=SnapshotConfig(
        every=EVERY, dir=folder) if snapshots else None)
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=STEPS, logger=False,
                         strategy=ModelParallelStrategy(data_parallel_size=2,
                                                        tensor_parallel_size=1),
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[callback, Probe()])
    try:
        trainer.fit(Tiny(), train_dataloaders=data)
    except Crash:
        callback.snapshots.close()      # the process would be gone; its snapshots stay
    return trainer, seen


def differences(a, b, path=""):
    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and torch.equal(a, b) else [path]
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{path} keys"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, list):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}/{i}")] \
            if len(a) == len(b) else [f"{path} length"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def main(folder: str, out: str) -> None:
    logging.basicConfig(level=logging.WARNING)
    _, crashed = fit(folder, seed=0, crash=True)
    _, full = fit(folder, seed=0, crash=False, snapshots=False)
    trainer, again = fit(folder, seed=1, crash=False)
    start = again.get("start", {})
    result = {"rank": trainer.global_rank, "resumed": start.get("global_step"),
              "ckpt_path": trainer.ckpt_path, "steps": sorted(k for k in again if k != "start"),
              "crashed_steps": sorted(crashed),
              "differences": differences(start, crashed.get(start.get("global_step"), {})),
              "end_differences": differences(again[STEPS], full[STEPS])}
    with open(f"{out}/rank{trainer.global_rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
