"""``trainguard actions``: the action service (its Kafka ends: :mod:`~trainguard.actions.topic_io`).

It consumes ``<prefix>.anomalies`` (consumer group ``trainguard-actions.<prefix>``, offsets
committed up to the oldest anomaly still under way) and runs the anomalies through the
pipeline of :mod:`trainguard.actions.pipeline`, many at once, on the scheduler of
:mod:`trainguard.actions.scheduler`. The worker's ``incident`` events on the same topic go
to an :class:`~trainguard.actions.incidents.IncidentBook` as they are read (the pipeline
groups the anomalies by them, see :mod:`trainguard.actions.incidents`); other event types
are skipped. Around it:

- at start-up it reads back the last ``state_horizon_s`` of ``<prefix>.actions`` into the
  ledger (:class:`~trainguard.actions.state.ServiceState`), so that even with a lost state
  file it never repeats a restart it already ordered;
- a background thread watches ``<prefix>.telemetry`` for ``lifecycle``, ``step`` and
  ``heartbeat`` events (a byte-level filter skips everything else) to learn each job's world
  size, topology and machines, and whether a stalled job moved on
  (:class:`~trainguard.actions.confirm.JobProgress`, confirm before acting);
- stack captures send ``command`` events to ``<prefix>.commands`` and read
  ``<prefix>.stacks`` from where it ended when the service started;
- restarts, evictions and rollbacks go to ``trainguard run`` as ``order`` events on
  ``<prefix>.orders``; a background thread files their acks
  (:class:`~trainguard.actions.order_desk.OrderDesk`) and dead-letters what does not belong
  on that topic. With a signing key (``TRAINGUARD_SIGNING_KEY``), orders and commands are
  signed and acks checked (docs/SECURITY.md).

The policy file (``--policy``) is JSON: the policy keys of docs/POLICY.md, plus an optional
``"alerts"`` section with the alert sinks (docs/ALERTS.md).
"""
from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

from trainguard import events as ev
from trainguard.actions.capture import JobDirectory, StackCapture, StackGatherer
from trainguard.actions.confirm import JobProgress
from trainguard.actions.incidents import IncidentBook
from trainguard.actions.order_desk import OrderDesk
from trainguard.actions.pipeline import build_pipeline
from trainguard.actions.policy import BacklogSettings, Policy, PolicyError, load_policy
from trainguard.actions.scheduler import OffsetTracker, Scheduler
from trainguard.actions.state import ServiceState
from trainguard.actions.topic_io import (KafkaRecorder, KafkaSource, check_kafka, quiet_logger,
                                         read_back)
from trainguard.actions.topic_io import log as _log
from trainguard.logs import context as log_context
from trainguard.signing import Verifier, sign, signing_key_from_env, warn_if_unsigned

__all__ = ["main", "ActionService",
           "load_service_config", "default_state_path", "PRODUCER_SETTINGS"]

PRODUCER_SETTINGS = {"linger.ms": 5, "acks": "all", "enable.idempotence": True,
                     "partitioner": "murmur2_random", "message.timeout.ms": 30000}
LIFECYCLE_LOOKBACK_S = 600.0
STATE_SAVE_EVERY_S = 1.0  # the ledger file at most once a second (docs/POLICY.md, State file)


class _DirectoryWatcher(threading.Thread):
    """Feeds one topic's events to the job directory (and to ``also``: more observers),
    until ``stop``. Messages it cannot decode are skipped and counted (the stream worker
    dead-letters those of the telemetry topic); the count is logged at most once a
    minute."""

    def __init__(self, source: KafkaSource, directory: JobDirectory, stop: threading.Event,
                 also: tuple = ()):
        super().__init__(name=f"trainguard-watch-{source.topic}", daemon=True)
        self.source, self.directory, self.stop = source, directory, stop
        self.observers = (directory, *also)

    def run(self) -> None:
        told, next_tell = 0, time.monotonic() + 60.0
        while not self.stop.is_set():
            try:
                event = self.source.poll(0.5)
            except Exception as exc:  # keep the service up; the directory is best-effort
                _log(f"watching {self.source.topic}: {type(exc).__name__}: {exc}")
                time.sleep(1.0)
                continue
            if event is not None:
                for observer in self.observers:
                    observer.observe(event)
            if self.source.invalid != told and time.monotonic() >= next_tell:
                _log(f"watching {self.source.topic}: skipped {self.source.invalid - told} "
                     f"empty or invalid message(s) ({self.source.invalid} in all)")
                told, next_tell = self.source.invalid, time.monotonic() + 60.0
        self.source.close()


class _OrderWatcher(threading.Thread):
    """Hands every message of the orders topic to the order desk (acks are filed there),
    expires unanswered orders, and dead-letters what arrived since ``started`` and does not
    belong: undecodable messages, other event types, acks whose signature fails."""

    def __init__(self, source: KafkaSource, desk: OrderDesk, deadletter, stop: threading.Event,
                 started: float, expire_every_s: float = 1.0):
        super().__init__(name=f"trainguard-watch-{source.topic}", daemon=True)
        self.source, self.desk, self.deadletter, self.stop = source, desk, deadletter, stop
        self.started = started
        self.expire_every_s = expire_every_s

    def run(self) -> None:
        next_expiry = 0.0
        while not self.stop.is_set():
            try:
                if time.monotonic() >= next_expiry:
                    next_expiry = time.monotonic() + self.expire_every_s
                    self.desk.expire()
                self._one(self.source.consumer.poll(0.5))
            except Exception as exc:  # keep the service up
                _log(f"watching {self.source.topic}: {type(exc).__name__}: {exc}")
                time.sleep(1.0)
        self.source.close()

    def _one(self, msg) -> None:
        if msg is None or msg.error():
            return
        new = msg.timestamp()[1] / 1000.0 >= self.started  # not re-read history
        value = msg.value()
        try:
            event = ev.decode(value if value is not None else b"")
        except ev.InvalidEvent as exc:
            if new:
                self.deadletter(msg, f"invalid message on the orders topic: {exc}")
            return
        if isinstance(event, ev.Feedback):
            return      # people's verdicts, for the stream worker (streams/feedback_feed.py)
        if not isinstance(event, (ev.Order, ev.Ack)):
            if new:
                self.deadletter(msg, f"a {event.type} event does not belong on the orders topic")
            return
        outcome, refusal = self.desk.receive(event, value)
        if refusal is not None and new:
            self.deadletter(msg, f"ack of order {event.order_id[:80]} refused: {refusal}")


def outcome_of(work) -> tuple[str, str]:
    """``(outcome, counter)`` of an anomaly's :class:`~trainguard.actions.pipeline.Work`: the
    ``outcome`` label of the ``anomalies`` metric (``handled``, ``false_alarm``, ``dropped``,
    ``error``) and the name it is counted under in the service's log (``dropped_<code>``
    says which drop)."""
    if work.drop_code == "internal_error":
        return "error", "internal_errors"
    if work.dropped:
        return "dropped", f"dropped_{work.drop_code or 'other'}"
    if work.false_alarm:
        return "false_alarm", "false_alarms"
    return "handled", "handled"


class ActionService:
    """The consume loop around a pipeline; I/O objects are given, so tests can drive
    :meth:`handle` (one anomaly, blocking) or the :attr:`scheduler` directly. In
    :meth:`run_kafka`, anomalies go through the scheduler (:mod:`trainguard.actions.
    scheduler`): many at once, the most severe first, a bounded backlog; ``pump`` reads the
    stack replies that parked anomalies wait for. Every anomaly's outcome is told in one
    place, :meth:`_tell`: logged, counted in :attr:`counts` (which the scheduler's periodic
    backlog line shows) and, when :attr:`metrics` is set (an
    :class:`~trainguard.service_metrics.ActionMetrics`), counted there."""

    def __init__(self, *, pipeline, state: ServiceState, clock=time.time, log=_log,
                 settings: BacklogSettings = BacklogSettings(), pump=None,
                 before_commit=None, book=None):
        self.pipeline = pipeline
        self.book = book  # the worker's incidents (actions/incidents.py), fed from the topic
        self.state = state
        self.clock = clock
        self.log = log
        self.before_commit = before_commit  # () -> records still unsent (then no commit)
        self.offsets = OffsetTracker()
        self.scheduler = Scheduler(pipeline=pipeline, settings=settings, pump=pump,
                                   on_done=self._done, clock=clock, log=log)
        self.counts: Counter = self.scheduler.counts  # one set of counters, logged by it
        self.metrics = None

    def handle(self, anomaly: ev.Anomaly):
        work = self.pipeline.process(anomaly, now=self.clock())
        self._tell(work)
        return work

    def _tell(self, work) -> None:
        anomaly = work.anomaly
        outcome, counter = outcome_of(work)
        self.counts[counter] += 1
        if self.metrics is not None:
            self.metrics.outcome(outcome)
        incident = getattr(getattr(work, "incident", None), "id", None)
        with log_context(job=anomaly.job, anomaly=anomaly.id, incident=incident):
            if work.dropped:
                self.log(f"anomaly {anomaly.id} ({anomaly.kind}, {anomaly.severity}, job "
                         f"{anomaly.job}) dropped: {work.dropped}")
            else:
                done = ", ".join(f"{r.action} {r.status}" for r in work.records) or "nothing"
                self.log(f"anomaly {anomaly.id} ({anomaly.kind}, job {anomaly.job}) -> "
                         f"incident {incident}: {done}")

    def _done(self, token, work) -> None:
        self._tell(work)
        if token is not None:
            self.offsets.finished(*token)

    def run_kafka(self, config, stop: threading.Event, deadletter=None) -> None:
        from confluent_kafka import Consumer

        consumer = Consumer(config.kafka(**{
            "group.id": f"trainguard-actions.{config.topics.prefix}",
            "enable.auto.commit": False, "auto.offset.reset": "earliest"}),
            logger=quiet_logger())
        topic = config.topics.anomalies
        consumer.subscribe([topic])
        loop_stop = threading.Event()
        loop = threading.Thread(target=self.scheduler.run, args=(loop_stop,), daemon=True,
                                name="trainguard-actions-scheduler")
        loop.start()
        next_commit = 0.0
        try:
            while not stop.is_set():
                msg = consumer.poll(0.2)
                if time.monotonic() >= next_commit:
                    self._save_and_commit(consumer, topic)
                    next_commit = time.monotonic() + 0.5
                if msg is None:
                    continue
                if msg.error():
                    self.log(f"consumer: {msg.error().str()}")
                    continue
                token = (msg.partition(), msg.offset())
                self.offsets.started(*token)
                try:
                    event = ev.decode(msg.value()) if msg.value() else None
                    reason = None if event is not None else "empty message"
                except ev.InvalidEvent as exc:
                    event, reason = None, str(exc)
                if reason is not None:
                    self.counts["invalid"] += 1
                    if deadletter:
                        deadletter(msg, reason)
                if isinstance(event, ev.Anomaly):
                    if self.book is not None:
                        self.book.arrived(event.id, self.clock())
                    self.scheduler.submit(event, token)
                else:
                    if isinstance(event, ev.Incident) and self.book is not None:
                        self.book.observe(event, self.clock())
                        self.counts["incidents"] += 1
                    self.offsets.finished(*token)
        finally:
            loop_stop.set()
            loop.join(timeout=30)
            self._save_and_commit(consumer, topic)
            consumer.close()

    def _save_and_commit(self, consumer, topic: str) -> None:
        from confluent_kafka import KafkaException, TopicPartition

        with self.pipeline.lock:
            self.state.save_pending(self.clock())
        if self.before_commit is not None and self.before_commit():
            return  # records of finished anomalies are unsent: their offsets wait
        points = self.offsets.committable()
        if not points:
            return
        try:  # asynchronous: a synchronous commit waits for ever when the broker is gone
            consumer.commit(offsets=[TopicPartition(topic, p, o) for p, o in points.items()],
                            asynchronous=True)
        except KafkaException as exc:  # e.g. a rebalance took the partition away
            self.log(f"commit of {points}: {exc}")


def load_service_config(path: str | None, dry_run: bool = False
                        ) -> tuple[Policy, dict, dict]:
    """The policy, and the ``alerts`` and ``driver`` sections, of the policy file."""
    if not path:
        return load_policy(None, dry_run=dry_run), {}, {}
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise PolicyError(f"cannot read policy file {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise PolicyError(f"policy file {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PolicyError(f"policy file {path} must hold one JSON object")
    alerts = data.pop("alerts", None) or {}
    driver = data.pop("driver", None) or {}
    if not isinstance(driver, dict):
        raise PolicyError("driver must be an object such as {\"type\": \"slurm\"}")
    policy = Policy.from_dict(data)
    if dry_run:
        from dataclasses import replace

        policy = replace(policy, dry_run=True)
    return policy, alerts, driver


def default_state_path(config, environ=None) -> Path:
    from trainguard.broker import trainguard_home

    return trainguard_home(environ) / f"actions-state.{config.topics.prefix}.json"


def _deadletter_writer(producer, topic: str):
    """The stream worker's dead-letter record (``trainguard/deadletter.py``), written here too:
    ``{"reason", "topic", "partition", "offset", "key_b64", "raw_b64", "ts"}``."""
    def b64(data):
        return None if data is None else base64.b64encode(bytes(data)).decode("ascii")

    def write(msg, reason: str) -> None:
        record = {"reason": reason[:500], "topic": msg.topic(), "partition": msg.partition(),
                  "offset": msg.offset(), "key_b64": b64(msg.key()), "raw_b64": b64(msg.value()),
                  "ts": time.time()}
        producer.produce(topic, key=msg.key(), value=json.dumps(record).encode())
        producer.poll(0)
    return write


def build_driver_actions(section: dict) -> dict:
    """``Act``'s drivers from the policy file's ``driver`` section (none: the planned
    records are the orders, for ``trainguard run``)."""
    if not section:
        return {}
    from trainguard.actions.drivers import build_driver
    from trainguard.actions.pipeline import driver_actions

    settings = dict(section)
    job_refs = settings.pop("job_refs", None) or {}
    return driver_actions(build_driver(settings), job_refs)


def build_service(config, policy: Policy, state: ServiceState, *, sinks=(), stop=None,
                  log=_log, drivers=None, keys=None, earlier_actions=()):
    """Wire the Kafka ends to a pipeline; returns ``(service, deadletter, close)``. ``keys``
    sign orders and commands and check acks; ``earlier_actions`` (audit records read back)
    tell the order desk which orders an earlier run of the service sent."""
    from confluent_kafka import Producer

    producer = Producer(config.kafka(**PRODUCER_SETTINGS), logger=quiet_logger())
    topics = config.topics
    directory = JobDirectory(clock=time.time)
    stop = stop or threading.Event()
    started = time.time()
    since = started - LIFECYCLE_LOOKBACK_S
    deadletter = _deadletter_writer(producer, topics.deadletter)
    # records of finished anomalies are flushed before their offsets are committed
    audit = KafkaRecorder(producer, topics.actions, keys=keys, deferred=True)
    # an order goes out within linger.ms; its outcome is the ack (or no_ack), not a flush
    orders = KafkaRecorder(producer, topics.orders, deferred=True)
    desk = OrderDesk(send=orders.write, recorder=audit, directory=directory, keys=keys,
                     log=log)
    for action in earlier_actions:
        desk.seed(action)
    progress = JobProgress(clock=time.time)  # steps, heartbeats: is a stalled job stalled?
    watchers = [
        _DirectoryWatcher(KafkaSource(config, topics.telemetry, since=since,
                                      want=(b'"lifecycle"', b'"step"', b'"heartbeat"')),
                          directory, stop, also=(progress,)),
        # acks of orders; already_satisfied restarts are told to the directory from there
        _OrderWatcher(KafkaSource(config, topics.orders, since=since), desk, deadletter, stop,
                      started)]
    for watcher in watchers:
        watcher.start()
    stacks = KafkaSource(config, topics.stacks)
    commands = KafkaRecorder(producer, topics.commands)

    def send(command: ev.Command) -> None:
        # sent within linger.ms; a flush here would wait for the broker's acks
        commands.write(sign(command, keys))

    gatherer = StackGatherer(stacks)
    capturer = StackCapture(send=send, gatherer=gatherer, settings=policy.capture)
    notify = None
    if sinks:
        from trainguard.actions.alerts import send_all

        def notify(message):
            return send_all(sinks, message)

    from trainguard.detectors.correlate import Correlator

    # the worker's incidents; Correlator(): for anomalies without one
    book = IncidentBook(wait_s=policy.incidents.wait_s, expect_s=policy.incidents.expect_s)
    pipeline = build_pipeline(policy=policy, state=state, recorder=audit,
                              capturer=capturer, directory=directory, notify=notify,
                              drivers=drivers, correlator=Correlator(), log=log,
                              clock=time.time, orders=desk, progress=progress, book=book)
    service = ActionService(pipeline=pipeline, state=state, log=log, settings=policy.backlog,
                            pump=lambda timeout: gatherer.pump(timeout, max_events=500),
                            before_commit=audit.flush_now, book=book)

    def close() -> None:
        stop.set()
        for watcher in watchers:
            watcher.join(timeout=5)
        stacks.close()
        producer.flush(10)

    return service, deadletter, close


def main(args, config, keys=None) -> int:
    """``trainguard actions``: runs until SIGINT or SIGTERM. ``keys`` (default: from the
    environment, :func:`~trainguard.signing.signing_key_from_env`) sign orders and
    commands."""
    keys = keys if keys is not None else signing_key_from_env()
    policy, alerts, driver = getattr(args, "service_config", None) or load_service_config(
        getattr(args, "policy", None), dry_run=bool(getattr(args, "dry_run", False)))
    drivers = build_driver_actions(driver)
    sinks = []
    if alerts:
        from trainguard.actions.alerts import build_sinks

        sinks = build_sinks(alerts, os.environ)
    topics = config.topics
    check_kafka(config, [topics.anomalies, topics.actions, topics.commands, topics.stacks,
                          topics.telemetry, topics.orders])
    warn_if_unsigned(keys, "actions", f"orders on {topics.orders} and commands on "
                                      f"{topics.commands}")
    state_path = Path(args.state) if getattr(args, "state", None) else default_state_path(config)
    state = ServiceState.load(state_path, log=_log, save_every_s=STATE_SAVE_EVERY_S)
    ordered = []

    def absorb(action) -> None:
        if not isinstance(action, ev.Action):
            return  # something else written to the audit log: not ours
        state.absorb(action)
        if (action.extra or {}).get("order_id") and action.ts >= time.time() - \
                LIFECYCLE_LOOKBACK_S:
            ordered.append(action)

    unsigned = []

    def accept(raw) -> bool:  # with a key, only records signed with it rebuild the ledger
        refusal = Verifier(keys).check_signature(raw) if keys is not None else None
        if refusal is not None:
            unsigned.append(refusal.code)
        return refusal is None

    restored = read_back(config, topics.actions, time.time() - state.horizon_s, absorb,
                         accept=accept)
    if unsigned:
        _log(f"{len(unsigned)} record(s) of {topics.actions} not read back: not signed with "
             "this service's key")
    state.save(time.time())
    _log(f"policy {'(dry-run) ' if policy.dry_run else ''}{args.policy or 'defaults'}; "
         f"state {state_path} ({len(state.incidents)} incidents, {restored} action records "
         f"read back); {len(sinks)} alert sink(s); driver "
         f"{driver.get('type', 'trainguard run')}; consuming {topics.anomalies}")
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    service, deadletter, close = build_service(config, policy, state, sinks=sinks, stop=stop,
                                               drivers=drivers, keys=keys,
                                               earlier_actions=ordered)
    try:
        from trainguard.service_metrics import serve_action_metrics

        serve_action_metrics(service, args, log=_log)
        service.run_kafka(config, stop, deadletter=deadletter)
    finally:
        close()
        for s, handler in old.items():
            signal.signal(s, handler)
    _log("stopped")
    return 0
