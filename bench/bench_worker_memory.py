"""Memory of ``trainguard worker`` for 100,000 one-message job ids, through the real broker.

Each job id sends one step event (the shape of a scan, a typo'd job id, or junk). The
measure is the resident set (VmRSS) of the worker process — Faust, both Kafka clients, the
stages and the kept snapshots of evicted stages together — sampled while it works through
them and then for a minute after, to show that it stays flat. The job stages dominate it:
a job stage in memory holds about 40 KB of detector windows, an evicted one a ~1 KB
snapshot.

Baseline in the same run: the same worker with eviction and caps off (``--max-live-jobs``
and ``--max-live-ranks`` 10^9, ``--evict-idle-s`` 6 h), as the worker was before them, on
``BASELINE_JOBS`` job ids (fewer: it grows by tens of KB a job); its per-job growth is
reported and projected to 100,000. Target: <= 500 MB at 100,000 job ids, flat afterwards.

Uses ``$TRAINGUARD_BOOTSTRAP`` or starts its own broker.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

JOBS = 100_000
BASELINE_JOBS = 10_000
SETTLE_S = 60.0                 # watched after the last job, for flatness
TIMEOUT_S = 1800.0
NO_CAPS = ["--max-live-jobs", str(10 ** 9), "--max-live-ranks", str(10 ** 9),
           "--evict-idle-s", str(6 * 3600)]


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _produce(config, jobs: int, t0: float) -> None:
    from confluent_kafka import Producer

    from trainguard import events as ev

    producer = Producer(config.kafka(**{"linger.ms": 20, "compression.type": "lz4"}))
    for i in range(jobs):
        job = f"one-{i:06d}"
        value = ev.encode(ev.Step(job=job, ts=t0 + i * 1e-4, node="n0", rank=0, step=1,
                                  step_time=0.5))
        while True:
            try:
                producer.produce(config.topics.telemetry, value, f"{job}/0".encode())
                break
            except BufferError:
                producer.poll(0.1)
        producer.poll(0)
    producer.flush(60)


def _measure(config, tmp: Path, jobs: int, extra: list) -> dict:
    from bench_stream_throughput import Worker

    tmp.mkdir(parents=True, exist_ok=True)
    worker = Worker(config, f"mem{uuid.uuid4().hex[:6]}", tmp, tuple(extra))
    try:
        deadline = time.monotonic() + 120
        while not worker.metrics().get("trainguard_assigned_partitions"
                                       f'{{topic="{config.topics.telemetry}"}}'):
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker not ready: {worker.log.read_text()[-2000:]}")
            time.sleep(0.5)
        time.sleep(3.0)
        idle_mb = _rss_mb(worker.proc.pid)
        began = time.monotonic()
        _produce(config, jobs, time.time())
        samples = []                 # (seconds since the first message, jobs applied, MB)
        marks = [jobs * q // 4 for q in (1, 2, 3, 4)]
        at_marks = {}
        deadline = time.monotonic() + TIMEOUT_S
        done_at = None
        applied = 0
        while time.monotonic() < deadline:
            m = worker.metrics()           # {} when the page did not answer in time
            applied = int(m.get("trainguard_items_applied_total", applied))
            mb = _rss_mb(worker.proc.pid)
            samples.append((round(time.monotonic() - began, 1), applied, round(mb, 1)))
            if len(samples) % 10 == 1:
                print(f"worker_memory: {samples[-1]}", file=sys.stderr, flush=True)
            for mark in marks:
                if applied >= mark and mark not in at_marks:
                    at_marks[mark] = round(mb, 1)
            if applied >= jobs and done_at is None:
                done_at = time.monotonic()
            if done_at is not None and time.monotonic() - done_at >= SETTLE_S:
                break
            time.sleep(2.0)
        m = worker.metrics()
        after = [s for s in samples if done_at is not None and s[1] >= jobs]
        return {
            "jobs": jobs, "idle_mb": round(idle_mb, 1),
            "rss_mb_at_quarters": [at_marks.get(mark) for mark in marks],
            "rss_mb_after_s": [(round(s[0] - after[0][0], 1), s[2]) for s in after[::5]],
            "peak_mb": max(s[2] for s in samples),
            "final_mb": samples[-1][2],
            "seconds_to_apply": round(done_at - began, 1) if done_at else None,
            "job_stages": m.get("trainguard_job_stages"),
            "rank_stages": m.get("trainguard_rank_stages"),
            "evicted_stages": m.get("trainguard_evicted_stages"),
            "evictions": m.get("trainguard_evictions_total"),
            "restore_failures": m.get("trainguard_restore_failures_total"),
        }
    finally:
        worker.stop()


def _config(bootstrap: str):
    from trainguard.config import Config, Topics
    from trainguard.topics import TopicPlan, create_topics

    config = Config(bootstrap=bootstrap, topics=Topics(prefix=f"m{uuid.uuid4().hex[:8]}"))
    create_topics(config, TopicPlan(telemetry_partitions=4, other_partitions=2))
    return config


def run() -> dict:
    from trainguard.broker import free_port, local_broker

    bootstrap = os.environ.get("TRAINGUARD_BOOTSTRAP")
    broker = None
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-mem-"))
    try:
        if not bootstrap:
            broker = local_broker(port=free_port(), data=tmp / "broker")
            broker.start(log=lambda m: None)
            bootstrap = broker.bootstrap
        capped = _measure(_config(bootstrap), tmp / "capped", JOBS, [])
        base = _measure(_config(bootstrap), tmp / "baseline", BASELINE_JOBS, NO_CAPS)
        per_job_kb = (base["final_mb"] - base["idle_mb"]) * 1024 / BASELINE_JOBS
        return {
            "measured": "VmRSS of the worker process (the job stages dominate it)",
            "capped": capped,
            "baseline_no_caps": base,
            "baseline_kb_per_job": round(per_job_kb, 1),
            "baseline_projected_mb_at_100k": round(base["idle_mb"] + per_job_kb * JOBS / 1024),
            "rss_mb_at_100k": capped["rss_mb_at_quarters"][-1],
            "ratio_to_baseline_projection": round(
                (capped["final_mb"] or 0) / (base["idle_mb"] + per_job_kb * JOBS / 1024), 3),
            "target_mb": 500,
        }
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
