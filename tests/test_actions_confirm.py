"""Confirm before acting (docs/POLICY.md): a hang whose job moved on gets no restart and no
eviction, only a false-alarm record for the detector to learn from; a job really stalled is
restarted as before. Without Kafka: the job's steps come to a JobProgress by hand."""
import pytest

from trainguard import events as ev
from trainguard.actions.capture import StackCapture, StackGatherer
from trainguard.actions.confirm import JobProgress, false_alarm_of
from trainguard.actions.pipeline import build_pipeline
from trainguard.actions.policy import CaptureSettings, Policy
from trainguard.actions.state import ServiceState
from trainguard.detectors.correlate import Correlator

from actions_harness import ListRecorder
from fakes import FakeClock, ListSource

T0 = 1_764_680_000.0


def hang(step=40, onset=T0, detected=T0 + 45, phase="checkpoint", id="h1", kind="hang",
         ranks=()):
    evidence = {"world_size": 2, "stalled_s": detected - onset}
    if phase is not None:
        evidence["phase"] = phase
    return ev.Anomaly(job="j1", ts=detected, id=id, kind=kind, severity="critical",
                      ranks=list(ranks), nodes=[], step=step, onset_ts=onset,
                      detected_ts=detected, detector=kind, summary=f"{kind} after step {step}",
                      evidence=evidence)


def step(n, ts, rank=0):
    return ev.Step(job="j1", ts=ts, node="n0", rank=rank, step=n, step_time=1.0)


def stacks(cid):
    frames = [{"function": "forward", "file": "/w/t.py", "line": 3},
              {"function": "<module>", "file": "/w/t.py", "line": 9}]
    return [ev.Stack(job="j1", ts=T0, node=f"n{r}", rank=r, capture_id=cid, pid=10 + r,
                     method="py-spy", threads=[{"name": "MainThread", "id": 1,
                                                "frames": frames}]) for r in range(2)]


def world(policy=Policy(), during_capture=(), answer=True):
    """A pipeline with a JobProgress; ``during_capture``: steps the job makes while its
    stacks are captured."""
    clock = FakeClock(T0 + 46)
    source = ListSource(clock=clock)
    progress = JobProgress()
    sent = []

    def agent(command):
        sent.append(command)
        for event in during_capture:
            progress.observe(event)
        if answer:
            source.add(*stacks(command.capture_id))

    capturer = StackCapture(send=agent, gatherer=StackGatherer(source, clock=clock),
                            settings=CaptureSettings(rounds=1, deadline_s=5.0),
                            sleep=clock.sleep, clock=clock)
    recorder = ListRecorder()
    pipe = build_pipeline(policy=policy, state=ServiceState(), recorder=recorder,
                          capturer=capturer, progress=progress, correlator=Correlator(),
                          clock=clock)
    return pipe, recorder, progress, sent


def summary(recorder):
    return [(r.action, r.status) for r in recorder.events]


def test_a_hang_whose_job_keeps_stepping_is_a_false_alarm_without_capture():
    pipe, rec, progress, sent = world()
    for n, ts in [(39, T0 - 1), (40, T0), (41, T0 + 52), (42, T0 + 53)]:
        progress.observe(step(n, ts))
    work = pipe.process(hang(), now=T0 + 46)
    assert summary(rec) == [("none", "rate_limited")] and not sent
    record = rec.events[0]
    assert record.targets["false_alarm"] == {
        "kind": "hang", "phase": "checkpoint", "stalled_s": 52.0, "step": 40,
        "resumed_step": 41, "check": "before_capture", "anomaly": "h1"}
    assert record.reason.startswith("false_alarm: job j1 moved on to step 41 after 52s "
                                    "stalled in phase checkpoint (before capture)")
    assert work.false_alarm == record.targets["false_alarm"] and not work.dropped
    assert false_alarm_of(ev.decode(ev.encode(record)))["stalled_s"] == 52.0
    assert all(r.status != "done" for r in rec.events)


def test_a_job_that_moves_on_during_the_capture_is_not_restarted():
    pipe, rec, _, sent = world(during_capture=[step(41, T0 + 47)])
    pipe.process(hang(phase=None), now=T0 + 46)
    assert len(sent) == 1
    assert summary(rec) == [("capture_stacks", "done"), ("none", "rate_limited")]
    marker = rec.events[1].targets["false_alarm"]
    assert marker["check"] == "after_capture" and marker["phase"] is None
    assert marker["stalled_s"] == 47.0


def test_a_job_really_stalled_is_restarted_as_before():
    pipe, rec, progress, _ = world()
    for n, ts in [(39, T0 - 1), (40, T0), (40, T0 + 0.3)]:  # rank 1 finishes step 40 late
        progress.observe(step(n, ts, rank=n % 2))
    pipe.process(hang(), now=T0 + 46)
    assert summary(rec) == [("capture_stacks", "done"), ("restart", "planned"),
                            ("alert", "done")]


def test_an_implausible_step_does_not_stop_a_real_hangs_restart():
    pipe, rec, progress, _ = world()
    progress.observe(step(2 ** 62, T0 + 10))  # a poisoned step number
    pipe.process(hang(), now=T0 + 46)
    assert ("restart", "planned") in summary(rec)


def test_a_step_stamped_far_in_the_future_is_not_progress():
    pipe, rec, progress, _ = world()
    progress.observe(step(41, T0 + 86400))
    pipe.process(hang(), now=T0 + 46)
    assert ("restart", "planned") in summary(rec)


def test_confirmation_can_be_turned_off():
    pipe, rec, progress, _ = world(policy=Policy(confirm_stalled=False))
    progress.observe(step(41, T0 + 50))
    pipe.process(hang(), now=T0 + 46)
    assert ("restart", "planned") in summary(rec)


def test_no_first_step_hang_confirmed_by_a_first_step():
    pipe, rec, progress, _ = world()
    progress.observe(step(0, T0 + 50))
    pipe.process(hang(step=None, phase="init"), now=T0 + 46)
    assert summary(rec) == [("none", "rate_limited")]
    assert rec.events[0].targets["false_alarm"]["stalled_s"] == 50.0


def test_silent_ranks_heard_again_are_not_evicted():
    policy = Policy(ladder={"silent": ["evict", "restart", "alert"]})
    pipe, rec, progress, _ = world(policy=policy)
    progress.observe(ev.Heartbeat(job="j1", ts=T0 + 50, node="n1", rank=3, pid=9, step=40,
                                  phase="forward", phase_since=T0 + 49))
    silent = hang(kind="silent", id="s1", ranks=[3], step=None, phase=None)
    pipe.process(silent, now=T0 + 46)
    assert summary(rec) == [("none", "rate_limited")]
    assert rec.events[0].targets["false_alarm"]["kind"] == "silent"
    assert rec.events[0].targets["false_alarm"]["ranks"] == [3]


def test_silent_ranks_still_quiet_are_acted_on():
    policy = Policy(ladder={"silent": ["evict", "restart", "alert"]})
    pipe, rec, progress, _ = world(policy=policy)
    progress.observe(ev.Heartbeat(job="j1", ts=T0 + 50, node="n1", rank=2, pid=9, step=40,
                                  phase="forward", phase_since=T0 + 49))
    silent = ev.Anomaly(job="j1", ts=T0 + 45, id="s1", kind="silent", severity="critical",
                        ranks=[3], nodes=["n1"], step=None, onset_ts=T0, detected_ts=T0 + 45,
                        detector="silent", summary="rank 3 went silent")
    pipe.process(silent, now=T0 + 46)
    assert ("restart", "planned") in summary(rec)


def test_alert_only_silent_is_not_confirmed():
    pipe, rec, progress, _ = world()
    progress.observe(ev.Heartbeat(job="j1", ts=T0 + 50, node="n1", rank=3, pid=9, step=40,
                                  phase="forward", phase_since=T0 + 49))
    pipe.process(hang(kind="silent", id="s1", ranks=[3], step=None), now=T0 + 46)
    assert summary(rec) == [("alert", "done")]


def test_a_later_real_hang_of_the_same_job_is_restarted():
    pipe, rec, progress, _ = world()
    for n, ts in [(40, T0), (41, T0 + 52), (42, T0 + 53)]:
        progress.observe(step(n, ts))
    pipe.process(hang(), now=T0 + 46)
    pipe.process(hang(step=42, onset=T0 + 53, detected=T0 + 120, id="h2"), now=T0 + 121)
    assert summary(rec) == [("none", "rate_limited"), ("capture_stacks", "done"),
                            ("restart", "planned"), ("alert", "done")]


def test_progress_book_is_bounded():
    progress = JobProgress(max_jobs=3, keep=4)
    for j in range(5):
        for n in range(10):
            progress.observe(ev.Step(job=f"j{j}", ts=float(n), rank=0, step=n, step_time=1.0))
    assert progress.progress_after("j0", 1, 0.0) is None  # forgotten
    assert progress.progress_after("j4", 1, 0.0) == (6, 6.0)  # the oldest of the last 4 kept


@pytest.mark.parametrize("targets", [{}, {"false_alarm": "hang"},
                                     {"false_alarm": {"kind": "crash", "stalled_s": 1.0}},
                                     {"false_alarm": {"kind": "hang", "stalled_s": -1}},
                                     {"false_alarm": {"kind": "hang", "stalled_s": True}}])
def test_false_alarm_markers_that_are_not_are_ignored(targets):
    record = ev.Action(job="j1", ts=1.0, incident="i", action="none", status="rate_limited",
                       reason="false_alarm: hand-made", targets=targets)
    assert false_alarm_of(record) is None


def resumed(progress, ranks=(0, 1)):
    """A run that reached step 45, and the run resumed from its step-20 checkpoint that
    stepped to 40 (stamped so that the hang of ``hang()`` follows its step 40)."""
    for n in range(30, 46):
        for rank in ranks:
            progress.observe(step(n, T0 - 300 + n, rank=rank))
    for n in range(21, 41):
        for rank in ranks:
            progress.observe(step(n, T0 - 40 + n, rank=rank))


def test_a_hang_of_a_resumed_run_at_a_step_the_run_before_passed_is_restarted():
    """The steps 41-45 of the run before the resume are not progress past step 40 (they
    were: the resumed run's real hang got a false alarm, and no restart)."""
    pipe, rec, progress, _ = world()
    resumed(progress)
    progress.observe(step(44, T0 - 256, rank=1))     # a late, redelivered one of the old run
    pipe.process(hang(), now=T0 + 46)
    assert summary(rec) == [("capture_stacks", "done"), ("restart", "planned"),
                            ("alert", "done")]


def test_a_resumed_run_that_moves_on_after_a_long_checkpoint_is_a_false_alarm():
    pipe, rec, progress, _ = world()
    resumed(progress)
    for n, ts in [(41, T0 + 52), (42, T0 + 53)]:
        progress.observe(step(n, ts))
    pipe.process(hang(), now=T0 + 46)
    assert summary(rec) == [("none", "rate_limited")]
    assert rec.events[0].targets["false_alarm"]["resumed_step"] == 41


def test_one_made_up_step_far_ahead_is_forgotten_at_its_ranks_next_real_step():
    progress = JobProgress()
    for n in range(38, 41):
        progress.observe(step(n, T0 - 40 + n))
    progress.observe(step(900_000, T0 + 1))          # poisoned, not implausible enough
    progress.observe(step(41, T0 + 52))
    assert progress.progress_after("j1", 40, since_ts=T0) == (41, T0 + 52)


def test_with_a_clock_steps_stamped_far_ahead_are_not_taken():
    clock = FakeClock(T0)
    progress = JobProgress(clock=clock, ahead_s=300)
    progress.observe(step(10, T0 + 3600))            # would hide every real step after it
    progress.observe(step(41, T0 + 1))
    assert progress.progress_after("j1", 40, since_ts=T0) == (41, T0 + 1)
