"""Shared fixtures: the real Kafka broker, per-test topic prefixes, paths to shared data."""
from __future__ import annotations

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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Order and group the tests for lanes (``pytest -n N --dist loadgroup``, scripts/test.sh).

    Slow tests go first so that the lanes start on them and no lane ends on a long tail. The
    tests of a module that shares a module-scoped fixture (a real job, a fresh venv) stay in one
    lane, so the fixture runs once, and the Slurm tests share one lane. The order is stable, so
    every lane collects the same list.
    """
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if "slurm" in defs:  # two loopback Slurm clusters at once name the same nodes
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif any(d.scope == "module" for fixturedefs in defs.values() for d in fixturedefs):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    items.sort(key=lambda item: 0 if item.get_closest_marker("slow") else 1)


@pytest.fixture
def shm():
    """A folder of its own under /dev/shm (host memory, as the node agent's snapshots)."""
    import shutil

    root = Path("/dev/shm") / f"tg-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)
