"""What a worker's job side knows of the telemetry partitions its jobs' ranks come from.

The rank workers say, with every summaries message and every second to the jobs they feed
(:class:`~trainguard.streams.logic.Reading`), which telemetry partitions they read, which of
them they are behind on, and how many the topic has. From that and from when each partition
last sent a rank's item (``JobSlot.sources``), :class:`PartitionWatch` answers the job side's
questions about a job's partitions:

- is a silent partition *unread* (nobody says they read it since it went silent): its job
  waits for it, up to ``unread_s`` (:meth:`PartitionWatch.unread_since`,
  :meth:`PartitionWatch.waits_long`);
- has a partition of a job not sent yet at the job's start while its worker has not said it
  read it to the end (:meth:`PartitionWatch.awaits_unheard`);
- which ranks does nobody read for longer than the job waits (:meth:`PartitionWatch.unseen`):
  the job goes on without them, and their silence is not judged until their partition is
  read to the end again.

Nothing here is in a snapshot: the next words of the rank workers, within a second, tell it
again.

>>> import math
>>> from trainguard.streams.logic import Reading
>>> watch = PartitionWatch(source_idle_s=10.0, hold_idle_s=2.0, unread_s=180.0)
>>> watch.read(Reading(parts=(0, 1), behind=()), now=100.0)     # both read to the end
>>> watch.unread_since(1, heard=99.0, wall=101.0)
False
>>> watch.unread_since(1, heard=99.0, wall=120.0)      # no word since 100 s: its worker gone
True
>>> watch.unread_since(1, heard=99.0, wall=300.0)      # ... for longer than the job waits
False
>>> watch.blind(1, heard=99.0)                         # its worker went with its records
True
>>> watch.read(Reading(parts=(1,), behind=()), now=130.0)
>>> watch.blind(1, heard=99.0)                         # a worker saw its ranks go quiet
False
"""
from __future__ import annotations

import logging
import math
from functools import partial

from .logic import job_partition, rank_partition, rank_partitions

__all__ = ["PartitionWatch"]

log = logging.getLogger(__name__)


class PartitionWatch:
    """See the module. ``source_idle_s``: a partition silent this long no longer holds its
    job back, unless it is unread; ``hold_idle_s``: a rank worker's word older than this is
    not taken as said now; ``unread_s``: how long a job waits for an unread partition."""

    def __init__(self, *, source_idle_s: float, hold_idle_s: float, unread_s: float):
        self.source_idle_s = source_idle_s
        self.hold_idle_s = hold_idle_s
        self.unread_s = unread_s
        #: telemetry partition -> wall time its rank worker last said it is behind, or
        #: (``caught_up``) that it is not; shared by all jobs (a partition's backlog is
        #: every job's in it)
        self.behind: dict = {}
        self.caught_up: dict = {}
        #: the telemetry topic's partition count, from the rank workers (0: not told)
        self.count = 0
        #: job -> wall time its state, idle evict_idle_s or more, was loaded again: what
        #: the rank workers said before then is not of it (:meth:`unread_of`)
        self.idle_loads: dict = {}
        self.first: dict = {}          # job -> wall time its first message came
        self.worlds: dict = {}         # job -> world size of the latest start received
        self._expected: dict = {}      # job -> (world, count, the partitions of its ranks)
        #: job -> {rank: the telemetry partition its items came from}
        self.rank_parts: dict = {}
        self._unseen: dict = {}        # job -> (what it was found from, the ranks)

    def read(self, reading, now: float) -> None:
        """A rank worker's word (:class:`~trainguard.streams.logic.Reading`) at ``now``."""
        behind, caught_up = self.behind, self.caught_up
        for p in reading.parts:
            behind.pop(p, None)
            caught_up[p] = now
        for p in reading.behind:
            caught_up.pop(p, None)
            behind[p] = now
        if reading.of:
            self.count = reading.of

    def forget(self, job: str) -> None:
        """``job`` left this worker's memory."""
        for book in (self.first, self.worlds, self._expected, self.rank_parts, self._unseen):
            book.pop(job, None)

    def prune(self, now: float) -> None:
        for job in [j for j, at in self.idle_loads.items() if now - at > self.unread_s]:
            del self.idle_loads[job]

    # -- one partition --------------------------------------------------------------------
    def unread_since(self, partition: int, heard: float, wall: float,
                     since: float = -math.inf) -> bool:
        """Whether ``partition``, which last sent at wall time ``heard``, is silent for at
        most ``unread_s`` while a rank worker told of it (live workers say with every
        message, and every second to the jobs they send to, which partitions they read and
        which of them they are behind on) and none said, since ``heard`` and within
        ``hold_idle_s`` of ``wall``, that it read it to the end. A partition never told of
        (``since``: since its job's state was loaded again after it was idle,
        :meth:`unread_of`) is judged by its silence alone."""
        return wall - heard <= self.unread_s and self.unread(partition, heard, wall, since)

    def unread(self, partition: int, heard: float, wall: float,
               since: float = -math.inf) -> bool:
        """:meth:`unread_since` however long the partition is silent."""
        at = self.caught_up.get(partition)
        if at is None or at < since:
            told = self.behind.get(partition)
            return told is not None and told >= since
        return at <= heard or wall - at > self.hold_idle_s

    def blind(self, partition: int, heard: float, since: float = -math.inf) -> bool:
        """Whether nobody may have read ``partition`` since it last sent (at ``heard``): a
        rank worker said it is behind on it, or the last word that it read it to the end
        came within ``source_idle_s`` of its last records (its worker went with them). A
        worker that kept saying so longer saw its ranks go quiet: their silence is theirs."""
        at = self.caught_up.get(partition)
        if at is None or at < since:
            told = self.behind.get(partition)
            return told is not None and told >= since
        return at - heard <= self.source_idle_s

    # -- one job ---------------------------------------------------------------------------
    def unread_of(self, job: str):
        """:meth:`unread_since` for ``job``: a job idle ``evict_idle_s`` or more whose
        state was loaded again when it spoke takes no word the rank workers said before the
        load as said of its partitions (they may have moved since, and their new worker
        says what it reads to the jobs it feeds only), for ``unread_s`` after the load;
        until they say it again, its partitions are judged by their silence, as those of a
        job never told of. A job loaded when its summaries partition moved here
        (``JobProcessor.load_saved``) was not idle: the words said of its partitions stand
        (a worker killed with this job's worker is still waited for)."""
        since = self.idle_loads.get(job)
        if since is None:
            return self.unread_since
        return partial(self.unread_since, since=since)

    @property
    def behind_wait_s(self) -> float:
        """How long a partition said to be behind (or not heard of yet at a job's start)
        holds its job back, the others' items with it (wall s)."""
        return max(self.unread_s, self.source_idle_s)

    def waits_long(self, job: str, slot, wall: float) -> bool:
        """Whether ``slot``'s job waits for one of its telemetry partitions for up to
        :attr:`behind_wait_s` rather than ``source_idle_s``: one was last said, within
        :attr:`behind_wait_s`, to have records still to read (its worker reads a backlog,
        and may pause in it for longer than ``source_idle_s``: a snapshot, a collection, a
        rebalance), or went silent while nobody says it reads it (:meth:`unread_since`:
        its worker killed or stalled, its partitions moving and their state restored)."""
        behind, bound = self.behind, self.behind_wait_s
        if behind and any(p in behind and wall - behind[p] <= bound for p in slot.sources):
            return True
        unread = slot.unread(wall, self.source_idle_s, self.unread_of(job))
        return next(unread, None) is not None      # partition 0 is one too

    def awaits_unheard(self, job: str, slot, now: float) -> bool:
        """Whether a telemetry partition that carries ranks of ``job`` (by the collectors'
        key ``job/rank``, the world size of its lifecycle ``start`` and the topic's partition
        count) sent none of them yet while its rank worker has not said it read it to the
        end: a worker that began reading a backlog later than the others. Within
        :attr:`behind_wait_s` of the job's first message only."""
        count = self.count
        first = self.first.get(job)
        if not count or first is None or now - first > self.behind_wait_s:
            return False
        # the starts received, held or not: a worker's first message may hold seconds of
        # its ranks' steps, which must wait for the other partitions' ranks
        world = self.worlds.get(job) or getattr(getattr(slot.stage, "steps", None), "world", 0)
        if not world:
            return False
        known = self._expected.get(job)
        if known is None or known[:2] != (world, count):
            known = self._expected[job] = (world, count, rank_partitions(job, world, count))
        sources, caught_up = slot.sources, self.caught_up
        return any(p not in sources and p not in caught_up for p in known[2])

    def unseen(self, job: str, slot, wall: float) -> frozenset:
        """The ranks of ``job`` whose records nobody reads: their telemetry partition is
        silent for more than ``unread_s`` and nobody may have read it since (:meth:`blind`:
        its worker gone for longer than the job waits for it); ``None`` among them when the
        launcher's partition is one. The job goes on without them from then on; they are
        not judged missing (:attr:`~trainguard.detectors.view.JobView.unseen`) until their
        partition is read to the end again: while its successor says, afresh, that it reads
        its backlog (for :attr:`behind_wait_s` at most), the ranks it has not reached yet
        would look silent, the job's time being far past their last records. A rank's
        partition is the one its items came from, else (a rank not heard since this process
        took the job) the collectors' murmur2 partition of ``job/rank`` (of ``job`` for the
        launcher)."""
        since = self.idle_loads.get(job, -math.inf)
        bound, behind, fresh = self.unread_s, self.behind, self.source_idle_s
        found = self._unseen.get(job)
        sticky = found[2] if found is not None else {}
        blind, still = [], {}
        for p, (_, heard) in slot.sources.items():
            if wall - heard > bound and self.blind(p, heard, since):
                blind.append(p)
            elif p in sticky or (found is not None and p in found[0][0]):
                said = behind.get(p)
                began = sticky.get(p, wall)
                if said is not None and wall - said <= fresh and \
                        wall - began <= self.behind_wait_s:
                    blind.append(p)
                    still[p] = began
        if not blind:
            if found is not None:
                log.info("job %s: its telemetry partitions are read again", job,
                         extra={"job": job})
                del self._unseen[job]
            return frozenset()
        parts_of = self.rank_parts.setdefault(job, {})
        books = getattr(getattr(slot.stage, "view", None), "books", ())
        known = sum(len(b.where) for b in books)          # ranks the job view knows
        count = self.count
        key = (frozenset(blind), len(parts_of), known, count)
        if found is not None and found[0] == key:
            self._unseen[job] = (key, found[1], still)
            return found[1]
        parts = key[0]
        if count:               # guessed once, replaced by where its items come from
            for book in books:
                for r in book.where:
                    if r not in parts_of and type(r) is int:
                        parts_of[r] = rank_partition(job, r, count)
            if None not in parts_of:
                parts_of[None] = job_partition(job, count)
            key = (parts, len(parts_of), known, count)
        ranks = frozenset(r for r, p in parts_of.items() if p in parts)
        if parts_of.get(None) not in slot.sources:
            # the launcher's partition unknown, or carrying no rank of the job (so its
            # silence tells nothing): it may be one of them
            ranks |= {None}
        if found is None or found[0][0] != parts:
            log.warning("job %s: nobody has read telemetry partition(s) %s for more than %.0f "
                        "s (worker.unread_partition_s): the job goes on without them, and its "
                        "%d rank(s) on them are not judged silent until they are read again",
                        job, ", ".join(map(str, sorted(parts))), bound,
                        len(ranks - {None}), extra={"job": job})
        self._unseen[job] = (key, ranks, still)
        return ranks

    # -- the worker's gauges ---------------------------------------------------------------
    def unread_partitions(self, slots: dict, wall: float) -> set:
        """The telemetry partitions silent for more than ``source_idle_s`` that hold a job's
        judged time back because no rank worker says it reads them (:meth:`unread_since`),
        or that nobody has read for longer than that (:meth:`unseen`)."""
        out: set = set()
        for key, slot in slots.items():
            out.update(slot.unread(wall, self.source_idle_s,
                                   self.unread_of(key.decode("utf-8", "replace"))))
        for key, _, _ in self._unseen.values():
            out.update(key[0])
        return out

    def unseen_ranks(self) -> int:
        """Ranks, over all jobs, whose partition nobody has read for more than ``unread_s``
        (as last found by :meth:`unseen`)."""
        return sum(len(ranks - {None}) for _, ranks, _ in self._unseen.values())
