"""Synthetic telemetry of a training job, healthy or with one injected fault, for detector tests.

``JobSim`` lays out a timeline (init, steps, checkpoints, evals, periodic job-wide slow steps)
and emits what trainguard would receive: lifecycle starts, a ``step`` per rank per step, a
``heartbeat`` per rank about every second (also during checkpoints and while stuck), a ``gpu``
sample per machine about every second. Fault methods change what happens from a given step.
All randomness comes from ``seed``; events come back sorted by time.

>>> sim = JobSim(ranks=4, nodes=1, steps=5, checkpoint_every=0)
>>> events = sim.events()
>>> sorted({e.type for e in events})
['gpu', 'heartbeat', 'lifecycle', 'step']
>>> sum(e.type == "step" for e in events)
20
"""
from __future__ import annotations

import bisect
import math
import random

from trainguard import events as ev
from trainguard.detectors.checks import drive, stage_items  # noqa: F401 (tests use them here)

T0 = 1764680000.0
PHASES = (("data", 0.05), ("forward", 0.35), ("backward", 0.40), ("optimizer", 0.05),
          ("collective", 0.15))


class JobSim:
    def __init__(self, *, job="j1", ranks=8, nodes=2, steps=300, step_time=0.5,
                 compute_frac=0.8, noise=0.02, seed=0, t0=T0, init_s=5.0,
                 checkpoint_every=100, checkpoint_s=25.0, eval_every=0, eval_s=10.0,
                 slow_every=0, slow_factor=3.0, heartbeat_s=1.0, gpu_s=1.0, gpus=True,
                 tail_s=60.0, finish=True, loss_scale=None, compute_time=True):
        self.job = job
        self.ranks = ranks
        self.nodes = nodes
        self.steps = steps
        self.step_time = step_time
        self.compute_frac = compute_frac
        self.noise = noise
        self.seed = seed
        self.t0 = t0
        self.init_s = init_s
        self.checkpoint_every = checkpoint_every
        self.checkpoint_s = checkpoint_s
        self.eval_every = eval_every
        self.eval_s = eval_s
        self.slow_every = slow_every
        self.slow_factor = slow_factor
        self.heartbeat_s = heartbeat_s
        self.gpu_s = gpu_s
        self.gpus = gpus
        self.tail_s = tail_s
        self.finish = finish
        self.loss_scale = loss_scale
        self.compute_time = compute_time
        self.per_node = math.ceil(ranks / nodes)
        self._slow: list = []          # (ranks, factor, start, end)
        self._network: list = []       # (factor, start)
        self._nan_loss: dict = {}      # rank -> step
        self._nan_grad: list = []      # (start, count)
        self._spikes: dict = {}        # step -> factor
        self._grad_spikes: dict = {}   # step -> factor
        self._stop = None              # (step, how, detail)
        self._dbe: list = []           # (node, gpu, step)
        self._throttle: list = []      # (node, gpu, step)
        self._xids: list = []          # (node, gpu, xid, step)

    # -- topology -------------------------------------------------------------------------
    def node_of(self, rank: int) -> str:
        return f"n{rank // self.per_node + 1}"

    def ranks_of(self, node: str) -> list:
        return [r for r in range(self.ranks) if self.node_of(r) == node]

    def rank_on(self, node: str, gpu: int) -> int:
        return self.ranks_of(node)[gpu]

    # -- faults ---------------------------------------------------------------------------
    def straggle(self, ranks, factor, start, end=None):
        self._slow.append((set(ranks), factor, start, end if end is not None else 1 << 60))
        return self

    def network(self, factor, start):
        self._network.append((factor, start))
        return self

    def nan_loss(self, rank, step):
        self._nan_loss[rank] = step
        return self

    def nan_grad(self, step, count=1):
        self._nan_grad.append((step, count))
        return self

    def spike(self, step, factor):
        self._spikes[step] = factor
        return self

    def grad_spike(self, step, factor):
        self._grad_spikes[step] = factor
        return self

    def crash(self, rank, step, exit_code=1, signal=None, teardown_s=None):
        """``rank`` exits at ``step``; with ``teardown_s`` the launcher then stops the other
        ranks by SIGTERM that much later (else they hang in the collective)."""
        self._stop = (step, "crash", {"rank": rank, "exit_code": exit_code, "signal": signal,
                                      "teardown_s": teardown_s})
        return self

    def kill(self, rank, step, teardown_s=0.5, signal="SIGTERM"):
        """``rank`` is SIGKILLed (or OOM-killed) at ``step``: it sends no exit event; the
        launcher stops the other ranks by ``signal`` ``teardown_s`` later (``"gloo"``: they
        fail with code 1 first, their collective broken)."""
        self._stop = (step, "kill", {"rank": rank, "teardown_s": teardown_s, "signal": signal})
        return self

    def stop(self, step, signal="SIGTERM", spread_s=0.3):
        """The whole job is stopped from outside at ``step`` (a restart, a preemption,
        Ctrl-C): every rank exits by ``signal`` within ``spread_s``."""
        self._stop = (step, "stop", {"signal": signal, "spread_s": spread_s})
        return self

    def hang(self, rank, step, phase="data"):
        self._stop = (step, "hang", {"rank": rank, "phase": phase})
        return self

    def rank_silent(self, rank, step):
        self._stop = (step, "silent", {"ranks": [rank], "node": None})
        return self

    def machine_down(self, node, step):
        self._stop = (step, "silent", {"ranks": self.ranks_of(node), "node": node})
        return self

    def xid(self, node, gpu, xid, step):
        """An Xid at the start of ``step``; 79 also takes the GPU and its rank away."""
        self._xids.append((node, gpu, xid, step))
        if xid == 79:
            self._stop = (step, "silent", {"ranks": [self.rank_on(node, gpu)], "node": None,
                                           "gpu": (node, gpu)})
        return self

    def ecc_dbe(self, node, gpu, step):
        self._dbe.append((node, gpu, step))
        return self

    def throttle(self, node, gpu, step):
        self._throttle.append((node, gpu, step))
        return self

    # -- generation -----------------------------------------------------------------------
    def step_of_ts(self, ts: float) -> int | None:
        """The last step that ended at or before ``ts`` (after :meth:`events`)."""
        i = bisect.bisect_right(self.step_end_ts, ts) - 1
        return i if i >= 0 else None

    def events(self) -> list:
        rng = random.Random(self.seed)
        out = []
        seq = 0

        def emit(e):
            nonlocal seq
            out.append((e.ts, seq, e))
            seq += 1

        for r in range(self.ranks):
            emit(ev.Lifecycle(job=self.job, ts=self.t0 + 0.01 * r, node=self.node_of(r), rank=r,
                              event="start", pid=1000 + r, world_size=self.ranks,
                              local_rank=r % self.per_node,
                              topology={"tp": 1, "pp": 1, "dp": self.ranks}))
        segments = [(self.t0, self.t0 + self.init_s, "init", None)]
        t = self.t0 + self.init_s
        stop_step = self._stop[0] if self._stop else None
        self.step_end_ts = []
        last_step = self.steps - 1 if stop_step is None else stop_step - 1
        for s in range(last_step + 1):
            base = self.step_time * (1 + rng.gauss(0, self.noise))
            if self.slow_every and s % self.slow_every == 0 and s > 0:
                base *= self.slow_factor
            network = 1.0
            for factor, start in self._network:
                if s >= start:
                    network = factor
            compute = {}
            for r in range(self.ranks):
                c = base * self.compute_frac * (1 + rng.gauss(0, self.noise))
                for ranks, factor, start, end in self._slow:
                    if r in ranks and start <= s < end:
                        c *= factor
                compute[r] = c
            duration = max(compute.values()) + base * (1 - self.compute_frac) * network
            segments.append((t, t + duration, "step", s))
            t_end = t + duration
            self.step_end_ts.append(t_end)
            progress = math.exp(-s / 60.0)
            for r in range(self.ranks):
                loss = 2.0 + 8.0 * progress + rng.gauss(0, 0.02)
                if s in self._spikes:
                    loss *= self._spikes[s]
                grad = 1.0 * math.exp(rng.gauss(0, 0.1)) * self._grad_spikes.get(s, 1.0)
                first_nan = min(self._nan_loss.values()) if self._nan_loss else None
                if first_nan is not None and s >= first_nan:
                    if self._nan_loss.get(r, 1 << 60) <= s or s > first_nan:
                        loss = float("nan")
                    grad = float("nan")
                for start, count in self._nan_grad:
                    if start <= s < start + count:
                        grad = float("nan")
                emit(ev.Step(job=self.job, ts=t_end + 0.002 * r + rng.random() * 0.003,
                             node=self.node_of(r), rank=r, step=s, step_time=duration,
                             compute_time=compute[r] if self.compute_time else None,
                             loss=loss, grad_norm=grad, loss_scale=self.loss_scale,
                             tokens=4096, lr=3e-4))
            t = t_end
            if self.checkpoint_every and s > 0 and s % self.checkpoint_every == 0:
                segments.append((t, t + self.checkpoint_s, "checkpoint", s))
                t += self.checkpoint_s
            if self.eval_every and s > 0 and s % self.eval_every == 0:
                segments.append((t, t + self.eval_s, "eval", s))
                t += self.eval_s
        self.stop_ts = t
        end = t + (self.tail_s if self._stop else 1.0)
        self.end_ts = end
        stopped_ranks, stopped_node, lost_gpu = set(), None, None
        hb_end = {}                    # rank -> time of its exit (no heartbeat after)

        def teardown(ranks, ts, signal, spread):
            for i, peer in enumerate(ranks):
                at = ts + spread * i / max(1, len(ranks) - 1)
                hb_end[peer] = at
                code = 1 if signal == "gloo" else None   # the peer's collective failed
                emit(ev.Lifecycle(job=self.job, ts=at, node=self.node_of(peer), rank=peer,
                                  event="exit", signal=None if code else signal,
                                  exit_code=code))

        if self._stop:
            _, how, detail = self._stop
            others = [r for r in range(self.ranks) if r != detail.get("rank")]
            if how == "crash":
                r = detail["rank"]
                stopped_ranks = {r}
                emit(ev.Lifecycle(job=self.job, ts=t + 0.5, node=self.node_of(r), rank=r,
                                  event="exit", exit_code=detail["exit_code"],
                                  signal=detail["signal"]))
                if detail["teardown_s"] is not None:
                    teardown(others, t + 0.5 + detail["teardown_s"], "SIGTERM", 0.2)
            elif how == "kill":
                stopped_ranks = {detail["rank"]}
                teardown(others, t + detail["teardown_s"], detail["signal"], 0.2)
            elif how == "stop":
                teardown(list(range(self.ranks)), t + 0.1, detail["signal"], detail["spread_s"])
            elif how == "silent":
                stopped_ranks = set(detail["ranks"])
                stopped_node = detail["node"]
                lost_gpu = detail.get("gpu")
        elif self.finish:
            for r in range(self.ranks):
                emit(ev.Lifecycle(job=self.job, ts=t + 0.5, node=self.node_of(r), rank=r,
                                  event="exit", exit_code=0))
            end = t + 0.4
        starts = [seg[0] for seg in segments]
        last_done = last_step
        for r in range(self.ranks):
            hb = self.t0 + 0.5 + 0.013 * r
            while hb < end:
                if r in stopped_ranks and hb >= self.stop_ts or hb >= hb_end.get(r, end):
                    break
                emit(self._heartbeat(r, hb, segments, starts, last_done))
                hb += self.heartbeat_s
        if self.gpus:
            nodes = sorted({self.node_of(r) for r in range(self.ranks)})
            sbe = {}
            g = self.t0 + 0.3
            while g < end:
                step_now = self.step_of_ts(g)
                for node in nodes:
                    if node == stopped_node and g >= self.stop_ts:
                        continue
                    entries = []
                    for i in range(len(self.ranks_of(node))):
                        if lost_gpu == (node, i) and g >= self.stop_ts:
                            continue
                        dbe = sum(1 for n, gi, s in self._dbe
                                  if (n, gi) == (node, i) and step_now is not None and step_now >= s)
                        hot = any((n, gi) == (node, i) and step_now is not None and step_now >= s
                                  for n, gi, s in self._throttle)
                        sbe[(node, i)] = sbe.get((node, i), 0) + (1 if rng.random() < 0.01 else 0)
                        entries.append({
                            "index": i, "uuid": f"GPU-{node}-{i}", "util": 97.0,
                            "mem_used": 70 << 30, "mem_total": 80 << 30,
                            "temp": 88.0 if hot else 62.0 + rng.random(), "power": 640.0,
                            "sm_clock": 1500 if hot else 1980,
                            "throttle": ["hw_thermal"] if hot else [],
                            "ecc_sbe": sbe[(node, i)], "ecc_dbe": dbe,
                            "remapped_pending": False, "remapped_failure": False,
                            "pcie_replay": 0, "nvlink_errors": 0})
                    emit(ev.Gpu(job=self.job, ts=g, node=node, gpus=entries))
                g += self.gpu_s
        for node, gpu, xid, step in self._xids:
            ts = self.step_end_ts[step - 1] + 0.2 if step > 0 else self.t0
            emit(ev.Xid(job=self.job, ts=ts, node=node, gpu=gpu, xid=xid, source="kmsg",
                        message=f"NVRM: Xid (PCI:0000:{gpu:02x}:00): {xid}, pid=1234"))
        out.sort(key=lambda x: (x[0], x[1]))
        return [e for _, _, e in out]

    def _heartbeat(self, r, ts, segments, starts, last_done):
        i = bisect.bisect_right(starts, ts) - 1
        node = self.node_of(r)
        if ts >= self.stop_ts:
            phase, since, step = "collective", self.stop_ts, last_done
            if self._stop and self._stop[1] == "hang" and self._stop[2]["rank"] == r:
                phase = self._stop[2]["phase"]
        else:
            start, end, kind, s = segments[i]
            if kind == "init":
                phase, since, step = "init", start, None
            elif kind in ("checkpoint", "eval"):
                phase, since, step = kind, start, s
            else:
                frac = (ts - start) / (end - start)
                acc = 0.0
                phase, since = "collective", start
                for name, share in PHASES:
                    if frac < acc + share:
                        phase, since = name, start + acc * (end - start)
                        break
                    acc += share
                step = s - 1 if s > 0 else None
        return ev.Heartbeat(job=self.job, ts=ts, node=node, rank=r, pid=1000 + r, step=step,
                            phase=phase, phase_since=since, dropped=0)


def by_kind(anomalies) -> dict:
    out: dict = {}
    for a in anomalies:
        out.setdefault(a.kind, []).append(a)
    return out


def run_engine(events, config=None):
    """Feed events to an Engine in event time (as ``analyze`` does); returns (anomalies, engine)."""
    from trainguard.detectors import Engine

    engine = Engine(config)
    found = []
    now = None
    for e in events:
        now = e.ts if now is None or e.ts > now else now
        found += engine.update(e)
        found += engine.advance(now)
    if now is not None:
        found += engine.advance(now, force=True)
    return found, engine
