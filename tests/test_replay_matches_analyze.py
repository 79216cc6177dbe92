"""SPEC §4 / issue: a replayed recording produces the same incidents from `trainguard worker`
as `trainguard analyze` finds in the file. The recording is a real demo run (tests/data)."""
from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def replayed_into_worker(kafka_bootstrap, tmp_path, path, *args):
    """A worker of its own, the recording at ``path`` replayed to it (``trainguard replay``
    with ``args``); yields ``(worker, reader of the anomalies topic)``."""
    config = new_config(kafka_bootstrap)
    worker = WorkerProcess(config, f"t{uuid.uuid4().hex[:8]}", tmp_path / "data",
                           tmp_path / "worker.log").start()
    reader = TopicReader(config, config.topics.anomalies)
    try:
        worker.wait_ready()
        replay = subprocess.run(
            [sys.executable, "-m", "trainguard.cli", "replay", str(path), *args,
             "--bootstrap", config.bootstrap, "--prefix", config.topics.prefix],
            capture_output=True, text=True, timeout=180)
        assert replay.returncode == 0, replay.stderr
        yield worker, reader
    finally:
        reader.close()
        worker.stop()


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

    with replayed_into_worker(kafka_bootstrap, tmp_path, DEMO, "--speed", "10",
                              "--job", job) as (worker, reader):
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


def test_replayed_library_recording_gives_every_incident_of_analyze(kafka_bootstrap, tmp_path):
    """Issue 10 point 7: a scenario-library recording with several faults and trainguard's own
    restart (a NaN, a straggler, a hang, the restart, a crash after it) gives the same
    incidents, warnings included, through the worker (replayed) as through analyze."""
    from trainguard.recording import RecordingWriter
    from scenario_library import FAULTS
    from scenarios import generate

    job = f"lib-{uuid.uuid4().hex[:6]}"
    sc = next(s for s in FAULTS if s.name == "three-faults")
    events = [e.replace(job=job) for e in generate(sc)[0]]
    path = tmp_path / "three-faults.jsonl"
    with RecordingWriter(path) as out:
        for e in events:
            out.write_raw(ev.encode(e))
    engine, _ = analyze_events(events)
    expected = sorted((i["kind"], tuple(i["ranks"]), i["step"]) for i in engine.incidents())
    assert [k for k, _, _ in expected].count("hang") == 1 and len(expected) == 4

    with replayed_into_worker(kafka_bootstrap, tmp_path, path, "--speed", "20") as (worker,
                                                                                   reader):
        def incidents(anomalies):
            correlator = Correlator()
            for anomaly in sorted(anomalies, key=lambda a: a.detected_ts):
                correlator.add(anomaly)
            return sorted((i["kind"], tuple(i["ranks"]), i["step"])
                          for i in correlator.incidents())

        try:
            reader.wait_for(lambda r: incidents(r.anomalies(job)) == expected or None,
                            "the offline incidents", timeout=60, worker=worker)
        except AssertionError:
            raise AssertionError(f"worker {incidents(reader.anomalies(job))} != analyze "
                                 f"{expected}\n{worker.tail()}") from None
