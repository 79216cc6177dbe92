"""The rank side of the worker: telemetry in batches, per-rank stages, summaries out.

Faust hands every message through its stream machinery one at a time; on this project's
2-core machine that path tops out at 6,000-14,000 messages/s even with ``take_events`` and
no processing at all (``faust_take_events_per_s`` in bench/bench_stream_throughput.py),
less than this service does with every detector on, and its aiokafka client cannot read
the collectors' lz4 batches without the cramjam package. So the high-volume rank side is a
:class:`mode.Service` inside the Faust worker that consumes in batches with confluent-kafka
(librdkafka: lz4, heartbeats on its own threads, the classic consumer-group protocol) in
its own consumer group; the job side stays a Faust agent and table.

Records are decoded, aligned in event time across partitions
(:class:`~trainguard.streams.logic.EventTimeAligner`) and applied to the stages without
awaiting anything. Every ``snapshot_interval_s`` (longer while snapshots cost more than
``snapshot_cpu_share`` of a core, at most ``snapshot_max_interval_s``: :func:`~trainguard.
streams.snapshots.snapshot_pause`) the changed stages go to the compacted
``<app>-rank-state`` topic (in the partition of their telemetry), the producer is flushed
and only then are the offsets of the applied records committed. A committed offset never
passes the snapshot, and a restarted worker restores the snapshot, re-reads from the
committed offset and skips what each restored stage had already seen.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid

from mode import Service

from trainguard.streams.logic import EventTimeAligner, Reading, key_job
from trainguard.streams.partition_leaders import STATS_INTERVAL_MS, LeaderWatch
from trainguard.streams.processors import RankOutput, RankProcessor
from trainguard.streams.snapshots import StateError, snapshot_pause, state_header

__all__ = ["RankService"]

log = logging.getLogger(__name__)
#: a partition that brought records this recently may bring older ones still
ACTIVE_S = 0.3
#: event-time lead over the other partitions at which a partition is paused
AHEAD_S = 2.0
#: a job told that a partition is behind hears that it no longer is within this (wall s)
TELL_EVERY_S = 1.0
#: a partition that this worker kept up with (read to the end, or what the broker held
#: fetched within this) is behind once the records the broker held beyond what was fetched,
#: when that was first seen, are still not all fetched after this long (wall s); one just
#: assigned or with a backlog is behind at once, and so is every partition after the loop
#: stood still for longer. A worker that keeps up consumes them within milliseconds, but
#: the cached high watermark comes with each fetch, before consume() hands its records over:
#: told every loop, a partition fed a heartbeat a second was said behind for seconds. A
#: loop that waits ``worker.poll_ms`` (at most 1 s) between empty polls gets that much more
#: (:attr:`RankService.keeps_up_s`): consume() hands over what was fetched meanwhile only then
KEEPS_UP_S = 1.0
#: a job that got items from this worker within this long (wall s) hears what it reads at
#: least every TELL_EVERY_S, also with nothing to send: that its partitions are read, so
#: their silence is its ranks' (``JobProcessor.unread_s``); at least that long and
#: VOUCH_MARGIN_S more (:attr:`RankService.vouch_for_s`), or a partition whose ranks all
#: went quiet would pass for one nobody reads once its worker stopped saying it reads it
VOUCH_FOR_S = 60.0
VOUCH_MARGIN_S = 30.0
#: librdkafka's socket.timeout.ms for the rank side's consumer and producer (see
#: :meth:`RankService.connect`)
SOCKET_TIMEOUT_MS = 10_000
#: the longest a restore of the rank state of newly assigned partitions reads (wall s); the
#: job side waits longer for partitions that nobody reads (``worker.unread_partition_s``)
RESTORE_MOST_S = 120.0


class RankService(Service):
    """Consumes ``telemetry``; see the module docstring."""

    def __init__(self, *, kafka: dict, settings, topics, processor: RankProcessor, metrics,
                 state_partitions: int, clock=time.time, consumer_factory=None,
                 producer_factory=None, **kwargs):
        self.kafka = kafka                      # librdkafka settings (bootstrap, security)
        self.consumer_factory = consumer_factory    # default: confluent_kafka.Consumer
        self.producer_factory = producer_factory    # default: confluent_kafka.Producer
        self.settings = settings
        self.topics = topics
        self.processor = processor
        self.metrics = metrics
        self.state_partitions = state_partitions
        self.clock = clock
        self.consumer = None
        self.producer = None
        self.leaders = LeaderWatch(topics.telemetry, clock=clock)
        self.assignment: set = set()    # partitions of the telemetry topic we own
        self.positions: dict = {}       # partition -> next offset to apply
        self.fetched: dict = {}         # partition -> next offset to fetch
        self.last_seen: dict = {}       # partition -> wall time records last came
        self.paused: set = set()        # partitions paused by flow control
        self.unblocked: dict = {}       # partition -> fetch position at which it stalled
        self.reassigned: set = set()    # assigned since the last batch, to resume
        self.aligner = EventTimeAligner(max_hold_s=settings.align_hold_s)
        self._committed: dict = {}
        self._told: dict = {}           # job -> (partitions told behind, wall time)
        self._gaps: dict = {}           # partition -> (high watermark, wall time) when the
                                        # broker was first seen to hold more than fetched
        self._keeping: set = set()      # partitions read as they are written (_keeps_up)
        self._processed_at = -math.inf  # wall time of the last batch (or empty poll)
        self.keeps_up_s = KEEPS_UP_S + settings.poll_ms / 1000
        self._fed: dict = {}            # job -> wall time it last got items from here
        self._heard_at: dict = {}       # job -> wall time it last got a message from here
        self._partitions = 0            # the telemetry topic's partition count, once known
        self._count_again = 0.0         # ... and when to ask the broker for it again
        self._failed = 0
        self._retry: list = []          # (topic, value, key, partition) whose delivery failed
        self._stopping = False
        self._task = None
        self._next_snapshot = 0.0
        super().__init__(**kwargs)

    # -- lifecycle ----------------------------------------------------------------------
    async def on_start(self) -> None:
        self.connect()
        self._next_snapshot = self.clock() + self.settings.snapshot_interval_s
        self._task = asyncio.ensure_future(self._run())

    def _clients(self):
        from confluent_kafka import Consumer, Producer

        return self.consumer_factory or Consumer, self.producer_factory or Producer

    def connect(self) -> None:
        """Create the producer and the consumer, and subscribe."""
        Consumer, Producer = self._clients()
        self.producer = Producer({**self.kafka, "linger.ms": 5, "enable.idempotence": True,
                                  "acks": "all",
                                  "partitioner": "murmur2_random",
                                  "message.max.bytes": 16 * 1024 * 1024,
                                  # a snapshot's flush waits for a broker that stopped
                                  # answering this long, not 60 s (see the consumer's)
                                  "socket.timeout.ms": SOCKET_TIMEOUT_MS})
        session_ms = int(self.settings.session_timeout_s * 1000)
        self.consumer = Consumer({
            **self.kafka, "group.id": self.settings.rank_group,
            "client.id": f"{self.settings.app_id}-ranks", "enable.auto.commit": False,
            "auto.offset.reset": "earliest", "session.timeout.ms": session_ms,
            "heartbeat.interval.ms": max(1000, session_ms // 5),
            "max.poll.interval.ms": 300_000,
            # a short prefetch queue and small per-partition fetches interleave the
            # partitions of a backlog finely, so the event-time aligner holds little back
            "queued.min.messages": 5000, "fetch.queue.backoff.ms": 10,
            "max.partition.fetch.bytes": 65536,
            # which partitions have no connected leader (a broker died): not said to be read
            "statistics.interval.ms": STATS_INTERVAL_MS, "stats_cb": self.leaders.on_stats,
            # a broker that stopped answering (frozen, its packets dropped) is let go and the
            # partitions' new leaders learned after this, not librdkafka's 60 s: a fetch
            # waits 0.5 s at most (fetch.wait.max.ms)
            "socket.timeout.ms": SOCKET_TIMEOUT_MS})
        self.consumer.subscribe([self.topics.telemetry], on_assign=self._on_assign,
                                on_revoke=self._on_revoke, on_lost=self._on_lost)

    async def on_stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            try:
                await asyncio.wait_for(self._task, timeout=self.settings.grace_s / 2)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
            except Exception:
                log.exception("rank side failed while stopping")
        if self.consumer is not None:
            await self.checkpoint("stop")
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.consumer.close)
        if self.producer is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.producer.flush, 10.0)

    # -- the loop -----------------------------------------------------------------------
    async def _run(self) -> None:
        while not self._stopping:
            messages = self.poll_once()
            if messages is None:
                await asyncio.sleep(1.0)
            if self.clock() >= self._next_snapshot:
                await self.checkpoint("interval")
            # yield to Faust's tasks after every batch; idle: wait a little for more
            await asyncio.sleep(self.settings.poll_ms / 1000 if not messages else 0)

    def poll_once(self, timeout_s: float = 0) -> list | None:
        """Consume one batch (this serves the rebalance callbacks too) and apply it; None
        when consuming failed."""
        failed = False
        try:
            messages = self.consumer.consume(self.settings.batch_max, timeout_s)
        except Exception as exc:
            log.warning("telemetry consume failed: %s", exc)
            messages, failed = [], True
        if self.reassigned:
            self._resume_reassigned()
        cpu = time.thread_time()
        self._process(messages)        # also releases held records when nothing came
        self.producer.poll(0)
        self.metrics.inc("rank_side_cpu_seconds", time.thread_time() - cpu)
        return None if failed else messages

    def _resume_reassigned(self) -> None:
        """librdkafka keeps a partition paused across a rebalance when it is assigned to
        this consumer again, while :meth:`_forget` cleared it from ``paused``: resume every
        newly assigned partition (only possible once the assignment took effect, after the
        callback), or it would never be read again."""
        from confluent_kafka import TopicPartition

        parts, self.reassigned = self.reassigned & self.assignment - self.paused, set()
        if not parts:
            return
        try:
            self.consumer.resume([TopicPartition(self.topics.telemetry, p) for p in parts])
        except Exception as exc:          # e.g. revoked again meanwhile
            log.info("resume after assignment failed: %s", exc)

    def _process(self, messages) -> None:
        now = self.clock()
        if not 0 <= now - self._processed_at <= self.keeps_up_s:
            # the loop stood still (a snapshot's flush, a rebalance): whatever the broker
            # wrote meanwhile was not fetched as it was written
            self._keeping.clear()
            self._gaps.clear()
        self._processed_at = now
        out = RankOutput()
        records = []
        for m in messages:
            if m.error():
                if m.error().code() != -191:         # _PARTITION_EOF
                    log.warning("telemetry consume error: %s", m.error())
                continue
            p, o = m.partition(), m.offset()
            kind, stamp = m.timestamp()
            records.append((p, o, m.key(), m.value(), stamp / 1000.0 if kind else None))
            self.fetched[p] = o + 1
            self.last_seen[p] = now
        if records:
            for p, timed in self.processor.decode(records, out).items():
                self.aligner.add(p, timed, now)
        if len(self.aligner):
            stalls = self.aligner.stalls
            blocked = self._blocked(now)
            released = self.aligner.release(blocked, now)
            if self.aligner.stalls != stalls:
                # what held everything back brought nothing (e.g. offsets taken by
                # transaction markers): stop waiting for it until it brings records again
                for p in blocked:
                    if now - self.last_seen.get(p, -ACTIVE_S) >= ACTIVE_S:
                        self.unblocked[p] = self.fetched.get(p, 0)
            if released:
                self.processor.apply(released, now, out)
                positions = self.positions
                for rec in released:
                    positions[rec[0]] = rec[1] + 1
        if len(self.aligner) or self.paused:
            self._flow_control()
        if out.items or self._told or self._vouch_due(now):
            self._tell_reading(out)
        self._account(out)

    def _tell_reading(self, out: RankOutput) -> None:
        """Say with each job's summaries which partitions this worker reads and which of
        them it is behind on (see ``JobProcessor.apply``); a job told that a partition was
        behind hears, with no items if need be, once it no longer is."""
        from confluent_kafka import TopicPartition

        # a partition without a connected leader is not read, whatever was fetched of it
        parts = sorted(self.assignment - self.leaders.unreadable())
        behind, now = [], self.clock()
        topic, fetched, aligner = self.topics.telemetry, self.fetched, self.aligner
        for p in parts:
            if aligner.newest(p) is not None:
                behind.append(p)               # fetched, held for its turn
                self._keeping.discard(p)
                continue
            tp = TopicPartition(topic, p)
            try:
                low, high = self.consumer.get_watermark_offsets(tp, cached=True)
                upto = fetched.get(p)
                if upto is None:               # nothing fetched yet: where it will start
                    upto = self.consumer.position([tp])[0].offset
                    upto = low if upto < 0 else upto
            except Exception:
                continue
            if high > upto:
                if not self._keeps_up(p, high, upto, now):
                    behind.append(p)           # the broker holds more of it
            elif high >= 0:                    # read to the end (known: a watermark is
                self._keeping.add(p)           # unknown until the first fetch)
                self._gaps.pop(p, None)
        out.reading = Reading(parts=tuple(parts), behind=tuple(behind),
                              of=self._partition_count())
        now_behind, told = set(behind), self._told
        for job, (was, when) in list(told.items()):
            # at most once a second: within a second of its last word a job still waits
            # for the partitions that sent to it anyway
            if job not in out.items and not was <= now_behind and now - when >= TELL_EVERY_S:
                out.items[job] = []            # tell it that it may stop waiting
        fed, heard_at = self._fed, self._heard_at
        vouch_for_s = self.vouch_for_s
        for job in [job for job, at in fed.items() if now - at > vouch_for_s]:
            del fed[job], heard_at[job]
        for job, at in heard_at.items():
            if job not in out.items and now - at >= TELL_EVERY_S:
                out.items[job] = []            # its partitions are read, nothing came
        for job, items in out.items.items():
            if now_behind:
                told[job] = (now_behind, now)
            else:
                told.pop(job, None)
            if items:
                fed[job] = now
            if job in fed:
                heard_at[job] = now

    def _keeps_up(self, p: int, high: int, upto: int, now: float) -> bool:
        """Whether partition ``p``, whose broker holds records up to ``high`` while this
        worker fetched up to ``upto``, is read as it is written (see :data:`KEEPS_UP_S`)
        rather than behind: only one that kept up before (read to the end, or what the
        broker held fetched within :attr:`keeps_up_s`) and whose gap is younger than that. A
        partition just assigned, or with a backlog, is behind at once."""
        gaps, keeping, grace = self._gaps, self._keeping, self.keeps_up_s
        gap = gaps.get(p)
        if gap is not None and upto >= gap[0]:     # what was held then is fetched
            if 0 <= now - gap[1] < grace:
                keeping.add(p)
            elif not 0 <= now - gap[1] < grace + TELL_EVERY_S:
                keeping.discard(p)             # surely late: told at least every second
            gap = None
        if gap is None:
            gap = gaps[p] = (high, now)
        if not 0 <= now - gap[1] < grace:
            keeping.discard(p)
            return False
        return p in keeping

    @property
    def vouch_for_s(self) -> float:
        """How long after this worker last fed a job it says what it reads to that job: as
        long as the job side may take a partition that sent nothing for a partition that
        nobody reads (``worker.unread_partition_s``), and more."""
        return max(VOUCH_FOR_S, self.settings.unread_partition_s + VOUCH_MARGIN_S)

    def _vouch_due(self, now: float) -> bool:
        """Whether a job this worker fed within :attr:`vouch_for_s` heard nothing from it
        for TELL_EVERY_S."""
        return any(now - at >= TELL_EVERY_S for at in self._heard_at.values())

    def _flow_control(self) -> None:
        """Pause partitions whose held records run ``AHEAD_S`` past the others, so that
        librdkafka, which hands a backlog over one partition after another, fetches the
        partitions that are behind; resume them once those caught up."""
        from confluent_kafka import TopicPartition

        cutoff = self.aligner.cutoff
        pause, resume = [], []
        for p in self.assignment:
            newest = self.aligner.newest(p)
            ahead = newest is not None and newest - cutoff > AHEAD_S
            if ahead and p not in self.paused:
                pause.append(p)
            elif not ahead and p in self.paused and (
                    newest is None or newest - cutoff <= AHEAD_S / 2):
                resume.append(p)
        topic = self.topics.telemetry
        try:
            if pause:
                self.consumer.pause([TopicPartition(topic, p) for p in pause])
                self.paused.update(pause)
            if resume:
                self.consumer.resume([TopicPartition(topic, p) for p in resume])
                self.paused.difference_update(resume)
        except Exception as exc:          # e.g. partitions revoked meanwhile
            log.info("pause/resume failed: %s", exc)

    def _blocked(self, now: float) -> set:
        """Assigned partitions that may still bring older records: their broker log holds
        records not fetched yet (or the high watermark is not known yet), or records came
        from them within ``ACTIVE_S`` (the watermark lags while producers write)."""
        from confluent_kafka import TopicPartition

        blocked = set()
        fetched, seen = self.fetched, self.last_seen
        for p in self.assignment:
            if now - seen.get(p, -ACTIVE_S) < ACTIVE_S:
                blocked.add(p)
                continue
            if p in self.unblocked:
                if self.unblocked[p] == fetched.get(p, 0):
                    continue
                del self.unblocked[p]
            try:
                _, high = self.consumer.get_watermark_offsets(
                    TopicPartition(self.topics.telemetry, p), cached=True)
            except Exception:
                continue
            if high < 0 or high > fetched.get(p, 0):
                blocked.add(p)
        return blocked

    def _partition_count(self) -> int:
        """The telemetry topic's partitions (0 while not known)."""
        known = self._partitions
        if (not known or max(self.assignment, default=-1) >= known) and \
                self.clock() >= self._count_again:
            self._count_again = self.clock() + 30.0     # a broker that does not answer
            try:
                meta = self.consumer.list_topics(self.topics.telemetry, timeout=1.0)
                self._partitions = len(meta.topics[self.topics.telemetry].partitions)
            except Exception:
                pass
        return self._partitions

    def _account(self, out: RankOutput) -> None:
        m = self.metrics
        m.inc("events_in", out.events)
        m.inc("invalid", out.invalid)
        m.inc("time_rejected", out.time_rejected)
        m.inc("ignored", out.ignored)
        m.inc("replayed", out.replayed)
        m.inc("stage_errors", out.errors)
        for key, value in out.messages(carrying=True):
            self._produce(self.topics.summaries, value, key)
            m.inc("summaries_out")
        for key, value in out.messages(carrying=False):
            self._produce(self.topics.summaries, value, key, delivered=self._word_delivered)
            m.inc("summaries_out")
        for key, record in out.deadletters:
            self._produce(self.topics.deadletter, record, key)

    def _produce(self, topic: str, value, key, partition: int | None = None,
                 delivered=None) -> None:
        kwargs = {} if partition is None else {"partition": partition}
        delivered = delivered or self._delivered
        while True:
            try:
                self.producer.produce(topic, value, key, on_delivery=delivered, **kwargs)
                return
            except BufferError:          # local queue full: let deliveries drain
                self.producer.poll(0.05)

    def _delivered(self, err, msg) -> None:
        if err is None:
            if msg.topic() == self.topics.deadletter:
                self.metrics.inc("deadletters_out")
            return
        if err is not None:
            self._failed += 1
            self.metrics.inc("deliveries_failed")
            # produced again before the next commit, which waits until it is delivered
            self._retry.append((msg.topic(), msg.value(), msg.key(), msg.partition()))
            log.warning("delivery to %s failed (produced again): %s", msg.topic(), err)

    def _word_delivered(self, err, msg) -> None:
        """A summaries message with no items, only what this worker reads: one lost is not
        produced again (the next, within TELL_EVERY_S, says it as of then; a late copy
        would say it as of its arrival) and holds no commit back (it covers no record)."""
        if err is not None:
            self.metrics.inc("deliveries_failed")
            log.info("delivery to %s failed (its next word replaces it): %s", msg.topic(), err)

    # -- snapshots and commits ------------------------------------------------------------
    def _write_snapshot(self) -> dict:
        retry, self._retry = self._retry, []
        for topic, value, key, partition in retry:
            self._produce(topic, value, key, partition if partition >= 0 else None)
        now = self.clock()
        cpu = time.thread_time()
        for key, partition, blob in self.processor.evict(now) + self.processor.snapshot():
            self._produce(self.topics.rank_state, blob, key, partition % self.state_partitions)
        cost = time.thread_time() - cpu
        s = self.settings
        self._next_snapshot = now + snapshot_pause(
            cost, s.snapshot_interval_s, cpu_share=s.snapshot_cpu_share,
            most_s=s.snapshot_max_interval_s)
        self.metrics.inc("snapshots")
        self.metrics.inc("snapshot_cpu_seconds", cost)
        return dict(self.positions)

    def _commit(self, offsets: dict, undelivered: int, why: str) -> bool:
        from confluent_kafka import TopicPartition

        if undelivered or self._failed:
            self.metrics.inc("snapshot_failures")
            log.warning("rank snapshot (%s): %d messages undelivered, %d failed; offsets not "
                        "committed until they are delivered", why, undelivered, self._failed)
            self._failed = 0
            return False
        assigned = {tp.partition for tp in self.consumer.assignment()}
        todo = {p: o for p, o in offsets.items()
                if p in assigned and o > self._committed.get(p, -1)}
        if not todo:
            return True
        try:
            self.consumer.commit(offsets=[TopicPartition(self.topics.telemetry, p, o)
                                          for p, o in todo.items()], asynchronous=False)
        except Exception as exc:          # a rebalance in progress: the next one commits
            log.info("rank offsets not committed (%s): %s", why, exc)
            return False
        self._committed.update(todo)
        return True

    async def checkpoint(self, why: str) -> bool:
        """Snapshot changed stages, flush, then commit what the snapshot covers."""
        offsets = self._write_snapshot()
        loop = asyncio.get_running_loop()
        left = await loop.run_in_executor(None, self.producer.flush, 30.0)
        return self._commit(offsets, left, why)

    # -- rebalancing (called from inside consume()) -----------------------------------------
    def checkpoint_now(self, why: str) -> bool:
        """:meth:`checkpoint` without the event loop (rebalance callbacks, tests)."""
        offsets = self._write_snapshot()
        return self._commit(offsets, self.producer.flush(30.0), why)

    def _on_revoke(self, consumer, partitions) -> None:
        if partitions:
            self.checkpoint_now("revoke")
        self._forget({tp.partition for tp in partitions})

    def _on_lost(self, consumer, partitions) -> None:
        self._forget({tp.partition for tp in partitions})

    def _forget(self, parts: set) -> None:
        self.assignment -= parts
        self.paused -= parts
        self.processor.drop(parts)
        self.aligner.drop(parts)
        for p in parts:
            self.positions.pop(p, None)
            self.fetched.pop(p, None)
            self.last_seen.pop(p, None)
            self.unblocked.pop(p, None)
            self._gaps.pop(p, None)
            self._keeping.discard(p)
            self._committed.pop(p, None)

    def _on_assign(self, consumer, partitions) -> None:
        parts = {tp.partition for tp in partitions}
        self.assignment |= parts
        self.reassigned |= parts
        self._keeping -= parts
        for p in parts:
            self._gaps.pop(p, None)
        try:
            for tp in consumer.committed(partitions, timeout=10):
                if tp.offset >= 0:
                    self.positions[tp.partition] = self.fetched[tp.partition] = tp.offset
        except Exception as exc:            # only the lag gauge needs them
            log.info("committed offsets unknown: %s", exc)
        if parts:
            restored = self.restore(parts)
            log.info("rank side: partitions %s assigned, %d stage snapshots restored",
                     sorted(parts), restored)

    def restore(self, partitions: set) -> int:
        """Read the rank-state partitions of ``partitions`` from the start to their end."""
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        Consumer, _ = self._clients()
        reader = Consumer({**self.kafka, "group.id": f"restore-{uuid.uuid4().hex}",
                           "enable.auto.commit": False, "enable.partition.eof": False})
        latest: dict = {}
        try:
            ends = {}
            for q in sorted({p % self.state_partitions for p in partitions}):
                low, high = reader.get_watermark_offsets(
                    TopicPartition(self.topics.rank_state, q), timeout=10)
                if high > low:
                    ends[q] = high
            reader.assign([TopicPartition(self.topics.rank_state, q, OFFSET_BEGINNING)
                           for q in ends])
            deadline = time.monotonic() + RESTORE_MOST_S
            while ends and time.monotonic() < deadline:
                for m in reader.consume(10000, 0.5):
                    if m.error():
                        continue
                    latest[m.key()] = m.value()
                    if m.offset() + 1 >= ends.get(m.partition(), 0):
                        ends.pop(m.partition(), None)
                # by position, not by the last record: a compacted or aborted last offset
                # is never delivered, and waiting for it would hold the rebalance that long
                for tp in reader.position([TopicPartition(self.topics.rank_state, q)
                                           for q in ends]):
                    if tp.offset >= 0 and tp.offset >= ends[tp.partition]:
                        ends.pop(tp.partition, None)
            if ends:
                log.warning("rank state partitions %s not fully read; those stages start "
                            "afresh", sorted(ends))
        finally:
            reader.close()
        count, now = 0, self.clock()
        for key, blob in latest.items():
            if not blob:
                self.processor.restore(key, None)
                continue
            try:
                partition, touched = state_header(blob)
            except StateError as exc:      # not a snapshot of ours: never loaded
                self.processor.state.failed(key, exc)
                continue
            if partition in partitions:
                self.processor.restore(key, blob)
                self._fed_before(key, touched, now)
                count += 1
        return count

    def _fed_before(self, key: bytes, touched: float, now: float) -> None:
        """A restored stage of ``key`` had input at ``touched`` (the writer's wall time):
        its job was fed from these partitions then, and hears what this worker reads for
        :attr:`vouch_for_s` since, as if this worker had fed it (a partition whose ranks
        went quiet before it moved here would otherwise pass for one nobody reads)."""
        at = min(touched, now)
        if now - at > self.vouch_for_s:
            return
        job = key_job(key)
        if at > self._fed.get(job, -math.inf):
            self._fed[job] = at
            self._heard_at.setdefault(job, now - TELL_EVERY_S)

    # -- gauges -------------------------------------------------------------------------------
    def lag(self) -> int:
        """Telemetry messages on this worker's partitions not yet applied."""
        from confluent_kafka import TopicPartition

        if self.consumer is None:
            return 0
        total = 0
        for p, pos in list(self.positions.items()):
            try:
                _, high = self.consumer.get_watermark_offsets(
                    TopicPartition(self.topics.telemetry, p), cached=True)
            except Exception:
                continue
            if high is not None and high >= 0:
                total += max(0, high - pos)
        return total

    def assigned(self) -> int:
        try:
            return len(self.consumer.assignment()) if self.consumer is not None else 0
        except Exception:
            return 0
