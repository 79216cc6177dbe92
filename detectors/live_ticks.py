"""Ticked summaries (issue 21 point 1, step 2 of docs/WORKER.md's plan, its third item): what a
partition would push to the job side at each look of the silent detector, of a size that does
not grow with its ranks, and how often the job side must still ask it for more.

A partition's summary at a look (:func:`heard_summary`) holds the newest time any of its live
ranks was heard, its ``k`` longest-unheard live ranks with their times and whether each was
reported, and the time of the next longest-unheard (``math.inf`` when there is none). The
job side judges the look from the summaries alone when each partition's next time is past
the look's ``half`` (then every rank going quiet is among its ``k``); else it asks that
partition for its ranks, as :class:`~.live_parts.SilentParts` does at every look
(``asked`` counts those, ``summaries`` the summaries taken). In a healthy job the ``k``
longest-unheard ranks were heard within a heartbeat, and no partition is asked. The hang
detector's summaries (:class:`PhaseSummary`, :class:`HangTicks`) work alike over the ranks
it would take for fresh.

>>> from .liveness import SilentDetector
>>> def run(detector):
...     out = []
...     for t in range(30):
...         for r in range(64):
...             if r < 56 or t < 5:      # n7 (ranks 56 to 63) stops at t=4
...                 detector.update({"k": "hb", "rank": r, "node": f"n{r // 8}",
...                                  "ts": float(t)})
...         out += [(f.nodes, f.ranks[0], f.detected_ts) for f in detector.advance(float(t))]
...     return out
>>> ticks = SilentTicks(4, k=2, timeout_s=10.0)      # n7's ranks: two in each partition
>>> run(ticks) == run(SilentDetector(timeout_s=10.0))
True
>>> ticks.summaries, ticks.asked
(120, 0)
>>> ticks = SilentTicks(4, k=1, timeout_s=10.0)      # one of them is not in the summary
>>> run(ticks)
[(['n7'], 56, 14.0)]
>>> ticks.summaries, ticks.asked
(120, 84)
"""
from __future__ import annotations

import heapq
import math

from .base import param_names
from .liveness import HangDetector, SilentDetector
from .live_parts import HangParts, SilentParts
from .rank_books import HeardBook, PhaseBook, merge_positions

__all__ = ["SilentTicks", "heard_summary", "HangTicks", "PhaseSummary"]


def _stamp(entry) -> float:
    """A ``(stamp, rank)`` pair's stamp: ranks of equal stamps stay in the books' order."""
    return entry[0]


def heard_summary(book: HeardBook, k: int, unseen=()) -> tuple:
    """``(newest, [(rank, heard, reported), ...], next)`` of a partition's live ranks (those
    neither exited nor ``unseen``): the newest time one was heard, the ``k`` heard longest
    ago, and when the one after them was heard (``math.inf``: none)."""
    heard, exited, reported = book.heard, book.exited, book.reported
    if exited or unseen:
        heard = {r: ts for r, ts in heard.items()
                 if r not in exited and not (unseen and r in unseen)}
    if not heard:
        return -math.inf, [], math.inf
    oldest = heapq.nsmallest(k + 1, zip(heard.values(), heard.keys()), key=_stamp)
    beyond = oldest[k][0] if len(oldest) > k else math.inf
    return max(heard.values()), [(r, ts, r in reported) for ts, r in oldest[:k]], beyond


class _Summarized:
    """A split detector whose partitions' summaries hold their ``k`` ranks heard longest
    ago."""

    def __init__(self, partitions: int = 3, k: int = 8, **params):
        self.k = k
        super().__init__(partitions, **params)

    def clone(self):
        return type(self)(self.partitions, self.k, **self._get_params())


class SilentTicks(_Summarized, SilentParts):
    """:class:`~.live_parts.SilentParts` judging each look from its partitions' summaries."""

    _param_names = param_names(SilentDetector)

    def _start(self) -> None:
        super()._start()
        self.summaries = 0
        self.asked = 0

    def _look(self, limit: float, going_on: float, half: float) -> tuple:
        quiet, pending, alive = [], set(), False
        unseen, node_of = self.view.unseen, self.view.node_of
        for book in self._books:
            newest, oldest, beyond = heard_summary(book, self.k, unseen)
            self.summaries += 1
            alive = alive or newest > going_on
            if beyond <= half:          # more may be going quiet than the summary holds
                self.asked += 1
                q, p, _ = book.look(limit, going_on, half, unseen, node_of)
                quiet += q
                pending |= p
                continue
            for rank, ts, reported in oldest:
                if ts > limit:
                    if ts <= half:
                        pending.add(node_of(rank))
                elif not reported:
                    quiet.append((rank, ts))
        return quiet, pending, alive


#: every rank counts as fresh: ``now - ts < stale_s`` holds for any stamp
_ALL_FRESH = -math.inf


class PhaseSummary:
    """A partition's summary for the hang detector's look (see :class:`HangTicks`). Its
    light part, sent at every look, is over the ranks in a pause only: each pausing phase's
    latest start and newest heartbeat, and the phases. Its full part, taken only at a look
    that asks more (a rank may be left behind: ``full``), holds the answers of its live
    ranks but the ``k`` heard longest ago, as if all of them were fresh, those ``k`` ranks'
    entries, and when the next one was heard. When that next one is fresh at the look, an
    answer is the rest's merged with the ``k`` ranks' own; else the partition is asked
    (``asked``), and for the ranks a finding names (``named``)."""

    def __init__(self, book: PhaseBook, k: int, stale_s: float):
        self.book, self.k, self.stale_s = book, k, stale_s
        self.asked = self.named = 0
        self.full = None
        starts, heard, phases = {}, {}, set()    # per pausing phase: latest start, newest
        hb, exited = book.hb, book.exited         # heartbeat; the phases of every rank
        for r in book.pausing:
            ts, phase, start, _, _ = hb[r]
            phases.add(phase)
            if r not in exited:
                if start > starts.get(phase, -math.inf):
                    starts[phase] = start
                if ts > heard.get(phase, -math.inf):
                    heard[phase] = ts
        self.starts, self.heard, self.phases = starts, heard, phases

    def _take_full(self) -> None:
        book, k, stale_s = self.book, self.k, self.stale_s
        live = [(h[0], r) for r, h in book.hb.items() if r not in book.exited]
        stalest = heapq.nsmallest(k + 1, live, key=_stamp)
        self.beyond = stalest[k][0] if len(stalest) > k else math.inf
        few = self.few = PhaseBook()             # the k ranks, apart; the rest over the book
        for _, r in stalest[:k]:
            few.put(r, book.hb[r])
            if r in book.ended:
                few.ended[r] = book.ended[r]
        apart = frozenset(few.hb)
        self.full = {"fresh": book.fresh_count(_ALL_FRESH, stale_s, apart),
                     "positions": book.positions(_ALL_FRESH, stale_s, apart),
                     "groups": book.phase_groups(_ALL_FRESH, stale_s, (), apart),
                     "census": book.census(_ALL_FRESH, stale_s, apart)}

    def _whole(self, now: float, stale_s: float, unseen=()) -> bool:
        """Whether the summary answers at ``now``: the rest are all fresh."""
        if unseen or stale_s != self.stale_s:
            self.asked += 1
            return False
        if self.full is None:
            self._take_full()
        if not now - self.beyond < stale_s:
            self.asked += 1
            return False
        return True

    def pause_starts(self, not_pauses) -> dict:
        return {p: t for p, t in self.starts.items() if p not in not_pauses}

    def pausing_fresh(self, now, stale_s, not_pauses) -> bool:
        return any(p not in not_pauses and now - t < stale_s for p, t in self.heard.items())

    def pausing_phases(self, not_pauses) -> set:
        return self.phases - set(not_pauses)

    def fresh_count(self, now, stale_s) -> int:
        if not self._whole(now, stale_s):
            return self.book.fresh_count(now, stale_s)
        return self.full["fresh"] + self.few.fresh_count(now, stale_s)

    def positions(self, now, stale_s, unseen=()):
        if not self._whole(now, stale_s, unseen):
            return self.book.positions(now, stale_s, unseen)
        return merge_positions([self.full["positions"], self.few.positions(now, stale_s)])

    def phase_groups(self, now, stale_s, not_pauses) -> dict:
        if not self._whole(now, stale_s):
            return self.book.phase_groups(now, stale_s, not_pauses)
        groups = {}
        for part in (self.full["groups"], self.few.phase_groups(now, stale_s, ())):
            for (phase, step), g in part.items():
                inside = phase not in not_pauses
                m = groups.get((phase, step))
                if m is None:
                    m = groups[(phase, step)] = [0, -math.inf, 0, -math.inf, math.inf]
                if inside:
                    m[0] += g[0]
                    m[1] = max(m[1], g[1])
                m[2] += g[2]
                m[3] = max(m[3], g[3])
                m[4] = min(m[4], g[4])
        return groups

    def census(self, now, stale_s, unseen) -> dict:
        if not self._whole(now, stale_s, unseen):
            return self.book.census(now, stale_s, unseen)
        rest, few = self.full["census"], self.few.census(now, stale_s, ())
        out = {"live": rest["live"] + few["live"], "fresh": rest["fresh"] + few["fresh"],
               "waiting": rest["waiting"] + few["waiting"],
               "working": rest["working"] | few["working"], "phases": dict(rest["phases"]),
               "steps": dict(rest["steps"])}
        for name in ("phases", "steps"):
            for key, n in few[name].items():
                out[name][key] = out[name].get(key, 0) + n
        return out

    def stale(self, now, stale_s, unseen) -> list:
        self.named += 1
        return self.book.stale(now, stale_s, unseen)

    def fresh_where(self, now, stale_s, unseen, keep) -> list:
        self.named += 1
        return self.book.fresh_where(now, stale_s, unseen, keep)

    def at_position(self, pos, now, stale_s, unseen=()) -> list:
        self.named += 1
        return self.book.at_position(pos, now, stale_s, unseen)


class HangTicks(_Summarized, HangParts):
    """:class:`~.live_parts.HangParts` judging each look from its partitions' summaries
    (:class:`PhaseSummary`); ``summaries``, ``full``, ``asked`` and ``named`` count them,
    those whose full part was taken, the questions they could not answer, and the requests
    for the ranks a finding names."""

    _param_names = param_names(HangDetector)

    def _start(self) -> None:
        super()._start()
        self.summaries = self.full = self.asked = self.named = 0
        self._ticked = None

    def _askable(self) -> list:
        return self._ticked if self._ticked is not None else self._books

    def advance(self, now: float) -> list:
        self._ticked = [PhaseSummary(b, self.k, self.stale_s) for b in self._books]
        self.summaries += len(self._ticked)
        try:
            return super().advance(now)
        finally:
            self.asked += sum(s.asked for s in self._ticked)
            self.named += sum(s.named for s in self._ticked)
            self.full += sum(s.full is not None for s in self._ticked)
            self._ticked = None
