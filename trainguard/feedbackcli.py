"""``trainguard feedback INCIDENT --false-alarm | --confirmed [--job J]`` and ``trainguard
feedback --reset --job J``: people's verdicts on incidents, for the detectors to learn from.

The verdict is one signed ``feedback`` event (:class:`trainguard.events.Feedback`) on the
orders topic; the worker that runs the job's stage learns from it (docs/DETECTION.md,
"Learning from outcomes") and records what it learned on the actions topic, which
``trainguard config show --job J`` prints beside the job's overrides. Without ``--job`` the
incident's job (and kind) are read from the incidents on the anomalies topic.
"""
from __future__ import annotations

import json
import time
import uuid

from .config import ConfigError

__all__ = ["add_feedback_command", "cmd_feedback", "read_learned", "show_job"]


def add_feedback_command(sub, add_kafka_flags) -> None:
    p = sub.add_parser("feedback", help="an incident was a false alarm, or a real fault: the "
                                        "job's detectors learn from it")
    p.add_argument("incident", nargs="?", help="incident id (inc-...)")
    verdict = p.add_mutually_exclusive_group(required=True)
    verdict.add_argument("--false-alarm", action="store_true",
                         help="no fault: widen that detector's allowance for the job")
    verdict.add_argument("--confirmed", action="store_true",
                         help="a real fault: keep it as a labelled example")
    verdict.add_argument("--reset", action="store_true",
                         help="forget what the job learned from feedback (needs --job)")
    p.add_argument("--job", default=None, help="the incident's job (default: looked up)")
    from .events import ANOMALY_KINDS

    p.add_argument("--kind", default=None, choices=ANOMALY_KINDS,
                   help="the incident's kind, when the worker may no longer hold it")
    add_kafka_flags(p)
    p.set_defaults(func=cmd_feedback)


def cmd_feedback(args) -> int:
    from .kafka_args import config_from
    from .overridecli import _keys, _who

    config = config_from(args)
    verdict = "reset" if args.reset else "false_alarm" if args.false_alarm else "confirmed"
    if verdict == "reset" and not args.job:
        raise ConfigError("--reset needs --job JOB (whose lessons to forget)")
    if verdict != "reset" and not args.incident:
        raise ConfigError("give the incident id (as `trainguard feedback inc-... "
                          "--false-alarm`)")
    job, kind = args.job, args.kind
    if job is None:
        job, found_kind = find_incident(config, args.incident)
        kind = kind or found_kind
    keys = _keys(args)
    from . import events as ev
    from .signing import sign

    feedback = sign(ev.Feedback(job=job, ts=time.time(), feedback_id=uuid.uuid4().hex,
                                verdict=verdict, incident=args.incident, kind=kind,
                                by=_who()), keys)
    _publish(config, config.topics.orders, job, ev.encode(feedback))
    signed = "signed" if keys is not None else "unsigned (no signing key)"
    what = f"incident {args.incident}: {verdict.replace('_', ' ')}" if args.incident else \
        "reset: forget what was learned from feedback"
    print(f"job {job}: {what}; written to {config.topics.orders} ({signed}). The worker "
          f"records what it learned on {config.topics.actions}; see `trainguard config show "
          f"--job {job}`")
    return 0


def _publish(config, topic: str, job: str, value: bytes) -> None:
    from confluent_kafka import Producer

    producer = Producer(config.kafka(**{"linger.ms": 0, "acks": "all",
                                         "enable.idempotence": True}))
    errors = []
    producer.produce(topic, value, job.encode(),
                     on_delivery=lambda err, msg: errors.append(err) if err else None)
    if producer.flush(15) or errors:
        raise ConfigError(f"the feedback could not be written to {topic}: "
                          f"{errors[0].str() if errors else 'timed out'}")


def _scan(config, topic: str, keep, timeout_s: float = 15.0) -> None:
    """Every record of ``topic`` up to its end as of now, to ``keep(key, value)``."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

    from .overrides import topic_ends

    consumer = Consumer(config.kafka(**{"group.id": f"tg-feedback-cli-{uuid.uuid4().hex}",
                                        "enable.auto.commit": False}))
    try:
        try:
            meta = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
            if meta is None or meta.error or not meta.partitions:
                raise ConfigError(f"topic {topic} does not exist; create it with "
                                  "`trainguard topics create`")
            ends = topic_ends(consumer, topic, sorted(meta.partitions), timeout_s)
        except KafkaException as exc:
            raise ConfigError(f"cannot read {topic} at {config.bootstrap}: "
                              f"{exc.args[0].str()}") from None
        ends = {p: e for p, e in ends.items() if e > 0}
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        deadline = time.monotonic() + timeout_s
        while ends and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            keep(msg.key(), msg.value())
            if msg.offset() + 1 >= ends.get(msg.partition(), 0):
                ends.pop(msg.partition(), None)
    finally:
        consumer.close()


def find_incident(config, incident: str) -> tuple[str, str | None]:
    """``(job, kind)`` of an incident the workers published on the anomalies topic."""
    from . import events as ev

    found = {}

    def keep(key, value):
        if value is None or incident.encode() not in value:
            return
        try:
            event = ev.decode(value)
        except ev.InvalidEvent:
            return
        if isinstance(event, ev.Incident) and event.id == incident:
            found["job"], found["kind"] = event.job, event.kind

    _scan(config, config.topics.anomalies, keep)
    if not found:
        raise ConfigError(f"incident {incident} is not on {config.topics.anomalies}; give "
                          "--job JOB (and --kind KIND)")
    return found["job"], found["kind"]


def read_learned(config, job: str, keys, timeout_s: float = 15.0) -> dict | None:
    """The job's lessons as the worker last recorded them (signature checked), or None."""
    from . import events as ev
    from .signing import Verifier

    verifier = Verifier(keys)
    latest = {}

    def keep(key, value):
        if value is None or b'"feedback"' not in value or key != job.encode():
            return
        try:
            action = ev.decode(value)
        except ev.InvalidEvent:
            return
        if not isinstance(action, ev.Action) or (action.extra or {}).get("code") != "feedback":
            return
        if verifier.check_signature(value) is not None:
            return
        if action.ts >= latest.get("ts", float("-inf")):
            latest.update(ts=action.ts, learned=(action.targets or {}).get("learned"))

    _scan(config, config.topics.actions, keep, timeout_s)
    return latest.get("learned")


def show_job(args, config) -> int:
    """``trainguard config show --job J``: the job's per-job overrides and its lessons."""
    from .configsections import detector_config
    from .overridecli import _keys, read_current

    keys = _keys(args)
    current, _ = read_current(config, keys, base=detector_config(args.tree))
    overrides = current[args.job].values if args.job in current else {}
    learned = read_learned(config, args.job, keys)
    if args.json:
        print(json.dumps({"job": args.job, "overrides": overrides, "learned": learned},
                         indent=1))
        return 0
    print(f"job {args.job}:")
    print("  overrides:" + ("" if overrides else " none"))
    for path, value in sorted(overrides.items()):
        print(f"    {path} = {json.dumps(value)}")
    if not learned or not (learned.get("widened") or learned.get("false_alarms")
                           or learned.get("confirmed")):
        print("  learned from feedback: nothing")
        return 0
    print("  learned from feedback:")
    for name, v in sorted(learned.get("widened", {}).items()):
        print(f"    detectors.{name}: {json.dumps(v['was'])} -> {json.dumps(v['now'])}")
    limits = learned.get("limits", {})
    print(f"    false alarms: {len(learned.get('false_alarms', []))}, confirmed faults: "
          f"{len(learned.get('confirmed', []))} (kept at most {limits.get('examples')}; "
          f"each kind widens at most {limits.get('widenings_per_kind')} times)")
    for example in learned.get("confirmed", []):
        print(f"    confirmed: {example['incident']} ({example['kind']})")
    print(f"  forget it with `trainguard feedback --reset --job {args.job}`")
    return 0
