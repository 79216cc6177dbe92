"""The job side's timer (streams/app.py, JobRuntime.tick) with a Faust app whose producer
does not answer: the checkpoint waits beside the timer, and hang and silent go on."""
from __future__ import annotations

import asyncio
import types
from functools import partial

from trainguard.detectors import JobStage
from trainguard.streams.app import JobRuntime
from trainguard.streams.metrics import Metrics
from trainguard.streams.processors import JobProcessor
from trainguard.streams.settings import WorkerSettings
from trainguard.streams.worker import WorkerTopics


TOPICS = WorkerTopics(telemetry="t.telemetry", anomalies="t.anomalies", deadletter="t.dl",
                      summaries="t-summaries", rank_state="t-rank-state")


class _StuckProducer:
    def __init__(self):
        self.answer = asyncio.Event()
        self.flushes = 0

    async def flush(self):
        self.flushes += 1
        await self.answer.wait()


class _Consumer:
    def __init__(self):
        self.commits = 0

    def assignment(self):
        return []

    async def commit(self):
        self.commits += 1


class _Processor(JobProcessor):
    def __init__(self):
        super().__init__(JobStage)
        self.advanced = 0

    def advance(self, now):
        self.advanced += 1
        return super().advance(now)


def test_a_checkpoint_whose_flush_waits_holds_no_advance_back():
    """Measured with a broker's JVM frozen (SIGSTOP) in a three-broker cluster: the job
    side's flush of its changelog waited 33 s, and with the checkpoint inside the timer no
    hang or silent was judged meanwhile ("Timer advance is overlapping ... 33.6")."""
    async def scenario():
        now = [1000.0]
        settings = WorkerSettings(prefix="t", worker_id="w", job_snapshot_interval_s=5.0)
        runtime = JobRuntime(settings=settings, topics=TOPICS,
                             processor=_Processor(), metrics=Metrics(), clock=lambda: now[0])
        producer, consumer = _StuckProducer(), _Consumer()
        recovered = asyncio.Event()
        recovered.set()
        runtime.app = types.SimpleNamespace(
            producer=producer, consumer=consumer,
            tables=types.SimpleNamespace(recovery=types.SimpleNamespace(completed=recovered)))
        runtime.table = types.SimpleNamespace(data={}, send_changelog=lambda *a: None)
        for _ in range(20):                      # 20 s of the timer, the flush stuck
            now[0] += 1.0
            await asyncio.wait_for(runtime.tick(), timeout=1.0)
            await asyncio.sleep(0)
        assert runtime.processor.advanced == 20
        assert producer.flushes == 1 and consumer.commits == 0     # one at a time
        producer.answer.set()                    # the broker answers again
        await asyncio.wait_for(runtime.checkpointing, timeout=1.0)
        assert consumer.commits == 1
        now[0] += 10.0
        await runtime.tick()
        await asyncio.wait_for(runtime.final_checkpoint(), timeout=1.0)
        assert producer.flushes >= 2 and consumer.commits >= 2

    asyncio.run(scenario())

