"""What trainguard costs a training rank to load: ``import trainguard`` and ``trainguard.init``
in the base install (``pip install trainguard``) against the full one (``trainguard[server]``,
what ``pip install trainguard`` installed before the two installs), measured in the same run.

Both installs are built fresh (tests/base_install.py) from this checkout. Each sample is a new
process running tests/rank_probe.py against a closed port (the collector never waits on
Kafka): the time of ``import trainguard``, of ``init``, and until its Kafka producer is
loaded, plus the whole process's wall time (interpreter start, the site's ``.pth`` files and
a ``close`` that does not wait included). One warm-up per install (bytecode compiled), then
REPEATS alternating samples; medians. Also each install's distributions and site-packages size (the fresh environment's
own pip and setuptools left out)."""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from base_install import create_base_venv, installed, site_packages_bytes  # noqa: E402

PROBE = HERE.parent / "tests" / "rank_probe.py"
REPEATS = 9
TIMES = ("import_s", "init_s", "ready_s", "process_s")
ENVIRONMENT_TOOLS = {"pip", "setuptools"}  # what python -m venv brings


def probe(python: Path, home: Path) -> dict:
    from trainguard.broker import free_port

    start = time.perf_counter()
    done = subprocess.run([str(python), str(PROBE), "bench-import", f"127.0.0.1:{free_port()}",
                           "tg", "3", "0"], capture_output=True, text=True, timeout=60, cwd=home,
                          env={"PATH": "/usr/bin:/bin", "TRAINGUARD_HOME": str(home)})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"rank probe failed: {done.stderr[-2000:]}")
    return {**json.loads(done.stdout), "process_s": wall}


def install_figures(python: Path) -> dict:
    return {"distributions": sorted(set(installed(python)) - ENVIRONMENT_TOOLS),
            "site_packages_mb": round(site_packages_bytes(python) / 1e6, 1)}


def summarize(samples: list[dict]) -> dict:
    medians = {k: round(statistics.median(s[k] for s in samples) * 1000, 1) for k in TIMES}
    return {"median_ms": medians,
            "modules_loaded": statistics.median(s["modules"] for s in samples),
            "third_party_loaded": samples[-1]["third_party"],
            "samples": len(samples)}


def measure(pythons: dict[str, Path], home: Path) -> dict[str, dict]:
    for python in pythons.values():
        probe(python, home)
    samples: dict[str, list] = {name: [] for name in pythons}
    for _ in range(REPEATS):
        for name, python in pythons.items():
            samples[name].append(probe(python, home))
    return {name: summarize(got) for name, got in samples.items()}


def run() -> dict:
    work = Path(tempfile.mkdtemp(prefix="tg-import-cost-"))
    try:
        return compare_installs(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def compare_installs(work: Path) -> dict:
    started = time.perf_counter()
    base = create_base_venv(work / "base")
    base_install_s = time.perf_counter() - started
    started = time.perf_counter()
    full = create_base_venv(work / "full", extras="server")
    full_install_s = time.perf_counter() - started
    home = work / "home"
    home.mkdir()
    result = measure({"base": base, "full": full}, home)
    result["base"].update(install_figures(base), install_s=round(base_install_s, 1))
    result["full"].update(install_figures(full), install_s=round(full_install_s, 1))
    base_ms, full_ms = result["base"]["median_ms"], result["full"]["median_ms"]
    result["ratio_base_over_full"] = {k: round(base_ms[k] / full_ms[k], 2) for k in TIMES
                                      if full_ms[k]}
    result["size_ratio_base_over_full"] = round(
        result["base"]["site_packages_mb"] / result["full"]["site_packages_mb"], 3)
    result["repeats"] = REPEATS
    return result
