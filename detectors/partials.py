"""What the step detectors need of a closed step, as partial summaries that merge.

A partial (:func:`partial_of`) is what one telemetry partition's ranks reported for one
step: how many reported, the ranks whose loss or gradient norm is not finite, the largest
finite loss scale, and, per field the detectors take a median of (loss, gradient norm,
step time, step time per token, compute time), either the values themselves (up to
``exact_upto`` of them) or a log-bucket sketch: per bucket of relative width
:data:`BUCKET`, the count, the first value and the sum of the others' differences from it.
The compute times also keep the ranks of the ``k`` slowest. :func:`merge` adds partials
up; :func:`column_median` is the median of a merged field, exact where every partial kept
its values, else the mean of the bucket it falls in: within :data:`BUCKET` of the true one,
and exact when that bucket's values are all equal (as a step's loss is on the ranks of one
tensor-parallel group).

So the job side's work for a step grows with the partitions that sent partials, not with
the ranks (issue 21, point 1). A ``jobstep`` that carries its ranks' records gets its
summary worked out from them once, exactly (:func:`step_summary`).

>>> recs = {r: {"rank": r, "ts": 5.0, "loss": 2.0 + r / 100, "step_time": 1.0,
...             "compute_time": 0.9 if r != 3 else 1.8} for r in range(6)}
>>> parts = [partial_of({r: recs[r] for r in half}, exact_upto=0) for half in ((0, 1, 2), (3, 4, 5))]
>>> whole = merge(parts)
>>> whole["n"], round(column_median(whole["loss"]), 4), column_median(whole["compute_time"])
(6, 2.025, 0.9)
>>> slowest(whole["compute_time"])
[(1.8, 3), (0.9, 0), (0.9, 1), (0.9, 2), (0.9, 4), (0.9, 5)]
"""
from __future__ import annotations

import heapq
import math

import numpy as np

from .base import median, num
from .peers import ARRAYS_FROM, StepTimes, step_times

__all__ = ["BUCKET", "EXACT_UPTO", "NAMED_UPTO", "SLOWEST_K", "ZERO_BUCKET", "MEDIAN_FIELDS",
           "POSITIVE_FIELDS", "partial_of", "merge", "from_wire", "PartialBuilder",
           "column_median", "middle_positions", "values_at", "buckets_of", "slowest",
           "peer_references", "peer_ratio", "standing_out", "step_summary"]

#: a sketch bucket's relative width: a median read from a sketch is within this of the
#: true one
BUCKET = 0.002
_INV_LOG_GAMMA = 1.0 / math.log1p(BUCKET)
_HALF, _LOW = 1 << 31, (1 << 32) - 1
#: the bucket index of a zero (below every other)
ZERO_BUCKET = -(1 << 62)
#: a partial of at most this many values of a field sends them as they are
EXACT_UPTO = 32
#: the non-finite ranks a partial names (how many there were is always sent)
NAMED_UPTO = 1024
#: the slowest ranks by compute time a partial names
SLOWEST_K = 8
#: the fields whose median across ranks a detector reads (``per_token`` is the step time
#: over the rank's tokens)
MEDIAN_FIELDS = ("loss", "grad_norm", "step_time", "per_token", "compute_time")
#: those whose column holds the finite values above 0 only (``compute_time`` keeps 0)
POSITIVE_FIELDS = ("loss", "grad_norm", "step_time", "per_token")


def _slow(pair):
    """Slower first; of equal times, the lower rank first."""
    return pair[0], -pair[1]


def _sketch(values) -> dict:
    if len(values) >= ARRAYS_FROM:
        return _sketch_arrays([values])[0]
    buckets: dict = {}
    zeros = 0
    log, ceil, k = math.log, math.ceil, _INV_LOG_GAMMA
    for x in values:
        if x <= 0.0:
            zeros += 1
            continue
        i = ceil(log(x) * k)
        b = buckets.get(i)
        if b is None:
            buckets[i] = [1, x, 0.0]
        else:
            b[0] += 1
            b[2] += x - b[1]
    return {"n": len(values), "b": buckets, "z": zeros}


def _sketch_arrays(columns: list) -> list:
    """:func:`_sketch` of each of ``columns`` (lists of many values) with one numpy pass: the
    same buckets, each's first value the first of its list that fell in it."""
    x = np.concatenate([np.asarray(c, dtype=np.float64) for c in columns])
    which = np.repeat(np.arange(len(columns)), [len(c) for c in columns])
    positive = x > 0.0
    zeros = np.bincount(which[~positive], minlength=len(columns)).tolist()
    x, which = x[positive], which[positive]
    # a bucket's key: its column in the high bits, its index + 2**31 in the low ones (an
    # index is within +-2**31 for any float: |log x| < 710 over a bucket's log width)
    keys = np.ceil(np.log(x) * _INV_LOG_GAMMA).astype(np.int64) + ((which << 32) + _HALF)
    keys, first_at, inverse, counts = np.unique(keys, return_index=True, return_inverse=True,
                                                return_counts=True)
    first = x[first_at]
    more = np.bincount(inverse, weights=x - first[inverse], minlength=len(keys))
    out = [{"n": len(c), "b": {}, "z": z} for c, z in zip(columns, zeros)]
    for key, c, f, m in zip(keys.tolist(), counts.tolist(), first.tolist(), more.tolist()):
        out[key >> 32]["b"][(key & _LOW) - _HALF] = [c, f, m]
    return out


def partial_of(ranks: dict, *, exact_upto: int | None = EXACT_UPTO,
               named_upto: int | None = NAMED_UPTO, k: int = SLOWEST_K) -> dict:
    """The partial summary of one step's records ``{rank: record}`` (``exact_upto=None``:
    every value kept, ``named_upto=None``: every non-finite rank named, as the job side does
    for a step whose records it holds). Its compute times are those of
    :func:`~.peers.step_times`, in the same order."""
    loss_v, grad_v, step_v, token_v, compute_v, compute_r = [], [], [], [], [], []
    bad_loss, bad_grad = [], []
    bad_ts = math.inf
    seen_grad = uncounted = 0
    scaled, top_scale = False, 0.0
    for rank, rec in ranks.items():
        loss, grad = rec.get("loss"), rec.get("grad_norm")
        if type(loss) is not float:       # a float is the common case: no num() call
            loss = num(loss)
        if type(grad) is not float:
            grad = num(grad)
        if loss is not None:
            if loss - loss != 0:
                bad_loss.append(rank)
                bad_ts = min(bad_ts, rec["ts"])
            elif loss > 0:
                loss_v.append(loss)
        if grad is not None:
            seen_grad += 1
            if grad - grad != 0:
                bad_grad.append(rank)
                bad_ts = min(bad_ts, rec["ts"])
            elif grad > 0:
                grad_v.append(grad)
        scale = rec.get("loss_scale")
        if scale is not None:
            scaled = True
            if type(scale) is not float:
                scale = num(scale)
            if scale is not None and scale - scale == 0 and scale > top_scale:
                top_scale = scale
        t = rec.get("step_time")
        if type(t) is not float:
            t = num(t)
        if t is not None and t > 0 and t - t == 0:
            step_v.append(t)
            n = rec.get("tokens")
            if type(n) is int and n > 0:
                token_v.append(t / n)
            else:
                uncounted += 1
        ct = rec.get("compute_time")
        if type(ct) is not float:
            ct = num(ct)
        if ct is not None and ct >= 0 and ct - ct == 0:
            compute_v.append(ct)
            compute_r.append(rank)
    values = (loss_v, grad_v, step_v, token_v, compute_v)
    columns: list = [None] * 5
    many = []
    for i, v in enumerate(values):
        if exact_upto is None or len(v) <= exact_upto:
            columns[i] = {"n": len(v), "v": v}
        elif len(v) < ARRAYS_FROM:
            columns[i] = _sketch(v)
        else:
            many.append(i)
    if many:
        for i, column in zip(many, _sketch_arrays([values[i] for i in many])):
            columns[i] = column
    compute = columns[4]
    if "v" in compute:
        compute["r"] = compute_r
    else:
        compute["top"] = [list(p) for p in heapq.nlargest(k, zip(compute_v, compute_r),
                                                          key=_slow)]
    return {"n": len(ranks), "loss": columns[0], "grad_norm": columns[1],
            "step_time": columns[2], "per_token": columns[3], "uncounted": uncounted,
            "compute_time": compute,
            "bad_loss": bad_loss[:named_upto], "bad_loss_n": len(bad_loss),
            "bad_grad": bad_grad[:named_upto], "bad_grad_n": len(bad_grad),
            "bad_ts": bad_ts if bad_loss or bad_grad else None,
            "seen_grad": seen_grad, "scaled": scaled, "top_scale": top_scale}


class PartialBuilder:
    """The partials of one job's steps for the ranks one telemetry partition carries.

    It remembers the ranks whose late record (one that came after its step was closed) had
    a non-finite loss, until the rank reports a finite one: a partial names those that do
    under ``"recovered"``, so that the job side ends their episodes as it would from their
    records (:class:`~.training.NanDetector`). Memory: those ranks only.

    >>> b = PartialBuilder()
    >>> b.late({"rank": 4, "loss": "NaN"})
    >>> b.partial({4: {"rank": 4, "ts": 1.0, "loss": 2.0}})["recovered"]
    [4]
    >>> "recovered" in b.partial({4: {"rank": 4, "ts": 2.0, "loss": 2.0}})
    False
    """

    def __init__(self, *, exact_upto: int | None = EXACT_UPTO, named_upto: int = NAMED_UPTO,
                 k: int = SLOWEST_K):
        self.exact_upto, self.named_upto, self.k = exact_upto, named_upto, k
        self._late_bad: set = set()

    def late(self, record: dict) -> None:
        loss = num(record.get("loss"))
        if loss is None:
            return
        if loss - loss == 0:
            self._late_bad.discard(record["rank"])
        else:
            self._late_bad.add(record["rank"])

    def partial(self, ranks: dict) -> dict:
        out = partial_of(ranks, exact_upto=self.exact_upto, named_upto=self.named_upto,
                         k=self.k)
        if self._late_bad:
            recovered = []
            for rank in list(self._late_bad):
                rec = ranks.get(rank)
                loss = num(rec.get("loss")) if rec is not None else None
                if loss is not None and loss - loss == 0:
                    self._late_bad.discard(rank)
                    recovered.append(rank)
            if recovered:
                out["recovered"] = sorted(recovered)
        return out


def _merge_columns(columns: list, k: int) -> dict:
    if all("v" in c for c in columns):
        out = {"n": sum(c["n"] for c in columns), "v": [x for c in columns for x in c["v"]]}
        if all("r" in c for c in columns):
            out["r"] = [r for c in columns for r in c["r"]]
        return out
    buckets: dict = {}
    zeros, n, tops = 0, 0, []
    for c in columns:
        n += c["n"]
        if "v" in c:
            part = _sketch(c["v"])
            if "r" in c:
                tops += zip(c["v"], c["r"])
        else:
            part = c
            tops += map(tuple, c.get("top", ()))
        zeros += part["z"]
        for i, (count, first, more) in part["b"].items():
            b = buckets.get(i)
            if b is None:
                buckets[i] = [count, first, more]
            else:
                b[0] += count
                b[2] += more + count * (first - b[1])
    out = {"n": n, "b": buckets, "z": zeros}
    if tops:
        out["top"] = [list(p) for p in heapq.nlargest(k, tops, key=_slow)]
    return out


def merge(partials: list, *, named_upto: int = NAMED_UPTO, k: int = SLOWEST_K) -> dict:
    """One partial of the ranks of all of ``partials`` (the same step)."""
    if len(partials) == 1:
        return partials[0]
    out = {"n": sum(p["n"] for p in partials), "uncounted": sum(p["uncounted"] for p in partials),
           "seen_grad": sum(p["seen_grad"] for p in partials),
           "scaled": any(p["scaled"] for p in partials),
           "top_scale": max(p["top_scale"] for p in partials)}
    for field in MEDIAN_FIELDS:
        out[field] = _merge_columns([p[field] for p in partials], k)
    for name in ("bad_loss", "bad_grad"):
        out[name] = [r for p in partials for r in p[name]][:named_upto]
        out[name + "_n"] = sum(p[name + "_n"] for p in partials)
    recovered = [r for p in partials for r in p.get("recovered", ())]
    if recovered:
        out["recovered"] = recovered
    stamps = [p["bad_ts"] for p in partials if p["bad_ts"] is not None]
    out["bad_ts"] = min(stamps) if stamps else None
    return out


def column_median(column: dict):
    """The median of a (merged) field: exact from its values, else from its buckets (the
    mean of each of the one or two middle buckets); None when no rank reported it.

    >>> column_median(merge([partial_of({0: {"ts": 0, "loss": 1.0}}, exact_upto=0),
    ...                      partial_of({1: {"ts": 0, "loss": 1.001}}, exact_upto=0)])["loss"])
    1.0005"""
    n = column["n"]
    if not n:
        return None
    if "v" in column:
        values = column["v"]
        return median(values) if n > 1 else values[0]
    found = values_at(column, middle_positions(n))
    return sum(found) / len(found)


def middle_positions(n: int) -> tuple:
    """The positions, in order, of the one or two middle values of ``n`` (their mean is the
    median, as :func:`~.base.median` takes it)."""
    return (n // 2,) if n % 2 else (n // 2 - 1, n // 2)


def values_at(column: dict, positions) -> list:
    """The values at ``positions`` (ascending, each below ``column["n"]``) of the field's
    values in order: exact from its values, else each its bucket's mean (0.0 for a zero)."""
    if "v" in column:
        ordered = sorted(column["v"])
        return [ordered[p] for p in positions]
    want = list(positions)
    found = []
    seen = column["z"]
    for w in want:
        if w < seen:
            found.append(0.0)
    if len(found) < len(want):
        buckets = column["b"]
        for i in sorted(buckets):
            count, first, more = buckets[i]
            seen += count
            while len(found) < len(want) and want[len(found)] < seen:
                found.append(first + more / count)
            if len(found) == len(want):
                break
    return found


def buckets_of(column: dict) -> list:
    """``[(value, count), ...]`` of a field: each value of an exact column once, else each
    bucket's mean with its count (zeros first)."""
    if "v" in column:
        return [(v, 1) for v in column["v"]]
    out = [(0.0, column["z"])] if column["z"] else []
    out += [(first + more / count, count) for count, first, more in column["b"].values()]
    return out


def peer_references(column: dict, needed: int):
    """A group's ``(middle, below, at, above, middle's bucket)``: the median of a rank's peers
    is ``below`` for a value under the middle one, ``above`` over it, ``at`` for it (as
    :func:`~.peers.peer_ratio_array`). Of a sketch, "under" and "over" are by bucket (a value
    in the middle's bucket takes ``at``: the bucket's mean does not tell on which side of the
    middle its values lie); of exact values, the bucket is None. None: too few ranks to
    judge; ``()``: one rank."""
    n = column["n"]
    if n < needed:
        return None
    m = n - 1
    if m < 1:
        return ()
    h = m // 2
    bucket = None if "v" in column else _bucket_at(column, h)
    if m % 2:
        mid, after = values_at(column, (h, h + 1))
        return mid, after, after, mid, bucket
    before, mid, after = values_at(column, (h - 1, h, h + 1))
    return mid, (mid + after) / 2, (before + after) / 2, (before + mid) / 2, bucket


def _bucket_at(column: dict, position: int) -> int:
    """The index of the sketch's bucket that holds ``position`` (a zero's: below all)."""
    seen = column["z"]
    if position < seen:
        return ZERO_BUCKET
    for i in sorted(column["b"]):
        seen += column["b"][i][0]
        if position < seen:
            return i
    raise IndexError(position)


def _bucket_of(value: float) -> int:
    return math.ceil(math.log(value) * _INV_LOG_GAMMA) if value > 0 else ZERO_BUCKET


def peer_ratio(value: float, refs) -> float:
    """``value`` over the median of its peers' values, from :func:`peer_references`
    (0.0: too few to judge)."""
    if refs is None:
        return 0.0
    if not refs:
        return 1.0
    mid, below, at, above, bucket = refs
    if bucket is None:
        ref = below if value < mid else above if value > mid else at
    else:
        i = _bucket_of(value)
        ref = below if i < bucket else above if i > bucket else at
    return value / ref if ref > 0 else 1.0


def slowest(column: dict) -> list:
    """``[(value, rank), ...]``, slowest first: every rank of an exact compute-time column,
    else the ``k`` slowest the partials named."""
    if "r" in column:
        return sorted(zip(column["v"], column["r"]), key=_slow, reverse=True)
    return [tuple(p) for p in column.get("top", ())]


def step_summary(item: dict) -> dict:
    """The merged partial of a ``jobstep``: the one it carries (``"agg"``, merged from the
    partitions' partials), else worked out once from its ranks' records, every value kept
    (cached in the item under ``"_agg"``)."""
    agg = item.get("agg")
    if agg is None:
        agg = item.get("_agg")
        if agg is None:
            agg = item["_agg"] = partial_of(item["ranks"], exact_upto=None, named_upto=None)
            if "_step_times" not in item:      # the same ranks and times: not looped again
                compute = agg["compute_time"]
                item["_step_times"] = StepTimes(compute["r"], compute["v"])
    return agg


def standing_out(item: dict, agg: dict, ratio: float) -> list:
    """The ranks whose compute time is at least ``ratio`` x the median of the others': of a
    ``jobstep`` with its records, every such rank (:meth:`~.peers.StepTimes.standing_out`);
    of one merged from partials, those among the slowest they named (up to ``k``), against
    the median of their peers read from the sketch (so half of the ranks slow still stand
    out)."""
    if item.get("agg") is None:
        return step_times(item).standing_out(ratio)
    column = agg["compute_time"]
    if "r" in column:
        return StepTimes(column["r"], column["v"]).standing_out(ratio)
    refs = peer_references(column, 1)
    return [rank for value, rank in slowest(column) if peer_ratio(value, refs) >= ratio]


def from_wire(partial: dict) -> dict:
    """A partial decoded from JSON, its buckets' indices numbers again (JSON object keys are
    strings): what :func:`merge` and :func:`column_median` take."""
    for field in MEDIAN_FIELDS:
        column = partial.get(field)
        if column is not None and "b" in column:
            column["b"] = {int(i): b for i, b in column["b"].items()}
    return partial
