"""The worker's state snapshots: their bytes, and the slots that hold stages in memory.

A snapshot blob is a 16-byte header ``b"tg"``, format, codec (0 JSON, 1 zlib JSON, 2 zlib
JSON with a preset dictionary: the JSON of fresh stages, which makes the snapshot of a
short-lived job about 250 bytes instead of 1,400), the source partition (int32) and the
wall time of the slot's last input (float64), then the JSON of :mod:`.statecodec`:
``["t", STATE_VERSION, layout, slot]``. ``layout`` is a digest
of the classes and attribute names of fresh stages, so that a snapshot written by a worker
whose detectors kept other attributes is refused (the stage starts afresh) instead of
being loaded with attributes missing. Nothing in a blob is ever unpickled.

>>> blob = dump_state({"a": [1.5, float("inf")]}, 7, touched=100.0)
>>> state_header(blob), load_state(blob)
((7, 100.0), {'a': [1.5, inf]})
>>> load_state(b"\\x80\\x04K\\x01.")
Traceback (most recent call last):
...
trainguard.streams.statecodec.StateError: not a trainguard snapshot (a 5-byte message)
"""
from __future__ import annotations

import hashlib
import logging
import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator

from . import statecodec
from .logic import SourceMarks
from .statecodec import Allowlist, StateError

__all__ = ["dump_state", "load_state", "state_header", "state_partition", "Slots", "RankSlot",
           "JobSlot", "state_allowlist", "STATE_VERSION", "StateError", "snapshot_pause"]

log = logging.getLogger(__name__)
_MAGIC = b"tg"
FORMAT = 2                 # 1 was the pickle of trainguard 0.x (refused)
_HEADER = struct.Struct(">2sBBid")
_JSON, _ZLIB, _ZDICT = 0, 1, 2
COMPRESS_ABOVE = 128
#: a snapshot that decompresses to more than this is refused (a zlib bomb); a job of
#: 100,000 ranks decompresses to about 60 MB (4 MB compressed)
MAX_STATE_BYTES = 256 * 1024 * 1024
#: the stages' layout; raise it when what a stage keeps changes meaning without changing
#: its attribute names (a new attribute changes the layout digest by itself)
STATE_VERSION = 25


# -- the slots: a stage and where its input came from (what a snapshot holds) --------------

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
    watermark: float = -math.inf   # newest event time seen (a bounded step ahead)
    applied_at: float = 0.0        # wall time when items last arrived
    clock: float = -math.inf       # last time given to advance()
    sources: dict = field(default_factory=dict)   # telemetry partition -> [newest ts, wall]
    low_source: int = -1           # the partition of the lowest newest ts (see heard())
    low: float = -math.inf         # the newest time every partition heard from has reached
    held: list = field(default_factory=list)   # heap of [time, seq, item, wall] not applied
    held_seq: int = 0
    released: dict = field(default_factory=dict)  # rank -> arrival of its last heartbeat or
                                                  # start let go

    def heard_again(self, wall: float) -> None:
        """Loaded from a snapshot at wall time ``wall``: every partition it had heard from
        counts as heard as long before ``wall`` as it had been before the snapshot's last
        input (the wall times of the process that wrote it are read only against each
        other), so one that lagged still holds steps open until ``idle_s`` passes, and one
        silent for hours does not pass for one that nobody reads since this load.

        >>> slot = JobSlot(stage=None, partition=0, touched=5000.0,
        ...                sources={0: [100.0, 4999.0], 1: [90.0, 1400.0]})
        >>> slot.heard_again(20.0)
        >>> slot.sources
        {0: [100.0, 19.0], 1: [90.0, -3580.0]}
        """
        touched = self.touched
        for source in self.sources.values():
            quiet = touched - source[1]
            source[1] = wall - quiet if quiet > 0.0 else wall

    def clocks(self, wall: float, unread_since=None) -> tuple[float, float]:
        """``(now, steps_now)``: :meth:`now`, and the job's clock for closing steps by their
        age, that held back to the partition read furthest behind (:meth:`heard`)."""
        run = self._run_on(wall, unread_since)
        now = self._now(wall, run)
        return now, (now if self.low == -math.inf else min(now, self.low + run))

    def heard(self, partition: int, ts: float, wall: float, idle_s: float,
              unread_since=None) -> float:
        """The job's low watermark once ``ts`` came from telemetry ``partition`` at wall time
        ``wall``: the lowest newest event time over the partitions heard from within
        ``idle_s`` (the minimum over inputs, as Kafka Streams and Flink take it). It closes
        steps by their age (:meth:`clocks`): one partition read ahead of the others (a
        backlog, a rank worker that lags, a collector sending a burst) does not close a step
        before the records on their way; a partition silent that long (its machines gone)
        no longer holds it back. The detectors that judge an absence (a silent rank, a hang's
        lack of progress) judge up to it (``JobView.judged``): a partition whose ranks are
        hung forwards a heartbeat only every few seconds, which holds a hang's detection
        back by as much (0.5 to 1 s on the library's faults), where a machine stamped
        behind its peers, or one whose peers' records were let go early, looked stalled.

        ``unread_since(partition, heard, wall)``: whether no rank worker said, since wall
        time ``heard`` (when the partition last sent) and lately at ``wall``, that it read
        it to the end, within a bound of silence (``JobProcessor.unread_s``). Such a
        partition is not known to be quiet: its worker may be gone (killed, stalled, its
        partitions moving to another in a rebalance). It holds the watermark back while
        silent, so its machines do not look silent while nobody reads them.

        >>> slot = JobSlot(stage=None, partition=0)
        >>> slot.heard(0, 100.0, wall=1.0, idle_s=10.0)
        100.0
        >>> slot.heard(1, 80.0, wall=1.0, idle_s=10.0)
        80.0
        >>> slot.heard(0, 130.0, wall=2.0, idle_s=10.0)     # partition 1 is behind
        80.0
        >>> slot.heard(0, 140.0, wall=12.0, idle_s=10.0)    # ... and silent for 11 s
        140.0
        >>> unread = lambda p, heard, wall: p == 1 and wall - heard <= 30.0   # nobody read 1
        >>> slot.heard(1, 80.0, wall=12.0, idle_s=10.0)
        80.0
        >>> slot.heard(0, 150.0, wall=24.0, idle_s=10.0, unread_since=unread)
        80.0
        >>> slot.heard(0, 160.0, wall=43.0, idle_s=10.0, unread_since=unread)
        160.0
        """
        sources = self.sources
        source = sources.get(partition)
        fresh = source is None or wall - source[1] > idle_s
        if source is None:
            source = sources[partition] = [ts, wall]
        else:
            if ts > source[0]:
                source[0] = ts
            source[1] = wall
        low = sources.get(self.low_source)
        if fresh or low is None or partition == self.low_source or (
                wall - low[1] > idle_s and not (unread_since is not None and
                                                unread_since(self.low_source, low[1], wall))):
            best, self.low_source = self._lowest(wall, idle_s, unread_since=unread_since)
            return best
        return low[0]

    def lowest(self, wall: float, idle_s: float, behind: dict | None = None,
               behind_s: float = 0.0, unread_since=None) -> float:
        """:meth:`heard`'s low watermark at wall time ``wall`` without a new record: the
        partitions silent for ``idle_s`` no longer count (-inf when none is left), unless
        ``behind`` (partition -> wall time its reader said it is behind) has them within
        ``behind_s`` and they were heard from within ``behind_s``, or (``unread_since``, as
        for :meth:`heard`) no worker read them since.

        >>> slot = JobSlot(stage=None, partition=0)
        >>> slot.heard(0, 100.0, wall=1.0, idle_s=2.0), slot.heard(1, 130.0, wall=4.0, idle_s=2.0)
        (100.0, 130.0)
        >>> slot.lowest(4.0, 2.0), slot.lowest(4.0, 2.0, {0: 1.0}, 10.0)
        (130.0, 100.0)
        """
        best = self._lowest(wall, idle_s, behind, behind_s, unread_since)[0]
        return best if best is not None else -math.inf

    def _lowest(self, wall: float, idle_s: float, behind: dict | None = None,
                behind_s: float = 0.0, unread_since=None) -> tuple:
        """``(newest, partition)`` of the partition heard from within ``idle_s`` (see
        :meth:`lowest` for ``behind`` and ``unread_since``) that was read the least far,
        ``(None, -1)`` when there is none."""
        best, low = None, -1
        for p, (newest, heard) in self.sources.items():
            quiet = wall - heard
            if (quiet <= idle_s or (behind and quiet <= behind_s and p in behind
                                    and wall - behind[p] <= behind_s)
                    or (unread_since is not None and unread_since(p, heard, wall))) \
                    and (best is None or newest < best):
                best, low = newest, p
        return best, low

    def unread(self, wall: float, idle_s: float, unread_since) -> Iterator[int]:
        """The partitions silent for more than ``idle_s`` that still hold the watermark back
        because nobody read them since (see :meth:`heard`), as they are found."""
        return (p for p, (_, heard) in self.sources.items()
                if wall - heard > idle_s and unread_since(p, heard, wall))

    def _run_on(self, wall: float, unread_since) -> float:
        """Wall seconds since items last came, by which the job's clock moves on: none while
        a partition it was heard from went unread since (``unread_since``)."""
        run = wall - self.applied_at
        if run <= 0.0:
            return 0.0
        if unread_since is not None and any(unread_since(p, heard, wall)
                                            for p, (_, heard) in self.sources.items()):
            return 0.0
        return run

    def now(self, wall: float, unread_since=None) -> float:
        """The job's clock for ``advance``: its newest event time, moved on by the wall
        time since then. Live, that is the wall clock less the pipeline's delay (and any
        skew of the senders' clocks); while a backlog is read it is the backlog's own time,
        so no hang is found in data that is merely late; when the job sends nothing at all
        it runs on with the wall clock, so a job that went quiet is still found, but never
        past the first item held for a partition read behind (:meth:`JobProcessor.apply`):
        that job is not quiet, its worker is. Nor while a partition it was heard from is
        not known to be read (``unread_since``, see :meth:`heard`): its worker may be gone,
        the job not quiet at all.

        >>> slot = JobSlot(stage=None, partition=0)
        >>> _ = slot.heard(3, 100.0, wall=50.0, idle_s=10.0)
        >>> slot.watermark, slot.applied_at = 100.0, 50.0
        >>> slot.now(70.0, unread_since=lambda p, heard, wall: True), slot.now(70.0)
        (100.0, 120.0)
        """
        return self._now(wall, self._run_on(wall, unread_since))

    def _now(self, wall: float, run: float) -> float:
        """:meth:`now`, the job's clock having run on ``run`` seconds since items came."""
        if self.watermark == -math.inf:       # nothing applied yet
            first = self.held[0][0] if self.held else wall
            return first if -math.inf < first < wall else wall
        t = self.watermark + run
        if self.held and self.held[0][0] < t:
            t = self.held[0][0]       # not past an item that waits for a partition behind
        if t > self.clock:
            self.clock = t
        return self.clock


_ALLOWLIST = None


def state_allowlist() -> Allowlist:
    """The classes a worker's snapshot may hold: those of every module of
    ``trainguard.detectors`` and of the registered detectors (plug-ins included), with their
    ``Config`` classes (a new detector is allowed without a list to keep), the slots,
    the event classes, the summaries' bookkeeping (:mod:`.logic`) and ``river.stats``."""
    global _ALLOWLIST
    if _ALLOWLIST is None:
        import importlib
        import inspect
        import pkgutil
        import sys

        import river.stats

        import trainguard.detectors as detectors
        from trainguard import events
        from trainguard.detectors.registry import registrations

        from . import logic

        modules = [importlib.import_module(f"{detectors.__name__}.{info.name}")
                   for info in pkgutil.iter_modules(detectors.__path__)]
        # the registered detectors' (plug-ins' too): their modules' classes and their Configs
        registered = registrations()
        modules += [sys.modules[r.cls.__module__] for r in registered]
        river_stats = [obj for obj in vars(river.stats).values() if inspect.isclass(obj)]
        _ALLOWLIST = Allowlist.of_modules(
            [*dict.fromkeys(modules), events, logic],
            classes=[RankSlot, JobSlot, *river_stats, *(r.config for r in registered)])
    return _ALLOWLIST


def _stage_layout() -> str:
    from trainguard.detectors import JobStage, NodeStage, RankStage

    names: set = set()

    def walk(node):
        if type(node) is list:
            if node and node[0] == "o":
                names.add((node[1], tuple(sorted(node[2::2]))))
            for child in node[1:]:
                walk(child)
        elif type(node) is dict:
            for child in node.values():
                walk(child)

    import orjson

    for stage in (RankStage(), NodeStage(), JobStage()):
        walk(orjson.loads(statecodec.encode(stage, state_allowlist())))
    return hashlib.sha1(repr(sorted(names)).encode()).hexdigest()[:16]


_LAYOUT = None
_ZDICT_BYTES = None
#: compressors primed with the preset dictionary, copied for each blob: for small blobs
#: (a rank stage's) one with an 8 KiB window and little memory, whose copy costs a third;
#: any zlib reader reads both
_DEFLATE: dict = {}
SMALL_BLOB = 4096


def layout() -> str:
    global _LAYOUT
    if _LAYOUT is None:
        _LAYOUT = _stage_layout()
    return _LAYOUT


def _zdict() -> bytes:
    """The preset dictionary: snapshots of fresh default stages (deterministic for one
    version of the code; another version's snapshots are refused anyway)."""
    global _ZDICT_BYTES
    if _ZDICT_BYTES is None:
        from trainguard.detectors import DetectorConfig, JobStage, NodeStage, RankStage

        config = DetectorConfig()
        shared = {"detector_config": config}
        parts = [statecodec.encode(("tg-state", STATE_VERSION, layout(), slot),
                                   state_allowlist(), shared)
                 for slot in (RankSlot(NodeStage(config), 0, 0), RankSlot(RankStage(config), 0, 0),
                              JobSlot(JobStage(config), 0))]
        _ZDICT_BYTES = b"".join(parts)[-32768:]
    return _ZDICT_BYTES


def dump_state(obj, partition: int, touched: float = 0.0, shared: dict | None = None,
               allowlist: Allowlist | None = None) -> bytes:
    """``obj`` behind a header naming its source partition and last input time; its objects
    of the classes of ``allowlist`` (default :func:`state_allowlist`) only."""
    data = statecodec.encode(("tg-state", STATE_VERSION, layout(), obj),
                             allowlist or state_allowlist(), shared)
    if len(data) > COMPRESS_ABOVE:
        small = len(data) <= SMALL_BLOB
        primed = _DEFLATE.get(small)
        if primed is None:
            primed = _DEFLATE[small] = (zlib.compressobj(1, zlib.DEFLATED, 13, 4, zdict=_zdict())
                                        if small else zlib.compressobj(1, zdict=_zdict()))
        deflate = primed.copy()
        return (_HEADER.pack(_MAGIC, FORMAT, _ZDICT, partition, touched)
                + deflate.compress(data) + deflate.flush())
    return _HEADER.pack(_MAGIC, FORMAT, _JSON, partition, touched) + data


def state_header(blob) -> tuple[int, float]:
    """``(partition, touched)``; raises :class:`StateError` for what is not a snapshot."""
    if not isinstance(blob, (bytes, bytearray)) or len(blob) < _HEADER.size:
        raise StateError(f"not a trainguard snapshot (a {len(blob or b'')}-byte message)")
    magic, fmt, codec, partition, touched = _HEADER.unpack_from(blob)
    if magic != _MAGIC or fmt != FORMAT or codec not in (_JSON, _ZLIB, _ZDICT):
        raise StateError("not a trainguard snapshot of this format")
    return partition, touched


def state_partition(blob) -> int:
    return state_header(blob)[0]


def load_state(blob, shared: dict | None = None, allowlist: Allowlist | None = None):
    """The object of :func:`dump_state`; raises :class:`StateError`."""
    state_header(blob)
    data = bytes(blob[_HEADER.size:])
    if blob[3] != _JSON:
        inflate = zlib.decompressobj(zdict=_zdict()) if blob[3] == _ZDICT else zlib.decompressobj()
        try:
            data = inflate.decompress(data, MAX_STATE_BYTES)
        except zlib.error as exc:
            raise StateError(f"corrupt snapshot: {exc}") from None
        if inflate.unconsumed_tail:
            raise StateError(f"snapshot larger than {MAX_STATE_BYTES} bytes")
    loaded = statecodec.decode(data, allowlist or state_allowlist(), shared)
    if type(loaded) is not tuple or len(loaded) != 4 or loaded[0] != "tg-state":
        raise StateError("not a trainguard snapshot")
    if loaded[1] != STATE_VERSION or loaded[2] != layout():
        raise StateError("a snapshot of another trainguard version")
    return loaded[3]


def snapshot_pause(cost_s: float, every_s: float, *, cpu_share: float, most_s: float) -> float:
    """Seconds from one snapshot to the next: ``every_s``, or longer when the last one cost
    more than ``cpu_share`` of that in CPU seconds (``cost_s``), so that snapshots take at
    most that share of a core; never more than ``most_s``, the longest a crashed worker's
    successor re-reads (nor less than ``every_s``).

    >>> snapshot_pause(0.01, 2.0, cpu_share=0.05, most_s=10.0)
    2.0
    >>> snapshot_pause(0.25, 2.0, cpu_share=0.05, most_s=10.0)
    5.0
    >>> snapshot_pause(2.0, 2.0, cpu_share=0.05, most_s=10.0)
    10.0
    """
    return max(every_s, min(cost_s / cpu_share, most_s))


class Slots:
    """Slots by key (each with ``partition`` and ``touched``), most recently used last;
    snapshots of the changed ones; idle ones evicted to blobs; blobs kept until restored,
    or dropped with a tombstone after ``idle_ttl_s``.

    - ``max_live``: at most this many slots in memory; a new one evicts the least recently
      used (its blob is written with the next snapshot and kept for when it speaks again).
    - ``evict_idle_s``: slots without input this long are evicted by :meth:`evict`.
    - ``kinds``: the classes a loaded slot may be (anything else is a restore failure).
    - ``reuse_blobs``: keep each live slot's last snapshot until it changes, so that
      evicting it does not encode it again (for job stages, which are large to encode).
    """

    def __init__(self, *, idle_ttl_s: float, evict_idle_s: float | None = None,
                 max_live: int | None = None, kinds: tuple = (object,),
                 shared: dict | None = None, reuse_blobs: bool = False):
        self.idle_ttl_s = idle_ttl_s
        self.evict_idle_s = evict_idle_s
        self.max_live = max_live
        self.kinds = kinds
        self.shared = shared
        self.slots: dict = {}
        self.saved: dict = {}      # key -> blob restored or evicted, not loaded (oldest first)
        self.dirty: set = set()
        self.pending: dict = {}    # key -> (partition, blob) evicted, not written yet
        self.clean: dict | None = {} if reuse_blobs else None   # key -> blob, unchanged since
        self.restore_failures = 0
        self.evictions = 0

    def blob(self, slot) -> bytes:
        return dump_state(slot, slot.partition, slot.touched, self.shared)

    def load(self, key):
        blob = self.saved.pop(key, None)
        if blob is None:
            return None
        self.pending.pop(key, None)
        try:
            slot = load_state(blob, self.shared)
            if not isinstance(slot, self.kinds):
                raise StateError(f"a snapshot of a {type(slot).__name__}")
        except Exception as exc:   # a damaged, foreign or hostile snapshot: start afresh
            self.failed(key, exc)
            return None
        slot.touched = state_header(blob)[1]
        self.put(key, slot)
        return slot

    def failed(self, key, exc) -> None:
        self.restore_failures += 1
        if self.restore_failures <= 20 or self.restore_failures % 1000 == 0:
            log.warning("snapshot of %r discarded, that stage starts afresh (%d so far): %s",
                        repr(key)[:80], self.restore_failures, str(exc)[:200])

    def put(self, key, slot) -> None:
        """A new or loaded slot, evicting the least recently used beyond ``max_live``."""
        self.slots[key] = slot
        if self.max_live is not None and len(self.slots) > self.max_live:
            old = next(iter(self.slots))
            self._evict(old)

    def _evict(self, key) -> None:
        slot = self.slots.pop(key)
        blob = self.clean.pop(key, None) if self.clean is not None else None
        if blob is None or key in self.dirty:
            self.dirty.discard(key)
            try:
                blob = self.blob(slot)
            except Exception as exc:       # a state the codec cannot write: lose it, loudly
                log.error("state of %r cannot be snapshotted, dropped: %s", key, exc)
                return
            self.pending[key] = (slot.partition, blob)
        self.saved[key] = blob
        self.evictions += 1

    def restore(self, key, blob) -> None:
        self.slots.pop(key, None)
        if self.clean is not None:
            self.clean.pop(key, None)
        self.saved.pop(key, None)
        if blob is not None:
            self.saved[key] = blob

    def snapshot(self) -> list:
        """``(key, partition, blob)`` of the slots changed and evicted since the last."""
        out = [(key, part, blob) for key, (part, blob) in self.pending.items()]
        self.pending.clear()
        for key in sorted(self.dirty):
            slot = self.slots.get(key)
            if slot is None:
                continue
            try:
                blob = self.blob(slot)
            except Exception as exc:
                log.error("state of %r cannot be snapshotted: %s", key, exc)
                continue
            out.append((key, slot.partition, blob))
            if self.clean is not None:
                self.clean[key] = blob
        self.dirty.clear()
        return out

    def touch(self, key, slot) -> None:
        """``slot`` got input: it becomes the most recently used."""
        del self.slots[key]
        self.slots[key] = slot

    def evict(self, now: float) -> list:
        """Evict the slots idle ``evict_idle_s`` (their blobs go out with the next
        :meth:`snapshot`); return tombstones ``(key, partition, None)`` for the slots and
        saved blobs idle ``idle_ttl_s``. Both scans stop at the first younger entry (the
        dicts run from least to most recently used)."""
        out = []
        ttl_limit = now - self.idle_ttl_s
        idle_limit = now - (self.evict_idle_s if self.evict_idle_s is not None
                            else self.idle_ttl_s)
        for key, slot in list(self.slots.items()):
            if slot.touched >= idle_limit and slot.touched >= ttl_limit:
                break
            if slot.touched < ttl_limit:
                del self.slots[key]
                self.dirty.discard(key)
                if self.clean is not None:
                    self.clean.pop(key, None)
                out.append((key, slot.partition, None))
            else:
                self._evict(key)
        for key, blob in list(self.saved.items()):
            try:
                partition, touched = state_header(blob)
            except StateError as exc:
                del self.saved[key]
                self.failed(key, exc)
                continue
            if touched >= ttl_limit:
                break
            del self.saved[key]
            self.pending.pop(key, None)
            out.append((key, partition, None))
        return out

    def drop(self, partitions: set) -> None:
        """Forget the slots of partitions this worker no longer owns."""
        for key in [k for k, s in self.slots.items() if s.partition in partitions]:
            del self.slots[key]
            self.dirty.discard(key)
            if self.clean is not None:
                self.clean.pop(key, None)
        for key, blob in list(self.saved.items()):
            try:
                mine = state_partition(blob) in partitions
            except StateError:
                mine = True
            if mine:
                del self.saved[key]
                self.pending.pop(key, None)
