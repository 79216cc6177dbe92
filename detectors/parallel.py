"""``trainguard analyze FILE --workers N``: the worker's job side in this process, its rank
side in N - 1 others, with exactly the result of one process.

On the project's recordings the job side (one ``JobStage`` per job) takes 40-45% of a
one-process analysis and decoding with the rank side the rest, so N processes are one for
the job side and N - 1 for the rank side: with two cores, one of each.

The ranks are split as the telemetry topic splits them: a line's key is the collectors'
producer key (``job/rank`` for a rank's events, ``job/node`` for a machine's ``gpu`` and
``xid`` events), its partition the Java client's murmur2 hash of the key modulo
``partitions`` (the telemetry topic's default count), and each rank-side process owns some of
the partitions, as a consumer of the topic would. The partitions are dealt to the workers by
their bytes in the first ``chunk_lines`` lines, largest first, so that the processes get
similar shares of the decoding (every worker makes the same deal from the same lines).

Each worker reads the whole file, finds every line's key in its raw bytes (no decoding),
decodes only its own lines, runs the event-time filter, one ``RankStage`` per rank and one
``NodeStage`` per machine over them, as the online worker's rank side does, and sends per
``chunk_lines`` lines of the file the summaries with each event's place in the file. This
process takes the chunks of all workers in file order and replays the one-process loop of
:func:`~.offline.analyze_events` on them: the event-time filter on every event, the summaries
into the jobs' ``JobStage``, each event's time on its job's clock and ``advance`` on the
same event-time grid. The job side (the job clock included) thus sees the same items in the
same order, and the incidents are the same, byte for byte.

Two things are checked rather than assumed, and a recording that fails either check is
analyzed again in one process (never a different answer, only a slower one):

- a line's raw key is the key of the decoded event (a line with, say, ``"rank"`` nested in
  ``extra`` before its own, or a ``gpu`` event carrying a rank, could be placed wrongly);
- a worker's event-time filter, which sees only its own ranks, accepts and refuses exactly
  the events that the filter here, which sees every event, does (the filter judges an
  event by its job's other events: a clock far off can be refused by one and not the other).

>>> import json, os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "crash.jsonl")
>>> lines = [{"v": 1, "type": "step", "job": "j", "ts": 100.0 + s, "node": f"n{r // 2}",
...           "rank": r, "step": s, "step_time": 1.0} for s in range(50) for r in range(8)]
>>> lines.append({"v": 1, "type": "lifecycle", "job": "j", "ts": 150.5, "node": "n0",
...               "rank": 1, "event": "exit", "exit_code": 139})
>>> with open(path, "w") as f:
...     _ = f.write("\\n".join(json.dumps(x) for x in lines) + "\\nnot json\\n")
>>> result = analyze_file_parallel(path, workers=2, chunk_lines=64)
>>> result["events"], result["invalid"], [(i["kind"], i["ranks"]) for i in result["incidents"]]
(401, 1, [('crash', [1])])
>>> from .offline import analyze_file
>>> result == analyze_file(path)
True
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import queue as queue_module
import re
from itertools import islice
from pathlib import Path
from sys import intern

import orjson

from trainguard import events as ev
from trainguard.errors import UserError
from trainguard.eventtime import EventTimeFilter, EventTimeLimits
from trainguard.recording import iter_lines
from trainguard.topics import DEFAULT_TELEMETRY_PARTITIONS

from .config import DetectorConfig
from .stages import Engine, NodeStage, RankStage, launcher_summary
from .offline import MAX_REJECTIONS_LISTED, _overrides_book, analyze_file, result_of

__all__ = ["analyze_file_parallel", "analyze_lines_parallel", "default_workers", "murmur2",
           "Router", "WORKERS_MIN_BYTES"]

#: lines of the file per message from a worker
CHUNK_LINES = 8192
#: a recording smaller than this is analyzed in one process (starting workers costs more)
WORKERS_MIN_BYTES = 4 << 20
#: messages a worker may run ahead of the job side (bounds the memory in flight)
QUEUED_CHUNKS = 8
_RANK_EVENTS = frozenset(("step", "heartbeat", "lifecycle"))
_NODE_EVENTS = frozenset(("gpu", "xid"))


#: the most processes ``--workers`` takes by default: the job side bounds the time long before
#: (it is 40-45% of a one-process run), and each rank-side process reads the whole file
DEFAULT_MOST_WORKERS = 8


def default_workers() -> int:
    """The cores this process may run on, at most :data:`DEFAULT_MOST_WORKERS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, DEFAULT_MOST_WORKERS))


def murmur2(data: bytes) -> int:
    """The Kafka Java client's murmur2 hash (librdkafka's ``murmur2_random`` partitioner
    uses it too): the partition of ``key`` is ``(murmur2(key) & 0x7fffffff) % partitions``.

    >>> murmur2(b"llama/12"), (murmur2(b"j/0") & 0x7FFFFFFF) % 24
    (4122973956, 14)
    """
    length = len(data)
    m = 0x5BD1E995
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    whole = length & ~3
    for i in range(0, whole, 4):
        k = (int.from_bytes(data[i:i + 4], "little") * m) & 0xFFFFFFFF
        k = ((k ^ (k >> 24)) * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    rest = length & 3
    if rest >= 3:
        h ^= data[whole + 2] << 16
    if rest >= 2:
        h ^= data[whole + 1] << 8
    if rest >= 1:
        h = ((h ^ data[whole]) * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    return h ^ (h >> 15)


_JOB = re.compile(rb'"job"\s*:\s*"((?:[^"\\]|\\.)*)"')
_RANK = re.compile(rb'"rank"\s*:\s*(-?[0-9]+|null)\s*[,}]')
_NODE = re.compile(rb'"node"\s*:\s*"((?:[^"\\]|\\.)*)"')


def _text(raw: bytes) -> bytes:
    """A JSON string's raw bytes (between the quotes) as the UTF-8 of its value."""
    if b"\\" not in raw:
        return raw
    try:
        return orjson.loads(b'"' + raw + b'"').encode()
    except (orjson.JSONDecodeError, UnicodeEncodeError):
        return raw


def event_key(event) -> bytes | None:
    """The producer's key of an event that has state on the rank side (a rank's RankStage,
    a machine's NodeStage), else None.

    >>> event_key(ev.Step(job="j", ts=1.0, node="n1", rank=3, step=1, step_time=1.0))
    b'j/3'
    >>> event_key(ev.Gpu(job="j", ts=1.0, node="n1", gpus=[])), event_key(
    ...     ev.Lifecycle(job="j", ts=1.0, node="n1", rank=None, event="exit"))
    (b'j/n1', None)
    """
    kind = event.TYPE
    if kind in _RANK_EVENTS:
        return None if event.rank is None else f"{event.job}/{event.rank}".encode()
    if kind in _NODE_EVENTS:
        return f"{event.job}/{event.node or ''}".encode()
    return None


class Router:
    """Which worker decodes a line, from its raw bytes: the partition of its key (``job/rank``
    when it has a rank, else ``job/node``), and that partition's worker (:meth:`deal`).
    A line without a key found goes to worker 0.

    >>> r = Router(workers=2, partitions=24)
    >>> r.key(b'{"v":1,"type":"step","job":"j","ts":1.0,"node":"n1","rank":0,"step":1}')
    b'j/0'
    >>> r.key(b'{"type": "gpu", "job": "j", "rank": null, "node": "n1", "gpus": []}')
    b'j/n1'
    >>> r.key(b'not json') is None
    True
    """

    def __init__(self, workers: int, partitions: int = DEFAULT_TELEMETRY_PARTITIONS):
        self.workers = workers
        self.partitions = partitions
        self.owner_of: list = [p % workers for p in range(partitions)]
        self._cache: dict = {}       # key -> owner
        self._lines: dict = {}       # (job text, rank text) -> owner

    def key(self, line: bytes) -> bytes | None:
        i = line.find(b'"job":"')
        if i >= 0:
            i += 7
            j = line.find(b'"', i)
            job = line[i:j]
            if b"\\" in job:             # an escaped quote: the pattern finds its end
                m = _JOB.search(line)
                job = _text(m.group(1)) if m else None
        else:
            m = _JOB.search(line)
            job = _text(m.group(1)) if m else None
        if job is None:
            return None
        i = line.find(b'"rank":')
        if i >= 0:
            i += 7
            j = line.find(b",", i)
            rank = line[i:j] if j >= 0 else b""
            if not rank.isdigit():
                m = _RANK.search(line)
                rank = m.group(1) if m else b"null"
        else:
            m = _RANK.search(line)
            rank = m.group(1) if m else b"null"
        if rank != b"null":
            return job + b"/" + str(int(rank)).encode()
        i = line.find(b'"node":"')
        if i >= 0:
            i += 8
            node = line[i:line.find(b'"', i)]
            if b"\\" in node:
                m = _NODE.search(line)
                node = _text(m.group(1)) if m else b""
        else:
            m = _NODE.search(line)
            node = _text(m.group(1)) if m else b""
        return job + b"/" + node

    def line_owner(self, line: bytes) -> int:
        """``owner(key(line))``, remembered for the common line (a rank's, its job without
        escapes): the same ``"job"`` and ``"rank"`` text, the same key."""
        i = line.find(b'"job":"')
        r = line.find(b'"rank":')
        if i >= 0 and r >= 0:
            i += 7
            r += 7
            probe = (line[i:line.find(b'"', i)], line[r:line.find(b",", r)])
            owner = self._lines.get(probe)
            if owner is not None:
                return owner
            owner = self.owner(self.key(line))
            if probe[1].isdigit() and b"\\" not in probe[0]:
                self._lines[probe] = owner
            return owner
        return self.owner(self.key(line))

    def partition(self, key: bytes) -> int:
        return (murmur2(key) & 0x7FFFFFFF) % self.partitions

    def owner(self, key: bytes | None) -> int:
        if key is None:
            return 0
        owner = self._cache.get(key)
        if owner is None:
            owner = self._cache[key] = self.owner_of[self.partition(key)]
        return owner

    def deal(self, lines) -> None:
        """Deal the partitions to the workers by their bytes in ``lines``, largest first,
        each to the worker with the fewest bytes so far (ties: the lower number); partitions
        absent from ``lines`` go round the workers by number.

        >>> r = Router(workers=2, partitions=4)
        >>> [r.partition(b"j/%d" % rank) for rank in range(4)]
        [2, 0, 0, 1]
        >>> r.deal([b'{"job":"j","rank":%d}' % rank for rank in (0, 1, 2, 3, 3)])
        >>> r.owner_of, [r.owner(b"j/%d" % rank) for rank in range(4)]
        ([0, 1, 0, 1], [0, 0, 0, 1])
        """
        size = [0] * self.partitions
        for line in lines:
            key = self.key(line)
            size[self.partition(key) if key is not None else 0] += len(line)
        load = [0] * self.workers
        owner_of = [p % self.workers for p in range(self.partitions)]
        for p in sorted(range(self.partitions), key=lambda p: (-size[p], p)):
            if not size[p]:
                break
            w = min(range(self.workers), key=lambda w: (load[w], w))
            owner_of[p] = w
            load[w] += size[p]
        self.owner_of = owner_of
        self._cache.clear()
        self._lines.clear()


# -- a worker process -------------------------------------------------------------------------
def _worker(path, index, workers, partitions, chunk_lines, config, limits, queue) -> None:
    """Worker ``index``: its lines' events through the filter and the rank side; one message
    per chunk of the file's lines (see the module)."""
    gc.set_threshold(50_000, 20, 100)      # many short-lived dicts, no cycles to speak of
    out = _Sender(queue)
    try:
        _work(path, index, workers, partitions, chunk_lines, config, limits, out)
    except UserError as exc:
        out.put(("user_error", type(exc).__name__, str(exc)))
    except _Orphaned:
        queue.cancel_join_thread()           # what is buffered has no reader any more
        return
    except BaseException as exc:             # the job side falls back to one process
        out.put(("error", f"{type(exc).__name__}: {exc}"))


class _Orphaned(Exception):
    """The job side's process is gone."""


class _Sender:
    """``put`` on the queue to the job side, which gives up once that process is gone (a
    full queue would otherwise block forever)."""

    def __init__(self, queue):
        self.queue = queue
        self.parent = os.getppid()

    def put(self, message) -> None:
        while True:
            try:
                self.queue.put(message, timeout=1.0)
                return
            except queue_module.Full:
                if os.getppid() != self.parent:
                    raise _Orphaned from None


def _work(path, index, workers, partitions, chunk_lines, config, limits, queue) -> None:
    position = [0]

    def on_read(pos):
        position[0] = pos

    lines = iter_lines(path, on_read)
    chunk = list(islice(lines, chunk_lines))
    router = Router(workers, partitions)
    if workers > 1:
        router.deal(chunk)
    side = _RankSide(index, router, config, limits)
    number = 0
    while chunk:
        offsets, records = side.chunk(chunk, number * chunk_lines)
        if side.misplaced is not None:
            queue.put(("misplaced", side.misplaced))
            return
        queue.put(("chunk", number, position[0], offsets, records))
        number += 1
        chunk = list(islice(lines, chunk_lines))
    queue.put(("done", side.valid, side.invalid, side.types, sorted(side.jobs)))


class _RankSide:
    """One worker's rank side: the event-time filter, a RankStage per rank and a NodeStage
    per machine, over the lines that are its own."""

    def __init__(self, index: int, router: Router, config, limits):
        self.index = index
        self.router = router
        self.check = EventTimeFilter(limits).check
        self.config = config if config is not None else DetectorConfig()
        self.ranks: dict = {}
        self.nodes: dict = {}
        self.types: dict = {}          # type -> [line of its first accepted event, count]
        self.jobs: set = set()
        self.valid = self.invalid = 0
        self.misplaced = None

    def chunk(self, lines: list, first: int) -> tuple[list, list]:
        """``(offsets, records)`` of this worker's events among ``lines`` (the first is line
        number ``first`` of the file): each event's offset in ``lines`` and its record
        ``(job, node, ts, step, items, refused)`` (``items``: summaries for the job side,
        None when there is nothing to give it; ``refused``: ``(type, rank, reason)`` of an
        event the filter refused, else None)."""
        index, line_owner = self.index, self.router.line_owner
        every = self.router.workers == 1         # the only worker: every line is its own
        decode, InvalidEvent, check = ev.decode, ev.InvalidEvent, self.check
        ranks, nodes, types, jobs_add = self.ranks, self.nodes, self.types, self.jobs.add
        offsets: list = []
        records: list = []
        keep, record = offsets.append, records.append
        for offset, line in enumerate(lines):
            if not every and line_owner(line) != index:
                continue
            try:
                event = decode(line)
            except InvalidEvent:
                self.invalid += 1
                continue
            kind = event.TYPE
            # one string object per job and machine name: the chunk pickles each once
            job, node, rank = intern(event.job), event.node, event.rank
            if node is not None:
                node = intern(node)
            step = getattr(event, "step", None)
            keep(offset)
            reason = check(event)
            if reason is not None:
                record((job, node, event.ts, step, None, (kind, rank, reason)))
                continue
            items = None
            if kind in _RANK_EVENTS:
                if rank is not None:
                    stage = ranks.get((job, rank))
                    if stage is None:
                        stage = self._new_stage(event, (job, rank))
                    items = stage.update(event) or None
                elif kind == "lifecycle":     # the launcher's: straight to the job side
                    items = [launcher_summary(event)]
            elif kind in _NODE_EVENTS:
                stage = nodes.get((job, node))
                if stage is None:
                    stage = self._new_stage(event, (job, node))
                items = stage.update(event)   # [] too: the job stage is made
            counted = types.get(kind)
            if counted is None:
                types[kind] = [first + offset, 1]
            else:
                counted[1] += 1
            jobs_add(job)
            record((job, node, event.ts, step, items, None))
            if self.misplaced is not None:
                break
        self.valid += len(offsets)
        return offsets, records

    def _new_stage(self, event, key):
        """A new RankStage or NodeStage, once sure that this worker owns its key."""
        true_key = event_key(event)
        if self.router.owner(true_key) != self.index:
            self.misplaced = (event.TYPE, true_key)
        if event.TYPE in _NODE_EVENTS:
            stage = self.nodes[key] = NodeStage(self.config)
        else:
            stage = self.ranks[key] = RankStage(self.config)
        return stage


# -- the job side ---------------------------------------------------------------------------------
class _Fallback(Exception):
    """The split cannot give the one-process answer for this recording (see the module)."""


class _Probe:
    """What the event-time filter reads of an event."""

    __slots__ = ("job", "ts", "step")


def analyze_lines_parallel(path, workers: int, config: DetectorConfig | None = None,
                           limits: EventTimeLimits | None = None, tune_stage=None,
                           on_read=None, chunk_lines: int = CHUNK_LINES,
                           partitions: int = DEFAULT_TELEMETRY_PARTITIONS):
    """The job side here, the rank side in ``workers`` processes: ``(engine, summary,
    counts)`` as :func:`~.offline.analyze_events` over the file's events gives (``counts``:
    ``{"events": valid lines, "invalid": invalid lines}``), or None when the recording must
    be analyzed in one process instead (see the module). Raises what reading the file raises
    (:class:`~trainguard.recording.RecordingError`)."""

    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    queues = [context.Queue(QUEUED_CHUNKS) for _ in range(workers)]
    procs = [context.Process(target=_worker, daemon=True, name=f"analyze-{w}",
                             args=(str(path), w, workers, partitions, chunk_lines, config,
                                   limits, queues[w]))
             for w in range(workers)]
    for proc in procs:
        proc.start()

    def receive(w):
        while True:
            try:
                return queues[w].get(timeout=1.0)
            except queue_module.Empty:
                if not procs[w].is_alive() and queues[w].empty():
                    raise _Fallback(f"worker {w} ended with exit code {procs[w].exitcode}")

    thresholds = gc.get_threshold()
    # each message brings thousands of records at once, which would otherwise go through
    # the young generations' collections over and over (10% of the job side's time)
    gc.set_threshold(max(thresholds[0], 50_000), *thresholds[1:])
    try:
        return _job_side(receive, workers, chunk_lines, config, limits, tune_stage, on_read,
                         MAX_REJECTIONS_LISTED)
    except _Fallback:
        return None
    finally:
        gc.set_threshold(*thresholds)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join()
        for queue in queues:
            queue.close()
            queue.cancel_join_thread()


def _job_side(receive, workers, chunk_lines, config, limits, tune_stage, on_read,
              max_listed):
    engine = Engine(config, tune_stage=tune_stage)
    job_stage, jobs_of = engine.job_stage, engine._jobs
    times: dict = {}                  # job -> its JobStage's clock.time
    # one rank-side worker saw every event in order: its filter's answers are the answers
    check = EventTimeFilter(limits).check if workers > 1 else None
    probe = _Probe()
    now = first = None
    next_advance = engine.next_advance_ts
    rejected = 0
    rejections: list = []
    done: list = [None] * workers
    chunk = 0
    while not all(done):
        merged: list = [None] * chunk_lines if workers > 1 else []
        for w in range(workers):
            if done[w] is not None:
                continue
            msg = receive(w)
            kind = msg[0]
            if kind == "done":
                done[w] = msg
                continue
            if kind == "user_error":
                from trainguard.recording import RecordingError

                raise RecordingError(msg[2])
            if kind != "chunk":            # misplaced, error
                raise _Fallback(msg)
            if msg[1] != chunk:
                raise _Fallback(("out of order", msg[1], chunk))
            if w == 0 and on_read is not None and msg[2]:
                on_read(msg[2])
            offsets, records = msg[3], msg[4]
            if workers == 1:
                merged = records           # in the file's order already
                break
            for offset, record in zip(offsets, records):
                merged[offset] = record
        chunk += 1
        for record in merged:
            if record is None:
                continue
            job, node, ts, step, items, refused = record
            if check is None:
                reason = refused[2] if refused is not None else None
            else:
                probe.job, probe.ts, probe.step = job, ts, step
                reason = check(probe)
            if reason is not None:
                if refused is None:
                    raise _Fallback("a worker's filter accepted an event refused here")
                rejected += 1
                if len(rejections) < max_listed:
                    rejections.append({"job": job, "type": refused[0], "rank": refused[1],
                                       "ts": ts, "reason": reason})
                continue
            if refused is not None:
                raise _Fallback("a worker's filter refused an event accepted here")
            if items is not None:
                stage = jobs_of.get(job) or job_stage(job)
                for item in items:
                    stage.update(item)
            clock_time = times.get(job)      # Engine.job_time, its clock's method kept
            if clock_time is None:
                stage = jobs_of.get(job)
                if stage is not None:
                    clock_time = times[job] = stage.clock.time
            t = clock_time(node, ts) if clock_time is not None else ts
            if now is None:
                now = first = t
            elif t > now:
                now = t
            if now >= next_advance:
                engine.advance(now)
                next_advance = engine.next_advance_ts
    if now is not None:
        engine.advance(now, force=True)
    types: dict = {}
    for _, kind, count in sorted((line, kind, count) for m in done
                                 for kind, (line, count) in m[3].items()):
        types[kind] = types.get(kind, 0) + count
    jobs: set = set()
    valid = invalid = 0
    for m in done:
        valid, invalid = valid + m[1], invalid + m[2]
        jobs.update(m[4])
    summary = {"types": types, "jobs": sorted(jobs), "first_ts": first, "last_ts": now,
               "rejected": rejected, "rejections": rejections}
    return engine, summary, {"events": valid, "invalid": invalid}


def analyze_file_parallel(path, config: DetectorConfig | None = None,
                          overrides: dict | None = None, on_read=None,
                          workers: int | None = None, chunk_lines: int = CHUNK_LINES) -> dict:
    """:func:`~.offline.analyze_file` over ``workers`` processes, this one the job side and
    ``workers - 1`` the rank side (None: :func:`default_workers`, or one process for a
    recording under :data:`WORKERS_MIN_BYTES`); the same dict, byte for byte once written
    as JSON."""
    if workers is None:
        workers = default_workers()
        try:
            if Path(path).stat().st_size < WORKERS_MIN_BYTES:
                workers = 1
        except OSError:
            workers = 1               # reading it in one process says what is wrong
    if workers > 1 and Path(path).is_file():
        got = analyze_lines_parallel(path, workers - 1, config,
                                     tune_stage=_overrides_book(overrides, config),
                                     on_read=on_read, chunk_lines=chunk_lines)
        if got is not None:
            engine, summary, counts = got
            return result_of(engine, summary, counts["events"], counts["invalid"])
    return analyze_file(path, config, overrides, on_read)
