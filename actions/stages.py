"""The stages of the action pipeline (:mod:`trainguard.actions.pipeline` assembles them).

Each stage is a small object called with the :class:`~trainguard.actions.interfaces.Work`
of one anomaly (the :class:`~trainguard.actions.interfaces.Stage` protocol); it declares
the interfaces of :mod:`trainguard.actions.interfaces` it ``reads`` and ``writes``, and
keeps only a narrow view of the ledger (:func:`~trainguard.actions.interfaces.narrow`).
The stages that give the anomaly its incident live with the incident book
(:mod:`trainguard.actions.incidents`), the confirmation with the job's progress
(:mod:`trainguard.actions.confirm`). The decisions themselves (``decide`` of
:mod:`trainguard.actions.policy`, ``apply_limits`` of :mod:`trainguard.actions.safety`) are
pure; I/O comes in through injected objects.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from trainguard import events as ev
from trainguard.actions.incidents import restarts_seen
from trainguard.actions.interfaces import (AnomalyIn, DecisionList, IncidentHistory,
                                           IncidentSlot, LedgerWrites, Records, SafetyRecord,
                                           SeenAnomalies, StackAnalysis, Verdict, Work, narrow)
from trainguard.actions.model import JOB_ACTIONS, RELAUNCHES, Decision, Incident
from trainguard.actions.orders import targets_of
from trainguard.actions.policy import Policy, decide, ladder_kind
from trainguard.actions.safety import apply_limits
from trainguard.actions.waits import Blocking
from trainguard.logs import service_logger

__all__ = ["Dedup", "Investigate", "Decide", "Limit", "Act", "Record", "Dispatch", "Notify",
           "action_event", "driver_actions", "DRIVER_CODES", "READ_ONLY_OPS"]


def action_event(decision: Decision, incident: Incident, ts: float) -> ev.Action:
    """The SPEC ``action`` record of a decision. Extra fields (documented in docs/POLICY.md):
    ``action_id`` (stable per incident and action, so a consumer can drop repeats),
    ``source``, ``kind``, ``severity``, ``ranks``, ``nodes``, ``anomalies``, ``detected_ts``,
    and where set ``code`` (the decision's reason as one word) and ``order_id``."""
    extra = {"action_id": f"{incident.id}:{decision.action}", "source": "actions",
             "kind": incident.kind, "severity": decision.severity,
             "ranks": list(incident.ranks), "nodes": list(incident.nodes),
             "anomalies": list(incident.anomalies), "detected_ts": incident.detected_ts}
    if decision.code:
        extra["code"] = decision.code
    if decision.order_id:
        extra["order_id"] = decision.order_id
    return ev.Action(job=incident.job, ts=ts, incident=incident.id, action=decision.action,
                     targets=dict(decision.targets), status=decision.status,
                     reason=decision.reason, extra=extra)


class Dedup:
    """Drops anomalies already handled (delivered twice, or re-read after a restart of the
    service), anomalies older than ``policy.max_anomaly_age_s``, and further anomalies of an
    incident for which a restart or rollback was already decided (whatever became of it:
    a rate-limited one is not retried)."""

    name = "dedup"
    exclusive = True
    reads = (AnomalyIn, IncidentSlot, SeenAnomalies, IncidentHistory)
    writes = (Verdict, LedgerWrites)

    def __init__(self, state, policy: Policy):
        self.state = narrow(state, self)
        self.policy = policy

    def __call__(self, work: Work) -> bool:
        anomaly, incident = work.anomaly, work.incident
        if self.state.seen_anomaly(anomaly.id):
            return work.drop("duplicate", f"anomaly {anomaly.id} was already handled")
        age = work.now - anomaly.detected_ts
        if age > self.policy.max_anomaly_age_s:
            return work.drop("stale", f"anomaly {anomaly.id} was detected {age:.0f}s ago "
                                      f"(max_anomaly_age_s {self.policy.max_anomaly_age_s:g})")
        done = self.state.history(incident).done
        restarted = [a for a in RELAUNCHES if a in done]
        if restarted:
            self.state.note_incident(incident, work.now)
            return work.drop("duplicate", f"incident {incident.id} already has a "
                                          f"{restarted[0]} ({done[restarted[0]]})")
        return True


class Investigate:
    """Captures and aggregates the stacks of all ranks when the ladder the incident gets
    (:func:`~trainguard.actions.policy.ladder_kind`) asks for it. It waits for the replies
    without the pipeline's lock (a waiting generator, see :mod:`trainguard.actions.waits`),
    so that the scheduler can go on with other jobs meanwhile."""

    name = "investigate"
    exclusive = False
    reads = (IncidentSlot,)
    writes = (StackAnalysis, DecisionList)

    def __init__(self, policy: Policy, capturer=None, directory=None, localize=None):
        self.policy = policy
        self.capturer = capturer
        self.directory = directory
        self.localize = localize

    def __call__(self, work: Work):
        incident = work.incident
        if not self.policy.wants_capture(ladder_kind(self.policy, incident)) \
                or self.capturer is None:
            return True
        from trainguard.actions.capture import JobInfo, localize

        info = self.directory.info(incident.job) if self.directory else JobInfo()
        world = incident.evidence.get("world_size")
        if info.world_size is None and isinstance(world, int) and world > 0:
            info.world_size = world
        try:
            if hasattr(self.capturer, "rounds"):
                result = yield from self.capturer.rounds(incident.job, info.expected_ranks(),
                                                         label=incident.id)
            else:
                result = self.capturer.capture(incident.job, info.expected_ranks(),
                                               label=incident.id)
            loc = (self.localize or localize)(result, info)
        except Exception as exc:  # no evidence must not mean no recovery
            work.decisions.append(Decision(
                action="capture_stacks", status="failed", targets={"job": incident.job,
                                                                   "ranks": "all"},
                reason=f"capture_error: {type(exc).__name__}: {exc}", code="capture_error"))
            return True
        targets = {"job": incident.job, "ranks": "all", "capture_ids": result.capture_ids}
        if not loc["answered"]:
            work.decisions.append(Decision(
                action="capture_stacks", status="failed", targets=targets, code="capture_timeout",
                reason=f"capture_timeout: no rank answered {len(result.capture_ids)} "
                       f"capture(s) (is `trainguard agent` running on the job's machines?)"))
            return True
        work.localization = loc
        moving = f"; moving: {loc['moving']}" if loc["moving"] else ""
        work.decisions.append(Decision(
            action="capture_stacks", status="done", code="stacks", targets={**targets, "suspects":
                                                              loc["suspects"]},
            reason=f"stacks of {len(loc['answered'])}/{loc['world_size']} ranks: "
                   f"{loc['summary']}{moving}"))
        return True


class Decide:
    """The policy's ladder for the incident."""

    name = "decide"
    exclusive = True
    reads = (IncidentSlot, StackAnalysis, IncidentHistory)
    writes = (DecisionList,)

    def __init__(self, policy: Policy, state):
        self.policy = policy
        self.state = narrow(state, self)

    def __call__(self, work: Work) -> bool:
        history = self.state.history(work.incident)
        work.decisions += decide(self.policy, work.incident, history, work.localization)
        return True


class Limit:
    """Rate limits, safety caps, approval and dry-run (:func:`apply_limits`)."""

    name = "limit"
    exclusive = True
    reads = (AnomalyIn, IncidentSlot, SafetyRecord)
    writes = (DecisionList,)

    def __init__(self, policy: Policy, state, directory=None):
        self.policy = policy
        self.state = narrow(state, self)
        self.directory = directory

    def __call__(self, work: Work) -> bool:
        launches, satisfied = restarts_seen(self.directory, work.incident.job)
        work.decisions = apply_limits(work.decisions, work.incident, self.policy, self.state,
                                      work.now, launches, satisfied)
        return True


class Act:
    """Carries out planned job actions through ``drivers`` (``{action: driver}``, a driver
    being ``(decision, incident) -> (status, reason)``). Without a driver, ``orders`` (an
    :class:`~trainguard.actions.order_desk.OrderDesk`) prepares an order to ``trainguard
    run``: the decision stays ``planned`` with its ``order_id``; :class:`Dispatch` sends the
    order once the decision is recorded, and the outcome is recorded when the ack comes."""

    name = "act"
    exclusive = True
    reads = (IncidentSlot,)
    writes = (DecisionList,)

    def __init__(self, drivers: dict | None = None, orders=None):
        self.drivers = drivers or {}
        self.orders = orders

    def __call__(self, work: Work) -> bool:
        out = []
        for d in work.decisions:
            driver = self.drivers.get(d.action)
            if d.status == "planned" and d.action in JOB_ACTIONS and driver is not None:
                try:
                    status, reason = driver(d, work.incident)
                except Exception as exc:  # a driver's failure is recorded, not fatal
                    status, reason = "failed", f"driver_error: {type(exc).__name__}: {exc}"
                d = d.with_status(status, reason, DRIVER_CODES.get(status))
            elif d.status == "planned" and d.action in JOB_ACTIONS and self.orders is not None:
                d = self.orders.prepare(d, work.incident)
            out.append(d)
        work.decisions = out
        return True


#: the ``code`` of a driver's outcome, by status (others keep the decision's code)
DRIVER_CODES = {"failed": "driver_error", "not_applicable": "no_change"}
SAID_OUTPUT = ("submit", "wait", "list_pods")  # driver calls whose output the record says
#: Driver calls that only look: an order of which nothing else was done changed nothing, and
#: is recorded ``not_applicable``, never ``done``.
READ_ONLY_OPS = ("wait", "list_pods", "read_comment")


def driver_actions(driver, job_refs: dict | None = None) -> dict:
    """``Act``'s drivers from a recovery driver (``restart(job_ref, exclude_nodes)``,
    ``evict(nodes)``, returning the calls made, see docs/DRIVERS.md); ``job_refs`` maps a
    trainguard job id to the cluster's job reference (default: the id itself). A rollback
    is a restart with ``resume_step``, which the driver passes on or, where it cannot, refuses
    (a ``not_applicable`` call: recorded ``not_applicable``). An order for
    which the driver made no call that changes anything (no pod to delete, an eviction
    with ``drain=False``) is ``not_applicable``, never ``done``."""
    refs = dict(job_refs or {})

    def outcome(decision: Decision, calls: list) -> tuple[str, str]:
        failed = [c for c in calls if c.status == "failed"]
        changed = [c for c in calls if c.status in ("done", "dry_run")
                   and c.op not in READ_ONLY_OPS]
        status = "failed" if failed else ("dry_run" if calls and all(
            c.status == "dry_run" for c in calls) else "done" if changed else "not_applicable")
        said = "; ".join(f"{c.describe()}: {c.status}" + (f" ({c.error})" if c.error else "")
                         + (f" -> {c.output}" if c.op in SAID_OUTPUT and c.output else "")
                         for c in calls) or "no call made"
        if status == "not_applicable":
            return status, f"no_change: the driver changed nothing; {decision.reason} [{said}]"
        return status, f"{decision.reason} [{said}]"

    def restart(decision: Decision, incident: Incident):
        ref = refs.get(incident.job, incident.job)
        targets = targets_of(decision.action, decision.targets)  # as trainguard run does
        step = getattr(targets, "rollback_step", None)
        return outcome(decision, driver.restart(ref, list(targets.exclude_nodes),
                                                resume_step=step))

    def evict(decision: Decision, incident: Incident):
        reason = " ".join(f"trainguard incident {incident.id}: {decision.reason}".split())
        return outcome(decision, driver.evict(list(targets_of("evict", decision.targets).nodes),
                                              reason=reason[:200]))

    return {"restart": restart, "rollback": restart, "evict": evict}


class Record:
    """Writes every decision but the planned alerts (``notify`` records those once sent) as
    an ``action`` event, then saves the state: a restart of the service sees them. Records
    are stamped with ``clock()`` (default: the time the anomaly was taken up)."""

    name = "record"
    exclusive = True
    reads = (AnomalyIn, IncidentSlot, DecisionList)
    writes = (Records, LedgerWrites)

    def __init__(self, recorder, state, clock: Callable[[], float] | None = None):
        self.recorder = recorder
        self.state = narrow(state, self)
        self.clock = clock

    def __call__(self, work: Work) -> bool:
        ts = self.clock() if self.clock else work.now
        self.state.note_incident(work.incident, work.now)
        for d in work.decisions:
            if d.action == "alert" and d.status == "planned":
                continue
            event = action_event(d, work.incident, ts)
            self.recorder.write(event)
            work.records.append(event)
            self.state.note(d, work.incident, ts)
        self.recorder.flush()
        self.state.save(work.now)
        return True


class Dispatch:
    """Sends the orders prepared by :class:`Act`, now that their decisions are recorded."""

    name = "dispatch"
    exclusive = True
    reads = (DecisionList,)
    writes = ()

    def __init__(self, orders=None):
        self.orders = orders

    def __call__(self, work: Work) -> bool:
        if self.orders is not None:
            self.orders.dispatch(work.decisions)
        return True


class Notify:
    """Sends the planned alerts (one message per incident: what happened, where, what was
    done, what the stacks showed) and records how each sink took it. The sending happens
    outside the pipeline's lock (a slow alert sink holds up no other job); the records are
    written under it."""

    name = "notify"
    exclusive = False
    reads = (AnomalyIn, IncidentSlot, StackAnalysis, DecisionList)
    writes = (Records, LedgerWrites)

    def __init__(self, recorder, state, notify=None, log: Callable[[str], None] | None = None,
                 clock: Callable[[], float] | None = None):
        self.recorder = recorder
        self.state = narrow(state, self)
        self.notify = notify
        self.log = log or _stderr
        self.clock = clock

    def __call__(self, work: Work) -> bool:
        alerts = [d for d in work.decisions if d.action == "alert" and d.status == "planned"]
        alerts.sort(key=lambda d: not d.targets.get("page"))  # a page leads the message
        if not alerts:
            return True
        severity = max((d.severity for d in alerts), key=("info", "warning", "critical").index)
        reasons = "; ".join(d.reason for d in alerts)
        message = self._message(work, severity, reasons, lead=alerts[0].code)
        self.log(message.text() if message is not None else reasons)
        results = []
        if self.notify and message is not None:
            results = yield Blocking(lambda: self.notify(message))
        outcomes = [r for r in results if r.action_status]
        if not outcomes:
            outcomes = [None]
        base = replace(alerts[0], severity=severity, reason=reasons,
                       targets={**alerts[0].targets, **{k: v for d in alerts[1:]
                                                        for k, v in d.targets.items()}})
        with work.lock:
            self._record(work, base, reasons, outcomes)
        return True

    def _record(self, work: Work, base: Decision, reasons: str, outcomes: list) -> None:
        incident = work.incident
        for result in outcomes:
            if result is None:
                d = base.with_status("done", f"{reasons} (logged; no alert sink sent it)")
            else:
                detail = f"{result.sink}: {result.status}" + (
                    f" ({result.error})" if result.error else "")
                d = replace(base.with_status(result.action_status, f"{reasons} [{detail}]"),
                            targets={**base.targets, "sink": result.sink})
            ts = self.clock() if self.clock else work.now
            event = action_event(d, incident, ts)
            self.recorder.write(event)
            work.records.append(event)
            self.state.note(d, incident, ts)
        self.recorder.flush()
        self.state.save(work.now)

    def _message(self, work: Work, severity: str, reasons: str, lead: str | None = None):
        try:
            from trainguard.actions.alerts import AlertMessage
        except ImportError:
            return None
        inc = work.incident
        loc = work.localization or {}
        return AlertMessage(
            incident=inc.id, job=inc.job, kind=inc.kind, severity=severity,
            summary=inc.summary if lead not in ("page", "approval_required") else
            f"{inc.summary}. {reasons}", ranks=list(inc.ranks or loc.get("suspects", [])),
            nodes=list(inc.nodes or loc.get("nodes", [])), step=inc.step,
            onset_ts=inc.onset_ts, detected_ts=inc.detected_ts, ts=work.now,
            actions=[ev.to_dict(r) for r in work.records], stacks=loc.get("text") or None,
            anomaly=ev.to_dict(work.anomaly))


_stderr = service_logger("trainguard.actions.pipeline", "trainguard actions", stamp=False)
