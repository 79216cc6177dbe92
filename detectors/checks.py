"""The detector contract as checks anyone can run on a detector, their own included (as
``river.checks`` does for river estimators).

:func:`check_detector` runs every check of :func:`yield_checks` on a detector and raises
``AssertionError`` naming the first broken rule. The rules (docs in :mod:`.base`):

- it declares what it consumes (``CONSUMES``, words of
  :data:`~trainguard.detectors.base.INPUTS`): its stage feeds it that and nothing else, and
  calls ``advance``/``finish`` only when it declares ``tick``/``end``;
- the constructor is the configuration: every argument is stored under its own name, and a
  built-in detector's defaults are those of :class:`~trainguard.detectors.DetectorConfig`;
- :meth:`~trainguard.detectors.Detector.clone` gives a fresh detector of equal settings that
  finds the same as a fresh one;
- the state pickles mid-stream and the restored detector goes on finding exactly the same;
- the same inputs give the same findings (no randomness, no wall clock: reading
  ``time.time`` or ``time.monotonic`` inside ``update``/``advance`` fails);
- inputs with every optional field missing or null do not raise;
- findings are :class:`~trainguard.detectors.Finding` objects that make valid SPEC
  anomalies (severity known, evidence plain JSON, onset not after detection).

``items`` are what a stage gives its detectors: ``("u", item)`` to ``update`` and
``("a", now)`` to ``advance``; :func:`stage_items` makes them from telemetry events (a
recording, say) the way the stages do. Without items the checks use :func:`bare_items`
(every input kind, optional fields missing). Give items on which the detector finds
something, so that clone and pickle carry real state.

:func:`state_layout` and :func:`state_changes` guard the worker's snapshots: a detector's
stored state (the classes and attribute names reachable from it) may only change together
with its state version.

>>> from trainguard.detectors import NanDetector
>>> check_detector(NanDetector())
>>> class Forgetful(NanDetector):
...     def __init__(self, window: int = 3):
...         super().__init__()
>>> check_detector(Forgetful())
Traceback (most recent call last):
...
AssertionError: Forgetful: constructor argument 'window' is not stored as self.window
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import pickle
import sys
import time
import types
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator
from unittest import mock

from trainguard import events as ev

from .base import INPUTS, Detector, Finding, item_kind, to_anomaly

__all__ = ["check_detector", "yield_checks", "drive", "stage_items", "bare_items",
           "state_layout", "state_changes", "layout_of_registry", "state_version_of"]

SEVERITIES = ("info", "warning", "critical")


def drive(detector, items) -> list:
    """Feed ``items`` to ``detector`` as a stage does: only the inputs it declares in
    ``CONSUMES`` (all of them when it declares none); returns every finding."""
    consumes = set(getattr(detector, "CONSUMES", ()) or INPUTS)
    found = []
    for op, x in items:
        if op == "u":
            if input_of(x) in consumes:
                found += detector.update(x)
        elif "tick" in consumes:
            found += detector.advance(x)
    return found


def input_of(item) -> str:
    """The :data:`~trainguard.detectors.base.INPUTS` name of a stage item."""
    kind = item_kind(item)
    return "late" if kind == "jobstep" and "late" in item else kind


def stage_items(events, config=None) -> list:
    """What a JobStage's detectors see: ``("u", item)`` for summaries, jobsteps and node
    events, ``("a", now)`` for each advance in event time."""
    from .config import DetectorConfig
    from .stages import RankStage, StepAggregator

    config = config or DetectorConfig()
    ranks: dict = {}
    steps = StepAggregator(close_lag=config.step_close_lag, close_s=config.step_close_s)
    out = []
    now = None
    for e in events:
        now = e.ts if now is None or e.ts > now else now
        if e.type in ("gpu", "xid"):
            out.append(("u", e))
        elif e.type in ("step", "heartbeat", "lifecycle") and e.rank is not None:
            stage = ranks.setdefault(e.rank, RankStage(config))
            for summary in stage.update(e):
                out.append(("u", summary))
                if summary["k"] == "step":
                    out += [("u", js) for js in steps.add(summary)]
                elif summary["k"] == "life":
                    steps.life(summary)
        out += [("u", js) for js in steps.expire(now)]
        if not out or out[-1] != ("a", now):
            out.append(("a", now))
    return out


def bare_items() -> list:
    """Every input kind with all optional fields missing or null (three ranks, 40 steps, a
    machine losing a GPU, Xids, exits, an unknown item kind)."""
    items = []
    for s in range(40):
        for r in range(3):
            items.append(("u", {"k": "step", "job": "j", "rank": r, "node": None,
                                "ts": 10.0 + s, "step": s, "step_time": 0.5}))
        items.append(("u", {"k": "jobstep", "job": "j", "step": s, "ts": 10.0 + s,
                            "first_ts": 10.0 + s, "world": 3,
                            "ranks": {r: {"k": "step", "job": "j", "rank": r, "ts": 10.0 + s,
                                          "step": s, "step_time": 0.5, "compute_time": None,
                                          "loss": None, "grad_norm": None}
                                      for r in range(3)}}))
        items.append(("u", {"k": "hb", "job": "j", "rank": 0, "ts": 10.5 + s, "step": None,
                            "phase": "forward", "phase_since": None}))
        items.append(("u", ev.Gpu(job="j", ts=10.0 + s, gpus=[{"index": 0, "uuid": "G"}])))
        items.append(("u", ev.Gpu(job="j", ts=10.0 + s, node="n1",
                                  gpus=[{"index": 0, "uuid": "G"}, {"index": 1, "uuid": "H"}]
                                  if s < 20 else [{"index": 0, "uuid": "G"}])))
        items.append(("u", ev.Gpu(job="j", ts=10.2 + s, node="n1", gpus=[],
                                  status="unavailable", reason="no NVML")))
        items.append(("a", 10.9 + s))
    items.append(("u", ev.Xid(job="j", ts=60.0, xid=79, source="kmsg", message="")))
    items.append(("u", ev.Xid(job="j", ts=60.0, node="n1", xid=48, source="nvml", message="")))
    items.append(("u", {"k": "life", "job": "j", "rank": 1, "ts": 61.0, "event": "exit"}))
    items.append(("u", {"k": "life", "job": "j", "rank": None, "ts": 61.0, "event": "exit",
                        "exit_code": 3}))
    items.append(("u", {"k": "life", "job": "j", "rank": 2, "ts": 62.0, "event": "start"}))
    items.append(("u", {"k": "whatever", "ts": 63.0}))
    items.append(("a", 500.0))
    return items


def _name(detector) -> str:
    return type(detector).__name__


def _params(detector) -> dict:
    names = [n for n, p in inspect.signature(type(detector).__init__).parameters.items()
             if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return {n: getattr(detector, n) for n in names if hasattr(detector, n)}


def _fresh(detector):
    """A new detector of the same settings, not by ``clone`` (whose rules are checked)."""
    return type(detector)(**_params(detector))


def _as_dicts(findings) -> list:
    return [dataclasses.asdict(f) if dataclasses.is_dataclass(f) else f for f in findings]


# ------------------------------------------------------------------ the checks
def check_declared_inputs(detector, items) -> None:
    """It declares what it consumes (its stage feeds nothing else), in known words, and
    declares ``tick``/``end`` exactly when it has ``advance``/``finish``."""
    consumes = getattr(detector, "CONSUMES", ())
    assert consumes, f"{_name(detector)}: CONSUMES is empty: no stage would feed it"
    unknown = sorted(set(consumes) - set(INPUTS))
    assert not unknown, f"{_name(detector)}: CONSUMES names unknown inputs {unknown}"
    timed = type(detector).advance.__qualname__ != Detector.advance.__qualname__
    assert timed == ("tick" in consumes), (
        f"{_name(detector)}: " + ("advance() without 'tick' in CONSUMES: never called" if timed
                                  else "'tick' in CONSUMES without an advance()"))
    ends = callable(getattr(detector, "finish", None))
    assert ends == ("end" in consumes), (
        f"{_name(detector)}: " + ("finish() without 'end' in CONSUMES: never called" if ends
                                  else "'end' in CONSUMES without a finish(now)"))


def check_params(detector, items) -> None:
    for name, p in inspect.signature(type(detector).__init__).parameters.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        assert hasattr(detector, name), (
            f"{_name(detector)}: constructor argument {name!r} is not stored as self.{name}")


def check_config_defaults(detector, items) -> None:
    """A detector known to DetectorConfig (``<PREFIX>_<arg>`` fields) has its defaults."""
    from .config import DetectorConfig

    cls = type(detector)
    try:
        params = DetectorConfig().params_for(cls)
    except AttributeError:
        return  # not configured through DetectorConfig (a user's own detector)
    defaults = {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items()
                if n != "self"}
    assert defaults == params, f"{cls.__name__}: constructor defaults differ from DetectorConfig"


def check_clone(detector, items) -> None:
    trained = _fresh(detector)
    drive(trained, items)
    clone = trained.clone()
    assert type(clone) is type(detector), f"{_name(detector)}: clone() changed the type"
    assert _params(clone) == _params(trained), f"{_name(detector)}: clone() changed settings"
    assert repr(clone) == repr(trained), f"{_name(detector)}: clone's repr differs"
    assert _as_dicts(drive(clone, items)) == _as_dicts(drive(_fresh(detector), items)), (
        f"{_name(detector)}: a clone of a trained detector kept learned state")


def check_pickle_mid_stream(detector, items) -> None:
    expected = _as_dicts(drive(_fresh(detector), items))
    for cut in (len(items) // 3, 2 * len(items) // 3):
        d = _fresh(detector)
        before = drive(d, items[:cut])
        try:
            restored = pickle.loads(pickle.dumps(d))
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise AssertionError(f"{_name(detector)}: its state does not pickle: {exc}") \
                from None
        assert _as_dicts(before + drive(restored, items[cut:])) == expected, (
            f"{_name(detector)}: restored from a pickle after {cut} items, it finds "
            f"something else")


_CLOCKS = ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns")


@contextmanager
def _no_wall_clock(detector):
    """Clocks refused in the detector's own module (only there: other threads go on)."""
    def refuse(*args):
        raise AssertionError(f"{_name(detector)} read the wall clock (time comes from the "
                             "inputs or advance(now))")
    module = sys.modules.get(type(detector).__module__)
    stub = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time)
                                    if not n.startswith("_")})
    for name in _CLOCKS:
        setattr(stub, name, refuse)
    with ExitStack() as stack:
        for name, value in list(vars(module).items()) if module else ():
            if value is time:
                stack.enter_context(mock.patch.object(module, name, stub))
            elif any(value is getattr(time, c) for c in _CLOCKS):
                stack.enter_context(mock.patch.object(module, name, refuse))
        yield


def check_deterministic(detector, items) -> None:
    with _no_wall_clock(detector):
        first = _as_dicts(drive(_fresh(detector), items))
    assert first == _as_dicts(drive(_fresh(detector), items)), (
        f"{_name(detector)}: the same inputs gave other findings")


def check_missing_optional_fields(detector, items) -> None:
    drive(_fresh(detector), bare_items())


def check_findings(detector, items) -> None:
    for f in drive(_fresh(detector), items) + drive(_fresh(detector), bare_items()):
        assert isinstance(f, Finding), f"{_name(detector)}: found a {type(f).__name__}"
        assert f.severity in SEVERITIES, f"{_name(detector)}: severity {f.severity!r}"
        assert f.onset_ts <= f.detected_ts, f"{_name(detector)}: onset after detection"
        json.dumps(f.evidence, allow_nan=False)
        ev.decode(ev.encode(to_anomaly("j", f)))


CHECKS = (check_declared_inputs, check_params, check_config_defaults, check_clone, check_pickle_mid_stream,
          check_deterministic, check_missing_optional_fields, check_findings)


def yield_checks(detector) -> Iterator[Callable]:
    """Each check, a function ``(detector, items) -> None`` raising ``AssertionError``."""
    yield from CHECKS


def check_detector(detector, items=None) -> None:
    """Run every check on ``detector`` (its settings; it is not changed) over ``items``."""
    items = list(items) if items is not None else bare_items()
    detector = copy.deepcopy(detector)
    for check in yield_checks(detector):
        check(detector, items)


# ------------------------------------------------------------------ state layout
_PLAIN = (str, bytes, int, float, bool, type(None), complex)


def state_layout(obj) -> dict:
    """``{"module.Class": [attribute names]}`` of ``obj`` and every object with attributes
    reachable from it (through lists, dicts, sets and tuples): what a snapshot stores.

    >>> from trainguard.detectors import NanDetector
    >>> sorted(state_layout(NanDetector()))
    ['trainguard.detectors.training.NanDetector']
    """
    out: dict = {}
    seen: set = set()
    todo = [obj]
    while todo:
        x = todo.pop()
        if isinstance(x, _PLAIN) or id(x) in seen or isinstance(x, type):
            continue
        seen.add(id(x))
        if isinstance(x, dict):
            todo += list(x.keys()) + list(x.values())
            continue
        if isinstance(x, (list, tuple, set, frozenset)) or type(x).__module__ == "collections":
            try:
                todo += list(x.values()) if hasattr(x, "values") else list(x)
            except TypeError:
                pass
            continue
        attrs = dict(getattr(x, "__dict__", {}))
        for slot in getattr(type(x), "__slots__", ()):
            if hasattr(x, slot):
                attrs[slot] = getattr(x, slot)
        if not attrs:
            continue
        key = f"{type(x).__module__}.{type(x).__qualname__}"
        out[key] = sorted(set(out.get(key, ())) | set(attrs))
        todo += list(attrs.values())
    return dict(sorted(out.items()))


def state_version_of(cls) -> int:
    """A detector's own ``STATE_VERSION``, else the worker's snapshot version."""
    own = getattr(cls, "STATE_VERSION", None)
    if own is not None:
        return own
    from trainguard.streams import processors

    return processors.STATE_VERSION


def layout_of_registry(items=None) -> dict:
    """``{name: {"version", "layout"}}`` of every registered detector and of the stages that
    hold them (what the worker's snapshots store), each driven over ``items`` (default
    :func:`bare_items`) first, so that state made on the way is in."""
    from . import stages

    items = list(items) if items is not None else bare_items()
    out = {}
    for cls in stages.DETECTORS:
        d = cls()
        drive(d, items)
        out[cls.__name__] = {"version": state_version_of(cls), "layout": state_layout(d)}
    summaries = [(op, x) for op, x in items if op == "a" or item_kind(x) != "jobstep"]
    job = stages.JobStage()
    for op, x in summaries:
        job.update(x) if op == "u" else job.advance(x)
    for stage in (stages.RankStage(), stages.NodeStage(), job):
        out[type(stage).__name__] = {"version": state_version_of(type(stage)),
                                     "layout": state_layout(stage)}
    return out


def state_changes(stored: dict, current: dict) -> list:
    """What is wrong with ``current`` (:func:`layout_of_registry`) against ``stored``: a
    layout changed under the same version, or a stored entry not current any more.

    >>> old = {"D": {"version": 3, "layout": {"m.D": ["a", "b"]}}}
    >>> state_changes(old, {"D": {"version": 3, "layout": {"m.D": ["a", "c"]}}})
    ['D: its stored state changed (m.D: +c -b) but its state version is still 3; raise it']
    >>> state_changes(old, {"D": {"version": 4, "layout": {"m.D": ["a", "c"]}}})
    ['D: state version 4 with a new layout; store the new fingerprint']
    """
    problems = []
    for name, now in current.items():
        before = stored.get(name)
        if before is None:
            problems.append(f"{name}: no stored fingerprint; store the new fingerprint")
        elif before["layout"] != now["layout"] and before["version"] == now["version"]:
            diff = []
            for cls in sorted(set(before["layout"]) | set(now["layout"])):
                a, b = set(before["layout"].get(cls, ())), set(now["layout"].get(cls, ()))
                if a != b:
                    diff.append(f"{cls}: " + " ".join([f"+{x}" for x in sorted(b - a)]
                                                      + [f"-{x}" for x in sorted(a - b)]))
            problems.append(f"{name}: its stored state changed ({'; '.join(diff)}) but its "
                            f"state version is still {now['version']}; raise it")
        elif before != now:
            problems.append(f"{name}: state version {now['version']} with a new layout; "
                            f"store the new fingerprint")
    problems += [f"{name}: no longer registered; drop its fingerprint"
                 for name in stored if name not in current]
    return problems


if __name__ == "__main__":  # python -m trainguard.detectors.checks > FILE: the fingerprints
    print(json.dumps(layout_of_registry(), indent=1, sort_keys=True))
