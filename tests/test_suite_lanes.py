"""The lanes of the suite (tests/conftest.py, scripts/test.sh): a module's tests that share a
module-scoped fixture run in one lane, so the fixture (a real job) runs once, and the tests of
one group never run side by side. Under pytest 9 xdist's own grouping was silently lost; this
runs a small suite in two lanes with the real conftest and looks where each test ran."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = '''
import os, time, pytest

@pytest.fixture(scope="module", params=["a", "b"])
def job(request):
    time.sleep(0.3)
    return request.param

@pytest.mark.parametrize("n", range(3))
def test_shares_the_job(job, n):
    pass

@pytest.mark.parametrize("n", range(4))
def test_alone(n):
    time.sleep(0.2)
'''


def test_a_modules_tests_that_share_a_module_fixture_run_in_one_lane(tmp_path):
    pytest.importorskip("xdist")
    folder = tmp_path / "tests"
    folder.mkdir()
    shutil.copy(Path(__file__).with_name("conftest.py"), folder / "conftest.py")
    (folder / "test_shared.py").write_text(SUITE)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist",
         "loadgroup", "-v", "-o", "addopts=", str(folder)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    lanes = {}
    for lane, test in re.findall(r"\[(gw\d)\] \[\s*\d+%\] PASSED (\S+)", run.stdout):
        lanes[test] = lane
    shared = {lane for test, lane in lanes.items() if "test_shares_the_job" in test}
    assert len(lanes) == 10 and len(shared) == 1, run.stdout[-3000:]
    assert all(test.endswith("@test_shared") for test in lanes if "shares" in test)


def test_the_units_go_longest_first_with_the_waiting_ones_spread_among_the_busy_ones():
    from conftest import lane_order

    costs = {"busy-100": (100, 90), "busy-50": (50, 45), "busy-10": (10, 9), "busy-9": (9, 8),
             "waits-60": (60, 2), "waits-30": (30, 1)}
    assert lane_order(costs) == ["busy-100", "waits-60", "busy-50", "waits-30", "busy-10",
                                 "busy-9"]
    assert lane_order({}) == []


def test_with_three_lanes_the_waiting_units_share_one_lane():
    import doctest

    import conftest
    from conftest import waiting_lane

    assert doctest.run_docstring_examples(waiting_lane, {"waiting_lane": waiting_lane}) is None
    assert doctest.testmod(conftest).failed == 0
    costs = {"busy": (500, 490), "waits-200": (200, 3), "waits-90": (90, 1),
             "waits-20": (20, 1), "slurm": (50, 2)}
    # 0.7 of a third of 860 s is 200.7 s: the longest waiting unit, then what still fits
    # (nothing here); Slurm never
    assert waiting_lane(costs, 3) == {"waits-200"}
    costs["waits-200"] = (170, 3)
    assert waiting_lane(costs, 3) == {"waits-200", "waits-20"}      # 0.7 * 830 / 3 = 193.7
    assert waiting_lane(costs, 2) == set()
