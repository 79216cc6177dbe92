"""Detectors on step timing: slow ranks (straggler) and a slower job (throughput_drop).

Both work on ``jobstep`` items. They are built to exclude each other: a straggler is a rank
slower than its peers in the same step, so a job-wide slowdown never makes one; a throughput
drop is the whole job slower than its own past while no rank stands out.

>>> d = StragglerDetector(k=3, n=4, settle=0, warmup=3)
>>> out = []
>>> for s in range(9):
...     slow = 0.80 if s >= 4 else 0.50                       # rank 6 gets 1.6x slower
...     ct = [0.50, 0.51, 0.49, 0.50, 0.50, 0.52, slow, 0.50]
...     out += d.update(make_jobstep(s, 10.0 + s, compute_time=ct))
>>> [(f.kind, f.ranks, f.step) for f in out]
[('straggler', [6], 4)]
"""
from __future__ import annotations

import math
import operator
from collections import deque
from dataclasses import dataclass

from river import stats

from trainguard.setting import setting

from .base import (Detector, Finding, fmt_ranks, make_jobstep, median, num, rank_nodes,
                   whole_nodes)
from .view import UsesView
from .registry import register_detector

__all__ = ["StragglerDetector", "ThroughputDetector", "PageHinkleyUp", "peer_ratios",
           "make_jobstep"]


class PageHinkleyUp:
    """The Page-Hinkley test for an increase in the mean, as ``river.drift.PageHinkley(mode="up")``.

    Kept here because importing ``river.drift`` loads SciPy (for KSWIN): 2-3 s at every start
    of ``trainguard analyze``. Same update rule as river's.

    >>> ph = PageHinkleyUp(min_instances=5, delta=0.05, threshold=2.0)
    >>> [i for i, x in enumerate([0.0] * 20 + [1.0] * 10) if ph.update(x)]
    [22]
    """

    def __init__(self, min_instances: int = 30, delta: float = 0.005, threshold: float = 50.0,
                 alpha: float = 1.0):
        self.min_instances = min_instances
        self.delta = delta
        self.threshold = threshold
        self.alpha = alpha
        self.reset()

    def reset(self) -> None:
        self._n = 0
        self._mean = 0.0
        self._sum = 0.0
        self._min = math.inf

    def update(self, x: float) -> bool:
        """Learn ``x``; True when an increase is detected (the test then starts afresh)."""
        self._n += 1
        self._mean += (x - self._mean) / self._n
        self._sum = self.alpha * self._sum + x - self._mean - self.delta
        if self._sum < self._min:
            self._min = self._sum
        if self._n >= self.min_instances and self._sum - self._min > self.threshold:
            self.reset()
            return True
        return False


_value = operator.itemgetter(1)
#: the weight of a step in a rank's learned spread (its mean absolute deviation)
_SPREAD_WEIGHT = 0.02


def peer_ratios(times: dict) -> dict:
    """``{rank: compute_time / median of the other ranks' compute_time}``.

    Excluding the rank itself keeps the reference on the fast side even when a whole machine
    (up to half of the ranks) is slow.

    >>> {r: round(x, 2) for r, x in peer_ratios({0: 1.0, 1: 1.0, 2: 2.0, 3: 2.0}).items()}
    {0: 0.5, 1: 0.5, 2: 2.0, 3: 2.0}
    """
    order = sorted(times.items(), key=_value)
    values = [v for _, v in order]
    m = len(values) - 1                      # each rank's number of peers
    if m < 1:
        return {rank: 1.0 for rank, _ in order}
    h = m // 2
    # Leaving out the i-th smallest value, the median of the rest is one of three values,
    # for i below, at or above the middle position h.
    if m % 2:
        below = at = values[h + 1]
        above = values[h]
    else:
        below = (values[h] + values[h + 1]) / 2
        at = (values[h - 1] + values[h + 1]) / 2
        above = (values[h - 1] + values[h]) / 2
    out = {}
    for ref, part in ((below, order[:h]), (at, order[h:h + 1]), (above, order[h + 1:])):
        for rank, value in part:
            out[rank] = value / ref if ref > 0 else 1.0
    return out


def peer_view(item) -> tuple[dict, dict]:
    """``(compute_times, peer_ratios)`` of a jobstep, worked out once for all the detectors
    that look at it (kept in the item under ``"_peer_view"``)."""
    view = item.get("_peer_view")
    if view is None:
        times = _compute_times(item)
        view = item["_peer_view"] = (times, peer_ratios(times) if len(times) >= 2 else {})
    return view


def _compute_times(item) -> dict:
    out = {}
    for rank, rec in item["ranks"].items():
        ct = rec.get("compute_time")
        if type(ct) is not float:             # a float is the common case: no num() call
            ct = num(ct)
        if ct is not None and ct >= 0 and ct - ct == 0:
            out[rank] = ct
    return out


@register_detector(kinds="straggler", ladder=("capture", "evict_if_persistent", "alert"),
                   priority=60, causes={"straggler": "shared", "hang": "shared",
                                        "machine_outlier": "shared"})
class StragglerDetector(UsesView, Detector):
    """Ranks persistently slower than their peers of the same role, and than their own past.

    Peers: with a known topology (lifecycle ``topology``, Megatron layout: TP fastest, then
    DP, then PP) the ranks of the same pipeline stage, when the stage has ``min_ranks``;
    otherwise the whole job. Each rank has its own *usual share*: the log of its
    ``compute_time`` over its peers' (the mean of its first ``warmup`` steps, then moved by
    ``baseline_step`` towards each step within its own noise: a running median, which a
    noisy rank's slow half does not drag), and its own *spread* (the mean absolute deviation
    of its log ratio). A rank whose usual share came out at least ``ratio`` x its peers'
    while at most a quarter of them did is slow from its first step: its share is set back
    to its peers'. In a step every
    time is first divided by its rank's usual share, and a rank's *ratio* is its scaled time
    over the median of its peers' scaled times; so ranks that differ steadily from the start,
    or a steadily slower stage compared across the job, are not stragglers, and several
    ranks falling behind at once do not hide each other. A rank is *slow* in a step when its
    ratio is at least ``ratio`` and at least ``noise_z`` x its spread (a 12% wobble on a
    shared CPU is noise), and its time at least ``min_excess_s`` more. A rank slow in
    ``k`` of the last ``n`` steps it reported is a
    straggler, also when single normal steps break the run. When the first rank qualifies,
    the detector waits ``settle`` steps for others (a whole slow machine), and while another
    rank is falling behind too (slow in 2+ steps) up to ``n`` steps, then names the ranks
    that qualified meanwhile and are still slow in most steps; machines all of whose ranks
    are named are named too. A named rank is
    reported again only after it recovered (slow in at most ``n - k`` of the last ``n``).

    >>> d = StragglerDetector(k=3, n=4, settle=0, warmup=2)
    >>> out = []
    >>> for s in range(8):
    ...     ct = [0.50, 0.51, 0.49, 0.50, 0.50, 0.52, 0.80 if s >= 3 else 0.5, 0.50]
    ...     out += d.update(make_jobstep(s, 10.0 + s, compute_time=ct))
    >>> [(f.kind, f.ranks, f.step) for f in out]
    [('straggler', [6], 3)]
    """

    PREFIX = "straggler"
    CONSUMES = ("jobstep", "life")

    @dataclass(kw_only=True)
    class Config:
        ratio: float = setting(1.2, "slow in a step: compute_time >= ratio x usual", above=1,
                               live=(1.001, 100.0))
        min_excess_s: float = setting(0.002, "... and at least this many seconds more",
                                      live=(0.0, 3600.0))
        k: int = setting(6, "persistent: slow in k ...", minimum=1, at_most="n",
                         live=(1, 100_000))
        n: int = setting(10, "... of the last n steps it reported")
        settle: int = setting(2, "steps to wait for more ranks before naming them",
                              live=(0, 1000))
        min_ranks: int = setting(3, "ranks needed in a step (and a stage) to compare",
                                 minimum=2)
        warmup: int = setting(10, "steps each rank's own baseline is learned over")
        baseline_step: float = setting(0.002, "... then moved this much (log) per step")
        noise_z: float = setting(3.0, "slow also needs >= z x the rank's own spread")

    def _start(self) -> None:
        self._log_ratio = math.log(self.ratio)
        self._history: dict = {}       # rank -> deque of (slow, step, ts, ratio)
        self._slow_steps: dict = {}    # rank -> how many of its _history steps were slow
        self._base: dict = {}          # rank -> [log of its usual share, steps learned, share,
                                       #          mean absolute deviation of its log ratio]
        self._init_view()              # where ranks run, ranks per pipeline stage
        self._named: set = set()
        self._pending = None           # steps left before naming
        self._waited = 0               # steps waited since the first rank qualified
        self._candidates: set = set()  # ranks that qualified meanwhile

    def _derive(self) -> None:
        self._log_ratio = math.log(self.ratio)

    def update(self, item) -> list[Finding]:
        if type(item) is not dict:
            return []
        if self._own_view:
            self.view.learn(item)
        if item.get("k") != "jobstep":
            return []
        times, ratios = self._ratios(item)
        if len(times) < self.min_ranks:
            return []
        step, ts = item["step"], item["ts"]
        qualifying = []
        base_of, log_ratio, warmup = self._base, self._log_ratio, self.warmup
        history, slow_steps, named, n, k = (self._history, self._slow_steps, self._named,
                                            self.n, self.k)
        log, exp, min_excess, step_size = math.log, math.exp, self.min_excess_s, self.baseline_step
        z, half_ratio, spread_weight = self.noise_z, log_ratio / 2, _SPREAD_WEIGHT
        learned_now = []
        # the typical ratio of the step's ranks that are not slow: what a rank learns is its
        # ratio against it, so a straggler among few ranks (each normal rank's peer median
        # is then its slower normal peer) does not drag every usual share down, and with
        # them the straggler's ratio
        usual = sorted([r for r in ratios.values() if 0 < r < self.ratio])
        m = len(usual)
        shift = log(usual[m // 2] if m % 2 else (usual[m // 2 - 1] + usual[m // 2]) / 2) if m \
            else 0.0
        for rank, r in ratios.items():
            if r <= 0:
                continue
            rel = log(r)                    # judge the step, learn the rank's usual share
            base = base_of.get(rank)
            count = slow_steps.get(rank, 0)
            if base is None:
                base_of[rank] = [rel, 1, r, 0.0]
                slow, r = False, 1.0
            else:
                level, learned, _, dev = base
                # slow: past the ratio, and past the rank's own noise (a shared CPU's 12%)
                slow = (learned >= warmup and rel >= log_ratio and rel >= z * dev
                        and (t := times[rank]) - t / r >= min_excess)
                if learned < warmup:
                    base[0] = level = level + min(rel, log_ratio) / (learned + 1)
                    base[1] = learned + 1
                    base[2] = exp(level)
                    base[3] = dev + (min(abs(rel), log_ratio) - dev) / learned
                    if learned + 1 == warmup:
                        learned_now.append(rank)
                else:
                    own = rel - shift
                    twice = dev + dev
                    if count + count < k:
                        # its noise, slow steps included while it is not falling behind
                        size = own if own >= 0 else -own
                        cap = twice if twice > log_ratio else log_ratio
                        base[3] = dev + spread_weight * ((size if size < cap else cap) - dev)
                    # a slow step is not learned, nor a drift up beyond the rank's noise: it
                    # may grow. A fixed step towards each step: the median of a noisy rank's
                    # steps, not a mean pulled down by never learning their slow side
                    if rel < log_ratio and own != 0 and (
                            own < half_ratio or own < twice):
                        base[0] = level = level + (step_size if own > 0 else -step_size)
                        base[2] = exp(level)
            hist = history.get(rank)
            if hist is None:
                hist = history[rank] = deque(maxlen=n)
            if len(hist) == n and hist[0][0]:
                count -= 1                        # the oldest slow step leaves the window
            hist.append((slow, step, ts, r))
            count += slow
            slow_steps[rank] = count
            if rank in named:
                if count <= n - k:
                    named.discard(rank)
            elif count >= k:
                qualifying.append(rank)
        if learned_now:
            self._slow_from_the_start(learned_now)
        if not qualifying and self._pending is None:
            return []
        if self._pending is None:
            self._pending, self._waited, self._candidates = self.settle, 0, set()
        self._candidates.update(qualifying)
        self._waited += 1
        if self._pending > 0 or (self._waited <= n and self._rising(self._candidates)):
            self._pending -= 1
            return []
        self._pending = None
        # the ranks that qualified while waiting and are still slow in most steps
        qualifying = sorted(r for r in self._candidates if slow_steps[r] * 2 > n)
        if not qualifying:
            return []
        self._named.update(qualifying)
        return [self._finding(qualifying, step, ts)]

    def _rising(self, qualifying) -> bool:
        """Another rank slow in 2+ of its last steps, not yet qualifying: ranks falling
        behind together a few steps apart are named together (wait at most ``n`` steps)."""
        for rank, count in self._slow_steps.items():
            if 2 <= count < self.k and rank not in self._named and rank not in qualifying:
                return True
        return False

    def _slow_from_the_start(self, learned_now) -> None:
        """A rank that learned a usual share of at least ``ratio`` x its peers' while at most a
        quarter of its peers did is slow from its first step, not different by design (as the
        several speeds of a heterogeneous job): its usual share is set back to its peers'."""
        base, cut, size = self._base, self._log_ratio, self.view.stage_size
        wanted = {rank // size if size else 0 for rank in learned_now}
        groups: dict = {}
        for rank, b in base.items():
            key = rank // size if size else 0
            if key in wanted and b[1] >= self.warmup:
                groups.setdefault(key, []).append(b[0])
        judged = {}                       # group -> (peers' median, how many at cut above it)
        for key, levels in groups.items():  # once per group: all ranks end warm-up together
            mid = median(levels)
            judged[key] = (mid, sum(1 for v in levels if v - mid >= cut), len(levels))
        for rank in learned_now:
            mid, high, peers = judged[rank // size if size else 0]
            b = base[rank]
            if b[0] - mid >= cut and high <= max(1, peers // 4):
                b[0] = mid
                b[2] = math.exp(mid)

    def _ratios(self, item):
        """``(compute_times, ratios)``: each rank's scaled time over the median of its
        peers' (see the class); peers within a pipeline stage where the topology is known."""
        times = peer_view(item)[0]
        base = self._base
        scaled = {}
        for rank, t in times.items():
            b = base.get(rank)
            scaled[rank] = t / b[2] if b is not None else t
        size = self.view.stage_size
        if size:
            stages: dict = {}
            for rank, t in scaled.items():
                stages.setdefault(rank // size, {})[rank] = t
            if all(len(group) >= self.min_ranks for group in stages.values()):
                ratios = {}
                for group in stages.values():
                    ratios.update(peer_ratios(group))
                return times, ratios
        return times, (peer_ratios(scaled) if len(scaled) >= 2 else {})

    def _finding(self, qualifying, step, ts) -> Finding:
        first = min((h for r in qualifying for h in self._history[r] if h[0]),
                    key=lambda h: (h[1], h[2]))
        mean_ratio = {str(r): round(sum(h[3] for h in self._history[r]) / len(self._history[r]), 3)
                      for r in sorted(qualifying)}
        nodes = whole_nodes(qualifying, self.view.where)
        where = f" (all of machine{'s' if len(nodes) > 1 else ''} {', '.join(nodes)})" if nodes else ""
        worst = max(float(v) for v in mean_ratio.values())
        staged = self.view.stage_size >= self.min_ranks  # else compared across the job
        peers = "the peers of their pipeline stage" if staged else "their peers"
        return Finding(
            kind="straggler", severity="warning", ranks=sorted(qualifying), nodes=nodes,
            step=first[1], onset_ts=first[2], detected_ts=ts, detector=self.PREFIX,
            summary=(f"{fmt_ranks(qualifying)}{where} slower than {peers} (each against its "
                     f"usual pace) in {self.k}+ of {self.n} steps, up to {worst:.2f}x"),
            evidence={"mean_ratio": mean_ratio, "ratio_threshold": self.ratio,
                      "k": self.k, "n": self.n, "detected_step": step,
                      "stage_size": self.view.stage_size,
                      "rank_nodes": rank_nodes(qualifying, self.view.where)})


#: standard errors of the recent median above the baseline that confirm a throughput drop
NOISE_Z = 3.0
#: the spread of log step times (sigma) up to which the Page-Hinkley test takes the log step
#: time as it is; a noisier job's deviations are scaled down to this noise
NOISE_REF = 0.15
#: sigma / (median absolute deviation) of a normal distribution, and the standard error of
#: a median of n samples over sigma / sqrt(n)
_SIGMA_PER_MAD, _MEDIAN_SE = 1.4826, 1.2533


@register_detector(kinds="throughput_drop", ladder=("alert",), priority=100,
                   causes={"throughput_drop": "any", "machine_outlier": "any"})
class ThroughputDetector(Detector):
    """The whole job slower than its own recent past, while no rank stands out.

    The job's step time of a step is the median of its ranks' ``step_time``; in a job whose
    ranks all report ``tokens`` (decided on its first step), of their ``step_time / tokens``:
    a step that takes twice as long because it carries twice the tokens (a curriculum of
    growing sequence length, variable-length batches) is no slower. After ``warmup``
    steps, a Page-Hinkley test (:class:`PageHinkleyUp`) watches its logarithm, each step clipped at ``clip`` x
    the baseline so a periodic slow step (GC, preconditioner, eval) cannot trip it, and, in a
    job whose log step times spread more than :data:`NOISE_REF`, scaled to that spread. A drift is
    confirmed when the median of the last ``window`` steps is at least ``ratio`` x the protected
    baseline (median of ``baseline_window`` steps before), and above it by more than
    :data:`NOISE_Z` standard errors of such a median (from the job's own spread of step times:
    a job of variable-length batches whose steps vary by 60% has medians of 20 steps that
    wander by 17%), and no rank stood out (peer ratio >= ``standout_ratio``) in half of
    those steps; that is a straggler's business. After a report, the new level is learned as
    the baseline.

    >>> d = ThroughputDetector(warmup=5)
    >>> found = []
    >>> for s in range(200):
    ...     t = 1.0 if s < 100 else 1.6                          # network got slower at 100
    ...     found += d.update(make_jobstep(s, float(s), step_time=[t] * 4,
    ...                                    compute_time=[0.7] * 4))
    >>> [(f.kind, f.step, round(f.evidence["ratio"], 2)) for f in found]
    [('throughput_drop', 100, 1.6)]
    """

    PREFIX = "throughput"
    CONSUMES = ("jobstep",)

    @dataclass(kw_only=True)
    class Config:
        warmup: int = setting(50, "steps before learning starts (compile, warm-up)")
        baseline_window: int = setting(200, "steps in the protected baseline median",
                                       minimum=1)
        window: int = setting(20, "steps in the recent median compared with it", minimum=1)
        ratio: float = setting(1.25, "confirmed when recent median >= ratio x baseline",
                               above=1, live=(1.001, 100.0))
        clip: float = setting(4.0, "one step counts at most clip x baseline", above=1)
        delta: float = setting(0.05, "Page-Hinkley delta, in log step time")
        threshold: float = setting(4.0, "Page-Hinkley threshold, in log step time")
        standout_ratio: float = setting(1.2, 'a rank slower than this vs peers "stands out"',
                                        above=1, live=(1.001, 100.0))

    def _start(self) -> None:
        self._per_token = None     # the job reports tokens: judged per token (first step)
        self._reset(0)

    def _reset(self, seen: int):
        self._seen = seen
        self._baseline = stats.RollingQuantile(q=0.5, window_size=self.baseline_window)
        # the median absolute deviation of the baseline's steps from it: the job's own noise
        self._spread = stats.RollingQuantile(q=0.5, window_size=self.baseline_window)
        self._recent = deque(maxlen=self.window)       # (log step time, step, ts, standouts)
        self._ph = PageHinkleyUp(min_instances=self.window, delta=self.delta,
                                 threshold=self.threshold)
        self._learned = 0
        self._confirming = 0    # steps left to confirm a drift the test found too early

    def update(self, item) -> list[Finding]:
        if type(item) is not dict or item.get("k") != "jobstep":
            return []
        times, counted = [], True
        for rec in item["ranks"].values():
            t = rec.get("step_time")
            if type(t) is not float:          # a float is the common case: no num() call
                t = num(t)
            if t is not None and t > 0 and t - t == 0:
                n = rec.get("tokens")
                if type(n) is int and n > 0:
                    times.append((t, n))
                else:
                    times.append((t, 1))
                    counted = False
        if not times:
            return []
        if self._per_token is None:
            self._per_token = counted
        if self._per_token:
            if not counted:
                return []     # a step without tokens in a job that reports them: no measure
            times = [t / n for t, n in times]
        else:
            times = [t for t, _ in times]
        self._seen += 1
        if self._seen <= self.warmup:
            return []
        y = math.log(median(times))
        cts, ratios = peer_view(item)
        standouts = ()
        if len(cts) >= 3:
            standouts = tuple(r for r, x in ratios.items() if x >= self.standout_ratio)
        self._recent.append((y, item["step"], item["first_ts"], standouts))
        if self._learned < self.window:
            self._learned += 1
            self._baseline.update(y)
            self._spread.update(abs(y - self._baseline.get()))
            return []
        base = self._baseline.get()
        clipped = min(y, base + math.log(self.clip))
        sigma = _SIGMA_PER_MAD * (self._spread.get() or 0.0)
        # a noisier job than NOISE_REF moves the test in units of its own noise
        fresh = drifted = self._ph.update((clipped - base) * min(1.0, NOISE_REF / sigma)
                                          if sigma > 0 else clipped - base)
        if fresh:
            self._confirming = self.window
        elif self._confirming:
            # the test starts afresh after a drift and takes the new level as its mean: a
            # sudden big drop (2x in one step) fires it before the recent median moved, and
            # only a confirmation over the next steps finds it
            self._confirming -= 1
            drifted = True
        recent = sorted([h[0] for h in self._recent])
        recent_median = recent[len(recent) // 2]
        if not drifted:
            if recent_median - base < math.log(self.ratio):
                self._baseline.update(y)
                self._spread.update(abs(y - base))
            return []
        ratio = math.exp(recent_median - base)
        if ratio < self.ratio:
            return []
        standard_error = _MEDIAN_SE * sigma * math.sqrt(1 / len(self._recent)
                                                        + 1 / self.baseline_window)
        if recent_median - base < NOISE_Z * standard_error:
            return []                # the job's own noise: its medians wander this much
        counts: dict = {}
        for h in self._recent:
            for r in h[3]:
                counts[r] = counts.get(r, 0) + 1
        if any(c * 2 >= len(self._recent) for c in counts.values()):
            self._confirming = 0          # ranks stand out: a straggler's business
            return []
        cut = base + math.log(self.ratio) / 2
        first = next((h for h in self._recent if h[0] >= cut), self._recent[0])
        self._reset(self._seen)
        return [Finding(
            kind="throughput_drop", severity="warning", ranks=[], nodes=[], step=first[1],
            onset_ts=first[2], detected_ts=item["ts"], detector=self.PREFIX,
            summary=(f"the job's step time{' per token' if self._per_token else ''} rose to "
                     f"{math.exp(recent_median):.3g}s from {math.exp(base):.3g}s ({ratio:.2f}x) "
                     f"with no rank standing out"),
            evidence={"step_time": math.exp(recent_median), "baseline": math.exp(base),
                      "ratio": ratio, "detected_step": item["step"],
                      "per_token": bool(self._per_token)})]
