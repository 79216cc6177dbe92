"""A scenario library: synthetic recordings of training jobs of many shapes, with the truth.

:class:`Scenario` holds the knobs (durations, topology, noise, restarts, faults);
:func:`generate` turns one into SPEC events in event time (``events``) and what a perfect
detector reports (``truth``: one :class:`Truth` per fault, several per recording allowed).
The library itself, ``HEALTHY`` (every shape a healthy job takes: step times from 0.05 s to
10 minutes, long first steps, long checkpoints and evals, user phases, periodic slow steps,
data-loader stalls, pipeline stages of steady different speeds, MoE noise, resumes with
earlier step numbers and new pids, trainguard's own restarts) and ``FAULTS`` (every kind,
intermittent and gradual onsets, faults during checkpoints, stragglers inside one pipeline
stage, spikes led by the gradient norm, several faults per recording), is in
tests/scenario_library.py.

Ranks are laid out as Megatron-LM does: TP fastest, then DP, then PP; machines hold
``per_node`` consecutive ranks; the rank on GPU ``g`` of a machine is its ``g``-th rank.

>>> events, truth = generate(Scenario(name="tiny", dp=4, steps=5, checkpoint_every=0))
>>> sorted({e.type for e in events}), truth
(['gpu', 'heartbeat', 'lifecycle', 'step'], [])
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from trainguard import events as ev

import machine_faults

T0 = 1764680000.0
STEP_PHASES = (("data", 0.05), ("forward", 0.35), ("backward", 0.40), ("optimizer", 0.05),
               ("collective", 0.15))
#: the longest a launch's starts, or a tear-down's exits, spread over (a job of thousands)
SPREAD_S = 2.0
#: ... and the ranks' ends of one step (they leave its last collective together)
STEP_SPREAD_S = 0.1
#: fault kinds whose truth is a stop of the job (what follows is a tail, or a restart)
TERMINAL = ("hang", "crash", "kill", "silent", "machine", "xid79", "hang_in_checkpoint")


@dataclass(kw_only=True)
class Fault:
    kind: str                 # straggler, network, nan, nan_grad, spike, grad_led_spike,
                              # dbe, throttle, + the TERMINAL ones, + machine_faults.KINDS
    step: int                 # step at which it begins
    ranks: tuple = ()
    factor: float = 2.0       # straggler / network slowdown, spike height
    end: int | None = None    # straggler / network: first step after it
    fraction: float = 1.0     # straggler: share of its steps that are slow (intermittent)
    ramp: int = 0             # straggler: steps over which the slowdown grows (gradual)
    node: str = ""            # machine / dbe / throttle / xid79
    gpu: int = 0
    signal: str | None = None  # crash
    exit_code: int | None = 1
    restart_after_s: float | None = None   # trainguard restarts the job this long after


@dataclass(kw_only=True)
class Truth:
    kind: str                 # the incident kind expected (spikes: "spike")
    ranks: list               # exact suspects ([] for job-wide)
    nodes: list
    onset_ts: float
    step: int | None
    limit_s: float            # the latency target for this fault, in seconds
    limit_steps: int | None = None   # ... or in steps (straggler, spike, nan)
    label: str = ""


@dataclass(kw_only=True)
class Scenario:
    name: str
    job: str = "j"
    tp: int = 1
    pp: int = 1
    dp: int = 8
    per_node: int = 4
    steps: int = 200
    step_time: float = 0.5
    first_step_s: float = 5.0          # init + compile before the first step ends
    compute_frac: float = 0.8
    noise: float = 0.02                # job-wide step-time noise
    rank_noise: float = 0.02           # per-rank compute noise
    moe_noise: float = 0.0             # heavy-tailed per-rank noise (expert imbalance)
    stage_factors: tuple = ()          # steady compute factor per pipeline stage
    rank_factors: dict = field(default_factory=dict)   # steady per-rank factors
    checkpoint_every: int = 100
    checkpoint_s: float = 20.0
    checkpoint_rank0_only: bool = False  # only rank 0 in `checkpoint`, the rest wait
    eval_every: int = 0
    eval_s: float = 30.0
    user_phase: str = ""               # a user-declared pause (e.g. "reshard") ...
    user_phase_every: int = 0
    user_phase_s: float = 60.0
    slow_every: int = 0                # periodic job-wide slow steps (GC, logging)
    slow_factor: float = 3.0
    stall_every: int = 0               # data-loader stalls: a few steps slower
    stall_steps: int = 3
    stall_factor: float = 2.0
    resume_at: tuple = ()              # healthy resumes: (step, gap_s, own) ...: at `step`
                                       # the job stops (own: trainguard's restart, else a
                                       # clean exit) and resumes from its last checkpoint
    hb_s: float = 5.0                  # (the RankStage forwards one in 5 s anyway)
    gpu_s: float = 5.0
    gpu_noise: float = 0.0             # > 0: counters vary, with host ones (machine_faults.py)
    gpu_bins: dict = field(default_factory=dict)   # node -> steady clock/power factor
    tail_s: float = 0.0                # telemetry after the last step (before exits)
    clock_offsets: dict = field(default_factory=dict)   # node -> its clock's offset, seconds
    loss_noise: float = 0.01
    grad_noise: float = 0.08
    faults: tuple = ()
    seed: int = 0
    report_every: int = 1              # the collectors' report_every: values (loss, grad norm,
                                       # lr) on every n-th step only, timings, tokens on all

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def node_of(self, rank: int) -> str:
        return f"n{rank // self.per_node + 1}"

    def stage_of(self, rank: int) -> int:
        return rank // (self.tp * self.dp)

    def rank_on(self, node: str, gpu: int) -> int:
        return (int(node[1:]) - 1) * self.per_node + gpu


def generate(sc: Scenario):
    """``(events, truth)`` of one scenario; events sorted by time."""
    return _Run(sc).run()


def _skewed(e, offset: float):
    """``e`` stamped by a clock ``offset`` seconds off (its phase start too)."""
    if e.TYPE == "heartbeat":
        return e.replace(ts=e.ts + offset, phase_since=e.phase_since + offset)
    return e.replace(ts=e.ts + offset)


def recording(sc: Scenario) -> dict:
    """``{"events", "truth", "step_ends", "p99_step_s"}``: :func:`generate` and the end time
    of every step played (for latencies in steps) and the job's p99 step interval."""
    run = _Run(sc)
    events, truth = run.run()
    return {"events": events, "truth": truth, "step_ends": run.step_ends,
            "p99_step_s": run._p99()}


class _Run:
    def __init__(self, sc: Scenario):
        self.sc = sc
        self.rng = random.Random(sc.seed)
        self.counters = machine_faults.MachineCounters(random.Random(sc.seed + 7919))
        self.out = []
        self.truth = []
        self.seq = 0
        self.t = T0
        self.incarnation = 0
        self.segments = []       # (start, end, phase by rank: dict or str, step done)
        self.step_ends = []      # every step's end time, in order (latency in steps)
        self.down = []           # [rank, from_ts, to_ts or None]: no heartbeats meanwhile
        self.down_of = {}        # rank -> its rows of self.down
        self.gpus_down = []      # [node, gpu or None (the machine), from_ts, to_ts or None]
        self.grad_base = 1.0

    def emit(self, e):
        offset = self.sc.clock_offsets.get(e.node) if self.sc.clock_offsets else None
        sent = e if not offset else _skewed(e, offset)
        self.out.append((e.ts, self.seq, sent))     # arrives in true time, stamped skewed
        self.seq += 1

    # -- the timeline -------------------------------------------------------------------------
    def run(self):
        sc = self.sc
        faults = sorted(sc.faults, key=lambda f: f.step)
        resumes = {s: (gap, own) for s, gap, own in sc.resume_at}
        step, last_ckpt = 0, 0
        self._start()
        while step < sc.steps:
            terminal = next((f for f in faults if f.kind in TERMINAL and f.step == step), None)
            if terminal is not None:
                faults = [f for f in faults if f is not terminal]
                restart = self._terminal(terminal, step)
                if restart is None:
                    break
                self._restart(restart, own=True)
                step = last_ckpt + 1
                continue
            if step in resumes:
                gap, own = resumes.pop(step)
                self._stop_for_resume(own)
                self._restart(self.t + gap, own=own)
                step = last_ckpt + 1
                continue
            self._step(step, faults)
            if sc.checkpoint_every and step > 0 and step % sc.checkpoint_every == 0:
                self._pause("checkpoint", sc.checkpoint_s, step,
                            only=[0] if sc.checkpoint_rank0_only else None)
                last_ckpt = step
            if sc.eval_every and step > 0 and step % sc.eval_every == 0:
                self._pause("eval", sc.eval_s, step)
            if sc.user_phase_every and step > 0 and step % sc.user_phase_every == 0:
                self._pause(sc.user_phase, sc.user_phase_s, step)
            step += 1
        else:
            self.t += sc.tail_s
            for r in range(sc.world):
                self._life(r, self.t + 0.3, "exit", exit_code=0)
                self._mark_down(r, self.t + 0.3)
        self.end = self.t + 0.2
        self._telemetry()
        self.out.sort(key=lambda x: (x[0], x[1]))
        return [e for _, _, e in self.out], self.truth

    def _start(self):
        sc = self.sc
        for row in self.down + self.gpus_down:
            if row[-1] is None:
                row[-1] = self.t
        for r in range(sc.world):
            self._life(r, self.t + self._gap(0.01) * r, "start")
        self.segments.append((self.t, self.t + sc.first_step_s * 0.8, "init", None))
        self.t += sc.first_step_s * 0.8
        self.first_step = True

    def _restart(self, at, own):
        sc = self.sc
        if own:                   # the supervisor relaunches: the launcher's own events
            self.emit(ev.Lifecycle(job=sc.job, ts=at - 0.5, node="n1", rank=None,
                                   event="start", pid=50000 + self.incarnation,
                                   world_size=sc.world,
                                   extra={"source": "supervisor",
                                          "incarnation": self.incarnation + 1}))
        self.incarnation += 1
        self.t = at
        self._start()

    def _stop_for_resume(self, own):
        sc = self.sc
        at = self.t + 1.0
        if own:
            self._own_teardown(at)
        else:
            for r in range(sc.world):
                self._life(r, at + self._gap(0.01) * r, "exit", exit_code=0)
                self._mark_down(r, at)
        self.segments.append((self.t, at + 1.0, "gone", None))
        self.t = at + 1.0

    def _own_teardown(self, at):
        """trainguard run restarting the job: it says so, then SIGTERMs every rank."""
        sc = self.sc
        self.emit(ev.Lifecycle(job=sc.job, ts=at - 0.05, node="n1", rank=None, event="exit",
                               exit_code=None, signal=None,
                               extra={"source": "supervisor", "incarnation": self.incarnation,
                                      "restart": True}))
        for r in range(sc.world):
            if self._is_down(r, at):
                continue
            self._life(r, at + self._gap(0.02) * r, "exit", exit_code=None, signal="SIGTERM")
            self._mark_down(r, at + self._gap(0.02) * r)

    def _gap(self, gap: float) -> float:
        """The time between two ranks' starts or exits: ``gap``, or less in a job so large
        that its starts or exits would spread over more than ``SPREAD_S``."""
        return min(gap, SPREAD_S / self.sc.world)

    def _mark_down(self, rank, at):
        rows = self.down_of.setdefault(rank, [])
        if not any(row[2] is None for row in rows):
            rows.append([rank, at, None])
            self.down.append(rows[-1])

    def _is_down(self, rank, ts):
        return any(row[1] <= ts and (row[2] is None or ts < row[2])
                   for row in self.down_of.get(rank, ()))

    def _gpu_is_down(self, node, gpu, ts):
        return any(row[0] == node and row[1] in (None, gpu) and row[2] <= ts
                   and (row[3] is None or ts < row[3]) for row in self.gpus_down)

    def _life(self, rank, ts, event, **kw):
        sc = self.sc
        if event == "start":
            kw.update(pid=1000 + 100 * self.incarnation + rank, world_size=sc.world,
                      local_rank=rank % sc.per_node,
                      topology={"tp": sc.tp, "pp": sc.pp, "dp": sc.dp})
        self.emit(ev.Lifecycle(job=sc.job, ts=ts, node=sc.node_of(rank), rank=rank,
                               event=event, **kw))

    def _pause(self, phase, seconds, step, only=None):
        by_rank = {r: (phase if only is None or r in only else "collective")
                   for r in range(self.sc.world)}
        self.segments.append((self.t, self.t + seconds, by_rank, step))
        self.t += seconds

    # -- one step ---------------------------------------------------------------------------
    def _step(self, s, faults):
        sc, rng = self.sc, self.rng
        if self.first_step:
            base = sc.first_step_s * 0.2
            self.first_step = False
        else:
            base = sc.step_time * math.exp(rng.gauss(0, sc.noise))
        if sc.slow_every and s > 0 and s % sc.slow_every == 0:
            base *= sc.slow_factor
        if sc.stall_every and s > 0 and s % sc.stall_every < sc.stall_steps:
            base *= sc.stall_factor
        network = 1.0
        for f in faults:
            if f.kind == "network" and f.step <= s < (f.end or 1 << 60):
                network = f.factor
        compute = {}
        for r in range(sc.world):
            c = base * sc.compute_frac * math.exp(rng.gauss(0, sc.rank_noise))
            if sc.moe_noise:
                c *= math.exp(abs(rng.gauss(0, sc.moe_noise)))
            if sc.stage_factors:
                c *= sc.stage_factors[sc.stage_of(r)]
            c *= sc.rank_factors.get(r, 1.0)
            for f in faults:
                if f.kind == "straggler" and r in f.ranks and f.step <= s < (f.end or 1 << 60):
                    grow = min(1.0, (s - f.step + 1) / f.ramp) if f.ramp else 1.0
                    if f.fraction >= 1.0 or rng.random() < f.fraction:
                        c *= 1.0 + (f.factor - 1.0) * grow
            compute[r] = c
        duration = max(compute.values()) + base * (1 - sc.compute_frac) * network
        start, end = self.t, self.t + duration
        self.segments.append((start, end, "step", s - 1))
        self.step_ends.append(end)
        self.t = end
        progress = math.exp(-s / 80.0)
        loss_job = 2.0 + 6.0 * progress
        grad_job = self.grad_base * math.exp(rng.gauss(0, sc.grad_noise))
        nan_ranks, nan_grad = set(), False
        for f in faults:
            if f.kind == "spike" and s == f.step:
                loss_job *= f.factor
            if f.kind == "grad_led_spike" and f.step <= s < f.step + 8:
                k = s - f.step                     # the norm grows 4x a step, then the loss
                grad_job *= 4.0 ** min(k + 1, 4)
                if k >= 3:
                    loss_job *= f.factor
            if f.kind == "nan" and s >= f.step:
                nan_ranks.update(f.ranks if s == f.step else range(sc.world))
            if f.kind == "nan_grad" and f.step <= s < f.step + 3:
                nan_grad = True
        step_gap = min(0.001, STEP_SPREAD_S / sc.world)
        for r in range(sc.world):
            loss = loss_job * math.exp(rng.gauss(0, sc.loss_noise))
            grad = grad_job
            if r in nan_ranks:
                loss = float("nan")
            if nan_ranks or nan_grad:
                grad = float("nan")
            values = {"loss": loss, "grad_norm": grad, "tokens": 4096, "lr": 3e-4} \
                if s % sc.report_every == 0 else {"tokens": 4096}
            self.emit(ev.Step(job=sc.job, ts=end + step_gap * r + rng.random() * 0.002,
                              node=sc.node_of(r), rank=r, step=s, step_time=duration,
                              compute_time=compute[r], **values))
        self._fault_truths(s, faults, start, end)

    def _fault_truths(self, s, faults, start, end):
        sc = self.sc
        for f in faults:
            if f.step != s:
                continue
            nodes_of = lambda ranks: _whole_nodes(sc, ranks)   # noqa: E731
            if f.kind == "straggler":
                self._truth("straggler", f.ranks, nodes_of(f.ranks), start, s, 1e9, 30 + f.ramp,
                            f"straggler x{f.factor} frac {f.fraction} ramp {f.ramp}")
            elif f.kind == "network":
                self._truth("throughput_drop", [], [], start, s, 1e9, 60, "network")
            elif f.kind == "nan":
                self._truth("nan", f.ranks, [], end, s, 1e9, 1, "nan loss")
            elif f.kind == "nan_grad":
                self._truth("nan", [], [], end, s, 1e9, 1, "nan grad")
            elif f.kind == "spike":
                self._truth("spike", [], [], end, s, 1e9, 2, f"loss spike x{f.factor}")
            elif f.kind == "grad_led_spike":
                # the norm is 16x its baseline at the second step: an order of magnitude
                self.pending_grad = (s + 1, f)
            elif f.kind in machine_faults.KINDS:
                self._truth("machine_outlier", [], [f.node], end, s, 120.0, None, f.kind)
                self.gpu_faults = getattr(self, "gpu_faults", []) + [(f, end, self.truth[-1])]
            elif f.kind in ("dbe", "throttle"):
                rank = sc.rank_on(f.node, f.gpu)
                kind = "gpu_fault" if f.kind == "dbe" else "gpu_degraded"
                self._truth(kind, [rank], [f.node], end, s,
                            2.0 if f.kind == "dbe" else 120.0, None, f.kind)
                # onset: the first GPU sample that carries it (set in _telemetry)
                self.gpu_faults = getattr(self, "gpu_faults", []) + [(f, end, self.truth[-1])]
        pending = getattr(self, "pending_grad", None)
        if pending and pending[0] == s:
            # within two steps of the rise's start (issue 19): the norm must be caught
            # before the loss moves (two steps later), not with it
            self._truth("spike", [], [], end, s, 1e9, 1, "grad-led spike")
            self.pending_grad = None

    def _truth(self, kind, ranks, nodes, onset, step, limit_s, limit_steps, label):
        self.truth.append(Truth(kind=kind, ranks=sorted(ranks), nodes=sorted(nodes),
                                onset_ts=onset, step=step, limit_s=limit_s,
                                limit_steps=limit_steps, label=label))

    # -- the stops --------------------------------------------------------------------------
    def _terminal(self, f, step):
        """Play a stopping fault at ``step``; returns when trainguard restarts, or None."""
        sc = self.sc
        t = self.t
        p99 = self._p99()
        hang_limit = max(30.0, 3.0 * p99)
        tail = max(120.0, 4.0 * p99)
        after = None if f.restart_after_s is None else t + f.restart_after_s
        stop_at = after if after is not None else t + tail
        last = step - 1
        if f.kind in ("hang", "hang_in_checkpoint"):
            rank = f.ranks[0]
            phase = "data" if f.kind == "hang" else "checkpoint"
            if f.kind == "hang_in_checkpoint":
                # every rank checkpoints; one never comes out, the others wait for it
                longest = sc.checkpoint_s
                limit = max(1800.0, 3.0 * longest) + 30.0
                by_rank = {r: ("checkpoint" if r == rank else "collective")
                           for r in range(sc.world)}
                self.segments.append((t, stop_at, by_rank, last, {r: t for r in range(sc.world)}))
                self._truth("hang", [rank], _whole_nodes(sc, [rank]), t, last, limit, None,
                            "hang in checkpoint")
                stop_at = max(stop_at, t + limit + 30) if after is None else stop_at
                self.segments[-1] = (t, stop_at, by_rank, last, {r: t for r in range(sc.world)})
            else:
                by_rank = {r: (phase if r == rank else "collective") for r in range(sc.world)}
                self.segments.append((t, stop_at, by_rank, last, {r: t for r in range(sc.world)}))
                self._truth("hang", [rank], _whole_nodes(sc, [rank]), t, last, hang_limit,
                            None, "hang")
        elif f.kind == "crash":
            rank = f.ranks[0]
            self._life(rank, t + 0.5, "exit", exit_code=f.exit_code, signal=f.signal)
            self._mark_down(rank, t + 0.5)
            for i, r in enumerate(x for x in range(sc.world) if x != rank):
                self._life(r, t + 2.0 + self._gap(0.01) * i, "exit", signal="SIGTERM")
                self._mark_down(r, t + 2.0)
            self._truth("crash", [rank], [], t + 0.5, last, 2.0, None, "crash")
            stop_at = t + 3.0 if after is None else after
        elif f.kind == "kill":
            rank = f.ranks[0]
            self._mark_down(rank, t)
            for i, r in enumerate(x for x in range(sc.world) if x != rank):
                self._life(r, t + 1.0 + self._gap(0.01) * i, "exit", signal="SIGTERM")
                self._mark_down(r, t + 1.0)
            # no exit event: named once the tear-down's grace is over
            self._truth("crash", [rank], [], t, last, 2.0 + 3.0 + 1.0, None, "kill")
            stop_at = t + 5.0 if after is None else after
        elif f.kind in ("silent", "machine", "xid79"):
            if f.kind == "machine":
                ranks = [r for r in range(sc.world) if sc.node_of(r) == f.node]
            elif f.kind == "xid79":
                ranks = [sc.rank_on(f.node, f.gpu)]
            else:
                ranks = list(f.ranks)
            for r in ranks:
                self._mark_down(r, t)
            if f.kind == "machine":
                self.gpus_down.append([f.node, None, t, None])
            elif f.kind == "xid79":
                self.gpus_down.append([f.node, f.gpu, t, None])
            by_rank = {r: "collective" for r in range(sc.world)}
            self.segments.append((t, stop_at, by_rank, last, {r: t for r in range(sc.world)}))
            if f.kind == "xid79":
                self.emit(ev.Xid(job=sc.job, ts=t + 0.1, node=f.node, gpu=f.gpu, xid=79,
                                 source="kmsg", message="NVRM: Xid (PCI:0000:3b:00): 79, "
                                 "GPU has fallen off the bus."))
                self._truth("gpu_fault", ranks, [f.node], t + 0.1, last, 2.0, None, "xid79")
            elif f.kind == "machine":
                self._truth("silent", ranks, [f.node], t, last, 30.0, None, "machine down")
            else:
                self._truth("silent", ranks, [], t, last, 30.0, None, "rank silent")
        self.t = stop_at
        if after is not None:
            self._own_teardown(stop_at)
            return stop_at + 5.0
        return None                    # the recording ends with the stalled job

    def _p99(self):
        ends = self.step_ends[1:]
        if len(ends) < 2:
            return self.sc.step_time
        gaps = sorted(b - a for a, b in zip(ends, ends[1:]))
        return gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]

    # -- heartbeats and GPU samples -------------------------------------------------------
    def _telemetry(self):
        sc = self.sc
        segs = sorted(self.segments, key=lambda x: x[0])
        for r in range(sc.world):
            ts = T0 + 0.5 + self._gap(0.013) * r
            i = 0
            while ts < self.end:
                if not self._is_down(r, ts):
                    while i + 1 < len(segs) and segs[i + 1][0] <= ts:
                        i += 1
                    phase, since, step = self._phase(segs[i], r, ts)
                    if step is not None and step < 0:
                        step = None           # before any step is done, as a collector sends
                    if phase is not None:
                        self.emit(ev.Heartbeat(job=sc.job, ts=ts, node=sc.node_of(r), rank=r,
                                               pid=1000 + r, step=step, phase=phase,
                                               phase_since=since, dropped=0))
                ts += sc.hb_s
        nodes = sorted({sc.node_of(r) for r in range(sc.world)})
        g = T0 + 0.3
        sbe = {}
        faults = getattr(self, "gpu_faults", [])
        while g < self.end:
            for node in nodes:
                if self._gpu_is_down(node, None, g):
                    continue
                entries = []
                for i in range(sc.per_node):
                    if sc.rank_on(node, i) >= sc.world:
                        break
                    if self._gpu_is_down(node, i, g):
                        continue
                    dbe, hot, active = 0, False, set()
                    for f, at, truth in faults:
                        if f.kind in machine_faults.KINDS and f.node == node and g >= at:
                            if truth.onset_ts == at:
                                truth.onset_ts = g
                            active.add(f.kind)
                        elif (f.node, f.gpu) == (node, i) and g >= at:
                            if truth.onset_ts == at:
                                truth.onset_ts = g
                            dbe += f.kind == "dbe"
                            hot = hot or f.kind == "throttle"
                    sbe[(node, i)] = sbe.get((node, i), 0) + (self.rng.random() < 0.005)
                    entries.append({"index": i, "uuid": f"GPU-{node}-{i}", "util": 97.0,
                                    "temp": 88.0 if hot else 62.0, "power": 600.0,
                                    "sm_clock": 1500 if hot else 1980,
                                    "throttle": ["hw_thermal"] if hot else [],
                                    "ecc_sbe": sbe[(node, i)], "ecc_dbe": dbe,
                                    "pcie_replay": 0, "nvlink_errors": 0})
                    if sc.gpu_noise:
                        entries[-1] = self.counters.entry(sc, node, i, entries[-1], active)
                host = self.counters.host_of(sc, node, g, active) if sc.gpu_noise else None
                self.emit(ev.Gpu(job=sc.job, ts=g, node=node, gpus=entries, host=host))
            g += sc.gpu_s

    def _phase(self, seg, r, ts):
        start, end, what, step = seg[0], seg[1], seg[2], seg[3]
        if what == "gone":
            return None, None, None
        if what == "init":
            return "init", start, None
        if type(what) is dict:
            since = seg[4][r] if len(seg) > 4 else start
            return what[r], since, step
        frac = (ts - start) / (end - start) if end > start else 0.0
        acc = 0.0
        for name, share in STEP_PHASES:
            if frac < acc + share:
                return name, start + acc * (end - start), step
            acc += share
        return "collective", start, step


def _whole_nodes(sc, ranks):
    chosen = set(ranks)
    on: dict = {}
    for r in range(sc.world):
        on.setdefault(sc.node_of(r), []).append(r)
    return [node for node in sorted(on) if all(r in chosen for r in on[node])]
