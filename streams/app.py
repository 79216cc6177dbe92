"""The Faust app of ``trainguard worker``: the job side, its table and timers.

Declared by :func:`make_app` (names depend on the prefix and id of the run):

- topic ``<app>-summaries`` (raw bytes, keyed by job): per-rank summaries, from
  :mod:`~trainguard.streams.rank_side`;
- agent ``jobs`` (``concurrency=1``): one ``JobStage`` per job, anomalies to
  ``<prefix>.anomalies`` as ``ev.encode(anomaly)`` keyed by job;
- table ``job-state`` (changelog ``<app>-job-state-changelog``, compacted): job slots as
  data-only snapshots (:mod:`~trainguard.streams.snapshots`, never pickled), co-partitioned
  with the summaries topic, so a job's state moves with its partition;
- timer (every ``advance_timer_s``): ``JobStage.advance`` for hang and silent (on each
  job's clock, :meth:`~trainguard.streams.snapshots.JobSlot.now`), the gauges of
  :mod:`~trainguard.streams.metrics` (served by ``trainguard worker`` itself on
  ``--metrics-port``, not by Faust, whose web server is off), and every
  ``job_snapshot_interval_s`` a checkpoint, run beside it (one at a time).

The agent reads with ``noack()``: an event is acknowledged only by the checkpoint after the
snapshot that covers it, and Faust's own periodic commit is off, so a committed summaries
offset never passes the job table; after a crash the replayed items that a restored job had
applied are skipped by its source marks. Anomalies are at-least-once: one found between a
snapshot and a crash is found and sent again after the restart, with the same id.
"""
from __future__ import annotations

import asyncio
import logging
import time

import faust

from trainguard import events as ev

from .logic import InvalidSummaries
from .processors import JobProcessor, state_partition
from .shorten import encode_finding
from .snapshots import StateError, snapshot_pause

__all__ = ["make_app", "JobRuntime"]

log = logging.getLogger(__name__)
NEVER = 10 ** 8   # seconds / acks: Faust's own commit timer and counter, switched off


class JobRuntime:
    """The job side's moving parts, shared by the agent, the timer and the page."""

    def __init__(self, *, settings, topics, processor: JobProcessor, metrics, clock=time.time,
                 collection=None):
        self.settings = settings
        self.collection = collection     # a gc_schedule.ScheduledCollection, or None
        self.topics = topics
        self.processor = processor
        self.metrics = metrics
        self.clock = clock
        self.app = None
        self.table = None
        self.anomalies = None
        self.rank_service = None
        self.config_feed = None          # per-job overrides (config_feed.ConfigFeed)
        self.false_alarms = None         # learning from false alarms (false_alarms.py)
        self.pending: list = []          # processed, not yet acknowledged events
        self.unconfirmed: list = []      # (future, key, value) of anomalies sent
        self.synced: set = set()         # summaries partitions loaded from the table
        self.next_snapshot = clock() + settings.job_snapshot_interval_s
        self.checkpointing = None        # the checkpoint under way beside the timer
        self.stopping = False            # the last checkpoint began: the timer starts none

    def assigned(self) -> set:
        try:
            return {tp.partition for tp in self.app.consumer.assignment()
                    if tp.topic == self.topics.summaries}
        except Exception:                # consumer not started yet
            return set()

    def sync(self, partitions: set) -> None:
        """Hand the table's recovered snapshots of newly owned partitions to the processor."""
        new = partitions - self.synced
        if not new:
            return
        live = self.processor.state.slots
        for key, blob in list(self.table.data.items()):
            if not blob or key in live:
                continue
            try:
                mine = state_partition(blob) in new
            except StateError as exc:      # not a snapshot of ours: never loaded
                self.table.data.pop(key, None)
                self.processor.state.failed(key, exc)
                continue
            if mine:
                self.processor.restore(key, blob)
        loaded = self.processor.load_saved(new, self.clock())
        self.synced |= new
        log.info("job side: partitions %s owned, %d job stages restored", sorted(new), loaded)

    def forget(self, partitions: set) -> None:
        self.processor.drop(partitions)
        self.synced -= partitions
        self.pending = [e for e in self.pending if e.message.partition not in partitions]

    def emit(self, anomalies) -> None:
        """Into the producer's buffer at once (no await): a snapshot that records an
        anomaly as sent is taken after it. Each is shortened to fit the broker's limit and
        counted once delivered; the checkpoint commits nothing while one is unconfirmed."""
        for event in anomalies:
            key, value = event.job.encode(), encode_finding(event)
            counter = "incidents_out" if event.TYPE == "incident" else "anomalies_out"
            self.unconfirmed.append((self.anomalies.send_soon(key=key, value=value),
                                     key, value, counter))

    def confirm(self) -> tuple[bool, int]:
        """After a flush: count the delivered anomalies, send the failed ones again;
        ``(every anomaly sent so far reached the topic, how many failed)``."""
        waiting, failed = [], 0
        for fut, key, value, counter in self.unconfirmed:
            if fut.done() and fut.exception() is None:
                self.metrics.inc(counter)
                continue
            if fut.done():
                failed += 1
                self.metrics.inc("anomalies_failed")
                log.warning("anomaly for job %r not delivered (%s); sending it again",
                            key[:100], fut.exception())
                fut = self.anomalies.send_soon(key=key, value=value)
            waiting.append((fut, key, value, counter))
        self.unconfirmed = waiting
        return not waiting, failed

    async def on_event(self, event) -> None:
        message = event.message
        self.metrics.inc("summaries_in")
        if message.partition not in self.synced:
            self.sync({message.partition})
        proc = self.processor
        before = (proc.applied, proc.replayed, proc.errors)
        cpu = time.thread_time()
        try:
            found = proc.apply(message.value, message.partition, self.clock())
        except InvalidSummaries as exc:
            self.metrics.inc("summaries_invalid")
            log.warning("skipped summaries message %s/%s: %s", message.partition,
                        message.offset, exc)
            found = []
        except Exception:                # a detector bug must not stop the worker
            log.exception("job stage failed on summaries message %s/%s", message.partition,
                          message.offset)
            found = []
        self.pending.append(event)
        m = self.metrics
        m.inc("job_side_cpu_seconds", time.thread_time() - cpu)
        m.inc("items_applied", proc.applied - before[0])
        m.inc("replayed", proc.replayed - before[1])
        m.inc("stage_errors", proc.errors - before[2])
        if found:
            self.emit(found)

    async def tick(self) -> None:
        if self.collection is not None and self.collection.maybe_collect():
            self.metrics.inc("gc_collections")
            self.metrics.counters["gc_seconds"] = round(self.collection.seconds, 6)
        if not self.app.tables.recovery.completed.is_set():
            try:
                self.refresh_gauges()      # the rank side's lag while the job side recovers
            except Exception:
                log.debug("gauges not refreshed during recovery", exc_info=True)
            return
        now = self.clock()
        self.sync(self.assigned())
        if self.config_feed is not None:
            try:
                self.config_feed.poll()
            except Exception:            # overrides must not stop detection
                log.exception("config topic: reading overrides failed")
        if self.false_alarms is not None:
            try:
                self.false_alarms.poll()
            except Exception:
                log.exception("actions topic: reading false alarms failed")
        cpu = time.thread_time()
        try:
            found = self.processor.advance(now)
        except Exception:
            log.exception("job stage failed in advance()")
            found = []
        self.metrics.inc("job_side_cpu_seconds", time.thread_time() - cpu)
        if found:
            self.emit(found)
        self.refresh_gauges()
        if now >= self.next_snapshot and not self.stopping and (
                self.checkpointing is None or self.checkpointing.done()):
            # beside the timer, not in it: its flush waits for a broker that stopped
            # answering as long as it does not answer (33 s measured, a broker's JVM
            # frozen), and hang and silent would wait with it
            self.checkpointing = asyncio.ensure_future(self._checkpoint_beside())

    async def _checkpoint_beside(self) -> None:
        try:
            await self.checkpoint()
        except asyncio.CancelledError:
            raise
        except Exception as exc:         # as inside the timer: the worker stops, and its
            self.metrics.inc("snapshot_failures")       # restart replays what was not
            log.exception("job side checkpoint failed")  # committed
            await self.app.crash(exc)

    async def checkpoint(self) -> None:
        """Confirm the anomalies sent so far, then snapshot, then commit. A snapshot records
        which anomalies a job sent, so it is taken only once they are all delivered: while
        one is not, nothing is snapshotted or committed (it is sent again), and a crash
        meanwhile replays the input that found it, which finds it again."""
        self.next_snapshot = self.clock() + self.settings.job_snapshot_interval_s
        delivered = False
        for _ in range(3):                 # anomalies found while flushing: flush again
            try:
                await self.app.producer.flush()
                for _ in range(3):         # let the delivery callbacks run
                    await asyncio.sleep(0)
            except Exception as exc:
                log.warning("job side flush failed: %s", exc)
                break
            delivered, failed = self.confirm()
            if delivered or failed:
                break
        if not delivered:
            self.metrics.inc("snapshot_failures")
            return
        now = self.clock()
        cpu = time.thread_time()
        for key, partition, blob in self.processor.evict(now) + self.processor.snapshot():
            if blob is None:
                self.table.data.pop(key, None)
            else:
                self.table.data[key] = blob
            self.table.send_changelog(partition, key, blob)
        cost = time.thread_time() - cpu
        s = self.settings
        self.next_snapshot = now + snapshot_pause(
            cost, s.job_snapshot_interval_s, cpu_share=s.snapshot_cpu_share,
            most_s=s.snapshot_max_interval_s)
        self.metrics.inc("snapshots")
        self.metrics.inc("snapshot_cpu_seconds", cost)
        acks, self.pending = self.pending, []
        for event in acks:
            event.ack()
        try:
            await self.app.consumer.commit()   # flushes the producer first
        except Exception as exc:
            self.metrics.inc("snapshot_failures")
            log.warning("job side commit failed: %s", exc)

    async def final_checkpoint(self) -> None:
        """Before a clean stop: snapshot and commit, so a restart replays nothing. The timer
        starts no other checkpoint from now on; one under way is waited for, and cancelled
        with this one when the stop's grace runs out."""
        self.stopping = True
        try:
            if self.checkpointing is not None and not self.checkpointing.done():
                await asyncio.shield(self.checkpointing)
            if self.app is not None and self.app.tables.recovery.completed.is_set():
                self.checkpointing = asyncio.ensure_future(self.checkpoint())
                await asyncio.shield(self.checkpointing)
        except asyncio.CancelledError:
            if self.checkpointing is not None:
                self.checkpointing.cancel()
            raise

    def refresh_gauges(self) -> None:
        m = self.metrics
        failures = self.processor.state.restore_failures
        evictions, evicted = self.processor.state.evictions, len(self.processor.state.saved)
        if self.rank_service is not None:
            rank_state = self.rank_service.processor.state
            failures += rank_state.restore_failures
            evictions += rank_state.evictions
            evicted += len(rank_state.saved)
            m.set_gauge("consumer_lag_messages", self.rank_service.lag(),
                        topic=self.topics.telemetry)
            m.set_gauge("assigned_partitions", self.rank_service.assigned(),
                        topic=self.topics.telemetry)
            m.set_gauge("rank_stages", len(self.rank_service.processor))
            m.set_gauge("unreadable_partitions", len(self.rank_service.leaders.current))
            m.counters["partitions_unreadable"] = self.rank_service.leaders.went_unreadable
        lag, parts = 0, 0
        try:
            consumer = self.app.consumer
            for tp in consumer.assignment():
                if tp.topic != self.topics.summaries:
                    continue
                parts += 1
                high, read = consumer.highwater(tp), consumer._read_offset[tp]
                if high is not None:
                    lag += max(0, high - (read + 1 if read is not None else 0))
        except Exception:
            pass
        m.set_gauge("consumer_lag_messages", lag, topic=self.topics.summaries)
        m.set_gauge("assigned_partitions", parts, topic=self.topics.summaries)
        m.set_gauge("job_stages", len(self.processor))
        m.set_gauge("late_step_records", sum(
            getattr(getattr(slot.stage, "steps", None), "late", 0)
            for slot in self.processor.state.slots.values()))
        m.set_gauge("held_records", sum(len(slot.held)
                                      for slot in self.processor.state.slots.values()))
        m.set_gauge("released_early_records", self.processor.released_early)
        m.set_gauge("superseded_records", self.processor.superseded)
        wall = self.clock()
        m.set_gauge("behind_partitions", sum(
            1 for at in self.processor.watch.behind.values()
            if wall - at <= self.processor.source_idle_s))
        m.set_gauge("unread_partitions", len(self.processor.unread_partitions(wall)))
        m.set_gauge("unseen_ranks", self.processor.watch.unseen_ranks())
        m.counters["restore_failures"] = failures
        m.counters["evictions"] = evictions
        m.set_gauge("evicted_stages", evicted)


def _idempotent_producer_class():
    """Faust's aiokafka producer with ``acks=all`` and ``enable_idempotence`` (Faust sets
    them only inside transactions): anomalies and the job-state changelog survive a broker's
    death, and the retries after a fail-over are not written twice."""
    from faust.transport.drivers.aiokafka import Producer

    class IdempotentProducer(Producer):
        def _settings_extra(self):
            return {**super()._settings_extra(), "acks": "all", "enable_idempotence": True}

    return IdempotentProducer


def make_app(*, settings, topics, runtime: JobRuntime, faust_broker: str, credentials=None,
             partitions: int) -> faust.App:
    """The Faust app; ``topics`` names telemetry, summaries, anomalies and deadletter."""
    app = faust.App(
        settings.app_id, broker=faust_broker, broker_credentials=credentials,
        store="memory://", datadir=settings.data_dir, autodiscover=False,
        web_enabled=False,              # /metrics: trainguard.metrics, see worker.main
        topic_disable_leader=True, topic_partitions=partitions,
        consumer_auto_offset_reset="earliest",
        broker_commit_every=NEVER, broker_commit_interval=NEVER,
        broker_session_timeout=settings.session_timeout_s,
        broker_heartbeat_interval=max(1.0, settings.session_timeout_s / 5),
        producer_max_request_size=16 * 1024 * 1024, table_standby_replicas=0,
        worker_redirect_stdouts=False, stream_wait_empty=False,
    )
    app.transport.Producer = _idempotent_producer_class()
    summaries = app.topic(topics.summaries, key_type=bytes, value_type=bytes,
                          key_serializer="raw", value_serializer="raw", partitions=partitions)
    runtime.anomalies = app.topic(topics.anomalies, key_type=bytes, value_type=bytes,
                                  key_serializer="raw", value_serializer="raw")
    runtime.table = app.Table("job-state", default=None, partitions=partitions,
                              key_type=bytes, value_type=bytes)
    runtime.app = app

    @app.agent(summaries, concurrency=1, name="jobs")
    async def jobs(stream):
        async for event in stream.noack().events():
            await runtime.on_event(event)

    @app.timer(settings.advance_timer_s, name="advance")
    async def advance():
        await runtime.tick()

    @app.on_partitions_revoked.connect
    async def on_revoked(sender, revoked, **kwargs):
        runtime.forget({tp.partition for tp in revoked if tp.topic == topics.summaries})

    return app
