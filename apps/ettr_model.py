"""ETTR at production scale, from what a recovery costs at that scale.

Meta's expected-ETTR model (Kokolis et al., "Revisiting Reliability in Large-Scale Machine
Learning Research Clusters", arXiv 2410.21680, HPCA '25) charges every failure its restart
overhead ``u0`` plus, on average, half a checkpoint interval ``dt`` of redone work, and every
checkpoint its blocking write time ``w``: ``E[ETTR] ~= (1 - lambda (u0 + dt/2)) / (1 + w/dt)``.
That first-order form goes below zero once a fault comes before the last one is recovered
(at 100,000 GPUs Llama 3's rate is a fault every 30 minutes), so here each fault is a renewal:
the job runs ``1/lambda`` on average, of which ``dt/2`` is redone, then stands ``d + u0``::

    E[ETTR] = (1 - lambda dt/2) / (1 + lambda (d + u0)) / (1 + w/dt)

which is Kokolis et al.'s form while ``lambda (d + u0 + dt)`` is small. ``d`` (fault to
detection) is split out of ``u0`` because trainguard measures it. The
inputs at a given size are published numbers, never the demo's small-job seconds:

* **Failure rate** ``lambda``: Llama 3's training (arXiv 2407.21783, §3.3.4): 419 unexpected
  interruptions in 54 days on 16,384 GPUs, scaled linearly in GPUs. About 78% of them were
  confirmed or suspected hardware issues: those take a machine out of the job, the other 22%
  leave every machine healthy.
* **Relaunch** (today: kill the command, requeue, start again, read the checkpoint back):
  ByteRobust (SOSP '25, arXiv 2509.16293, Table 7), full requeue from request to resumed
  training: 454, 545, 635 and 768 s on 2,048, 4,096, 8,192 and 16,384 GPUs. Between points the
  time is interpolated in log2(GPUs); beyond them the last doubling's slope is kept. The same
  paper: "often more than 10 minutes" at 10,000 GPUs (§2.3); Kokolis et al. assume 5-20 min.
* **Restart in place** (machines healthy: same processes or warm standbys, state from memory):
  never below ByteRobust's in-place hot update at that size (Table 7: 46, 51, 54, 65 s on the
  same sizes), and never below the demo's measured ratio to its own relaunch
  (``bench/run.py recovery_inplace``) times the relaunch at that size.
* **Checkpoints today**: every 30 min (ByteRobust §2.3 cites 30 min; Kokolis et al. find
  hourly typical on Meta's clusters), a blocking save of 10 s (ByteRobust Table 8: Megatron's
  save blocks 6.8-13.0 s at 2,048-16,384 GPUs).
* **In-memory snapshots** (issue 20): the interval is the snapshot cadence; each snapshot
  blocks training for a share of one step (the snapshot target, at most 1%; measured by
  ``bench/run.py snapshot``), and a step at scale is Llama 3 405B's: 16.8M-token batches on
  16,384 GPUs at about 400 TFLOPs each (arXiv 2407.21783 §3.3), 6 x 405e9 x 16.8e6 /
  (16,384 x 400e12) = 6.2 s. A snapshot a minute thus costs 0.1% of the time, not the 1% of
  a snapshot every step. A lost machine's ranks come back on
  a spare from the buddies' copies, so its redone work is also half a snapshot interval; the
  spare is a relaunch, or, with warm spare machines (``warm_spares``: the standby launcher's
  ``--spare``), a restart in place: :data:`LOST_MACHINE_RATIO` of a relaunch (measured), never
  below the hot update at that size.

>>> round(relaunch_s(9600), 1), round(relaunch_s(100_000), 1)
(665.4, 1115.1)
>>> today = Recovery.relaunch(detect_s=25.0)
>>> round(ettr(9600, today), 4), round(ettr(100_000, today), 4)
(0.9142, 0.3101)
>>> fast = Recovery.in_memory(detect_s=25.0, inplace_ratio=0.25, snapshot_every_s=60.0,
...                           snapshot_overhead=0.01)
>>> round(ettr(9600, fast), 4), round(ettr(100_000, fast), 4)
(0.9678, 0.6447)
>>> spares = Recovery.in_memory(detect_s=25.0, inplace_ratio=0.25, snapshot_every_s=60.0,
...                             snapshot_overhead=0.01, warm_spares=True)
>>> round(ettr(9600, spares), 4), round(ettr(100_000, spares), 4)
(0.9874, 0.8423)
>>> every_step = Recovery.in_memory(detect_s=25.0, inplace_ratio=0.25, snapshot_every_s=6.2,
...                                 snapshot_overhead=0.01, warm_spares=True)
>>> round(ettr(9600, every_step), 4)      # the 1% of every step, for half a step redone
0.9801
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

#: Llama 3 (arXiv 2407.21783 §3.3.4): unexpected interruptions, days, GPUs
LLAMA3_INTERRUPTIONS, LLAMA3_DAYS, LLAMA3_GPUS = 419, 54.0, 16384
#: Llama 3 §3.3.4: "Approximately 78% of the unexpected interruptions are attributed to
#: confirmed hardware issues ... or suspected hardware-related issues"
MACHINE_LOST_SHARE = 0.78
#: ByteRobust (arXiv 2509.16293) Table 7: GPUs -> seconds from request to resumed training
REQUEUE_S = ((2048, 454.0), (4096, 545.0), (8192, 635.0), (16384, 768.0))
HOT_UPDATE_S = ((2048, 46.0), (4096, 51.0), (8192, 54.0), (16384, 65.0))
#: a lost machine's ranks taken over by a warm spare's standbys, from detection to resumed
#: training, as a share of a relaunch onto a spare (``bench/run.py recovery_machine``:
#: ``restart_ratio``, 0.079 and 0.081 in two runs, 2026-12-06)
LOST_MACHINE_RATIO = 0.08
#: today's checkpoint cadence and blocking save (ByteRobust §2.3 and Table 8)
CHECKPOINT_EVERY_S, CHECKPOINT_BLOCKING_S = 1800.0, 10.0
#: a training step at scale: Llama 3 405B (arXiv 2407.21783 §3.3: 16.8M-token batches on
#: 16,384 GPUs at about 400 TFLOPs each): 6 x 405e9 x 16.8e6 / (16,384 x 400e12) seconds
STEP_S = round(6 * 405e9 * 16.8e6 / (16384 * 400e12), 1)


def failures_per_s(gpus: int) -> float:
    """Llama 3's interruption rate, scaled linearly to ``gpus``."""
    return LLAMA3_INTERRUPTIONS / (LLAMA3_DAYS * 86400.0) * gpus / LLAMA3_GPUS


def _log2_interpolate(points, gpus: int) -> float:
    x = math.log2(gpus)
    xs = [math.log2(g) for g, _ in points]
    ys = [s for _, s in points]
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return ys[-1] + slope * (x - xs[-1])


def relaunch_s(gpus: int) -> float:
    """Published time of a full relaunch at this size (ByteRobust Table 7, requeue)."""
    return _log2_interpolate(REQUEUE_S, gpus)


def hot_update_s(gpus: int) -> float:
    """Published time of an in-place restart at this size (ByteRobust Table 7, hot update)."""
    return _log2_interpolate(HOT_UPDATE_S, gpus)


@dataclass(kw_only=True, frozen=True)
class Recovery:
    """How a job recovers: what each fault costs and what checkpoints cost."""

    name: str
    detect_s: float
    #: restart of a fault that leaves every machine healthy, as a share of a relaunch
    #: (None: a relaunch)
    inplace_ratio: float | None
    checkpoint_every_s: float
    checkpoint_blocking_s: float
    #: a lost machine's ranks are taken over by a warm spare machine's standbys (in place)
    #: instead of a relaunch onto a spare
    warm_spares: bool = False
    #: with warm spares, a lost machine's restart as a share of a relaunch (None: the
    #: in-place ratio; measured: :data:`LOST_MACHINE_RATIO`)
    lost_ratio: float | None = None

    @classmethod
    def relaunch(cls, *, detect_s: float) -> Recovery:
        """Today: every fault relaunches the job from its last disk checkpoint."""
        return cls(name="relaunch", detect_s=detect_s, inplace_ratio=None,
                   checkpoint_every_s=CHECKPOINT_EVERY_S,
                   checkpoint_blocking_s=CHECKPOINT_BLOCKING_S)

    @classmethod
    def in_memory(cls, *, detect_s: float, inplace_ratio: float, snapshot_every_s: float,
                  snapshot_overhead: float, step_s: float = STEP_S,
                  warm_spares: bool = False, lost_ratio: float | None = None) -> Recovery:
        """Issue 20: snapshots in memory every ``snapshot_every_s``, each costing
        ``snapshot_overhead`` of one step of ``step_s`` (at most every step); healthy machines
        restart in place, and with ``warm_spares`` a lost machine's ranks too, on a spare
        machine's standbys."""
        every = max(snapshot_every_s, step_s)
        return cls(name="in_memory_warm_spares" if warm_spares else "in_memory",
                   detect_s=detect_s, inplace_ratio=inplace_ratio, checkpoint_every_s=every,
                   checkpoint_blocking_s=snapshot_overhead * step_s, warm_spares=warm_spares,
                   lost_ratio=lost_ratio if warm_spares else None)

    def restart_s(self, gpus: int) -> float:
        """Mean seconds from detection to resumed training over the fault mix."""
        full = relaunch_s(gpus)
        if self.inplace_ratio is None:
            return full
        in_place = max(self.inplace_ratio * full, hot_update_s(gpus))
        if self.warm_spares:
            ratio = self.inplace_ratio if self.lost_ratio is None else self.lost_ratio
            lost = max(ratio * full, hot_update_s(gpus))
        else:
            lost = full
        return MACHINE_LOST_SHARE * lost + (1.0 - MACHINE_LOST_SHARE) * in_place


def ettr(gpus: int, recovery: Recovery) -> float:
    """Expected ETTR of a job of ``gpus`` that recovers as ``recovery`` says."""
    rate = failures_per_s(gpus)
    kept = max(0.0, 1.0 - rate * recovery.checkpoint_every_s / 2.0)
    standing = 1.0 + rate * (recovery.detect_s + recovery.restart_s(gpus))
    return kept / standing / (1.0 + recovery.checkpoint_blocking_s / recovery.checkpoint_every_s)


def projection(recoveries, sizes=(9600, 100_000)) -> dict:
    """The table the demo and the benchmarks print: ETTR per size and recovery, with inputs."""
    rows = []
    for gpus in sizes:
        for recovery in recoveries:
            rows.append({"gpus": gpus, "recovery": recovery.name,
                         "failures_per_day": round(failures_per_s(gpus) * 86400.0, 2),
                         "restart_s": round(recovery.restart_s(gpus), 1),
                         "redone_s": round(recovery.checkpoint_every_s / 2.0, 1),
                         "ettr": round(ettr(gpus, recovery), 4)})
    return {"formula": "E[ETTR] = (1 - lambda*dt/2) / (1 + lambda*(d + u0)) / (1 + w/dt)  (Kokolis et al. to "
                       "first order)",
            "sources": ["Llama 3, arXiv 2407.21783 §3.3.4 (failure rate, 78% hardware)",
                        "ByteRobust, arXiv 2509.16293 Tables 7-8 (requeue, hot update, save)",
                        "Kokolis et al., arXiv 2410.21680 (model; u0 5-20 min, hourly dt)"],
            "recoveries": [asdict(r) for r in recoveries], "rows": rows}
