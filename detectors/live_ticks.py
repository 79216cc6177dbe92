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
longest-unheard ranks were heard within a heartbeat, and no partition is asked.

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
from .liveness import SilentDetector
from .live_parts import HeardBook, SilentParts

__all__ = ["SilentTicks", "heard_summary"]


def heard_summary(book: HeardBook, k: int, unseen=()) -> tuple:
    """``(newest, [(rank, heard, reported), ...], next)`` of a partition's live ranks (not
    exited, but ``unseen``): the newest time one was heard, the ``k`` heard longest ago, and
    when the one after them was heard (``math.inf``: none)."""
    heard, exited, reported = book.heard, book.exited, book.reported
    if exited or unseen:
        heard = {r: ts for r, ts in heard.items()
                 if r not in exited and not (unseen and r in unseen)}
    if not heard:
        return -math.inf, [], math.inf
    oldest = heapq.nsmallest(k + 1, zip(heard.values(), heard.keys()))
    beyond = oldest[k][0] if len(oldest) > k else math.inf
    return max(heard.values()), [(r, ts, r in reported) for ts, r in oldest[:k]], beyond


class SilentTicks(SilentParts):
    """:class:`~.live_parts.SilentParts` judging each look from its partitions' summaries."""

    _param_names = param_names(SilentDetector)

    def __init__(self, partitions: int = 3, k: int = 8, **params):
        self.k = k
        super().__init__(partitions, **params)

    def _start(self) -> None:
        super()._start()
        self.summaries = 0
        self.asked = 0

    def clone(self) -> "SilentTicks":
        return type(self)(self.partitions, self.k, **self._get_params())

    def _look(self, limit: float, going_on: float, half: float) -> tuple:
        quiet, pending, alive = [], set(), False
        unseen, node_of = self.view.unseen, self.view.node_of
        for book in self.books:
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
