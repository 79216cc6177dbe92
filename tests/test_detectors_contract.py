"""One contract over every detector, through the checks shipped as
``trainguard.detectors.checks`` (configuration, clone, determinism, missing optional fields,
valid findings) and those of tests/detector_checks.py (the worker's snapshot mid-stream, no
wall clock); and the stages' own contract (pickle, JSON
summaries, stable ids)."""
import dataclasses
import json
import pickle
import time
from pathlib import Path

import pytest

from trainguard import events as ev
from trainguard.detectors import (DETECTORS, Detector, DetectorConfig, Engine, JobStage, NanDetector,
                                  RankStage, anomaly_id)
from trainguard.detectors.checks import drive, stage_items

from detector_checks import CHECKS, check_detector, layout_of_registry, state_changes, state_layout
from detector_traces import JobSim, run_engine

# A trace on which each detector finds something, so the round trips carry real state.
SCENARIOS = {
    "nan": lambda: JobSim(steps=120).nan_loss(3, 80),
    "loss_spike": lambda: JobSim(steps=330, checkpoint_every=0, gpus=False).spike(300, 1.6),
    "grad_spike": lambda: JobSim(steps=330, checkpoint_every=0, gpus=False).grad_spike(300, 5.0),
    "straggler": lambda: JobSim(steps=150).straggle([6], 1.5, 60),
    "throughput": lambda: JobSim(steps=250, checkpoint_every=0).network(3.0, 150),
    "hang": lambda: JobSim(steps=120).hang(5, 90),
    "silent": lambda: JobSim(steps=120).machine_down("n2", 90),
    "crash": lambda: JobSim(steps=120).crash(2, 90, exit_code=1),
    "gpu_fault": lambda: JobSim(steps=120).xid("n2", 1, 79, 90),
    "gpu_degraded": lambda: JobSim(steps=200).throttle("n1", 2, 40),
    "data_position": lambda: _LostPosition(),
    "machine_outlier": lambda: JobSim(ranks=16, nodes=4, steps=700,
                                      checkpoint_every=0).throttle("n2", 1, 450),
}


class _LostPosition:
    """Two ranks report ``samples``; after a restart rank 1 resumes at its checkpoint step
    with its data position reset (JobSim has no ``samples``)."""

    def events(self):
        out, ts = [], 1000.0
        for rank in (0, 1):
            out.append(ev.Lifecycle(job="j1", ts=ts, node="n1", rank=rank, event="start",
                                    pid=10 + rank, world_size=2))
        for step in list(range(30)) + list(range(20, 30)):
            ts += 1.0
            if step == 20 and ts > 1030:
                for rank in (0, 1):
                    out.append(ev.Lifecycle(job="j1", ts=ts, node="n1", rank=rank,
                                            event="start", pid=20 + rank, world_size=2))
            for rank in (0, 1):
                samples = (step + 1) * 8 if not (rank == 1 and ts > 1030) else (step - 19) * 8
                out.append(ev.Step(job="j1", ts=ts, node="n1", rank=rank, step=step,
                                   step_time=1.0, loss=2.0, extra={"samples": samples}))
        return out
_ITEMS = {}


def items_for(prefix):
    if prefix not in _ITEMS:
        _ITEMS[prefix] = stage_items(SCENARIOS[prefix]().events())
    return _ITEMS[prefix]


@pytest.fixture(params=DETECTORS, ids=lambda c: c.__name__)
def cls(request):
    return request.param


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_detector_contract(cls, check):
    """Every check (the shipped ones and the suite's), over a trace on which the detector
    finds something."""
    items = items_for(cls.PREFIX)
    assert drive(cls(), items), f"the {cls.PREFIX} scenario should make {cls.__name__} find"
    check(cls(**DetectorConfig().params_for(cls)), items)


class Moody(NanDetector):
    """Finds on some runs only: it counts inputs in a class attribute."""
    seen = [0]

    def update(self, item):
        Moody.seen[0] += 1
        return super().update(item) if Moody.seen[0] % 7 else []


class ClockReader(NanDetector):
    CONSUMES = (*NanDetector.CONSUMES, "tick")

    def advance(self, now):
        return [] if time.time() else []


def test_a_users_detector_that_breaks_the_contract_is_told_which_rule():
    with pytest.raises(AssertionError, match="Moody"):
        check_detector(Moody(), items_for("nan"))
    with pytest.raises(AssertionError, match="ClockReader read the wall clock"):
        check_detector(ClockReader())

    class Local(NanDetector):
        def update(self, item):
            self.last = lambda: item       # a function: no snapshot can hold it
            return super().update(item)

    with pytest.raises(AssertionError, match="Local: its state does not survive"):
        check_detector(Local())


def test_every_registered_detector_passes_check_detector_on_bare_inputs():
    for cls in DETECTORS:
        check_detector(cls())


def test_engine_accepts_events_with_only_required_fields():
    events = []
    for s in range(30):
        for r in range(4):
            events.append(ev.Step(job="j", ts=100.0 + s, rank=r, step=s, step_time=1.0))
            events.append(ev.Heartbeat(job="j", ts=100.5 + s, rank=r, pid=1, phase="forward",
                                       phase_since=100.0 + s))
    events.append(ev.Lifecycle(job="j", ts=131.0, rank=2, event="exit"))
    events.append(ev.Gpu(job="j", ts=131.0, gpus=[], status="unavailable", reason="x"))
    events.append(ev.Xid(job="j", ts=131.0, xid=79, source="nvml", message=""))
    found, engine = run_engine(events)
    assert [a.kind for a in found] == ["gpu_fault"]
    assert json.dumps(engine.incidents())


def test_rank_summaries_are_plain_json_and_job_stage_pickles_mid_stream():
    events = JobSim(steps=120).nan_loss(3, 80).events()
    summaries, node_events = [], []
    ranks = {}
    for e in events:
        if e.type in ("gpu", "xid"):
            summaries.append(e)
            continue
        for s in ranks.setdefault(e.rank, RankStage()).update(e):
            wire = json.loads(json.dumps(s, allow_nan=False))    # what crosses Kafka
            summaries.append(wire)
    reference = JobStage()
    expected = [a.id for x in summaries for a in reference.update(x)]
    assert expected
    stage = JobStage()
    cut = len(summaries) // 2
    got = [a.id for x in summaries[:cut] for a in stage.update(x)]
    stage = pickle.loads(pickle.dumps(stage))
    got += [a.id for x in summaries[cut:] for a in stage.update(x)]
    assert got == expected


def test_anomaly_ids_are_stable_across_runs_and_restarts():
    events = JobSim(steps=150).straggle([6], 1.5, 60).crash(1, 120).events()
    first, _ = run_engine(events)
    second, _ = run_engine(events)
    assert [a.id for a in first] == [a.id for a in second]
    assert len({a.id for a in first}) == len(first)
    # A worker restored from a snapshot re-processes the events after it: same ids again.
    cut = len(events) // 3
    engine, emitted, snapshot = Engine(), [], None
    for i, e in enumerate(events):
        if i == cut:
            snapshot = pickle.dumps(engine)
        emitted += [(i, a.id) for a in engine.update(e) + engine.advance(e.ts)]
    emitted += [(len(events), a.id) for a in engine.advance(events[-1].ts, force=True)]
    restored = pickle.loads(snapshot)
    again = [a.id for e in events[cut:] for a in restored.update(e) + restored.advance(e.ts)]
    again += [a.id for a in restored.advance(events[-1].ts, force=True)]
    assert again == [i for n, i in emitted if n >= cut]
    assert set(again) <= {a.id for a in first} and len(again) >= 2


def test_anomaly_id_depends_on_identity_only():
    from trainguard.detectors import Finding

    f = Finding(kind="straggler", severity="warning", ranks=[6, 2], nodes=[], step=181,
                onset_ts=1.0, detected_ts=2.0, detector="straggler", summary="a")
    g = dataclasses.replace(f, ranks=[2, 6], detected_ts=99.0, summary="b")
    assert anomaly_id("j1", f) == anomaly_id("j1", g)
    assert anomaly_id("j1", f) != anomaly_id("j2", f)
    assert anomaly_id("j1", f) != anomaly_id("j1", dataclasses.replace(f, step=182))


def test_config_validation():
    from trainguard.config import ConfigError
    from trainguard.setting import with_values

    for bad in ({"straggler.ratio": 0.9}, {"hang.floor_s": -1}, {"hang.quantile": 1.5},
                {"straggler.k": 0}):
        with pytest.raises(ConfigError):
            with_values(DetectorConfig(), bad)
    assert with_values(DetectorConfig(), {"hang.floor_s": 5}).hang.floor_s == 5.0


LAYOUT_FILE = Path(__file__).parent / "data" / "detector_state_layout.json"


def test_stored_state_changes_only_with_the_state_version():
    """Each registered detector's and stage's stored state (classes and attribute names) is
    fingerprinted per state version in tests/data/detector_state_layout.json. A change of what
    they keep needs a new state version (a worker would otherwise load old snapshots into new
    objects); then store the new fingerprints:
    ``python tests/detector_checks.py > tests/data/detector_state_layout.json``."""
    problems = state_changes(json.loads(LAYOUT_FILE.read_text()), layout_of_registry())
    assert not problems, "\n".join(problems)


def test_the_fingerprint_check_sees_a_new_attribute():
    current = layout_of_registry()
    changed = NanDetector()
    changed.extra_memory = {}
    name = "NanDetector"
    bumped = dict(current, **{name: {"version": current[name]["version"],
                                     "layout": state_layout(changed)}})
    assert state_changes(current, bumped) == [
        "NanDetector: its stored state changed (trainguard.detectors.training.NanDetector: "
        "+extra_memory) but its state version is still "
        f"{current[name]['version']}; raise it"]


# -- declared consumption (issue 13 point 3) -------------------------------------------------

class _Counting(Detector):
    """A user's detector: counts what it is fed, by input."""

    PREFIX = "counting"
    CONSUMES = ("jobstep", "hb", "tick")

    def __init__(self):
        self.fed: dict = {}

    def update(self, item):
        kind = "hb" if item.get("k") == "hb" else item.get("k")
        self.fed[kind] = self.fed.get(kind, 0) + 1
        return []

    def advance(self, now):
        self.fed["tick"] = self.fed.get("tick", 0) + 1
        return []


def test_a_detector_added_to_the_registry_is_fed_what_it_declares(monkeypatch):
    from trainguard.detectors import stages

    real = DetectorConfig.params_for

    class Config(DetectorConfig):
        def params_for(self, cls):
            return {} if cls is _Counting else real(self, cls)

    monkeypatch.setattr(stages, "JOB_DETECTORS", (*stages.JOB_DETECTORS, _Counting))
    stage = stages.JobStage(Config())
    for s in range(3):
        for r in range(2):
            stage.update({"k": "step", "job": "j", "rank": r, "node": "n1", "ts": 10.0 + s,
                          "step": s, "step_time": 1.0, "loss": 1.0})
    stage.update({"k": "hb", "job": "j", "rank": 0, "node": "n1", "ts": 13.0, "step": 2,
                  "phase": "forward", "phase_since": 12.5, "pid": 1, "dropped": 0})
    stage.update({"k": "life", "job": "j", "rank": 0, "node": "n1", "ts": 14.0,
                  "event": "start", "world_size": 2})
    stage.advance(15.0)
    # the closed steps, the heartbeat and the tick; no step summary, no lifecycle
    assert stage.detectors["counting"].fed == {"jobstep": 3, "hb": 1, "tick": 1}


def test_the_contract_check_names_an_undeclared_or_unfed_detector():
    class Mute(NanDetector):
        CONSUMES = ()

    class Timed(NanDetector):
        def advance(self, now):
            return []

    with pytest.raises(AssertionError, match="CONSUMES is empty"):
        check_detector(Mute())
    with pytest.raises(AssertionError, match="advance\\(\\) without 'tick'"):
        check_detector(Timed())


def test_the_detectors_of_a_job_stage_share_one_view_of_the_job():
    """Issue 13 point 3: placement, last seen and topology are learned once, by the stage."""
    from trainguard.detectors.view import JobView

    stage = JobStage()
    users = [d for d in stage.detectors.values() if getattr(d, "USES_VIEW", False)]
    assert {d.PREFIX for d in users} >= {"hang", "silent", "crash", "straggler"}
    assert all(d.view is stage.view and not d._own_view for d in users)
    stage.update({"k": "life", "job": "j", "rank": 0, "node": "n1", "ts": 1.0,
                  "event": "start", "pid": 1, "world_size": 4,
                  "topology": {"tp": 1, "pp": 2, "dp": 2}})
    stage.update({"k": "step", "job": "j", "rank": 3, "node": "n2", "ts": 2.0, "step": 0,
                  "step_time": 1.0})
    assert (stage.view.where, stage.view.last_seen, stage.view.stage_size) == (
        {0: "n1", 3: "n2"}, {0: 1.0, 3: 2.0}, 2)
    restored = pickle.loads(pickle.dumps(stage))
    assert all(d.view is restored.view for d in restored.detectors.values()
               if getattr(d, "USES_VIEW", False))
    alone = type(users[0])()                    # a detector alone keeps its own view
    assert isinstance(alone.view, JobView) and alone._own_view
