"""One contract over every detector: configuration, clone, pickle mid-stream, determinism,
missing optional fields; and the stages' own contract (pickle, JSON summaries, stable ids)."""
import dataclasses
import inspect
import json
import pickle

import pytest

from trainguard import events as ev
from trainguard.detectors import (DETECTORS, DetectorConfig, Engine, JobStage, RankStage,
                                  anomaly_id)

from detector_traces import JobSim, drive, run_engine, stage_items

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


def as_dicts(findings):
    return [dataclasses.asdict(f) for f in findings]


@pytest.fixture(params=DETECTORS, ids=lambda c: c.__name__)
def cls(request):
    return request.param


def test_constructor_stores_every_argument_and_config_matches_defaults(cls):
    config = DetectorConfig()
    params = config.params_for(cls)
    detector = cls(**params)
    for name, value in params.items():
        assert getattr(detector, name) == value
    defaults = {n: p.default for n, p in inspect.signature(cls.__init__).parameters.items()
                if n != "self"}
    assert defaults == params, f"{cls.__name__} defaults differ from DetectorConfig"


def test_clone_is_fresh_and_equal(cls):
    items = items_for(cls.PREFIX)
    trained = cls()
    first = drive(trained, items)
    assert first, f"the {cls.PREFIX} scenario should make {cls.__name__} find something"
    clone = trained.clone()
    assert type(clone) is cls and clone._get_params() == trained._get_params()
    assert repr(clone) == repr(trained)
    assert as_dicts(drive(clone, items)) == as_dicts(first)


def test_pickle_mid_stream_gives_identical_output(cls):
    items = items_for(cls.PREFIX)
    reference = cls()
    expected = as_dicts(drive(reference, items))
    for cut in (len(items) // 3, 2 * len(items) // 3):
        detector = cls()
        before = drive(detector, items[:cut])
        restored = pickle.loads(pickle.dumps(detector))
        assert as_dicts(before + drive(restored, items[cut:])) == expected


def test_deterministic(cls):
    items = items_for(cls.PREFIX)
    assert as_dicts(drive(cls(), items)) == as_dicts(drive(cls(), items))


def _bare_items():
    """Every input kind with all optional fields missing or null."""
    items = []
    for s in range(40):
        for r in range(3):
            rec = {"k": "step", "job": "j", "rank": r, "node": None, "ts": 10.0 + s,
                   "step": s, "step_time": 0.5}
            items.append(("u", rec))
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


def test_no_crash_on_missing_optional_fields(cls):
    drive(cls(), _bare_items())


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
    with pytest.raises(ValueError):
        DetectorConfig(straggler_ratio=0.9)
    with pytest.raises(ValueError):
        DetectorConfig(hang_floor_s=-1)
    with pytest.raises(ValueError):
        DetectorConfig(hang_quantile=1.5)
    with pytest.raises(ValueError):
        DetectorConfig(straggler_k=0)
    assert DetectorConfig(hang_floor_s=5).hang_floor_s == 5.0
