"""Detectors on what the model reports each step: non-finite values and loss / gradient spikes.

Both work on ``jobstep`` items, one closed step of all ranks, so they judge the job as a whole.

>>> nan = NanDetector()
>>> findings = nan.update(make_jobstep(7, 70.0, loss=[2.1, float("nan"), 2.2, 2.0],
...                                    grad_norm=[float("nan")] * 4))
>>> [(f.kind, f.ranks, f.step) for f in findings]
[('nan', [1], 7)]
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from river import stats

from trainguard.setting import setting

from .base import Detector, Finding, fmt_ranks, is_finite, make_jobstep, median, num
from .partials import POSITIVE_FIELDS, column_median, step_summary
from .registry import register_detector

__all__ = ["NanDetector", "LossSpikeDetector", "GradSpikeDetector", "SpikeDetector",
           "make_jobstep"]


# A NaN is one rank's arithmetic: it explains a crash or a hang blamed on that rank only.
@register_detector(kinds="nan", ladder=("rollback_if_repeated", "alert"), priority=20,
                   causes={"nan": "any", "loss_spike": "any", "grad_spike": "any",
                           "crash": "same_rank", "hang": "same_rank"})
class NanDetector(Detector):
    """A non-finite loss or gradient norm.

    The suspects are the ranks whose *loss* went non-finite in the first step where any did.
    A gradient norm is global (all-reduced), so a non-finite one on every rank blames none:
    the finding is then job-wide (``ranks == []``). With a dynamic loss scaler (``loss_scale``
    reported) a non-finite gradient norm with finite losses is the scaler's routine overflow
    skip, reported only after ``scaler_patience`` such steps in a row. Before the job's first
    finite gradient norm since it (re)started, such steps are the scaler's start-up search (a
    scale of 2^32 halved until gradients fit: dozens of skipped steps with Megatron's
    hysteresis) and are not counted while the scale still falls, at least every
    ``SEARCH_HOLD`` steps, and is at least 1. One finding per episode;
    a step with every value finite ends it. A late record (a ``jobstep`` with ``"late"``: one
    rank's record that came after its step was closed) is checked for a non-finite loss only;
    its rank's episode lasts until that rank reports a finite loss again.

    >>> d = NanDetector()
    >>> gn = [float("inf")] * 4
    >>> [f.ranks for f in d.update(make_jobstep(3, 30.0, loss=[2.0] * 4, grad_norm=gn))]
    [[]]
    >>> scaled = NanDetector(scaler_patience=2)
    >>> scaled.update(make_jobstep(0, 0, loss=[2.0] * 4, grad_norm=[1.0] * 4,
    ...                            loss_scale=[1024.0] * 4))
    []
    >>> [len(scaled.update(make_jobstep(s, s, loss=[2.0] * 4, grad_norm=gn,
    ...                                 loss_scale=[1024.0] * 4))) for s in range(1, 4)]
    [0, 1, 0]

    A scaler searching down from 2^32 at the start (Megatron: two overflows per halving):

    >>> search = NanDetector(scaler_patience=2)
    >>> sum(len(search.update(make_jobstep(s, s, loss=[9.0] * 4, grad_norm=gn,
    ...                                    loss_scale=[2.0 ** (32 - s // 2)] * 4)))
    ...     for s in range(36))
    0
    """

    PREFIX = "nan"
    CONSUMES = ("jobstep", "late", "life")
    #: steps the scale may stay put during the start-up search (hysteresis 2, plus one)
    SEARCH_HOLD = 3

    @dataclass(kw_only=True)
    class Config:
        scaler_patience: int = setting(
            8, "with a dynamic loss scaler in use (``loss_scale`` reported), a non-finite "
               "gradient norm alone is the scaler's normal overflow skip; reported only after "
               "this many steps in a row", live=(0, 100_000))

    def _start(self) -> None:
        self._active = False
        self._grad_streak = 0
        self._grad_onset = None
        self._late_ranks: set = set()   # reported from late records, no finite loss since
        self._searching = True          # no finite gradient norm since the job (re)started
        self._search_scale = None       # the lowest loss scale of the search so far ...
        self._search_hold = 0           # ... and the steps since it last fell

    def update(self, item) -> list[Finding]:
        if type(item) is not dict:
            return []
        if item.get("k") != "jobstep":
            if item.get("k") == "life" and item.get("event") == "start":
                self._searching, self._search_scale = True, None   # a fresh scaler, maybe
            return []
        if "late" in item:
            return self._late(item)
        agg = step_summary(item)
        late_ranks = self._late_ranks
        if late_ranks:
            self._recovered(item, agg)
        bad_loss, bad_grad = agg["bad_loss"], agg["bad_grad"]
        n_loss, n_grad = agg["bad_loss_n"], agg["bad_grad_n"]
        scaled, seen_grad, top_scale = agg["scaled"], agg["seen_grad"], agg["top_scale"]
        first_ts = agg["bad_ts"]
        if not n_loss and not n_grad:
            self._active = False
            self._grad_streak = 0
            if seen_grad:
                self._searching = False
            return []
        if not n_grad and n_loss == len(bad_loss) and late_ranks.issuperset(bad_loss):
            return []                    # the ranks already reported from late records
        step, ts = item["step"], item["ts"]
        if self._active:
            return []
        reporting = agg["n"]
        if n_loss:
            everyone = n_loss == reporting and reporting > 1
            ranks = [] if everyone else sorted(bad_loss)
            who = f"every rank ({reporting})" if everyone else _named(bad_loss, n_loss)
            summary = f"loss became non-finite on {who} at step {step}"
            onset = first_ts
        else:
            if scaled and self._searching and self._still_searching(top_scale):
                return []
            if scaled:
                self._grad_streak += 1
                if self._grad_streak == 1:
                    self._grad_onset = (item["step"], first_ts)
                if self._grad_streak < self.scaler_patience:
                    return []
                step, onset = self._grad_onset
            else:
                onset = first_ts
            everyone = n_grad == seen_grad
            ranks = [] if everyone else sorted(bad_grad)
            summary = (f"gradient norm non-finite on "
                       f"{'every rank' if everyone else _named(ranks, n_grad)}"
                       f" at step {step} while the loss is finite"
                       + (f" ({self._grad_streak} steps despite loss scaling)" if scaled else ""))
        self._active = True
        return [Finding(kind="nan", severity="critical", ranks=ranks, nodes=[], step=step,
                        onset_ts=onset, detected_ts=ts, detector=self.PREFIX, summary=summary,
                        evidence={"nonfinite_loss_ranks": sorted(bad_loss),
                                  "nonfinite_grad_norm_ranks": sorted(bad_grad),
                                  "ranks_reporting": reporting, "loss_scaled": scaled})]

    def _recovered(self, item, agg) -> None:
        """The ranks reported from late records that report a finite loss now."""
        if item.get("agg") is not None:
            self._late_ranks.difference_update(agg.get("recovered", ()))
            return
        records = item["ranks"]
        for rank in list(self._late_ranks):
            rec = records.get(rank)
            if rec is not None:
                loss = num(rec.get("loss"))
                if loss is not None and loss - loss == 0:
                    self._late_ranks.discard(rank)

    def _still_searching(self, scale: float) -> bool:
        """The scaler's start-up search goes on: its scale (at least 1) fell within the last
        ``SEARCH_HOLD`` steps."""
        if scale < 1.0:
            self._searching = False
            return False
        if self._search_scale is None or scale < self._search_scale:
            self._search_scale, self._search_hold = scale, 0
            return True
        self._search_hold += 1
        if self._search_hold < self.SEARCH_HOLD:
            return True
        self._searching = False
        return False

    def _late(self, item) -> list[Finding]:
        """A late record's own non-finite loss, once per episode of that rank: the on-time
        steps of the others, all finite, do not end it; a finite loss of that rank does."""
        bad = []
        for rank, rec in item["ranks"].items():
            loss = num(rec.get("loss"))
            if loss is not None and not is_finite(loss):
                bad.append(rank)
            elif loss is not None:
                self._late_ranks.discard(rank)
        new = sorted(r for r in bad if r not in self._late_ranks)
        self._late_ranks.update(bad)
        if not new or self._active:
            return []
        bad = new
        step = item["step"]
        return [Finding(kind="nan", severity="critical", ranks=bad, nodes=[], step=step,
                        onset_ts=item["first_ts"], detected_ts=item["ts"], detector=self.PREFIX,
                        summary=f"loss became non-finite on {fmt_ranks(bad)} at step {step} "
                                "(its record came after the step was closed)",
                        evidence={"nonfinite_loss_ranks": bad, "late_record": True})]


def _named(ranks: list, count: int) -> str:
    """The ranks named, with how many there were when a partial named only some."""
    if len(ranks) == count:
        return fmt_ranks(ranks)
    return f"{count} ranks ({', '.join(map(str, sorted(ranks)[:8]))}, ...)"


class SpikeDetector(Detector):
    """A value far above its own robust baseline; the job's value of a step is the median
    across ranks.

    Works on the log of the value. The baseline is a rolling median (``window`` steps); the
    yardstick is a high quantile (``tail_quantile``) of recent upward log deviations
    (``tail_window`` steps; downward ones count as 0, so a falling curve does not widen it),
    so a noisy curve needs a bigger jump than a smooth one. A spike is
    a deviation above ``tail_factor`` x that quantile and a value above ``min_ratio`` x the
    baseline. Values enter the baseline clipped at that threshold (winsorized), so a spike does
    not teach the baseline, while a lasting level shift is learned in about ``window / 2``
    steps. Nothing is reported in the first ``warmup`` steps, and in the first ``early_steps``
    (a young, rough curve) only jumps of ``early_min_ratio`` x the baseline or more. The state
    is the job's: it carries over restarts of the job. ``cooldown`` quiet steps end a
    spike episode, and each episode is reported once. Values <= 0 are skipped.

    A subclass may also judge fast rises (:class:`GradSpikeDetector` does): with
    ``rise_steps`` > 0, a rise of 2 to ``rise_steps`` steps to ``rise_ratio`` x the level
    before it is a spike, whatever the tail and the early steps say (see :meth:`_rise`).
    """

    PREFIX = ""
    CONSUMES = ("jobstep",)
    FIELD = ""
    KIND = ""
    #: steps of a fast rise judged against the level from before it (0: none); see
    #: :meth:`_rise`
    rise_steps = 0
    #: a value this far (log) above the baseline, or the tail quantile, is above normal
    BAND_FLOOR = math.log(1.5)

    @dataclass(kw_only=True)
    class Config:
        window: int = setting(50, "steps in the rolling median baseline", minimum=1)
        tail_window: int = setting(1000, "steps over which the tail of deviations is learned",
                                   minimum=1)
        tail_quantile: float = setting(0.995, "quantile of the deviations' tail", above=0,
                                       maximum=1)
        tail_factor: float = setting(4.0, "spike: log deviation > factor x tail quantile ...",
                                     live=(1.0, 100.0))
        min_ratio: float = setting(1.1, "... and value > min_ratio x baseline", above=1,
                                   live=(1.001, 100.0))
        warmup: int = setting(20, "steps learned before any report")
        cooldown: int = setting(20, "quiet steps that end a spike episode")
        early_steps: int = setting(250, "young curves are rough: in these first steps ...")
        early_min_ratio: float = setting(1.5, "... a spike must be at least this x baseline",
                                         above=1, live=(1.001, 100.0))

    def _start(self) -> None:
        self._log_early_ratio = math.log(max(self.min_ratio, self.early_min_ratio))
        self._median = stats.RollingQuantile(q=0.5, window_size=self.window)
        self._tail = stats.RollingQuantile(q=self.tail_quantile, window_size=self.tail_window)
        self._log_min_ratio = math.log(self.min_ratio)
        self._n = 0
        self._quiet = self.cooldown
        self._episode = None

    def _derive(self) -> None:
        self._log_early_ratio = math.log(max(self.min_ratio, self.early_min_ratio))
        self._log_min_ratio = math.log(self.min_ratio)

    def update(self, item) -> list[Finding]:
        if type(item) is not dict or item.get("k") != "jobstep":
            return []
        field = self.FIELD
        if field in POSITIVE_FIELDS:
            value = column_median(step_summary(item)[field])
        else:                         # a field no partial carries: from the records
            values = [x for rec in item.get("ranks", {}).values()
                      if (x := num(rec.get(field))) is not None and x > 0 and x - x == 0]
            value = (median(values) if len(values) > 1 else values[0]) if values else None
        if value is None:
            return []
        return self.learn(value, item["step"], item["first_ts"], item["ts"])

    def learn(self, value: float, step: int, onset_ts: float, ts: float) -> list[Finding]:
        """One job-level value; usable directly on a plain curve (as the tests do on Pythia)."""
        y = math.log(value)
        self._n += 1
        if self._n <= 2:
            self._median.update(y)
            return []
        base = self._median.get()
        dev = y - base
        tail = self._tail.get() or 0.0
        threshold = max(self.tail_factor * tail, self._log_min_ratio)
        # judged before the tail learns this step: the rise's own steps widen it
        rise = self._rise(y, base, tail) if self.rise_steps else None
        clipped = dev if dev < threshold else threshold
        self._median.update(base + clipped)
        self._tail.update(clipped if clipped > 0 else 0.0)
        if self._n <= self.early_steps and threshold < self._log_early_ratio and \
                dev <= self._log_early_ratio:
            dev = 0.0       # young curves are rough: only a big jump counts there
        if self._n <= self.warmup or (dev <= threshold and rise is None):
            self._quiet += 1
            if self._quiet >= self.cooldown:
                self._episode = None
            return []
        self._quiet = 0
        if self._episode is not None:
            return []
        self._episode = step
        evidence = {}
        if rise is not None and dev <= threshold:
            base, steps = rise          # found by the rise: against the level before it
            evidence = {"rise_steps": steps}
        baseline = math.exp(base)
        ratio = value / baseline
        if evidence:
            how = (f"rose to {value:.4g} at step {step}, {ratio:.2f}x its level {baseline:.4g} "
                   f"before a rise of {evidence['rise_steps']} steps")
        else:
            how = f"jumped to {value:.4g} at step {step}, {ratio:.2f}x its baseline {baseline:.4g}"
        return [Finding(
            kind=self.KIND, severity="warning", ranks=[], nodes=[], step=step, onset_ts=onset_ts,
            detected_ts=ts, detector=self.PREFIX, summary=f"{self.FIELD} {how}",
            evidence={"value": value, "baseline": baseline, "ratio": ratio,
                      "threshold_ratio": math.exp(threshold), "steps_seen": self._n,
                      **evidence})]

    def _rise(self, y: float, base: float, tail: float):
        """``(reference, steps)`` when log value ``y`` completes a fast rise, else None.

        A rise is a run of consecutive steps above the normal band: above the baseline by
        more than the tail quantile and by at least ``BAND_FLOOR``. It is measured from the
        level before its first step: the higher of the baseline then and the value of that
        step's predecessor (so a drift the rolling median lags behind is not a rise), not a
        baseline its own steps have moved. It is a spike once, at its second to
        ``rise_steps``-th step, it reaches ``rise_ratio`` x that level; a single step is
        left to the tail.
        """
        last, self._last = self._last, y
        if y - base <= max(tail, self.BAND_FLOOR):
            self._run = 0
            return None
        if self._run == 0:
            self._run_base = base if last is None or last < base else last
        self._run += 1
        if 2 <= self._run <= self.rise_steps and y - self._run_base >= self._log_rise_ratio:
            return self._run_base, self._run
        return None


@register_detector(kinds="loss_spike", ladder=("rollback_if_repeated", "alert"),
                   priority=80, causes={"loss_spike": "any", "grad_spike": "any"})
class LossSpikeDetector(SpikeDetector):
    """Loss spikes (see :class:`SpikeDetector`).

    >>> d = LossSpikeDetector(warmup=20)
    >>> curve = [3.0 + 0.01 * ((s * 7) % 5) for s in range(60)] + [4.8] + [3.0] * 5
    >>> [(f.step, round(f.evidence["ratio"], 2)) for s, x in enumerate(curve)
    ...  for f in d.learn(x, s, float(s), float(s))]
    [(60, 1.59)]
    """

    PREFIX = "loss_spike"
    FIELD = "loss"
    KIND = "loss_spike"


@register_detector(kinds="grad_spike", ladder=("rollback_if_repeated", "alert"),
                   priority=90, causes={"grad_spike": "any", "loss_spike": "any"})
class GradSpikeDetector(SpikeDetector):
    """Gradient-norm spikes (see :class:`SpikeDetector`); needs a bigger jump (``min_ratio``).

    >>> d = GradSpikeDetector(warmup=20)
    >>> norms = [1.0 + 0.1 * ((s * 3) % 4) for s in range(60)] + [2.0, 9.0, 1.1]
    >>> [(f.step, round(f.evidence["value"], 1)) for s, x in enumerate(norms)
    ...  for f in d.learn(x, s, float(s), float(s))]
    [(61, 9.0)]

    The norm leads a divergence: it can rise by an order of magnitude over a few steps
    before the loss moves (BLOOM-176B's first spike: about 60x in three steps). A rise that
    reaches ``rise_ratio`` x the level from before it within ``rise_steps`` steps (two at
    least) is a spike even where the tail or the early steps ask for more. Here, at step
    30 of a young job, the rise 4x, 15x, 60x is reported at its second step:

    >>> norms = [1.0 + 0.05 * ((s * 3) % 4) for s in range(30)] + [4.2, 15.8, 63.0, 40.0]
    >>> def spikes(d):
    ...     return [(f.step, round(f.evidence["ratio"], 1), f.evidence.get("rise_steps"))
    ...             for s, x in enumerate(norms) for f in d.learn(x, s, float(s), float(s))]
    >>> spikes(GradSpikeDetector())
    [(31, 13.7, 2)]

    Without it (``rise_steps=0``) the tail, widened by the rise's own first step (a young
    tail's high quantile is about its largest value), asks for 25x at the second step and
    15,000x at the third, and the rise goes unreported:

    >>> spikes(GradSpikeDetector(rise_steps=0))
    []

    A slower rise (a warm-up of the learning rate, a drift) is learned by the baseline, and
    a rise is measured from the value before it where the rolling median lags behind that.
    A single step is left to the tail, so a curve with heavy-tailed noise is judged by
    what it has shown.
    """

    PREFIX = "grad_spike"
    FIELD = "grad_norm"
    KIND = "grad_spike"

    @dataclass(kw_only=True)
    class Config(SpikeDetector.Config):
        min_ratio: float = setting(2.5, "... and value > min_ratio x baseline", above=1,
                                   live=(1.001, 100.0))
        early_min_ratio: float = setting(5.0, "... a spike must be at least this x baseline",
                                         above=1, live=(1.001, 100.0))
        rise_ratio: float = setting(10.0, "a norm this x its level before a rise ...", above=1)
        rise_steps: int = setting(4, "... of 2 to this many steps is a spike (0: off)")

    def _start(self) -> None:
        super()._start()
        self._log_rise_ratio = math.log(self.rise_ratio)
        self._run = 0                  # consecutive steps above the normal band, up to now
        self._run_base = 0.0           # the log level before the first of them
        self._last = None              # the log value of the step before

    def _derive(self) -> None:
        super()._derive()
        self._log_rise_ratio = math.log(self.rise_ratio)
