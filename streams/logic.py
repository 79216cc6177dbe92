"""Pure pieces of the stream worker: sorting raw telemetry, stage keys, and the wire format
of the internal summaries topic. No Kafka, no clock; the worker's agents call these.

The summaries topic (``<prefix>.summaries``, keyed by job) carries, per job and per batch
of telemetry, one JSON object ``{"v": 1, "job": J, "items": [[p, o, i, item], ...]}``:
``item`` is a RankStage summary dict or the SPEC dict of a ``gpu`` / ``xid`` event, and
``(p, o, i)`` says where it came from: telemetry partition ``p``, offset ``o``, ``i``-th
output of that message. The job side applies an item only if ``(o, i)`` is past the
highest mark it has applied for ``p`` (:class:`SourceMarks`), so items that a restarted
rank side sends again are applied once. An optional ``"reading": {"parts": [...],
"behind": [...], "of": N}`` says which telemetry partitions the sender reads, which of
them still had records to read when it sent, and how many the topic has (:class:`Reading`):
the job side keeps waiting for a partition that is behind even while it sends nothing
(see ``JobProcessor.apply``). A message whose reading is malformed is refused whole, as
one with a malformed item is.

>>> event, reason = classify(b'{"v":1,"type":"xid","job":"j1","ts":5,"node":"n1",'
...                          b'"xid":79,"source":"kmsg","message":"fell off the bus"}')
>>> event.type, reason
('xid', None)
>>> classify(b'{"v":1,"type":"step"}')[1]
"missing required field 'job'"
>>> parts = encode_summaries("j1", [(3, 17, 0, {"k": "step", "loss": "NaN"})])
>>> decode_summaries(parts[0])
('j1', [[3, 17, 0, {'k': 'step', 'loss': 'NaN'}]])
>>> read = encode_summaries("j1", [], reading=Reading(parts=(3, 4), behind=(4,), of=24))
>>> parse_summaries(read[0])
('j1', [], Reading(parts=(3, 4), behind=(4,), of=24))
>>> trusted_event(ev.to_dict(event)) == event
True
>>> marks = SourceMarks()
>>> [marks.advance(3, 17, 0), marks.advance(3, 17, 0), marks.advance(3, 17, 1)]
[True, False, True]
"""
from __future__ import annotations

import heapq
from collections import deque
from typing import NamedTuple

import orjson

from trainguard import events as ev

__all__ = ["RANK_TYPES", "NODE_TYPES", "TELEMETRY_TYPES", "classify", "stage_key", "node_key",
           "key_job", "encode_summaries", "decode_summaries", "parse_summaries", "Reading",
           "rank_partitions", "rank_partition", "job_partition", "InvalidSummaries",
           "SourceMarks", "EventTimeAligner",
           "trusted_event"]

RANK_TYPES = frozenset(("step", "heartbeat", "lifecycle"))
NODE_TYPES = frozenset(("gpu", "xid"))
TELEMETRY_TYPES = RANK_TYPES | NODE_TYPES
SUMMARIES_VERSION = 1
#: a summaries message holds at most this many items and about this many bytes, so that
#: one large batch of one job never meets Kafka's message size limit (1 MiB by default)
MAX_ITEMS = 2000
MAX_BYTES = 512 * 1024
#: releases without progress (besides max_hold_s of wall time) that make a stall; time
#: spent processing large batches alone is no stall
STALL_ROUNDS = 3


def classify(value) -> tuple[ev.Event | None, str | None]:
    """``(event, None)`` for a valid telemetry event, ``(None, reason)`` for anything else:
    what :func:`ev.decode` rejects, an empty message, or a valid event of a type that does
    not belong on the telemetry topic (a command or an anomaly written there by mistake)."""
    if value is None:
        return None, "empty message: no value"
    try:
        event = ev.decode(value)
    except ev.InvalidEvent as exc:
        return None, str(exc)
    if event.TYPE not in TELEMETRY_TYPES:
        return None, f"type: {event.TYPE!r} events do not belong on the telemetry topic"
    return event, None


def stage_key(job: str, rank: int) -> bytes:
    """Key of a rank's state: the same text as the telemetry key producers use.

    >>> stage_key("llama", 12)
    b'llama/12'
    """
    return f"{job}/{rank}".encode()


def node_key(job: str, node: str | None) -> bytes:
    """Key of a machine's state (a NodeStage): never the key of a rank's, which has no NUL.

    >>> node_key("llama", "n7")
    b'llama\\x00n7'
    """
    return f"{job}\x00{node or ''}".encode()


def key_job(key: bytes) -> str:
    """The job of a :func:`stage_key` or :func:`node_key` (a job id holds neither ``/`` nor
    NUL).

    >>> key_job(stage_key("llama", 12)), key_job(node_key("llama", "n7"))
    ('llama', 'llama')
    """
    job = key.split(b"\x00", 1)[0] if b"\x00" in key else key.rpartition(b"/")[0]
    return job.decode("utf-8", "replace")


class InvalidSummaries(ValueError):
    """A summaries message that this worker cannot read (another version, or garbage)."""


#: a reading report lists at most this many partitions (a topic has far fewer)
MAX_READING_PARTS = 10_000


class Reading(NamedTuple):
    """What a rank worker reads: its telemetry partitions (``parts``), those of them whose
    records it had not all read yet when it sent (``behind``: a backlog, or records fetched
    and held for their turn), and how many partitions the topic has (``of``, 0: unknown)."""

    parts: tuple
    behind: tuple
    of: int = 0


def encode_summaries(job: str, items: list, max_items: int = MAX_ITEMS,
                     max_bytes: int = MAX_BYTES, reading: Reading | None = None) -> list[bytes]:
    """One job's items ``(p, o, i, item)`` as one or more summaries messages, in order
    (one message without items when there are none but a ``reading`` to tell).

    Items are plain JSON with non-finite numbers as the SPEC strings, as RankStage's
    summaries and validated events are (orjson would write a float NaN as ``null``).
    """
    head = {"v": SUMMARIES_VERSION, "job": job}
    if reading is not None:
        head["reading"] = {"parts": list(reading.parts), "behind": list(reading.behind),
                           "of": reading.of}
    out = []
    for start in range(0, len(items) or (reading is not None), max_items):
        _encode_chunk(head, items[start:start + max_items], max_bytes, out)
    return out


def _encode_chunk(head: dict, chunk: list, max_bytes: int, out: list) -> None:
    value = orjson.dumps({**head, "items": chunk})
    if len(value) <= max_bytes or len(chunk) <= 1:
        out.append(value)
        return
    half = len(chunk) // 2
    _encode_chunk(head, chunk[:half], max_bytes, out)
    _encode_chunk(head, chunk[half:], max_bytes, out)


#: a job with this many ranks per partition has ranks on every partition (the chance that
#: one has none is below partitions x e^-50); so is one of more than ``_HASHED_MOST`` ranks
#: taken to have (the hashing is bounded, whatever world size a lifecycle event claims)
_EVERY_PARTITION = 50
_HASHED_MOST = 4096


def rank_partitions(job: str, world: int, partitions: int) -> frozenset:
    """The telemetry partitions that carry ranks ``0 .. world - 1`` of ``job``, keyed
    ``job/rank`` by the collectors and placed by the Java client's murmur2 partitioner.

    >>> sorted(rank_partitions("j", 4, 24)), len(rank_partitions("big", 100_000, 24))
    ([8, 14, 20, 21], 24)
    """
    if world >= _EVERY_PARTITION * partitions or world > _HASHED_MOST:
        return frozenset(range(partitions))
    return frozenset(rank_partition(job, r, partitions) for r in range(world))


def rank_partition(job: str, rank: int, partitions: int) -> int:
    """The telemetry partition of rank ``rank`` of ``job`` (see :func:`rank_partitions`).

    >>> [rank_partition("j", r, 24) for r in range(4)]
    [14, 20, 8, 21]
    """
    return _key_partition(f"{job}/{rank}".encode(), partitions)


def job_partition(job: str, partitions: int) -> int:
    """The telemetry partition of the events keyed by ``job`` alone (the launcher's).

    >>> job_partition("j", 24)
    14
    """
    return _key_partition(job.encode(), partitions)


def _key_partition(key: bytes, partitions: int) -> int:
    """The partition of a producer key under the Java client's murmur2 partitioner."""
    from trainguard.detectors.parallel import murmur2

    return (murmur2(key) & 0x7FFFFFFF) % partitions


def decode_summaries(value) -> tuple[str, list]:
    """``(job, [[p, o, i, item], ...])``; raises :class:`InvalidSummaries`."""
    return parse_summaries(value)[:2]


def parse_summaries(value) -> tuple[str, list, Reading | None]:
    """``(job, [[p, o, i, item], ...], reading or None)``; raises :class:`InvalidSummaries`."""
    try:
        obj = orjson.loads(value)
        if obj.get("v") != SUMMARIES_VERSION:
            raise InvalidSummaries(f"summaries version {obj.get('v')!r} is not "
                                   f"{SUMMARIES_VERSION}")
        job, items = obj["job"], obj["items"]
    except InvalidSummaries:
        raise
    except (orjson.JSONDecodeError, TypeError, KeyError, AttributeError) as exc:
        raise InvalidSummaries(f"unreadable summaries message: {str(exc)[:100]}") from None
    if type(job) is not str or type(items) is not list:
        raise InvalidSummaries("summaries message without a job or items")
    for it in items:
        if type(it) is not list or len(it) != 4 or type(it[3]) is not dict:
            raise InvalidSummaries("malformed summaries item")
    return job, items, _reading(obj.get("reading"))


def _reading(obj) -> Reading | None:
    if obj is None:
        return None
    parts = obj.get("parts") if type(obj) is dict else None
    behind = obj.get("behind") if type(obj) is dict else None
    of = obj.get("of", 0) if type(obj) is dict else None
    if type(parts) is not list or type(behind) is not list or \
            len(parts) > MAX_READING_PARTS or len(behind) > len(parts) or \
            not all(type(p) is int and p >= 0 for p in parts) or \
            not set(behind) <= set(parts) or type(of) is not int or \
            not 0 <= of <= MAX_READING_PARTS:
        raise InvalidSummaries("malformed reading report")
    return Reading(parts=tuple(parts), behind=tuple(behind), of=of)


def trusted_event(item: dict) -> ev.Event:
    """The event of a SPEC dict that the rank side validated already (cheaper than
    :func:`ev.from_dict`, which a GPU sample of eight devices costs ~50 µs)."""
    cls = ev.EVENT_TYPES[item["type"]]
    declared = _FIELDS[cls.TYPE]
    values = {k: v for k, v in item.items() if k in declared}
    extra = {k: v for k, v in item.items() if k not in declared and k not in ("v", "type")}
    if extra:
        values["extra"] = extra
    return cls(**values)


_FIELDS = {name: frozenset(("job", "ts", "node", "rank", *cls.REQUIRED, *cls.OPTIONAL))
           for name, cls in ev.EVENT_TYPES.items()}


class SourceMarks:
    """Per telemetry partition, the highest ``(offset, index)`` applied: exactly-once
    application of items that may arrive twice after a restart of the rank side."""

    def __init__(self):
        self.marks: dict = {}

    def advance(self, partition: int, offset: int, index: int) -> bool:
        """True (and remember it) when ``(offset, index)`` is new for ``partition``."""
        mark = self.marks.get(partition)
        if mark is not None and (offset < mark[0] or (offset == mark[0] and index <= mark[1])):
            return False
        self.marks[partition] = (offset, index)
        return True


class EventTimeAligner:
    """Merges the records of several partitions into event-time order, keeping each
    partition's own order.

    A job's ranks sit on many partitions, and a consumer catching up on a backlog gets one
    partition's records in large runs; a job stage fed that way would see rank 0 reach step
    90 before rank 1 has reported step 1. Like Kafka Streams' partition group, the aligner
    holds records back until every partition that still has unread data on the broker
    (``blocked``) has caught up to their time; a partition read to its end holds nothing
    back. If that time stops moving on for ``max_hold_s`` and a few calls (a partition that
    never comes),
    or more than ``max_buffered`` records wait, everything held is let go.

    >>> a = EventTimeAligner()
    >>> a.add(0, [(10.0, "a10"), (11.0, "a11"), (12.0, "a12")], now=0.0)
    >>> a.add(1, [(10.5, "b10")], now=0.0)
    >>> a.release(blocked={1}, now=0.0)        # partition 1 has more on the broker
    ['a10', 'b10']
    >>> a.add(1, [(11.5, "b11"), (13.0, "b13")], now=0.1)
    >>> a.release(blocked=set(), now=0.1)      # both read to the end
    ['a11', 'b11', 'a12', 'b13']
    """

    def __init__(self, max_hold_s: float = 1.0, max_buffered: int = 100_000):
        self.max_hold_s = max_hold_s
        self.max_buffered = max_buffered
        self.buffers: dict = {}     # partition -> deque of (ts, record)
        self.horizon: dict = {}     # partition -> ts of the last record released
        self.size = 0
        self._cutoff = float("-inf")  # the furthest cutoff so far
        self._current = float("inf")  # the cutoff of the last release
        self._moved = None          # wall time the cutoff last moved on
        self._rounds = 0            # releases since then
        self.stalls = 0             # how often everything was let go for want of progress

    def __len__(self) -> int:
        return self.size

    def add(self, partition, records: list, now: float) -> None:
        """``records``: ``(ts, record)`` in partition order (ts may be None: no time)."""
        if not records:
            return
        buf = self.buffers.get(partition)
        if buf is None:
            buf = self.buffers[partition] = deque()
        buf.extend(records)
        self.size += len(records)
        if self._moved is None:
            self._moved = now

    def release(self, blocked: set, now: float) -> list:
        """Records that can go now, merged by time. A stall (the cutoff not moving for
        ``max_hold_s`` and STALL_ROUNDS calls, e.g. a partition the broker does not serve)
        releases everything."""
        live = {p: b for p, b in self.buffers.items() if b}
        if not live:
            self._moved = None
            return []
        cutoff = float("inf")
        for p in blocked:
            buf = live.get(p)
            end = _last_ts(buf) if buf else self.horizon.get(p, float("-inf"))
            if end < cutoff:
                cutoff = end
        if cutoff > self._cutoff or self._moved is None:
            self._cutoff, self._moved, self._rounds = cutoff, now, 0
        else:
            self._rounds += 1
        if self.size > self.max_buffered or (now - self._moved >= self.max_hold_s
                                             and self._rounds >= STALL_ROUNDS):
            cutoff, self._moved, self._rounds = float("inf"), now, 0
            self._cutoff = float("-inf")
            self.stalls += 1
        self._current = cutoff
        runs = []
        for p, buf in live.items():
            run = []
            while buf and (buf[0][0] is None or buf[0][0] <= cutoff):
                run.append(buf.popleft())
            if run:
                runs.append(run)
                last = _last_ts(run)
                if last != float("-inf"):
                    self.horizon[p] = max(self.horizon.get(p, last), last)
        if len(runs) > 1:
            out = [rec for _, rec in heapq.merge(*runs, key=_ts_key)]
        else:
            out = [rec for _, rec in runs[0]] if runs else []
        self.size -= len(out)
        return out

    @property
    def cutoff(self) -> float:
        """Event time up to which the last :meth:`release` let records go."""
        return self._current

    def newest(self, partition):
        """Time of the newest record held for ``partition``, or None."""
        buf = self.buffers.get(partition)
        return _last_ts(buf) if buf else None

    def drop(self, partitions: set) -> None:
        for p in partitions:
            self.size -= len(self.buffers.pop(p, ()))
            self.horizon.pop(p, None)


def _ts_key(item) -> float:
    return item[0] if item[0] is not None else float("-inf")


def _last_ts(records) -> float:
    for ts, _ in reversed(records):
        if ts is not None:
            return ts
    return float("-inf")
