"""No action record says ``done`` for an order that changed nothing: a driver that made no
changing call, and ``trainguard run``'s eviction on one machine, say ``not_applicable``."""
from __future__ import annotations

import subprocess
from types import SimpleNamespace as NS

from trainguard import events as ev
from trainguard.actions.drivers import KubernetesDriver, SlurmDriver
from trainguard.actions.orders import check_targets, outcome_status
from trainguard.actions.pipeline import build_pipeline, driver_actions
from trainguard.actions.policy import Decision, Incident, Policy
from trainguard.actions.state import ServiceState
from trainguard.launcher.supervisor import Supervisor

from actions_harness import ListRecorder

INCIDENT = Incident(id="inc-1", job="j1", kind="gpu_fault", severity="critical", ranks=[0],
                    nodes=["n1"], onset_ts=1.0, detected_ts=2.0, summary="Xid 79 on n1")


def decision(action, **targets):
    return Decision(action=action, reason="gpu_fault: Xid 79 on n1",
                    targets={"job": "j1", **targets})


def ok_runner(argv, **kw):
    return subprocess.CompletedProcess(argv, 0, "", "")


class NoPods:
    def list_namespaced_pod(self, namespace, **kw):
        return NS(items=[])

    def patch_node(self, name, body, **kw):
        return NS()


def test_drivers_that_changed_nothing_are_not_applicable():
    act = driver_actions(SlurmDriver(drain=False, runner=ok_runner))
    status, reason = act["evict"](decision("evict", nodes=["n1"]), INCIDENT)
    assert status == "not_applicable" and reason.startswith("no_change: the driver")
    assert reason.endswith("[no call made]")
    act = driver_actions(KubernetesDriver(core_api=NoPods()))
    status, reason = act["restart"](decision("restart", exclude_nodes=[]), INCIDENT)
    assert status == "not_applicable" and "no pod matches job-name=j1" in reason
    status, _ = act["restart"](decision("restart", exclude_nodes=["n1"]), INCIDENT)
    assert status == "done"  # the cordon did change something


def test_drivers_that_acted_are_done_and_dry_runs_stay_dry_run():
    act = driver_actions(SlurmDriver(runner=ok_runner))
    assert act["evict"](decision("evict", nodes=["n1"]), INCIDENT)[0] == "done"
    act = driver_actions(SlurmDriver(dry_run=True), {"j1": "42"})
    assert act["restart"](decision("restart", exclude_nodes=["n1"]), INCIDENT)[0] == "dry_run"


def test_the_local_supervisor_never_says_done_for_an_eviction():
    published = []
    sup = Supervisor(job="j1", cmd=["python", "train.py"], environ={}, node="box",
                     publish=published.append, log=lambda m: None)
    order = ev.Order(job="j1", ts=1.0, order_id="o-1", op="evict", incident="inc-1",
                     targets={"nodes": ["box"]})
    assert sup.obey(order, check_targets("evict", order.targets)) == "not_applicable"
    [ack] = published
    assert (ack.status, ack.code) == ("not_applicable", "cannot_exclude")
    assert "nothing was excluded" in ack.reason
    assert ev.decode(ev.encode(ack)).status == "not_applicable"  # valid on the wire
    assert outcome_status(ack) == "not_applicable"  # and so it is recorded on the audit log


def test_a_driver_that_changed_nothing_is_recorded_not_applicable_with_its_code():
    rec = ListRecorder()
    pipe = build_pipeline(policy=Policy(), state=ServiceState(), recorder=rec,
                          drivers=driver_actions(SlurmDriver(drain=False, runner=ok_runner)))
    a = ev.Anomaly(job="j1", ts=101.0, id="a1", kind="gpu_fault", severity="critical",
                   ranks=[0], nodes=["n1"], onset_ts=100.0, detected_ts=101.0,
                   detector="gpu_fault", summary="Xid 79 on n1")
    pipe.process(a, now=102.0)
    [evict] = [r for r in rec.events if r.action == "evict"]
    assert (evict.status, evict.extra["code"]) == ("not_applicable", "no_change")
    assert ev.decode(ev.encode(evict)).status == "not_applicable"


def test_a_rollback_a_driver_cannot_pass_the_step_to_is_never_done():
    """Kubernetes cannot hand recreated pods the step: the rollback is not carried out and is
    recorded not_applicable with the reason. The Slurm driver requeues with the step in the
    job's comment (done); where it could not write it, failed, never done."""
    rollback = decision("rollback", exclude_nodes=[], rollback_step=40)
    status, reason = driver_actions(KubernetesDriver(core_api=NoPods()))["rollback"](
        rollback, INCIDENT)
    assert status == "not_applicable" and "cannot pass the resume step 40" in reason

    def slurm(answers):
        answers = list(answers)
        return SlurmDriver(runner=lambda argv, **kw: subprocess.CompletedProcess(
            argv, *answers.pop(0)) if answers else ok_runner(argv), sleep=lambda s: None)

    held = (0, "JobId=42 JobState=PENDING Restarts=1", "")
    status, reason = driver_actions(slurm([(0, "", ""), held, (0, "(null)\n", "")]),
                                    {"j1": "42"})["rollback"](rollback, INCIDENT)
    assert status == "done" and "Comment=trainguard-resume-step=40@1: done" in reason
    status, reason = driver_actions(slurm([(0, "", ""), held, (1, "", "squeue: timeout")]),
                                    {"j1": "42"})["rollback"](rollback, INCIDENT)
    assert status == "failed" and "squeue -h -j 42 -o %k: failed (exit 1: squeue: timeout)" \
        in reason and "scontrol release 42: done" in reason
