"""The demo's chaos comparison as a benchmark: ETTR with trainguard and under plain
``torchrun --max-restarts=3`` (the baseline, measured in the same run), detection and recovery
seconds per fault, the training time lost per fault, and the projection to a 9,600-GPU job."""
import json
import os
import subprocess
import sys
import tempfile


def run() -> dict:
    with tempfile.TemporaryDirectory(prefix="tg-bench-ettr-") as out:
        proc = subprocess.run([sys.executable, "-m", "trainguard.cli", "demo", "--json",
                               "--minutes", os.environ.get("TRAINGUARD_BENCH_MINUTES", "8"),
                               "--out", out], capture_output=True, text=True, timeout=3600)
        if proc.returncode not in (0, 1) or not proc.stdout.strip():
            return {"error": f"demo exited {proc.returncode}: {proc.stderr.strip()[-500:]}"}
        card = json.loads(proc.stdout.strip().splitlines()[-1])
    faults = [{"kind": f["kind"], "ranks": f["ranks"],
               "detect_s": _delta(f["detected_ts"], f["injected_ts"]),
               "recover_s": _delta(f["recovered_ts"], f["injected_ts"]),
               "actions": f["actions"]} for f in card["faults"]]
    baseline = card.get("baseline") or {}
    return {"ettr": card["ettr"], "baseline_ettr": baseline.get("ettr"),
            "ettr_over_baseline": (round(card["ettr"] / baseline["ettr"], 3)
                                   if baseline.get("ettr") else None),
            "loss_per_fault_s": card["loss_per_fault_s"], "faults": faults,
            "baseline_faults": [{"kind": f["kind"], "recover_s": _delta(f["recovered_ts"],
                                                                       f["injected_ts"])}
                                for f in baseline.get("faults", [])],
            "completed": card["completed"], "wall_s": card["wall_s"],
            "baseline_wall_s": baseline.get("wall_s"), "projection": card["projection"]}


def _delta(later, earlier):
    return None if later is None else round(later - earlier, 1)
