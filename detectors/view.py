"""One shared view of a job, kept by its :class:`~trainguard.detectors.JobStage` and handed to
the detectors that use it, so that they do not each learn the same facts.

It holds what every detector means alike: where each rank runs (the latest ``node`` it
reported) and when it was last heard from (the newest ``ts`` of its step, heartbeat or
lifecycle summaries), and the job's parallel layout from lifecycle ``topology``. What a
detector means in its own way (whether a rank has "exited", a phase) stays in the detector.

A detector that uses the view (:class:`UsesView`) builds its own in its constructor and
keeps it current itself when it runs alone; a stage calls ``share_view(view)`` once and from
then on keeps the one view current before it feeds any detector.

The ranks' part is kept in books (:class:`ViewBook`: where each rank runs, when it was last
heard), one, or one per telemetry partition (``JobView(partitions)``, as the rank side would
keep it; issue 21 point 1, step 2 of docs/WORKER.md's plan). Detectors ask the view
questions (:meth:`JobView.node_of`, :meth:`JobView.ranks_on`, :meth:`JobView.whole_nodes`,
...) whose answers merge the books'; ``where`` and ``last_seen`` give the whole maps.

>>> view = JobView()
>>> for item in ({"k": "step", "rank": 0, "node": "n1", "ts": 5.0},
...              {"k": "hb", "rank": 0, "node": "n1", "ts": 4.0},
...              {"k": "life", "rank": 1, "node": "n2", "ts": 6.0, "event": "start",
...               "topology": {"tp": 1, "pp": 2, "dp": 1}}):
...     view.learn(item)
>>> view.where, view.last_seen, view.stage_size
({0: 'n1', 1: 'n2'}, {0: 5.0, 1: 6.0}, 1)
"""
from __future__ import annotations

import math

from .rank_books import book_of

__all__ = ["JobView", "ViewBook", "UsesView", "LEARNS_FROM"]

#: the summary kinds the view learns from (a stage gives it the first three; a detector
#: alone also gives it the closed steps it gets)
LEARNS_FROM = frozenset(("step", "hb", "life", "jobstep"))


class ViewBook:
    """Ranks of the view: where each runs (the latest ``node`` it reported) and the newest
    ``ts`` heard from it."""

    def __init__(self):
        self.where: dict = {}          # rank -> node
        self.last_seen: dict = {}      # rank -> newest ts heard from it

    def counts_on(self, nodes) -> dict:
        """``{node: how many ranks run there}`` of ``nodes``."""
        out = dict.fromkeys(nodes, 0)
        for node in self.where.values():
            if node in out:
                out[node] += 1
        return out


class JobView:
    def __init__(self, partitions: int = 1):
        self.books = [ViewBook() for _ in range(partitions)]
        self.stage_size = 0            # ranks per pipeline stage (tp x dp), 0: unknown
        #: the job's time up to which every source has been heard (the worker's lowest
        #: telemetry partition), None: up to "now" (one process reads everything in order)
        self.heard_upto = None
        #: ranks whose records nobody reads now (their telemetry partition's worker is gone
        #: for longer than the job waits for it): their silence is not judged; ``None`` in
        #: it: nor the launcher's (``trainguard run``'s events, keyed by the job)
        self.unseen = frozenset()

    # -- the ranks' part, from the books ---------------------------------------------------------
    def book(self, rank) -> ViewBook:
        return book_of(self.books, rank)

    def _whole(self, name: str) -> dict:
        """A map of the books' over the whole job (a copy when there are several)."""
        books = self.books
        if len(books) == 1:
            return getattr(books[0], name)
        return {r: v for b in books for r, v in getattr(b, name).items()}

    where = property(lambda self: self._whole("where"), doc="``{rank: node}``")
    last_seen = property(lambda self: self._whole("last_seen"),
                         doc="``{rank: newest ts heard}``")

    def node_of(self, rank):
        return self.book(rank).where.get(rank)

    def seen(self, rank):
        """The newest ts heard from ``rank`` (None: never)."""
        return self.book(rank).last_seen.get(rank)

    def ranks_on(self, node) -> list:
        """The ranks that run on ``node`` (as the books hold them)."""
        return [r for b in self.books for r, n in b.where.items() if n == node]

    def rank_nodes(self, ranks) -> dict:
        """``{str(rank): node}`` for the evidence, so correlation can relate ranks to
        machines (ranks with no machine known are left out)."""
        out = {}
        for r in sorted(ranks):
            node = self.node_of(r)
            if node:
                out[str(r)] = node
        return out

    def nodes_of(self, ranks) -> list:
        """The machines of ``ranks``, in order."""
        return sorted({n for n in map(self.node_of, ranks) if n is not None})

    def whole_nodes(self, ranks) -> list:
        """Machines all of whose known ranks are in ``ranks``.

        >>> view = JobView(partitions=2)
        >>> for r in range(6):
        ...     view.learn({"k": "hb", "rank": r, "node": f"n{r // 2}", "ts": 1.0})
        >>> view.whole_nodes([0, 1, 2, 5])
        ['n0']
        """
        chosen: dict = {}
        for r in set(ranks):
            node = self.node_of(r)
            if node:
                chosen[node] = chosen.get(node, 0) + 1
        if not chosen:
            return []
        total = dict.fromkeys(chosen, 0)
        for book in self.books:
            for node, n in book.counts_on(chosen).items():
                total[node] += n
        return sorted(n for n, k in chosen.items() if total[n] == k)

    def node_stages(self, size: int) -> dict:
        """``{node: the pipeline stages of its ranks}`` (``size`` ranks a stage)."""
        stages: dict = {}
        for book in self.books:
            for rank, node in book.where.items():
                stages.setdefault(node, set()).add(rank // size)
        return stages

    def heard_within(self, now: float, span: float, skip) -> bool:
        """Whether a rank not ``skip(rank)`` was heard less than ``span`` before ``now``."""
        return any(now - ts < span and not skip(r)
                   for b in self.books for r, ts in b.last_seen.items())

    def judged(self, now: float) -> float:
        """The time up to which an absence can be judged at ``now``: a rank whose records
        are still on their way (its telemetry partition is read behind the others') is not
        missing until every source has been heard up to then.

        >>> view = JobView()
        >>> view.judged(100.0), setattr(view, "heard_upto", 80.0), view.judged(100.0)
        (100.0, None, 80.0)
        """
        upto = self.heard_upto
        return now if upto is None or upto > now else upto

    @property
    def launcher_unseen(self) -> bool:
        """Whether nobody reads the launcher's events now (its word of a restart of ours)."""
        return None in self.unseen

    @property
    def ranks_unseen(self) -> list:
        """The ranks in :attr:`unseen`.

        >>> view = JobView()
        >>> view.unseen = frozenset({None, 3})
        >>> view.ranks_unseen, view.launcher_unseen
        ([3], True)
        """
        return [r for r in self.unseen if r is not None] if self.unseen else []

    def learn(self, item) -> None:
        """One stage item of :data:`LEARNS_FROM`; others are ignored."""
        if type(item) is not dict:
            return
        k = item.get("k")
        if k == "step" or k == "hb":            # the common case first
            pass
        elif k == "jobstep":
            for rank, rec in item["ranks"].items():
                node = rec.get("node")
                if node:
                    where = self.book(rank).where
                    if where.get(rank) != node:
                        where[rank] = node
            return
        elif k == "life":
            if item.get("event") == "start":
                self._learn_topology(item)
        else:
            return
        rank, ts = item.get("rank"), item.get("ts")
        if rank is None or ts is None:
            return
        books = self.books
        book = books[rank % len(books)] if len(books) > 1 else books[0]    # book_of, inline
        last_seen = book.last_seen
        if ts > last_seen.get(rank, -math.inf):
            last_seen[rank] = ts
        node = item.get("node")
        if node and book.where.get(rank) != node:
            book.where[rank] = node

    def _learn_topology(self, item) -> None:
        """A start's ``topology`` (Megatron layout: TP fastest, then DP, then PP), when it is
        whole and agrees with the world size."""
        topo = item.get("topology")
        if type(topo) is not dict:
            return
        tp, pp, dp = topo.get("tp"), topo.get("pp"), topo.get("dp")
        if not all(type(x) is int and x > 0 for x in (tp, pp, dp)):
            return
        world = item.get("world_size")
        if world is not None and world != tp * pp * dp:
            return
        self.stage_size = tp * dp if pp > 1 else 0


class UsesView:
    """Mixin of the detectors that read a :class:`JobView`: ``self.view`` is their own until
    a stage calls :meth:`share_view`; then the stage keeps it current."""

    USES_VIEW = True

    def _init_view(self) -> None:
        self.view = JobView()
        self._own_view = True

    def share_view(self, view: JobView) -> None:
        self.view = view
        self._own_view = False
