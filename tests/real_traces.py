"""The real traces of ../shared/data as SPEC events, for the detector tests and the bench.

- ``alibaba_job(n)``: ``straggler-traces/alibaba-pai/job_<n>_norm.csv`` (per-worker
  mini-batch times of a 10-worker data-parallel job, normalized 0-1000, sampled every 10
  iterations) replayed as ``step`` events: one step per sample, ``compute_time`` the
  normalized time in milliseconds, ``step_time`` the slowest worker's (synchronous training).
- ``loss_curve_job(rows)``: a per-step loss curve replayed by four ranks.
"""
from __future__ import annotations

import csv
import math
import random
from pathlib import Path

from trainguard import events as ev

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
T0 = 1764680000.0


def alibaba_rows(n: int) -> dict:
    """``{sample index: {worker: normalized time}}``."""
    path = SHARED / "straggler-traces" / "alibaba-pai" / f"job_{n}_norm.csv"
    out: dict = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            out.setdefault(int(row["time"]), {})[int(row["worker"])] = float(row["batch_time_norm"])
    return out


def alibaba_job(n: int, job: str | None = None) -> list:
    rows = alibaba_rows(n)
    job = job or f"alibaba-{n}"
    workers = sorted({w for r in rows.values() for w in r})
    events = [ev.Lifecycle(job=job, ts=T0 + 0.01 * w, node=f"n{w // 2 + 1}", rank=w,
                           event="start", pid=100 + w, world_size=len(workers),
                           local_rank=w % 2, topology={"tp": 1, "pp": 1, "dp": len(workers)})
              for w in workers]
    ts = T0 + 5.0
    for step, t in enumerate(sorted(rows)):
        times = rows[t]
        duration = max(times.values()) / 1000.0 * 1.1
        ts += duration
        for w, x in sorted(times.items()):
            events.append(ev.Step(job=job, ts=ts + 0.001 * w, node=f"n{w // 2 + 1}", rank=w,
                                  step=step, step_time=duration, compute_time=x / 1000.0,
                                  loss=2.0 + math.exp(-step / 300), grad_norm=1.0))
        if step % 2 == 0:
            for w in times:
                events.append(ev.Heartbeat(job=job, ts=ts + 0.002 * w, node=f"n{w // 2 + 1}",
                                           rank=w, pid=100 + w, step=step, phase="forward",
                                           phase_since=ts - duration / 2, dropped=0))
    return events


def loss_curve_job(curve, job="curve", ranks=4, step_s=1.0, seed=0) -> list:
    """``curve``: ``[(step, loss)]``; each rank sees the loss with its own micro-batch noise."""
    rng = random.Random(seed)
    events = [ev.Lifecycle(job=job, ts=T0 + 0.01 * r, node="n1", rank=r, event="start",
                           pid=10 + r, world_size=ranks, local_rank=r) for r in range(ranks)]
    ts = T0 + 2.0
    for step, loss in curve:
        ts += step_s
        for r in range(ranks):
            events.append(ev.Step(job=job, ts=ts + 0.001 * r, node="n1", rank=r, step=step,
                                  step_time=step_s, compute_time=0.8 * step_s,
                                  loss=loss * (1 + rng.gauss(0, 0.003)),
                                  grad_norm=1.0 * math.exp(rng.gauss(0, 0.05))))
    return events
