"""The worker's reader of ``<prefix>.config``: per-job overrides, applied without a restart.

Every worker reads every partition of the config topic (no consumer group: each needs every
job's overrides, whichever summaries partitions it owns), from the beginning at start
(:meth:`ConfigFeed.catch_up`, before any job stage is built) and then on the job side's timer
(:meth:`ConfigFeed.poll`, in the event loop, so no lock is needed around the job stages).

Each message goes through :func:`trainguard.overrides.check_record`: a refused one (unsigned
or forged with a signing key configured, malformed, out of range, replayed) is written to
``<prefix>.deadletter`` with the reason and never applied; an accepted one becomes the job's
overrides in the :class:`~trainguard.overrides.OverrideBook`, is applied in place to the job's
live stage (a stage evicted to a snapshot, or built later, gets it when it is loaded or
built: ``JobProcessor(tune_stage=...)``), and is recorded on ``<prefix>.actions`` (an
``action`` record with ``code: "config_override"``, old and new values, who and when).
"""
from __future__ import annotations

import logging
import time

from trainguard.deadletter import deadletter_record
from trainguard.overrides import (Accepted, OverrideBook, audit_action, check_record,
                                  topic_ends)

from .feed_client import FeedClient

__all__ = ["ConfigFeed"]

log = logging.getLogger(__name__)
MAX_PER_POLL = 500


class ConfigFeed(FeedClient):
    """See the module docstring. ``processor`` is the job side's ``JobProcessor``;
    ``verifier`` a :class:`~trainguard.signing.Verifier` (its keys None: unsigned records are
    accepted); ``keys`` sign the audit records."""

    GROUP = "tg-config"

    def __init__(self, *, book: OverrideBook, worker: str, keys=None, **kw):
        super().__init__(**kw)
        self.book = book
        self.worker = worker
        self.keys = keys
        self.applied = 0

    def start(self) -> None:
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        self.consumer = self._clients("earliest")
        topic = self.topics.config
        try:
            meta = self.consumer.list_topics(topic, timeout=30).topics.get(topic)
        except Exception as exc:
            from trainguard.errors import UserError

            raise UserError(f"cannot read the config topic {topic}: {exc}") from None
        partitions = sorted(meta.partitions) if meta is not None and not meta.error else []
        if not partitions:
            log.warning("config topic %s has no partitions: per-job overrides are off "
                        "(create it with `trainguard topics create`)", topic)
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        self._partitions = partitions

    def catch_up(self, timeout_s: float = 15.0) -> int:
        """Read the topic up to its end as of now (at start); returns the records read."""
        from confluent_kafka import KafkaException

        if self.consumer is None:
            return 0
        topic = self.topics.config
        try:
            ends = topic_ends(self.consumer, topic, self._partitions, timeout_s)
        except KafkaException as exc:     # the rest comes with poll()
            log.warning("config topic %s: its end is unknown (%s); overrides are applied as "
                        "they are read", topic, exc)
            return 0
        read = 0
        deadline = time.monotonic() + timeout_s
        while ends and time.monotonic() < deadline:
            msg = self.consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            read += 1
            self.handle(msg, at_start=True)
            if msg.offset() + 1 >= ends.get(msg.partition(), 0):
                ends.pop(msg.partition(), None)
        if ends:
            log.warning("config topic %s not read to its end in %.0fs; the rest is applied "
                        "as it comes", topic, timeout_s)
        self.producer.poll(0)
        return read

    def poll(self) -> int:
        """Apply what came since (without waiting); returns the records read."""
        if self.consumer is None:
            return 0
        msgs = self.consumer.consume(MAX_PER_POLL, timeout=0)
        for msg in msgs:
            if msg.error():
                continue
            self.handle(msg)
        self.producer.poll(0)
        return len(msgs)

    def handle(self, msg, at_start: bool = False) -> None:
        key, value = msg.key(), msg.value()
        now = self.clock()
        job = None
        try:
            job = key.decode("utf-8") if key is not None and len(key) <= 128 else None
        except UnicodeDecodeError:
            pass
        result = check_record(key, value, verifier=self.verifier, base=self.book.base,
                              latest_ts=self.book.latest_ts(job) if job else None, now=now)
        if isinstance(result, Accepted) and self.book.full(result.job):
            from trainguard.signing import Refusal

            result = Refusal("malformed", f"more than {self.book.max_jobs} jobs with "
                                          "overrides; this one is not kept")
        if not isinstance(result, Accepted):
            self.refused += 1
            self._count("config_overrides_refused")
            log.warning("config override at %s/%d refused: %s", msg.partition(),
                        msg.offset(), result)
            self._produce(self.topics.deadletter, key, deadletter_record(
                reason=f"config override refused: {result}", topic=self.topics.config,
                partition=msg.partition(), offset=msg.offset(), key=key, raw=value, ts=now))
            return
        self.apply(result, now, at_start)

    def apply(self, accepted: Accepted, now: float, at_start: bool = False) -> dict:
        """Make ``accepted`` the job's overrides and retune its live stage; the changes."""
        changes = self.book.set(accepted)
        live = 0
        slot = self.processor.state.slots.get(accepted.job.encode())
        if slot is not None:
            self.book.tune(accepted.job, slot.stage)
            self.processor.state.dirty.add(accepted.job.encode())
            live = 1
        self.applied += 1
        self._count("config_overrides_applied")
        log.info("config override for job %s applied (%d live stage): %s", accepted.job, live,
                 changes)
        if changes:
            from trainguard import events as ev
            from trainguard.signing import sign

            action = sign(audit_action(accepted=accepted, changes=changes, worker=self.worker,
                                       live_stages=live, now=now, at_start=at_start),
                          self.keys)
            self._produce(self.topics.actions, accepted.job.encode(), ev.encode(action))
        return changes
