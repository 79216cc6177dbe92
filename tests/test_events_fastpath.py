"""The compiled fast path of ``decode`` accepts exactly what the checkers accept, and builds
the same event.

Every example event of every type is mutated field by field (wrong types, out of range,
non-finite strings, nulls, missing fields, unknown extra fields); for each mutation the fast
path and ``from_dict`` must agree, and ``decode`` of the bytes must give the checkers' answer,
with the checkers' reason when it is invalid.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest

from events_factory import examples
from trainguard import events as ev

ODD_VALUES = [None, -1, 0, 1, 1.5, -0.5, 2 ** 63 - 1, True, False, "", "x", "all", "NaN",
              "Infinity", "-Infinity", "bad job!", "a" * 300, [], [1, 2], ["x"], [-1], {},
              {"tp": 1, "pp": 1, "dp": 1}, [{"function": "f", "file": "x.py"}],
              [{"index": 0, "uuid": "u", "util": "NaN"}], [{"index": 0, "uuid": "u", "temp": 5}],
              [{"frames": [{"function": "f", "file": "x", "line": None}]}], "start", "exit",
              "nvml", "py-spy", "capture_stacks", "warning", "straggler", "restart", "done"]


def _same(a: ev.Event, b: ev.Event) -> bool:
    """Equal, with NaN equal to NaN and int/float kept apart."""
    da, db = vars(a), vars(b)
    if type(a) is not type(b) or da.keys() != db.keys():
        return False
    return json.dumps(da, sort_keys=True, default=str) == json.dumps(db, sort_keys=True,
                                                                     default=str) and all(
        type(da[k]) is type(db[k]) for k in da)


def _slow(obj):
    try:
        return ev.from_dict(copy.deepcopy(obj)), None
    except ev.InvalidEvent as exc:
        return None, str(exc)


def _fast(obj):
    fast = ev._FAST[obj["type"]]
    try:
        return fast(copy.deepcopy(obj))
    except (ev.InvalidEvent, ValueError, TypeError, OverflowError):
        return None


def _mutations(obj: dict):
    yield obj
    for key in list(obj):
        if key in ("v", "type"):
            continue
        missing = dict(obj)
        del missing[key]
        yield missing
        for value in ODD_VALUES:
            yield {**obj, key: value}
    for extra in ({"mine": 1}, {"extra": {"a": 1}}, {"TYPE": "x", "__class__": 1}):
        yield {**obj, **extra}
    for name, value in obj.items():        # nested objects: mutate their fields too
        if isinstance(value, list) and value and isinstance(value[0], dict):
            for key in list(value[0]):
                for odd in (None, -1, "x", 1.5, "NaN", True):
                    yield {**obj, name: [{**value[0], key: odd}, *value[1:]]}


def _disagreement(obj) -> str | None:
    expected, reason = _slow(obj)
    got = _fast(obj)
    raw = json.dumps(obj).encode()
    if expected is None:
        if got is not None:
            return f"the fast path accepted what the checkers reject ({reason})"
        try:
            ev.decode(raw)
        except ev.InvalidEvent as exc:
            return None if str(exc) == reason else f"decode said {exc}, the checkers {reason}"
        return "decode accepted what the checkers reject"
    if got is None:
        return "the fast path rejected a valid event"
    if not _same(got, expected) or not _same(ev.decode(raw), expected):
        return "the fast path built a different event"
    return None


@pytest.mark.parametrize("example", examples(), ids=lambda e: e.TYPE)
def test_fast_path_agrees_with_checkers(example):
    base = json.loads(ev.encode(example))
    wrong = [(obj, why) for obj in _mutations(base) if (why := _disagreement(obj))]
    assert not wrong, f"{len(wrong)} disagreements, the first: {wrong[0]}"


def test_every_example_takes_the_fast_path():
    for example in examples():
        event = _fast(json.loads(ev.encode(example)))
        assert event is not None, example.TYPE
        assert ev.encode(event) == ev.encode(example)


def test_fast_path_converts_like_the_checkers():
    raw = (b'{"v":1,"type":"step","job":"j","ts":7,"step":1,"step_time":2,"loss":"-Infinity",'
           b'"grad_norm":3,"extra":5}')
    event = ev.decode(raw)
    assert (type(event.ts), type(event.step_time), type(event.grad_norm)) == (float,) * 3
    assert event.loss == -math.inf and event.extra == {"extra": 5}
    assert dataclasses.asdict(event)["node"] is None


def test_job_cache_does_not_admit_a_bad_id_later():
    good = b'{"v":1,"type":"heartbeat","job":"ok","ts":1,"pid":1,"phase":"x","phase_since":1,' \
           b'"dropped":0}'
    ev.decode(good)
    with pytest.raises(ev.InvalidEvent, match="does not match"):
        ev.decode(good.replace(b'"ok"', b'"not ok"'))
    assert ev.decode(good).job == "ok"
