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
from typing import Any, Callable, Iterable

from trainguard import events as ev
from trainguard.eventtime import EventTimeFilter
from trainguard.deadletter import deadletter_record
from trainguard.detectors.stages import launcher_summary, on_grid

from .logic import (NODE_TYPES, InvalidSummaries, Reading, classify, encode_summaries,
                    node_key, parse_summaries, stage_key, trusted_event)
from .partition_watch import PartitionWatch
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
        self.released_early = 0
        self.superseded = 0            # heartbeats let go after a later one of their rank
        #: a telemetry partition that sent nothing this long no longer holds the job's
        #: clock back (:meth:`JobSlot.heard`)
        self.source_idle_s = source_idle_s
        #: ... unless no rank worker said since that it read the partition to the end (its
        #: worker killed, stalled or its partitions moving): then it holds the time up to which
        #: the job is judged (a silent machine's) back this long, and the job goes on without
        #: the ranks on it after that (:class:`~.partition_watch.PartitionWatch`)
        self.unread_s = unread_s
        #: what the rank workers said of the telemetry partitions, and what follows for a job
        self.watch = PartitionWatch(source_idle_s=source_idle_s, hold_idle_s=hold_idle_s,
                                    unread_s=unread_s)
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
                    self.watch.idle_loads[job] = now   # not one evicted for room (max_live)
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
        went silent while nobody says it reads it (:meth:`PartitionWatch.unread_since`: its
        worker killed or stalled, its partitions moving to another worker that reads their
        state back); after ``unread_s`` the job goes on without it, and the ranks on it are
        not judged missing until it is read again (:meth:`PartitionWatch.unseen`)."""
        job, items, reading = parse_summaries(value)
        watch = self.watch
        if reading is not None:
            watch.read(reading, now)
        watch.first.setdefault(job, now)
        slot = self._slot(job, partition, now)
        slot.touched = now
        if items or slot.held:           # a word of what a worker reads changes no state
            self.state.dirty.add(job.encode())
        marks, held, idle_s = slot.marks, slot.held, self.source_idle_s
        unread_since = watch.unread_of(job)
        limit = now + FUTURE_SLACK_S
        clock = getattr(slot.stage, "clock", None)
        parts_of = watch.rank_parts.get(job)
        if parts_of is None:
            parts_of = watch.rank_parts[job] = {}
        for p, o, i, item in items:
            if not marks.advance(p, o, i):
                self.replayed += 1
                continue
            if "type" in item and "k" not in item:     # a machine's gpu / xid event
                item = trusted_event(item)
            # the item's time on the job's clock (the stage restamps a machine whose clock
            # is off), so no machine's clock moves the job's "now"
            if type(item) is dict:
                if clock is not None:
                    clock.correct(item)       # learns, and restamps it in place
                ts = item.get("ts")
                rank = item.get("rank")
                ranked = rank is not None and item.get("k") in _RANK_KINDS
                if rank is None and item.get("k") == "life":
                    parts_of[None] = p        # the launcher's (trainguard run's) partition
                elif ranked and item.get("event") == "start":
                    world = item.get("world_size")
                    if type(world) is int and world > 0:
                        watch.worlds[job] = world     # before it is applied: see below
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
                if type(rank) is int:
                    parts_of[rank] = p
            slot.held_seq += 1
            heapq.heappush(held, [ts, slot.held_seq, item, now])
        return self._release(job, slot, now, self._hold_upto(job, slot, now))

    def unread_partitions(self, wall: float) -> set:
        """The telemetry partitions that nobody says it reads (see
        :meth:`PartitionWatch.unread_partitions`)."""
        return self.watch.unread_partitions(self.state.slots, wall)

    def _hold_upto(self, job: str, slot, now: float) -> float:
        """The job's time up to which held items go on: the slowest partition that carried
        a rank's item within ``hold_idle_s`` (a backlog read by two workers streams from
        every partition; live, a partition whose ranks stopped or send a heartbeat every
        few seconds holds nothing back for long), that its worker last said, within
        ``unread_s``, is behind, or that nobody says it reads
        (:meth:`PartitionWatch.unread_since`), plus ``hold_slack_s``."""
        watch = self.watch
        if watch.awaits_unheard(job, slot, now):
            return -math.inf
        lowest = slot.lowest(now, self.hold_idle_s, watch.behind, watch.behind_wait_s,
                             watch.unread_of(job))
        return math.inf if lowest == -math.inf else lowest + self.hold_slack_s

    def _release(self, job: str, slot, now: float, upto: float) -> list[ev.Anomaly]:
        """Apply the held items of ``slot`` up to the job's time ``upto``, in time order."""
        held, released = slot.held, slot.released
        stage, observe = slot.stage, self.observe_lag
        clocked = getattr(stage, "clock", None) is not None    # restamped when held
        watermark, limit = slot.watermark, now + FUTURE_SLACK_S
        every = self.advance_every_s
        out = []
        applied = False
        unseen = None                              # found at the first advance
        wait = now - self.source_idle_s            # held this long (wall): on it goes ...
        if held and (upto == -math.inf or self.watch.waits_long(job, slot, now)):
            wait = now - self.watch.behind_wait_s   # ... or this, in a backlog
        while held and (held[0][0] <= upto or len(held) > self.max_held
                        or held[0][3] < wait):
            if held[0][0] > upto:
                self.released_early += 1
            _, seq, item, _ = heapq.heappop(held)
            if type(item) is dict and item.get("k") in _IN_ORDER:
                rank = item.get("rank")
                if type(rank) is int:
                    if released.get(rank, -1) < seq:
                        released[rank] = seq
                    elif item["k"] == "hb":
                        # let go after a later heartbeat or start of its rank (its machine's
                        # clock offset, learned meanwhile, moved them apart): what it tells
                        # is over; taken, it would end a phase that had begun since
                        self.superseded += 1
                        continue
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
                    if unseen is None:
                        unseen = self.watch.unseen(job, slot, now)
                    # nothing of a rank heard yet (the launcher's start first): judged up
                    # to the clock, as advance() does (on_grid(-inf) raised, every new job)
                    steps = slot.clock if slot.low == -math.inf else on_grid(slot.low, every)
                    out += _advance(stage, slot.clock, steps, unseen)
                except Exception:
                    self.errors += 1
                    log.exception("job stage %s failed in advance()", job,
                                  extra={"job": job})
        if applied:
            slot.watermark, slot.applied_at = watermark, now
        if not held and released:
            released.clear()           # what comes next came after all that went
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
        watch = self.watch
        watch.prune(now)
        if len(watch.first) > len(self.state.slots):
            for job in [j for j in watch.first if j.encode() not in self.state.slots]:
                watch.forget(job)
        for key, slot in self.state.slots.items():
            job = key.decode()
            unread_since = watch.unread_of(job)
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
                found = _advance(slot.stage, at, steps_at, watch.unseen(job, slot, now))
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
                self.watch.idle_loads.pop(key.decode("utf-8", "replace"), None)
                self._tuned(key.decode("utf-8", "replace"), slot)
                loaded += 1
        return loaded


#: a rank's items sent in the order they were stamped (one thread stamps its heartbeats; a
#: start is a new process); its step records may be sent after later heartbeats
_IN_ORDER = frozenset(("hb", "life"))


def _advance(stage, now: float, steps_now: float, unseen: frozenset) -> list:
    """``stage.advance``, told the ranks nobody reads when there are any (a stage that
    knows nothing of them is never told)."""
    if unseen:
        return stage.advance(now, steps_now=steps_now, unseen=unseen)
    return stage.advance(now, steps_now=steps_now)


__all__ += ["InvalidSummaries"]
