#!/usr/bin/env python3
"""GPU check of ``compute_time`` from CUDA events: NCCL DDP on one GPU, two ranks.

    python scripts/gpu_compute_time_check.py OUT.json [--steps 60] [--slow-ms 30]

Starts two processes on GPU 0 (NCCL allows two ranks on one device for DDP), trains a small
MLP with DistributedDataParallel and no comm hook, watched by trainguard's hooks as ``--instrument`` installs them, with :class:`CudaComputeTimer`. Rank 1 adds ``--slow-ms`` of GPU
work (a matmul loop) to every forward pass, so it is the straggler; with NCCL the host-side
wait is near zero, and only the CUDA events tell the ranks apart. Each rank's step records
(step, step_time, compute_time, loss, grad_norm) are written to OUT.json with the device name
and torch/NCCL versions, as a fixture for tests. Exit status 0 when rank 1's median
compute_time is at least 1.2x rank 0's, 1 when not, 3 when no GPU is at hand (and OUT.json
says so).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def worker(rank: int, world: int, port: int, args, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainguard.collectors.api import Collector, CollectorSettings
    from trainguard.integrations.torch_hooks import TorchHooks
    from trainguard.integrations.watcher import StepWatcher

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=world)

    class Keep:
        dropped = 0

        def __init__(self):
            self.steps = []

        def produce(self, record, key=None):
            if type(record) is tuple and record[0] == 1:
                _, ts, step, step_time, compute, values = record
                self.steps.append({"step": step, "step_time": step_time,
                                   "compute_time": compute,
                                   "loss": values[0] if values else None,
                                   "grad_norm": values[1] if values else None})

    keep = Keep()
    collector = Collector(CollectorSettings(job="gpu-check", rank=rank, world_size=world), keep)
    hooks = TorchHooks(StepWatcher(lambda: collector, cuda=True)).install()
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 1024)).cuda()
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    burn = torch.randn(2048, 2048, device="cuda")
    for step in range(args.steps):
        x = torch.randn(64, 1024, device="cuda")
        if rank == 1:  # extra GPU work on the slow rank: about --slow-ms on the device
            for _ in range(max(1, int(args.slow_ms))):
                burn = (burn @ burn).tanh_()
        loss = ddp(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    torch.cuda.synchronize()
    hooks.watcher.flush()
    hooks.uninstall()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(keep.steps, f)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--slow-ms", type=float, default=30.0,
                   help="matmul iterations of extra work on rank 1 (about ms each)")
    args = p.parse_args()
    result = {"host": os.uname().nodename, "time": time.time()}
    try:
        import torch
    except ImportError as exc:
        result["error"] = f"torch missing: {exc}"
        json.dump(result, open(args.out, "w"), indent=2)
        return 3
    if not torch.cuda.is_available():
        result["error"] = "no CUDA device at hand"
        json.dump(result, open(args.out, "w"), indent=2)
        print(result["error"], file=sys.stderr)
        return 3
    import socket

    import torch.multiprocessing as mp

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    out_dir = tempfile.mkdtemp(prefix="tg-gpu-ct-")
    mp.spawn(worker, args=(2, port, args, out_dir), nprocs=2, join=True)
    ranks = {r: json.load(open(os.path.join(out_dir, f"rank{r}.json"))) for r in (0, 1)}
    medians = {r: statistics.median(s["compute_time"] for s in steps[5:]
                                    if s["compute_time"] is not None)
               for r, steps in ranks.items()}
    result.update(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                  nccl=".".join(map(str, torch.cuda.nccl.version())),
                  median_compute_time=medians,
                  median_step_time={r: statistics.median(s["step_time"] for s in steps[5:])
                                    for r, steps in ranks.items()},
                  ratio=medians[1] / medians[0] if medians[0] else None, steps=ranks)
    json.dump(result, open(args.out, "w"), indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}, indent=2))
    return 0 if result["ratio"] and result["ratio"] >= 1.2 else 1


if __name__ == "__main__":
    sys.exit(main())
