"""The two stateful steps of the worker, without Kafka: per-rank compaction (and per-machine
GPU checks) and per-job detection, with the bookkeeping that makes their state survive a
restart.

:class:`RankProcessor` turns batches of raw telemetry records ``(partition, offset, key,
value)`` into summary items per job and dead-letter records, through one ``RankStage`` per
(job, rank) and one ``NodeStage`` per (job, machine). :class:`JobProcessor` applies summaries messages to one ``JobStage`` per job
and runs ``advance(now)``. Both keep their stages in *slots* that remember where their
input came from, so that after a restore from a snapshot, input the snapshot already
covered is skipped instead of applied twice (the consumer's committed offset never passes a
snapshot, see :mod:`trainguard.streams.ranks`). Snapshots are ``(key, partition, blob)``:
``blob`` is a pickle of ``(STATE_VERSION, slot)`` behind a 5-byte header (codec, source
partition), ``None`` is a tombstone for an evicted slot.

>>> from trainguard.detectors import RankStage
>>> raw = (b'{"v":1,"type":"step","job":"j1","ts":10.0,"node":"n1","rank":0,"step":4,'
...        b'"step_time":0.5}')
>>> ranks = RankProcessor(RankStage)
>>> out = ranks.process([(2, 100, b"j1/0", raw), (2, 101, b"j1/0", b"garbage")], now=10.0)
>>> [(p, o, i, item["step"]) for p, o, i, item in out.items["j1"]], len(out.deadletters)
([(2, 100, 0, 4)], 1)
>>> [(key, part) for key, part, blob in ranks.snapshot()]
[(b'j1/0', 2)]
>>> ranks.process([(2, 100, b"j1/0", raw)], now=11.0).replayed    # seen already
1
"""
from __future__ import annotations

import logging
import math
import pickle
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from trainguard import events as ev
from trainguard.detectors.stages import launcher_summary, on_grid

from .deadletter import deadletter_record
from .logic import (NODE_TYPES, InvalidSummaries, SourceMarks, classify, decode_summaries,
                    encode_summaries, node_key, stage_key, trusted_event)

__all__ = ["RankProcessor", "JobProcessor", "RankOutput", "dump_state", "load_state",
           "state_partition"]

log = logging.getLogger(__name__)
_RAW, _ZLIB = b"P", b"Z"
_HEADER = struct.Struct(">ci")
COMPRESS_ABOVE = 8192
DEFAULT_IDLE_TTL_S = 6 * 3600.0
#: an event stamped further ahead of the worker's clock than this moves a job's clock no more
FUTURE_SLACK_S = 5.0
#: the stages' pickled layout; a snapshot of another layout is a restore failure (the stage
#: starts afresh) rather than a stage whose detectors miss attributes. Raise it whenever a
#: stage or detector changes what it keeps.
STATE_VERSION = 4


def dump_state(obj, partition: int) -> bytes:
    """Pickle ``obj`` behind a header naming its source partition; zlib when large.

    >>> blob = dump_state({"a": 1}, 7)
    >>> state_partition(blob), load_state(blob)
    (7, {'a': 1})
    """
    data = pickle.dumps((STATE_VERSION, obj), protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > COMPRESS_ABOVE:
        return _HEADER.pack(_ZLIB, partition) + zlib.compress(data, 1)
    return _HEADER.pack(_RAW, partition) + data


def state_partition(blob: bytes) -> int:
    return _HEADER.unpack_from(blob)[1]


def load_state(blob: bytes):
    """The object of :func:`dump_state`. Snapshots come only from this worker's own
    internal topics; they are never read from user-writable topics."""
    codec, _ = _HEADER.unpack_from(blob)
    data = blob[_HEADER.size:]
    if codec == _ZLIB:
        data = zlib.decompress(data)
    elif codec != _RAW:
        raise ValueError(f"unknown snapshot codec {codec!r}")
    loaded = pickle.loads(data)
    if type(loaded) is not tuple or len(loaded) != 2 or loaded[0] != STATE_VERSION:
        raise ValueError("a snapshot of another trainguard version")
    return loaded[1]


@dataclass
class RankSlot:
    stage: Any
    partition: int        # telemetry partition of the last applied message
    offset: int           # its offset
    touched: float = 0.0  # wall time of the last message (for eviction; not restored)


@dataclass
class JobSlot:
    stage: Any
    partition: int        # summaries partition of the job
    marks: SourceMarks = field(default_factory=SourceMarks)
    touched: float = 0.0
    watermark: float = -math.inf   # newest event time seen (at most FUTURE_SLACK_S ahead)
    applied_at: float = 0.0        # wall time when items last arrived
    clock: float = -math.inf       # last time given to advance()

    def now(self, wall: float) -> float:
        """The job's clock for ``advance``: its newest event time, moved on by the wall
        time since then. Live, that is the wall clock less the pipeline's delay (and any
        skew of the senders' clocks); while a backlog is read it is the backlog's own time,
        so no hang is found in data that is merely late; when the job sends nothing at all
        it runs on with the wall clock, so a job that went quiet is still found."""
        if self.watermark == -math.inf:
            return wall
        t = self.watermark + max(0.0, wall - self.applied_at)
        if t > self.clock:
            self.clock = t
        return self.clock


@dataclass
class RankOutput:
    """What one batch of telemetry produced."""

    items: dict = field(default_factory=dict)      # job -> [(p, o, i, item), ...]
    deadletters: list = field(default_factory=list)  # (key, record bytes)
    events: int = 0
    invalid: int = 0
    ignored: int = 0
    replayed: int = 0
    errors: int = 0

    def messages(self) -> list[tuple[bytes, bytes]]:
        """Summaries messages ``(key, value)``, keyed by job."""
        out = []
        for job, items in self.items.items():
            key = job.encode()
            out += [(key, value) for value in encode_summaries(job, items)]
        return out


class _Slots:
    """Slots by key, lazily loaded from restored snapshots, with dirty tracking."""

    def __init__(self, idle_ttl_s: float):
        self.idle_ttl_s = idle_ttl_s
        self.slots: dict = {}
        self.saved: dict = {}      # key -> blob restored but not loaded yet
        self.dirty: set = set()
        self.restore_failures = 0

    def load(self, key):
        blob = self.saved.pop(key, None)
        if blob is None:
            return None
        try:
            slot = load_state(blob)
        except Exception:          # an old or damaged snapshot: start that stage afresh
            self.restore_failures += 1
            return None
        self.slots[key] = slot
        return slot

    def restore(self, key, blob) -> None:
        self.slots.pop(key, None)
        if blob is None:
            self.saved.pop(key, None)
        else:
            self.saved[key] = blob

    def snapshot(self) -> list:
        out = []
        for key in sorted(self.dirty):
            slot = self.slots.get(key)
            if slot is not None:
                out.append((key, slot.partition, dump_state(slot, slot.partition)))
        self.dirty.clear()
        return out

    def evict(self, now: float) -> list:
        """Tombstones ``(key, partition, None)`` for slots idle longer than the TTL."""
        old = [k for k, s in self.slots.items() if now - s.touched > self.idle_ttl_s]
        out = []
        for key in old:
            slot = self.slots.pop(key)
            self.dirty.discard(key)
            out.append((key, slot.partition, None))
        return out

    def drop(self, partitions: set) -> None:
        """Forget the slots of partitions this worker no longer owns."""
        for key in [k for k, s in self.slots.items() if s.partition in partitions]:
            del self.slots[key]
            self.dirty.discard(key)
        for key in [k for k, b in self.saved.items() if state_partition(b) in partitions]:
            del self.saved[key]


class _SlotsProcessor:
    """What both processors do with their slots' state: snapshot, evict, restore, drop."""

    state: _Slots

    def snapshot(self) -> list:
        return self.state.snapshot()

    def evict(self, now: float) -> list:
        return self.state.evict(now)

    def restore(self, key: bytes, blob: bytes | None) -> None:
        self.state.restore(key, blob)

    def drop(self, partitions: set) -> None:
        self.state.drop(partitions)


class RankProcessor(_SlotsProcessor):
    """One ``make_stage()`` per (job, rank) and one ``make_node_stage()`` per (job, machine)
    for the machines' ``gpu`` and ``xid`` events; ``process`` a batch of raw telemetry.
    Without ``make_node_stage`` node events go on as they are, as SPEC dicts."""

    def __init__(self, make_stage: Callable[[], Any], *,
                 make_node_stage: Callable[[], Any] | None = None,
                 telemetry_topic: str = "telemetry", idle_ttl_s: float = DEFAULT_IDLE_TTL_S):
        self.make_stage = make_stage
        self.make_node_stage = make_node_stage
        self.telemetry_topic = telemetry_topic
        self.idle_ttl_s = idle_ttl_s
        self.state = _Slots(idle_ttl_s)

    def __len__(self) -> int:
        return len(self.state.slots)

    def process(self, records: Iterable, now: float) -> RankOutput:
        """Decode and apply ``(partition, offset, key, value)`` records in the given order."""
        out = RankOutput()
        decoded = self.decode(records, out)
        self.apply([rec for recs in decoded.values() for _, rec in recs], now, out)
        return out

    def decode(self, records: Iterable, out: RankOutput) -> dict:
        """``{partition: [(ts, record), ...]}`` with ``record = (partition, offset, key,
        value, event, reason)``: ``event`` None and ``reason`` set for an invalid one."""
        decoded: dict = {}
        for partition, offset, key, value in records:
            out.events += 1
            event, reason = classify(value)
            bucket = decoded.get(partition)
            if bucket is None:
                bucket = decoded[partition] = []
            bucket.append((event.ts if event is not None else None,
                           (partition, offset, key, value, event, reason)))
        return decoded

    def apply(self, records: Iterable, now: float, out: RankOutput) -> None:
        """Run decoded records through the rank stages, into ``out``."""
        items = out.items
        slots = self.state.slots
        dirty = self.state.dirty
        for partition, offset, key, value, event, reason in records:
            if event is None:
                out.invalid += 1
                out.deadletters.append((key, deadletter_record(
                    reason=reason, topic=self.telemetry_topic, partition=partition,
                    offset=offset, key=key, raw=value, ts=now)))
                continue
            if event.TYPE in NODE_TYPES:
                if self.make_node_stage is None:
                    items.setdefault(event.job, []).append(
                        (partition, offset, 0, ev.to_dict(event)))
                    continue
                skey, make = node_key(event.job, event.node), self.make_node_stage
            elif event.rank is None:
                if event.TYPE == "lifecycle":    # the launcher's: straight to the job side
                    items.setdefault(event.job, []).append(
                        (partition, offset, 0, launcher_summary(event)))
                else:
                    out.ignored += 1
                continue
            else:
                skey, make = stage_key(event.job, event.rank), self.make_stage
            slot = slots.get(skey) or self.state.load(skey)
            if slot is None:
                slot = slots[skey] = RankSlot(make(), partition, -1)
            elif slot.partition == partition and offset <= slot.offset:
                out.replayed += 1
                continue
            slot.partition, slot.offset, slot.touched = partition, offset, now
            dirty.add(skey)
            try:
                summaries = slot.stage.update(event)
            except Exception:            # a stage bug must not stop the stream
                out.errors += 1
                log.exception("rank stage %s failed on offset %d/%d", skey, partition, offset)
                continue
            if summaries:
                bucket = items.setdefault(event.job, [])
                for index, summary in enumerate(summaries):
                    bucket.append((partition, offset, index, summary))


class JobProcessor(_SlotsProcessor):
    """One ``make_stage()`` per job; ``apply`` summaries messages, ``advance`` the clock
    (each job on its own clock, :meth:`JobSlot.now`).

    ``apply`` also advances a job in event time, as ``trainguard analyze`` does, whenever
    its items move its clock past a point of the grid of ``advance_every_s`` (None: never;
    the timer's ``advance`` uses the same grid, ``detectors.stages.on_grid``): a backlog or
    a fast replay brings many seconds of event time between two ticks of the wall-clock
    timer, and a hang that such a stretch holds (steps stop, heartbeats go on, then the ranks exit)
    would otherwise never be looked for while it lasted.
    """

    def __init__(self, make_stage: Callable[[], Any], *,
                 idle_ttl_s: float = DEFAULT_IDLE_TTL_S, observe_lag=None,
                 advance_every_s: float | None = 0.5):
        self.make_stage = make_stage
        self.idle_ttl_s = idle_ttl_s
        self.observe_lag = observe_lag
        self.advance_every_s = advance_every_s
        self.state = _Slots(idle_ttl_s)
        self.applied = 0
        self.replayed = 0
        self.errors = 0

    def __len__(self) -> int:
        return len(self.state.slots)

    def _slot(self, job: str, partition: int) -> JobSlot:
        key = job.encode()
        slot = self.state.slots.get(key) or self.state.load(key)
        if slot is None:
            slot = self.state.slots[key] = JobSlot(self.make_stage(), partition)
            if getattr(slot.stage, "job", "") is None:
                slot.stage.job = job
        slot.partition = partition
        return slot

    def apply(self, value, partition: int, now: float) -> list[ev.Anomaly]:
        """Apply one summaries message; raises :class:`InvalidSummaries` for a bad one."""
        job, items = decode_summaries(value)
        slot = self._slot(job, partition)
        slot.touched = now
        self.state.dirty.add(job.encode())
        stage, marks, observe = slot.stage, slot.marks, self.observe_lag
        watermark, limit = slot.watermark, now + FUTURE_SLACK_S
        every = self.advance_every_s
        out = []
        for p, o, i, item in items:
            if not marks.advance(p, o, i):
                self.replayed += 1
                continue
            self.applied += 1
            ts = item.get("ts")
            if type(ts) is float or type(ts) is int:
                if ts > watermark:
                    watermark = ts if ts < limit else limit
                if observe is not None:
                    observe(now - ts)
            if "type" in item and "k" not in item:     # a machine's gpu / xid event
                item = trusted_event(item)
            try:
                out += stage.update(item)
            except Exception:            # a detector bug must not stop the stream
                self.errors += 1
                log.exception("job stage %s failed on an item from %d/%d", job, p, o)
            if every is not None and watermark > slot.clock and \
                    on_grid(watermark, every) > slot.clock:
                slot.clock = on_grid(watermark, every)     # analyze's event-time grid
                try:
                    out += stage.advance(slot.clock)
                except Exception:
                    self.errors += 1
                    log.exception("job stage %s failed in advance()", job)
        slot.watermark, slot.applied_at = watermark, now
        return out

    def advance(self, now: float) -> list[ev.Anomaly]:
        out = []
        for key, slot in self.state.slots.items():
            try:
                every = self.advance_every_s
                at = slot.now(now)
                found = slot.stage.advance(on_grid(at, every) if every else at)
            except Exception:
                self.errors += 1
                log.exception("job stage %s failed in advance()", key.decode())
                continue
            if found:
                self.state.dirty.add(key)
                out += found
        return out

    def load_saved(self, partitions: set) -> int:
        """Load every restored job of ``partitions`` now (so that ``advance`` sees jobs
        that send nothing any more); returns how many."""
        keys = [k for k, b in self.state.saved.items() if state_partition(b) in partitions]
        return sum(1 for k in keys if self.state.load(k) is not None)


__all__ += ["InvalidSummaries"]
