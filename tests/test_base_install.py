"""`pip install trainguard` in a fresh environment: what it pulls in, and that a rank reports.

The server extra (worker, action service, agent, tools) must stay out of a training
environment; its commands and modules say in one line which install they need."""
from __future__ import annotations

import json
import subprocess
import uuid

import pytest

from base_install import REPO, SERVER_DISTRIBUTIONS, create_base_venv, installed
from collector_harness import by_type, consume

pytestmark = [pytest.mark.slow, pytest.mark.broker]

PROBE = REPO / "tests" / "rank_probe.py"
SERVER_INSTALL = "pip install 'trainguard[server]'"


@pytest.fixture(scope="module")
def base_python(tmp_path_factory):
    return create_base_venv(tmp_path_factory.mktemp("base-install"))


def run(python, *argv, env=None, timeout=60):
    """In a folder of its own: from the checkout, ``python -c`` would import the sources."""
    return subprocess.run([str(python), *argv], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=python.parents[2])


def test_base_install_pulls_in_only_the_rank_side(base_python):
    names = installed(base_python)
    assert {"trainguard", "confluent-kafka", "orjson"} <= set(names)
    assert sorted(set(SERVER_DISTRIBUTIONS) & set(names)) == []


def test_a_rank_reports_from_the_base_install(base_python, kafka_config, tmp_path):
    job = f"base-{uuid.uuid4().hex[:8]}"
    env = {"PATH": "/usr/bin:/bin", "TRAINGUARD_HOME": str(tmp_path)}
    done = run(base_python, str(PROBE), job, kafka_config.bootstrap,
               kafka_config.topics.prefix, "3", env=env)
    assert done.returncode == 0, done.stderr
    probe = json.loads(done.stdout)
    assert probe["third_party"] == ["confluent_kafka", "orjson"]

    events = consume(kafka_config.bootstrap, kafka_config.topics.telemetry, timeout=30,
                     done=lambda got: any(e.event == "exit" for e in by_type(got, "lifecycle")))
    mine = [e for e in events if not isinstance(e, Exception) and e.job == job]
    assert [e.step for e in by_type(mine, "step")] == [0, 1, 2]
    assert [e.event for e in by_type(mine, "lifecycle")] == ["start", "exit"]


def test_trainguard_run_supervises_from_the_base_install(base_python, kafka_config, tmp_path):
    """`trainguard run` (and so --instrument) is rank-side: it runs without the server."""
    env = {"PATH": "/usr/bin:/bin", "TRAINGUARD_HOME": str(tmp_path)}
    done = run(base_python.parent / "trainguard", "run", "--job", "base-run", "--bootstrap",
               kafka_config.bootstrap, "--prefix", kafka_config.topics.prefix, "--",
               str(base_python), "-c", "pass", env=env)
    assert done.returncode == 0, done.stderr
    assert "command finished (exit 0)" in done.stderr


def test_server_commands_name_the_server_install(base_python):
    trainguard = base_python.parent / "trainguard"
    for argv in (["worker"], ["actions"], ["agent"], ["up"], ["demo"],
                 ["analyze", str(PROBE)]):
        done = run(trainguard, *argv, timeout=30)
        assert done.returncode == 2, (argv, done.stderr)
        assert done.stderr.strip().count("\n") == 0, done.stderr
        assert SERVER_INSTALL in done.stderr, done.stderr


def test_importing_a_server_module_names_the_server_install(base_python):
    done = run(base_python, "-c", "import trainguard.streams.app")
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ModuleNotFoundError: No module named ")
    assert "trainguard.streams" in last and SERVER_INSTALL in last


def test_a_missing_package_outside_trainguard_keeps_its_plain_error(base_python):
    done = run(base_python, "-c", "import trainguard, rich")
    assert done.stderr.strip().splitlines()[-1] == "ModuleNotFoundError: No module named 'rich'"
