"""Kubernetes: cordon bad nodes, delete the job's pods so that its controller recreates them.

Through the official client (``pip install 'trainguard[k8s]'``), imported only when a
driver first needs a client; tests inject ``core_api``, any object with the three
``CoreV1Api`` methods used:

- ``evict(nodes)``: ``patch_node(name, {"spec": {"unschedulable": True}})`` per node (a
  cordon; pods already there keep running until the restart deletes them);
- ``restart(job_ref, exclude_nodes)``: cordon ``exclude_nodes``, then
  ``list_namespaced_pod(namespace, label_selector="<job_label>=<job_ref>")`` and
  ``delete_namespaced_pod(name, namespace, grace_period_seconds=...)`` for each pod. The
  controller that owns the pods (a Job, JobSet, PyTorchJob, StatefulSet...) makes new ones,
  which the scheduler keeps off cordoned nodes. A pod already gone (404) counts as deleted.
- a rollback (``restart`` with ``resume_step``): not carried out, one ``not_applicable``
  call says why (a recreated pod gets its spec's environment; nothing would carry the step).

Dry run plans the writes but still *reads*: it lists the pods so the plan names them.

>>> from types import SimpleNamespace as NS
>>> class Fake:
...     def list_namespaced_pod(self, namespace, **kw):
...         pod = NS(metadata=NS(name="llama-0"), spec=NS(node_name="n1"))
...         return NS(items=[pod])
>>> d = KubernetesDriver(namespace="train", core_api=Fake(), dry_run=True)
>>> for c in d.restart("llama", exclude_nodes=["n1"]):
...     print(c.status, c.describe())
dry_run CoreV1Api.patch_node(name='n1', body={'spec': {'unschedulable': True}})
done CoreV1Api.list_namespaced_pod(namespace='train', label_selector='job-name=llama')
dry_run CoreV1Api.delete_namespaced_pod(name='llama-0', namespace='train', grace_period_seconds=30)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable

from trainguard.errors import UserError

from .base import DriverCall, check_names, cut

__all__ = ["KubernetesDriver", "load_core_api", "CORDON"]

CORDON = {"spec": {"unschedulable": True}}
REASON_ANNOTATION = "trainguard.io/evict-reason"
NODE_NAME = re.compile(r"[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?")
LABEL_VALUE = re.compile(r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
LABEL_KEY = re.compile(r"(?:[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?/)?"
                       r"[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


def load_core_api(*, kubeconfig: str | None = None, context: str | None = None,
                  in_cluster: bool | None = None) -> Any:
    """A ``kubernetes.client.CoreV1Api`` with in-cluster or kubeconfig credentials."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise UserError("the Kubernetes driver needs the kubernetes package; install it with "
                        "pip install 'trainguard[k8s]'") from None
    try:
        if in_cluster is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config(config_file=kubeconfig, context=context)
        elif in_cluster:
            config.load_incluster_config()
        else:
            config.load_kube_config(config_file=kubeconfig, context=context)
    except Exception as exc:
        raise UserError(f"cannot load Kubernetes credentials ({type(exc).__name__}: "
                        f"{str(exc)[:200]}); give kubeconfig= or run in a pod with a service "
                        f"account") from None
    return client.CoreV1Api()


@dataclass(kw_only=True)
class KubernetesDriver:
    """``job_label``: the pod label whose value is the job (``job-name`` for a batch Job,
    ``training.kubeflow.org/job-name`` for a PyTorchJob, ``jobset.sigs.k8s.io/jobset-name``
    for a JobSet)."""

    KIND: ClassVar[str] = "kubernetes"

    namespace: str = "default"
    job_label: str = "job-name"
    grace_period_seconds: int | None = 30
    dry_run: bool = False
    core_api: Any = None
    kubeconfig: str | None = None
    context: str | None = None
    in_cluster: bool | None = None

    def __post_init__(self):
        check_names([self.namespace], NODE_NAME, "namespace", "a Kubernetes namespace")
        check_names([self.job_label], LABEL_KEY, "label key", "a Kubernetes label key")
        if self.grace_period_seconds is not None and not (
                isinstance(self.grace_period_seconds, int) and self.grace_period_seconds >= 0):
            raise ValueError("grace_period_seconds must be an int >= 0 or None")
        self._api = self.core_api

    def api(self) -> Any:
        if self._api is None:
            self._api = load_core_api(kubeconfig=self.kubeconfig, context=self.context,
                                      in_cluster=self.in_cluster)
        return self._api

    # ----------------------------------------------------------------- the interface
    def evict(self, nodes: Iterable[str], reason: str | None = None) -> list[DriverCall]:
        """Cordon ``nodes``; a ``reason`` goes into the node annotation
        ``trainguard.io/evict-reason`` (a cordon has no reason field of its own)."""
        body = CORDON if not reason else {**CORDON, "metadata": {
            "annotations": {REASON_ANNOTATION: reason[:1000]}}}
        calls: list[DriverCall] = []
        for node in check_names(nodes, NODE_NAME, "node", "a Kubernetes node name"):
            if not self._call(calls, "cordon", "patch_node", name=node, body=body):
                break
        return calls

    def restart(self, job_ref: str, exclude_nodes: Iterable[str] = (),
                resume_step: int | None = None) -> list[DriverCall]:
        """A rollback (``resume_step`` given) is not carried out: the recreated pods get
        their spec's environment, so nothing would tell them the step, and a restart from the
        newest checkpoint is what a rollback must not be. The one call returned is
        ``not_applicable`` and says so; nothing is cordoned or deleted."""
        [job] = check_names([job_ref], LABEL_VALUE, "job", "a Kubernetes label value")
        if resume_step is not None:
            return [DriverCall(
                driver=self.KIND, op="rollback", api="KubernetesDriver.restart",
                args={"job": job, "resume_step": resume_step}, status="not_applicable",
                error=(f"the Kubernetes driver cannot pass the resume step {resume_step} to "
                       f"the recreated pods (they get their spec's environment) and did not "
                       f"restart the job from its newest checkpoint instead; roll back by "
                       f"hand: TRAINGUARD_RESUME_STEP={resume_step} in the pod template"))]
        calls = self.evict(exclude_nodes)
        if calls and calls[-1].status == "failed":
            return calls
        selector = f"{self.job_label}={job}"
        pods = self._call(calls, "list_pods", "list_namespaced_pod", read=True,
                          namespace=self.namespace, label_selector=selector)
        if pods is None:
            return calls
        names = sorted(p.metadata.name for p in (getattr(pods, "items", None) or []))
        calls[-1].output = ", ".join(names) or f"no pod matches {selector}"
        for name in names:
            kwargs: dict = {"name": name, "namespace": self.namespace}
            if self.grace_period_seconds is not None:
                kwargs["grace_period_seconds"] = self.grace_period_seconds
            if not self._call(calls, "delete_pod", "delete_namespaced_pod", missing_ok=True,
                              **kwargs):
                break
        return calls

    def _call(self, calls: list[DriverCall], op: str, method: str, *, read: bool = False,
              missing_ok: bool = False, **kwargs) -> Any:
        """Run (or in dry run, plan) one API call; falsy only when it failed."""
        call = DriverCall(driver=self.KIND, op=op, api=f"CoreV1Api.{method}", args=kwargs)
        calls.append(call)
        if self.dry_run and not read:
            call.status = "dry_run"
            return True
        try:
            result = getattr(self.api(), method)(**kwargs)
        except UserError:
            raise
        except Exception as exc:
            status = getattr(exc, "status", None)
            if missing_ok and status == 404:
                call.status, call.output = "done", "already gone"
                return True
            call.status = "failed"
            reason = getattr(exc, "reason", None) or cut(str(exc))[:300]
            call.error = f"{type(exc).__name__}" + (f" {status}" if status else "") + \
                f": {reason}"
            return None
        call.status = "done"
        return result if result is not None else True
