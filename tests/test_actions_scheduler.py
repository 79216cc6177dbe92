"""The action service's scheduler without Kafka: many anomalies at once, a job's in order,
critical first, a bounded backlog whose drops are recorded, offsets committed only up to the
oldest unfinished anomaly. The scheduler runs inline (``tick``), on a fake clock that the
stack source advances while nothing arrives."""
import threading
import time

import pytest

from trainguard import events as ev
from trainguard.actions.capture import StackCapture, StackGatherer
from trainguard.actions.pipeline import build_pipeline
from trainguard.actions.policy import BacklogSettings, CaptureSettings, Policy
from trainguard.actions.scheduler import Backlog, OffsetTracker, Scheduler
from trainguard.actions.service import ActionService
from trainguard.actions.state import ServiceState

from actions_harness import ListRecorder
from fakes import FakeClock, ListSource

T0 = 1_764_680_000.0


def anomaly(job, id=None, kind="hang", severity="critical", step=40):
    return ev.Anomaly(job=job, ts=T0, id=id or f"a-{job}", kind=kind, severity=severity,
                      ranks=[], nodes=[], step=step, onset_ts=T0 - 30, detected_ts=T0,
                      detector=kind, summary=f"{kind} of {job}", evidence={"world_size": 2})


def stack(job, rank, cid):
    frames = [{"function": "load_batch" if rank == 1 else "all_reduce", "file": "/w/t.py",
               "line": 3}, {"function": "<module>", "file": "/w/t.py", "line": 9}]
    return ev.Stack(job=job, ts=T0, node=f"n{rank}", rank=rank, capture_id=cid, pid=10 + rank,
                    method="py-spy", threads=[{"name": "MainThread", "id": 1, "frames": frames}])


class World:
    """A pipeline with a capturer whose agent answers only the jobs in ``answering``."""

    def __init__(self, answering=(), settings=BacklogSettings(), deadline_s=10.0, rounds=1):
        self.clock = FakeClock(T0)
        self.source = ListSource(clock=self.clock)
        self.answering = set(answering)
        self.commands = []
        self.gatherer = StackGatherer(self.source, clock=self.clock)
        capturer = StackCapture(send=self.agent, gatherer=self.gatherer, clock=self.clock,
                                sleep=self.clock.sleep,
                                settings=CaptureSettings(rounds=rounds, interval_s=1.0,
                                                         deadline_s=deadline_s))
        self.recorder = ListRecorder()
        self.state = ServiceState()
        self.pipeline = build_pipeline(policy=Policy(), state=self.state,
                                       recorder=self.recorder, capturer=capturer,
                                       clock=self.clock)
        self.done = []
        self.logs = []
        self.service = ActionService(pipeline=self.pipeline, state=self.state, clock=self.clock,
                                     log=self.logs.append, settings=settings,
                                     pump=self.gatherer.pump)
        self.scheduler = self.service.scheduler
        tell = self.scheduler.on_done  # the service's: tells (logs, counts) each outcome

        def done(token, work):
            self.done.append((token, work))
            tell(token, work)
        self.scheduler.on_done = done

    def agent(self, command):
        self.commands.append(command)
        if command.job in self.answering:
            self.source.add(*(stack(command.job, r, command.capture_id) for r in range(2)))

    def turn(self):
        self.scheduler.tick()
        self.gatherer.pump(0.2)  # lets 0.2 s of fake time pass when no reply is waiting

    def run_until(self, predicate, seconds=60.0):
        end = self.clock() + seconds
        while self.clock() < end:
            self.turn()
            if predicate():
                return
        raise AssertionError(f"not reached in {seconds:g}s of fake time")

    def records(self, job, action=None):
        return [(r.action, r.status) for r in self.recorder.events
                if r.job == job and (action is None or r.action == action)]


def test_a_hang_is_not_kept_behind_unanswered_captures_of_other_jobs():
    w = World(answering={"real"})
    for i in range(200):
        w.scheduler.submit(anomaly(f"junk-{i}"), token=(0, i))
    w.scheduler.submit(anomaly("real"), token=(0, 200))
    w.run_until(lambda: w.records("real", "restart"))
    assert w.records("real") == [("capture_stacks", "done"), ("evict", "planned"),
                                 ("restart", "planned"), ("alert", "done")]
    assert w.clock() - T0 < 2.0  # fake time: the junk captures' 10 s deadlines are far off
    assert not any(r.job.startswith("junk") and r.action == "restart"
                   for r in w.recorder.events)
    status = w.scheduler.status()
    assert status["in_flight"] == 200 and status["parked"] == 200
    w.run_until(lambda: len(w.done) == 201)  # the junk ends at its deadline, all of it
    assert all(w.records(f"junk-{i}") == [("capture_stacks", "failed"), ("restart", "planned"),
                                          ("alert", "done")] for i in range(200))
    assert w.clock() - T0 < 12.0


def test_anomalies_of_one_job_run_one_after_the_other():
    w = World(answering={"j1"})
    w.scheduler.submit(anomaly("j1", id="first"))
    w.scheduler.submit(anomaly("j1", id="second", kind="straggler", severity="warning"))
    w.scheduler.tick()
    assert [c.job for c in w.commands] == ["j1"]  # the second waits for the first's end
    assert w.scheduler.status()["in_flight"] == 1
    w.run_until(lambda: len(w.done) == 2)
    assert [work.anomaly.id for _, work in w.done] == ["first", "second"]


def test_critical_anomalies_go_before_warnings():
    w = World(settings=BacklogSettings(max_in_flight=1))
    for i in range(3):
        w.scheduler.submit(anomaly(f"w{i}", kind="throughput_drop", severity="warning"))
    w.scheduler.submit(anomaly("late", kind="crash"))
    w.run_until(lambda: len(w.done) == 4)
    assert [work.anomaly.id for _, work in w.done] == ["a-late", "a-w0", "a-w1", "a-w2"]


def test_a_full_backlog_drops_the_oldest_least_severe_with_a_record():
    w = World(settings=BacklogSettings(max_queued=2, max_in_flight=1))
    w.scheduler.submit(anomaly("w0", kind="straggler", severity="warning"), token=(0, 0))
    w.scheduler.submit(anomaly("w1", kind="straggler", severity="warning"), token=(0, 1))
    w.scheduler.submit(anomaly("c0", kind="crash"), token=(0, 2))
    dropped = [r for r in w.recorder.events if r.action == "none"]
    assert [(r.job, r.status) for r in dropped] == [("w0", "rate_limited")]
    assert dropped[0].reason.startswith("backlog_full: 2 anomalies waiting (max_queued 2)")
    assert dropped[0].extra["anomalies"] == ["a-w0"] and dropped[0].targets["dropped"]
    assert [(t, work.drop_code) for t, work in w.done] == [((0, 0), "backlog_full")]
    assert w.done[0][1].records == dropped  # its offset may be committed: it was recorded
    assert w.scheduler.counts["dropped_backlog_full"] == 1
    assert any("dropped: backlog_full" in line for line in w.logs)
    # a new warning, less severe than the crash and the other warning: the older one goes
    w.scheduler.submit(anomaly("w2", kind="straggler", severity="warning"), token=(0, 3))
    assert [r.job for r in w.recorder.events if r.action == "none"] == ["w0", "w1"]
    w.run_until(lambda: len(w.done) == 4)
    assert [work.anomaly.job for _, work in w.done if not work.dropped] == ["c0", "w2"]
    assert w.state.seen_anomaly("a-w0")  # a drop is handled: re-read, it is a duplicate


def test_a_duplicate_of_an_anomaly_under_way_is_dropped_and_counted():
    w = World()
    w.scheduler.submit(anomaly("j1"), token=(0, 0))
    w.scheduler.tick()  # under way: waits for its stacks
    w.scheduler.submit(anomaly("j1"), token=(0, 1))
    assert [(t, work.drop_code) for t, work in w.done] == [((0, 1), "duplicate")]
    assert w.scheduler.counts["dropped_duplicate"] == 1
    assert any("duplicate: anomaly a-j1 is already under way" in line for line in w.logs)
    assert not [r for r in w.recorder.events if r.action == "none"]  # the first one speaks


def test_an_internal_error_is_logged_and_the_job_goes_on():
    w = World()
    calls = []

    class Broken:
        name = "broken"

        def __call__(self, work):
            calls.append(work.anomaly.id)
            if len(calls) == 1:
                raise RuntimeError("bug")
            return True

    w.pipeline.stages.insert(0, Broken())
    w.scheduler.submit(anomaly("j1", id="one", kind="crash"), token=(0, 0))
    w.scheduler.submit(anomaly("j1", id="two", kind="crash"), token=(0, 1))
    w.run_until(lambda: len(w.done) == 2)
    assert w.done[0][0] == (0, 0) and w.done[0][1].drop_code == "internal_error"
    assert w.done[1][1].anomaly.id == "two" and not w.done[1][1].dropped
    assert w.scheduler.counts["internal_errors"] == 1
    assert any("RuntimeError: bug" in line for line in w.logs)
    assert not w.pipeline.lock._is_owned()


def test_backlog_hands_out_one_anomaly_per_job_most_severe_first():
    b = Backlog(max_queued=10)
    b.add(anomaly("j1", id="w", severity="warning"))
    b.add(anomaly("j1", id="c", severity="critical"))
    b.add(anomaly("j2", id="i", severity="info"))
    first = b.take()
    assert first.anomaly.id == "c"
    assert b.take().anomaly.id == "i"  # j1 is busy
    assert b.take() is None
    b.release(first)
    assert b.take().anomaly.id == "w"


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [3, 2, 1, 0], [2, 0, 3, 1]])
def test_offsets_are_committed_up_to_the_oldest_unfinished(order):
    t = OffsetTracker()
    for offset in range(10, 14):
        t.started(0, offset)
    seen = []
    for i in order:
        t.finished(0, 10 + i)
        seen.append(t.committable().get(0))
    assert seen[-1] == 14 and all(s is None or s <= 14 for s in seen)
    assert [s for s in seen if s is not None] == sorted(s for s in seen if s is not None)


class _Message:
    def __init__(self, value):
        self._value = value

    def error(self):
        return None

    def value(self):
        return self._value


class _Consumer:
    def __init__(self, values):
        self.messages = [_Message(v) for v in values]

    def poll(self, timeout):
        return self.messages.pop(0) if self.messages else None


def test_the_telemetry_watchers_source_skips_empty_messages_and_counts_them():
    from trainguard.actions.topic_io import KafkaSource

    life = ev.encode(ev.Lifecycle(job="j1", ts=T0, node="n0", rank=0, event="start", pid=1,
                                  world_size=2))
    source = object.__new__(KafkaSource)  # its consumer only: no broker here
    source.topic, source.want, source.invalid = "tg.telemetry", (b'"lifecycle"',), 0
    source.consumer = _Consumer([None, b"", b"{\"type\": \"lifecycle\", trunc", life])
    got = [source.poll(0.1) for _ in range(4)]
    assert got[:3] == [None, None, None] and got[3].job == "j1"
    assert source.invalid == 3


def test_a_slow_alert_sink_holds_up_no_other_job():
    """The first job's alert hangs in its sink (a worker thread); the second job's restart
    and alert go through meanwhile, and the first one's alert is recorded once it returns."""
    from trainguard.actions.alerts import SendResult

    release, entered = threading.Event(), threading.Event()

    def notify(message):
        if message.job == "slow":
            entered.set()
            release.wait(30)
        return [SendResult(sink="hook", status="sent", attempts=1)]

    recorder = ListRecorder()
    pipeline = build_pipeline(policy=Policy(), state=ServiceState(), recorder=recorder,
                              notify=notify, clock=lambda: T0 + 1)
    done = []
    scheduler = Scheduler(pipeline=pipeline, settings=BacklogSettings(workers=2),
                          on_done=lambda token, work: done.append(work.anomaly.job),
                          clock=lambda: T0 + 1, log=lambda m: None)
    stop = threading.Event()
    loop = threading.Thread(target=scheduler.run, args=(stop,), kwargs={"idle_s": 0.01})
    loop.start()
    try:
        scheduler.submit(anomaly("slow", kind="crash"))
        assert entered.wait(30)
        scheduler.submit(anomaly("fast", kind="crash"))
        deadline = time.monotonic() + 30
        while "fast" not in done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done == ["fast"]
        assert [(r.job, r.action) for r in recorder.events] == [
            ("slow", "restart"), ("fast", "restart"), ("fast", "alert")]
        release.set()
        while len(done) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done == ["fast", "slow"]
        assert [(r.job, r.action, r.status) for r in recorder.events][-1] == (
            "slow", "alert", "done")
    finally:
        release.set()
        stop.set()
        loop.join(30)
