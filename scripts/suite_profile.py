"""Measure what each test costs, for the lane order of tests/conftest.py (tests/durations.json).

A test's own process is the small part: most tests start training jobs, workers and brokers.
So every Python process of the run writes its CPU seconds and the test it belongs to (the
``PYTEST_CURRENT_TEST`` it inherited) to a folder, once a second and at exit, and the
plugin writes each test's wall and in-process CPU time. ``merge`` adds them up::

    python scripts/suite_profile.py run -- -n 2 --dist loadgroup
    python scripts/suite_profile.py merge                           # tests/durations.json

``run`` puts this folder first on ``PYTHONPATH`` (the ``sitecustomize`` below loads in every
Python process started with the environment) and loads the plugin with ``-p suite_profile``.
Processes killed within their first second, and those started with an environment of their
own, are not seen.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = Path(os.environ.get("SUITE_PROFILE_DIR", "/tmp/trainguard-suite-profile"))
DURATIONS = ROOT / "tests" / "durations.json"


def plain_id(nodeid: str) -> str:
    """A test's id without the ``@group`` that tests/conftest.py adds for the lanes."""
    return nodeid[:nodeid.rfind("@")] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


def start_process_probe() -> None:
    """In every process: write ``{test, argv, cpu}`` to WORK/procs/<pid>.json each second."""
    import threading

    folder, pid = WORK / "procs", os.getpid()

    def dump():
        t = os.times()
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        record = {"test": plain_id(test), "argv": sys.argv[:3],
                  "cpu": round(t.user + t.system, 2)}
        try:
            (folder / f"{pid}.json").write_text(json.dumps(record))
        except OSError:
            pass

    def loop():
        while True:
            time.sleep(1.0)
            dump()

    threading.Thread(target=loop, name="suite-profile", daemon=True).start()
    import atexit
    atexit.register(dump)


if "pytest" in sys.modules:  # loaded as the plugin (-p suite_profile), not as the probe
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        """Each test's wall and in-process CPU seconds, to WORK/tests.jsonl."""
        t0, c0 = time.monotonic(), time.process_time()
        yield
        with open(WORK / "tests.jsonl", "a") as out:
            out.write(json.dumps({"id": plain_id(item.nodeid),
                                  "wall": round(time.monotonic() - t0, 2),
                                  "cpu": round(time.process_time() - c0, 2)}) + "\n")


def merge() -> dict[str, list[float]]:
    """``{test id: [wall s, cpu s]}`` for every test of the last run that took 1 s or more."""
    tests = {}
    for line in (WORK / "tests.jsonl").read_text().splitlines():
        row = json.loads(line)
        tests[row["id"]] = [row["wall"], row["cpu"]]
    for path in (WORK / "procs").glob("*.json"):
        try:
            row = json.loads(path.read_text())
        except ValueError:
            continue
        if row["test"] in tests:
            tests[row["test"]][1] += row["cpu"]
    return {k: [round(w, 1), round(c, 1)] for k, (w, c) in sorted(tests.items()) if w >= 1.0}


def main(argv: list[str]) -> int:
    if argv[:1] == ["run"]:
        import shutil
        import subprocess

        shutil.rmtree(WORK, ignore_errors=True)
        (WORK / "procs").mkdir(parents=True)
        probe = WORK / "site"
        probe.mkdir()
        (probe / "sitecustomize.py").write_text(
            f"import sys\nsys.path.insert(0, {str(ROOT / 'scripts')!r})\n"
            "import suite_profile\nsuite_profile.start_process_probe()\n")
        env = {**os.environ, "SUITE_PROFILE_DIR": str(WORK),
               "PYTHONPATH": os.pathsep.join(filter(None, [
                   str(probe), str(ROOT / "scripts"), os.environ.get("PYTHONPATH")]))}
        rest = argv[2:] if argv[1:2] == ["--"] else argv[1:]
        return subprocess.call([sys.executable, "-m", "pytest", "-p", "suite_profile", *rest],
                               cwd=ROOT, env=env)
    if argv[:1] == ["merge"]:
        durations = merge()
        DURATIONS.write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}"
                                                 for k, v in durations.items()) + "\n}\n")
        print(f"{DURATIONS}: {len(durations)} tests, "
              f"{sum(w for w, _ in durations.values()):.0f} s wall, "
              f"{sum(c for _, c in durations.values()):.0f} s CPU")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
