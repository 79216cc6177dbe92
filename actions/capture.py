"""Capturing the stacks of every rank of a job, and turning them into suspects and machines.

:class:`StackCapture` sends a SPEC ``command`` (``capture_stacks``, ranks ``"all"``) and
:class:`StackGatherer` collects the ``stack`` replies of that ``capture_id`` until every
expected rank answered, or a deadline. With ``rounds > 1`` the capture is repeated
``interval_s`` apart: a rank whose main-thread stack changed between rounds is *moving*,
one whose stack stayed the same is *stuck*. :func:`localize` hands the latest stack of each
rank to the stack analysis (``trainguard.diagnosis.stacks``) and maps its suspects to machines
and parallel groups. The event source is injected (tests use a list of events and a clock
they move, ``tests/fakes.py``); here, the replies of one round:

>>> def stack(rank, cid, fn):
...     frames = [{"function": fn, "file": "train.py", "line": 1},
...               {"function": "main", "file": "train.py", "line": 9}]
...     return ev.Stack(job="j1", ts=1.0, node=f"n{rank // 2}", rank=rank, capture_id=cid,
...                     pid=100 + rank, method="py-spy",
...                     threads=[{"name": "MainThread", "id": 1, "frames": frames}])
>>> got = {r: stack(r, "c1", "load_batch" if r == 2 else "all_reduce") for r in range(4)}
>>> loc = localize(CaptureResult(job="j1", capture_ids=["c1"], rounds=[got]),
...               JobInfo(world_size=4))
>>> loc["suspects"], loc["nodes"]
([2], ['n1'])
"""
from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterable, Protocol

from trainguard import events as ev
from trainguard.actions.policy import CaptureSettings
from trainguard.diagnosis.stacks import analyze_threads, frame_key, map_suspects, render_tree_text
from trainguard.actions.waits import Pause, drive

__all__ = ["EventSource", "StackGatherer", "StackCapture",
           "AwaitStacks", "CaptureResult", "JobInfo", "JobDirectory", "localize", "main_signature"]


class EventSource(Protocol):
    """Where events come from: the next decoded event within ``timeout`` seconds, or None."""

    def poll(self, timeout: float) -> ev.Event | None: ...


class StackGatherer:
    """Collects the ``stack`` replies of captures from ``source``: only those of capture ids
    it was told to :meth:`expect` (at most ``keep`` of them at a time, oldest forgotten),
    and only from the job named. Thread-safe: :meth:`expect` may be called from any thread,
    :meth:`pump` and :meth:`check` from one."""

    def __init__(self, source: EventSource, clock: Callable[[], float] = time.monotonic,
                 poll_s: float = 0.2, keep: int = 4096):
        self.source = source
        self.clock = clock
        self.poll_s = poll_s
        self.keep = keep
        self._open: OrderedDict = OrderedDict()  # capture id -> [job, {rank: stack}, last]
        self._lock = threading.Lock()

    def expect(self, job: str, capture_id: str) -> None:
        """Keep the replies of ``capture_id`` from now on (call before sending the command)."""
        with self._lock:
            if capture_id not in self._open:
                self._open[capture_id] = [job, {}, None]
                while len(self._open) > self.keep:
                    self._open.popitem(last=False)

    def pump(self, timeout: float, max_events: int = 1) -> int:
        """Read up to ``max_events`` events (the first within ``timeout``), filing the
        replies of expected captures; returns how many events were read."""
        count = 0
        while count < max_events:
            event = self.source.poll(timeout if count == 0 else 0.0)
            if event is None:
                break
            count += 1
            if isinstance(event, ev.Stack) and event.rank is not None:
                with self._lock:
                    entry = self._open.get(event.capture_id)
                    if entry is not None and entry[0] == event.job:
                        entry[1][event.rank] = event
                        entry[2] = self.clock()
        return count

    def check(self, capture_id: str, expected: set | None, start: float, deadline_s: float,
              quiet_s: float) -> tuple[bool, dict]:
        """``(over, {rank: stack})`` of a capture begun at ``start`` (this gatherer's clock):
        over once every ``expected`` rank answered, or ``deadline_s`` passed, or, with
        ``expected`` None, no new rank answered for ``quiet_s`` after the first. An
        ended capture is forgotten."""
        now = self.clock()
        with self._lock:
            entry = self._open.get(capture_id) or [None, {}, None]
            replies, last = entry[1], entry[2]
            over = ((expected is not None and expected <= replies.keys())
                    or now - start >= deadline_s
                    or (expected is None and last is not None and now - last >= quiet_s))
            if over:
                self._open.pop(capture_id, None)
            return over, dict(replies)

    def gather(self, job: str, capture_id: str, expected: set | None = None,
               deadline_s: float = 10.0, quiet_s: float = 2.0) -> dict[int, ev.Stack]:
        """``{rank: stack event}``, blocking until :meth:`check` says the capture is over."""
        self.expect(job, capture_id)
        return AwaitStacks(self, job, capture_id, expected, deadline_s, quiet_s).block()


class AwaitStacks:
    """A wait (:mod:`trainguard.actions.waits`) for the replies of one capture."""

    def __init__(self, gatherer: StackGatherer, job: str, capture_id: str,
                 expected: set | None, deadline_s: float, quiet_s: float):
        self.gatherer = gatherer
        self.job, self.capture_id, self.expected = job, capture_id, expected
        self.deadline_s, self.quiet_s = deadline_s, quiet_s
        self.start = gatherer.clock()

    def poll(self) -> tuple[bool, dict]:
        return self.gatherer.check(self.capture_id, self.expected, self.start,
                                   self.deadline_s, self.quiet_s)

    def block(self) -> dict:
        while True:
            over, replies = self.poll()
            if over:
                return replies
            left = self.deadline_s - (self.gatherer.clock() - self.start)
            self.gatherer.pump(min(self.gatherer.poll_s, max(0.0, left)))

    def __repr__(self) -> str:
        return f"AwaitStacks({self.job}, {self.capture_id})"


@dataclass(kw_only=True)
class JobInfo:
    """What is known of a job's layout from its lifecycle and stack events."""

    world_size: int | None = None
    topology: dict | None = None
    rank_to_node: dict = field(default_factory=dict)

    def expected_ranks(self) -> set | None:
        return set(range(self.world_size)) if self.world_size else None


@dataclass
class _JobRecord:
    info: JobInfo = field(default_factory=JobInfo)
    launches: list = field(default_factory=list)
    satisfied: list = field(default_factory=list)
    rank_started: dict = field(default_factory=dict)   # rank -> its last start's ts
    this_run: set = field(default_factory=set)         # ranks started in the current run


class JobDirectory:
    """Learns each job's world size, topology and rank-to-machine map from ``lifecycle``
    starts, heartbeats and ``stack`` events, when it was (re)launched, and which
    restart orders it acked ``already_satisfied`` (:meth:`note_satisfied`, from the order
    desk). At most ``max_jobs`` jobs, the least recently heard forgotten first. With a
    ``clock``, a start stamped more than ``ahead_s`` after it is no launch (it would hide the
    real ones). Thread-safe: fed by other threads than the one reading it.

    >>> d = JobDirectory()
    >>> d.observe(ev.Lifecycle(job="j1", ts=1.0, node="n3", rank=5, event="start", pid=9,
    ...                        world_size=8, topology={"tp": 2, "pp": 1, "dp": 4}))
    >>> info = d.info("j1")
    >>> info.world_size, info.rank_to_node
    (8, {5: 'n3'})
    """

    def __init__(self, max_jobs: int = 10_000, clock: Callable[[], float] | None = None,
                 ahead_s: float = 300.0):
        self.max_jobs = max_jobs
        self.clock = clock
        self.ahead_s = ahead_s
        self._jobs: OrderedDict = OrderedDict()   # job -> _JobRecord
        self._lock = threading.Lock()

    def _record(self, job: str) -> _JobRecord:
        record = self._jobs.get(job)
        if record is None:
            record = self._jobs[job] = _JobRecord()
            while len(self._jobs) > self.max_jobs:
                self._jobs.popitem(last=False)
        else:
            self._jobs.move_to_end(job)
        return record

    def note_satisfied(self, job: str, incident: str) -> None:
        """``trainguard run`` acked the restart of ``incident`` ``already_satisfied``: it had
        relaunched the job on its own after the incident began."""
        with self._lock:
            satisfied = self._record(job).satisfied
            satisfied.append(incident)
            del satisfied[:-100]

    def observe(self, event: ev.Event) -> None:
        with self._lock:
            record = self._record(event.job)
            if isinstance(event, ev.Lifecycle) and event.event == "start" and (
                    self.clock is None or event.ts <= self.clock() + self.ahead_s) and (
                    event.rank is None or _rank_run_began(record, event)):
                record.launches.append(event.ts)
                del record.launches[:-100]
            if event.node is None:
                return
            info = record.info
            if isinstance(event, ev.Lifecycle) and event.event == "start" \
                    and event.rank is not None:  # not the supervisor's guess for the job
                info.world_size = event.world_size or info.world_size
                info.topology = event.topology or info.topology
            if event.rank is not None and isinstance(event, (ev.Lifecycle, ev.Heartbeat,
                                                             ev.Stack, ev.Step)):
                info.rank_to_node[event.rank] = event.node

    def launches(self, job: str) -> list[float]:
        """When the job was (re)launched, oldest first: by ``trainguard run``, or the first
        rank start of each run after the first."""
        with self._lock:
            record = self._jobs.get(job)
            return sorted(record.launches) if record else []

    def satisfied(self, job: str) -> frozenset:
        """Incidents whose restart ``trainguard run`` acked ``already_satisfied``."""
        with self._lock:
            record = self._jobs.get(job)
            return frozenset(record.satisfied) if record else frozenset()

    def info(self, job: str) -> JobInfo:
        with self._lock:
            record = self._jobs.get(job)
            known = record.info if record else JobInfo()
            return JobInfo(world_size=known.world_size, topology=known.topology,
                           rank_to_node=dict(known.rank_to_node))


def _rank_run_began(record: _JobRecord, start: ev.Lifecycle) -> bool:
    """Whether a rank's ``start`` is the first of a new run: that rank had already started in
    the current one, earlier (a job relaunched without ``trainguard run``: by Slurm,
    Kubernetes or torchrun itself). A redelivered or late start is not."""
    if start.ts <= record.rank_started.get(start.rank, float("-inf")):
        return False
    record.rank_started[start.rank] = start.ts
    began = start.rank in record.this_run
    if began:
        record.this_run.clear()
    record.this_run.add(start.rank)
    return began


def main_signature(stack: ev.Stack) -> tuple | None:
    """The main thread's frames (``function (file)``, outermost first), or None."""
    if stack.error or not stack.threads:
        return None
    main = next((t for t in stack.threads if t.get("name") == "MainThread"), stack.threads[0])
    return tuple(frame_key(f) for f in reversed(main.get("frames") or [])) or None


@dataclass(kw_only=True)
class CaptureResult:
    """The replies of every round, oldest first."""

    job: str
    capture_ids: list
    rounds: list
    expected: set | None = None

    def latest(self) -> dict[int, ev.Stack]:
        """Each rank's most recent reply (a rank missing from the last round keeps its older
        one)."""
        out: dict[int, ev.Stack] = {}
        for replies in self.rounds:
            out.update(replies)
        return out

    def per_rank_threads(self) -> dict[int, list | str]:
        return {rank: (s.error or "capture failed") if s.error else s.threads
                for rank, s in self.latest().items()}

    def moving(self) -> tuple[list, list]:
        """``(moving, stuck)``: ranks whose main-thread stack changed between rounds, and
        ranks seen in two or more rounds whose stack did not."""
        seen: dict[int, list] = {}
        for replies in self.rounds:
            for rank, stack in replies.items():
                signature = main_signature(stack)
                if signature is not None:
                    seen.setdefault(rank, []).append(signature)
        moving = sorted(r for r, sigs in seen.items() if len(set(sigs)) > 1)
        stuck = sorted(r for r, sigs in seen.items() if len(sigs) > 1 and len(set(sigs)) == 1)
        return moving, stuck


class StackCapture:
    """Sends ``capture_stacks`` and gathers the replies, ``settings.rounds`` times."""

    def __init__(self, *, send: Callable[[ev.Command], None], gatherer: StackGatherer,
                 settings: CaptureSettings = CaptureSettings(),
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.time,
                 new_id: Callable[[str, int], str] | None = None):
        self.send = send
        self.gatherer = gatherer
        self.settings = settings
        self.sleep = sleep
        self.clock = clock
        self.new_id = new_id or _capture_id

    def capture(self, job: str, expected: set | None = None, label: str = "cap"
                ) -> CaptureResult:
        """The capture, blocking until it is over."""
        return drive(self.rounds(job, expected, label))

    def rounds(self, job: str, expected: set | None = None, label: str = "cap"
               ) -> Generator[object, object, CaptureResult]:
        """The capture as a waiting generator: it yields a :class:`~trainguard.actions.waits.
        Pause` between rounds and an :class:`AwaitStacks` for each round's replies."""
        s = self.settings
        result = CaptureResult(job=job, capture_ids=[], rounds=[], expected=expected)
        for number in range(s.rounds):
            if number:
                if not result.rounds[-1]:
                    break  # nobody answered: another round would only add latency
                yield Pause(s.interval_s, clock=self.gatherer.clock, sleep=self.sleep)
            capture_id = self.new_id(label, number)
            self.gatherer.expect(job, capture_id)
            self.send(ev.Command(job=job, ts=self.clock(), command="capture_stacks",
                                 capture_id=capture_id, ranks="all"))
            result.capture_ids.append(capture_id)
            result.rounds.append((yield AwaitStacks(self.gatherer, job, capture_id, expected,
                                                    s.deadline_s, s.quiet_s)))
        return result


def _capture_id(label: str, number: int) -> str:
    return f"{label[:96]}-r{number}-{uuid.uuid4().hex[:8]}"


def _group_nodes(groups: dict, rank_to_node: dict) -> dict:
    return {dim: sorted({rank_to_node[r] for members in lists for r in members
                         if r in rank_to_node})
            for dim, lists in groups.items()}


def localize(result: CaptureResult, info: JobInfo, analyze=analyze_threads,
             map_ranks=map_suspects) -> dict:
    """The stack analysis (SPEC §4 fields) of the latest stacks, plus ``nodes`` (machines of
    the suspects), ``groups`` and ``group_nodes`` (their TP/PP/DP groups and those groups'
    machines), ``moving``/``stuck`` ranks, ``world_size``, ``capture_ids`` and ``text`` (the
    merged tree for alerts)."""
    latest = result.latest()
    expected = result.expected if result.expected is not None else info.expected_ranks()
    analysis = analyze(result.per_rank_threads(), expected_ranks=expected)
    rank_to_node = {**info.rank_to_node, **{r: s.node for r, s in latest.items() if s.node}}
    world = info.world_size or (max(expected) + 1 if expected else None) or analysis["ranks"]
    mapping = map_ranks(analysis["suspects"], rank_to_node, info.topology, world)
    moving, stuck = result.moving()
    loc = dict(analysis)
    loc.update(nodes=mapping["nodes"], groups=mapping["groups"],
               group_nodes=_group_nodes(mapping["groups"], rank_to_node),
               unmapped=mapping.get("unmapped", []), moving=moving, stuck=stuck,
               world_size=world, answered=sorted(latest), capture_ids=list(result.capture_ids),
               text=render_tree_text(analysis) if analysis.get("tree") else "")
    return loc
