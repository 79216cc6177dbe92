"""A small data-parallel training job instrumented with trainguard (CPU, gloo).

Run it under torchrun, e.g. four ranks of which rank 2 has a 1.5x slower forward pass::

    TRAINGUARD_BOOTSTRAP=127.0.0.1:9092 python -m torch.distributed.run --nproc-per-node 4 \\
        examples/instrumented_job.py --job demo-1 --steps 40 --slow-rank 2 --slow-factor 1.5

Without torchrun (no ``RANK`` in the environment) it trains alone, without DDP.

Each step's work is a small MLP plus a controlled delay of ``--forward-ms`` inside the model's
forward pass (CPU contention on a small machine would otherwise swamp the signal); the slow
rank's forward takes ``--slow-factor`` times as long as it would otherwise, by sleeping in
proportion to the time its forward pass has taken. With ``--out DIR`` every rank writes
``DIR/rank<r>.json`` with its step times and the collector's counters.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn


class Net(nn.Module):
    """An MLP whose forward pass also takes ``forward_s`` seconds times ``factor``."""

    def __init__(self, forward_s: float, factor: float = 1.0, width: int = 64):
        super().__init__()
        self.forward_s = forward_s
        self.factor = factor
        self.layers = nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width),
                                    nn.ReLU(), nn.Linear(width, 1))

    def forward(self, x):
        t0 = time.perf_counter()
        y = self.layers(x)
        if self.forward_s > 0:
            time.sleep(self.forward_s)
        if self.factor != 1.0:
            time.sleep((time.perf_counter() - t0) * (self.factor - 1.0))
        return y


class NoCollector:
    """The collector API doing nothing: the uninstrumented baseline."""

    dropped = 0

    class _Step:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def report(self, **values):
            pass

    def step(self, step):
        return self._Step()

    def phase(self, name):
        return contextlib.nullcontext()

    def close(self, **kwargs):
        pass


def train(tg, model, opt, steps: int, batch: int, rank: int, until: Path | None,
          max_seconds: float, record: list) -> int:
    gen = torch.Generator().manual_seed(1234 + rank)
    t_start = time.monotonic()
    step = 0
    while True:
        if until is None and step >= steps:
            break
        if until is not None and (until.exists() or time.monotonic() - t_start > max_seconds):
            break
        t0 = time.perf_counter()
        with tg.step(step) as s:
            with tg.phase("data"):
                x = torch.randn(batch, 32, generator=gen)
                y = torch.randn(batch, 1, generator=gen)
            with tg.phase("forward"):
                loss = nn.functional.mse_loss(model(x), y)
            with tg.phase("backward"):
                loss.backward()
            with tg.phase("optimizer"):
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
                opt.step()
                opt.zero_grad(set_to_none=True)
            s.report(loss=loss.detach(), grad_norm=grad_norm, tokens=batch,
                     lr=opt.param_groups[0]["lr"])
        record.append((time.time(), time.perf_counter() - t0))
        step += 1
    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--job", default="instrumented-job")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--forward-ms", type=float, default=30.0)
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--slow-factor", type=float, default=1.5)
    parser.add_argument("--baseline-steps", type=int, default=0,
                        help="uninstrumented steps to time before trainguard.init")
    parser.add_argument("--no-trainguard", action="store_true")
    parser.add_argument("--no-watch-ddp", action="store_true")
    parser.add_argument("--heartbeat", type=float, default=1.0)
    parser.add_argument("--report-every", type=int, default=1)
    parser.add_argument("--until-file", type=Path, help="train until this file exists")
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--out", type=Path, help="write DIR/rank<r>.json")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    factor = args.slow_factor if rank == args.slow_rank else 1.0
    torch.manual_seed(0)
    model = Net(args.forward_ms / 1000.0, factor)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    result = {"rank": rank, "pid": os.getpid()}
    if args.baseline_steps:
        base: list = []
        if distributed:
            dist.barrier()
        train(NoCollector(), model, opt, args.baseline_steps, args.batch, rank, None, 0, base)
        result["baseline_step_times"] = [d for _, d in base]

    if args.no_trainguard:
        tg = NoCollector()
    else:
        import trainguard

        tg = trainguard.init(job=args.job, heartbeat_interval=args.heartbeat,
                             report_every=args.report_every,
                             topology={"tp": 1, "pp": 1, "dp": dist.get_world_size()
                                       if distributed else 1})
        if distributed and not args.no_watch_ddp:
            tg.watch_ddp(model)
    if distributed:
        dist.barrier()
    record: list = []
    steps = train(tg, model, opt, args.steps, args.batch, rank, args.until_file,
                  args.max_seconds, record)
    dropped_before_close = tg.dropped
    t0 = time.monotonic()
    tg.close()
    result.update(steps=steps, step_end_times=[t for t, _ in record],
                  step_times=[d for _, d in record], close_seconds=time.monotonic() - t0,
                  dropped_before_close=dropped_before_close, dropped=tg.dropped,
                  median_step_time=statistics.median(d for _, d in record) if record else None)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
