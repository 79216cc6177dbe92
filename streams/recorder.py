"""``trainguard record`` and ``trainguard replay``: Kafka topics to a SPEC §3 recording and
back.

``record --out FILE [--job J] [--seconds S] [--from-beginning]`` reads the telemetry,
commands, stacks, anomalies, actions and orders topics (from now, or from the oldest retained
message) and writes every valid envelope, in the order received, as one line; with ``--job``
only that job's. Invalid messages are counted, not written (they are the dead-letter topic's
business). It stops after ``S`` seconds or on Ctrl-C / SIGTERM, and always closes the file.

``replay FILE [--speed X] [--job J] [--retime]`` produces every valid event back to the
topic of its type, keyed as the collectors key them, paced by the recorded ``ts`` divided by
``X`` (``0``: as fast as possible). ``--job`` rewrites the job id of every event; anomaly ids
and action incident ids are then derived anew from the new job (so consumers that
de-duplicate by id do not mistake the replay for the original). ``--retime`` shifts every
timestamp (``ts``, and ``phase_since``, ``onset_ts``, ``detected_ts``) so that the recording
starts now. Invalid lines are counted and reported, not fatal. Each message carries its
event's ``ts`` as its Kafka timestamp, so that the worker's event-time check
(:mod:`trainguard.eventtime`) takes an old recording for what it is.

>>> from trainguard.config import Topics
>>> e = ev.Heartbeat(job="j1", ts=100.0, node="n1", rank=3, pid=7, phase="data",
...                  phase_since=99.0)
>>> topic_for(e, Topics(prefix="tg")), message_key(e)
('tg.telemetry', b'j1/3')
>>> moved = rewrite(e, job="j2", shift=1000.0)
>>> moved.job, moved.ts, moved.phase_since
('j2', 1100.0, 1099.0)
"""
from __future__ import annotations

import hashlib
import signal
import sys
import time
import uuid

from trainguard import events as ev
from trainguard.config import Config, Topics
from trainguard.errors import UserError

__all__ = ["record_main", "replay_main", "topic_for", "message_key", "rewrite", "Pacer",
           "RecordFilter"]

TELEMETRY = frozenset(("step", "heartbeat", "gpu", "xid", "lifecycle"))
PRODUCER_SETTINGS = {"linger.ms": 5, "partitioner": "murmur2_random",
                     "compression.type": "lz4", "acks": "all", "enable.idempotence": True}


def recorded_topics(topics: Topics) -> list[str]:
    return [topics.telemetry, topics.commands, topics.stacks, topics.anomalies, topics.actions,
            topics.orders]


def topic_for(event: ev.Event, topics: Topics) -> str:
    kind = event.TYPE
    if kind in TELEMETRY:
        return topics.telemetry
    return {"command": topics.commands, "stack": topics.stacks, "anomaly": topics.anomalies,
            "incident": topics.anomalies, "action": topics.actions, "order": topics.orders, "ack": topics.orders,
            "feedback": topics.orders}[kind]


def message_key(event: ev.Event) -> bytes:
    """The collectors' keys: ``job/rank`` for rank events and stacks, ``job/node`` for a
    machine's gpu and xid events, ``job`` for the rest."""
    if event.TYPE in ("step", "heartbeat", "lifecycle", "stack") and event.rank is not None:
        return f"{event.job}/{event.rank}".encode()
    if event.TYPE in ("gpu", "xid") and event.node is not None:
        return f"{event.job}/{event.node}".encode()
    return event.job.encode()


def _derived_id(old: str, job: str) -> str:
    return hashlib.sha1(f"{job}|{old}".encode()).hexdigest()[:16]


def rewrite(event: ev.Event, job: str | None = None, shift: float = 0.0) -> ev.Event:
    """The event with a new job id and/or every timestamp moved by ``shift`` seconds."""
    changes = {}
    if job is not None and job != event.job:
        changes["job"] = job
        if event.TYPE == "anomaly":
            changes["id"] = _derived_id(event.id, job)
        elif event.TYPE == "action":
            changes["incident"] = _derived_id(event.incident, job)
    if shift:
        changes["ts"] = event.ts + shift
        for name in ("phase_since", "onset_ts", "detected_ts"):
            value = getattr(event, name, None)
            if value is not None:
                changes[name] = value + shift
    return event.replace(**changes) if changes else event


class Pacer:
    """When to send each event: recorded time since the first event divided by ``speed``.

    >>> clock = iter([0.0, 0.0, 0.5, 3.0]).__next__     # the sleeps do not move this clock
    >>> slept = []
    >>> pacer = Pacer(speed=2.0, clock=clock, sleep=slept.append)
    >>> for ts in (100.0, 101.0, 104.0, 105.0):
    ...     pacer.wait(ts)
    >>> slept                                              # due at 0.5, 2.0 and 2.5
    [0.5, 1.5]
    """

    def __init__(self, speed: float, clock=time.monotonic, sleep=time.sleep):
        if speed < 0:
            raise UserError(f"--speed {speed} must be 0 (as fast as possible) or positive")
        self.speed = speed
        self.clock = clock
        self.sleep = sleep
        self._first_ts = None
        self._start = None

    def wait(self, ts: float) -> None:
        if not self.speed:
            return
        if self._first_ts is None:
            self._first_ts, self._start = ts, self.clock()
            return
        due = self._start + (ts - self._first_ts) / self.speed
        delay = due - self.clock()
        if delay > 0:
            self.sleep(delay)


class RecordFilter:
    """What ``record`` keeps: valid envelopes (of one job, if given), each as one line.

    >>> f = RecordFilter(job="j1")
    >>> f.line(b'{"v":1,"type":"xid","job":"j1","ts":5,"xid":79,"source":"kmsg",'
    ...        b'"message":"m"}') is not None
    True
    >>> f.line(b"nope"), f.line(b'{"v":1,"type":"xid","job":"j2","ts":5,"xid":79,'
    ...                          b'"source":"kmsg","message":"m"}'), f.invalid, f.other_jobs
    (None, None, 1, 1)
    """

    def __init__(self, job: str | None = None):
        self.job = job
        self.kept = 0
        self.invalid = 0
        self.other_jobs = 0

    def line(self, raw) -> bytes | None:
        if raw is None:
            self.invalid += 1
            return None
        try:
            event = ev.decode(raw)
        except ev.InvalidEvent:
            self.invalid += 1
            return None
        if self.job is not None and event.job != self.job:
            self.other_jobs += 1
            return None
        self.kept += 1
        raw = bytes(raw)
        return raw if b"\n" not in raw and b"\r" not in raw else ev.encode(event)


class _Stop:
    """SIGTERM (and SIGINT) set a flag instead of killing the loop mid-write."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for s in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[s] = signal.signal(s, self._handle)
            except ValueError:             # not the main thread (tests): no handlers
                pass
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def record_main(args, config: Config) -> int:
    from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, TopicPartition

    from trainguard.progress import counting, wanted
    from trainguard.recording import RecordingWriter
    from trainguard.topics import create_topics

    if args.seconds is not None and args.seconds <= 0:
        raise UserError(f"--seconds {args.seconds} must be positive")
    writer = RecordingWriter(args.out)
    keep = RecordFilter(job=args.job)
    create_topics(config)
    consumer = Consumer(config.kafka(**{"group.id": f"trainguard-record-{uuid.uuid4().hex}",
                                        "enable.auto.commit": False}))
    start = OFFSET_BEGINNING if args.from_beginning else OFFSET_END
    names = recorded_topics(config.topics)
    began = time.monotonic()
    try:
        meta = consumer.list_topics(timeout=30).topics
        consumer.assign([TopicPartition(t, p, start) for t in names for p in meta[t].partitions])
        deadline = None if args.seconds is None else began + args.seconds
        with _Stop() as stop, counting("record", wanted(), args.seconds) as show:
            while not stop.requested and (deadline is None or time.monotonic() < deadline):
                wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
                for message in consumer.consume(1000, wait):
                    if message.error():
                        continue
                    line = keep.line(message.value())
                    if line is not None:
                        writer.write_raw(line)
                if show is not None:
                    show(keep.kept, f"{keep.invalid} invalid")
    except KeyboardInterrupt:
        pass
    finally:
        writer.close()
        consumer.close()
    print(f"trainguard record: {keep.kept} events to {args.out} in "
          f"{time.monotonic() - began:.1f}s ({keep.invalid} invalid messages skipped"
          + (f", {keep.other_jobs} of other jobs" if args.job else "") + ")",
          file=sys.stderr)
    return 0


def replay_main(args, config: Config) -> int:
    from confluent_kafka import Producer

    from trainguard.progress import reading, wanted
    from trainguard.recording import ReadStats, read_events
    from trainguard.topics import create_topics

    pacer = Pacer(args.speed)
    _check_job(args.job)
    stats = ReadStats()
    create_topics(config)      # and a clear error now if Kafka cannot be reached
    producer = Producer(config.kafka(**PRODUCER_SETTINGS))
    sent, shift, began = 0, None, time.monotonic()
    failed = []

    def delivered(err, msg):
        if err is not None:
            failed.append(err)

    interrupted = False
    try:
        with _Stop() as stop, reading(args.file, "replay", enabled=wanted()) as on_read:
            events = read_events(args.file, stats, on_read)
            for event in events:
                if stop.requested:
                    interrupted = True
                    break
                if shift is None:
                    shift = (time.time() - event.ts) if args.retime else 0.0
                pacer.wait(event.ts)
                out = rewrite(event, job=args.job, shift=shift)
                value = ev.encode(out)
                while True:
                    try:
                        # stamped with the event's own time, as a collector sends it: the
                        # worker refuses events far from their message's timestamp
                        producer.produce(topic_for(out, config.topics), value, message_key(out),
                                         on_delivery=delivered, timestamp=int(out.ts * 1000))
                        break
                    except BufferError:
                        producer.poll(0.05)
                producer.poll(0)
                sent += 1
    except KeyboardInterrupt:
        interrupted = True
    finally:
        left = producer.flush(30)
    elapsed = time.monotonic() - began
    print(f"trainguard replay: {sent} events from {args.file} to {config.topics.prefix}.* in "
          f"{elapsed:.1f}s; {stats.invalid} invalid lines skipped"
          + (f" ({', '.join(f'{k}: {n}' for k, n in sorted(stats.reasons.items()))})"
             if stats.invalid else "")
          + (f"; {left + len(failed)} not delivered" if left or failed else "")
          + ("; interrupted" if interrupted else ""), file=sys.stderr)
    if left or failed:
        return 1
    return 130 if interrupted else 0


def _check_job(job: str | None) -> None:
    if job is None:
        return
    try:
        ev.ENVELOPE["job"].check(job, "--job")
    except ev.InvalidEvent:
        raise UserError(f"--job {job!r} must be 1-128 of [A-Za-z0-9._-]") from None
