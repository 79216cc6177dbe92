"""The escalation ladder: pure decisions per anomaly kind, and the policy file."""
import json

import pytest

from trainguard.actions.policy import (DEFAULT_LADDER, History, Incident, Policy, PolicyError,
                                       decide, load_policy)


def incident(kind, ranks=(1,), nodes=("n1",), onset=100.0, detected=110.0, step=50,
             evidence=None, id="i1"):
    return Incident(id=id, job="j1", kind=kind, severity="critical", ranks=list(ranks),
                    nodes=list(nodes), onset_ts=onset, detected_ts=detected,
                    summary=f"{kind} happened", step=step, anomalies=[f"a-{id}"],
                    evidence=dict(evidence or {}))


def actions(decisions):
    return [d.action for d in decisions]


def test_a_restart_names_the_ranks_an_order_may_carry_and_no_more():
    from trainguard.actions.orders import MAX_RANKS, order_of

    small = decide(Policy(), incident("crash", ranks=[3, 1, 3]), History())
    assert [d.targets.get("ranks") for d in small if d.action == "restart"] == [[1, 3]]
    big = incident("hang", ranks=range(MAX_RANKS + 1))    # a hang of a 100k-rank job
    restart = next(d for d in decide(Policy(), big, History()) if d.action == "restart")
    assert "ranks" not in restart.targets                  # the order still goes out
    assert "ranks" not in order_of(restart, big, ts=200.0).targets


def test_gpu_fault_evicts_the_machine_and_restarts():
    out = decide(Policy(), incident("gpu_fault", nodes=["n7"]), History())
    assert actions(out) == ["evict", "restart", "alert"]
    assert out[0].targets["nodes"] == ["n7"]
    assert out[1].targets == {"job": "j1", "onset_ts": 100.0, "exclude_nodes": ["n7"],
                              "ranks": [1]}
    assert all(d.status == "planned" for d in out)


def test_gpu_fault_without_a_machine_restarts_only():
    out = decide(Policy(), incident("gpu_fault", nodes=[]), History())
    assert actions(out) == ["restart", "alert"]


def test_first_crash_restarts_a_repeated_one_evicts():
    first = decide(Policy(), incident("crash"), History())
    assert actions(first) == ["restart", "alert"]
    again = decide(Policy(), incident("crash", detected=2000.0),
                   History(node_failures={"n1": [1500.0]}))
    assert actions(again) == ["evict", "restart", "alert"]
    assert again[0].reason.startswith("repeated_failure: n1 failed 2 times")


def test_crash_outside_the_window_does_not_evict():
    late = decide(Policy(crash_window_s=600), incident("crash", detected=5000.0),
                  History(node_failures={"n1": [1000.0]}))
    assert actions(late) == ["restart", "alert"]


def test_hang_with_suspects_evicts_their_machines():
    loc = {"suspects": [2], "nodes": ["n2"], "world_size": 8, "summary": "rank 2 differs",
           "group_nodes": {"tp": ["n2", "n3"], "dp": [], "pp": []}}
    out = decide(Policy(), incident("hang", ranks=[], nodes=[]), History(), loc)
    assert actions(out) == ["evict", "restart", "alert"]
    assert out[0].targets["nodes"] == ["n2"]
    over = decide(Policy(over_evict="tp"), incident("hang", ranks=[], nodes=[]), History(), loc)
    assert over[0].targets["nodes"] == ["n2", "n3"]
    assert over[1].targets["exclude_nodes"] == ["n2", "n3"]


def test_hang_without_outliers_restarts():
    loc = {"suspects": [], "nodes": [], "world_size": 4, "summary": "all wait in all_reduce"}
    out = decide(Policy(), incident("hang", ranks=[], nodes=[]), History(), loc)
    assert actions(out) == ["restart", "alert"]
    assert "no outlier" in out[0].reason


def test_hang_blaming_too_many_ranks_does_not_evict():
    loc = {"suspects": [0, 1, 2], "nodes": ["n0", "n1"], "world_size": 4, "summary": "?"}
    out = decide(Policy(), incident("hang", ranks=[], nodes=[]), History(), loc)
    assert actions(out) == ["restart", "alert"]


def test_hang_with_failed_capture_restarts():
    assert actions(decide(Policy(), incident("hang"), History(), None)) == ["restart", "alert"]


def test_straggler_alerts_then_evicts_when_persistent():
    policy = Policy(straggler_persist_s=300, straggler_min_slowdown=1.3)
    short = incident("straggler", onset=100.0, detected=200.0, evidence={"slowdown": 1.8})
    assert actions(decide(policy, short, History())) == ["alert"]
    long = incident("straggler", onset=100.0, detected=500.0, evidence={"slowdown": 1.8})
    out = decide(policy, long, History(done={"alert": "done"}))
    assert actions(out) == ["evict", "restart", "alert"]
    assert out[0].reason.startswith("persistent_straggler: 1.80x slower for 400s")
    mild = incident("straggler", onset=100.0, detected=500.0, evidence={"slowdown": 1.1})
    assert actions(decide(policy, mild, History(done={"alert": "done"}))) == []


def test_straggler_persistence_counts_from_first_sighting():
    policy = Policy(straggler_persist_s=300)
    late = incident("straggler", onset=450.0, detected=500.0, evidence={"ratio": 2.0})
    assert actions(decide(policy, late, History(first_seen_ts=100.0))) == ["evict", "restart",
                                                                            "alert"]


def test_nan_alerts_and_rollback_is_optional():
    assert actions(decide(Policy(), incident("nan"), History())) == ["alert"]
    policy = Policy(ladder={"nan": ["alert", "rollback"]})     # every NaN, not a repeated one
    out = decide(policy, incident("nan", step=50, evidence={"onset_step": 48}), History())
    assert actions(out) == ["rollback", "alert"]
    assert out[0].targets["rollback_step"] == 48  # resumes at 48: the onset's step undone


@pytest.mark.parametrize("kind", ["nan", "loss_spike", "grad_spike"])
def test_a_repeated_spike_or_nan_rolls_back_to_its_onset_a_single_one_alerts(kind):
    """Issue 12 point 4: the second incident of the kind within repeat_window_s rolls back
    to the newest checkpoint at or before the onset's step; one alone, or one an hour and
    more after the last, is only told."""
    now = incident(kind, step=50, evidence={"onset_step": 47}, detected=5000.0, id="i2")
    assert actions(decide(Policy(), now, History())) == ["alert"]
    assert actions(decide(Policy(), now, History(same_kind_ts=[5000.0 - 3601]))) == ["alert"]
    out = decide(Policy(), now, History(same_kind_ts=[4000.0]))
    assert actions(out) == ["rollback", "alert"]
    assert out[0].targets["rollback_step"] == 47
    assert actions(decide(Policy(), now, History(same_kind_ts=[4000.0],
                                                 done={"rollback": "done"}))) == ["alert"]
    three = Policy(repeat_count=3)
    assert actions(decide(three, now, History(same_kind_ts=[4000.0]))) == ["alert"]
    now.same_kind = 2                   # a second spike joined the same incident
    assert actions(decide(Policy(), now, History())) == ["rollback", "alert"]


def test_the_service_state_counts_the_jobs_earlier_incidents_of_the_kind(tmp_path):
    from trainguard.actions.state import ServiceState

    state = ServiceState(tmp_path / "state.json")
    for inc, job, kind, ts in (("a", "j1", "loss_spike", 100.0), ("b", "j2", "loss_spike", 200.0),
                               ("c", "j1", "nan", 300.0)):
        state.note_incident(Incident(id=inc, job=job, kind=kind, severity="warning", ranks=[],
                                     nodes=[], onset_ts=ts, detected_ts=ts, summary=""), ts)
    now = Incident(id="d", job="j1", kind="loss_spike", severity="warning", ranks=[],
                   nodes=[], onset_ts=400.0, detected_ts=400.0, summary="")
    state.note_incident(now, 400.0)
    assert state.history(now).same_kind_ts == [100.0]


def test_gpu_degraded_alerts():
    out = decide(Policy(), incident("gpu_degraded"), History())
    assert actions(out) == ["alert"]
    assert out[0].severity == "critical"


def test_done_actions_are_not_repeated():
    done = History(done={"evict": "planned", "restart": "planned", "alert": "done"})
    assert decide(Policy(), incident("gpu_fault"), done) == []


def test_already_excluded_machines_are_not_evicted_again():
    out = decide(Policy(), incident("gpu_fault", nodes=["n1"]), History(excluded_nodes=["n1"]))
    assert actions(out) == ["restart", "alert"]
    assert out[0].targets["exclude_nodes"] == ["n1"]


def test_every_kind_has_a_default_ladder():
    from trainguard import events as ev

    assert set(DEFAULT_LADDER) == set(ev.ANOMALY_KINDS)


def test_policy_file(tmp_path):
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"_comment": "ours", "over_evict": "dp",
                                "limits": {"max_restarts": 2},
                                "ladder": {"gpu_degraded": ["alert", "evict"]}}))
    policy = load_policy(path)
    assert policy.over_evict == "dp" and policy.limits.max_restarts == 2
    assert policy.ladder["gpu_degraded"] == ("alert", "evict")
    assert policy.ladder["hang"] == DEFAULT_LADDER["hang"]
    assert load_policy(path, dry_run=True).dry_run
    assert Policy.from_dict(policy.to_dict()) == policy


@pytest.mark.parametrize("data, words", [
    ({"ladder": {"hang": ["reboot"]}}, "unknown step"),
    ({"ladder": {"oops": ["alert"]}}, "unknown anomaly kind"),
    ({"limits": {"max_restarts": 0}}, "limits.max_restarts must be a positive integer"),
    ({"limits": {"max_restart": 3}}, "unknown limits key"),
    ({"require_approval": ["alert"]}, "require_approval"),
    ({"over_evict": "rack"}, "over_evict"),
    ({"capture": {"rounds": 1.5}}, "capture.rounds"),
])
def test_policy_mistakes_are_user_errors(tmp_path, data, words):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PolicyError, match=words):
        load_policy(path)


def test_unreadable_policy_file(tmp_path):
    with pytest.raises(PolicyError, match="cannot read policy file"):
        load_policy(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(PolicyError, match="not valid JSON"):
        load_policy(tmp_path / "bad.json")


def escalated(kind, kinds, **kw):
    inc = incident(kind, **kw)
    inc.kinds = list(kinds)
    return inc


def test_ladders_are_ordered_by_their_strongest_step():
    strength = Policy().strength
    assert strength("gpu_fault") > strength("hang") == strength("crash") \
        > strength("straggler") > strength("nan")


def test_a_hang_joining_a_nan_incident_escalates_to_the_hang_ladder():
    loc = {"suspects": [2], "nodes": ["n2"], "world_size": 8, "summary": "rank 2 differs"}
    inc = escalated("nan", ["nan", "hang"], ranks=[1], nodes=[])
    out = decide(Policy(), inc, History(done={"alert": "done"}), loc)
    assert actions(out) == ["evict", "restart", "alert"]
    assert out[0].reason.startswith("hang_suspects: stack analysis blames rank(s) [2]")
    assert out[1].reason == "escalated: hang joined nan incident i1; hang: restart after " \
                            "evicting n2"
    assert out[2].reason == "escalated: hang joined nan incident i1: nan happened"


def test_a_straggler_that_hangs_escalates_to_a_restart():
    inc = escalated("straggler", ["straggler", "hang"], ranks=[2], nodes=["n1"],
                    evidence={"slowdown": 1.5})
    done = History(done={"capture_stacks": "done", "alert": "done"})
    out = decide(Policy(), inc, done)
    assert actions(out) == ["restart", "alert"]
    assert out[0].reason.startswith("escalated: hang joined straggler incident i1:")
    # once restarted, the incident's further anomalies change nothing
    assert decide(Policy(), inc, History(done={**done.done, "restart": "planned"})) == []


def test_a_stronger_or_equal_root_keeps_its_own_ladder():
    gpu = decide(Policy(), escalated("gpu_fault", ["gpu_fault", "hang"], nodes=["n7"]),
                 History())
    assert actions(gpu) == ["evict", "restart", "alert"]
    assert not any(d.reason.startswith("escalated") for d in gpu)
    crash = decide(Policy(), escalated("crash", ["crash", "hang"]), History())
    assert [d.reason for d in crash] == ["crash: crash happened"] * 2
    rollback = Policy(ladder={"nan": ["alert", "rollback"]})  # as strong as a hang's restart
    assert actions(decide(rollback, escalated("nan", ["nan", "hang"]), History())) == [
        "rollback", "alert"]


def test_a_job_stopped_from_outside_is_reported_not_restarted():
    from trainguard.actions.policy import History, Incident, Policy, decide

    incident = Incident(id="inc-stop", job="j", kind="crash", severity="warning", ranks=[],
                        nodes=[], onset_ts=100.0, detected_ts=103.0,
                        summary="the job was stopped from outside",
                        evidence={"external_stop": True})
    decisions = decide(Policy(), incident, History())
    assert [d.action for d in decisions] == ["alert"]
