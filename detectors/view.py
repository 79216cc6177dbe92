"""One shared view of a job, kept by its :class:`~trainguard.detectors.JobStage` and handed to
the detectors that use it, so that they do not each learn the same facts.

It holds what every detector means alike: where each rank runs (the latest ``node`` it
reported) and when it was last heard from (the newest ``ts`` of its step, heartbeat or
lifecycle summaries), and the job's parallel layout from lifecycle ``topology``. What a
detector means in its own way (whether a rank has "exited", a phase) stays in the detector.

A detector that uses the view (:class:`UsesView`) builds its own in its constructor and
keeps it current itself when it runs alone; a stage calls ``share_view(view)`` once and from
then on keeps the one view current before it feeds any detector.

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

__all__ = ["JobView", "UsesView", "LEARNS_FROM"]

#: the summary kinds the view learns from (a stage gives it the first three; a detector
#: alone also gives it the closed steps it gets)
LEARNS_FROM = frozenset(("step", "hb", "life", "jobstep"))


class JobView:
    def __init__(self):
        self.where: dict = {}          # rank -> node
        self.last_seen: dict = {}      # rank -> newest ts heard from it
        self.stage_size = 0            # ranks per pipeline stage (tp x dp), 0: unknown
        #: the job's time up to which every source has been heard (the worker's lowest
        #: telemetry partition), None: up to "now" (one process reads everything in order)
        self.heard_upto = None
        #: ranks whose records nobody reads now (their telemetry partition's worker is gone
        #: for longer than the job waits for it): their silence is not judged; ``None`` in
        #: it: nor the launcher's (``trainguard run``'s events, keyed by the job)
        self.unseen = frozenset()

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
            where = self.where
            for rank, rec in item["ranks"].items():
                node = rec.get("node")
                if node and where.get(rank) != node:
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
        if ts > self.last_seen.get(rank, -math.inf):
            self.last_seen[rank] = ts
        node = item.get("node")
        if node and self.where.get(rank) != node:
            self.where[rank] = node

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
