"""The worker's data-only snapshots: every stage and every detector survives a round trip
mid-run (so a detector attribute the codec cannot write fails here), and nothing in a
snapshot runs code."""
from __future__ import annotations

import importlib
import inspect
import os
import pickle
import pkgutil
import struct
import zlib

import pytest

import trainguard.detectors as detectors
from trainguard.detectors import DetectorConfig, Engine
from trainguard.detectors.base import Detector
from trainguard.streams import statecodec
from trainguard.streams.snapshots import (MAX_STATE_BYTES, StateError, dump_state, load_state,
                                         state_allowlist)

from detector_traces import JobSim, drive, stage_items


def rich_trace():
    """One job that gives every detector state: steps, heartbeats, checkpoints, GPU samples
    with throttling and ECC errors, Xids, a straggler, spikes, then a crash."""
    sim = JobSim(job="rt", ranks=8, nodes=2, steps=400, slow_every=40, checkpoint_every=150)
    sim.straggle([5], 2.5, 120, 200).spike(260, 4.0).grad_spike(300, 8.0)
    sim.throttle("n1", 2, 100).ecc_dbe("n0", 1, 220).xid("n1", 0, 79, 350)
    return sim.crash(3, 380).events()


def every_detector_class() -> list:
    found = []
    for info in pkgutil.iter_modules(detectors.__path__):
        module = importlib.import_module(f"{detectors.__name__}.{info.name}")
        for obj in vars(module).values():
            if (inspect.isclass(obj) and issubclass(obj, Detector) and obj is not Detector
                    and obj.__module__ == module.__name__ and obj.PREFIX):
                found.append(obj)
    return sorted(set(found), key=lambda c: c.__qualname__)


def round_trip(obj, shared=None):
    return load_state(dump_state(obj, 0, 1.0, shared), shared)


@pytest.mark.parametrize("cls", every_detector_class(), ids=lambda c: c.__name__)
def test_every_detector_round_trips_mid_run_and_finds_the_same(cls):
    items = stage_items(rich_trace())
    cut = len(items) // 2
    straight = cls()
    drive(straight, items[:cut])
    restored = round_trip(straight)
    assert type(restored) is cls
    allow = state_allowlist()
    assert statecodec.encode(restored, allow) == statecodec.encode(straight, allow)
    rest = items[cut:]
    assert [f.__dict__ for f in drive(restored, rest)] == \
        [f.__dict__ for f in drive(straight, rest)]


def test_every_stage_of_an_engine_round_trips_mid_run():
    events = rich_trace()
    cut = len(events) // 2
    config = DetectorConfig()
    shared = {"detector_config": config}
    straight, restored = Engine(config), Engine(config)
    for e in events[:cut]:
        straight.update(e)
        restored.update(e)
        straight.advance(e.ts)
        restored.advance(e.ts)
    restored._ranks = {k: round_trip(s, shared) for k, s in restored._ranks.items()}
    restored._jobs = {k: round_trip(s, shared) for k, s in restored._jobs.items()}
    job = restored._jobs["rt"]
    assert job.config is config                       # the running worker's, not a copy
    assert job._routes["step"][0] is job.detectors["hang"]   # shared references survive
    assert job._nodes, "the trace gives the JobStage NodeStages"
    found = {name: [] for name in ("straight", "restored")}
    for e in events[cut:]:
        for name, engine in (("straight", straight), ("restored", restored)):
            found[name] += [a.id for a in engine.update(e) + engine.advance(e.ts)]
    found["straight"] += [a.id for a in straight.advance(events[-1].ts, force=True)]
    found["restored"] += [a.id for a in restored.advance(events[-1].ts, force=True)]
    assert found["straight"] and found["restored"] == found["straight"]


class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    Exploit.marker = marker
    hostile = pickle.dumps(Exploit())
    for blob in (hostile, struct.pack(">ci", b"P", 0) + hostile,
                 b"tg\x02\x00" + struct.pack(">id", 0, 1.0) + hostile,
                 b"tg\x02\x01" + struct.pack(">id", 0, 1.0) + zlib.compress(hostile)):
        with pytest.raises(StateError):
            load_state(blob)
    assert not marker.exists()


@pytest.mark.parametrize("payload, why", [
    (b'["o","os:system"]', "not allowed"),
    (b'["o","builtins:eval"]', "not allowed"),
    (b'["t","tg-state",4,"x",["o","subprocess:Popen","args","ls"]]', "not allowed"),
    (b'["@",5]', "reference to nothing"),
    (b'["o","trainguard.detectors.liveness:HangDetector","__class__",1]', "attribute"),
    (b'["rq",0.5,100000000000,[]]', "window"),
    (b'["np","O",[1],"AA=="]', "numpy"),
    (b"[" * 5000 + b"]" * 5000, "deep"),
    (b"\x80\x04K\x01.", "JSON"),
])
def test_malformed_or_foreign_state_is_refused(payload, why):
    with pytest.raises(StateError):
        statecodec.decode(payload, state_allowlist())


def test_a_zlib_bomb_is_refused():
    bomb = zlib.compress(b" " * (MAX_STATE_BYTES + 1024), 9)
    with pytest.raises(StateError, match="larger than"):
        load_state(b"tg\x02\x01" + struct.pack(">id", 0, 1.0) + bomb)


def test_values_the_codec_cannot_write_fail_loudly():
    with pytest.raises(StateError, match="not allowed"):
        statecodec.encode({"f": lambda: 1}, state_allowlist())
    with pytest.raises(StateError, match="not allowed"):
        statecodec.encode([Exploit()], state_allowlist())
