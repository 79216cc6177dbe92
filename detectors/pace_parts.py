"""The straggler's book split by telemetry partition: each rank's pace kept where its records
are, only sketches between (issue 21 point 1; step 4 of the plan in docs/WORKER.md).

:class:`PaceParts` applies :class:`~.straggler.StragglerDetector`'s rules as
:class:`~.straggler.PaceDicts` does, with each partition's ranks in a ``PaceDicts`` of their
own (what the rank side would keep). What crosses partitions is what a job side would merge
and send back, no rank's record:

- per step, from each partition, one sketch (:mod:`.partials`) of its ranks' scaled compute
  times per peer group (``t / usual share``); back, each group's references (the three
  order statistics the median of a rank's peers is one of) and the step's shift (the median
  ratio of the ranks that are not slow), both worked out from the merged sketches;
- when ranks end their warm-up, from each partition a sketch of its warm ranks' usual
  shares per group; back, each group's median and how many ranks sit a ``ratio`` above it.

A sketch keeps a partition's values as they are up to ``exact_upto`` of them (then the
answers are those of value comparisons, as :class:`~.straggler.PaceArrays` makes), else
log buckets 0.2% wide: a reference within 0.2% of the true one. Built beside today's path
and checked against it on the scenario library (``tests/test_pace_parts.py``); nothing
travels over Kafka yet, and the references would come back a round trip after the step.

>>> from .straggler import StragglerDetector
>>> from .base import make_jobstep
>>> detector = StragglerDetector(k=2, n=3, settle=0, warmup=3)
>>> detector._paces = book = PaceParts(4, exact_upto=0)      # 4 partitions, all sketched
>>> found = []
>>> for step in range(10):
...     times = [0.9 + 0.01 * (r % 3) for r in range(12)]
...     times[9] *= 1.5 if step >= 5 else 1.0                  # rank 9 (partition 1) slows
...     found += detector.update(make_jobstep(step, 100.0 + step, compute_time=times))
>>> [(f.ranks, f.step, f.evidence["mean_ratio"]) for f in found]
[([9], 5, {'9': 1.333})]
>>> scaled, sent = book.scaled([{1: 0.9, 5: 0.92}, {}, {}, {3: 0.9}], 0)
>>> [column["n"] for column in sent[0]]                          # what crosses: no ranks
[2, 1]
"""
from __future__ import annotations

import math

import numpy as np

from .partials import (_INV_LOG_GAMMA, EXACT_UPTO, ZERO_BUCKET, _merge_columns, _sketch,
                       buckets_of, middle_positions, peer_ratio, peer_references, values_at)
from .base import median
from .straggler import PaceArrays, PaceDicts

__all__ = ["PaceParts", "answer"]


class PaceParts:
    """The straggler's book over ``partitions`` partitions (a rank's is ``rank % partitions``),
    with the interface of :class:`~.straggler.PaceDicts`; each partition's own book is a
    ``PaceDicts``, or with ``arrays`` a ``PaceArrays`` (large partitions)."""

    def __init__(self, partitions: int, exact_upto: int | None = EXACT_UPTO,
                 arrays: bool = False, n: int = 10):
        self.arrays = arrays
        self.parts = [PaceArrays(n) if arrays else PaceDicts() for _ in range(partitions)]
        self.exact_upto = exact_upto

    def _part(self, rank):
        return self.parts[rank % len(self.parts)]

    def _column(self, values: list) -> dict:
        if self.exact_upto is None or len(values) <= self.exact_upto:
            return {"n": len(values), "v": values}
        return _sketch(values)

    def judge(self, d, st, step, ts, size: int) -> list:
        if self.arrays:
            return self._judge_arrays(d, st, step, ts, size)
        count = len(self.parts)
        times = [{} for _ in range(count)]
        for rank, t in zip(st.ranks, st.values):
            times[rank % count][rank] = t
        scaled, sent = self.scaled(times, size)
        refs, usual = answer(sent, d.min_ranks if size else 1, d.ratio)
        shift = math.log(usual) if usual else 0.0      # as PaceDicts.judge takes it
        qualifying, learned_now = [], []
        for part, own, mine in zip(self.parts, times, scaled):
            ratios = {rank: peer_ratio(v, refs[rank // size if size else 0])
                      for rank, v in mine.items()}
            found, learned = part.apply(d, own, ratios, shift, step, ts)
            qualifying += found
            learned_now += learned
        if learned_now:
            self._slow_from_the_start(d, learned_now)
        return qualifying

    def _judge_arrays(self, d, st, step, ts, size: int) -> list:
        count = len(self.parts)
        ranks = np.array(st.ranks, dtype=np.int64)
        where = ranks % count
        mine, sent = [], {}
        for p, part in enumerate(self.parts):        # the rank side, each partition
            sel = np.flatnonzero(where == p)
            if not len(sel):
                mine.append(None)
                continue
            own = ranks[sel]
            rows = part.rows.rows(own.tolist(), part._grow)
            times = st.times[sel]
            scaled = times / part.share[rows]
            keys = own // size if size else np.zeros(len(own), dtype=np.int64)
            mine.append((rows, times, scaled, keys))
            for key in np.unique(keys).tolist():
                sent.setdefault(key, []).append(self._column(scaled[keys == key].tolist()))
        refs, usual = answer(sent, d.min_ranks if size else 1, d.ratio)
        shift = float(np.log(usual)) if usual else 0.0  # as PaceArrays.judge takes it
        qualifying, learned_now = [], []
        for part, got in zip(self.parts, mine):
            if got is None:
                continue
            rows, times, scaled, keys = got
            ratios = np.zeros(len(scaled))
            for key in np.unique(keys).tolist():
                sel = keys == key
                ratios[sel] = _ratio_array(scaled[sel], refs[key])
            found, learned = part.apply(d, rows, times, ratios, shift, step, ts)
            qualifying += found
            rank_of = part.rows.rank_of
            learned_now += [rank_of[r] for r in learned.tolist()]
        if learned_now:
            self._slow_from_the_start(d, learned_now)
        return qualifying

    def scaled(self, times: list, size: int) -> tuple:
        """The rank side's half before the job side answers: each partition's ranks' times
        over their usual shares, and ``{group: [one column per partition]}`` to send."""
        scaled, sent = [], {}
        for part, own in zip(self.parts, times):
            base = part.base
            mine = {}
            for rank, t in own.items():
                b = base.get(rank)
                mine[rank] = t / b[2] if b is not None else t
            scaled.append(mine)
            groups: dict = {}
            for rank, v in mine.items():
                groups.setdefault(rank // size if size else 0, []).append(v)
            for key, values in groups.items():
                sent.setdefault(key, []).append(self._column(values))
        return scaled, sent

    def _slow_from_the_start(self, d, learned_now) -> None:
        """Each group's median usual share and how many ranks sit ``ratio`` above it, from
        the partitions' warm ranks: their levels as they are when every partition has few
        (``median(levels)``, as one book takes it), else sketches of the shares."""
        cut = math.log(d.ratio)
        sent: dict = {}
        for part in self.parts:
            for key, levels in part.warm_levels(d, learned_now).items():
                sent.setdefault(key, []).append(levels)
        judged = {}
        for key, lists in sent.items():
            if self.exact_upto is None or all(len(x) <= self.exact_upto for x in lists):
                levels = [v for x in lists for v in x]
                mid = median(levels)
                judged[key] = (mid, sum(1 for v in levels if v - mid >= cut), len(levels))
                continue
            column = _merge_columns([self._column([math.exp(v) for v in x]) for x in lists], 0)
            n = column["n"]
            middle = values_at(column, middle_positions(n))
            mid = sum(math.log(v) for v in middle) / len(middle)
            high = sum(c for v, c in buckets_of(column) if math.log(v) - mid >= cut)
            judged[key] = (mid, high, n)
        for part in self.parts:
            mine = [rank for rank in learned_now if self._part(rank) is part]
            if mine:
                part.set_back(d, mine, judged)

    def rising(self, d, qualifying) -> bool:
        return any(part.rising(d, qualifying) for part in self.parts)

    def slow_count(self, rank) -> int:
        return self._part(rank).slow_count(rank)

    def history(self, rank) -> list:
        return self._part(rank).history(rank)

    def mark_named(self, ranks) -> None:
        for rank in ranks:
            self._part(rank).mark_named([rank])


def _ratio_array(values: np.ndarray, refs) -> np.ndarray:
    """:func:`~.partials.peer_ratio` of each of ``values``."""
    if refs is None:
        return np.zeros(len(values))
    if not refs:
        return np.ones(len(values))
    mid, below, at, above, middle = refs
    if middle is None:
        ref = np.where(values < mid, below, np.where(values > mid, above, at))
    else:                           # a sketch's middle: its bucket, not its mean, divides
        index = np.full(len(values), ZERO_BUCKET, dtype=np.int64)
        positive = values > 0
        index[positive] = np.ceil(np.log(values[positive]) * _INV_LOG_GAMMA).astype(np.int64)
        ref = np.where(index < middle, below, np.where(index > middle, above, at))
    out = np.ones(len(values))
    np.divide(values, ref, out=out, where=ref > 0)
    return out


def answer(sent: dict, needed: int, ratio: float) -> tuple:
    """The job side's half: ``({group: references}, usual)`` from each group's columns (one
    per partition), ``needed`` ranks in a group to judge it; ``usual``, the median ratio of
    the ranks that are not slow (its log is the step's shift; None: none)."""
    merged = {key: _merge_columns(columns, 0) for key, columns in sent.items()}
    refs = {key: peer_references(column, needed) for key, column in merged.items()}
    return refs, _usual(merged, refs, ratio)


def _usual(merged: dict, refs: dict, ratio: float):
    """The median ratio, below ``ratio``, of the step's ranks, from the merged sketches (each
    bucket's ranks at its mean's ratio); None when no rank's is."""
    usual = []
    for key, column in merged.items():
        for value, count in buckets_of(column):
            r = peer_ratio(value, refs[key])
            if 0 < r < ratio:
                usual.append((r, count))
    total = sum(c for _, c in usual)
    if not total:
        return None
    usual.sort()
    want = middle_positions(total)
    found, seen = [], 0
    for r, c in usual:
        seen += c
        while len(found) < len(want) and want[len(found)] < seen:
            found.append(r)
        if len(found) == len(want):
            break
    return (found[0] + found[-1]) / 2 if len(found) == 2 else found[0]
