"""The action pipeline's stages, safety caps, dry-run and the persisted ledger, without Kafka."""
import json

import pytest

from trainguard import events as ev
from trainguard.actions.alerts import SendResult
from trainguard.actions.capture import JobDirectory, StackCapture, StackGatherer
from trainguard.actions.order_desk import OrderDesk
from trainguard.actions.orders import ack_of
from trainguard.actions.pipeline import (Dedup, Work, action_event, apply_limits, build_pipeline,
                                         incident_of)
from trainguard.actions.policy import CaptureSettings, Decision, Limits, Policy
from trainguard.actions.state import ServiceState
from trainguard.detectors.correlate import Correlator

from actions_harness import ListRecorder
from fakes import FakeClock, ListSource

T0 = 1_764_680_000.0


def anomaly(kind="crash", id="a1", ranks=(1,), nodes=("n1",), onset=T0, detected=T0 + 1,
            evidence=None, job="j1"):
    return ev.Anomaly(job=job, ts=detected, id=id, kind=kind, severity="critical",
                      ranks=list(ranks), nodes=list(nodes), step=40, onset_ts=onset,
                      detected_ts=detected, detector=kind, summary=f"{kind} on {nodes}",
                      evidence=dict(evidence or {}))


def pipe(policy=Policy(), state=None, **kw):
    state = state if state is not None else ServiceState()
    recorder = ListRecorder()
    return build_pipeline(policy=policy, state=state, recorder=recorder, **kw), recorder, state


def summary(records):
    return [(r.action, r.status) for r in records]


def test_pipeline_is_assembled_in_order():
    p, _, _ = pipe()
    assert repr(p) == ("Pipeline(await_incident -> correlate -> dedup -> confirm -> "
                       "investigate -> confirm -> decide -> limit -> act -> record -> "
                       "dispatch -> notify)")


def test_crash_becomes_planned_restart_records():
    p, rec, _ = pipe()
    work = p.process(anomaly(), now=T0 + 2)
    assert summary(rec.events) == [("restart", "planned"), ("alert", "done")]
    restart = rec.events[0]
    assert restart.incident == "a1" and restart.job == "j1"
    assert restart.targets == {"job": "j1", "onset_ts": T0, "exclude_nodes": [], "ranks": [1]}
    assert restart.extra["action_id"] == "a1:restart" and restart.extra["source"] == "actions"
    assert work.records == rec.events
    assert ev.decode(ev.encode(restart)) == restart  # valid SPEC action


def test_same_anomaly_twice_gives_one_restart():
    p, rec, _ = pipe()
    p.process(anomaly(), now=T0 + 2)
    again = p.process(anomaly(), now=T0 + 3)
    assert again.dropped == "duplicate: anomaly a1 was already handled"
    assert [r.action for r in rec.events].count("restart") == 1


def test_correlated_anomaly_of_a_restarted_incident_is_dropped():
    p, rec, _ = pipe(correlator=Correlator())
    p.process(anomaly(id="a1"), now=T0 + 2)
    work = p.process(anomaly(kind="hang", id="a2", ranks=[2], onset=T0 + 0.5), now=T0 + 3)
    assert work.dropped.startswith("duplicate: incident inc-a1 already has a restart")
    assert [r.action for r in rec.events].count("restart") == 1


def test_a_problem_that_began_after_the_restart_is_a_new_incident():
    p, rec, _ = pipe(correlator=Correlator(),
                     policy=Policy(limits=Limits(restart_settle_s=5)))
    p.process(anomaly(id="a1"), now=T0 + 2)
    work = p.process(anomaly(kind="hang", id="a2", ranks=[], onset=T0 + 60,
                             detected=T0 + 90), now=T0 + 91)
    assert work.incident.id == "inc-a2" and work.incident.kind == "hang"
    assert [(r.incident, r.status) for r in rec.events if r.action == "restart"] == [
        ("inc-a1", "planned"), ("inc-a2", "planned")]


def test_exits_caused_by_our_own_restart_join_its_incident():
    directory = JobDirectory()
    p, rec, _ = pipe(correlator=Correlator(), directory=directory)
    p.process(anomaly(kind="hang", id="h1", ranks=[], nodes=[]), now=T0 + 2)
    # the supervisor kills the ranks (they exit by SIGTERM) and relaunches 3 s later
    directory.observe(ev.Lifecycle(job="j1", ts=T0 + 5, node="n1", event="start", pid=1,
                                   world_size=2))
    for rank in (0, 1):
        work = p.process(anomaly(kind="crash", id=f"c{rank}", ranks=[rank], nodes=[],
                                 onset=T0 + 3, detected=T0 + 3.5), now=T0 + 4)
        assert work.dropped.startswith("duplicate: incident inc-h1")
    # a crash after the relaunch is a new problem again
    work = p.process(anomaly(kind="crash", id="c9", ranks=[1], nodes=[], onset=T0 + 30,
                             detected=T0 + 30), now=T0 + 31)
    assert work.incident.id == "inc-c9"
    assert [r.status for r in rec.events if r.incident == "inc-c9"] == ["planned", "done"]


def test_a_crash_after_the_ranks_started_again_is_new_without_trainguard_run():
    """Under Slurm requeue no ``trainguard run`` announces the relaunch: the new run's rank
    starts end the restart, so a crash 4 s later (within ``restart_settle_s``) is restarted,
    not taken for the teardown (it was, and the job stayed down)."""
    directory = JobDirectory()
    p, rec, _ = pipe(directory=directory, policy=Policy(limits=Limits(restart_settle_s=60)))
    for rank in (0, 1):
        directory.observe(ev.Lifecycle(job="j1", ts=T0 - 100, node="n1", rank=rank,
                                       event="start", pid=1, world_size=2))
    p.process(anomaly(kind="hang", id="h1", ranks=[], nodes=[]), now=T0 + 2)
    for rank in (0, 1):
        directory.observe(ev.Lifecycle(job="j1", ts=T0 + 6, node="n2", rank=rank,
                                       event="start", pid=2, world_size=2))
    p.process(anomaly(id="c1", onset=T0 + 10, detected=T0 + 10.5), now=T0 + 11)
    assert [(r.action, r.status) for r in rec.events if r.incident == "c1"][:1] == [
        ("restart", "planned")]


def test_a_problem_beginning_during_another_restart_is_expected():
    p, rec, _ = pipe()
    p.process(anomaly(kind="hang", id="h1", ranks=[], nodes=[]), now=T0 + 2)
    p.process(anomaly(id="c1", onset=T0 + 3, detected=T0 + 3.5), now=T0 + 4)
    late = [r for r in rec.events if r.incident == "c1"]
    assert [(r.action, r.status) for r in late] == [("restart", "rate_limited")]
    assert late[0].reason.startswith("expected: began while job j1 was being restarted for "
                                     "incident h1")


def test_root_cause_found_later_is_acted_on():
    p, rec, _ = pipe(correlator=Correlator())
    p.process(anomaly(kind="crash", id="c1", ranks=[3], nodes=["n2"]), now=T0 + 2)
    work = p.process(anomaly(kind="gpu_fault", id="x1", ranks=[3], nodes=["n2"],
                             onset=T0 - 0.5, detected=T0 + 4), now=T0 + 5)
    assert work.incident.id == "inc-c1~gpu_fault"
    got = [(r.action, r.status) for r in rec.events if r.incident == work.incident.id]
    assert got == [("evict", "planned"), ("restart", "planned"), ("alert", "done")]


def test_same_machine_failing_again_after_a_restart_is_evicted():
    p, rec, _ = pipe(policy=Policy(limits=Limits(restart_settle_s=5)))
    p.process(anomaly(id="c1", nodes=["n4"]), now=T0 + 2)
    p.process(anomaly(id="c2", nodes=["n4"], onset=T0 + 100, detected=T0 + 100),
              now=T0 + 101)
    assert [(r.action, r.status) for r in rec.events if r.incident == "c2"][:2] == [
        ("evict", "planned"), ("restart", "planned")]


def test_state_survives_a_restart_of_the_service(tmp_path):
    path = tmp_path / "state.json"
    p1, rec1, _ = pipe(state=ServiceState.load(path))
    p1.process(anomaly(kind="hang", nodes=[]), now=T0 + 2)
    assert ("restart", "planned") in summary(rec1.events)
    # a new service process: state from the file, the anomaly delivered again
    p2, rec2, _ = pipe(state=ServiceState.load(path))
    work = p2.process(anomaly(kind="hang", nodes=[]), now=T0 + 30)
    assert work.dropped.startswith("duplicate")
    assert rec2.events == []
    saved = json.loads(path.read_text())
    assert saved["format"] == 1 and "a1" in saved["seen"]
    assert not list(tmp_path.glob(".state.json.*"))  # no temporary file left behind


def test_state_rebuilt_from_action_records_prevents_a_second_restart():
    p1, rec1, _ = pipe()
    p1.process(anomaly(), now=T0 + 2)
    fresh = ServiceState()
    for record in rec1.events:  # what read_back() gives the service from the actions topic
        fresh.absorb(ev.decode(ev.encode(record)))
    p2, rec2, _ = pipe(state=fresh)
    assert p2.process(anomaly(), now=T0 + 5).dropped.startswith("duplicate")
    # a new anomaly id for the same incident id is still recognised as restarted
    inc = incident_of(anomaly(id="a1"))
    assert fresh.history(inc).done["restart"] == "planned"


def test_corrupt_state_file_is_moved_aside(tmp_path):
    path = tmp_path / "state.json"
    path.write_text("{not json")
    messages = []
    state = ServiceState.load(path, log=messages.append)
    assert state.incidents == {} and not path.exists()
    assert list(tmp_path.glob("state.json.corrupt-*")) and "unreadable" in messages[0]


def test_stale_anomalies_are_dropped():
    p, rec, _ = pipe(policy=Policy(max_anomaly_age_s=60))
    work = p.process(anomaly(detected=T0), now=T0 + 3600)
    assert work.dropped.startswith("stale: anomaly a1 was detected 3600s ago")
    assert rec.events == []


def test_restart_cap_rate_limits_and_pages_once():
    policy = Policy(limits=Limits(max_restarts=2, restart_window_s=600, restart_settle_s=10))
    p, rec, _ = pipe(policy=policy)
    for i in range(4):
        p.process(anomaly(id=f"a{i}", onset=T0 + 100 * i, detected=T0 + 100 * i + 1),
                  now=T0 + 100 * i + 2)
    restarts = [r for r in rec.events if r.action == "restart"]
    assert [r.status for r in restarts] == ["planned", "planned", "rate_limited",
                                            "rate_limited"]
    assert restarts[2].reason.startswith("restart_cap: 2 restarts of job j1 in the last 600s "
                                         "(limit 2)")
    pages = [r for r in rec.events if r.action == "alert" and r.reason.startswith("page")]
    assert len(pages) == 1 and pages[0].extra["severity"] == "critical"
    assert "restart_cap" in pages[0].reason


def test_restart_cap_window_slides():
    policy = Policy(limits=Limits(max_restarts=1, restart_window_s=60))
    p, rec, _ = pipe(policy=policy)
    p.process(anomaly(id="a0"), now=T0 + 2)
    p.process(anomaly(id="a1", onset=T0 + 1000, detected=T0 + 1001), now=T0 + 1002)
    assert [r.status for r in rec.events if r.action == "restart"] == ["planned", "planned"]


def test_restart_already_covering_an_incident_is_not_repeated_nor_counted():
    p, rec, state = pipe(policy=Policy(limits=Limits(max_restarts=1)))
    p.process(anomaly(id="a-rank1", ranks=[1]), now=T0 + 2)
    p.process(anomaly(id="a-rank2", ranks=[2], onset=T0 + 0.5), now=T0 + 3)
    restarts = [r for r in rec.events if r.action == "restart"]
    assert [r.status for r in restarts] == ["planned", "rate_limited"]
    assert restarts[1].reason.startswith("covered: job j1 was already restarted for incident "
                                         "a-rank1")
    assert not any(r.reason.startswith("page") for r in rec.events)
    assert len(state.restarts) == 1


def test_eviction_caps():
    policy = Policy(limits=Limits(max_evictions_per_incident=1, max_evictions_per_day=2))
    p, rec, _ = pipe(policy=policy)
    p.process(anomaly(kind="gpu_fault", id="g1", nodes=["n1", "n2"]), now=T0 + 2)
    evict = [r for r in rec.events if r.action == "evict"][0]
    assert evict.status == "rate_limited" and evict.reason.startswith("evict_cap:")
    restart = [r for r in rec.events if r.action == "restart"][0]
    assert restart.status == "planned" and restart.targets["exclude_nodes"] == []
    assert any(r.reason.startswith("page: evict_cap") for r in rec.events)
    p.process(anomaly(kind="gpu_fault", id="g2", nodes=["n3"], onset=T0 + 500,
                      detected=T0 + 501), now=T0 + 502)
    p.process(anomaly(kind="gpu_fault", id="g3", nodes=["n4"], onset=T0 + 900,
                      detected=T0 + 901), now=T0 + 902)
    p.process(anomaly(kind="gpu_fault", id="g4", nodes=["n5"], onset=T0 + 1300,
                      detected=T0 + 1301), now=T0 + 1302)
    statuses = [r.status for r in rec.events if r.action == "evict"]
    assert statuses == ["rate_limited", "planned", "planned", "rate_limited"]


def test_dry_run_records_everything_and_does_nothing():
    p, rec, state = pipe(policy=Policy(dry_run=True))
    p.process(anomaly(kind="gpu_fault", nodes=["n9"]), now=T0 + 2)
    got = summary(rec.events)
    assert got == [("evict", "dry_run"), ("restart", "dry_run"), ("alert", "done")]
    assert rec.events[0].reason.startswith("dry_run: would evict;")
    assert state.excluded == {}  # nothing was really evicted
    # dry-run decisions still count as handled: no second one for the same incident
    assert p.process(anomaly(kind="gpu_fault", nodes=["n9"]), now=T0 + 3).dropped


def test_require_approval_alerts_instead_of_acting():
    p, rec, _ = pipe(policy=Policy(require_approval=("evict",)))
    p.process(anomaly(kind="gpu_fault", nodes=["n9"]), now=T0 + 2)
    evict = [r for r in rec.events if r.action == "evict"][0]
    assert evict.status == "dry_run" and evict.reason.startswith("approval_required: evict")
    assert [r.status for r in rec.events if r.action == "restart"] == ["planned"]
    alert = [r for r in rec.events if r.action == "alert"][0]
    assert alert.status == "done"


def test_apply_limits_is_pure():
    state = ServiceState()
    inc = incident_of(anomaly())
    before = [Decision(action="restart", reason="crash", targets={"job": "j1"})]
    after = apply_limits(before, inc, Policy(dry_run=True), state, T0)
    assert before[0].status == "planned" and after[0].status == "dry_run"
    assert state.restarts == []


def test_drivers_carry_out_actions_and_failures_are_recorded():
    calls = []

    def good(decision, incident):
        calls.append((decision.action, incident.id))
        return "done", "requeued by scontrol"

    def bad(decision, incident):
        raise RuntimeError("no cluster")

    p, rec, _ = pipe(drivers={"restart": good, "evict": bad})
    p.process(anomaly(kind="gpu_fault", nodes=["n1"]), now=T0 + 2)
    assert calls == [("restart", "a1")]
    got = {r.action: (r.status, r.reason) for r in rec.events}
    assert got["restart"] == ("done", "requeued by scontrol")
    assert got["evict"] == ("failed", "driver_error: RuntimeError: no cluster")


def test_notify_records_each_sink_outcome():
    sent = []

    def notify(message):
        sent.append(message)
        return [SendResult(sink="slack", status="sent", attempts=1),
                SendResult(sink="alertmanager", status="failed", attempts=3, error="HTTP 500")]

    p, rec, _ = pipe(notify=notify)
    p.process(anomaly(), now=T0 + 2)
    alerts = [r for r in rec.events if r.action == "alert"]
    assert [(a.targets["sink"], a.status) for a in alerts] == [("slack", "done"),
                                                                ("alertmanager", "failed")]
    assert "HTTP 500" in alerts[1].reason
    message = sent[0]
    assert message.incident == "a1" and message.kind == "crash"
    assert "restart" in message.done() and "planned" in message.done()


def stack_event(rank, cid, fn, node="n0"):
    frames = [{"function": fn, "file": "/w/train.py", "line": 3},
              {"function": "train_step", "file": "/w/train.py", "line": 20},
              {"function": "<module>", "file": "/w/train.py", "line": 40}]
    return ev.Stack(job="j1", ts=T0, node=node, rank=rank, capture_id=cid, pid=100 + rank,
                    method="py-spy", threads=[{"name": "MainThread", "id": 1, "active": True,
                                               "frames": frames}])


class ScriptedAgent:
    """Answers each capture command by queueing stack events on the source."""

    def __init__(self, source, answer):
        self.source, self.answer, self.commands = source, answer, []

    def __call__(self, command):
        self.commands.append(command)
        self.source.add(*self.answer(command.capture_id, len(self.commands)))


def hang_capturer(answer, rounds=2):
    clock = FakeClock(T0)
    source = ListSource(clock=clock)
    agent = ScriptedAgent(source, answer)
    capturer = StackCapture(send=agent, gatherer=StackGatherer(source, clock=clock),
                            settings=CaptureSettings(rounds=rounds, interval_s=1.0,
                                                     deadline_s=5.0),
                            sleep=clock.sleep, clock=clock)
    return capturer, agent


def test_hang_captures_stacks_and_evicts_the_suspects_machine():
    def answer(cid, n):
        return [stack_event(r, cid, "load_batch" if r == 2 else "all_reduce",
                            node="n1" if r >= 2 else "n0") for r in range(4)]

    capturer, agent = hang_capturer(answer)
    p, rec, _ = pipe(capturer=capturer)
    work = p.process(anomaly(kind="hang", ranks=[], nodes=[], evidence={"world_size": 4}),
                     now=T0 + 2)
    assert [c.command for c in agent.commands] == ["capture_stacks", "capture_stacks"]
    assert all(c.ranks == "all" and c.node is None for c in agent.commands)
    assert work.localization["suspects"] == [2] and work.localization["stuck"] == [0, 1, 2, 3]
    assert summary(rec.events) == [("capture_stacks", "done"), ("evict", "planned"),
                                   ("restart", "planned"), ("alert", "done")]
    capture = rec.events[0]
    assert capture.targets["suspects"] == [2]
    assert capture.reason.startswith("stacks of 4/4 ranks:")
    assert rec.events[1].targets["nodes"] == ["n1"]


def test_hang_with_no_answer_restarts_without_eviction():
    capturer, agent = hang_capturer(lambda cid, n: [])
    p, rec, _ = pipe(capturer=capturer)
    p.process(anomaly(kind="hang", ranks=[], nodes=[]), now=T0 + 2)
    assert len(agent.commands) == 1  # no second round when nobody answered the first
    assert summary(rec.events) == [("capture_stacks", "failed"), ("restart", "planned"),
                                   ("alert", "done")]
    assert rec.events[0].reason.startswith("capture_timeout:")


def test_straggler_capture_is_evidence_only():
    def answer(cid, n):
        return [stack_event(r, cid, "forward" if n == 1 else "backward") for r in range(2)]

    capturer, _ = hang_capturer(answer)
    p, rec, _ = pipe(capturer=capturer)
    work = p.process(anomaly(kind="straggler", evidence={"slowdown": 1.5, "world_size": 2}),
                     now=T0 + 2)
    assert summary(rec.events) == [("capture_stacks", "done"), ("alert", "done")]
    assert work.localization["moving"] == [0, 1]
    assert "moving: [0, 1]" in rec.events[0].reason


def test_dedup_stage_alone():
    state = ServiceState()
    stage = Dedup(state, Policy())
    a = anomaly()
    work = Work(anomaly=a, now=T0 + 2, incident=incident_of(a))
    assert stage(work) and work.dropped is None
    state.note_incident(work.incident, T0 + 2)
    again = Work(anomaly=a, now=T0 + 3, incident=incident_of(a))
    assert not stage(again) and again.dropped.startswith("duplicate")


def test_action_event_is_valid_spec():
    inc = incident_of(anomaly())
    record = action_event(Decision(action="none", reason="nothing to do", status="done"), inc,
                          T0)
    back = ev.decode(ev.encode(record))
    assert back.type == "action" and back.extra["anomalies"] == ["a1"]


@pytest.mark.parametrize("kind", ["nan", "loss_spike", "gpu_degraded", "throughput_drop",
                                  "silent", "grad_spike"])
def test_alert_only_kinds(kind):
    p, rec, _ = pipe()
    p.process(anomaly(kind=kind), now=T0 + 2)
    assert summary(rec.events) == [("alert", "done")]


def test_policy_file_driver_section_runs_a_cluster_driver(tmp_path):
    from trainguard.actions.service import build_driver_actions, load_service_config

    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"limits": {"max_restarts": 5},
                                "driver": {"type": "slurm", "dry_run": True,
                                           "job_refs": {"j1": "4242"}},
                                "alerts": {"webhook": {"url": "http://127.0.0.1:9/x"}}}))
    policy, alerts, driver = load_service_config(str(path))
    assert policy.limits.max_restarts == 5 and "webhook" in alerts
    p, rec, _ = pipe(policy=policy, drivers=build_driver_actions(driver))
    p.process(anomaly(kind="gpu_fault", nodes=["gpu-03"]), now=T0 + 2)
    got = {r.action: (r.status, r.reason) for r in rec.events}
    assert got["evict"][0] == "dry_run" and "scontrol update NodeName=gpu-03" in got["evict"][1]
    assert got["restart"][0] == "dry_run"
    assert "scontrol requeuehold 4242" in got["restart"][1]


def test_a_repeat_that_our_own_restart_explains_is_not_evicted():
    """Rank 1 dies; torchrun then stops the others by SIGTERM: their exits are one episode
    (here without correlation, which would fold them into one incident anyway)."""
    p, rec, _ = pipe()
    p.process(anomaly(id="c0", ranks=[0], nodes=["n1"]), now=T0 + 2)
    p.process(anomaly(id="c2", ranks=[2], nodes=["n1"], onset=T0 + 3, detected=T0 + 3),
              now=T0 + 4)
    later = [(r.action, r.status) for r in rec.events if r.incident == "c2"]
    assert later == [("evict", "rate_limited"), ("restart", "rate_limited")]


def test_a_failing_capture_still_leads_to_a_restart():
    class Broken:
        def capture(self, job, expected, label):
            raise RuntimeError("broker gone")

    p, rec, _ = pipe(capturer=Broken())
    p.process(anomaly(kind="hang", ranks=[], nodes=[]), now=T0 + 2)
    assert summary(rec.events) == [("capture_stacks", "failed"), ("restart", "planned"),
                                   ("alert", "done")]
    assert rec.events[0].reason == "capture_error: RuntimeError: broker gone"


def alike(cid, n):
    return [stack_event(r, cid, "all_reduce", node="n1") for r in range(4)]


def test_demo_nan_then_a_hang_on_another_rank_captures_and_restarts():
    """The demo run: NaN on rank 1 (alert only), then a hang blamed on rank 2."""
    capturer, agent = hang_capturer(alike)
    p, rec, _ = pipe(correlator=Correlator(), capturer=capturer)
    p.process(anomaly(kind="nan", id="n1", ranks=[1], nodes=[]), now=T0 + 2)
    work = p.process(anomaly(kind="hang", id="h1", ranks=[2], nodes=[], onset=T0 - 9,
                             detected=T0 + 51, evidence={"rank_nodes": {"2": "n1"},
                                                         "world_size": 4}), now=T0 + 52)
    assert work.incident.kind == "hang"
    assert [(r.incident, r.action, r.status) for r in rec.events] == [
        ("inc-n1", "alert", "done"), ("inc-h1", "capture_stacks", "done"),
        ("inc-h1", "restart", "planned"), ("inc-h1", "alert", "done")]
    # rank 1 exits by our restart's SIGTERM: it joins the NaN incident, covered by that restart
    work = p.process(anomaly(kind="crash", id="c1", ranks=[1], nodes=[], onset=T0 + 53,
                             detected=T0 + 53), now=T0 + 54)
    assert work.incident.id == "inc-n1"
    assert [r.status for r in rec.events if r.action == "restart"] == ["planned",
                                                                       "rate_limited"]
    assert rec.events[-1].reason.startswith("covered: job j1 was already restarted for "
                                            "incident inc-h1")


def test_a_hang_joining_a_nan_incident_escalates_it():
    capturer, agent = hang_capturer(alike)
    p, rec, _ = pipe(correlator=Correlator(), capturer=capturer)
    p.process(anomaly(kind="nan", id="n1", ranks=[2], nodes=[]), now=T0 + 2)
    work = p.process(anomaly(kind="hang", id="h1", ranks=[2], nodes=[], onset=T0 - 9,
                             detected=T0 + 51, evidence={"world_size": 4}), now=T0 + 52)
    assert work.incident.id == "inc-n1" and work.incident.kinds == ["nan", "hang"]
    assert summary(work.records) == [("capture_stacks", "done"), ("restart", "planned"),
                                     ("alert", "done")]
    assert work.records[1].reason.startswith("escalated: hang joined nan incident inc-n1; "
                                             "hang: no outlier among the ranks' stacks")


def test_a_straggler_that_hangs_escalates_to_one_restart():
    capturer, agent = hang_capturer(alike)
    p, rec, _ = pipe(correlator=Correlator(), capturer=capturer)
    where = {"rank_nodes": {"2": "n1"}, "world_size": 4}
    first = p.process(anomaly(kind="straggler", id="s1", ranks=[2], nodes=[],
                              evidence={"slowdown": 1.5, **where}), now=T0 + 2)
    assert summary(first.records) == [("capture_stacks", "done"), ("alert", "done")]
    # the rank hangs while still being reported slow (onset within the correlator's 5 s of
    # the straggler's detection): one root cause, one incident; a later onset is a new one
    hang = anomaly(kind="hang", id="h1", ranks=[2], nodes=[], onset=T0 + 4,
                   detected=T0 + 80, evidence=where)
    work = p.process(hang, now=T0 + 81)
    assert work.incident.id == "inc-s1" and work.incident.kind == "straggler"
    assert summary(work.records) == [("capture_stacks", "done"), ("restart", "planned"),
                                     ("alert", "done")]
    assert work.records[1].reason.startswith("escalated: hang joined straggler incident inc-s1")
    assert len(agent.commands) == 4  # two rounds for the straggler, two for the hang
    # the hang delivered again, and the exits our own restart causes: no second restart
    assert p.process(hang, now=T0 + 82).dropped == "duplicate: anomaly h1 was already handled"
    for rank in (0, 2):
        again = p.process(anomaly(kind="crash", id=f"c{rank}", ranks=[rank], nodes=[],
                                  onset=T0 + 83, detected=T0 + 84), now=T0 + 85)
        if again.dropped is None:  # a new incident of its own, covered by our restart
            assert all(r.status != "planned" for r in again.records if r.action == "restart")
        else:
            assert again.dropped.startswith("duplicate: incident inc-")
    assert [r.status for r in rec.events if r.action == "restart"
            and r.status == "planned"] == ["planned"]


def _crash_restart_satisfied(state=None):
    """Rank 3 of j1 is killed at T0, ``trainguard run`` relaunches the job on its own at
    T0+1, then the crash's restart is ordered and acked ``already_satisfied``."""
    directory, sent, recorder = JobDirectory(), [], ListRecorder()
    desk = OrderDesk(send=sent.append, recorder=recorder, directory=directory,
                     clock=lambda: T0 + 4.6)
    p = build_pipeline(policy=Policy(), state=state if state is not None else ServiceState(),
                       recorder=recorder, correlator=Correlator(), directory=directory,
                       orders=desk)
    directory.observe(ev.Lifecycle(job="j1", ts=T0 + 1, node="vm", event="start", pid=1,
                                   world_size=4))
    p.process(anomaly(id="c3", ranks=[3], nodes=["vm"], onset=T0, detected=T0 + 4),
              now=T0 + 4.5)
    order = [o for o in sent if o.incident == "inc-c3"][0]
    ack = ack_of(order, "already_satisfied", "relaunched_since_onset",
                 "launch 2 started 1.0s after the incident began", ts=T0 + 4.6, node="vm")
    assert desk.receive(ack, ev.encode(ack)) == ("filed", None)
    assert directory.satisfied("j1") == {"inc-c3"}
    outcome = recorder.events[-1]
    assert (outcome.incident, outcome.action, outcome.status) == ("inc-c3", "restart", "done")
    assert outcome.extra["ack_status"] == "already_satisfied"
    assert outcome.extra["order_id"] == order.order_id
    return p, recorder


def test_a_restart_already_satisfied_expects_nothing_later():
    """The demo's sequence: 13 s after the crash's satisfied restart an Xid 79 takes a GPU
    of the machine a hang before had the job exclude. That fault is not an effect of our
    restart: it is restarted for and alerted."""
    state = ServiceState()
    state.excluded["j1"] = ["vm"]
    p, rec = _crash_restart_satisfied(state)
    work = p.process(anomaly(kind="gpu_fault", id="x79", ranks=[], nodes=["vm"],
                             onset=T0 + 17.5, detected=T0 + 17.6), now=T0 + 18)
    assert summary(r for r in rec.events if r.incident == work.incident.id) == [
        ("restart", "planned"), ("alert", "done")]


def test_a_fault_after_a_satisfied_restart_is_a_new_incident():
    """An Xid 79 six seconds after the crash's restart was answered ``already_satisfied``:
    not a part of the crash's incident (which has its restart), a new one that evicts."""
    p, rec = _crash_restart_satisfied()
    work = p.process(anomaly(kind="gpu_fault", id="x79", ranks=[], nodes=["vm"],
                             onset=T0 + 6, detected=T0 + 6.1), now=T0 + 7)
    assert not work.dropped and work.incident.id == "inc-x79"
    assert summary(r for r in rec.events if r.incident == "inc-x79") == [
        ("evict", "planned"), ("restart", "planned"), ("alert", "done")]


def test_a_hardware_fault_covered_by_another_restart_is_still_alerted():
    p, rec, _ = pipe()
    p.process(anomaly(kind="hang", id="h1", ranks=[], nodes=[]), now=T0 + 2)
    p.process(anomaly(kind="gpu_fault", id="x1", nodes=[], onset=T0 + 3, detected=T0 + 3.5),
              now=T0 + 4)
    late = [r for r in rec.events if r.incident == "x1"]
    assert summary(late) == [("restart", "rate_limited"), ("alert", "done")]
    assert late[0].reason.startswith("expected: began while job j1 was being restarted")


def test_the_teardown_of_a_rollback_after_a_relaunch_is_still_expected():
    """trainguard run relaunched the job on its own, then a rollback is ordered: it is not
    satisfied by that launch (it tears the job down again), so the exits of that teardown
    are its own doing and start no new incident."""
    directory = JobDirectory()
    policy = Policy.from_dict({"ladder": {"nan": ["rollback", "alert"]}})
    p, rec, _ = pipe(policy=policy, directory=directory)
    directory.observe(ev.Lifecycle(job="j1", ts=T0 + 2, node="n1", event="start", pid=1,
                                   world_size=2))
    p.process(anomaly(kind="nan", id="n1", nodes=[]), now=T0 + 3)
    p.process(anomaly(id="c1", nodes=[], onset=T0 + 5, detected=T0 + 5.5), now=T0 + 6)
    late = [r for r in rec.events if r.incident == "c1"]
    assert summary(late) == [("restart", "rate_limited")]
    assert late[0].reason.startswith("expected: began while job j1 was being restarted")
