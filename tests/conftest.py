"""Shared fixtures: the real Kafka broker, per-test topic prefixes, paths to shared data."""
from __future__ import annotations

import json
import os
import tempfile
import uuid
from pathlib import Path

import pytest

from trainguard.config import Config, Topics

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is not there (the project's ../shared/data)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def kafka_bootstrap():
    """Bootstrap of a real broker: $TRAINGUARD_BOOTSTRAP when set, else one started here."""
    if os.environ.get("TRAINGUARD_BOOTSTRAP"):
        yield os.environ["TRAINGUARD_BOOTSTRAP"]
        return
    from trainguard.broker import free_port, local_broker

    data = tempfile.mkdtemp(prefix="tg-test-broker-")
    broker = local_broker(port=free_port(), data=data)
    broker.start(log=lambda m: None)
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture
def topic_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
def kafka_config(kafka_bootstrap, topic_prefix) -> Config:
    """A config on the real broker with this test's own topics, already created."""
    from trainguard.topics import TopicPlan, create_topics

    config = Config(bootstrap=kafka_bootstrap, topics=Topics(prefix=topic_prefix))
    create_topics(config, TopicPlan(telemetry_partitions=4, other_partitions=2))
    return config


DURATIONS = Path(__file__).with_name("durations.json")  # scripts/suite_profile.py writes it
UNMEASURED = (0.25, 0.2)  # wall and CPU seconds of a test not in it (one under 1 s)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Group and order the tests for lanes (``pytest -n N --dist loadgroup``, scripts/test.sh).

    The tests of a module that shares a module-scoped fixture (a real job, a fresh venv) stay
    in one lane, so the fixture runs once, and the Slurm tests share one lane. The units of
    work are then ordered by :func:`lane_order` from the measured costs in durations.json. The
    order is stable, so every lane collects the same list.
    """
    units: dict[str, list] = {}
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if "slurm" in defs:  # two loopback Slurm clusters at once name the same nodes
            unit = "slurm"
        elif any(d.scope == "module" for fixturedefs in defs.values() for d in fixturedefs):
            unit = item.module.__name__
        else:
            unit = item.nodeid
        units.setdefault(unit, []).append(item)
    measured = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    costs = {unit: tuple(map(sum, zip(*(measured.get(i.nodeid, UNMEASURED) for i in members))))
             for unit, members in units.items()}
    items[:] = [item for unit in lane_order(costs) for item in units[unit]]
    waiting = waiting_lane(costs, lanes_of(config))
    for unit, members in units.items():
        group = WAITING if unit in waiting else unit
        if len(members) > 1 or unit == "slurm" or unit in waiting:
            for item in members:
                in_group(item, group)


def lanes_of(config) -> int:
    """How many lanes run the tests (xdist tells its workers; collection happens there)."""
    workerinput = getattr(config, "workerinput", None)
    return int(workerinput.get("workercount", 1)) if workerinput else 1


WAITING = "waiting"
WAITING_SHARE = 0.7


def waiting_lane(costs: dict[str, tuple[float, float]], lanes: int) -> set[str]:
    """With three lanes or more: the units that mostly wait, longest first, up to 0.7 of one
    lane's share of the suite's wall time, all in one lane (the group ``waiting``).

    That lane waits on real time (a worker judging a hang, a broker failing over) while the
    others compute, so for most of the run no more busy units run at once than there are
    lanes less one: three lanes where the CPU-bound tests see two cores shared by two, not
    three (a starved job's compute times are what some tests measure). With fewer lanes
    nothing is grouped this way (the waiting units are spread among the busy ones instead).

    >>> sorted(waiting_lane({"a": (100, 90), "b": (60, 2), "c": (50, 45), "d": (30, 1),
    ...                      "e": (40, 1)}, lanes=3))    # 0.7 of a third of 280 s: b
    ['b']
    >>> waiting_lane({"a": (100, 90), "b": (60, 2)}, lanes=2)
    set()
    """
    if lanes < 3:
        return set()
    # less than a full share: the waiting tests slow down beside two busy lanes (the whole
    # waiting set, 843 s measured in two lanes, took about 900 s in three and ended last)
    share = WAITING_SHARE * sum(wall for wall, _ in costs.values()) / lanes
    chosen, total = set(), 0.0
    for unit in sorted(costs, key=lambda u: -costs[u][0]):
        wall, cpu = costs[unit]
        if unit != "slurm" and cpu < 0.5 * wall and total + wall <= share:
            chosen.add(unit)
            total += wall
    return chosen


def in_group(item, group: str) -> None:
    """Keep ``item`` in the lane of the other tests of ``group`` (``--dist loadgroup``).

    xdist groups a test by the ``@group`` it appends to the test's id. Under pytest 9 the id
    lives in ``Node._id`` and xdist 3.8's ``item._nodeid = ...`` is lost: no test was grouped,
    two Slurm clusters ran at once and shared fixtures ran once per lane. So the id is set
    here (xdist's own suffix, where it works, names the same group again).
    """
    item.add_marker(pytest.mark.xdist_group(group))
    if getattr(item.config.option, "loadgroup", False) and hasattr(item, "_id") \
            and not item.nodeid.endswith(f"@{group}"):
        item._id = type(item._id).parse(f"{item.nodeid}@{group}")


def lane_order(costs: dict[str, tuple[float, float]]) -> list[str]:
    """Units of work, longest first, the waiting ones spread evenly among the busy ones.

    A unit that mostly waits (a worker judging in real time, a broker failing over) uses
    little CPU; two of them side by side leave the cores idle, and two busy ones share them.
    So the units that use less than half a core are interleaved with the others in proportion
    to their wall time. ``costs`` maps a unit to its (wall, CPU) seconds.

    >>> lane_order({"a": (100, 90), "b": (60, 2), "c": (50, 45), "d": (30, 1), "e": (1, 1)})
    ['a', 'b', 'c', 'd', 'e']
    """
    longest_first = sorted(costs, key=lambda u: -costs[u][0])
    busy = [u for u in longest_first if costs[u][1] >= 0.5 * costs[u][0]]
    waiting = [u for u in longest_first if costs[u][1] < 0.5 * costs[u][0]]
    totals = [sum(costs[u][0] for u in us) or 1.0 for us in (busy, waiting)]
    done = [0.0, 0.0]
    order = []
    while busy or waiting:
        side = 0 if not waiting or (busy and done[0] / totals[0] <= done[1] / totals[1]) else 1
        unit = (busy, waiting)[side].pop(0)
        done[side] += costs[unit][0]
        order.append(unit)
    return order


@pytest.fixture
def shm():
    """A folder of its own under /dev/shm (host memory, as the node agent's snapshots)."""
    import shutil

    root = Path("/dev/shm") / f"tg-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


def pytest_runtest_logreport(report):
    """With ``TRAINGUARD_SUITE_TIMELINE=FILE``: each phase of each test, its lane and its wall
    clock span, one JSON line appended to FILE (docs/TESTING.md: where a run's time went)."""
    path = os.environ.get("TRAINGUARD_SUITE_TIMELINE")
    lane = os.environ.get("PYTEST_XDIST_WORKER", "main")
    if path and not (lane == "main" and hasattr(report, "node")):   # xdist's controller
        with open(path, "a") as f:
            f.write(json.dumps({"lane": lane, "test": report.nodeid, "when": report.when,
                                "start": report.start, "stop": report.stop,
                                "outcome": report.outcome}) + "\n")
