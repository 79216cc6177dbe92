"""A slower job (throughput_drop), and the Page-Hinkley test it watches its step time with.

It works on ``jobstep`` items and is built to exclude the straggler (``straggler.py``): a
straggler is a rank slower than its peers in the same step, so a job-wide slowdown never
makes one; a throughput drop is the whole job slower than its own past while no rank
stands out.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from river import stats

from trainguard.setting import setting

from .base import Detector, Finding, make_jobstep
from .partials import column_median, standing_out, step_summary
from .registry import register_detector

__all__ = ["ThroughputDetector", "PageHinkleyUp", "make_jobstep"]


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
        agg = step_summary(item)
        if not agg["step_time"]["n"]:
            return []
        counted = not agg["uncounted"]
        if self._per_token is None:
            self._per_token = counted
        if self._per_token:
            if not counted:
                return []     # a step without tokens in a job that reports them: no measure
            typical = column_median(agg["per_token"])
        else:
            typical = column_median(agg["step_time"])
        self._seen += 1
        if self._seen <= self.warmup:
            return []
        y = math.log(typical)
        standouts = ()
        if agg["compute_time"]["n"] >= 3:
            standouts = tuple(standing_out(item, agg, self.standout_ratio))
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
