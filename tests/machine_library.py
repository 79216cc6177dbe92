"""Machines that degrade without a flag (tests/machine_faults.py), with and without a later
slowdown of the step time, and healthy jobs whose machines differ steadily (mixed GPU bins).

Every job: 16 ranks on 4 machines (4 GPUs each), 1 s steps, a 20 s checkpoint every 150
steps, counters that vary (``gpu_noise``) sampled every 2 s; a fault begins at step 320
(after the per-machine model's warm-up), a slowdown of its machine's ranks (1.3x, a
``straggler``) at step 420 where there is one.
"""
from __future__ import annotations

from machine_faults import KINDS
from scenarios import Fault, Scenario

__all__ = ["MACHINE_HEALTHY", "MACHINE_FAULTS", "SLOWDOWN_STEP", "FAULT_STEP"]

FAULT_STEP = 320
SLOWDOWN_STEP = 420
_RANKS_OF = {"n2": (4, 5, 6, 7), "n3": (8, 9, 10, 11)}


def _job(name, seed, **kw) -> Scenario:
    base = dict(name=name, dp=16, per_node=4, steps=560, step_time=1.0, first_step_s=20.0,
                checkpoint_every=150, checkpoint_s=20.0, gpu_s=2.0, gpu_noise=0.01, seed=seed)
    return Scenario(**{**base, **kw})


def _fault(kind, node, slowdown, seed) -> Scenario:
    faults = [Fault(kind=kind, step=FAULT_STEP, node=node)]
    if slowdown:
        faults.append(Fault(kind="straggler", step=SLOWDOWN_STEP, ranks=_RANKS_OF[node],
                            factor=1.3))
    return _job(f"machine-{kind}{'-slowdown' if slowdown else ''}", seed, faults=tuple(faults))


MACHINE_FAULTS = [_fault(kind, node, slowdown, seed=100 + 10 * i + slowdown)
                  for i, (kind, node) in enumerate(zip(KINDS, ("n2", "n3", "n2", "n3", "n2")))
                  for slowdown in (False, True)]

MACHINE_HEALTHY = [
    _job("bins-one-slow-6pct", 1, gpu_bins={"n3": 0.94}),
    _job("bins-one-fast-8pct", 2, gpu_bins={"n1": 1.08}),
    _job("bins-mixed", 3, gpu_bins={"n1": 0.95, "n2": 1.05, "n4": 0.93}),
    _job("bins-noisy", 4, gpu_bins={"n2": 0.94}, gpu_noise=0.03),
    _job("plain-noise", 5),
    _job("rank0-checkpoints-alone", 6, checkpoint_rank0_only=True, checkpoint_every=100),
    _job("pp2-bins", 7, dp=8, pp=2, gpu_bins={"n4": 0.94}),
]
