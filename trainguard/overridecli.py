"""``trainguard config set|unset|overrides``: per-job overrides on the config topic.

``set --job J KEY=VALUE...`` checks each setting against the tree and
:func:`~trainguard.overrides.live_keys`, merges it into the job's current overrides (read back
from the topic, signature checked) and publishes the job's whole set, signed when a key is
configured; ``unset --job J [KEY...]`` removes some (or all) of them; ``overrides [--job J]``
lists what the topic holds. The running workers apply the change without a restart and
record it on the audit log (``<prefix>.actions``).
"""
from __future__ import annotations

import getpass
import json
import socket
import time
import uuid

from .config import ConfigError
from .overrides import (Accepted, check_keys, check_record, check_values, make_record,
                        parse_assignments, topic_ends)

__all__ = ["add_override_commands", "cmd_overrides"]


def add_override_commands(action, add_kafka_flags, add_config_flag) -> None:
    """The three sub-commands, under ``trainguard config``."""
    set_ = action.add_parser("set", help="change settings of one running job (per-job "
                                         "override, applied by the workers without a restart)")
    set_.add_argument("--job", required=True, help="job id")
    set_.add_argument("values", nargs="+", metavar="KEY=VALUE",
                      help="e.g. detectors.hang.checkpoint_s=3600")
    unset = action.add_parser("unset", help="remove per-job overrides (back to the file)")
    unset.add_argument("--job", required=True, help="job id")
    unset.add_argument("keys", nargs="*", metavar="KEY", help="settings (default: all)")
    listing = action.add_parser("overrides", help="list the per-job overrides in force")
    listing.add_argument("--job", default=None, help="only this job")
    listing.add_argument("--json", action="store_true", help="as JSON")
    for parser in (set_, unset, listing):
        add_config_flag(parser)
        add_kafka_flags(parser)


def _keys(args):
    from .signing import SigningKeys

    text = args.tree.value("security.signing_key") if "security.signing_key" in \
        args.tree.keys else None
    return SigningKeys.parse(text) if text else None


def read_current(config, keys, timeout_s: float = 15.0, base=None) -> tuple[dict, int]:
    """``({job: Accepted}, refused)``: the latest accepted record of each job on the topic,
    its values checked together with ``base`` (the DetectorsConfig in use, as the workers
    check them; None: the defaults)."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

    from .signing import Verifier

    topic = config.topics.config
    consumer = Consumer(config.kafka(**{"group.id": f"tg-config-cli-{uuid.uuid4().hex}",
                                        "enable.auto.commit": False}))
    try:
        try:
            meta = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
        except KafkaException as exc:
            raise ConfigError(f"cannot reach Kafka at {config.bootstrap}: "
                              f"{exc.args[0].str()}") from None
        if meta is None or meta.error or not meta.partitions:
            raise ConfigError(f"topic {topic} does not exist; create it with "
                              "`trainguard topics create`")
        try:
            ends = topic_ends(consumer, topic, sorted(meta.partitions), timeout_s)
        except KafkaException as exc:
            raise ConfigError(f"cannot read topic {topic}: {exc.args[0].str()}") from None
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
        verifier = Verifier(keys)
        current, refused = {}, 0
        deadline = time.monotonic() + timeout_s
        while ends and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            job = _job_of(msg.key())
            latest = current.get(job)
            result = check_record(msg.key(), msg.value(), verifier=verifier, base=base,
                                  latest_ts=latest.ts if latest is not None else None)
            if isinstance(result, Accepted):
                current[result.job] = result
            else:
                refused += 1
            if msg.offset() + 1 >= ends.get(msg.partition(), 0):
                ends.pop(msg.partition(), None)
        if ends:
            raise ConfigError(f"topic {topic} could not be read to its end in {timeout_s:.0f}s")
        return {j: a for j, a in current.items() if a.values}, refused
    finally:
        consumer.close()


def _job_of(key):
    try:
        return key.decode("utf-8") if key is not None else None
    except UnicodeDecodeError:
        return None


def _publish(config, job: str, values: dict, keys) -> dict:
    from confluent_kafka import Producer

    record = make_record(job=job, values=values, ts=time.time(),
                         override_id=uuid.uuid4().hex, by=_who(), keys=keys)
    producer = Producer(config.kafka(**{"linger.ms": 0, "acks": "all",
                                         "enable.idempotence": True}))
    errors = []
    producer.produce(config.topics.config, json.dumps(record).encode(), job.encode(),
                     on_delivery=lambda err, msg: errors.append(err) if err else None)
    if producer.flush(15) or errors:
        raise ConfigError(f"the override could not be written to {config.topics.config}: "
                          f"{errors[0].str() if errors else 'timed out'}")
    return record


def _who() -> str:
    try:
        user = getpass.getuser()
    except Exception:
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def cmd_overrides(args, config) -> int:
    from .configsections import detector_config

    keys = _keys(args)
    base = detector_config(args.tree)
    if args.config_action == "set":
        wanted = parse_assignments(args.values, base)
    elif args.config_action == "unset":
        removed = check_keys(args.keys)
    current, refused = read_current(config, keys, base=base)
    if args.config_action == "overrides":
        return _list(current, refused, args)
    job = args.job
    mine = dict(current[job].values) if job in current else {}
    if args.config_action == "set":
        values = check_values({**mine, **wanted}, base)
    else:
        values = {k: v for k, v in mine.items() if removed and k not in removed}
        if values == mine:
            print(f"job {job}: {', '.join(removed) if removed else 'nothing'} not overridden; "
                  "nothing written")
            return 0
    _publish(config, job, values, keys)
    signed = "signed" if keys is not None else "unsigned (no signing key)"
    if args.config_action == "set":
        for path, value in wanted.items():
            was = mine.get(path, _default(base, path))
            print(f"job {job}: {path} = {json.dumps(value)} (was {json.dumps(was)})")
    else:
        for path in (removed or list(mine)):
            if path in mine:
                print(f"job {job}: {path} back to the file's "
                      f"{json.dumps(_default(base, path))}")
    print(f"written to {config.topics.config} ({signed}); the workers apply it and record it "
          f"on {config.topics.actions}")
    return 0


def _default(base, path: str):
    """The file's value of ``detectors.<section>.<field>``: the path below ``detectors``."""
    value = base
    for part in path.split(".")[1:]:
        value = getattr(value, part)
    return value


def _list(current: dict, refused: int, args) -> int:
    jobs = {j: a for j, a in sorted(current.items()) if args.job in (None, j)}
    if args.json:
        print(json.dumps({j: {"values": a.values, "by": a.by, "ts": a.ts,
                              "override_id": a.override_id} for j, a in jobs.items()},
                         indent=1))
        return 0
    if not jobs:
        print("no per-job overrides" + (f" for job {args.job}" if args.job else ""))
    for job, accepted in jobs.items():
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(accepted.ts or 0))
        print(f"job {job} (set by {accepted.by or '?'} at {when} UTC):")
        for path, value in sorted(accepted.values.items()):
            print(f"  {path} = {json.dumps(value)}")
    if refused:
        print(f"({refused} records on the topic were refused: unsigned, forged or malformed)")
    return 0
