"""The SPEC §1 events as typed classes, with ``encode`` and ``decode``.

Every Kafka message value and every recording line is one JSON object, the envelope
(``v``, ``type``, ``job``, ``ts``, ``node``, ``rank``) plus the fields of its type.
``decode`` validates it fully and raises :class:`InvalidEvent`, and nothing else,
whatever the bytes; unknown extra fields are kept in ``extra`` and written back.

>>> ev = Step(job="j1", ts=1764680000.0, node="n1", rank=3, step=7, step_time=0.5,
...           loss=float("nan"))
>>> raw = encode(ev)
>>> b'"loss":"NaN"' in raw
True
>>> back = decode(raw)
>>> back.type, back.rank, back.step, math.isnan(back.loss)
('step', 3, 7, True)
>>> decode(b'{"v":1,"type":"step","job":"bad job!","ts":1}')
Traceback (most recent call last):
...
trainguard.fields.InvalidEvent: job: 'bad job!' does not match [A-Za-z0-9._-]{1,128}
"""
from __future__ import annotations

import dataclasses
import json
import math

import orjson
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .fastpath import compile_all
from .fields import (AnyObject, Bool, Int, InvalidEvent, ListOf, Nullable, Num, Object, OneOf,
                     Str)

__all__ = [
    "VERSION", "InvalidEvent", "Event", "Step", "Heartbeat", "Gpu", "Xid", "Lifecycle",
    "Command", "Stack", "Anomaly", "Action", "Order", "Ack", "Incident", "Feedback", "VERDICTS", "EVENT_TYPES", "ANOMALY_KINDS",
    "allow_anomaly_kinds",
    "SEVERITIES", "ACTIONS", "ACTION_STATUSES", "ORDER_OPS", "ACK_STATUSES", "encode", "decode",
    "from_dict", "to_dict", "json_schema",
]

VERSION = 1
JOB_PATTERN = r"[A-Za-z0-9._-]{1,128}"
#: The contract's anomaly kinds (SPEC §1 and docs/CONTRACT.md), those of the built-in detectors'
#: registrations (detectors/registry.py; tests/test_detector_registry.py holds them equal).
ANOMALY_KINDS = ("nan", "loss_spike", "grad_spike", "straggler", "throughput_drop", "hang",
                 "gpu_fault", "gpu_degraded", "crash", "silent", "data_position",
                 "machine_outlier")
SEVERITIES = ("info", "warning", "critical")
ACTIONS = ("alert", "capture_stacks", "restart", "evict", "rollback", "none")
ACTION_STATUSES = ("planned", "done", "failed", "dry_run", "rate_limited", "not_applicable")
ORDER_OPS = ("restart", "evict", "rollback", "stop")
ACK_STATUSES = ("done", "failed", "already_satisfied", "not_applicable", "rejected")
#: the optional signature fields of orders, acks and commands (trainguard/signing.py)
SIGNATURE = {"key_id": Str(pattern=r"[0-9a-f]{8}"), "sig": Str(pattern=r"[0-9a-f]{64}")}
ORDER_ID = Str(min_length=1, max_length=128)

ENVELOPE = {
    "job": Str(pattern=JOB_PATTERN),
    "ts": Num(minimum=0),
}
ENVELOPE_NULLABLE = {
    "node": Nullable(Str(min_length=1, max_length=255)),
    "rank": Nullable(Int(minimum=0)),
}
RANKS = ListOf(Int(minimum=0))
FRAME = Object({"function": Str(), "file": Str()}, {"line": Nullable(Int())})
THREAD = Object({"frames": ListOf(FRAME)},
                {"name": Nullable(Str()), "id": Nullable(Int()), "active": Nullable(Bool())})
GPU_ENTRY = Object(
    {"index": Int(minimum=0), "uuid": Str()},
    {"util": Num(minimum=0), "mem_used": Int(minimum=0), "mem_total": Int(minimum=0),
     "temp": Num(), "power": Num(minimum=0), "sm_clock": Int(minimum=0),
     "throttle": ListOf(Str()), "ecc_sbe": Int(minimum=0), "ecc_dbe": Int(minimum=0),
     "remapped_pending": Bool(), "remapped_failure": Bool(), "pcie_replay": Int(minimum=0),
     "nvlink_errors": Int(minimum=0), "lost": Bool(),
     "mem_clock": Int(minimum=0), "power_limit": Num(minimum=0),
     "pcie_tx_kbs": Num(minimum=0), "pcie_rx_kbs": Num(minimum=0)},
)
#: a gpu event's optional ``host`` object: the machine's CPU and network counters
HOST = Object({}, {"cpu_util": Num(minimum=0), "net_rx_bytes": Int(minimum=0),
                   "net_tx_bytes": Int(minimum=0), "tcp_retrans": Int(minimum=0),
                   "tcp_out_segs": Int(minimum=0)})
TOPOLOGY = Object({"tp": Int(minimum=1), "pp": Int(minimum=1), "dp": Int(minimum=1)},
                  {"layout": Str()})


@dataclass(kw_only=True)
class Event:
    """The envelope. Subclasses add their type's fields; ``extra`` keeps unknown ones."""

    TYPE: ClassVar[str] = ""
    REQUIRED: ClassVar[dict] = {}
    OPTIONAL: ClassVar[dict] = {}

    job: str
    ts: float
    node: str | None = None
    rank: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def type(self) -> str:
        return self.TYPE

    def to_dict(self) -> dict:
        return to_dict(self)

    def replace(self, **changes) -> "Event":
        return dataclasses.replace(self, **changes)


@dataclass(kw_only=True)
class Step(Event):
    """One per rank per training step, after the step ends."""

    TYPE: ClassVar[str] = "step"
    REQUIRED: ClassVar[dict] = {"step": Int(minimum=0), "step_time": Num(minimum=0)}
    OPTIONAL: ClassVar[dict] = {
        "compute_time": Nullable(Num(minimum=0)), "loss": Nullable(Num(finite=False)),
        "grad_norm": Nullable(Num(finite=False)), "loss_scale": Nullable(Num(finite=False)),
        "tokens": Nullable(Int(minimum=0)), "lr": Nullable(Num(finite=False)),
    }
    step: int
    step_time: float
    compute_time: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    loss_scale: float | None = None
    tokens: int | None = None
    lr: float | None = None


@dataclass(kw_only=True)
class Heartbeat(Event):
    """About every second from each rank's collector thread, also while the loop is stuck."""

    TYPE: ClassVar[str] = "heartbeat"
    REQUIRED: ClassVar[dict] = {
        "pid": Int(minimum=0), "phase": Str(min_length=1, max_length=64),
        "phase_since": Num(minimum=0), "dropped": Int(minimum=0),
    }
    OPTIONAL: ClassVar[dict] = {"step": Nullable(Int(minimum=0))}
    pid: int
    phase: str
    phase_since: float
    dropped: int = 0
    step: int | None = None


@dataclass(kw_only=True)
class Gpu(Event):
    """A machine's GPU sample; ``status="unavailable"`` with a ``reason`` where NVML is missing.

    ``lost`` (optional, per GPU) is a trainguard extension: the device answered
    ``GPU is lost``; the entry then carries only ``index``, ``uuid`` and ``lost``. So are
    ``mem_clock`` (MHz), ``power_limit`` (W), ``pcie_tx_kbs``/``pcie_rx_kbs`` (KB/s) per
    GPU, and ``host`` (the machine's ``cpu_util`` percent and cumulative ``net_rx_bytes``,
    ``net_tx_bytes``, ``tcp_retrans``, ``tcp_out_segs``), for machine_outlier.
    """

    TYPE: ClassVar[str] = "gpu"
    REQUIRED: ClassVar[dict] = {"gpus": ListOf(GPU_ENTRY)}
    OPTIONAL: ClassVar[dict] = {"status": Nullable(Str()), "reason": Nullable(Str()),
                                "host": Nullable(HOST)}
    gpus: list
    status: str | None = None
    reason: str | None = None
    host: dict | None = None


@dataclass(kw_only=True)
class Xid(Event):
    """An Xid error, from NVML's event set or the kernel log."""

    TYPE: ClassVar[str] = "xid"
    REQUIRED: ClassVar[dict] = {"xid": Int(minimum=0), "source": Str(enum=("nvml", "kmsg")),
                                "message": Str()}
    OPTIONAL: ClassVar[dict] = {"gpu": Nullable(Int(minimum=0))}
    xid: int
    source: str
    message: str
    gpu: int | None = None


@dataclass(kw_only=True)
class Lifecycle(Event):
    """``event="start"`` (pid, world_size required) or ``event="exit"``."""

    TYPE: ClassVar[str] = "lifecycle"
    REQUIRED: ClassVar[dict] = {"event": Str(enum=("start", "exit"))}
    OPTIONAL: ClassVar[dict] = {
        "pid": Int(minimum=0), "world_size": Int(minimum=1),
        "local_rank": Nullable(Int(minimum=0)), "topology": Nullable(TOPOLOGY),
        "argv": Nullable(ListOf(Str())), "exit_code": Nullable(Int()),
        "signal": Nullable(Str()),
    }
    START_REQUIRED: ClassVar[tuple] = ("pid", "world_size")
    event: str
    pid: int | None = None
    world_size: int | None = None
    local_rank: int | None = None
    topology: dict | None = None
    argv: list | None = None
    exit_code: int | None = None
    signal: str | None = None


@dataclass(kw_only=True)
class Command(Event):
    """Action service to node agents. Only this enumerated form is ever obeyed.

    ``native`` (optional bool) is a trainguard extension: ask py-spy for native frames.
    """

    TYPE: ClassVar[str] = "command"
    REQUIRED: ClassVar[dict] = {
        "command": Str(enum=("capture_stacks",)), "capture_id": Str(min_length=1, max_length=128),
        "ranks": OneOf(RANKS, Str(enum=("all",))),
    }
    OPTIONAL: ClassVar[dict] = {"native": Bool(), **SIGNATURE}
    command: str
    capture_id: str
    ranks: Any = "all"
    native: bool | None = None
    key_id: str | None = None
    sig: str | None = None


@dataclass(kw_only=True)
class Stack(Event):
    """Reply to ``capture_stacks``, one per rank process; frames innermost first."""

    TYPE: ClassVar[str] = "stack"
    REQUIRED: ClassVar[dict] = {"capture_id": Str(), "pid": Int(minimum=0),
                                "method": Str(enum=("py-spy", "inproc")),
                                "threads": ListOf(THREAD)}
    OPTIONAL: ClassVar[dict] = {"error": Nullable(Str())}
    capture_id: str
    pid: int
    method: str
    threads: list
    error: str | None = None


@dataclass(kw_only=True)
class Anomaly(Event):
    """A stream processor's finding."""

    TYPE: ClassVar[str] = "anomaly"
    REQUIRED: ClassVar[dict] = {
        "id": Str(min_length=1), "kind": Str(enum=ANOMALY_KINDS),
        "severity": Str(enum=SEVERITIES), "ranks": RANKS, "nodes": ListOf(Str()),
        "onset_ts": Num(minimum=0), "detected_ts": Num(minimum=0), "detector": Str(),
        "summary": Str(),
    }
    OPTIONAL: ClassVar[dict] = {"step": Nullable(Int(minimum=0)), "evidence": AnyObject()}
    id: str
    kind: str
    severity: str
    ranks: list
    nodes: list
    onset_ts: float
    detected_ts: float
    detector: str
    summary: str
    step: int | None = None
    evidence: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class Action(Event):
    """The action service's audit record, also for what it decided not to do."""

    TYPE: ClassVar[str] = "action"
    REQUIRED: ClassVar[dict] = {"incident": Str(), "action": Str(enum=ACTIONS),
                                "targets": AnyObject(), "status": Str(enum=ACTION_STATUSES),
                                "reason": Str()}
    incident: str
    action: str
    targets: dict
    status: str
    reason: str


@dataclass(kw_only=True)
class Order(Event):
    """SPEC §6: an order of the action service to ``trainguard run`` or a driver, on
    ``<prefix>.orders``. ``targets`` is checked by the receiver before use
    (``trainguard.actions.orders.check_targets``).

    ``incident`` (optional) names the incident the order deals with; ``key_id`` and ``sig``
    (optional) are the HMAC signature of ``trainguard/signing.py``.
    """

    TYPE: ClassVar[str] = "order"
    REQUIRED: ClassVar[dict] = {"order_id": ORDER_ID, "op": Str(enum=ORDER_OPS),
                                "targets": AnyObject()}
    OPTIONAL: ClassVar[dict] = {"incident": Str(min_length=1, max_length=512), **SIGNATURE}
    order_id: str
    op: str
    targets: dict
    incident: str | None = None
    key_id: str | None = None
    sig: str | None = None


@dataclass(kw_only=True)
class Ack(Event):
    """SPEC §6: the answer to one order, on the same topic. ``reason`` is for humans only;
    a program decides on ``status`` and, where given, ``code`` (an enumerated word such as
    ``budget_exhausted`` or ``bad_signature``, see docs/CONTRACT.md).

    ``op`` and ``incident`` (optional) repeat the order's; ``key_id``/``sig`` as on orders.
    """

    TYPE: ClassVar[str] = "ack"
    REQUIRED: ClassVar[dict] = {"order_id": ORDER_ID, "status": Str(enum=ACK_STATUSES),
                                "reason": Str()}
    OPTIONAL: ClassVar[dict] = {"code": Nullable(Str(pattern=r"[a-z_]{1,64}")),
                                "op": Str(enum=ORDER_OPS),
                                "incident": Str(min_length=1, max_length=512), **SIGNATURE}
    order_id: str
    status: str
    reason: str
    code: str | None = None
    op: str | None = None
    incident: str | None = None
    key_id: str | None = None
    sig: str | None = None


#: an incident event lists at most this many of its anomalies' ids (the first ones)
MAX_INCIDENT_ANOMALIES = 1000


@dataclass(kw_only=True)
class Incident(Event):
    """SPEC §6: an incident the stream worker correlated, on ``<prefix>.anomalies`` beside
    the anomalies, with the fields of an ``analyze --json`` incident. It is published again,
    same ``id``, each time it gains an anomaly; the latest one holds. ``anomalies`` lists at
    most :data:`MAX_INCIDENT_ANOMALIES` ids; ``anomaly_count`` (optional) counts them all.
    """

    TYPE: ClassVar[str] = "incident"
    REQUIRED: ClassVar[dict] = {
        "id": Str(min_length=1, max_length=512), "kind": Str(enum=ANOMALY_KINDS),
        "severity": Str(enum=SEVERITIES), "ranks": RANKS, "nodes": ListOf(Str()),
        "onset_ts": Num(minimum=0), "detected_ts": Num(minimum=0), "summary": Str(),
        "anomalies": ListOf(Str(min_length=1, max_length=512),
                            max_items=MAX_INCIDENT_ANOMALIES),
    }
    OPTIONAL: ClassVar[dict] = {"step": Nullable(Int(minimum=0)),
                                "anomaly_count": Int(minimum=0)}
    id: str
    kind: str
    severity: str
    ranks: list
    nodes: list
    onset_ts: float
    detected_ts: float
    summary: str
    anomalies: list
    step: int | None = None
    anomaly_count: int | None = None

    @classmethod
    def of(cls, incident: dict) -> "Incident":
        """The event of one ``analyze --json`` incident dict (``job`` and the SPEC keys)."""
        ids = list(incident["anomalies"])
        return cls(job=incident["job"], ts=incident["detected_ts"], id=incident["id"],
                   kind=incident["kind"], severity=incident["severity"],
                   ranks=list(incident["ranks"]), nodes=list(incident["nodes"]),
                   onset_ts=incident["onset_ts"], detected_ts=incident["detected_ts"],
                   summary=incident["summary"], anomalies=ids[:MAX_INCIDENT_ANOMALIES],
                   step=incident.get("step"), anomaly_count=len(ids))


#: a feedback's verdicts: the incident was no fault, was one, or forget what was learned
VERDICTS = ("false_alarm", "confirmed", "reset")


@dataclass(kw_only=True)
class Feedback(Event):
    """A trainguard extension (SPEC §6: a new type; docs/CONTRACT.md): a human's verdict on
    an incident, from ``trainguard feedback``, on ``<prefix>.orders``, signed as orders are.
    The stream worker that runs the job's stage learns from it (docs/DETECTION.md); a
    ``reset`` (``incident`` null) forgets what the job learned so."""

    TYPE: ClassVar[str] = "feedback"
    REQUIRED: ClassVar[dict] = {"feedback_id": ORDER_ID, "verdict": Str(enum=VERDICTS)}
    OPTIONAL: ClassVar[dict] = {"incident": Nullable(Str(min_length=1, max_length=512)),
                                "kind": Nullable(Str(enum=ANOMALY_KINDS)),
                                "by": Nullable(Str(max_length=256)), **SIGNATURE}
    feedback_id: str
    verdict: str
    incident: str | None = None
    kind: str | None = None
    by: str | None = None
    key_id: str | None = None
    sig: str | None = None


EVENT_TYPES: dict[str, type[Event]] = {
    cls.TYPE: cls for cls in (Step, Heartbeat, Gpu, Xid, Lifecycle, Command, Stack, Anomaly,
                              Action, Order, Ack, Incident, Feedback)
}
_ENVELOPE_KEYS = frozenset(("v", "type", *ENVELOPE, *ENVELOPE_NULLABLE))
_DECLARED = {name: frozenset((*cls.REQUIRED, *cls.OPTIONAL)) for name, cls in EVENT_TYPES.items()}
_ENVELOPE_CHECKS = tuple((n, c.check) for n, c in ENVELOPE.items())
_NULLABLE_CHECKS = tuple((n, c.inner.check) for n, c in ENVELOPE_NULLABLE.items())
_REQUIRED_CHECKS = {name: tuple((n, c.check) for n, c in cls.REQUIRED.items())
                    for name, cls in EVENT_TYPES.items()}
_OPTIONAL_CHECKS = {name: tuple((n, c.check) for n, c in cls.OPTIONAL.items())
                    for name, cls in EVENT_TYPES.items()}
_KNOWN_KEYS = {name: _ENVELOPE_KEYS | declared for name, declared in _DECLARED.items()}
_FACTORIES = {name: tuple((f.name, f.default_factory) for f in dataclasses.fields(cls)
                          if f.default_factory is not dataclasses.MISSING)
              for name, cls in EVENT_TYPES.items()}
_DEFAULTS = {name: {f.name: f.default for f in dataclasses.fields(cls)
                    if f.default is not dataclasses.MISSING}
             for name, cls in EVENT_TYPES.items()}


def from_dict(obj: Any) -> Event:
    """Validate a decoded JSON value and build its typed event."""
    if type(obj) is not dict:
        raise InvalidEvent(f"an event must be a JSON object, got {type(obj).__name__}")
    version = obj.get("v")
    if version != VERSION or type(version) is not int:
        raise InvalidEvent(f"v: unsupported contract version {version!r} (expected {VERSION})")
    kind = obj.get("type")
    cls = EVENT_TYPES.get(kind) if type(kind) is str else None
    if cls is None:
        raise InvalidEvent(f"type: unknown event type {kind!r}")
    values = {}
    for name, checker in _ENVELOPE_CHECKS:
        if name not in obj:
            raise InvalidEvent(f"missing required field {name!r}")
        values[name] = checker(obj[name], name)
    for name, checker in _NULLABLE_CHECKS:
        value = obj.get(name)
        values[name] = None if value is None else checker(value, name)
    for name, checker in _REQUIRED_CHECKS[kind]:
        if name not in obj:
            raise InvalidEvent(f"{kind}: missing required field {name!r}")
        values[name] = checker(obj[name], name)
    for name, checker in _OPTIONAL_CHECKS[kind]:
        if name in obj:
            values[name] = checker(obj[name], name)
    if cls is Lifecycle and values["event"] == "start":
        for name in Lifecycle.START_REQUIRED:
            if values.get(name) is None:
                raise InvalidEvent(f"lifecycle start: missing required field {name!r}")
    if not obj.keys() <= _KNOWN_KEYS[kind]:
        known = _KNOWN_KEYS[kind]
        values["extra"] = {k: v for k, v in obj.items() if k not in known}
    return _build(cls, values)


def _build(cls, values: dict) -> Event:
    """``cls(**values)`` without re-running the dataclass ``__init__`` (values are checked)."""
    event = cls.__new__(cls)
    event.__dict__.update(_DEFAULTS[cls.TYPE])
    event.__dict__.update(values)
    for name, factory in _FACTORIES[cls.TYPE]:
        if name not in values:
            setattr(event, name, factory())
    return event


def decode(raw: bytes | bytearray | memoryview | str) -> Event:
    """Parse and validate one envelope; raises only :class:`InvalidEvent`.

    A valid event takes the compiled fast path (``fastpath.py``); anything that path does
    not accept is parsed again and goes through the checkers, which say what is wrong.
    """
    try:
        obj = orjson.loads(raw)
    except (orjson.JSONDecodeError, TypeError) as exc:
        raise InvalidEvent(f"not valid UTF-8 JSON: {str(exc)[:120]}") from None
    if type(obj) is dict:
        version, kind = obj.get("v"), obj.get("type")
        if version == VERSION and type(version) is int and type(kind) is str:
            fast = _FAST.get(kind)
            if fast is not None:
                try:
                    event = fast(obj)
                except (InvalidEvent, ValueError, TypeError, OverflowError):
                    event = None
                if event is not None:
                    return event
                obj = orjson.loads(raw)
    try:
        return from_dict(obj)
    except InvalidEvent:
        raise
    except (ValueError, TypeError, RecursionError) as exc:
        raise InvalidEvent(f"malformed event: {str(exc)[:120]}") from None


_FAST = compile_all(EVENT_TYPES, ENVELOPE, ENVELOPE_NULLABLE)


def allow_anomaly_kinds(kinds) -> None:
    """Accept ``kinds`` besides :data:`ANOMALY_KINDS` as the ``kind`` of anomalies, incidents
    and feedback in this process: the kinds of a plug-in detector, which registers them as
    it loads (docs/CONTRACT.md, "Anomaly kinds of plug-in detectors"). The shipped schemas
    hold the contract's kinds only."""
    checkers = [Anomaly.REQUIRED["kind"], Incident.REQUIRED["kind"],
                Feedback.OPTIONAL["kind"].inner]
    new = tuple(dict.fromkeys(k for k in kinds if k not in checkers[0].enum))
    if not new:
        return
    for checker in checkers:
        checker.enum = (*checker.enum, *new)
    _FAST.update(compile_all({t: EVENT_TYPES[t] for t in ("anomaly", "incident", "feedback")},
                             ENVELOPE, ENVELOPE_NULLABLE))


def to_dict(event: Event) -> dict:
    """The envelope as a plain dict: declared fields, then the kept extra ones."""
    out = {"v": VERSION, "type": event.TYPE, "job": event.job, "ts": event.ts,
           "node": event.node, "rank": event.rank}
    for name in event.REQUIRED:
        out[name] = getattr(event, name)
    for name in event.OPTIONAL:
        value = getattr(event, name)
        if value is not None:
            out[name] = value
    for key, value in event.extra.items():
        out.setdefault(key, value)
    return out


def _nonfinite_as_strings(value):
    if type(value) is float and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if type(value) is dict:
        return {k: _nonfinite_as_strings(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return [_nonfinite_as_strings(v) for v in value]
    return value


def dumps(obj: dict) -> str:
    """Plain JSON, with NaN and ±Infinity written as the strings of SPEC §1."""
    try:
        return json.dumps(obj, allow_nan=False, separators=(",", ":"))
    except ValueError:
        return json.dumps(_nonfinite_as_strings(obj), allow_nan=False, separators=(",", ":"))


def encode(event: Event) -> bytes:
    return dumps(to_dict(event)).encode("utf-8")


def json_schema(kind: str) -> dict:
    """The JSON Schema (draft 2020-12) of one event type, for users' own producers."""
    cls = EVENT_TYPES[kind]
    props = {"v": {"const": VERSION}, "type": {"const": kind}}
    props.update({n: c.schema() for n, c in {**ENVELOPE, **ENVELOPE_NULLABLE}.items()})
    props.update({n: c.schema() for n, c in {**cls.REQUIRED, **cls.OPTIONAL}.items()})
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"trainguard/v{VERSION}/{kind}.json",
        "title": f"trainguard {kind} event",
        "description": (cls.__doc__ or "").strip().split("\n")[0],
        "type": "object",
        "required": ["v", "type", *ENVELOPE, *cls.REQUIRED],
        "properties": props,
        "additionalProperties": True,
    }
    if cls is Lifecycle:
        schema["if"] = {"properties": {"event": {"const": "start"}}}
        schema["then"] = {"required": list(Lifecycle.START_REQUIRED),
                          "properties": {n: {"not": {"type": "null"}}
                                         for n in Lifecycle.START_REQUIRED}}
    return schema
