"""Issue 24's learned models, for bench_detection_quality: the machine-outlier model against
the rules alone (the same engine with ``machine_outlier_min_machines = 0``), on the same
recordings (tests/machine_library.py: machines that degrade without a flag, with and without
a later slowdown of their ranks, and healthy jobs whose machines differ steadily).

- ``recall``: degradations whose machine is named at or after the fault's onset, by a
  ``machine_outlier`` warning (``learned``) or by any finding of the rules (``rules``);
- ``lead_steps``: on the recordings with a slowdown, steps from the model's warning to the
  slowdown's start (``before_slowdown``) and to the rules' first finding on that machine
  (``before_rules``, the step time showing the problem);
- ``false``: incidents on every healthy recording (the machine set, the scenario library's
  healthy set, the unseen-shapes generator), machine_outlier warnings included;
- ``us_per_gpu_event``: the cost of the model per ``gpu`` event (64 machines of 8 GPUs, one
  sample per machine per second, 10 minutes): the machine's vector on its NodeStage, and the
  rounds on the JobStage.
"""
from __future__ import annotations

import bisect
import random
import statistics
import time

from machine_library import MACHINE_FAULTS, MACHINE_HEALTHY
from scenario_library import HEALTHY
from scenarios import recording

from trainguard import events as ev
from trainguard.detectors.config import DetectorConfig
from trainguard.setting import with_values
from trainguard.detectors.machine_outlier import MachineVector
from trainguard.detectors.offline import analyze_events

RULES = with_values(DetectorConfig(), {"machine_outlier.min_machines": 0})


def _run(events, config=None):
    engine, _ = analyze_events(events, config)
    anomalies = [a for stage in engine._jobs.values()
                 for inc in [stage.correlator] for a in _members(inc)]
    return engine.incidents(), anomalies


def _members(correlator) -> list:
    return [m for inc in correlator._closed + correlator._open for m in inc.members]


def _names(anomaly, node) -> bool:
    where = (anomaly.evidence or {}).get("rank_nodes") or {}
    return node in anomaly.nodes or node in where.values()


def _first(anomalies, node, since, kinds=None):
    hits = [a.detected_ts for a in anomalies if a.detected_ts >= since - 5.0
            and _names(a, node) and (kinds is None or a.kind in kinds)]
    return min(hits) if hits else None


def faults() -> dict:
    rows = []
    for sc in MACHINE_FAULTS:
        rec = recording(sc)
        truth = next(t for t in rec["truth"] if t.kind == "machine_outlier")
        slow = next((t for t in rec["truth"] if t.kind == "straggler"), None)
        node, ends = truth.nodes[0], rec["step_ends"]
        _, learned = _run(rec["events"])
        _, rules = _run(rec["events"], RULES)
        model_ts = _first(learned, node, truth.onset_ts, ("machine_outlier",))
        rules_ts = _first(rules, node, truth.onset_ts)
        step = lambda ts: bisect.bisect_right(ends, ts) if ts is not None else None  # noqa
        row = {"case": sc.name, "counter": truth.label,
               "learned_s": None if model_ts is None else round(model_ts - truth.onset_ts, 1),
               "rules_s": None if rules_ts is None else round(rules_ts - truth.onset_ts, 1)}
        if slow is not None and model_ts is not None:
            row["before_slowdown"] = step(slow.onset_ts) - step(model_ts)
            row["before_rules"] = None if rules_ts is None else step(rules_ts) - step(model_ts)
        rows.append(row)
    n = len(rows)
    leads = [r for r in rows if "before_slowdown" in r]
    return {
        "recordings": n,
        "recall": {"learned": round(sum(r["learned_s"] is not None for r in rows) / n, 3),
                   "rules": round(sum(r["rules_s"] is not None for r in rows) / n, 3)},
        "latency_s_median": {
            "learned": _median([r["learned_s"] for r in rows]),
            "rules": _median([r["rules_s"] for r in rows])},
        "lead_steps": {
            "before_slowdown_min": min((r["before_slowdown"] for r in leads), default=None),
            "before_rules_min": min((r["before_rules"] for r in leads
                                     if r["before_rules"] is not None), default=None),
            "before_rules_median": _median([r["before_rules"] for r in leads])},
        "cases": rows}


def _median(values):
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 1) if values else None


def healthy(unseen_seeds=(0,)) -> dict:
    """False incidents (and machine_outlier warnings) on every healthy recording."""
    from test_unseen_healthy_shapes import SHAPES
    from unseen_jobs import job_events

    sets = {"machine": [(sc.name, recording(sc)["events"]) for sc in MACHINE_HEALTHY],
            "library": [(sc.name, recording(sc)["events"]) for sc in HEALTHY],
            "unseen": [(f"{name}/{seed}", job_events(make(seed)))
                       for name, make in SHAPES.items() for seed in unseen_seeds]}
    out = {}
    for name, cases in sets.items():
        false, warnings, listed = 0, 0, []
        for case, events in cases:
            incidents, anomalies = _run(events)
            false += len(incidents)
            warnings += sum(a.kind == "machine_outlier" for a in anomalies)
            listed += [f"{case}: {i['kind']} {i['nodes']}" for i in incidents]
        out[name] = {"recordings": len(cases), "false_incidents": false,
                     "machine_outlier_warnings": warnings, "examples": listed[:8]}
    out["all_zero"] = all(v["false_incidents"] == 0 for v in out.values())
    return out


def cost(machines: int = 64, gpus: int = 8, seconds: int = 600) -> dict:
    """Microseconds per ``gpu`` event: the vector (NodeStage) and the rounds (JobStage)."""
    rng = random.Random(0)
    events = []
    for t in range(seconds):
        for m in range(machines):
            entries = [{"index": i, "uuid": f"G{m}-{i}", "util": 97.0 + rng.random(),
                        "sm_clock": 1980 - rng.randrange(20), "mem_clock": 2619,
                        "power": 600.0 + 10 * rng.random(), "power_limit": 700.0,
                        "temp": 60.0 + rng.random(), "mem_used": 70 << 30,
                        "mem_total": 80 << 30, "ecc_sbe": 0, "pcie_replay": 0,
                        "nvlink_errors": 0, "throttle": []} for i in range(gpus)]
            events.append(ev.Gpu(job="j", ts=1000.0 + t + m / machines, node=f"m{m}",
                                 gpus=entries, host={"cpu_util": 30.0 + rng.random(),
                                                     "net_rx_bytes": t << 30,
                                                     "net_tx_bytes": t << 30,
                                                     "tcp_retrans": t, "tcp_out_segs": t << 20}))
    vectors = {}
    t0 = time.perf_counter()
    for e in events:
        maker = vectors.get(e.node) or vectors.setdefault(e.node, MachineVector())
        maker.vector(e.ts, e.gpus, e.host)
    vector_us = (time.perf_counter() - t0) / len(events) * 1e6
    timings = {}
    for name, config in (("on", DetectorConfig()), ("off", RULES)):
        t0 = time.perf_counter()
        analyze_events(events, config)
        timings[name] = (time.perf_counter() - t0) / len(events) * 1e6
    rounds_us = max(0.0, timings["on"] - timings["off"])
    return {"machines": machines, "gpus_per_machine": gpus, "events": len(events),
            "vector_us": round(vector_us, 1), "rounds_us": round(rounds_us, 1),
            "total_us": round(vector_us + rounds_us, 1),
            "engine_us_per_gpu_event": {k: round(v, 1) for k, v in timings.items()}}


def run() -> dict:
    return {"machine_outlier": faults(), "healthy": healthy(), "cost": cost()}


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    print(json.dumps(run(), indent=1))
