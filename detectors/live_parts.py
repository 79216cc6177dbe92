"""The liveness detectors' per-rank half split by telemetry partition (issue 21 point 1, step 2
of the plan in docs/WORKER.md; built beside today's path): the silent, hang and crash
detectors, and the data-position detector, which has no cross-rank state at all.

The silent, hang and crash detectors keep their ranks in books (:mod:`.rank_books`) and merge
the books' answers whether they have one or several: :class:`SilentParts`, :class:`HangParts`
and :class:`CrashParts` give them one per partition (a rank's is ``rank % partitions``), as
the rank side would keep them. For the silent detector, what the job side asks at each look
is merged from per-partition answers (whether any rank was heard lately, the machines with
ranks going quiet, and the quiet ranks with their times: the ranks a finding names), and a
finding asks the partitions of a machine's ranks which of them exited or were reported. A
whole job quiet for a while shifts every partition's times (rare: one message to each).
Nothing here is sent over Kafka yet; the job's clock at which a rank was heard is the one its
item was applied at, which the rank side would learn from the job side (step 3).

>>> from .liveness import SilentDetector
>>> def run(detector):
...     out = []
...     for t in range(30):
...         for r in range(8):
...             if r < 6 or t < 5:      # n3 (ranks 6, 7) stops at t=4
...                 detector.update({"k": "hb", "rank": r, "node": f"n{1 + r // 2}",
...                                  "ts": float(t)})
...         out += [(f.nodes, f.ranks, f.detected_ts) for f in detector.advance(float(t))]
...     return out
>>> run(SilentParts(3, timeout_s=10.0)) == run(SilentDetector(timeout_s=10.0))
True
>>> run(SilentParts(3, timeout_s=10.0))
[(['n4'], [6, 7], 14.0)]
"""
from __future__ import annotations

from .base import Detector, Finding, param_names
from .data_position import DataPositionDetector
from .liveness import CrashDetector, HangDetector, SilentDetector
from .rank_books import ExitBook, HeardBook, PhaseBook
from .view import JobView

__all__ = ["SilentParts", "HangParts", "CrashParts", "DataPositionParts"]


class _BooksByPartition:
    """A detector that keeps its ranks in books (``_books``) with one per partition."""

    BOOK = None

    def __init__(self, partitions: int = 3, **params):
        self.partitions = partitions
        super().__init__(**params)

    def _start(self) -> None:
        super()._start()
        self._books = [self.BOOK() for _ in range(self.partitions)]
        self.view = JobView(self.partitions)     # its own, until a stage shares one

    def clone(self):
        return type(self)(self.partitions, **self._get_params())


class HangParts(_BooksByPartition, HangDetector):
    """:class:`~.hang.HangDetector` over ``partitions`` :class:`~.rank_books.PhaseBook`\\ s."""

    _param_names = param_names(HangDetector)
    BOOK = PhaseBook


class SilentParts(_BooksByPartition, SilentDetector):
    """:class:`~.liveness.SilentDetector` over ``partitions``
    :class:`~.rank_books.HeardBook`\\ s."""

    _param_names = param_names(SilentDetector)
    BOOK = HeardBook


class CrashParts(_BooksByPartition, CrashDetector):
    """:class:`~.liveness.CrashDetector` over ``partitions`` :class:`~.rank_books.ExitBook`\\ s."""

    _param_names = param_names(CrashDetector)
    BOOK = ExitBook


class DataPositionParts(Detector):
    """:class:`~.data_position.DataPositionDetector` with each partition's ranks in a detector
    of their own: it compares a rank with itself only, so nothing crosses partitions.

    >>> parts, one = DataPositionParts(3), DataPositionDetector()
    >>> items = [{"k": "step", "rank": r, "ts": float(s), "step": s, "samples": 8 * s}
    ...          for s in range(3) for r in range(4)]
    >>> items += [{"k": "life", "rank": r, "event": "start", "ts": 5.0} for r in range(4)]
    >>> items += [{"k": "step", "rank": r, "ts": 6.0, "step": 1, "samples": 0 if r == 2 else 8}
    ...           for r in range(4)]
    >>> [f.ranks for i in items for f in parts.update(i)]
    [[2]]
    >>> [f.ranks for i in items for f in one.update(i)]
    [[2]]
    """

    PREFIX = DataPositionDetector.PREFIX
    CONSUMES = DataPositionDetector.CONSUMES

    def __init__(self, partitions: int = 3):
        self.partitions = partitions
        super().__init__()

    def _start(self) -> None:
        self.parts = [DataPositionDetector() for _ in range(self.partitions)]

    def update(self, item) -> list[Finding]:
        rank = item.get("rank") if type(item) is dict else None
        if rank is None:
            return []          # it reads ranks' items only
        return self.parts[rank % self.partitions].update(item)
