"""The action service's values: the list of actions, the incident, a decision, a history.

**The actions** exist once, as the SPEC §6 ``action`` enum of :data:`trainguard.events.ACTIONS`;
every other list of the service is derived from it here (:data:`JOB_ACTIONS`: those that
change a job, sent as orders; :data:`RELAUNCHES`: those that relaunch it).

**The incident** has one in-process type, :class:`Incident`. The two wire shapes stay as
SPEC.md has them and are converted here, and only here: the correlator's SPEC §4 dict
(:meth:`Incident.of_dict`, :meth:`Incident.as_dict`) and the SPEC §6 ``incident`` event
(:meth:`Incident.of_event`, :meth:`Incident.to_event`).

>>> from trainguard.detectors.correlate import summarize
>>> a = ev.Anomaly(job="j1", ts=101.0, id="a1", kind="crash", severity="critical", ranks=[1],
...                nodes=["n1"], step=40, onset_ts=100.0, detected_ts=101.0, detector="crash",
...                summary="rank 1 exited with code 1")
>>> found = summarize("inc-a1", [a])
>>> inc = Incident.of_dict(found, a)
>>> inc.id, inc.kind, inc.ranks, inc.kinds, inc.as_dict() == found
('inc-a1', 'crash', [1], ['crash'], True)
>>> inc.to_event() == ev.Incident.of(found)
True
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainguard import events as ev

__all__ = ["ACTIONS", "JOB_ACTIONS", "RELAUNCHES", "Incident", "Decision", "History"]

#: every action the service records (SPEC §6 ``action.action``): the one list
ACTIONS: tuple = ev.ACTIONS
#: the actions that change a job (an order to ``trainguard run`` or a driver carries them
#: out; dry-run and approval stop them): those of :data:`ACTIONS` that are order ops
JOB_ACTIONS: tuple = tuple(a for a in ACTIONS if a in ev.ORDER_OPS)
#: the job actions that relaunch the job (a rollback is a restart from an older checkpoint)
RELAUNCHES: tuple = tuple(a for a in JOB_ACTIONS if a in ("restart", "rollback"))


@dataclass(kw_only=True)
class Incident:
    """One problem of one job, made of one or more anomalies; ``kind`` is its root cause,
    ``kinds`` the kinds of its anomalies (empty: just ``kind``)."""

    id: str
    job: str
    kind: str
    severity: str
    ranks: list
    nodes: list
    onset_ts: float
    detected_ts: float
    summary: str
    step: int | None = None
    anomalies: list = field(default_factory=list)
    evidence: dict = field(default_factory=dict)
    kinds: list = field(default_factory=list)
    #: anomalies of the root kind among its members (episodes: a spike twice is two)
    same_kind: int = 1

    # -------------------------------------------------------------- from the wire shapes
    @classmethod
    def of_anomaly(cls, anomaly: ev.Anomaly) -> "Incident":
        """One incident per anomaly, with the anomaly's id (the fallback correlation)."""
        return cls(id=anomaly.id, job=anomaly.job, kind=anomaly.kind,
                   severity=anomaly.severity, ranks=list(anomaly.ranks),
                   nodes=list(anomaly.nodes), onset_ts=anomaly.onset_ts,
                   detected_ts=anomaly.detected_ts, summary=anomaly.summary,
                   step=anomaly.step, anomalies=[anomaly.id], evidence=dict(anomaly.evidence),
                   kinds=[anomaly.kind])

    @classmethod
    def of_dict(cls, found: dict, anomaly: ev.Anomaly,
                   kinds: dict | None = None) -> "Incident":
        """From the correlator's incident dict (SPEC §4 shape) and the anomaly that just
        joined it; machines of the ranks come from ``evidence.rank_nodes`` when the anomalies
        name none. ``kinds`` (``{anomaly id: kind}`` of the anomalies seen so far) gives the
        incident's member kinds, root kind first."""
        ids = list(found.get("anomalies") or [anomaly.id])
        seen = [anomaly.kind if i == anomaly.id else (kinds or {}).get(i) for i in ids]
        members = list(dict.fromkeys([found["kind"], *filter(None, seen)]))
        evidence = dict(anomaly.evidence)
        nodes = list(found.get("nodes") or [])
        where = evidence.get("rank_nodes") or {}
        if not nodes and isinstance(where, dict):
            nodes = sorted({where[str(r)] for r in found["ranks"] if where.get(str(r))})
        return cls(id=found["id"], job=found["job"], kind=found["kind"],
                   severity=found["severity"], ranks=list(found["ranks"]), nodes=nodes,
                   onset_ts=found["onset_ts"],
                   detected_ts=max(found["detected_ts"], anomaly.detected_ts),
                   summary=found["summary"], step=found.get("step"), anomalies=ids,
                   evidence=evidence, kinds=members,
                   same_kind=max(1, sum(1 for k in seen if k == found["kind"])))

    @classmethod
    def of_event(cls, event: ev.Incident) -> "Incident":
        """From a SPEC §6 ``incident`` event (a grouping only: no evidence, member kinds
        unknown beyond the root's)."""
        return cls(id=event.id, job=event.job, kind=event.kind, severity=event.severity,
                   ranks=list(event.ranks), nodes=list(event.nodes), onset_ts=event.onset_ts,
                   detected_ts=event.detected_ts, summary=event.summary, step=event.step,
                   anomalies=list(event.anomalies), kinds=[event.kind])

    # -------------------------------------------------------------- to the wire shapes
    def as_dict(self) -> dict:
        """The SPEC §4 incident dict (``analyze --json``, the correlator's)."""
        return {"id": self.id, "kind": self.kind, "job": self.job, "ranks": list(self.ranks),
                "nodes": list(self.nodes), "step": self.step, "onset_ts": self.onset_ts,
                "detected_ts": self.detected_ts, "severity": self.severity,
                "summary": self.summary, "anomalies": list(self.anomalies)}

    def to_event(self, ts: float | None = None) -> ev.Incident:
        """The SPEC §6 ``incident`` event (stamped ``ts``, default ``detected_ts``)."""
        event = ev.Incident.of(self.as_dict())
        return event if ts is None else event.replace(ts=ts)



@dataclass(kw_only=True, frozen=True)
class Decision:
    """One action for one incident; ``status`` starts ``planned`` and the safety stage may
    turn it into ``dry_run`` or ``rate_limited``; ``reason`` says why, for humans, and
    ``code`` the same as one word that programs decide on (``restart_cap``, ``dry_run``,
    ``covered``, ...; the reason starts with it). ``order_id``: the order that carries the
    decision out, once sent."""

    action: str
    reason: str
    targets: dict = field(default_factory=dict)
    status: str = "planned"
    severity: str = "warning"
    code: str | None = None
    order_id: str | None = None

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}")

    def with_status(self, status: str, reason: str, code: str | None = None) -> "Decision":
        return replace(self, status=status, reason=reason, code=code or self.code)


@dataclass(kw_only=True)
class History:
    """What the service already knows, for one incident: actions recorded for it
    (``{action: status}``), when the job's other failures happened per machine
    (``node_failures``: ``{node: [ts, ...]}``, this incident excluded), the machines
    already evicted from the job, and when the incident was first seen."""

    done: dict = field(default_factory=dict)
    node_failures: dict = field(default_factory=dict)
    excluded_nodes: list = field(default_factory=list)
    first_seen_ts: float | None = None
    #: when the job's earlier incidents of the same kind were first seen (this one excluded)
    same_kind_ts: list = field(default_factory=list)
