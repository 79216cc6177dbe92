"""A closed step's compute times, each rank's ratio to its peers, and rows of per-rank state
in arrays: what the step detectors need of a large step without one Python call per rank.

A step of fewer than :data:`ARRAYS_FROM` ranks is worked out with plain loops (numpy's fixed
cost per call is more than a loop over a few ranks), a larger one with numpy.

>>> js = make_jobstep(3, 10.0, compute_time=[1.0, 1.0, 2.0, float("nan"), 2.0])
>>> st = step_times(js)
>>> st.ranks, st.values, st.standing_out(1.5)
([0, 1, 2, 4], [1.0, 1.0, 2.0, 2.0], [2, 4])
"""
from __future__ import annotations

import operator

import numpy as np

from .base import make_jobstep, num

__all__ = ["StepTimes", "step_times", "peer_ratios", "peer_ratio_array", "array_median",
           "RankRows", "ARRAYS_FROM"]

#: the ranks of a step from which it is worked out with numpy
ARRAYS_FROM = 128


class StepTimes:
    """The ranks of a ``jobstep`` that reported a usable ``compute_time`` (finite, >= 0), in
    the item's order: ``ranks`` and ``values`` (lists), ``times`` (the values as float64)."""

    __slots__ = ("ranks", "values", "_times")

    def __init__(self, ranks: list, values: list):
        self.ranks = ranks
        self.values = values
        self._times = None

    def __len__(self) -> int:
        return len(self.ranks)

    @property
    def times(self) -> np.ndarray:
        if self._times is None:
            self._times = np.array(self.values, dtype=np.float64)
        return self._times

    def standing_out(self, ratio: float) -> list:
        """The ranks whose time is at least ``ratio`` x the median of the others'."""
        if len(self.ranks) < ARRAYS_FROM:
            ratios = peer_ratios(dict(zip(self.ranks, self.values)))
            return [r for r in self.ranks if ratios[r] >= ratio]
        ranks = self.ranks
        return [ranks[i] for i in np.flatnonzero(peer_ratio_array(self.times) >= ratio).tolist()]


def step_times(item) -> StepTimes:
    """The :class:`StepTimes` of a jobstep, worked out once for all the detectors that look
    at it (kept in the item under ``"_step_times"``)."""
    view = item.get("_step_times")
    if view is None:
        ranks, values = [], []
        for rank, rec in item["ranks"].items():
            ct = rec.get("compute_time")
            if type(ct) is not float:             # a float is the common case: no num() call
                ct = num(ct)
            if ct is not None and ct >= 0 and ct - ct == 0:
                ranks.append(rank)
                values.append(ct)
        view = item["_step_times"] = StepTimes(ranks, values)
    return view


_value = operator.itemgetter(1)


def peer_ratios(times: dict) -> dict:
    """``{rank: time / median of the other ranks' times}``, a loop (few ranks).

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


def peer_ratio_array(values: np.ndarray) -> np.ndarray:
    """Each value over the median of the *other* values (1.0 where that median is 0), as
    :func:`peer_ratios` over an array (many ranks).

    Leaving out one value, the median of the rest is one of three numbers, for a value
    below, at or above the middle; ties get the same number whichever of them is taken
    for the middle one, so three order statistics do (no sort).

    >>> peer_ratio_array(np.array([1.0, 2.0, 1.0, 2.0])).tolist()
    [0.5, 2.0, 0.5, 2.0]
    >>> peer_ratio_array(np.array([3.0, 0.0, 0.0])).tolist()
    [1.0, 0.0, 0.0]
    """
    m = len(values) - 1                       # each value's number of peers
    if m < 1:
        return np.ones(len(values))
    h = m // 2
    low = h - 1 if h > 0 else 0
    part = np.partition(values, (low, h, h + 1))
    mid = part[h]
    if m % 2:
        below = at = part[h + 1]
        above = mid
    else:
        below = (mid + part[h + 1]) / 2
        at = (part[h - 1] + part[h + 1]) / 2
        above = (part[h - 1] + mid) / 2
    ref = np.where(values < mid, below, np.where(values > mid, above, at))
    out = np.ones(len(values))
    np.divide(values, ref, out=out, where=ref > 0)
    return out


def array_median(values: np.ndarray) -> float:
    """The median (the mean of the two middle values of an even count) of a non-empty array,
    as :func:`~.base.median` computes it.

    >>> array_median(np.array([3.0, 1.0, 2.0, 10.0])), array_median(np.array([5.0]))
    (2.5, 5.0)
    """
    n = len(values)
    mid = n // 2
    if n % 2:
        return float(np.partition(values, mid)[mid])
    part = np.partition(values, (mid - 1, mid))
    return float((part[mid - 1] + part[mid]) / 2)


class RankRows:
    """A row per rank, for per-rank state kept in arrays: ``rows(ranks)`` gives each rank's
    row, adding rows for new ranks; ``grow`` is called with the new row count, so that the
    owner can widen its arrays. ``group_ids(size)`` is each row's ``rank // size`` as a
    small dense id (0 for every row when ``size`` is 0).

    >>> rows = RankRows()
    >>> rows.rows([7, 3]).tolist(), rows.rows([3, 9]).tolist(), rows.rank_of
    ([0, 1], [1, 2], [7, 3, 9])
    >>> rows.group_ids(4).tolist()
    [0, 1, 2]
    """

    def __init__(self):
        self.row_of: dict = {}        # rank -> row
        self.rank_of: list = []       # row -> rank
        self._grouped_by = 0          # the size group_ids were worked out for
        self._group_key: dict = {}    # rank // size -> dense id
        self._gid = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.rank_of)

    def rows(self, ranks: list, grow=None) -> np.ndarray:
        row_of = self.row_of
        out = [row_of.get(r, -1) for r in ranks]
        if -1 in out:
            for i, row in enumerate(out):
                if row == -1:
                    rank = ranks[i]
                    out[i] = row_of[rank] = len(self.rank_of)
                    self.rank_of.append(rank)
            if grow is not None:
                grow(len(self.rank_of))
        return np.array(out, dtype=np.int64)

    def group_ids(self, size: int) -> np.ndarray:
        if size != self._grouped_by:
            self._grouped_by, self._group_key, self._gid = size, {}, np.zeros(0, np.int64)
        have = len(self._gid)
        if have < len(self.rank_of):
            keys = self._group_key
            new = [keys.setdefault(r // size if size else 0, len(keys))
                   for r in self.rank_of[have:]]
            self._gid = np.concatenate((self._gid, np.array(new, dtype=np.int64)))
        return self._gid
