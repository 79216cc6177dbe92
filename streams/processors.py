"""The two stateful steps of the worker, without Kafka: per-rank compaction (and per-machine
GPU checks) and per-job detection, with the bookkeeping that makes their state survive a
restart.

:class:`RankProcessor` turns batches of raw telemetry records ``(partition, offset, key,
value)`` into summary items per job and dead-letter records, through one ``RankStage`` per
(job, rank) and one ``NodeStage`` per (job, machine). :class:`JobProcessor` applies summaries messages to one ``JobStage`` per job
and runs ``advance(now)``. Both keep their stages in *slots* that remember where their
input came from, so that after a restore from a snapshot, input the snapshot already
covered is skipped instead of applied twice (the consumer's committed offset never passes a
snapshot, see :mod:`trainguard.streams.rank_side`). Snapshots are ``(key, partition, blob)``:
``blob`` is the data-only encoding of the slot (:mod:`.snapshots`), ``None`` a tombstone
for a slot idle longer than ``idle_ttl_s``. Slots idle ``evict_idle_s``, or beyond
``max_live``, leave memory for a blob, and come back when their key has input again.

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

import heapq
import logging
import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterable

from trainguard import events as ev
from trainguard.eventtime import EventTimeFilter
from trainguard.deadletter import deadletter_record
from trainguard.detectors.stages import launcher_summary, on_grid

from .logic import (NODE_TYPES, InvalidSummaries, Reading, classify, encode_summaries,
                    node_key, parse_summaries, rank_partitions, stage_key, trusted_event)
from .snapshots import (STATE_VERSION, JobSlot, RankSlot, Slots, StateError, dump_state,
                        load_state, state_header, state_partition)

__all__ = ["RankProcessor", "JobProcessor", "RankOutput", "RankSlot", "JobSlot", "dump_state",
           "load_state", "state_partition", "STATE_VERSION"]

log = logging.getLogger(__name__)
#: the summary kinds of a rank that the job side orders by time (see JobProcessor.apply)
_RANK_KINDS = frozenset(("step", "hb", "life"))
DEFAULT_IDLE_TTL_S = 6 * 3600.0
#: an event stamped further ahead of the worker's clock than this moves a job's clock no more
FUTURE_SLACK_S = 5.0


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
    time_rejected: int = 0         # of invalid: an implausible ts or step
    reading: Reading | None = None   # what the sender reads, told with every message

    def messages(self, carrying: bool | None = None) -> list[tuple[bytes, bytes]]:
        """Summaries messages ``(key, value)``, keyed by job: those with items
        (``carrying=True``), those that only tell what the sender reads (``False``), or all."""
        out = []
        for job, items in self.items.items():
            if carrying is not None and bool(items) != carrying:
                continue
            key = job.encode()
            out += [(key, value) for value in encode_summaries(job, items,
                                                               reading=self.reading)]
        return out


class _SlotsProcessor:
    """What both processors do with their slots' state: snapshot, evict, restore, drop."""

    state: Slots

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
                 telemetry_topic: str = "telemetry", idle_ttl_s: float = DEFAULT_IDLE_TTL_S,
                 evict_idle_s: float | None = None, max_live: int | None = None,
                 shared: dict | None = None, time_filter: EventTimeFilter | None = None):
        self.make_stage = make_stage
        self.make_node_stage = make_node_stage
        self.time_filter = time_filter if time_filter is not None else EventTimeFilter()
        self.telemetry_topic = telemetry_topic
        self.idle_ttl_s = idle_ttl_s
        self.state = Slots(idle_ttl_s=idle_ttl_s, evict_idle_s=evict_idle_s,
                           max_live=max_live, kinds=(RankSlot,), shared=shared)

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
        value, event, reason)``: ``event`` None and ``reason`` set for an invalid one, or
        one that :class:`~trainguard.eventtime.EventTimeFilter` refuses (judged by the
        broker's timestamp of the message too, when a record carries it as a fifth item, in
        seconds)."""
        decoded: dict = {}
        check = self.time_filter.check
        for rec in records:
            partition, offset, key, value = rec[:4]
            out.events += 1
            event, reason = classify(value)
            if event is not None:
                reason = check(event, rec[4] if len(rec) > 4 else None)
                if reason is not None:
                    event = None
                    out.time_rejected += 1
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
            slot = slots.get(skey)
            if slot is not None:
                del slots[skey]          # the most recently used goes last
                slots[skey] = slot
            else:
                slot = self.state.load(skey)
                if slot is None:
                    slot = RankSlot(make(), partition, -1)
                    self.state.put(skey, slot)
            if slot.partition == partition and offset <= slot.offset:
                out.replayed += 1
                continue
            slot.partition, slot.offset, slot.touched = partition, offset, now
            dirty.add(skey)
            try:
                summaries = slot.stage.update(event)
            except Exception:            # a stage bug must not stop the stream
                out.errors += 1
                log.exception("rank stage %s failed on offset %d/%d", skey, partition, offset,
                              extra={"job": event.job, "rank": event.rank})
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
                 advance_every_s: float | None = 0.5, evict_idle_s: float | None = None,
                 max_live: int | None = None, shared: dict | None = None,
                 incidents: bool = False, source_idle_s: float = 10.0,
                 tune_stage: Callable[[str, Any], Any] | None = None,
                 max_held: int = 200_000, hold_slack_s: float = 1.0,
                 hold_idle_s: float = 2.0, unread_s: float = 180.0):
        self.make_stage = make_stage
        #: items of a job held for a partition read behind, at most (see :meth:`apply`)
        self.max_held = max_held
        #: an item at most this far ahead of the slowest partition is not held
        self.hold_slack_s = hold_slack_s
        #: a partition holds the others back while it sent a rank's item this recently
        #: (wall seconds), or while its rank worker said it is behind (``reading``) or nobody
        #: says it reads it; an item is held ``source_idle_s`` at most (``unread_s`` for a
        #: partition said to be behind or that nobody reads)
        self.hold_idle_s = hold_idle_s
        #: telemetry partition -> wall time its rank worker last said it is behind, or
        #: (``caught_up``) that it is not; shared by all jobs (a partition's backlog is every
        #: job's in it); not in snapshots: the next messages tell it again
        self.behind: dict = {}
        self.caught_up: dict = {}
        #: the telemetry topic's partition count, from the rank workers (0: not told)
        self.telemetry_partitions = 0
        self._first: dict = {}        # job -> wall time its first message came
        #: job -> wall time its state, idle evict_idle_s or more, was loaded again: what
        #: the rank workers said before then is not of it (:meth:`_unread_of`)
        self._idle_loads: dict = {}
        self._worlds: dict = {}       # job -> world size of the latest start received
        self._expected: dict = {}     # job -> (world, partitions, the partitions of its ranks)
        self.released_early = 0
        #: a telemetry partition that sent nothing this long no longer holds the job's
        #: clock back (:meth:`JobSlot.heard`)
        self.source_idle_s = source_idle_s
        #: ... unless no rank worker said since that it read the partition to the end (its
        #: worker killed, stalled or its partitions moving): then it holds the time up to which
        #: the job is judged (a silent machine's) back this long (:meth:`_unread_since`)
        self.unread_s = unread_s
        self.incidents = incidents
        #: called with (job, stage) for each stage built or loaded from a snapshot: the
        #: job's per-job overrides (streams/config_feed.py)
        self.tune_stage = tune_stage
        self.idle_ttl_s = idle_ttl_s
        self.evict_idle_s = evict_idle_s
        self.observe_lag = observe_lag
        self.advance_every_s = advance_every_s
        self.state = Slots(idle_ttl_s=idle_ttl_s, evict_idle_s=evict_idle_s,
                           max_live=max_live, kinds=(JobSlot,), shared=shared,
                           reuse_blobs=True)
        self.applied = 0
        self.replayed = 0
        self.errors = 0

    def __len__(self) -> int:
        return len(self.state.slots)

    def _slot(self, job: str, partition: int, now: float | None = None) -> JobSlot:
        key = job.encode()
        slot = self.state.slots.get(key)
        if slot is not None:
            self.state.touch(key, slot)
        else:
            slot = self.state.load(key)
            if slot is not None and now is not None:
                if now - slot.touched >= (self.evict_idle_s or 0.0):
                    self._idle_loads[job] = now    # not one evicted for room (max_live)
                slot.heard_again(now)
            if slot is None:
                slot = JobSlot(self.make_stage(), partition)
                if getattr(slot.stage, "job", "") is None:
                    slot.stage.job = job
                self.state.put(key, slot)
            self._tuned(job, slot)
        slot.partition = partition
        return slot

    def _tuned(self, job: str, slot) -> None:
        if self.tune_stage is not None:
            try:
                self.tune_stage(job, slot.stage)
            except Exception:            # the stage keeps the file's settings
                log.exception("per-job overrides of %s not applied", job)

    def apply(self, value, partition: int, now: float) -> list[ev.Anomaly]:
        """Apply one summaries message; raises :class:`InvalidSummaries` for a bad one.

        Its items are applied in the job's time order up to the time every telemetry
        partition that carried a rank's item within ``hold_idle_s`` has reached
        (:meth:`_hold_upto`),
        as one process reading everything in order would apply them: the rank workers of a
        job do not wait for each other, and one that catches up on a backlog seconds of the
        job's time ahead of another would otherwise show the other's ranks as silent, stuck
        or stopped. The items of a partition more than ``hold_slack_s`` ahead wait, at most
        ``source_idle_s`` of wall time and ``max_held`` items per job (beyond, they go on,
        counted in ``released_early``: a machine's clock offset not learned yet, or learned
        wrong, cannot hold a job back for long).

        A partition whose rank worker said, with its last message, that records of it are
        still to read (``reading``: a backlog) holds the others back also while it sends
        nothing, and their items wait, within ``unread_s``: a worker that pauses in the
        middle of a backlog (a snapshot, a collection, a rebalance) would otherwise let the
        other workers' items of that time go first (Kafka Streams waits for an empty
        partition in the same way only while it has lag, KIP-695). So does a partition that
        went silent while nobody says it reads it (:meth:`_unread_since`: its worker killed
        or stalled, its partitions moving to another worker that reads their state back)."""
        job, items, reading = parse_summaries(value)
        if reading is not None:
            self._read(reading, now)
        self._first.setdefault(job, now)
        slot = self._slot(job, partition, now)
        slot.touched = now
        if items or slot.held:           # a word of what a worker reads changes no state
            self.state.dirty.add(job.encode())
        marks, held, idle_s = slot.marks, slot.held, self.source_idle_s
        unread_since = self._unread_of(job)
        limit = now + FUTURE_SLACK_S
        clock = getattr(slot.stage, "clock", None)
        for p, o, i, item in items:
            if not marks.advance(p, o, i):
                self.replayed += 1
                continue
            if "type" in item and "k" not in item:     # a machine's gpu / xid event
                item = trusted_event(item)
            # the item's time on the job's clock (the stage restamps a machine whose clock
            # is off), so no machine's clock moves the job's "now"
            if type(item) is dict:
                if clock is not None and item.get("k") != "finding":
                    clock.correct(item)       # learns, and restamps it in place
                ts = item.get("ts")
                ranked = item.get("rank") is not None and item.get("k") in _RANK_KINDS
                if ranked and item.get("event") == "start":
                    world = item.get("world_size")
                    if type(world) is int and world > 0:
                        self._worlds[job] = world     # before it is applied: see below
            else:
                ts = item.ts if clock is None else clock.time(item.node, item.ts)
                ranked = False
            if type(ts) is not float and type(ts) is not int:
                ts = -math.inf                # nothing to order it by: at once
            elif ranked:
                # a rank's step, heartbeat or lifecycle: what the rank workers' partitions
                # carry every few seconds tells how far each was read. The launcher's own
                # events and a machine's samples come seconds or minutes apart: they wait
                # their turn, but hold nothing back.
                low = slot.heard(p, ts, now, idle_s, unread_since)
                if low > slot.low:
                    slot.low = low if low < limit else limit
            slot.held_seq += 1
            heapq.heappush(held, [ts, slot.held_seq, item, now])
        return self._release(job, slot, now, self._hold_upto(job, slot, now))

    def _unread_since(self, partition: int, heard: float, wall: float,
                      since: float = -math.inf) -> bool:
        """Whether ``partition``, which last sent at wall time ``heard``, is silent for at
        most ``unread_s`` while a rank worker told of it (live workers say with every
        message, and every second to the jobs they send to, which partitions they read and
        which of them they are behind on) and none said, since ``heard`` and within
        ``hold_idle_s`` of ``wall``, that it read it to the end. A partition never told of
        (``since``: since its job's state was loaded again after it was idle,
        :meth:`_unread_of`) is judged by its silence alone."""
        if wall - heard > self.unread_s:
            return False
        at = self.caught_up.get(partition)
        if at is None or at < since:
            told = self.behind.get(partition)
            return told is not None and told >= since
        return at <= heard or wall - at > self.hold_idle_s

    def _unread_of(self, job: str):
        """:meth:`_unread_since` for ``job``: a job idle ``evict_idle_s`` or more whose
        state was loaded again when it spoke takes no word the rank workers said before the
        load as said of its partitions (they may have moved since, and their new worker
        says what it reads to the jobs it feeds only), for ``unread_s`` after the load;
        until they say it again, its partitions are judged by their silence, as those of a
        job never told of. A job loaded when its summaries partition moved here
        (:meth:`load_saved`) was not idle: the words said of its partitions stand (a worker
        killed with this job's worker is still waited for)."""
        since = self._idle_loads.get(job)
        if since is None:
            return self._unread_since
        return partial(self._unread_since, since=since)

    @property
    def _behind_wait_s(self) -> float:
        """How long a partition said to be behind (or not heard of yet at a job's start)
        holds its job back, the others' items with it (wall s)."""
        return max(self.unread_s, self.source_idle_s)

    def _waits_long(self, job: str, slot, wall: float) -> bool:
        """Whether ``slot``'s job waits for one of its telemetry partitions for up to
        :attr:`_behind_wait_s` rather than ``source_idle_s``: one was last said, within
        :attr:`_behind_wait_s`, to have records still to read (its worker reads a backlog,
        and may pause in it for longer than ``source_idle_s``: a snapshot, a collection, a
        rebalance), or went silent while nobody says it reads it (:meth:`_unread_since`:
        its worker killed or stalled, its partitions moving and their state restored)."""
        behind, bound = self.behind, self._behind_wait_s
        if behind and any(p in behind and wall - behind[p] <= bound for p in slot.sources):
            return True
        unread = slot.unread(wall, self.source_idle_s, self._unread_of(job))
        return next(unread, None) is not None      # partition 0 is one too

    def unread_partitions(self, wall: float) -> set:
        """The telemetry partitions silent for more than ``source_idle_s`` that hold a job's
        judged time back because no rank worker says it reads them (:meth:`_unread_since`)."""
        out: set = set()
        for key, slot in self.state.slots.items():
            out.update(slot.unread(wall, self.source_idle_s,
                                   self._unread_of(key.decode("utf-8", "replace"))))
        return out

    def _read(self, reading, now: float) -> None:
        behind, caught_up = self.behind, self.caught_up
        for p in reading.parts:
            behind.pop(p, None)
            caught_up[p] = now
        for p in reading.behind:
            caught_up.pop(p, None)
            behind[p] = now
        if reading.of:
            self.telemetry_partitions = reading.of

    def _awaits_unheard(self, job: str, slot, now: float) -> bool:
        """Whether a telemetry partition that carries ranks of ``job`` (by the collectors'
        key ``job/rank``, the world size of its lifecycle ``start`` and the topic's partition
        count) sent none of them yet while its rank worker has not said it read it to the
        end: a worker that began reading a backlog later than the others. Within
        ``unread_s`` of the job's first message only."""
        count = self.telemetry_partitions
        first = self._first.get(job)
        if not count or first is None or now - first > self._behind_wait_s:
            return False
        # the starts received, held or not: a worker's first message may hold seconds of
        # its ranks' steps, which must wait for the other partitions' ranks
        world = self._worlds.get(job) or getattr(getattr(slot.stage, "steps", None), "world", 0)
        if not world:
            return False
        known = self._expected.get(job)
        if known is None or known[:2] != (world, count):
            known = self._expected[job] = (world, count, rank_partitions(job, world, count))
        sources, caught_up = slot.sources, self.caught_up
        return any(p not in sources and p not in caught_up for p in known[2])

    def _hold_upto(self, job: str, slot, now: float) -> float:
        """The job's time up to which held items go on: the slowest partition that carried
        a rank's item within ``hold_idle_s`` (a backlog read by two workers streams from
        every partition; live, a partition whose ranks stopped or send a heartbeat every
        few seconds holds nothing back for long), that its worker last said, within
        ``unread_s``, is behind, or that nobody says it reads (:meth:`_unread_since`), plus
        ``hold_slack_s``."""
        if self._awaits_unheard(job, slot, now):
            return -math.inf
        lowest = slot.lowest(now, self.hold_idle_s, self.behind, self._behind_wait_s,
                             self._unread_of(job))
        return math.inf if lowest == -math.inf else lowest + self.hold_slack_s

    def _release(self, job: str, slot, now: float, upto: float) -> list[ev.Anomaly]:
        """Apply the held items of ``slot`` up to the job's time ``upto``, in time order."""
        held = slot.held
        stage, observe = slot.stage, self.observe_lag
        clocked = getattr(stage, "clock", None) is not None    # restamped when held
        watermark, limit = slot.watermark, now + FUTURE_SLACK_S
        every = self.advance_every_s
        out = []
        applied = False
        wait = now - self.source_idle_s            # held this long (wall): on it goes ...
        if held and (upto == -math.inf or self._waits_long(job, slot, now)):
            wait = now - self._behind_wait_s       # ... or this, in a backlog
        while held and (held[0][0] <= upto or len(held) > self.max_held
                        or held[0][3] < wait):
            if held[0][0] > upto:
                self.released_early += 1
            item = heapq.heappop(held)[2]
            applied = True
            self.applied += 1
            try:
                out += stage.update(item, clocked=True) if clocked else stage.update(item)
            except Exception:            # a detector bug must not stop the stream
                self.errors += 1
                log.exception("job stage %s failed on an item", job, extra={"job": job})
            if type(item) is dict:
                ts = item.get("ts")
            else:
                clock = getattr(stage, "clock", None)
                ts = clock.time(item.node, item.ts) if clock is not None else item.ts
            if type(ts) is float or type(ts) is int:
                if ts > watermark:
                    watermark = ts if ts < limit else limit
                if observe is not None:
                    observe(now - ts)
            if every is not None and watermark > slot.clock and \
                    on_grid(watermark, every) > slot.clock:
                slot.clock = on_grid(watermark, every)     # analyze's event-time grid
                try:
                    out += stage.advance(slot.clock, steps_now=on_grid(slot.low, every))
                except Exception:
                    self.errors += 1
                    log.exception("job stage %s failed in advance()", job,
                                  extra={"job": job})
        if applied:
            slot.watermark, slot.applied_at = watermark, now
        return self._with_incidents(stage, out) if out else out

    def _with_incidents(self, stage, anomalies: list) -> list:
        """``anomalies``, then (with ``incidents``) an ``ev.Incident`` for each incident of
        ``stage`` they opened or grew."""
        changed = stage.take_incidents() if hasattr(stage, "take_incidents") else []
        if not self.incidents:
            return anomalies
        return anomalies + [ev.Incident.of(incident) for incident in changed]

    def advance(self, now: float) -> list[ev.Anomaly]:
        out = []
        for job in [j for j, at in self._idle_loads.items() if now - at > self.unread_s]:
            del self._idle_loads[job]
        if len(self._first) > len(self.state.slots):
            for job in [j for j in self._first if j.encode() not in self.state.slots]:
                del self._first[job]
                self._expected.pop(job, None)
                self._worlds.pop(job, None)
        for key, slot in self.state.slots.items():
            job = key.decode()
            unread_since = self._unread_of(job)
            if slot.held:            # a partition gone quiet, or held too long, no longer
                                     # holds the others
                low = slot.lowest(now, self.source_idle_s, unread_since=unread_since)
                if low > slot.low:
                    slot.low = min(low, now + FUTURE_SLACK_S)
                found = self._release(job, slot, now, self._hold_upto(job, slot, now))
                if found:
                    self.state.dirty.add(key)
                    out += found
            try:
                every = self.advance_every_s
                at, steps_at = slot.clocks(now, unread_since)
                if every:
                    at, steps_at = on_grid(at, every), on_grid(steps_at, every)
                found = slot.stage.advance(at, steps_now=steps_at)
            except Exception:
                self.errors += 1
                log.exception("job stage %s failed in advance()", job)
                continue
            if found:
                self.state.dirty.add(key)
                out += self._with_incidents(slot.stage, found)
        return out

    def load_saved(self, partitions: set, now: float | None = None) -> int:
        """Load the restored jobs of ``partitions`` that had input within ``evict_idle_s``
        now (so that ``advance`` sees jobs that send nothing any more; the others were
        evicted as idle and come back when they speak); returns how many."""
        recent = (now - self.evict_idle_s if now is not None and self.evict_idle_s is not None
                  else -math.inf)
        keys = []
        for key, blob in list(self.state.saved.items()):
            try:
                partition, touched = state_header(blob)
            except StateError as exc:
                del self.state.saved[key]
                self.state.failed(key, exc)
                continue
            if partition in partitions and touched >= recent:
                keys.append(key)
        loaded = 0
        for key in keys:
            slot = self.state.load(key)
            if slot is not None:
                if now is not None:
                    slot.heard_again(now)
                self._idle_loads.pop(key.decode("utf-8", "replace"), None)
                self._tuned(key.decode("utf-8", "replace"), slot)
                loaded += 1
        return loaded


__all__ += ["InvalidSummaries"]
