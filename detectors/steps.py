"""Steps matched by number: a job's step summaries collected into one ``jobstep`` per step.

The job side's :class:`~.stages.JobStage` feeds it every rank's ``step`` summary and every
lifecycle; what it closes goes to the detectors that consume ``jobstep`` (or ``late``).

The ranks' part is kept in books (:class:`StepBook`: each rank's records of the open steps, the
highest step it reported, the lowest of those), one today, or one per telemetry partition
(``partitions``, issue 21 point 1, step 1 of docs/WORKER.md's plan), as the rank side would keep
them: the aggregator keeps per step and for the job only counts and times, and what it asks of
a book per record is a few numbers (whether the rank is new to the step, to the roster, whether
its partition's lowest step moved). A step's records are taken from the books when it closes.
"""
from __future__ import annotations

from .rank_books import book_of

__all__ = ["StepAggregator", "StepBook"]


_UNMOVED = (False, False)


class StepBook:
    """One partition's ranks for :class:`StepAggregator`: their records of the open steps, the
    highest step each reported, the first step each reported (while the roster is learned),
    the ranks heard since the world size changed, and the lowest highest step with how many
    ranks are at it.

    >>> book = StepBook()
    >>> book.raise_top(0, 4), book.raise_top(1, 5), (book.low, book.at_low)
    ((True, True), (True, False), (4, 1))
    >>> book.raise_top(0, 6), (book.low, book.at_low)      # the last rank at 4 moved on
    ((False, True), (5, 1))
    """

    def __init__(self):
        self.open: dict = {}         # step -> {rank: its record}
        self.tops: dict = {}         # rank -> the highest step it reported
        self.first: dict = {}        # rank -> the first step it reported
        self.ranks: set = set()
        self.low = None              # the lowest of the tops ...
        self.at_low = 0              # ... and how many ranks are at it

    def raise_top(self, rank, step) -> tuple:
        """``(new, moved)``: whether ``rank`` is new to the tops, whether :attr:`low` changed."""
        tops = self.tops
        top = tops.get(rank)
        if top is not None and step <= top:
            return _UNMOVED
        tops[rank] = step
        low = self.low
        if top is None:
            if low is None or step < low:
                self.low, self.at_low = step, 1
                return True, True
            if step == low:
                self.at_low += 1
            return True, False
        if top == low:
            self.at_low -= 1
            if not self.at_low:       # the last rank at the lowest step moved on
                self.low = min(tops.values())
                self.at_low = sum(1 for t in tops.values() if t == self.low)
                return False, True
        return False, False

    def clear(self) -> None:
        """A restart: the open steps, the tops and the roster are learned again."""
        self.open.clear()
        self.tops.clear()
        self.first.clear()
        self.low, self.at_low = None, 0


class StepAggregator:
    """Collects step summaries into ``jobstep`` items, one per step, in step order.

    Steps are matched by number, not by arrival. A step closes when every expected rank
    reported it (the world size from lifecycle ``start``, else the ranks seen so far), when
    every rank of a complete roster reported it or went past it (a rank that skipped it), when
    it is ``window`` steps behind the highest step seen, or ``window_s`` seconds of the job's
    clock after its first record (:meth:`expire`). So a rank whose records come late (its
    worker lags, its collector sends in bursts, one partition of a backlog is read before the
    others) still counts toward its step while the step is inside that window. A record of a
    step already closed is a restart when a lifecycle ``start`` came since (one of a rank
    that reported no step yet, stamped more than ``window_s`` before the newest closed step
    began, was read late, as the rest of its partition's backlog: no restart; a rank that
    stepped before and starts on a machine whose clock runs behind restarts); otherwise it
    is late, counted in ``late``, and comes out alone as a ``jobstep`` with ``"late": True``, for
    the one check that makes sense on one rank (a non-finite loss). A rank that stops
    reporting steps while its peers go on (its telemetry lost) holds their steps open until
    ``window_s`` or ``window``: it cannot be told from one that lags. Memory: the highest
    step of each rank, and the open steps (at most ``window`` of them, while a rank lags).

    >>> agg = StepAggregator(window=3)
    >>> rec = lambda r, s: {"k": "step", "job": "j", "rank": r, "ts": float(s), "step": s}
    >>> closed = [js for s in (1, 2) for r in (0, 1) for js in agg.add(rec(r, s))]
    >>> [(js["step"], sorted(js["ranks"])) for js in closed]
    [(1, [0, 1]), (2, [0, 1])]
    >>> closed = [js for s in (3, 4, 5) for js in agg.add(rec(0, s))]    # rank 1 lags
    >>> closed
    []
    >>> [(js["step"], sorted(js["ranks"])) for js in agg.add(rec(1, 3))]  # ... and counts
    [(3, [0, 1])]
    >>> [(js["step"], sorted(js["ranks"])) for js in agg.add(rec(0, 7))]  # 3 steps behind
    [(4, [0])]
    >>> [(js["step"], sorted(js["ranks"]), js.get("late")) for js in agg.add(rec(1, 4))]
    [(4, [1], True)]
    >>> agg.life({"k": "life", "event": "start", "rank": 2, "ts": -9.0})   # read late
    >>> [(js["step"], js.get("late")) for js in agg.add(rec(2, 2))]
    [(2, True)]
    >>> agg.life({"k": "life", "event": "start", "rank": 1, "ts": -9.0})   # its clock behind
    >>> agg.add(rec(1, 2)), agg.late
    ([], 2)
    """

    def __init__(self, window: int = 32, window_s: float = 5.0, partitions: int = 1):
        self.window = window
        self.window_s = window_s
        self._books = [StepBook() for _ in range(partitions)]
        self._open: dict = {}        # step -> [first_ts, last_ts, how many ranks reported it]
        self._closed = -1            # a record of this step or older is late (or a restart)
        self._closed_ts = float("-inf")   # when the newest closed step began
        self._n_ranks = 0            # the ranks heard since the world size changed
        self._world = 0
        self._stable = False         # some rank reported a second step: roster complete
        self._restarted = False
        self._n_tops = 0             # the ranks with a highest step (since the start)
        self._low = None             # the lowest of those steps
        self._high = -1              # the highest step any rank reported
        self._base = 0               # the first step since the start (or a restart)
        self.late = 0

    @property
    def world(self) -> int:
        """The world size of the latest lifecycle ``start`` (0: none told it)."""
        return self._world

    def life(self, item) -> None:
        if item.get("event") == "start":
            ts = item.get("ts")
            rank = item.get("rank")
            if type(ts) in (int, float) and ts < self._closed_ts - self.window_s and \
                    (rank is None or rank not in book_of(self._books, rank).tops):
                return          # a rank not heard of, from before steps already closed:
                                # read late (its partition's backlog), not a restart
            if item.get("world_size") and item["world_size"] != self._world:
                self._world = item["world_size"]
                self._n_ranks = 0
                for book in self._books:
                    book.ranks = set()
            self._restarted = True

    def add(self, item) -> list[dict]:
        step = item["step"]
        if step <= self._closed:
            if not self._restarted:
                self.late += 1
                late = self._jobstep(item["job"], step, item["ts"], item["ts"],
                                     {item["rank"]: item})
                late["late"] = True
                return [late]
            self._open.clear()
            self._closed = step - 1
            for book in self._books:
                book.clear()
            self._n_tops, self._low, self._high = 0, None, -1
            self._stable = False
        self._restarted = False
        rank = item["rank"]
        books = self._books           # book_of, inline: it runs for every record
        book = books[rank % len(books)] if len(books) > 1 else books[0]
        if rank not in book.ranks:
            book.ranks.add(rank)
            self._n_ranks += 1
        if not self._stable:
            first = book.first.setdefault(rank, step)
            self._stable = step != first
        if step > self._high:
            self._high = step
        if self._low is None:
            self._base = step        # the first step since the start
        new, moved = book.raise_top(rank, step)
        if new:
            self._n_tops += 1
        if moved:
            self._low = book.low if len(books) == 1 else \
                min(b.low for b in books if b.low is not None)
        entry = self._open.get(step)
        ts = item["ts"]
        if entry is None:
            entry = self._open[step] = [ts, ts, 0]
        elif ts > entry[1]:
            entry[1] = ts
        records = book.open.get(step)
        if records is None:
            records = book.open[step] = {}
        if rank not in records:
            entry[2] += 1
        records[rank] = item
        expected = self._world if self._world > self._n_ranks else self._n_ranks
        complete = self._stable or self._world
        if entry[2] >= expected and complete:
            return self._close_through(step)
        last = self._high - self.window
        if self._low is not None and self._low > last and self._roster():
            last = self._low                  # every rank reported it or went past it
        if last > self._closed:
            out = self._close_through(last)
            self._closed = last
            return out
        return []

    def _roster(self) -> bool:
        """Whether the ranks that reported are all the job has: the world size of lifecycle
        ``start``, else the ranks seen once some rank reported a second step; or, a window
        after the first step, those that came (a rank that never reports must not hold
        every step open)."""
        if self._high - self._base >= self.window:
            return True
        if self._world:
            return self._n_tops >= self._world
        return self._stable and self._n_tops >= self._n_ranks

    def expire(self, now: float) -> list[dict]:
        if not self._open:
            return []
        old = [s for s, e in self._open.items() if now - e[0] >= self.window_s]
        return self._close_through(max(old)) if old else []

    def _jobstep(self, job, step, ts, first_ts, ranks) -> dict:
        return {"k": "jobstep", "job": job, "step": step, "ts": ts, "first_ts": first_ts,
                "world": max(self._world, self._n_ranks), "ranks": ranks}

    def _records(self, step) -> dict:
        """The records of ``step`` from every book, taken out of them."""
        books = self._books
        if len(books) == 1:
            return books[0].open.pop(step)
        ranks: dict = {}
        for book in books:
            ranks.update(book.open.pop(step, ()))
        return ranks

    def _close_through(self, last: int) -> list[dict]:
        out = []
        for step in sorted(s for s in self._open if s <= last):
            first_ts, last_ts, _ = self._open.pop(step)
            ranks = self._records(step)
            job = next(iter(ranks.values()))["job"]
            out.append(self._jobstep(job, step, last_ts, first_ts, ranks))
            self._closed = max(self._closed, step)
            if first_ts > self._closed_ts:
                self._closed_ts = first_ts
        return out
