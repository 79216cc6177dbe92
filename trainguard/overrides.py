"""Per-job overrides of detector settings at runtime: what may change, the record, applying it.

An operator changes a setting of one job (``trainguard config set --job J
detectors.hang.checkpoint_s=3600``); the record goes onto the compacted topic
``<prefix>.config``, keyed by job, and the running workers apply it to that job's live
detectors in place (learned state kept) and to stages built for the job later. Only the keys
of :func:`live_keys` may change so (the settings declared ``live`` in their detector's
``Config``, :func:`trainguard.setting.setting`): each is a detector attribute read when a decision is
made, not one that sized learned state (``detectors.hang.window`` sizes a rolling quantile,
so it is not here).

The record (value of the topic, key = job id in UTF-8) is one JSON object, the *whole* set of
the job's overrides (a compacted topic keeps the latest per job)::

    {"v": 1, "type": "config_override", "job": "j1", "ts": 1764680000.0,
     "override_id": "5f0c...", "by": "alice@login1",
     "values": {"detectors.hang.checkpoint_s": 3600.0}, "key_id": "...", "sig": "..."}

``values: {}`` (or a tombstone, a null value) reverts the job to the file/environment
configuration. Nothing in a record is trusted: :func:`check_record` bounds its size, its
number of keys and each value's range, and (with a signing key) its HMAC signature; a record
older than the job's latest applied one is refused as replayed.

>>> values = parse_assignments(["detectors.hang.checkpoint_s=600", "detectors.silent.timeout_s=30"])
>>> values
{'detectors.hang.checkpoint_s': 600.0, 'detectors.silent.timeout_s': 30.0}
>>> parse_assignments(["detectors.hang.window=10"])
Traceback (most recent call last):
...
trainguard.config.ConfigError: detectors.hang.window: cannot be changed while the worker runs (it sizes learned state); live keys: detectors.crash.grace_s, ...
>>> parse_assignments(["detectors.hang.checkpoint_s=-1"])
Traceback (most recent call last):
...
trainguard.config.ConfigError: detectors.hang.checkpoint_s = -1: must be a number from 0.1 to 2592000
"""
from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field

from .config import ConfigError

__all__ = ["live_keys", "RECORD_TYPE", "parse_assignments", "check_values", "make_record",
           "check_record", "Accepted", "OverrideBook", "retune_stage", "audit_action",
           "MAX_RECORD_BYTES", "read_overrides_file"]

RECORD_TYPE = "config_override"
MAX_RECORD_BYTES = 16 * 1024
MAX_ID_CHARS = 128
MAX_BY_CHARS = 256
MONTH_S = 30 * 86400.0
_JOB_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")


@dataclass(frozen=True)
class Range:
    """A number (``integer``: an int) from ``lo`` to ``hi``."""

    lo: float
    hi: float
    integer: bool = False

    def check(self, value, path: str, shown: str | None = None):
        if self.integer:
            ok = type(value) is int
        else:
            ok = type(value) in (int, float) and math.isfinite(value)
        if not ok or not self.lo <= value <= self.hi:
            kind = "an integer" if self.integer else "a number"
            raise ConfigError(f"{path} = {shown or _shown(value)}: must be {kind} from "
                              f"{_plain(self.lo)} to {_plain(self.hi)}")
        return value if self.integer else float(value)


#: the sections whose settings may change per job: the detectors'
LIVE_SECTIONS = ("detectors",)


def _keys() -> dict:
    """The keys of :data:`LIVE_SECTIONS`, as the configuration tree's root has them."""
    from .configsections import keys_of

    return {k.path: k for k in keys_of(LIVE_SECTIONS)}


@functools.lru_cache(maxsize=None)
def live_keys() -> dict:
    """The settings that may change while a job runs, with the values each may take (a
    :class:`Range`): the keys of the tree whose ``setting()`` says ``live``. Every one is
    read by its detector when it decides; none sizes what the detector has learned."""
    return {path: Range(k.live.lo, k.live.hi, integer=type(k.default) is int)
            for path, k in _keys().items() if k.live}


def _plain(x) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _shown(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 60 else text[:57] + "..."


def _live_list() -> str:
    return ", ".join(sorted(live_keys()))


def _check_key(path) -> None:
    if type(path) is not str or path not in live_keys():
        shown = _shown(path)[:128]
        if type(path) is str and path in _keys():
            raise ConfigError(f"{shown}: cannot be changed while the worker runs (it sizes "
                              f"learned state); live keys: {_live_list()}")
        raise ConfigError(f"{shown}: not a setting that can be changed per job; live keys: "
                          f"{_live_list()}")


def check_values(values, base=None) -> dict:
    """``{path: value}`` checked key by key, then together with ``base`` (a DetectorConfig:
    the worker's own), so that ``straggler.k`` stays at most ``straggler.n``. Raises
    :class:`ConfigError` with one line."""
    if type(values) is not dict:
        raise ConfigError("values must be an object of setting -> value")
    live = live_keys()
    if len(values) > len(live):
        raise ConfigError(f"{len(values)} settings; at most {len(live)}")
    out = {}
    for path, value in values.items():
        _check_key(path)
        out[path] = live[path].check(value, path)
    from .setting import with_values

    if base is None:
        from .configsections import root_class

        base = root_class(LIVE_SECTIONS)().detectors
    try:
        with_values(base, {p[len("detectors."):]: v for p, v in out.items()})
    except TypeError as exc:
        raise ConfigError(str(exc)) from None
    return out


def parse_assignments(texts, base=None) -> dict:
    """``["KEY=VALUE", ...]`` of the command line as checked ``{path: value}``."""
    from .configtree import _from_env_text

    keys = _keys()
    values = {}
    for text in texts:
        path, sep, raw = text.partition("=")
        path = path.strip()
        if not sep or not path:
            raise ConfigError(f"{text!r}: expected KEY=VALUE, e.g. detectors.hang.checkpoint_s=3600")
        _check_key(path)
        try:
            value = _from_env_text(keys[path], raw.strip(), path)
        except ConfigError:
            value = raw.strip()
        values[path] = live_keys()[path].check(value, path, shown=raw.strip()[:60])
    return check_values(values, base)


def check_keys(texts) -> list[str]:
    """The keys of ``config unset`` (any live key; unknown ones are one clear line)."""
    for path in texts:
        _check_key(path)
    return list(dict.fromkeys(texts))


def make_record(*, job: str, values: dict, ts: float, override_id: str, by: str,
                keys=None) -> dict:
    """The record of the job's whole set of overrides, signed with ``keys`` when given."""
    if not _JOB_RE.fullmatch(job):
        raise ConfigError(f"job id {job!r} must be 1-128 of [A-Za-z0-9._-]")
    record = {"v": 1, "type": RECORD_TYPE, "job": job, "ts": ts, "override_id": override_id,
              "by": by[:MAX_BY_CHARS], "values": dict(values)}
    if keys is not None:
        from .signing import sign_object

        record = sign_object(record, keys)
    return record


@dataclass(frozen=True)
class Accepted:
    """A record that passed every check: the job's overrides (empty: back to the file)."""

    job: str
    values: dict
    ts: float | None = None
    override_id: str | None = None
    by: str | None = None


def _refusal(code: str, reason: str):
    from .signing import Refusal

    return Refusal(code, reason)


def check_record(key, value, *, verifier=None, base=None, latest_ts: float | None = None,
                 now: float | None = None, max_skew_s: float = 30.0):
    """:class:`Accepted`, or the :class:`~trainguard.signing.Refusal` (the dead-letter
    reason) of one message of the config topic. ``verifier``: a
    :class:`~trainguard.signing.Verifier` with the signing keys (None: no key configured);
    ``latest_ts``: the job's latest applied record (an older one is a replay)."""
    if key is None or len(key) > 128:
        return _refusal("malformed", "the record's key must be the job id")
    try:
        job = bytes(key).decode("utf-8")
    except UnicodeDecodeError:
        return _refusal("malformed", "the record's key is not UTF-8")
    if not _JOB_RE.fullmatch(job):
        return _refusal("malformed", f"job id {job[:130]!r} must be 1-128 of [A-Za-z0-9._-]")
    if value is None:                               # a tombstone
        if verifier is not None and verifier.keys is not None:
            return _refusal("unsigned", "a tombstone carries no signature, and a signing key "
                                        "is configured; revert with `trainguard config unset`")
        return Accepted(job=job, values={})
    if len(value) > MAX_RECORD_BYTES:
        return _refusal("malformed", f"{len(value)} bytes; a record has at most "
                                     f"{MAX_RECORD_BYTES}")
    from .signing import _parsed

    obj = _parsed(value)
    if not isinstance(obj, dict):
        return obj
    if verifier is not None:
        refusal = verifier.check_signature(obj)
        if refusal is not None:
            return refusal
    if obj.get("type") != RECORD_TYPE or obj.get("v") != 1:
        return _refusal("malformed", f"type must be {RECORD_TYPE!r} and v 1")
    if obj.get("job") != job:
        return _refusal("malformed", "the record's job is not its key")
    ts, oid, by = obj.get("ts"), obj.get("override_id"), obj.get("by")
    if type(ts) not in (int, float) or not math.isfinite(ts) or ts < 0:
        return _refusal("malformed", f"ts {_shown(ts)} is not a finite number")
    if type(oid) is not str or not 1 <= len(oid) <= MAX_ID_CHARS:
        return _refusal("malformed", f"override_id must be a string of 1-{MAX_ID_CHARS} chars")
    if by is not None and (type(by) is not str or len(by) > MAX_BY_CHARS):
        return _refusal("malformed", f"by must be a string of at most {MAX_BY_CHARS} chars")
    if now is not None and ts - now > max_skew_s:
        return _refusal("future", f"stamped {ts - now:.0f}s in the future (clock skew allowed "
                                  f"up to {max_skew_s:g}s)")
    if latest_ts is not None and ts <= latest_ts:
        return _refusal("replayed", "older than the job's override already applied")
    try:
        values = check_values(obj.get("values"), base)
    except ConfigError as exc:
        return _refusal("malformed", str(exc))
    return Accepted(job=job, values=values, ts=float(ts), override_id=oid, by=by)


# -- applying ------------------------------------------------------------------------------

def base_values(base) -> dict:
    """``{path: value}`` of every live key in the DetectorsConfig ``base``."""
    out = {}
    for path in live_keys():
        _, section, name = path.split(".")
        out[path] = getattr(getattr(base, section), name)
    return out


def retune_stage(stage, wanted: dict) -> dict:
    """Set the live keys of ``stage`` (a JobStage) to ``wanted`` (``{path: value}``, every
    live key) in place; ``{path: (old, new)}`` of what changed. Learned state is kept."""
    detectors = getattr(stage, "detectors", None) or {}
    changed, by_detector = {}, {}
    for path, new in wanted.items():
        detector = detectors.get(path.split(".")[1])
        name = path.rsplit(".", 1)[1]
        if detector is None or not hasattr(detector, name):
            continue
        old = getattr(detector, name)
        if old != new:
            changed[path] = (old, new)
            by_detector.setdefault(detector, {})[name] = new
    for detector, params in by_detector.items():
        detector.retune(**params)
    return changed


@dataclass
class OverrideBook:
    """Each job's accepted overrides over the worker's own configuration ``base``."""

    base: object                    # DetectorsConfig
    max_jobs: int = 100_000
    jobs: dict = field(default_factory=dict)       # job -> Accepted

    def __post_init__(self):
        self._base_values = base_values(self.base)

    def wanted(self, job: str) -> dict:
        accepted = self.jobs.get(job)
        if accepted is None or not accepted.values:
            return self._base_values
        return {**self._base_values, **accepted.values}

    def latest_ts(self, job: str):
        accepted = self.jobs.get(job)
        return accepted.ts if accepted is not None else None

    def full(self, job: str) -> bool:
        return job not in self.jobs and len(self.jobs) >= self.max_jobs

    def set(self, accepted: Accepted) -> dict:
        """Record ``accepted``; ``{path: (old, new)}`` of the job's effective settings."""
        before = self.wanted(accepted.job)
        if accepted.values or accepted.ts is not None:
            self.jobs[accepted.job] = accepted
        else:
            self.jobs.pop(accepted.job, None)          # a tombstone
        after = self.wanted(accepted.job)
        return {p: (before[p], after[p]) for p in after if before[p] != after[p]}

    def tune(self, job: str, stage) -> dict:
        """A stage of ``job`` just built or loaded: the job's settings, in place."""
        return retune_stage(stage, self.wanted(job))


def audit_action(*, accepted: Accepted, changes: dict, worker: str, live_stages: int,
                 now: float, at_start: bool = False):
    """The ``action`` record of the audit log (``tg.actions``) for an applied override."""
    from . import events as ev

    text = ", ".join(f"{p} {_shown(old)} -> {_shown(new)}" for p, (old, new) in changes.items())
    who = f" by {accepted.by}" if accepted.by else ""
    return ev.Action(
        job=accepted.job, ts=now, incident=f"config:{accepted.job}", action="none",
        status="done",
        reason=f"config override{who} applied by worker {worker}: {text or 'back to the file'}"
               f" ({live_stages} live stage{'s' if live_stages != 1 else ''} retuned)",
        targets={"changes": {p: {"old": old, "new": new} for p, (old, new) in changes.items()},
                 "values": accepted.values, "override_id": accepted.override_id,
                 "by": accepted.by, "set_ts": accepted.ts, "worker": worker,
                 "live_stages": live_stages, "at_start": at_start},
        extra={"source": "worker", "code": "config_override"})


def read_overrides_file(path, base=None) -> dict:
    """``{job: {path: value}}`` from a TOML or JSON file (``trainguard analyze
    --overrides``): ``[jobs.J]`` tables, or ``{"J": {...}}``, keys as in ``config set``;
    checked together with ``base`` (the DetectorsConfig of the analysis)."""
    from pathlib import Path

    from .configtree import read_toml

    text_path = Path(path)
    if text_path.suffix == ".json":
        try:
            data = json.loads(text_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read overrides file {path}: {exc}") from None
    else:
        data = read_toml(path)
    data = data.get("jobs", data) if isinstance(data, dict) else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected job -> {{setting: value}}")
    out = {}
    for job, values in data.items():
        if not _JOB_RE.fullmatch(str(job)):
            raise ConfigError(f"{path}: job id {job!r} must be 1-128 of [A-Za-z0-9._-]")
        out[job] = check_values(_flatten(values), base)
    return out


def _flatten(values, base="") -> dict:
    """Nested TOML tables (``[jobs.J.detectors.hang]``) as dotted paths."""
    if not isinstance(values, dict):
        raise ConfigError(f"{base or 'overrides'}: expected a table of settings")
    out = {}
    for name, value in values.items():
        path = f"{base}{name}"
        if isinstance(value, dict):
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def topic_ends(consumer, topic: str, partitions, timeout_s: float = 20.0) -> dict:
    """``{partition: end offset}`` of the non-empty partitions of ``topic`` (confluent-kafka
    ``consumer``), asking again while a just-created topic has no leader yet; raises
    ``KafkaException`` when the broker does not answer within ``timeout_s``."""
    import time

    from confluent_kafka import KafkaException, TopicPartition

    deadline = time.monotonic() + timeout_s
    ends = {}
    for p in partitions:
        while True:
            try:
                low, high = consumer.get_watermark_offsets(TopicPartition(topic, p),
                                                           timeout=5)
                break
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        if high > low:
            ends[p] = high
    return ends
