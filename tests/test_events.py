"""The SPEC §1 contract in code: round trips, validation, schemas, arbitrary bytes."""
import json
import math
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard import events as ev
from trainguard.events import InvalidEvent, decode, encode

from events_factory import TS, examples

SCHEMA_DIR = Path(ev.__file__).parent / "schemas"


def _same(a, b):
    """Equality where NaN equals NaN."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("event", examples(), ids=lambda e: e.type)
def test_round_trip_every_type(event):
    back = decode(encode(event))
    assert type(back) is type(event)
    assert _same(ev.to_dict(back), ev.to_dict(event))


@pytest.mark.parametrize("event", examples(), ids=lambda e: e.type)
def test_encoded_events_match_shipped_schema(event):
    schema = json.loads((SCHEMA_DIR / f"{event.type}.json").read_text())
    jsonschema.validate(json.loads(encode(event)), schema)


def test_shipped_schemas_are_current():
    for kind in ev.EVENT_TYPES:
        shipped = json.loads((SCHEMA_DIR / f"{kind}.json").read_text())
        assert shipped == ev.json_schema(kind), f"run python -m trainguard.schemas ({kind})"


def test_unknown_fields_are_kept_and_written_back():
    raw = (b'{"v":1,"type":"step","job":"j","ts":1,"node":null,"rank":0,"step":1,'
           b'"step_time":0.5,"mfu":0.41,"custom":{"a":[1,2]}}')
    event = decode(raw)
    assert event.extra == {"mfu": 0.41, "custom": {"a": [1, 2]}}
    assert json.loads(encode(event))["mfu"] == 0.41


def test_nonfinite_numbers_are_strings_on_the_wire():
    event = ev.Step(job="j", ts=TS, rank=0, step=1, step_time=1.0, loss=float("inf"),
                    grad_norm=float("-inf"), lr=float("nan"))
    wire = json.loads(encode(event))
    assert (wire["loss"], wire["grad_norm"], wire["lr"]) == ("Infinity", "-Infinity", "NaN")
    back = decode(encode(event))
    assert back.loss == math.inf and back.grad_norm == -math.inf and math.isnan(back.lr)


BASE = {"v": 1, "type": "step", "job": "j1", "ts": 1.0, "node": "n", "rank": 0, "step": 3,
        "step_time": 0.5}


@pytest.mark.parametrize("change, reason", [
    ({"v": 2}, "version"),
    ({"type": "bogus"}, "unknown event type"),
    ({"job": "has space"}, "job"),
    ({"job": "x" * 129}, "job"),
    ({"job": ""}, "job"),
    ({"ts": "yesterday"}, "ts"),
    ({"ts": "NaN"}, "finite"),
    ({"rank": -1}, "minimum"),
    ({"rank": 1.5}, "integer"),
    ({"rank": True}, "integer"),
    ({"step": -3}, "minimum"),
    ({"step_time": None}, "step_time"),
    ({"loss": "high"}, "loss"),
    ({"tokens": 2.5}, "tokens"),
])
def test_invalid_values_say_what_is_wrong(change, reason):
    with pytest.raises(InvalidEvent, match=reason):
        decode(json.dumps({**BASE, **change}))


@pytest.mark.parametrize("missing", ["job", "ts", "step", "step_time"])
def test_missing_required_field(missing):
    obj = {k: v for k, v in BASE.items() if k != missing}
    with pytest.raises(InvalidEvent, match=f"missing required field '{missing}'"):
        decode(json.dumps(obj))


@pytest.mark.parametrize("raw", [b"", b"[]", b"null", b"42", b'"s"', b"\xff\xfe", b"{",
                                 b"[" * 100000, b'{"v":1}', b'{"v":1,"type":"step"}'])
def test_garbage_raises_only_invalid_event(raw):
    with pytest.raises(InvalidEvent):
        decode(raw)


def test_lifecycle_start_needs_pid_and_world_size():
    with pytest.raises(InvalidEvent, match="pid"):
        decode(b'{"v":1,"type":"lifecycle","job":"j","ts":1,"event":"start","world_size":2}')
    exit_event = decode(b'{"v":1,"type":"lifecycle","job":"j","ts":1,"event":"exit",'
                        b'"exit_code":1,"signal":null}')
    assert exit_event.exit_code == 1


def test_command_ranks_all_or_list():
    ok = decode(b'{"v":1,"type":"command","job":"j","ts":1,"command":"capture_stacks",'
                b'"capture_id":"c","ranks":[1,2]}')
    assert ok.ranks == [1, 2]
    with pytest.raises(InvalidEvent):
        decode(b'{"v":1,"type":"command","job":"j","ts":1,"command":"rm -rf /",'
               b'"capture_id":"c","ranks":"all"}')
    with pytest.raises(InvalidEvent):
        decode(b'{"v":1,"type":"command","job":"j","ts":1,"command":"capture_stacks",'
               b'"capture_id":"c","ranks":"some"}')


# --- property tests -------------------------------------------------------------------------

finite = st.floats(allow_nan=False, allow_infinity=False, min_value=0, max_value=1e12)
anyfloat = st.floats(allow_nan=True, allow_infinity=True)
job_ids = st.from_regex(r"[A-Za-z0-9._-]{1,128}", fullmatch=True)
nodes = st.none() | st.text(min_size=1, max_size=30)
ranks = st.none() | st.integers(min_value=0, max_value=100_000)
opt = lambda s: st.none() | s  # noqa: E731
json_leaf = st.none() | st.booleans() | st.integers(-2**53, 2**53) | finite | st.text(max_size=10)
json_values = st.recursive(json_leaf, lambda c: st.lists(c, max_size=3)
                           | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=8)
envelope = dict(job=job_ids, ts=finite, node=nodes, rank=ranks)

steps = st.builds(ev.Step, **envelope, step=st.integers(0, 10**9), step_time=finite,
                  compute_time=opt(finite), loss=opt(anyfloat), grad_norm=opt(anyfloat),
                  loss_scale=opt(anyfloat), tokens=opt(st.integers(0, 10**9)), lr=opt(anyfloat))
heartbeats = st.builds(ev.Heartbeat, **envelope, pid=st.integers(0, 2**22),
                       step=opt(st.integers(0, 10**9)), phase=st.text(min_size=1, max_size=64),
                       phase_since=finite, dropped=st.integers(0, 10**9))
xids = st.builds(ev.Xid, **envelope, gpu=opt(st.integers(0, 15)), xid=st.integers(0, 200),
                 source=st.sampled_from(["nvml", "kmsg"]), message=st.text(max_size=50))
frames = st.fixed_dictionaries({"function": st.text(max_size=10), "file": st.text(max_size=10),
                                "line": opt(st.integers(0, 10**6))})
threads = st.fixed_dictionaries({"name": st.text(max_size=10), "id": st.integers(0, 2**63),
                                 "active": st.booleans(),
                                 "frames": st.lists(frames, max_size=4)})
stacks = st.builds(ev.Stack, **envelope, capture_id=st.text(max_size=20),
                   pid=st.integers(0, 2**22), method=st.sampled_from(["py-spy", "inproc"]),
                   threads=st.lists(threads, max_size=3), error=opt(st.text(max_size=20)))
anomalies = st.builds(ev.Anomaly, **envelope, id=st.text(min_size=1, max_size=20),
                      kind=st.sampled_from(ev.ANOMALY_KINDS),
                      severity=st.sampled_from(ev.SEVERITIES),
                      ranks=st.lists(st.integers(0, 10**5), max_size=5),
                      nodes=st.lists(st.text(max_size=8), max_size=3),
                      step=opt(st.integers(0, 10**9)), onset_ts=finite, detected_ts=finite,
                      detector=st.text(max_size=10), summary=st.text(max_size=40),
                      evidence=st.dictionaries(st.text(max_size=5), json_values, max_size=3))
actions = st.builds(ev.Action, **envelope, incident=st.text(max_size=20),
                    action=st.sampled_from(ev.ACTIONS),
                    targets=st.dictionaries(st.text(max_size=5), json_values, max_size=3),
                    status=st.sampled_from(ev.ACTION_STATUSES), reason=st.text(max_size=30))
lifecycles = st.builds(ev.Lifecycle, **envelope, event=st.just("start"), pid=st.integers(0, 2**22),
                       world_size=st.integers(1, 10**5), local_rank=opt(st.integers(0, 64)),
                       topology=opt(st.fixed_dictionaries({"tp": st.integers(1, 8),
                                                           "pp": st.integers(1, 8),
                                                           "dp": st.integers(1, 8)})),
                       argv=opt(st.lists(st.text(max_size=10), max_size=3))) | st.builds(
    ev.Lifecycle, **envelope, event=st.just("exit"), exit_code=opt(st.integers(-255, 255)),
    signal=opt(st.sampled_from(["SIGKILL", "SIGTERM"])))
any_event = st.one_of(steps, heartbeats, xids, stacks, anomalies, actions, lifecycles)


@settings(max_examples=300, deadline=None)
@given(any_event)
def test_property_round_trip(event):
    back = decode(encode(event))
    assert _same(ev.to_dict(back), ev.to_dict(event))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_property_arbitrary_bytes(raw):
    try:
        assert isinstance(decode(raw), ev.Event)
    except InvalidEvent:
        pass


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(sorted({*BASE, "loss", "pid", "phase", "gpus", "threads",
                                                "event", "xid", "kind", "ranks"})),
                       json_values, max_size=10),
       st.sampled_from(sorted(ev.EVENT_TYPES)))
def test_property_arbitrary_objects(obj, kind):
    obj = {**obj, "v": 1, "type": kind}
    try:
        assert isinstance(decode(json.dumps(obj)), ev.Event)
    except InvalidEvent:
        pass
