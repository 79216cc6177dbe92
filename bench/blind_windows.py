"""Issue 19's blind windows, for bench_detection_quality: hangs in steps 1-10 of a job and
in the first steps after a restart, ranks stuck in a checkpoint their peers left. Each case
runs through trainguard's engine (``trainguard analyze``), through the same engine with the
hang detector of the commit before this issue (``before``: no peers' evidence, the first-step
budget until five intervals are learned; read with ``git show``) and through the rule page
(bench/baseline_rules.py), on the same events.

Latency is from the hang (the hung rank's step began; for a stuck checkpoint, its peers left
it) to the incident. Targets: ``max(30 s, 3 x the step time)`` for a hang between steps,
60 s from the peers' leaving for a stuck phase."""
from __future__ import annotations

import statistics
import subprocess
import types
from pathlib import Path

from baseline_rules import baseline_incidents
from peer_jobs import Job, to_events

from trainguard.detectors.config import DetectorConfig
from trainguard.detectors.offline import analyze_events

T0 = 1_764_680_000.0
BEFORE_COMMIT = "34b43f6"        # the last commit before issue 19
REPO = Path(__file__).resolve().parent.parent


def _engine(hang_class=None):
    def tune(job, stage):
        old = stage.detectors["hang"]
        new = hang_class(**DetectorConfig().params_for(hang_class))
        stage.detectors["hang"] = new
        for table in stage._routes.values():
            table[:] = [new if d is old else d for d in table]

    def detect(events):
        engine, _ = analyze_events(events, tune_stage=tune if hang_class else None)
        return engine.incidents()
    return detect


def _hang_before():
    """The hang detector as it was at ``BEFORE_COMMIT`` (None without the git history)."""
    shown = subprocess.run(["git", "show", f"{BEFORE_COMMIT}:detectors/hang.py"], cwd=REPO,
                           capture_output=True, text=True)
    if shown.returncode != 0:
        return None
    module = types.ModuleType("trainguard.detectors.hang_before")
    module.__package__ = "trainguard.detectors"
    exec(compile(shown.stdout, f"{BEFORE_COMMIT}:detectors/hang.py", "exec"), module.__dict__)
    return module.HangDetector


def _detectors() -> dict:
    found = {"trainguard": _engine(), "baseline": baseline_incidents}
    before = _hang_before()
    if before is not None:
        found["before"] = _engine(before)
    return found


def _cases() -> list:
    """``(group, name, events, hang_at, target_s)``."""
    cases = []
    for step_s in (2.0, 6.0, 30.0):
        for hang_step in (1, 2, 3, 5, 8, 10):
            job = Job(steps=14, step_s=step_s, first_step_s=step_s, hang_step=hang_step,
                      start=T0)
            _, _, hang_at = job.timelines()
            cases.append(("early_hang", f"{step_s:g}s-steps-hang-at-step-{hang_step}",
                          to_events(job, hang_at + 1900.0), hang_at, max(30.0, 3 * step_s)))
    issue = Job(steps=12, checkpoint_after=(4,), hang_step=6, start=T0)
    _, _, hang_at = issue.timelines()
    cases.append(("early_hang", "issue-6s-steps-45s-checkpoint-hang-at-step-6",
                  to_events(issue, hang_at + 1900.0), hang_at, 30.0))
    for step_s in (2.0, 6.0):
        for hang_step in (1, 2):
            first = Job(steps=20, step_s=step_s, first_step_s=step_s, start=T0)
            first.timelines()
            events = to_events(first, first.end + 10.0)
            again = Job(steps=6, step_s=step_s, first_step_s=step_s, hang_step=hang_step,
                        start=first.end + 60.0)
            _, _, hang_at = again.timelines()
            cases.append(("after_restart", f"{step_s:g}s-steps-hang-at-step-{hang_step}",
                          events + to_events(again, hang_at + 1900.0), hang_at,
                          max(30.0, 3 * step_s)))
    for ck in (20.0, 60.0, 300.0):
        job = Job(steps=12, checkpoint_after=(3, 7), checkpoint_s=ck, stuck_checkpoint=7,
                  start=T0, world=4)
        _, _, peers_left = job.timelines()
        cases.append(("phase_stuck", f"checkpoint-{ck:g}s-rank-1-stays",
                      to_events(job, peers_left + 1900.0), peers_left, 60.0))
    return cases


def run() -> dict:
    cases = _cases()
    out = {"cases": len(cases), "targets": {
        "early_hang": "<= max(30 s, 3 x the step time) from the hang",
        "after_restart": "<= max(30 s, 3 x the step time) from the hang",
        "phase_stuck": "<= 60 s from the moment its peers left the phase"}}
    out["before_commit"] = BEFORE_COMMIT
    for name, detect in _detectors().items():
        groups: dict = {}
        for group, case, events, hang_at, target in cases:
            hangs = [i for i in detect(events) if i["kind"] == "hang"
                     and i["detected_ts"] >= hang_at - 1.0]
            first = min(hangs, key=lambda i: i["detected_ts"]) if hangs else None
            latency = round(first["detected_ts"] - hang_at, 1) if first else None
            groups.setdefault(group, []).append({
                "case": case, "found": first is not None,
                "exact": bool(first) and first["ranks"] == [1],
                "latency_s": latency, "target_s": target,
                "ok": latency is not None and latency <= target})
        out[name] = {g: _summary(rows) for g, rows in groups.items()}
    return out


def _summary(rows: list) -> dict:
    lat = [r["latency_s"] for r in rows if r["latency_s"] is not None]
    return {"cases": len(rows), "found": sum(r["found"] for r in rows),
            "exact": sum(r["exact"] for r in rows), "within_target": sum(r["ok"] for r in rows),
            "median_latency_s": round(statistics.median(lat), 1) if lat else None,
            "worst_latency_s": max(lat) if lat else None, "each": rows}


RECORDINGS = REPO / "tests" / "data" / "recordings"


def loader_stragglers() -> dict:
    """The real 3-rank jobs of bench/record_loader_jobs.py (rank 1's data loader 0.1 s a batch
    slower, or every rank's): who each detector names a straggler, and rank 1's compute time
    over its peers' (medians of steps 1-21)."""
    from trainguard.recording import read_events

    out = {}
    for path in sorted(RECORDINGS.glob("loader-*.jsonl.gz")):
        case = path.name.removesuffix(".jsonl.gz")
        events = list(read_events(path))
        want = [] if case.endswith("-all") else [1]
        row = {"want": want, "compute_ratio": _compute_ratio(events)}
        for name, detect in (("trainguard", _engine()), ("baseline", baseline_incidents)):
            named = sorted({r for i in detect(events) if i["kind"] == "straggler"
                            for r in i["ranks"]})
            row[name] = {"named": named, "exact": named == want}
        out[case] = row
    return out


def _compute_ratio(events) -> float | None:
    by_rank: dict = {}
    for e in events:
        if e.type == "step" and e.step >= 1 and e.compute_time:
            by_rank.setdefault(e.rank, []).append(e.compute_time)
    if 1 not in by_rank or len(by_rank) < 2:
        return None
    peers = max(statistics.median(v) for r, v in by_rank.items() if r != 1)
    return round(statistics.median(by_rank[1]) / peers, 2) if peers else None


def grad_led(per_detector_results: dict) -> dict:
    """The scenario library's gradient-led spikes (the norm 4x, 16x, ... before the loss moves,
    two steps later): found within one step of the rise's second step, the target."""
    out = {}
    for name, results in per_detector_results.items():
        rows = [r for r in results if r["label"] == "grad-led spike"]
        lat = [r["latency_steps"] for r in rows if r["found"]]
        out[name] = {"cases": len(rows), "found": sum(r["found"] for r in rows),
                     "within_target": sum(r["ok"] for r in rows),
                     "worst_latency_steps": max(lat) if lat else None,
                     "target": "<= 1 step after the rise's second step (2 after its start)"}
    return out
