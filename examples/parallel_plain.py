"""Plain FSDP2, tensor parallel and pipeline parallel training on CPU (gloo); knows nothing of
trainguard.

    trainguard run --job fsdp --instrument -- \
        torchrun --nproc-per-node 4 examples/parallel_plain.py fsdp2 --steps 100

``fsdp2``: ``fully_shard`` on each block of a small MLP and on the whole, a 1-D CPU mesh;
every rank its own batches. ``tp``: ``parallelize_module`` with ``ColwiseParallel`` /
``RowwiseParallel`` on the blocks' two linears, a 1-D CPU mesh; every rank the same batches.
``pp``: ``torch.distributed.pipelining`` — a model cut into 2 stages (``PipelineStage``,
``ScheduleGPipe`` or ``--schedule 1f1b``: ``Schedule1F1B``, 4 micro-batches); with 4 ranks, 2 pipelines x 2 stages (Megatron layout:
ranks 0,1 run stage 0, ranks 2,3 stage 1), each stage's gradients averaged over its 2 pipelines
with ``dist.all_reduce``. The loss exists on the last stage only.

``FAULT_SLOW=RANK:SECONDS[:STEP]``: that rank sleeps in every forward pass of its model (each
micro-batch for ``pp``) from the STEP-th step on, standing in for a slower GPU.
"""
from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn


def slow_fault(rank: int) -> tuple[float, int]:
    """(seconds, from step) this rank sleeps per forward; (0, 0) when not slowed."""
    raw = os.environ.get("FAULT_SLOW", "")
    if ":" not in raw:
        return 0.0, 0
    who, seconds, *start = raw.split(":")
    return (float(seconds), int(start[0]) if start else 0) if int(who) == rank else (0.0, 0)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))


class Net(nn.Module):
    """``blocks`` residual MLP blocks; sleeps ``slow`` s per forward once ``slow_from`` steps
    (counted by ``step``, set by the loop) have passed."""

    def __init__(self, width: int, blocks: int, slow: tuple[float, int], head: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 1) if head else None
        self.slow, self.slow_from = slow
        self.step = 0

    def forward(self, x):
        if self.slow and self.step >= self.slow_from:
            time.sleep(self.slow)
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def batch(step: int, seed: int, size: int, width: int):
    g = torch.Generator().manual_seed(step * 4099 + seed)
    x = torch.randn(size, width, generator=g)
    return x, x.sum(dim=1, keepdim=True).tanh()


def fsdp2(args, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = Net(args.width, 2, slow_fault(rank))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        model.step = step
        x, y = batch(step, rank, args.batch, args.width)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        pause(args)


def tensor_parallel(args, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the replicated head starts the same on every rank
    model = Net(args.width, 2, slow_fault(rank))
    plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.up"] = ColwiseParallel()
        plan[f"blocks.{i}.down"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        model.step = step
        x, y = batch(step, 0, args.batch, args.width)  # TP ranks see the same batch
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        pause(args)


def pipeline_parallel(args, rank, world):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stages = 2
    if world % stages:
        raise SystemExit(f"pp needs a world size divisible by {stages}, got {world}")
    dp = world // stages
    stage, replica = divmod(rank, dp)  # Megatron layout: DP fastest, then PP
    pipes = [dist.new_group([s * dp + r for s in range(stages)]) for r in range(dp)]
    replicas = [dist.new_group([s * dp + r for r in range(dp)]) for s in range(stages)]
    torch.manual_seed(stage)
    last = stage == stages - 1
    model = Net(args.width, 2, slow_fault(rank), head=last)
    micro = 4
    pipe = PipelineStage(model, stage, stages, torch.device("cpu"), group=pipes[replica])
    # every stage gets the loss function: without one a stage runs no backward
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule](
        pipe, n_microbatches=micro, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        model.step = step
        x, y = batch(step, replica, args.batch, args.width)
        if stage == 0:
            schedule.step(x)
        elif last:
            losses: list = []
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        if dp > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=replicas[stage])
                p.grad /= dp
        opt.step()
        opt.zero_grad()
        pause(args)


def pause(args):
    if args.step_sleep:
        time.sleep(args.step_sleep)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("parallel", choices=["fsdp2", "tp", "pp"])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--width", type=int, default=48)  # 4x48 splits over 2, 3, 4 ranks
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--step-sleep", type=float, default=0.0, help="idle seconds between steps")
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe", help="pp only")
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    {"fsdp2": fsdp2, "tp": tensor_parallel, "pp": pipeline_parallel}[args.parallel](
        args, rank, world)
    if rank == 0:
        print(f"[{args.parallel}] {world} ranks, done at step {args.steps}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
