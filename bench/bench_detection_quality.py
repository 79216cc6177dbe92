"""Detection quality of trainguard's detectors (``trainguard analyze``'s Engine) against a page of
fixed-threshold rules (bench/baseline_rules.py), in the same run, on the same recordings:

- the scenario library (tests/scenarios.py): the healthy set (every shape of a healthy job)
  and the fault set (every kind, intermittent and gradual onsets, faults during checkpoints,
  stragglers inside one pipeline stage, spikes led by the gradient norm, several faults and
  restarts per recording), scored by tests/scenario_scoring.py;
- the real traces of ../shared/data: alibaba-pai job 2 (workers differing steadily: healthy),
  jobs 3 and 4 (workers falling behind; the truth as read off the data: job 3, workers 6-9
  from sample ~214; job 4, worker 6 from ~100 to ~450, workers 3 and 9 around sample 1670,
  workers 5 and 6 from ~1870),
  and real loss curves (Pythia 70m-0, the two modded-nanogpt runs), which must stay quiet.

Per detector: false incidents on the healthy set and the real healthy traces, recall on the
faults, exact localization, median and worst latency per kind (seconds; steps for
straggler, spike and NaN), and the issue's targets. ``beats_baseline`` compares every line
(per kind: found, then exactly localized, then the worst latency, in that order).

``blind_windows`` (issue 19, bench/blind_windows.py): hangs in steps 1-10 and after a
restart, ranks stuck in a checkpoint their peers left (trainguard beside the hang detector of
the commit before the issue and beside the rule page); data-loader stragglers in real
torchrun jobs (tests/data/recordings/loader-*, made by bench/record_loader_jobs.py); the
library's gradient-led spikes.

``learned`` (issue 24, bench/learned_models.py): the machine-outlier model against the rules
alone on machines that degrade without a flag; recall, lead time in steps, false incidents
on every healthy recording, cost per gpu event.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

import blind_windows  # noqa: E402
import learned_models  # noqa: E402
from baseline_rules import baseline_incidents  # noqa: E402
from real_traces import alibaba_job, loss_curve_job  # noqa: E402
from scenario_library import FAULTS, HEALTHY  # noqa: E402
from scenario_scoring import score  # noqa: E402
from scenarios import Truth, recording  # noqa: E402

from trainguard.detectors.offline import analyze_events  # noqa: E402

STEP_KINDS = ("straggler", "spike", "nan")
TARGETS = {"hang": "<= max(30 s, 3 x the job's p99 step time)",
           "hang_in_checkpoint": "<= the checkpoint's allowance (30 min by default) + 30 s",
           "straggler": "<= 30 steps (+ the ramp of a gradual onset)",
           "spike": "<= 2 steps", "nan": "<= 1 step", "crash": "<= 2 s (SIGKILL: grace + 1 s)",
           "gpu_fault": "<= 2 s"}


def trainguard_incidents(events):
    engine, _ = analyze_events(events)
    return engine.incidents()


DETECTORS = {"trainguard": trainguard_incidents, "baseline": baseline_incidents}


def _real_cases(shared):
    """``(name, events, truth, step_ends)`` of the real traces."""
    import test_detectors_realdata as real
    cases = []
    for n, truths in ((2, []), (3, [([6, 7, 8, 9], 214)]),
                      (4, [([6], 100), ([3, 9], 1665), ([5, 6], 1866)])):
        events = alibaba_job(n)
        ends = sorted({e.ts for e in events if e.type == "step" and e.rank == 0})
        truth = [Truth(kind="straggler", ranks=r, nodes=[], onset_ts=ends[s], step=s,
                       limit_s=1e9, limit_steps=30, label=f"alibaba job {n}") for r, s in truths]
        cases.append((f"alibaba-job-{n}", events, truth, ends))
    curve = real.pythia(shared, "70m-0")[:6000]
    cases.append(("pythia-70m-0", loss_curve_job(curve, job="p70m"), [], []))
    for name in sorted(real.NANOGPT):
        curve = [(s, loss) for s, loss, _ in real.nanogpt(shared, name)]
        cases.append((f"nanogpt-{name}", loss_curve_job(curve, job=name), [], []))
    return cases


def _summary(results: list, false_healthy: int, healthy_cases: int) -> dict:
    found = [r for r in results if r["found"]]
    by_kind: dict = {}
    for r in results:       # a hang inside a checkpoint has the phase's allowance as target
        kind = "hang_in_checkpoint" if r["label"] == "hang in checkpoint" else r["kind"]
        by_kind.setdefault(kind, []).append(r)
    kinds = {}
    for kind, rs in sorted(by_kind.items()):
        hit = [r for r in rs if r["found"]]
        unit = "latency_steps" if kind in STEP_KINDS else "latency_s"
        lat = [r[unit] for r in hit]
        kinds[kind] = {"cases": len(rs), "found": len(hit),
                       "exact": sum(r["exact"] for r in rs),
                       "within_target": sum(r["ok"] for r in rs),
                       "unit": "steps" if kind in STEP_KINDS else "s",
                       "median_latency": round(statistics.median(lat), 3) if lat else None,
                       "worst_latency": round(max(lat), 3) if lat else None}
    n = len(results)
    return {"false_incidents_healthy": false_healthy, "healthy_recordings": healthy_cases,
            "faults": n, "recall": round(len(found) / n, 4) if n else None,
            "exact_localization": round(sum(r["exact"] for r in results) / n, 4) if n else None,
            "within_target": round(sum(r["ok"] for r in results) / n, 4) if n else None,
            "per_kind": kinds}


def run() -> dict:
    shared = HERE.parent.parent / "shared" / "data"
    cases = [(sc.name, recording(sc)) for sc in HEALTHY + FAULTS]
    real = _real_cases(shared) if shared.exists() else []
    out = {"library": {"healthy": len(HEALTHY), "faults": len(FAULTS),
                       "fault_cases": sum(len(r["truth"]) for _, r in cases),
                       "events": sum(len(r["events"]) for _, r in cases)},
           "targets": TARGETS}
    all_results = {}
    for name, detect in DETECTORS.items():
        t0 = time.process_time()
        results, false_healthy, false_faults, false_list = [], 0, 0, []
        for case, rec in cases:
            s = score(detect(rec["events"]), rec["truth"], rec["step_ends"])
            results += s["results"]
            if rec["truth"]:
                false_faults += s["false"]
            else:
                false_healthy += s["false"]
            false_list += [f"{case}: {f['kind']} {f['ranks']}" for f in s["false_incidents"]]
        real_results, real_false = [], []
        for case, events, truth, ends in real:
            s = score(detect(events), truth, ends)
            real_results += [{**r, "case": case} for r in s["results"]]
            real_false += [f"{case}: {f['kind']} {f['ranks']}" for f in s["false_incidents"]]
        all_results[name] = results
        summary = _summary(results, false_healthy, len(HEALTHY))
        summary["false_incidents_in_fault_recordings"] = false_faults
        summary["false_incident_examples"] = false_list[:12]
        summary["real_traces"] = {
            "false_incidents": len(real_false), "false_incident_list": real_false[:12],
            "episodes": [{"case": r["case"], "found": r["found"], "exact": r["exact"],
                          "got": r.get("got", {}).get("ranks"),
                          "want": r.get("want", {}).get("ranks"),
                          "latency_steps": r["latency_steps"]} for r in real_results]}
        summary["cpu_seconds"] = round(time.process_time() - t0, 2)
        out[name] = summary
    out["beats_baseline"] = _compare(out["trainguard"], out["baseline"])
    out["blind_windows"] = blind_windows.run()
    out["blind_windows"]["loader_stragglers"] = blind_windows.loader_stragglers()
    out["blind_windows"]["grad_led_spikes"] = blind_windows.grad_led(all_results)
    out["learned"] = learned_models.run()     # issue 24: the machine-outlier model
    tg = out["trainguard"]
    out["targets_met"] = (tg["false_incidents_healthy"] == 0 and tg["recall"] >= 0.98
                          and tg["exact_localization"] == 1.0 and tg["within_target"] == 1.0)
    return out


def _compare(tg: dict, base: dict) -> dict:
    """Per line: is trainguard at least as good as the baseline, and better somewhere?"""
    lines = {
        "false_incidents_healthy": tg["false_incidents_healthy"] <= base["false_incidents_healthy"],
        "false_incidents_real": tg["real_traces"]["false_incidents"]
        <= base["real_traces"]["false_incidents"],
        "recall": tg["recall"] >= base["recall"],
        "exact_localization": tg["exact_localization"] >= base["exact_localization"],
        "within_target": tg["within_target"] >= base["within_target"],
    }
    for kind, mine in tg["per_kind"].items():
        theirs = base["per_kind"].get(kind, {})
        # found, then exactly localized, then the worst latency
        ours = (mine["found"], mine["exact"], -(mine["worst_latency"] or 0))
        their = (theirs.get("found", 0), theirs.get("exact", 0),
                 -(theirs.get("worst_latency") or 0))
        better = ours >= their
        lines[f"{kind}"] = better
    lines["all"] = all(lines.values())
    return lines


if __name__ == "__main__":
    import json
    print(json.dumps(run(), indent=2))
