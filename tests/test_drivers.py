"""Slurm and Kubernetes recovery drivers: exact argv / API calls, dry run, failures.

Here the Slurm tools are fakes that record their argv (tests/test_slurm_cluster.py runs the
driver against a real Slurm cluster); the Kubernetes client is a fake object (and, where the
package is installed, the real client talking to a local HTTP stand-in for the API server)."""
from __future__ import annotations

import json
import stat
import subprocess
import sys
from types import SimpleNamespace as NS

import pytest
from http_receiver import HttpReceiver

from trainguard.actions.drivers import (DriverCall, InvalidTarget, KubernetesDriver,
                                        RecoveryDriver, SlurmDriver, build_driver, calls_ok)
from trainguard.errors import UserError


# ---------------------------------------------------------------- Slurm
class Runner:
    """Stands in for subprocess.run; answers from a list of (returncode, stdout, stderr)."""

    def __init__(self, answers=()):
        self.calls, self.answers = [], list(answers)

    def __call__(self, argv, **kw):
        self.calls.append((argv, kw))
        code, out, err = self.answers.pop(0) if self.answers else (0, "", "")
        if isinstance(code, BaseException):
            raise code
        return subprocess.CompletedProcess(argv, code, out, err)


def argvs(calls):
    return [c.argv for c in calls]


class Clock:
    """Injected time for the driver's wait: sleeping advances it."""

    def __init__(self):
        self.now, self.slept = 0.0, []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.slept.append(seconds)
        self.now += seconds


def slurm(runner, **kw):
    clock = Clock()
    return SlurmDriver(runner=runner, clock=clock, sleep=clock.sleep, **kw)


SHOW = ["scontrol", "show", "job", "-o"]


def test_slurm_requeue_holds_waits_for_the_old_run_then_starts_now():
    runner = Runner([(0, "", ""), (0, "JobId=4242 JobState=COMPLETING Reason=None", ""),
                     (0, "JobId=4242 JobState=COMPLETING", ""),
                     (0, "JobId=4242 JobState=PENDING Reason=JobHeldAdmin", "")])
    d = slurm(runner)
    calls = d.restart("4242")
    assert argvs(calls) == [["scontrol", "requeuehold", "4242"], SHOW + ["4242"],
                            ["scontrol", "update", "JobId=4242", "StartTime=now"],
                            ["scontrol", "release", "4242"]]
    assert [c.op for c in calls] == ["requeuehold", "wait", "update", "release"]
    assert [c.status for c in calls] == ["done"] * 4
    assert calls[1].output == "old run finished after 0.4 s (JobState=PENDING)"
    assert d.clock.slept == [0.2, 0.2, 1.0]  # polls, then a whole second for the credential
    argv, kw = runner.calls[0]
    assert isinstance(argv, list) and kw["shell"] is False and kw["timeout"] == 30.0
    assert len(runner.calls) == 6


def test_slurm_wait_is_bounded_and_an_unknown_state_does_not_wait():
    runner = Runner([(0, "", "")] + [(0, "JobState=COMPLETING", "")] * 100)
    calls = slurm(runner, wait_s=1.0).restart("7")
    assert calls[1].output.startswith("still COMPLETING after 1.0 s") and calls_ok(calls)
    runner = Runner()  # scontrol show job answers nothing usable
    d = slurm(runner)
    calls = d.restart("7")
    assert calls[1].output == "job state unknown; not waiting" and d.clock.slept == []


def test_slurm_requeue_with_exclusions_holds_updates_releases():
    runner = Runner()
    d = slurm(runner)
    calls = d.restart("4242_7", exclude_nodes=["gpu-12", "gpu-03", "gpu-12"])
    assert argvs(calls) == [["scontrol", "requeuehold", "4242_7"], SHOW + ["4242_7"],
                            ["scontrol", "update", "JobId=4242_7", "ExcNodeList=gpu-03,gpu-12",
                             "StartTime=now"],
                            ["scontrol", "release", "4242_7"]]
    assert [c.op for c in calls] == ["requeuehold", "wait", "update", "release"]
    assert [c[0] for c in runner.calls] == argvs(calls) and calls_ok(calls)


def test_slurm_requeue_rollback_writes_the_step_for_the_next_run_into_the_comment():
    shown = "JobId=42 JobState=PENDING Reason=job_requeued_in_held_state Requeue=1 Restarts=3"
    runner = Runner([(0, "", ""), (0, shown, ""), (0, "ablation b trainguard-resume-step=9@1\n",
                                                  ""), (0, "", ""), (0, "", "")])
    calls = slurm(runner).restart("42", ["n2"], resume_step=40)
    assert [c.op for c in calls] == ["requeuehold", "wait", "read_comment", "update", "release"]
    assert argvs(calls)[2] == ["squeue", "-h", "-j", "42", "-o", "%k"]
    # the owner's comment is kept; the stale token of restart 1 is replaced by run 3's
    assert argvs(calls)[3] == ["scontrol", "update", "JobId=42", "ExcNodeList=n2",
                               "StartTime=now", "Comment=ablation b trainguard-resume-step=40@3"]
    assert calls_ok(calls) and calls[2].output == ""
    with pytest.raises(InvalidTarget, match="resume step -1"):
        slurm(Runner()).restart("42", resume_step=-1)


def test_slurm_requeue_rollback_that_cannot_write_the_step_fails_but_releases():
    runner = Runner([(0, "", ""), (0, "JobId=42 JobState=PENDING Restarts=1", ""),
                     (1, "", "squeue: error: Invalid job id")])
    calls = slurm(runner).restart("42", ["n2"], resume_step=40)
    assert [(c.op, c.status) for c in calls] == [
        ("requeuehold", "done"), ("wait", "done"), ("read_comment", "failed"),
        ("update", "done"), ("release", "done")]
    assert not any(a.startswith("Comment=") for a in calls[3].argv) and not calls_ok(calls)
    runner = Runner([(0, "", ""), (0, "JobId=42 JobState=PENDING", "")])  # no Restarts=
    calls = slurm(runner).restart("42", resume_step=40)
    assert [(c.op, c.status) for c in calls][2:] == [
        ("read_comment", "failed"), ("update", "done"), ("release", "done")]
    assert "Restarts count is unknown" in calls[2].error
    assert [a[0][0] for a in runner.calls] == ["scontrol"] * 4  # squeue never asked


def test_slurm_evict_drains_and_later_restarts_keep_excluding():
    runner = Runner()
    d = slurm(runner, reason="trainguard: Xid 79 on GPU 3")
    calls = d.evict(["gpu-07", "gpu-01"])
    assert argvs(calls) == [["scontrol", "update", "NodeName=gpu-01,gpu-07", "State=DRAIN",
                             "Reason=trainguard: Xid 79 on GPU 3"]]
    assert argvs(d.evict(["gpu-09"], reason="trainguard incident i7: Xid 79"))[0][-1] == \
        "Reason=trainguard incident i7: Xid 79"
    with pytest.raises(ValueError, match="one non-empty line"):
        d.evict(["gpu-09"], reason="two\nlines")
    assert argvs(d.restart("99", ["gpu-03"]))[2] == [
        "scontrol", "update", "JobId=99", "ExcNodeList=gpu-01,gpu-03,gpu-07,gpu-09",
        "StartTime=now"]
    assert argvs(d.restart("99"))[2][-2] == "ExcNodeList=gpu-01,gpu-03,gpu-07,gpu-09"
    assert d.excluded == {"gpu-01", "gpu-03", "gpu-07", "gpu-09"}


def test_slurm_evict_without_drain_only_remembers():
    d = SlurmDriver(runner=Runner(), drain=False)
    assert d.evict(["n1"]) == [] and d.excluded == {"n1"}
    assert d.evict([]) == []


def test_slurm_resubmit_mode():
    runner = Runner([(0, "", ""), (0, "5001\n", "")])
    d = SlurmDriver(runner=runner, mode="resubmit", script="/jobs/train.sbatch",
                    sbatch_args=("--nodes=4", "--job-name=llama"), sbatch="/opt/slurm/bin/sbatch")
    calls = d.restart("5000", exclude_nodes=["n2", "n1"])
    assert argvs(calls) == [["scancel", "5000"],
                            ["/opt/slurm/bin/sbatch", "--parsable", "--exclude=n1,n2",
                             "--export=ALL,TRAINGUARD_RESUME=1,TRAINGUARD_RESTART_COUNT=1",
                             "--nodes=4", "--job-name=llama", "/jobs/train.sbatch"]]
    assert calls[1].output == "5001" and [c.op for c in calls] == ["cancel", "submit"]
    runner.answers = [(0, "", ""), (0, "5002\n", "")]
    again = argvs(d.restart("5000", resume_step=40))  # a rollback's step goes along
    assert again[0] == ["scancel", "5001"]  # the resubmitted job
    assert again[1][3] == ("--export=ALL,TRAINGUARD_RESUME=1,TRAINGUARD_RESTART_COUNT=2,"
                           "TRAINGUARD_RESUME_STEP=40")
    assert d.current("5000") == "5002"
    assert argvs(SlurmDriver(mode="resubmit", script="s.sh", dry_run=True).restart("1"))[1] == \
        ["sbatch", "--parsable", "--export=ALL,TRAINGUARD_RESUME=1,TRAINGUARD_RESTART_COUNT=1",
         "s.sh"]


def test_slurm_dry_run_runs_nothing():
    runner = Runner()
    d = SlurmDriver(runner=runner, dry_run=True)
    calls = d.restart("12", ["n1"]) + d.evict(["n2"])
    assert len(calls) == 4 and {c.status for c in calls} == {"dry_run"}  # no wait in a dry run
    assert runner.calls == [] and calls_ok(calls)
    assert d.plan_evict(["n3"]) == [["scontrol", "update", "NodeName=n3", "State=DRAIN",
                                     "Reason=trainguard evict"]]


def test_slurm_failure_is_recorded_and_a_held_job_is_released_all_the_same():
    runner = Runner([(0, "", ""), (0, "", ""),
                     (1, "", "slurm_update error: Invalid node name specified")])
    calls = slurm(runner).restart("12", ["n1"])
    # released after the failed update: a job left held by requeuehold never runs again
    assert [(c.op, c.status) for c in calls] == [("requeuehold", "done"), ("wait", "done"),
                                                 ("update", "failed"), ("release", "done")]
    assert calls[2].error == "exit 1: slurm_update error: Invalid node name specified"
    assert not calls_ok(calls) and len(runner.calls) == 4
    runner = Runner([(1, "", "Job has already finished")])
    calls = slurm(runner).restart("12")
    assert [(c.op, c.status) for c in calls] == [("requeuehold", "failed")]


def test_slurm_missing_tools_and_timeouts_are_failed_calls():
    calls = SlurmDriver(runner=Runner([(FileNotFoundError("scontrol"), "", "")])).restart("1")
    assert calls[0].status == "failed" and "install the Slurm client tools" in calls[0].error
    expired = subprocess.TimeoutExpired(["scontrol"], 5)
    calls = SlurmDriver(runner=Runner([(expired, "", "")]), timeout=5).evict(["n1"])
    assert calls[0].status == "failed" and calls[0].error == "no answer within 5 s"


@pytest.mark.parametrize("job, nodes", [("--all", []), ("12; rm -rf /", []), ("", []),
                                        ("12", ["-n1"]), ("12", ["n1 n2"]), ("12", ["n1,n2"])])
def test_slurm_refuses_odd_names_before_running_anything(job, nodes):
    runner = Runner()
    with pytest.raises(InvalidTarget) as info:
        SlurmDriver(runner=runner).restart(job, nodes)
    assert isinstance(info.value, UserError) and runner.calls == []


def test_slurm_config_is_validated():
    with pytest.raises(ValueError, match="needs script="):
        SlurmDriver(mode="resubmit")
    with pytest.raises(ValueError, match="mode must be one of"):
        SlurmDriver(mode="scancel")


def test_slurm_with_real_subprocesses_and_fake_tools(tmp_path):
    log = tmp_path / "argv.jsonl"
    for tool in ("scontrol", "sbatch", "scancel"):
        path = tmp_path / tool
        path.write_text(f"#!{sys.executable}\nimport json, sys\n"
                        f"open({str(log)!r}, 'a').write(json.dumps(sys.argv) + '\\n')\n"
                        f"print('4243' if sys.argv[0].endswith('sbatch') else '')\n")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    d = SlurmDriver(scontrol=str(tmp_path / "scontrol"), reason="trainguard: $(reboot) `x`")
    calls = d.evict(["n1"]) + d.restart("4242", ["n2"])
    assert [c.status for c in calls] == ["done"] * 5
    seen = [json.loads(line) for line in log.read_text().splitlines()]
    assert [s[1:] for s in seen] == [
        ["update", "NodeName=n1", "State=DRAIN", "Reason=trainguard: $(reboot) `x`"],
        ["requeuehold", "4242"], ["show", "job", "-o", "4242"],
        ["update", "JobId=4242", "ExcNodeList=n1,n2", "StartTime=now"],
        ["release", "4242"]]
    r = SlurmDriver(mode="resubmit", script="train.sbatch", scancel=str(tmp_path / "scancel"),
                    sbatch=str(tmp_path / "sbatch")).restart("4242")
    assert r[1].output == "4243"
    missing = SlurmDriver(scontrol=str(tmp_path / "nope")).restart("1")
    assert missing[0].status == "failed"


# ---------------------------------------------------------------- Kubernetes
class FakeCoreV1Api:
    """Records calls; same method names and parameters as kubernetes.client.CoreV1Api."""

    def __init__(self, pods=(), fail=None):
        self.calls, self.pods, self.fail = [], list(pods), fail or {}

    def _maybe_fail(self, method, key):
        exc = self.fail.get((method, key))
        if exc:
            raise exc

    def patch_node(self, name, body, **kw):
        self.calls.append(("patch_node", name, body, kw))
        self._maybe_fail("patch_node", name)
        return NS(metadata=NS(name=name))

    def list_namespaced_pod(self, namespace, **kw):
        self.calls.append(("list_namespaced_pod", namespace, kw))
        self._maybe_fail("list_namespaced_pod", namespace)
        return NS(items=[NS(metadata=NS(name=n), spec=NS(node_name=node))
                         for n, node in self.pods])

    def delete_namespaced_pod(self, name, namespace, **kw):
        self.calls.append(("delete_namespaced_pod", name, namespace, kw))
        self._maybe_fail("delete_namespaced_pod", name)
        return NS(metadata=NS(name=name))


class ApiException(Exception):
    def __init__(self, status, reason):
        super().__init__(f"({status})\nReason: {reason}\nHTTP response headers: ...")
        self.status, self.reason = status, reason


PODS = [("llama-worker-1", "n2"), ("llama-worker-0", "n1")]


def test_kubernetes_evict_cordons_each_node():
    api = FakeCoreV1Api()
    calls = KubernetesDriver(core_api=api).evict(["n2", "n1"])
    assert api.calls == [("patch_node", "n1", {"spec": {"unschedulable": True}}, {}),
                         ("patch_node", "n2", {"spec": {"unschedulable": True}}, {})]
    assert [(c.op, c.api, c.status) for c in calls] == [
        ("cordon", "CoreV1Api.patch_node", "done")] * 2


def test_kubernetes_restart_cordons_then_deletes_the_jobs_pods():
    api = FakeCoreV1Api(PODS)
    d = KubernetesDriver(core_api=api, namespace="train", job_label="training.kubeflow.org/"
                         "job-name", grace_period_seconds=10)
    calls = d.restart("llama", exclude_nodes=["n1"])
    assert api.calls == [
        ("patch_node", "n1", {"spec": {"unschedulable": True}}, {}),
        ("list_namespaced_pod", "train",
         {"label_selector": "training.kubeflow.org/job-name=llama"}),
        ("delete_namespaced_pod", "llama-worker-0", "train", {"grace_period_seconds": 10}),
        ("delete_namespaced_pod", "llama-worker-1", "train", {"grace_period_seconds": 10})]
    assert [c.op for c in calls] == ["cordon", "list_pods", "delete_pod", "delete_pod"]
    assert calls[1].output == "llama-worker-0, llama-worker-1" and calls_ok(calls)
    assert isinstance(d, RecoveryDriver)


def test_kubernetes_dry_run_reads_but_never_writes():
    api = FakeCoreV1Api(PODS)
    calls = KubernetesDriver(core_api=api, dry_run=True, grace_period_seconds=None).restart(
        "llama", ["n1"])
    assert [name for name, *_ in api.calls] == ["list_namespaced_pod"]
    assert [c.status for c in calls] == ["dry_run", "done", "dry_run", "dry_run"]
    assert calls[2].args == {"name": "llama-worker-0", "namespace": "default"}
    assert KubernetesDriver(core_api=api, dry_run=True).evict(["n3"])[0].status == "dry_run"
    assert len(api.calls) == 1


def test_kubernetes_failures_stop_and_a_pod_already_gone_is_fine():
    api = FakeCoreV1Api(PODS, fail={("patch_node", "n1"): ApiException(403, "Forbidden")})
    calls = KubernetesDriver(core_api=api).restart("llama", ["n1", "n2"])
    assert [(c.op, c.status) for c in calls] == [("cordon", "failed")]
    assert calls[0].error == "ApiException 403: Forbidden" and len(api.calls) == 1
    api = FakeCoreV1Api(PODS, fail={
        ("delete_namespaced_pod", "llama-worker-0"): ApiException(404, "Not Found")})
    calls = KubernetesDriver(core_api=api).restart("llama")
    assert [c.status for c in calls] == ["done"] * 3 and calls[1].output == "already gone"
    api = FakeCoreV1Api(PODS, fail={("list_namespaced_pod", "default"): OSError("refused")})
    calls = KubernetesDriver(core_api=api).restart("llama")
    assert [c.status for c in calls] == ["failed"] and "refused" in calls[0].error


def test_kubernetes_does_not_carry_out_a_rollback_it_cannot_pass_the_step_to():
    api = FakeCoreV1Api()
    calls = KubernetesDriver(core_api=api).restart("llama", ["n1"], resume_step=40)
    [call] = calls
    assert (call.op, call.status) == ("rollback", "not_applicable") and not calls_ok(calls)
    assert "cannot pass the resume step 40" in call.error
    assert api.calls == []  # nothing cordoned, no pod deleted


def test_kubernetes_no_pods_is_reported():
    calls = KubernetesDriver(core_api=FakeCoreV1Api()).restart("llama")
    assert len(calls) == 1 and calls[0].output == "no pod matches job-name=llama"


@pytest.mark.parametrize("job, nodes", [("llama run", []), ("-x", []), ("llama", ["N1"]),
                                        ("llama", ["n1/../x"]), ("a" * 64, [])])
def test_kubernetes_refuses_odd_names(job, nodes):
    api = FakeCoreV1Api()
    with pytest.raises(InvalidTarget):
        KubernetesDriver(core_api=api).restart(job, nodes)
    assert api.calls == []


def test_kubernetes_package_is_imported_lazily(monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # import kubernetes -> ImportError
    d = KubernetesDriver(dry_run=True)  # constructing needs no package and no cluster
    with pytest.raises(UserError, match=r"pip install 'trainguard\[k8s\]'"):
        d.restart("llama")  # a dry run still lists the pods, so it needs the client
    with pytest.raises(UserError, match="kubernetes package"):
        KubernetesDriver().evict(["n1"])


def test_kubernetes_real_client_against_a_local_api_stand_in():
    kubernetes = pytest.importorskip(
        "kubernetes", reason="the optional extra trainguard[k8s] is not installed")

    def pod(name, node):
        return {"metadata": {"name": name, "namespace": "train"},
                "spec": {"nodeName": node, "containers": [{"name": "c", "image": "x"}]}}

    with HttpReceiver(content_type="application/json") as rx:
        rx.script([
            (200, json.dumps({"kind": "Node", "apiVersion": "v1",
                              "metadata": {"name": "n1"}}).encode()),
            (200, json.dumps({"kind": "PodList", "apiVersion": "v1", "metadata": {},
                              "items": [pod("llama-1", "n2"), pod("llama-0", "n1")]}).encode()),
            (200, json.dumps({"kind": "Pod", "apiVersion": "v1", **pod("llama-0", "n1")}).encode()),
            (404, json.dumps({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                              "reason": "NotFound", "code": 404}).encode())])
        client = kubernetes.client
        api = client.CoreV1Api(client.ApiClient(client.Configuration(host=rx.url().rstrip("/"))))
        calls = KubernetesDriver(core_api=api, namespace="train").restart("llama", ["n1"])
        assert [c.status for c in calls] == ["done"] * 4 and calls[3].output == "already gone"
        got = [(r.method, r.path) for r in rx.requests]
        assert got == [("PATCH", "/api/v1/nodes/n1"),
                       ("GET", "/api/v1/namespaces/train/pods?labelSelector=job-name%3Dllama"),
                       ("DELETE", "/api/v1/namespaces/train/pods/llama-0?gracePeriodSeconds=30"),
                       ("DELETE", "/api/v1/namespaces/train/pods/llama-1?gracePeriodSeconds=30")]
        assert json.loads(rx.requests[0].body) == {"spec": {"unschedulable": True}}


# ---------------------------------------------------------------- common
def test_build_driver_and_call_records():
    d = build_driver({"type": "slurm", "dry_run": True, "sbatch_args": ["--nodes=2"],
                      "mode": "resubmit", "script": "t.sh"})
    assert d.sbatch_args == ("--nodes=2",)
    k = build_driver({"type": "kubernetes", "namespace": "train"}, core_api=FakeCoreV1Api())
    assert isinstance(k, KubernetesDriver) and k.namespace == "train"
    with pytest.raises(UserError, match="driver type 'pbs' is unknown"):
        build_driver({"type": "pbs"})
    with pytest.raises(UserError, match="driver slurm: "):
        build_driver({"type": "slurm", "colour": "red"})
    call = DriverCall(driver="slurm", op="requeue", argv=["scontrol", "requeue", "1"],
                      status="done")
    assert call.to_dict() == {"driver": "slurm", "op": "requeue",
                              "argv": ["scontrol", "requeue", "1"], "args": {},
                              "status": "done", "output": ""}
    assert json.dumps([c.to_dict() for c in d.restart("1")])
