"""Machines that drift from their peers without raising a flag, learned online per job.

Every machine of a job does the same work, so its counters should look like its peers'. A
power cap set wrongly, a failing fan (hotter, lower clocks), memory clocks that dropped, host
CPU contention or a NIC that retransmits raise no Xid and no throttle reason; the rules see
them only once the step time stands out. Here, per round (every ``every_s`` of the tick
grid), each machine's vector of counters (:data:`FEATURES`, made by :class:`MachineVector`
from its latest ``gpu`` sample) becomes *robust deviations* from the machines of the same
role (median and MAD across them, per counter; role: the pipeline stages of its ranks, or
the whole job), and a per-machine Gaussian scorer (``river.stats.Var`` per counter) learns
what that machine's deviations normally are: a machine of a slower bin that runs 6% lower
clocks all along is normal for itself. A round is flagged when a counter's deviation is
``threshold`` of its own standard deviations (at least ``min_std``) from its usual; ``k``
flagged rounds of the last ``n`` are a ``machine_outlier`` warning that names the machine
and the counters that contribute most. Learning: every round of the first ``warmup``, then
only counters well inside the normal (below half the threshold), so a slow drift is not
learned as the new normal. Rounds while a rank is in a pause (checkpoint, eval, init, a user
phase) or before the first step after a start are skipped (rank 0 writing alone is no
outlier). Findings are warnings and evidence (the action service never restarts or evicts
on them alone).

>>> from trainguard import events as ev
>>> d = MachineOutlierDetector(warmup=10)
>>> def sample(node, t, clock):
...     return ev.Gpu(job="j", ts=t, node=node, gpus=[{"index": 0, "uuid": node,
...         "util": 97.0, "sm_clock": clock, "temp": 60.0, "power": 600.0}])
>>> found = []
>>> for i in range(40):
...     t = 100.0 + 5 * i
...     for n, node in enumerate(("n1", "n2", "n3", "n4")):
...         bin_ = 1900 if node == "n4" else 1980          # a slower bin, steady: normal
...         clock = 1500 if node == "n2" and i >= 25 else bin_ + (i * 7 + n * 3) % 11
...         found += d.update(sample(node, t, clock))
...     found += d.advance(t + 1.0)
>>> [(f.kind, f.nodes, f.evidence["counters"][0]["counter"], f.onset_ts) for f in found]
[('machine_outlier', ['n2'], 'sm_clock', 226.0)]
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from river import stats

from trainguard.setting import setting

from .base import Detector, Finding
from .phases import STEP_PHASES
from .view import UsesView
from .registry import register_detector

__all__ = ["MachineOutlierDetector", "MachineVector", "FEATURES"]

#: the counters compared, in the order of a ``gpu`` summary's ``x``
FEATURES = ("util", "sm_clock", "mem_clock", "power", "temp", "mem", "pcie_kbs", "sbe_rate",
            "replay_rate", "nvlink_err_rate", "host_cpu", "net_bytes_rate", "tcp_retrans")
#: per counter, the least scale of a deviation: (absolute, relative to the peers' median);
#: machines that agree exactly still differ by this much before it counts
SCALE_FLOOR = {"util": (2.0, 0.0), "sm_clock": (10.0, 0.01), "mem_clock": (10.0, 0.01),
               "power": (0.005, 0.02), "temp": (1.0, 0.0), "mem": (0.02, 0.0),
               "pcie_kbs": (1000.0, 0.05), "sbe_rate": (0.5, 0.0), "replay_rate": (0.5, 0.0),
               "nvlink_err_rate": (0.5, 0.0), "host_cpu": (3.0, 0.0),
               "net_bytes_rate": (1e6, 0.05), "tcp_retrans": (0.002, 0.0)}
_FLOORS = [SCALE_FLOOR[f] for f in FEATURES]
_CLIP = 50.0
_NUMBER = (int, float)
#: a ``gpu`` sample's cumulative error counters, summed over the machine's GPUs
_COUNTERS = (("sbe", "ecc_sbe"), ("replay", "pcie_replay"), ("nvlink", "nvlink_errors"))


class MachineVector:
    """One machine's :data:`FEATURES` from its ``gpu`` samples (rates need the sample
    before). Per GPU: ``util``, ``sm_clock``, ``mem_clock``, ``power`` (a fraction of
    ``power_limit`` when given), ``temp``, ``mem_used / mem_total``, ``pcie_tx_kbs +
    pcie_rx_kbs``, and the rates of ``ecc_sbe``, ``pcie_replay``, ``nvlink_errors``; the
    machine is its weakest GPU on clocks, power and utilisation, its hottest on temperature
    and error rates, the mean on memory and PCIe traffic. From the event's optional ``host``
    object: ``cpu_util``, the rate of ``net_rx_bytes + net_tx_bytes``, and ``tcp_retrans``
    over ``tcp_out_segs`` between samples.

    >>> mv = MachineVector()
    >>> g = {"index": 0, "uuid": "G", "util": 90.0, "power": 350.0, "power_limit": 700.0,
    ...      "ecc_sbe": 4}
    >>> x = mv.vector(10.0, [g], {"tcp_retrans": 10, "tcp_out_segs": 1000})
    >>> x[FEATURES.index("power")], x[FEATURES.index("sbe_rate")]
    (0.5, None)
    >>> x = mv.vector(15.0, [{**g, "ecc_sbe": 9}], {"tcp_retrans": 60, "tcp_out_segs": 2000})
    >>> x[FEATURES.index("sbe_rate")], x[FEATURES.index("tcp_retrans")]
    (1.0, 0.05)
    """

    def __init__(self):
        self._prev_ts = None
        self._prev: dict = {}      # counter -> cumulative value of the sample before

    def vector(self, ts, gpus, host=None) -> list:
        util, sm_clock, mem_clock, power, temp, mem, pcie = [], [], [], [], [], [], []
        counters = {}                  # sbe, replay, nvlink -> their sum over the GPUs
        number = _NUMBER
        plain = (("util", util), ("sm_clock", sm_clock), ("mem_clock", mem_clock),
                 ("temp", temp))
        for g in gpus:
            if type(g) is not dict or g.get("lost"):
                continue
            get = g.get
            for name, values in plain:
                v = get(name)
                if type(v) in number:
                    values.append(float(v))
            v, limit = get("power"), get("power_limit")
            if type(v) in number:
                power.append(v / limit if type(limit) in number and limit > 0 else float(v))
            used, total = get("mem_used"), get("mem_total")
            if type(used) is int and type(total) is int and total > 0:
                mem.append(used / total)
            tx, rx = get("pcie_tx_kbs"), get("pcie_rx_kbs")
            if type(tx) in number and type(rx) in number:
                pcie.append(float(tx + rx))
            for key, name in _COUNTERS:
                v = get(name)
                if type(v) is int:
                    counters[key] = counters.get(key, 0) + v
        x = [None] * len(FEATURES)
        # a machine is its weakest GPU on clocks, power and utilisation, its hottest on
        # temperature, the mean on memory and PCIe traffic
        for i, values in enumerate((util, sm_clock, mem_clock, power)):
            if values:
                x[i] = min(values)
        if temp:
            x[4] = max(temp)
        if mem:
            x[5] = sum(mem) / len(mem)
        if pcie:
            x[6] = sum(pcie) / len(pcie)
        now = counters
        if type(host) is dict:
            for name in ("net_rx_bytes", "net_tx_bytes", "tcp_retrans", "tcp_out_segs"):
                v = host.get(name)
                if type(v) is int and v >= 0:
                    now[name] = v
            cpu = host.get("cpu_util")
            if type(cpu) in (int, float):
                x[10] = float(cpu)
        prev, dt = self._prev, (ts - self._prev_ts) if self._prev_ts is not None else 0.0
        if dt > 0:
            for i, key in ((7, "sbe"), (8, "replay"), (9, "nvlink")):
                if key in now and key in prev and now[key] >= prev[key]:
                    x[i] = (now[key] - prev[key]) / dt
            if all(k in now and k in prev for k in ("net_rx_bytes", "net_tx_bytes")):
                moved = now["net_rx_bytes"] + now["net_tx_bytes"] - prev["net_rx_bytes"] \
                    - prev["net_tx_bytes"]
                x[11] = moved / dt if moved >= 0 else None
            if all(k in now and k in prev for k in ("tcp_retrans", "tcp_out_segs")):
                segs = now["tcp_out_segs"] - prev["tcp_out_segs"]
                if segs > 0 and now["tcp_retrans"] >= prev["tcp_retrans"]:
                    x[12] = (now["tcp_retrans"] - prev["tcp_retrans"]) / segs
        if dt > 0 or self._prev_ts is None:
            self._prev, self._prev_ts = now, ts
        return x


class _Normal:
    """What one machine's deviations usually are: a ``river.stats.Var`` per counter, and
    its last rounds' verdicts."""

    def __init__(self, n: int):
        self.vars = [stats.Var() for _ in FEATURES]
        self.flags: deque = deque(maxlen=n)
        self.rounds = 0
        self.active = False     # an episode is reported and not over
        self.quiet = 0          # rounds without a flag since the episode's last one
        self.last_ts = 0.0


# A machine that drifts from its peers is the likely cause of the slowdown that follows it
# there; it is last in priority, so the incident takes the ladder of that slowdown.
@register_detector(kinds="machine_outlier", ladder=("alert",), priority=110, causes={
    "machine_outlier": "shared", "straggler": "shared", "hang": "shared",
    "throughput_drop": "any", "gpu_degraded": "shared"})
class MachineOutlierDetector(UsesView, Detector):
    """See the module docstring."""

    PREFIX = "machine_outlier"
    CONSUMES = ("gpu", "hb", "life", "jobstep", "tick")

    @dataclass(kw_only=True)
    class Config:
        every_s: float = setting(5.0, "a round (peers' medians, scores) this often")
        stale_s: float = setting(15.0, "a machine's sample older than this is not compared")
        min_machines: int = setting(3, "machines (of a role) needed to compare (0: off)")
        warmup: int = setting(30, "rounds each machine's usual deviations are learned over")
        threshold: float = setting(8.0, "flagged: a counter this many of its own std off")
        min_std: float = setting(0.5, "... the std (in peer MADs) taken as at least this")
        k: int = setting(4, "an outlier: flagged in k ...", minimum=1, at_most="n")
        n: int = setting(6, "... of the machine's last n rounds")
        top: int = setting(3, "counters named in a finding")
        forget_s: float = setting(3600.0, "a machine unheard this long is forgotten")

    def _start(self) -> None:
        self._init_view()
        self._vectors: dict = {}     # node -> MachineVector (raw ev.Gpu input)
        self._latest: dict = {}      # node -> (ts, x)
        self._models: dict = {}      # node -> _Normal
        self._paused: set = set()    # ranks in an allowed phase (a pause)
        self._waiting = False        # started, no step since
        self._step = None
        self._next = None

    # -- input ---------------------------------------------------------------------------
    def update(self, item) -> list[Finding]:
        if type(item) is dict:
            k = item.get("k")
            if k == "gpu":
                x, node, ts = item.get("x"), item.get("node"), item.get("ts")
                if node and type(x) is list and len(x) == len(FEATURES) \
                        and type(ts) in (int, float):
                    self._latest[node] = (ts, x)
            elif k == "hb":
                rank, phase = item.get("rank"), item.get("phase")
                if type(phase) is str and phase not in STEP_PHASES:
                    self._paused.add(rank)
                else:
                    self._paused.discard(rank)
            elif k == "jobstep":
                if self._own_view:
                    self.view.learn(item)
                self._waiting = False
                self._step = item.get("step")
            elif k == "life":
                if self._own_view:
                    self.view.learn(item)
                if item.get("event") == "start":
                    self._waiting = True
                    self._paused.discard(item.get("rank"))
            return []
        if getattr(item, "TYPE", "") == "gpu" and item.node and item.status != "unavailable":
            maker = self._vectors.get(item.node)
            if maker is None:
                maker = self._vectors[item.node] = MachineVector()
            host = item.host
            self._latest[item.node] = (item.ts, maker.vector(item.ts, item.gpus, host))
        return []

    def advance(self, now: float) -> list[Finding]:
        if self._next is not None and now < self._next:
            return []
        self._next = now + self.every_s
        if not self.min_machines or self._waiting or self._paused \
                or len(self._latest) < self.min_machines:
            return []
        return self._round(now)

    # -- one round -----------------------------------------------------------------------
    def _roles(self, nodes) -> dict:
        size = self.view.stage_size
        if not size:
            return {(): nodes}
        stages = self.view.node_stages(size)
        groups: dict = {}
        for node in nodes:
            groups.setdefault(tuple(sorted(stages.get(node, ()))), []).append(node)
        if all(len(g) >= self.min_machines for g in groups.values()):
            return groups
        return {(): nodes}       # too few of a role: the job; each machine's usual absorbs it

    def _round(self, now: float) -> list[Finding]:
        fresh = [node for node, (ts, _) in self._latest.items() if now - ts <= self.stale_s]
        for node in [n for n, (ts, _) in self._latest.items() if now - ts > self.forget_s]:
            del self._latest[node]
            self._models.pop(node, None)
            self._vectors.pop(node, None)
        if len(fresh) < self.min_machines:
            return []
        out = []
        for group in self._roles(sorted(fresh)).values():
            rows = [self._latest[node][1] for node in group]
            centers = []
            for i in range(len(FEATURES)):
                col = sorted(r[i] for r in rows if r[i] is not None)
                if len(col) < self.min_machines:
                    centers.append(None)
                    continue
                med = _median(col)
                mad = _median(sorted(abs(v - med) for v in col))
                absolute, relative = _FLOORS[i]
                centers.append((med, max(1.4826 * mad, absolute, relative * abs(med))))
            for node, row in zip(group, rows):
                finding = self._judge(node, row, centers, now)
                if finding is not None:
                    out.append(finding)
        return out

    def _judge(self, node, row, centers, now) -> Finding | None:
        model = self._models.get(node)
        if model is None:
            model = self._models[node] = _Normal(self.n)
        model.last_ts = now
        learning = model.rounds < self.warmup
        model.rounds += 1
        scores = []
        for i, center in enumerate(centers):
            v = row[i]
            if center is None or v is None:
                continue
            med, scale = center
            z = max(-_CLIP, min(_CLIP, (v - med) / scale))
            var = model.vars[i]
            if learning:
                var.update(z)
                continue
            usual = var.mean.get()
            std = math.sqrt(var.get()) if var.mean.n > 1 else 0.0
            s = abs(z - usual) / max(std, self.min_std)
            if s < 0.5 * self.threshold:
                var.update(z)
            elif s >= self.threshold:
                scores.append((s, i, v, med, z, usual))
        if learning:
            return None
        flagged = bool(scores)
        model.flags.append(now if flagged else None)
        if model.active:
            model.quiet = 0 if flagged else model.quiet + 1
            if model.quiet >= self.n:
                model.active = False
            return None
        rounds = [t for t in model.flags if t is not None]
        if not flagged or len(rounds) < self.k:
            return None
        model.active, model.quiet = True, 0
        scores.sort(reverse=True)
        counters = [{"counter": FEATURES[i], "value": round(v, 4), "peers": round(med, 4),
                     "z": round(z, 2), "usual_z": round(usual, 2), "score": round(s, 1)}
                    for s, i, v, med, z, usual in scores[:self.top]]
        ranks = sorted(self.view.ranks_on(node))
        text = ", ".join(f"{c['counter']} {c['value']:g} vs peers {c['peers']:g}"
                         for c in counters)
        return Finding(kind="machine_outlier", severity="warning", ranks=[], nodes=[node],
                       step=self._step, onset_ts=rounds[0], detected_ts=now,
                       detector=self.PREFIX, key=f"o{rounds[0]:.1f}",
                       summary=f"{node} stands out from its peers in {len(rounds)} of the "
                               f"last {len(model.flags)} rounds: {text}",
                       evidence={"score": round(scores[0][0], 2), "threshold": self.threshold,
                                 "counters": counters, "rounds": len(rounds),
                                 "rank_nodes": {str(r): node for r in ranks}})

    # -- feedback ------------------------------------------------------------------------
    def relearn(self, node: str) -> None:
        """Forget what ``node`` usually looks like (a false alarm: its new level is normal)."""
        self._models.pop(node, None)


def _median(s: list) -> float:
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2
