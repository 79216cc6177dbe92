"""Many anomalies at once: the action service's backlog and scheduler.

One anomaly can take seconds (its stacks are captured, and an unanswered capture waits out
its deadline), so the service must not take them one at a time: a real hang would wait
behind every junk anomaly before it. Here:

- the :class:`Backlog` keeps the anomalies not yet started, the most severe first
  (critical, warning, info), then the oldest; it holds at most ``max_queued``: beyond, the
  oldest of the least severe is dropped, and an anomaly already queued or under way is a
  duplicate. Every drop is recorded (an ``action`` record ``none``/``rate_limited``, code
  ``backlog_full``; a duplicate: only told, the first of its id speaks) and told to
  ``on_done`` like any outcome;
- the :class:`Scheduler` runs up to ``max_in_flight`` anomalies at once, at most one per
  job (a job's anomalies stay in order, so that correlation and de-duplication see them as
  before). Each runs down the pipeline as a waiting generator
  (:meth:`~trainguard.actions.pipeline.Pipeline.run`): while it waits for stacks it is
  *parked*, which costs no thread. The scheduler's own thread runs the pieces between two
  waits (they are short: no thread hand-offs, which under the GIL cost more than the work)
  and polls the parked waits; a blocking call (an alert sink's HTTP request) is a wait too
  (:class:`~trainguard.actions.waits.Blocking`), run on one of ``workers`` threads;
- the :class:`OffsetTracker` says which consumer offsets may be committed: up to the oldest
  anomaly still under way, so that a restart of the service re-reads nothing it lost (and
  de-duplication drops what it had finished).

>>> from trainguard import events as ev
>>> def a(id, job, severity="critical"):
...     return ev.Anomaly(job=job, ts=1.0, id=id, kind="hang", severity=severity, ranks=[],
...                       nodes=[], onset_ts=0.0, detected_ts=1.0, detector="hang",
...                       summary="no step")
>>> b = Backlog(max_queued=3)
>>> for x in (a("w1", "j1", "warning"), a("c1", "j1"), a("c2", "j2"), a("c1", "j1")):
...     print([(i.anomaly.id, code) for i, code, why in b.add(x)])
[]
[]
[]
[('c1', 'duplicate')]
>>> [(i.anomaly.id, code) for i, code, why in b.add(a("c3", "j3"))]
[('w1', 'backlog_full')]
>>> first = b.take(); first.anomaly.id, b.take().anomaly.id, b.take().anomaly.id
('c1', 'c2', 'c3')
>>> b.take() is None, len(b)
(True, 0)
"""
from __future__ import annotations

import heapq
import logging
import threading
import time
import traceback
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from trainguard import events as ev
from trainguard.actions.interfaces import Work
from trainguard.actions.policy import BacklogSettings
from trainguard.logs import context as log_context
from trainguard.logs import service_logger

__all__ = ["Backlog", "Item", "Scheduler", "OffsetTracker", "SEVERITY_ORDER"]

SEVERITY_ORDER = ("critical", "warning", "info")


class Item:
    """One anomaly in the backlog; ``token`` is the caller's (the consumer offset)."""

    __slots__ = ("anomaly", "token", "seq", "rank", "state")

    def __init__(self, anomaly: ev.Anomaly, token, seq: int):
        self.anomaly = anomaly
        self.token = token
        self.seq = seq
        severity = anomaly.severity
        self.rank = SEVERITY_ORDER.index(severity) if severity in SEVERITY_ORDER \
            else len(SEVERITY_ORDER) - 1
        self.state = "queued"  # queued, taken, dropped

    @property
    def key(self) -> tuple:
        return (self.rank, self.seq)

    def __lt__(self, other: "Item") -> bool:
        return self.key < other.key


class Backlog:
    """The anomalies not yet started, most severe first, then oldest first, at most one job's
    anomaly taken at a time (:meth:`take` ... :meth:`release`). Pure: no thread, no clock;
    the caller locks."""

    def __init__(self, max_queued: int = 10_000):
        self.max_queued = max_queued
        self._seq = 0
        self._jobs: dict[str, list] = {}      # job -> heap of its queued items
        self._ready: list = []                # heap of (key, job): a job's head, maybe stale
        self._busy: set = set()               # jobs with an item taken
        self._ids: dict[str, Item] = {}       # anomaly id -> queued or taken item
        self._arrivals = [deque() for _ in SEVERITY_ORDER]  # per severity, oldest first
        self._queued = 0

    def __len__(self) -> int:
        return self._queued

    def add(self, anomaly: ev.Anomaly, token=None) -> list[tuple[Item, str, str]]:
        """Queue ``anomaly``; returns what was dropped for it, as ``(item, code, detail)``: the
        anomaly itself when one of the same id is queued or under way, or, when the backlog
        is full, the oldest of the least severe queued ones (the new one if it is less
        severe than all of them)."""
        self._seq += 1
        item = Item(anomaly, token, self._seq)
        if anomaly.id in self._ids:
            item.state = "dropped"
            where = "under way" if self._ids[anomaly.id].state == "taken" else "queued"
            return [(item, "duplicate", f"anomaly {anomaly.id} is already {where}")]
        dropped = []
        if self._queued >= self.max_queued:
            victim = self._least_important(item)
            dropped.append((victim, "backlog_full", (
                f"{self._queued} anomalies waiting (max_queued {self.max_queued}); dropped the "
                f"oldest of the least severe ({victim.anomaly.severity})")))
            if victim is item:
                item.state = "dropped"
                return dropped
            self._remove(victim)
        self._ids[anomaly.id] = item
        heapq.heappush(self._jobs.setdefault(anomaly.job, []), item)
        self._arrivals[item.rank].append(item)
        self._queued += 1
        if anomaly.job not in self._busy:
            heapq.heappush(self._ready, (item.key, anomaly.job))
        return dropped

    def take(self) -> Item | None:
        """The most urgent queued anomaly of a job with none under way; its job is busy
        until :meth:`release`."""
        while self._ready:
            key, job = heapq.heappop(self._ready)
            if job in self._busy:
                continue
            head = self._head(job)
            if head is None:
                continue
            if head.key != key:  # a stale hint: the job's head changed since
                heapq.heappush(self._ready, (head.key, job))
                continue
            heapq.heappop(self._jobs[job])
            head.state = "taken"
            self._busy.add(job)
            self._queued -= 1
            return head
        return None

    def release(self, item: Item) -> None:
        """``item`` (taken) is finished: its job may go on."""
        job = item.anomaly.job
        self._busy.discard(job)
        if self._ids.get(item.anomaly.id) is item:
            del self._ids[item.anomaly.id]
        head = self._head(job)
        if head is not None:
            heapq.heappush(self._ready, (head.key, job))
        self._compact()

    def _head(self, job: str) -> Item | None:
        heap = self._jobs.get(job)
        while heap and heap[0].state != "queued":
            heapq.heappop(heap)
        if not heap:
            self._jobs.pop(job, None)
            return None
        return heap[0]

    def _least_important(self, new: Item) -> Item:
        for rank in range(len(SEVERITY_ORDER) - 1, -1, -1):
            if rank < new.rank:
                return new  # every queued anomaly is more severe than the new one
            arrivals = self._arrivals[rank]
            while arrivals and arrivals[0].state != "queued":
                arrivals.popleft()
            if arrivals:
                return arrivals[0]
        return new

    def _remove(self, item: Item) -> None:
        item.state = "dropped"
        self._queued -= 1
        if self._ids.get(item.anomaly.id) is item:
            del self._ids[item.anomaly.id]
        self._head(item.anomaly.job)  # pops it if it was the head

    def _compact(self) -> None:
        for arrivals in self._arrivals:  # taken items leave the arrival lists by and by
            if len(arrivals) > 2 * self._queued + 64:
                kept = [i for i in arrivals if i.state == "queued"]
                arrivals.clear()
                arrivals.extend(kept)


class _Run:
    __slots__ = ("item", "steps", "wait")

    def __init__(self, item: Item, steps):
        self.item = item
        self.steps = steps
        self.wait = None


class Scheduler:
    """Runs anomalies down ``pipeline`` concurrently (see the module's doc). ``submit`` may
    be called from any thread; :meth:`run` is the loop (its own thread), :meth:`tick` one
    turn of it (without :meth:`run`, the pieces run inline: tests drive it by hand).
    ``pump(timeout)`` reads the stack replies the parked waits wait for (the
    :class:`~trainguard.actions.capture.StackGatherer`'s). ``on_done(token, work)`` is
    called once per submitted anomaly, with its :class:`~trainguard.actions.pipeline.Work`,
    when it is finished or dropped (``work.drop_code``: ``backlog_full``, ``duplicate``,
    ``internal_error`` here, or a stage's); it tells, logs and counts the outcome."""

    def __init__(self, *, pipeline, settings: BacklogSettings = BacklogSettings(),
                 pump: Callable[[float], int] | None = None,
                 on_done: Callable[[object, object], None] | None = None,
                 clock: Callable[[], float] = time.time,
                 log: Callable[[str], None] | None = None, status_every_s: float = 60.0):
        self.pipeline = pipeline
        self.settings = settings
        self.pump = pump
        self.on_done = on_done
        self.clock = clock
        self.log = log or _stderr
        self.status_every_s = status_every_s
        self.backlog = Backlog(settings.max_queued)
        self.counts: Counter = Counter()
        self._parked: list[_Run] = []
        self._in_flight = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._executor: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ input
    def submit(self, anomaly: ev.Anomaly, token=None) -> None:
        with self._lock:
            dropped = self.backlog.add(anomaly, token)
            self.counts["received"] += 1
        for item, code, detail in dropped:
            self._drop(item, code, detail)
        self._wake.set()

    def _drop(self, item: Item, code: str, detail: str) -> None:
        work = Work(anomaly=item.anomaly, now=self.clock())
        work.drop(code, detail)
        if code != "duplicate":  # the first of the same id is handled; this one is recorded
            try:
                self.pipeline.drop(work)
            except Exception:
                self.log(f"anomaly {item.anomaly.id}: recording the drop failed:\n"
                         f"{traceback.format_exc()}")
        self._report(item.token, work)

    # ------------------------------------------------------------------ the loop
    def status(self) -> dict:
        with self._lock:
            return {"queued": len(self.backlog), "in_flight": self._in_flight,
                    "parked": len(self._parked), **self.counts}

    def tick(self) -> int:
        """Resume the parked anomalies whose wait is over and start queued ones; returns how
        many pieces it started."""
        started = 0
        with self._lock:
            parked, self._parked = self._parked, []
        waiting = []
        for run in parked:
            try:
                over, value = run.wait.poll()
            except Exception as exc:  # the stage sees it, as if the wait had raised
                self._dispatch(run, None, exc)
                started += 1
                continue
            if over:
                self._dispatch(run, value)
                started += 1
            else:
                waiting.append(run)
        with self._lock:
            self._parked.extend(waiting)
        while True:
            with self._lock:
                if self._in_flight >= self.settings.max_in_flight:
                    break
                item = self.backlog.take()
                if item is None:
                    break
                self._in_flight += 1
            self._dispatch(_Run(item, self.pipeline.run(item.anomaly, now=self.clock())), None)
            started += 1
        return started

    def run(self, stop: threading.Event, idle_s: float = 0.05) -> None:
        """Loop until ``stop``; blocking calls run on ``settings.workers`` threads."""
        next_status = time.monotonic() + self.status_every_s
        last = None
        with ThreadPoolExecutor(self.settings.workers,
                                thread_name_prefix="trainguard-actions") as pool:
            self._executor = pool
            try:
                while not stop.is_set():
                    busy = self.tick()
                    if self.pump is not None:
                        self.pump(0.0 if busy else idle_s)
                    elif not busy:
                        self._wake.wait(idle_s)
                    self._wake.clear()
                    if time.monotonic() >= next_status:
                        next_status = time.monotonic() + self.status_every_s
                        now = self.status()
                        if now != last and (now["queued"] or now["in_flight"] or any(
                                k.startswith("dropped") for k in now)):
                            self.log("backlog: " + ", ".join(f"{k} {v}" for k, v in now.items()))
                        last = now
            finally:
                self._executor = None
                pool.shutdown(wait=True, cancel_futures=True)

    # ------------------------------------------------------------------ pieces
    def _dispatch(self, run: _Run, value, error: BaseException | None = None) -> None:
        self._piece(run, value, error)

    def _piece(self, run: _Run, value, error: BaseException | None) -> None:
        """Run ``run`` until its next wait (then park it) or its end."""
        a = run.item.anomaly
        try:
            with log_context(job=a.job, anomaly=a.id):    # fields of its JSON log lines
                wait = run.steps.throw(error) if error is not None else run.steps.send(value)
        except StopIteration as end:
            self._finish(run, end.value)
            return
        except Exception as exc:
            self.log(f"anomaly {a.id}: internal error, skipped:\n{traceback.format_exc()}")
            work = Work(anomaly=a, now=self.clock())
            work.drop("internal_error", f"{type(exc).__name__}: {exc}")
            self._finish(run, work)
            return
        run.wait = wait
        start = getattr(wait, "start_on", None)
        if start is not None:  # a blocking call: on a worker thread (inline without run())
            start(self._executor)
        with self._lock:
            self._parked.append(run)

    def _finish(self, run: _Run, work: Work) -> None:
        with self._lock:
            self.backlog.release(run.item)
            self._in_flight -= 1
        self._report(run.item.token, work)
        self._wake.set()

    def _report(self, token, work: Work) -> None:
        if self.on_done:
            try:
                self.on_done(token, work)
            except Exception:
                self.log(f"on_done: {traceback.format_exc()}")


class OffsetTracker:
    """Per partition, the offset up to which everything is finished (the next one to
    read after a restart). Thread-safe.

    >>> t = OffsetTracker()
    >>> for offset in (5, 6, 7):
    ...     t.started(0, offset)
    >>> t.finished(0, 6); t.committable()
    {}
    >>> t.finished(0, 5); t.committable()
    {0: 7}
    >>> t.finished(0, 7); t.committable(), t.committable()
    ({0: 8}, {})
    """

    def __init__(self):
        self._pending: dict[int, list] = {}
        self._done: dict[int, set] = {}
        self._high: dict[int, int] = {}
        self._committed: dict[int, int] = {}
        self._lock = threading.Lock()

    def started(self, partition: int, offset: int) -> None:
        with self._lock:
            heapq.heappush(self._pending.setdefault(partition, []), offset)
            self._high[partition] = max(self._high.get(partition, -1), offset + 1)
            self._committed.setdefault(partition, offset)  # where reading began: no news

    def finished(self, partition: int, offset: int) -> None:
        with self._lock:
            self._done.setdefault(partition, set()).add(offset)

    def committable(self) -> dict[int, int]:
        """Partitions whose commit point moved since the last call: ``{partition: offset}``."""
        out = {}
        with self._lock:
            for partition, pending in self._pending.items():
                done = self._done.get(partition, set())
                while pending and pending[0] in done:
                    done.discard(heapq.heappop(pending))
                point = pending[0] if pending else self._high[partition]
                if point > self._committed.get(partition, -1):
                    self._committed[partition] = point
                    out[partition] = point
        return out


_stderr = service_logger("trainguard.actions.scheduler", "trainguard actions",
                         logging.WARNING, stamp=False)
