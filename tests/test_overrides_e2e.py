"""End to end: a per-job override set while the job runs takes effect in the running worker.

The real worker, action service and two `trainguard run` jobs (torchrun, gloo, CPU) share a
configuration file whose checkpoint allowance is 2 s; each job's last checkpoint takes 10 s.
While both run, `trainguard config set --job keep detectors.hang.checkpoint_s=60` goes onto
the config topic (signed), then a forged unsigned record tries to set it back to 1 s. Job
`keep` gets no hang and no restart, the worker is never restarted; job `other`, without the
override, is reported hung, which is what the file's allowance makes of such a checkpoint.
"""
import json
import os
import time

import pytest

from actions_harness import PYTHON, Collector, Deployment, producer, wait_for
from trainguard.overrides import make_record

pytestmark = [pytest.mark.broker, pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("TRAINGUARD_E2E") != "1",
                                 reason="end-to-end job scenarios run with TRAINGUARD_E2E=1")]

CONFIG = """
[detectors.hang]
floor_s = 6.0
checkpoint_s = 2.0
"""


def test_a_longer_checkpoint_allowance_set_at_runtime_prevents_a_hang(kafka_config, tmp_path):
    import subprocess

    topics = kafka_config.topics
    watch = {name: Collector(kafka_config, getattr(topics, name))
             for name in ("telemetry", "anomalies", "actions")}
    config_file = tmp_path / "tg.toml"
    config_file.write_text(CONFIG)
    with Deployment(tmp_path, kafka_config, limit_s=240) as d:
        d.env["TRAINGUARD_CONFIG"] = str(config_file)
        d.start(agent=False, policy={"capture": {"rounds": 1, "interval_s": 0.5,
                                                 "deadline_s": 2.0}})
        worker = next(p for name, p in d.procs.procs if name == "worker")
        jobs = {}
        for job, ranks in (("keep", 2), ("other", 1)):
            cmd = d.torchrun(ranks, steps=20, checkpoint_every=20, step_sleep=0.3, job=job,
                             extra=["--checkpoint-sleep", "10"])
            jobs[job] = d.supervise(job, cmd, max_restarts=1)
        watch["telemetry"].wait(lambda es: [e for e in es if e.type == "step"
                                            and e.job == "keep"], timeout=90,
                                what="the first step of job keep")
        setter = subprocess.run(
            [PYTHON, "-m", "trainguard.cli", "config", "set", "--job", "keep",
             "detectors.hang.checkpoint_s=60"], env={**os.environ, **d.env},
            capture_output=True, text=True, timeout=60)
        assert setter.returncode == 0, setter.stderr
        audit = watch["actions"].wait(
            lambda es: [e for e in es if e.extra.get("code") == "config_override"
                        and e.job == "keep"], timeout=20, what="the worker's audit record")
        assert audit[0].targets["changes"] == {
            "detectors.hang.checkpoint_s": {"old": 2.0, "new": 60.0}}
        assert audit[0].targets["live_stages"] == 1, audit[0].reason
        forged = make_record(job="keep", values={"detectors.hang.checkpoint_s": 1.0},
                             ts=time.time(), override_id="forged", by="mallory")
        p = producer(kafka_config)
        p.produce(topics.config, json.dumps(forged).encode(), b"keep")
        assert p.flush(10) == 0

        wait_for(lambda: jobs["keep"].poll() is not None, timeout=150, interval=0.5,
                 what="job keep's end")
        assert jobs["keep"].returncode == 0, d.procs.log("run-keep")[-2000:]
        hangs = watch["anomalies"].wait(
            lambda es: [e for e in es if e.type == "anomaly" and e.kind == "hang"
                        and e.job == "other"], timeout=60, what="job other's hang")
        assert hangs
        time.sleep(2.0)                          # anything the worker still had to say
        anomalies = watch["anomalies"].drain(1.0)
        actions = watch["actions"].drain(0.5)
        telemetry = watch["telemetry"].drain(0.5)

        # the override was in force before job keep's checkpoint began
        checkpoint = min(e.phase_since for e in telemetry if e.type == "heartbeat"
                         and e.job == "keep" and e.phase == "checkpoint")
        assert audit[0].ts < checkpoint
        assert not [a for a in anomalies if a.type == "anomaly" and a.job == "keep"
                    and a.kind == "hang"], [a.summary for a in anomalies if a.job == "keep"]
        assert not [a for a in actions if a.job == "keep" and a.action == "restart"]
        starts = [e for e in telemetry if e.type == "lifecycle" and e.job == "keep"
                  and e.rank is None and e.event == "start"]
        assert len(starts) == 1                  # launched once: never restarted
        assert len([a for a in actions if a.extra.get("code") == "config_override"]) == 1
        assert worker.poll() is None             # the same worker process throughout
        assert d.procs.log("worker").count("trainguard worker ") == 1
    deadletters = _deadletters(kafka_config)
    assert [r for r in deadletters if r["topic"] == topics.config
            and r["reason"].startswith("config override refused: unsigned")]
    for c in watch.values():
        c.close()


def _deadletters(kafka_config) -> list[dict]:
    from confluent_kafka import Consumer

    consumer = Consumer(kafka_config.kafka(**{"group.id": "t-dead-e2e",
                                              "auto.offset.reset": "earliest"}))
    consumer.subscribe([kafka_config.topics.deadletter])
    out, deadline = [], time.monotonic() + 10
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                out.append(json.loads(msg.value()))
            elif out:
                break
    finally:
        consumer.close()
    return out
