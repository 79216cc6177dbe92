"""The detector contract as trainguard's own tests check it: the checks shipped to users
(:mod:`trainguard.detectors.checks`), and those that need a test harness:

- the state survives the stream worker's snapshot mid-stream (:func:`snapshot_round_trip`:
  its data-only codec, with the detector's own classes allowed) and the restored detector
  goes on finding exactly the same;
- no wall clock: reading ``time.time`` or ``time.monotonic`` inside ``update``/``advance``
  fails (the clocks are patched in the detector's own module);
- :func:`state_layout` and :func:`state_changes` guard the worker's snapshots: a detector's
  stored state (the classes and attribute names reachable from it) may only change together
  with its state version (tests/data/detector_state_layout.json, written by
  ``python tests/detector_checks.py > tests/data/detector_state_layout.json``).
"""
from __future__ import annotations

import json
import sys
import time
import types
from contextlib import ExitStack, contextmanager
from unittest import mock

from trainguard.detectors import checks, stages
from trainguard.detectors.base import item_kind
from trainguard.detectors.checks import _fresh, _name, bare_items, drive
from trainguard.streams.snapshots import STATE_VERSION, dump_state, load_state, state_allowlist
from trainguard.streams.statecodec import Allowlist

__all__ = ["CHECKS", "check_detector", "snapshot_round_trip", "check_no_wall_clock",
           "state_layout", "state_changes", "layout_of_registry", "state_version_of"]


def snapshot_round_trip(detector):
    """``detector`` through the worker's snapshot and back, its own module's classes (and
    its class, which may be local to a test) allowed beside the worker's."""
    cls = type(detector)
    allow = Allowlist.of_modules([sys.modules[cls.__module__]],
                                 classes=[*state_allowlist().classes.values(), cls])
    return load_state(dump_state(detector, 0, allowlist=allow), allowlist=allow)


check_snapshot_mid_stream = checks.round_trip_check(snapshot_round_trip)
check_snapshot_mid_stream.__name__ = "check_snapshot_mid_stream"


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


def check_no_wall_clock(detector, items) -> None:
    with _no_wall_clock(detector):
        drive(_fresh(detector), items)


CHECKS = (*checks.CHECKS, check_snapshot_mid_stream, check_no_wall_clock)


def check_detector(detector, items=None) -> None:
    """Every check of :data:`CHECKS` on ``detector`` over ``items``."""
    checks.check_detector(detector, items, round_trip=snapshot_round_trip)
    check_no_wall_clock(detector, list(items) if items is not None else bare_items())


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
    return STATE_VERSION


def layout_of_registry(items=None) -> dict:
    """``{name: {"version", "layout"}}`` of every registered detector and of the stages that
    hold them (what the worker's snapshots store), each driven over ``items`` (default
    :func:`bare_items`) first, so that state made on the way is in."""
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


if __name__ == "__main__":  # python tests/detector_checks.py > FILE: the fingerprints
    print(json.dumps(layout_of_registry(), indent=1, sort_keys=True))
