"""Healthy training jobs of shapes the scenario library (tests/scenarios.py) does not make,
from a timing model of their own, for the blind spots of detectors tuned on that library.

:class:`Shape` holds the knobs; :func:`job_events` turns one into SPEC events *in the order
a recorder receives them* (collectors that send in bursts, machines whose clocks disagree),
which is the order ``analyze`` reads a recording in. What differs from tests/scenarios.py:

- step times drawn per step and shared by every rank (lognormal, bimodal packing), drifting
  over the job, with gradient accumulation (many micro-batches) or a collector that shows
  only ``step`` and ``idle`` (no ``tg.phase``);
- whole machines steadily slower from step 0 (heterogeneous hardware);
- clock skew per machine, bursty collectors (events late and out of order), events
  delivered twice (at-least-once), late joiners;
- step numbers that start high or skip (logged every N steps);
- loss curves with warm-up, plateaus and sudden drops, epoch bumps, and fp16 loss scaling
  (a skipped step with an infinite gradient norm, the scale halved; a start-up search from
  a high initial scale);
- pauses: checkpoints, evals of varying length, long ``init``, and undeclared pauses inside
  a step phase.

>>> events = job_events(Shape(name="tiny", world=4, per_node=2, steps=3))
>>> sorted({e.type for e in events}), sum(e.type == "step" for e in events)
(['gpu', 'heartbeat', 'lifecycle', 'step'], 12)
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from trainguard import events as ev

T0 = 1_780_000_000.0


@dataclass(kw_only=True)
class Shape:
    name: str
    job: str = "u"
    world: int = 16
    per_node: int = 8
    tp: int = 1
    pp: int = 1
    steps: int = 120
    step_s: float = 1.0              # median step time
    sigma: float = 0.05              # job-wide lognormal noise per step
    bimodal: tuple = ()              # (probability, factor): a long mode (packing, long docs)
    drift: float = 1.0               # step time at the end / at the start (log-linear)
    drift_tokens: bool = False       # ... with tokens per step growing alike
    micro: int = 1                   # micro-batches per step (gradient accumulation)
    phases: str = "full"             # "full": data/forward/backward/optimizer/collective;
                                     # "plain": only `step` and `idle` (no tg.phase)
    compute_frac: float = 0.85
    rank_sigma: float = 0.03
    slow_nodes: dict = field(default_factory=dict)   # node index -> steady compute factor
    skew_s: float = 0.0              # machine clock offsets, uniform in +-skew_s
    burst_s: float = 0.0             # collectors flush every burst_s (0: at once)
    delay_s: float = 0.0             # extra random delivery delay, up to this
    again: float = 0.0               # share of events delivered a second time (at-least-once)
    again_s: float = 3.0             # ... up to this much later
    join_late_s: float = 0.0         # machines start up to this late
    init_s: float = 8.0              # `init` until the first step begins
    first_step_s: float = 0.0        # extra time of step 0 (compile), in `forward`
    start_step: int = 0
    stride: int = 1                  # step numbers reported (every stride-th step)
    pauses: dict = field(default_factory=dict)   # after step index -> (phase, seconds[,
                                                 # the phase of ranks other than 0])
    loss: str = "decay"              # decay, plateau_drop, epoch_bumps
    epoch_steps: int = 50
    bump: float = 0.06
    loss_noise: float = 0.01
    grad_noise: float = 0.1
    amp: bool = False
    amp_init_power: int = 16         # initial loss scale 2^p ...
    amp_good_power: int = 13         # ... overflowing until it is at most 2^good
    amp_hysteresis: int = 1          # overflows per halving (Megatron: 2)
    amp_growth: int = 40             # steps without overflow before the scale doubles
    grad_bad: str = "inf"            # the gradient norm of a skipped step: inf, nan
    hb_s: float = 1.0
    gpu_s: float = 2.0
    t0: float = T0
    curve_from: int = 0              # a resumed job's curves go on from this step index
    seed: int = 0

    def node_of(self, rank: int) -> int:
        return rank // self.per_node


def job_events(shape: Shape) -> list:
    """The recording of one healthy job, in arrival order."""
    return _Job(shape).play()


class _Job:
    def __init__(self, shape: Shape):
        self.s = shape
        self.rng = random.Random(f"{shape.name}/{shape.seed}")
        nodes = (shape.world + shape.per_node - 1) // shape.per_node
        self.nodes = nodes
        self.skew = [self.rng.uniform(-shape.skew_s, shape.skew_s) for _ in range(nodes)]
        self.join = [self.rng.uniform(0, shape.join_late_s) for _ in range(nodes)]
        self.out = []                  # (true time, order, node or None, event)
        self.timeline = {r: [] for r in range(shape.world)}   # (start, end, phase, step)
        self.seq = 0

    # -- helpers ----------------------------------------------------------------------------
    def emit(self, true_ts, node, make):
        """``make(ts)`` builds the event with the sender's clock (skewed)."""
        self.out.append((true_ts, self.seq, node, make(true_ts + self.skew[node])))
        self.seq += 1

    def span(self, rank, start, end, phase, step):
        if end > start:
            self.timeline[rank].append((start, end, phase, step))

    # -- the job ------------------------------------------------------------------------------
    def play(self) -> list:
        s, rng = self.s, self.rng
        topo = {"tp": s.tp, "pp": s.pp, "dp": s.world // (s.tp * s.pp)}
        starts = {}
        for r in range(s.world):
            node = s.node_of(r)
            at = s.t0 + self.join[node] + 0.002 * (r % s.per_node)
            starts[r] = at
            self.emit(at, node, lambda ts, r=r, node=node: ev.Lifecycle(
                job=s.job, ts=ts, node=f"m{node}", rank=r, event="start", pid=7000 + r,
                world_size=s.world, local_rank=r % s.per_node, topology=topo,
                argv=["train.py"]))
        t = max(starts.values()) + s.init_s
        for r in range(s.world):
            self.span(r, starts[r], t, "init", None)
        rank_factor = [s.slow_nodes.get(s.node_of(r), 1.0) for r in range(s.world)]
        scale, overflows, calm = 2.0 ** s.amp_init_power, 0, 0
        last_reported = None
        for i in range(s.steps):
            frac = i / max(1, s.steps - 1)
            growth = s.drift ** frac
            base = s.step_s * growth * math.exp(rng.gauss(0, s.sigma))
            if s.bimodal and rng.random() < s.bimodal[0]:
                base *= s.bimodal[1]
            tokens = int(4096 * (growth if s.drift_tokens else 1.0))
            extra = s.first_step_s if i == 0 else 0.0
            pause = s.pauses.get(i)
            compute = {r: base * s.compute_frac * rank_factor[r]
                       * math.exp(rng.gauss(0, s.rank_sigma)) for r in range(s.world)}
            comm = base * (1 - s.compute_frac)
            length = max(compute.values()) + comm + extra
            inner = pause if pause and pause[0] in ("step", "optimizer", "forward") else None
            if inner:
                length += inner[1]
            number = s.start_step + i * s.stride
            reported = last_reported
            for r in range(s.world):
                self._step_phases(r, t, length, compute[r] + extra, inner, reported)
            end = t + length
            # the model's numbers
            loss, grad = self._curve(i + s.curve_from)
            skipped = False
            if s.amp:
                if scale > 2.0 ** s.amp_good_power or calm >= s.amp_growth:
                    if calm >= s.amp_growth:
                        calm = 0
                    skipped = True
                    overflows += 1
                    if overflows >= s.amp_hysteresis:
                        scale /= 2.0
                        overflows = 0
                else:
                    calm += 1
                    if calm == s.amp_growth:
                        scale *= 2.0
            for r in range(s.world):
                node = s.node_of(r)
                stamp = end + 0.0005 * r + rng.random() * 0.003
                gn = float(s.grad_bad) if skipped else grad
                rl = loss * math.exp(rng.gauss(0, s.loss_noise))
                self.emit(stamp, node, lambda ts, r=r, node=node, rl=rl, gn=gn: ev.Step(
                    job=s.job, ts=ts, node=f"m{node}", rank=r, step=number,
                    step_time=length, compute_time=compute[r] + extra, loss=rl, grad_norm=gn,
                    loss_scale=scale if s.amp else None, tokens=tokens,
                    lr=3e-4 * min(1.0, (i + s.curve_from + 1) / 30)))
            last_reported = number
            t = end + 0.002                  # the loop's own gap: logging, the next batch
            for r in range(s.world):
                self.span(r, end, t, "idle", number)
            if pause and not inner:
                phase, secs = pause[:2]
                others = pause[2] if len(pause) > 2 else phase   # rank 0 alone, the rest wait
                for r in range(s.world):
                    self.span(r, t, t + secs, phase if r == 0 else others, number)
                t += secs
        for r in range(s.world):
            node = s.node_of(r)
            self.emit(t + 0.5 + 0.01 * r, node, lambda ts, r=r, node=node: ev.Lifecycle(
                job=s.job, ts=ts, node=f"m{node}", rank=r, event="exit", exit_code=0))
        self._heartbeats(starts, t + 0.5)
        self._gpus(s.t0, t + 0.5)
        return self._deliver()

    def _step_phases(self, r, t, length, work, inner, last_step):
        s = self.s
        if s.phases == "plain":
            self.span(r, t, t + length, "step", last_step)
            return
        cur = t
        per = work / s.micro
        for _ in range(s.micro):
            for name, share in (("data", 0.05), ("forward", 0.35), ("backward", 0.6)):
                self.span(r, cur, cur + per * share, name, last_step)
                cur += per * share
        if inner:
            self.span(r, cur, cur + inner[1], inner[0] if inner[0] != "step" else "optimizer",
                      last_step)
            cur += inner[1]
        opt = min(0.02 * length, max(0.0, t + length - cur))
        self.span(r, cur, cur + opt, "optimizer", last_step)
        self.span(r, cur + opt, t + length, "collective", last_step)

    def _curve(self, i):
        s, rng = self.s, self.rng
        if s.loss == "plateau_drop":
            half = s.steps // 2
            loss = 3.0 if i < half else 3.0 - 0.5 * min(1.0, (i - half) / 8)
            loss += 4.0 * math.exp(-i / 10)
        else:
            loss = 2.0 + 7.0 * math.exp(-i / 40)
        if s.loss == "epoch_bumps" and i >= s.epoch_steps:
            k = i % s.epoch_steps
            if k < 3:
                loss *= 1 + s.bump * (1.0, 0.5, 0.2)[k]
        grad = (1.0 + 6.0 * math.exp(-i / 12)) * math.exp(rng.gauss(0, s.grad_noise))
        return loss, grad

    # -- telemetry ----------------------------------------------------------------------------
    def _heartbeats(self, starts, stop):
        s, rng = self.s, self.rng
        for r in range(s.world):
            node = s.node_of(r)
            spans = sorted(self.timeline[r])
            j = 0
            hb = starts[r] + rng.uniform(0.05, s.hb_s)
            while hb < stop:
                while j + 1 < len(spans) and spans[j + 1][0] <= hb:
                    j += 1
                start, _, phase, step = spans[j]
                self.emit(hb, node, lambda ts, r=r, node=node, phase=phase, start=start,
                          step=step: ev.Heartbeat(
                              job=s.job, ts=ts, node=f"m{node}", rank=r, pid=7000 + r,
                              step=step, phase=phase, phase_since=start + self.skew[node],
                              dropped=0))
                hb += s.hb_s * rng.uniform(0.9, 1.1)

    def _gpus(self, start, stop):
        s = self.s
        for node in range(self.nodes):
            g = start + self.join[node] + 0.3
            gpus = [{"index": i, "uuid": f"GPU-m{node}-{i}", "util": 95.0, "temp": 60.0,
                     "power": 550.0, "sm_clock": 1980, "throttle": [], "ecc_sbe": 0,
                     "ecc_dbe": 0, "pcie_replay": 0, "nvlink_errors": 0}
                    for i in range(min(s.per_node, s.world - node * s.per_node))]
            while g < stop:
                self.emit(g, node, lambda ts, node=node: ev.Gpu(
                    job=s.job, ts=ts, node=f"m{node}", gpus=gpus))
                g += s.gpu_s

    def _deliver(self) -> list:
        """Arrival order: a collector flushes its queue every ``burst_s`` (per machine, at its
        own phase), plus a random delay; each machine's events stay in their own order."""
        s, rng = self.s, self.rng
        phase = [rng.uniform(0, s.burst_s) for _ in range(self.nodes)]
        arrivals = []
        last = [0.0] * self.nodes
        for true_ts, seq, node, event in sorted(self.out, key=lambda x: (x[0], x[1])):
            at = true_ts
            if s.burst_s:
                at = phase[node] + math.ceil((true_ts - phase[node]) / s.burst_s) * s.burst_s
            if s.delay_s:
                at += rng.uniform(0, s.delay_s)
            at = max(at, last[node])             # one producer per machine keeps order
            last[node] = at
            arrivals.append((at, true_ts, seq, event))
            if s.again and rng.random() < s.again:  # a retry: the same event once more
                arrivals.append((at + rng.uniform(0, s.again_s), true_ts, seq, event))
        arrivals.sort(key=lambda x: x[:3])
        return [x[3] for x in arrivals]
