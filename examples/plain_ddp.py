"""A plain DistributedDataParallel training script that knows nothing of trainguard.

    trainguard run --job plain --instrument --checkpoint-dir ckpt -- \
        torchrun --nproc-per-node 2 examples/plain_ddp.py --steps 100

It trains a small MLP regressor on random data over gloo, fetching batches from a DataLoader
(``--loader python``: straight from the dataset, a loader no torch hook sees), clipping
gradients, and saving ``ckpt_<step>.pt`` every ``--checkpoint-every`` steps into
``--checkpoint-dir`` (default ``$TRAINGUARD_CHECKPOINT_DIR``, else ``./checkpoints``); every
start resumes from the newest checkpoint there. ``trainguard run --instrument`` watches it as
it is.

Faults for tests, each once per checkpoint folder (a marker file):
``FAULT_SLOW=RANK:SECONDS[:STEP]`` (that rank sleeps in every forward pass from the STEP-th
on), ``FAULT_SLOW_DATA=RANK:SECONDS`` (that rank's data loader takes SECONDS longer for
every batch; RANK ``*``: every rank's), ``FAULT_HANG=RANK:STEP`` (that rank hangs fetching
the batch of that step), ``FAULT_KILL=RANK:STEP`` (that rank SIGKILLs itself at that step).
"""
from __future__ import annotations

import argparse
import datetime
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset


def fault(name: str):
    """``RANK:VALUE[:FROM]`` -> (rank, value, from): FROM is the first step it applies to
    (``FAULT_SLOW`` only; default 0)."""
    raw = os.environ.get(name, "")
    if ":" not in raw:
        return None
    rank, value, *start = raw.split(":")
    return int(rank), float(value), int(start[0]) if start else 0


def loader_delay(rank: int) -> float:
    """Seconds this rank's data loader sleeps per batch, from ``FAULT_SLOW_DATA``."""
    who, _, seconds = os.environ.get("FAULT_SLOW_DATA", "").partition(":")
    return float(seconds) if seconds and who in ("*", str(rank)) else 0.0


class Batches(Dataset):
    """Batch ``i`` of a rank is a function of (seed, i, rank): the same after a restart."""

    def __init__(self, rank: int, start: int, steps: int, batch: int, width: int, ckpt: Path):
        self.rank, self.start, self.steps, self.batch, self.width = rank, start, steps, batch, width
        self.hang, self.ckpt, self.delay = fault("FAULT_HANG"), ckpt, loader_delay(rank)

    def __len__(self):
        return self.steps - self.start

    def __getitem__(self, i):
        step = self.start + i
        if self.hang and self.hang[0] == self.rank and step == int(self.hang[1]):
            marker = self.ckpt / f"hang-fired-{self.rank}"
            if not marker.exists():
                marker.touch()
                print(f"[plain] rank {self.rank} hangs in its data loader at step {step}",
                      flush=True)
                while True:
                    time.sleep(0.1)
        if self.delay:
            time.sleep(self.delay)  # a slow loader: disk, decoding, augmentation
        g = torch.Generator().manual_seed(step * 4099 + self.rank)
        x = torch.randn(self.batch, self.width, generator=g)
        return x, x.sum(dim=1, keepdim=True).tanh()


class Net(nn.Module):
    def __init__(self, width: int, slow: tuple | None, rank: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                  nn.Linear(4 * width, width), nn.GELU(), nn.Linear(width, 1))
        self.sleep = slow[1] if slow and slow[0] == rank else 0.0
        self.slow_from, self.calls = (slow[2] if slow else 0), 0

    def forward(self, x):
        self.calls += 1
        if self.sleep and self.calls > self.slow_from:
            time.sleep(self.sleep)  # a slow rank: stands in for a slower GPU
        return self.body(x)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--loader", choices=("dataloader", "python"), default="dataloader")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--checkpoint-dir", default=os.environ.get("TRAINGUARD_CHECKPOINT_DIR")
                   or "checkpoints")
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    env = os.environ
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    timeout = datetime.timedelta(seconds=args.timeout)
    store = dist.TCPStore(env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)),
                          world, is_master=rank == 0 and
                          env.get("TORCHELASTIC_USE_AGENT_STORE") != "True", timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{restart}", store),
                            rank=rank, world_size=world, timeout=timeout)
    ckpt = Path(args.checkpoint_dir)
    ckpt.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = Net(args.width, fault("FAULT_SLOW"), rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    found = sorted(ckpt.glob("ckpt_*.pt"))
    start = torch.tensor([int(found[-1].stem.split("_")[1]) if found and rank == 0 else -1])
    dist.broadcast(start, src=0)
    start = max(0, int(start.item()))
    if start:
        state = torch.load(ckpt / f"ckpt_{start:08d}.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
    if rank == 0:
        print(f"[plain] {world} ranks, starting at step {start}", flush=True)
    ddp = DDP(model)
    data = Batches(rank, start, args.steps, args.batch, args.width, ckpt)
    loader = (DataLoader(data, batch_size=None, shuffle=False) if args.loader == "dataloader"
              else (data[i] for i in range(len(data))))
    kill = fault("FAULT_KILL")
    for step, (x, y) in enumerate(loader, start=start):
        if kill and kill[0] == rank and step == int(kill[1]):
            marker = ckpt / f"kill-fired-{rank}"
            if not marker.exists():
                marker.touch()
                print(f"[plain] rank {rank} SIGKILLs itself at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done = step + 1
        if rank == 0 and (done % args.checkpoint_every == 0 or done == args.steps):
            tmp = ckpt / f".ckpt_{done:08d}.tmp"
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp)
            os.replace(tmp, ckpt / f"ckpt_{done:08d}.pt")
    if rank == 0:
        print(f"[plain] done at step {args.steps}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
