"""Instructions a training step costs under ``--instrument`` and the callbacks, counted by
valgrind's callgrind: issue 11's per-step overhead, free of this shared machine's noise.

The loop, model and modes are ``instrument_overhead``'s (:func:`bench_instrument_overhead.setup`).
Each mode runs in a fresh interpreter under ``valgrind --tool=callgrind`` twice, with
``SHORT`` and ``LONG`` counted steps after the same warm-up (and, with hooks, their discovery),
so that ``(Ir(LONG) - Ir(SHORT)) / (LONG - SHORT)`` is one step's instructions, the import and
set-up cancelling. ``<mode>_added_instructions`` is that minus the plain loop's, and
``<mode>_added_share`` the same over the plain step's instructions. Their time equivalent,
``<mode>_added_us_at_plain_rate``, takes the plain loop's own rate (its 10th-percentile thread
time per step, measured natively in this run, over its instructions): Python-level hook code
runs at a lower rate than torch's kernels, so ``instrument_overhead``'s measured time is the
figure the target is judged by, and this one says how much work the hooks add.
Needs ``valgrind``; the runs take minutes (torch's import under callgrind).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("plain", "instrument", "hf", "lightning")
SHORT, LONG = 40, 240
WARM = 20
PARALLEL = 2


def _child(mode: str, steps: int) -> None:
    sys.path.insert(0, str(HERE))
    import bench_instrument_overhead as b

    torch, model, opt, loader, blocks, modes, _ = b.setup(4000)
    b._loop(torch, model, opt, loader, WARM)
    blocks[mode](WARM)          # the hooks' discovery of the top-level modules and gradients
    blocks[mode](steps)


def _instructions(mode: str, steps: int, folder: str) -> int:
    out = os.path.join(folder, f"callgrind.{mode}.{steps}")
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                    "--dump-instr=no", sys.executable, __file__, "--child", mode, str(steps)],
                   check=True, capture_output=True, timeout=3600)
    with open(out) as f:
        for line in f:
            found = re.match(r"(summary|totals): (\d+)", line)
            if found:
                return int(found.group(2))
    raise RuntimeError(f"no instruction total in {out}")


def _plain_step_s() -> float:
    sys.path.insert(0, str(HERE))
    import bench_instrument_overhead as b

    torch, model, opt, loader, blocks, _, _ = b.setup(4000)
    b._loop(torch, model, opt, loader, WARM)
    times = sorted(blocks["plain"](2000)[WARM:])
    return times[len(times) // 10]


def run() -> dict:
    if shutil.which("valgrind") is None:
        return {"skipped": "valgrind is not installed"}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(PARALLEL) as pool:
        jobs = {(m, n): pool.submit(_instructions, m, n, folder)
                for m in MODES for n in (SHORT, LONG)}
        counts = {key: job.result() for key, job in jobs.items()}
    per_step = {m: (counts[m, LONG] - counts[m, SHORT]) / (LONG - SHORT) for m in MODES}
    plain_s = _plain_step_s()
    rate = per_step["plain"] / plain_s          # instructions per second of the plain loop
    out = {"steps_counted": LONG - SHORT, "plain_instructions": round(per_step["plain"]),
           "plain_step_us": round(plain_s * 1e6, 1)}
    for mode in MODES[1:]:
        added = per_step[mode] - per_step["plain"]
        out[f"{mode}_added_instructions"] = round(added)
        out[f"{mode}_added_share"] = round(added / per_step["plain"], 4)
        out[f"{mode}_added_us_at_plain_rate"] = round(added / rate * 1e6, 1)
    out["target_added_us"] = 20.0
    out["seconds"] = round(time.perf_counter() - started)
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _child(sys.argv[2], int(sys.argv[3]))
    else:
        print(json.dumps(run(), indent=2))
