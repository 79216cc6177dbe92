"""The one entry point of trainguard's benchmarks: ``python bench/run.py NAME [--json]``.

Each benchmark is ``bench/bench_<name>.py`` with ``run() -> dict``. Figures are reported
with the baseline measured in the same run (this machine is shared and noisy); the latest
result of each is kept in ``bench/results/<name>.json`` for docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def available() -> list[str]:
    return sorted(p.stem[len("bench_"):] for p in HERE.glob("bench_*.py"))


def run_one(name: str) -> dict:
    sys.path.insert(0, str(HERE))
    module = importlib.import_module(f"bench_{name}")
    result = module.run()
    stamped = {"bench": name, "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "machine": f"{platform.node()} {platform.machine()} "
                          f"{_cpu_count()} cores {_memory_gib():.0f} GiB",
               "result": result}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(stamped, indent=2) + "\n")
    return result


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0))


def _memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", help=f"one of: {', '.join(available())}")
    parser.add_argument("--all", action="store_true", help="run every benchmark")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--list", action="store_true", help="list the benchmarks")
    args = parser.parse_args(argv)
    if args.list or not (args.name or args.all):
        print("\n".join(available()))
        return 0
    names = available() if args.all else [args.name]
    unknown = [n for n in names if n not in available()]
    if unknown:
        print(f"bench/run.py: error: no benchmark {unknown[0]!r}; one of: "
              f"{', '.join(available())}", file=sys.stderr)
        return 2
    results = {name: run_one(name) for name in names}
    out = results if args.all else results[names[0]]
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
