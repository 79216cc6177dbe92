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
from trainguard.streams.recorder import rewrite

from test_streams_worker import TopicReader, WorkerProcess, new_config

pytestmark = [pytest.mark.broker, pytest.mark.slow]
DEMO = Path(__file__).parent / "data" / "incidents" / "demo-chaos-4ranks.jsonl.gz"


def renamed(job: str):
    return [e.replace(job=job) for e in read_events(DEMO) if e.type != "anomaly"]


def replayed_ids(job: str) -> set:
    """Ids of the recording's own anomalies, which replay puts back on the anomalies topic
    (rewritten to ``job``) beside the worker's."""
    return {rewrite(e, job=job).id for e in read_events(DEMO) if e.type == "anomaly"}


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

        replayed = replayed_ids(job)
        assert replayed, "the recording holds anomalies of its own"

        def found_by_worker(r):
            return [a for a in r.anomalies(job) if a.id not in replayed]

        def same(r):
            found = found_by_worker(r)
            return found if incidents_of(found) == expected else None

        try:
            reader.wait_for(same, "the offline incidents", timeout=40, worker=worker)
        except AssertionError:
            got = incidents_of(found_by_worker(reader))
            raise AssertionError(f"worker incidents {got} != analyze {expected}\n"
                                 f"{worker.tail()}") from None
    finally:
        reader.close()
        worker.stop()
