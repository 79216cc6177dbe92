"""Issue 21 point 1: a step's ranks summarized per telemetry partition (partials) and merged
give the step detectors (NaN, loss and gradient spikes, throughput) the incidents that the
ranks' records give them, and so does the straggler's book split by partition
(detectors/pace_parts.py), on the whole scenario library (tests/scenarios.py)."""
from __future__ import annotations

import math
import random

import pytest

from trainguard.detectors import stages
from trainguard.detectors.offline import analyze_events
from trainguard.detectors.partials import (BUCKET, NAMED_UPTO, PartialBuilder, column_median,
                                           merge, partial_of, slowest, step_summary)
from trainguard.detectors.base import make_jobstep, median
from trainguard.detectors.live_parts import (CrashParts, DataPositionParts, HangParts,
                                             SilentParts)
from trainguard.detectors.pace_parts import PaceParts
from trainguard.detectors.steps import StepAggregator
from trainguard.detectors.straggler import StragglerDetector
from trainguard.detectors.view import JobView
from trainguard.detectors.training import NanDetector

from scenario_library import FAULTS, HEALTHY
from scenarios import generate


def _split(monkeypatch, partitions: int, exact_upto):
    """Each closed step's ranks split by ``rank % partitions``, one PartialBuilder each, and
    the step detectors given the merged partial instead of the records; the straggler's
    book and the silent, hang, crash and data-position detectors' split the same way
    (detectors/pace_parts.py, detectors/live_parts.py)."""
    original = stages.JobStage._jobstep

    def _jobstep(self, jobstep):
        builders = self.__dict__.setdefault("_builders", {})
        for part in range(partitions):
            builders.setdefault(part, PartialBuilder(exact_upto=exact_upto))
        if "late" in jobstep:
            for rank, rec in jobstep["ranks"].items():
                builders[rank % partitions].late(rec)
        else:
            groups: dict = {}
            for rank, rec in jobstep["ranks"].items():
                groups.setdefault(rank % partitions, {})[rank] = rec
            jobstep["agg"] = merge([builders[p].partial(g) for p, g in sorted(groups.items())])
        return original(self, jobstep)

    start = StragglerDetector._start

    def _start(self):
        start(self)
        self._paces = PaceParts(partitions, exact_upto=exact_upto)

    init = stages.JobStage.__init__

    def __init__(self, config=None):
        init(self, config)
        for name, split in (("silent", SilentParts), ("hang", HangParts),
                            ("crash", CrashParts)):
            old = self.detectors[name]
            parts = self.detectors[name] = split(partitions, **old._get_params())
            parts.share_view(self.view)
        if "data_position" in self.detectors:
            self.detectors["data_position"] = DataPositionParts(partitions)
        self.view = JobView(partitions)              # the job view's books too
        self.steps = StepAggregator(window=self.steps.window, window_s=self.steps.window_s,
                                    partitions=partitions)    # and the step aggregator's
        for detector in self.detectors.values():
            if getattr(detector, "USES_VIEW", False):
                detector.share_view(self.view)
        self._routes = stages.routes(self.detectors.values())

    monkeypatch.setattr(stages.JobStage, "_jobstep", _jobstep)
    monkeypatch.setattr(stages.JobStage, "__init__", __init__)
    monkeypatch.setattr(StragglerDetector, "_start", _start)


def _incidents(events):
    engine, _ = analyze_events(events)
    return [(i["kind"], i["ranks"], i["nodes"], i["onset_ts"], i["detected_ts"],
             i["anomalies"]) for i in engine.incidents()]


#: every fault and every third healthy shape (each shape family is still in it), as the
#: parallel analyze's check: the whole library was 189 jobs, 30 CPU s more for the suite
LIBRARY = [*HEALTHY[::3], *FAULTS]


@pytest.mark.parametrize("sc", LIBRARY, ids=[sc.name for sc in LIBRARY])
def test_partitions_merged_give_the_library_its_incidents(sc, monkeypatch):
    """Three partitions, each sketching its values even when it has few (exact_upto=0): the
    step detectors on merged partials, the straggler's, silent, hang, crash and
    data-position detectors' books split by partition find the same incidents, with the
    same ranks, machines, times and anomalies (the whole library, 189 jobs, gave the same
    on 2026-12-07 and again with the hang, crash and data-position splits)."""
    events, _ = generate(sc)
    want = _incidents(events)
    with monkeypatch.context() as m:
        _split(m, 3, exact_upto=0)
        assert _incidents(events) == want


def test_a_sketched_median_is_within_a_bucket_of_the_true_one():
    rng = random.Random(7)
    for _ in range(60):
        values = [rng.lognormvariate(0, rng.choice((0.01, 0.3, 2.0)))
                  for _ in range(rng.randint(1, 3000))]
        ranks = {r: {"rank": r, "ts": 1.0, "loss": v, "step_time": v, "compute_time": v}
                 for r, v in enumerate(values)}
        cut = sorted(rng.sample(range(len(values) + 1), min(len(values), 5)))
        bounds = [0, *cut, len(values)]
        parts = [partial_of({r: ranks[r] for r in range(a, b)}, exact_upto=rng.choice((0, 8)))
                 for a, b in zip(bounds, bounds[1:]) if b > a]
        whole = merge(parts)
        true = median(values)
        for field in ("loss", "step_time", "compute_time"):
            got = column_median(whole[field])
            assert abs(got - true) <= BUCKET * true * 1.0001, (field, got, true)
        top = max(range(len(values)), key=lambda r: (values[r], -r))
        assert slowest(whole["compute_time"])[0] == (values[top], top)


def test_equal_values_keep_their_exact_median_in_a_sketch():
    ranks = {r: {"rank": r, "ts": 1.0, "loss": 2.3456789} for r in range(500)}
    parts = [partial_of({r: ranks[r] for r in range(a, a + 100)}, exact_upto=0)
             for a in range(0, 500, 100)]
    assert column_median(merge(parts)["loss"]) == 2.3456789


def test_merging_is_the_same_in_any_grouping():
    rng = random.Random(3)
    ranks = {r: {"rank": r, "ts": float(r), "loss": rng.choice((1.0, 2.0, float("nan"))),
                 "grad_norm": rng.random(), "step_time": 1 + rng.random(),
                 "compute_time": rng.random(), "tokens": 100} for r in range(400)}
    parts = [partial_of({r: ranks[r] for r in range(a, a + 50)}, exact_upto=0)
             for a in range(0, 400, 50)]
    flat = merge(parts)
    nested = merge([merge(parts[:3]), merge(parts[3:])])
    for field in ("loss", "grad_norm", "step_time", "per_token", "compute_time"):
        assert column_median(flat[field]) == pytest.approx(column_median(nested[field]))
    assert slowest(flat["compute_time"]) == slowest(nested["compute_time"])
    assert sorted(flat["bad_loss"]) == sorted(nested["bad_loss"])
    assert flat["bad_ts"] == nested["bad_ts"] == min(
        rec["ts"] for rec in ranks.values() if math.isnan(rec["loss"]))


def test_a_partial_names_at_most_named_upto_ranks_and_says_how_many():
    n = NAMED_UPTO + 10
    js = make_jobstep(4, 40.0, loss=[float("nan")] * n + [2.0])
    parts = [partial_of({r: rec for r, rec in js["ranks"].items() if r % 2 == half})
             for half in (0, 1)]
    js["agg"] = merge(parts)
    assert js["agg"]["bad_loss_n"] == n and len(js["agg"]["bad_loss"]) == NAMED_UPTO
    (finding,) = NanDetector().update(js)
    assert len(finding.ranks) == NAMED_UPTO
    assert f"on {n} ranks (0, 1, 2" in finding.summary


def test_a_jobstep_with_records_is_summarized_once_and_exactly():
    js = make_jobstep(1, 1.0, loss=[float(v) for v in range(1, 100)])
    agg = step_summary(js)
    assert step_summary(js) is agg and agg["loss"]["v"] == [float(v) for v in range(1, 100)]
    assert column_median(agg["loss"]) == 50.0


def test_a_summary_from_records_gives_the_steps_compute_times_as_step_times_does():
    """The summary hands its compute times on (the straggler and the throughput detector's
    standouts read them), the same ranks and values as step_times' own loop."""
    from trainguard.detectors.peers import step_times

    times = [0.5, float("nan"), 0.0, "Infinity", 0.7, None, -1.0, "0.9"]
    js = make_jobstep(2, 2.0, compute_time=[0.5] * len(times))
    for rank, t in enumerate(times):
        js["ranks"][rank]["compute_time"] = t
    own = step_times(dict(js))
    step_summary(js)
    assert (js["_step_times"].ranks, js["_step_times"].values) == (own.ranks, own.values)
    assert own.ranks == [0, 2, 4, 7] and own.values == [0.5, 0.0, 0.7, 0.9]


def test_the_buckets_are_the_same_with_numpy_and_without():
    from trainguard.detectors.partials import _sketch, _sketch_arrays

    rng = random.Random(5)
    values = [rng.lognormvariate(0, 3) for _ in range(300)] + [0.0, 0.0, 1e-300, 1e300]
    small = [v for v in values[:100]]
    loop = {"n": len(values), "z": 2, "b": {}}
    for part in (values[i:i + 50] for i in range(0, len(values), 50)):   # below ARRAYS_FROM
        sk = _sketch(part)
        for i, (c, f, m) in sk["b"].items():
            b = loop["b"].setdefault(i, [0, f, 0.0])
            b[0] += c
            b[2] += m + c * (f - b[1])
    arrays = _sketch_arrays([small, values])
    assert arrays[0]["b"].keys() == _sketch(small)["b"].keys()
    assert arrays[1]["b"].keys() == loop["b"].keys() and arrays[1]["z"] == 2
    for i, (c, f, m) in arrays[1]["b"].items():
        assert c == loop["b"][i][0] and f + m / c == pytest.approx(loop["b"][i][1] + loop["b"][i][2] / c)


def test_the_partials_bench_finds_what_the_records_find():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import bench_step_partials

    result = bench_step_partials.one_size(512)
    assert result["partitions"] == 4 and result["same_findings"]
    assert result["findings"] == [("nan", [170], 40), ("throughput_drop", [], 60)]
    assert result["straggler_same_findings"]
    assert result["straggler_findings"] == [("straggler", [171], 15)]


def test_a_step_with_records_names_every_non_finite_rank():
    """The records' path names them all, as before partials (only a partial caps them)."""
    n = NAMED_UPTO + 76
    js = make_jobstep(4, 40.0, loss=[2.0] * 10 + [float("nan")] * n)
    (finding,) = NanDetector().update(js)
    assert finding.ranks == list(range(10, 10 + n))
    assert finding.evidence["nonfinite_loss_ranks"] == finding.ranks


def test_half_of_the_ranks_slow_still_stand_out_from_merged_partials():
    """The peers' median is read as the records' path reads it (without the rank itself):
    a whole slow machine, half of the ranks, stands out; against the median of all it
    would not, and the throughput detector would take a straggler's slowdown for a drop."""
    from trainguard.detectors.partials import standing_out

    js = make_jobstep(1, 1.0, compute_time=[1.0] * 8 + [1.4] * 8)
    want = sorted(standing_out(js, step_summary(js), 1.2))
    assert want == list(range(8, 16))
    parts = [partial_of({r: rec for r, rec in js["ranks"].items() if r % 2 == h}, exact_upto=0)
             for h in (0, 1)]
    merged = {**js, "agg": merge(parts)}
    assert sorted(standing_out(merged, merged["agg"], 1.2)) == want


def test_a_partial_survives_json():
    import orjson

    from trainguard.detectors.partials import from_wire

    rng = random.Random(11)
    ranks = {r: {"rank": r, "ts": 1.0, "loss": rng.uniform(0.1, 40.0), "step_time": 1.0,
                 "compute_time": rng.uniform(0.0, 2.0)} for r in range(300)}
    parts = [partial_of({r: ranks[r] for r in range(a, a + 100)}) for a in (0, 100, 200)]
    wire = [from_wire(orjson.loads(orjson.dumps(p, option=orjson.OPT_NON_STR_KEYS)))
            for p in parts]
    for field in ("loss", "step_time", "compute_time"):
        assert column_median(merge(wire)[field]) == column_median(merge(parts)[field])
        assert column_median(merge([wire[0], parts[1], parts[2]])[field]) == pytest.approx(
            column_median(merge(parts)[field]))
    assert slowest(merge(wire)["compute_time"]) == [
        tuple(p) for p in slowest(merge(parts)["compute_time"])]


def test_a_spike_detector_of_a_field_no_partial_carries_reads_the_records():
    from trainguard.detectors.training import SpikeDetector

    class LrSpike(SpikeDetector):
        FIELD, KIND, PREFIX = "lr", "lr_spike", "lr_spike"

    d = LrSpike(warmup=2, early_steps=0)
    found = []
    for s in range(30):
        js = make_jobstep(s, float(s), loss=[2.0, 2.0])
        for rec in js["ranks"].values():
            rec["lr"] = 1e-3 if s != 25 else 1e-2
        found += d.update(js)
    assert [(f.kind, f.step) for f in found] == [("lr_spike", 25)]
    assert d.update({**make_jobstep(31, 31.0, loss=[2.0]), "agg": None}) == []
