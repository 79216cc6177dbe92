"""The action service's stages, after Alertmanager's notification pipeline.

Every stage is a small object called with the :class:`Work` of one anomaly; it adds to it
and returns True to go on, or sets ``work.dropped`` and returns False to stop. The chain is
assembled in one place, :func:`build_pipeline`::

    await_incident -> correlate -> dedup -> confirm -> investigate -> confirm -> decide
                   -> limit -> act -> record -> dispatch -> notify

``await_incident`` and ``correlate`` give the anomaly its incident: the stream worker's
(SPEC §6 ``incident`` events, read from the anomalies topic into an
:class:`~trainguard.actions.incidents.IncidentBook`), waited for briefly when it is not there
yet, else the fallback correlator's (:mod:`trainguard.actions.incidents` says how).
``investigate`` (capture and aggregate the stacks) sits before ``decide`` because the
policy of a hang needs its suspects. ``confirm`` (:mod:`trainguard.actions.confirm`), before
and again after the capture, closes a hang whose job moved on as a false alarm. The
decisions themselves (``decide`` and ``apply_limits`` of :mod:`trainguard.actions.policy`)
are pure; I/O comes in through injected objects: ``capturer`` (a :class:`~trainguard.actions.capture.StackCapture`),
``recorder`` (``write(action_event)`` and ``flush()``), ``notify`` (``AlertMessage ->
[SendResult]``) and ``drivers``.

>>> from trainguard.actions.state import ServiceState
>>> recorder = ListRecorder()
>>> pipe = build_pipeline(policy=Policy(), state=ServiceState(), recorder=recorder)
>>> a = ev.Anomaly(job="j1", ts=101.0, id="a1", kind="crash", severity="critical",
...                ranks=[1], nodes=["n1"], onset_ts=100.0, detected_ts=101.0,
...                detector="crash", summary="rank 1 exited with code 1")
>>> [(r.action, r.status) for r in pipe.process(a, now=102.0).records]
[('restart', 'planned'), ('alert', 'done')]
>>> pipe.process(a, now=103.0).dropped
'duplicate: anomaly a1 was already handled'
"""
from __future__ import annotations

import inspect
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from trainguard import events as ev
from trainguard.actions.confirm import Confirm
from trainguard.actions.incidents import (AwaitIncident, Correlate, incident_from, incident_of,
                                          recaused_id, restarts_seen)
from trainguard.actions.orders import check_targets
from trainguard.actions.policy import (JOB_ACTIONS, Decision, Incident, Policy, apply_limits,
                                       covering_restart, decide, ladder_kind)
from trainguard.actions.waits import Blocking, drive
from trainguard.logs import service_logger

__all__ = ["Work", "Pipeline", "build_pipeline", "apply_limits", "covering_restart",
           "incident_of", "incident_from", "driver_actions", "ListRecorder",
           "AwaitIncident", "Correlate", "recaused_id", "Dedup", "Confirm", "Investigate",
           "Decide", "Limit", "Act", "Record",
           "Dispatch", "Notify", "action_event", "record_drop"]


@dataclass(kw_only=True)
class Work:
    """Everything known about one anomaly as it goes down the chain."""

    anomaly: ev.Anomaly
    now: float
    incident: Incident | None = None
    localization: dict | None = None
    decisions: list = field(default_factory=list)
    records: list = field(default_factory=list)
    dropped: str | None = None
    drop_code: str | None = None
    false_alarm: dict | None = None
    lock: object = field(default_factory=threading.RLock, repr=False)

    def drop(self, code: str, detail: str) -> bool:
        """Stop here: ``dropped`` reads ``<code>: <detail>``, ``drop_code`` is the code (what
        programs count on); returns False, a stage's answer."""
        self.dropped, self.drop_code = f"{code}: {detail}", code
        return False


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


class ListRecorder:
    """A recorder that keeps the action events in a list (tests, offline runs)."""

    def __init__(self):
        self.events: list[ev.Action] = []

    def write(self, event: ev.Action) -> None:
        self.events.append(event)

    def flush(self) -> None:
        pass


# ---------------------------------------------------------------------------- stages
class Dedup:
    """Drops anomalies already handled (delivered twice, or re-read after a restart of the
    service), anomalies older than ``policy.max_anomaly_age_s``, and further anomalies of an
    incident for which a restart or rollback was already decided (whatever became of it:
    a rate-limited one is not retried)."""

    name = "dedup"

    def __init__(self, state, policy: Policy):
        self.state = state
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
        restarted = [a for a in ("restart", "rollback") if a in done]
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

    def __init__(self, policy: Policy, state):
        self.policy = policy
        self.state = state

    def __call__(self, work: Work) -> bool:
        history = self.state.history(work.incident)
        work.decisions += decide(self.policy, work.incident, history, work.localization)
        return True


class Limit:
    """Rate limits, safety caps, approval and dry-run (:func:`apply_limits`)."""

    name = "limit"

    def __init__(self, policy: Policy, state, directory=None):
        self.policy = policy
        self.state = state
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
        targets = check_targets(decision.action, decision.targets)  # as trainguard run does
        step = targets.get("rollback_step") if decision.action == "rollback" else None
        return outcome(decision, driver.restart(ref, targets["exclude_nodes"], resume_step=step))

    def evict(decision: Decision, incident: Incident):
        reason = " ".join(f"trainguard incident {incident.id}: {decision.reason}".split())
        return outcome(decision, driver.evict(check_targets("evict", decision.targets)["nodes"],
                                              reason=reason[:200]))

    return {"restart": restart, "rollback": restart, "evict": evict}


class Record:
    """Writes every decision but the planned alerts (``notify`` records those once sent) as
    an ``action`` event, then saves the state: a restart of the service sees them. Records
    are stamped with ``clock()`` (default: the time the anomaly was taken up)."""

    name = "record"

    def __init__(self, recorder, state, clock: Callable[[], float] | None = None):
        self.recorder = recorder
        self.state = state
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

    def __init__(self, recorder, state, notify=None, log: Callable[[str], None] | None = None,
                 clock: Callable[[], float] | None = None):
        self.recorder = recorder
        self.state = state
        self.notify = notify
        self.log = log or _stderr
        self.clock = clock

    def __call__(self, work: Work) -> bool:
        alerts = [d for d in work.decisions if d.action == "alert" and d.status == "planned"]
        alerts.sort(key=lambda d: not d.targets.get("page"))  # a page leads the message
        if not alerts:
            return True
        incident = work.incident
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


class Pipeline:
    """The stages in order. :meth:`run` runs one anomaly through them as a waiting generator
    (it yields the waits of the stages that wait, see :mod:`trainguard.actions.waits`), so
    that many anomalies can be under way at once: stages run under one lock (the state,
    the correlator and the safety caps are shared), held from one stage to the next and let
    go only around the stages marked ``exclusive = False`` (those that wait or send), so
    that no two anomalies interleave between a cap's check and its record. :meth:`process`
    runs one anomaly to its end, blocking on each wait."""

    def __init__(self, stages: list, on_drop: Callable | None = None):
        self.stages = stages
        self.lock = threading.RLock()
        self.on_drop = on_drop

    def run(self, anomaly: ev.Anomaly, now: float):
        work = Work(anomaly=anomaly, now=now, lock=self.lock)
        held = False
        try:
            for stage in self.stages:
                if getattr(stage, "exclusive", True):
                    if not held:
                        self.lock.acquire()
                        held = True
                    go_on = stage(work)
                else:
                    if held:
                        self.lock.release()
                        held = False
                    go_on = stage(work)
                    if inspect.isgenerator(go_on):
                        go_on = yield from go_on
                if not go_on:
                    break
        finally:
            if held:
                self.lock.release()
        return work

    def process(self, anomaly: ev.Anomaly, now: float) -> Work:
        return drive(self.run(anomaly, now))

    def drop(self, work: Work) -> None:
        """An anomaly the scheduler let go without handling it (``work.dropped``): recorded
        by ``on_drop``, whose record joins ``work.records``."""
        if self.on_drop is None:
            return
        with self.lock:
            event = self.on_drop(work)
        if event is not None:
            work.records.append(event)

    def __repr__(self) -> str:
        return "Pipeline(" + " -> ".join(s.name for s in self.stages) + ")"


def record_drop(record: Record, state, clock: Callable[[], float] | None = None):
    """``on_drop`` of :class:`Pipeline`: an ``action`` record ``none``, status
    ``rate_limited``, code ``work.drop_code`` (``backlog_full``, ...) and reason
    ``work.dropped``, for the anomaly's own incident, written with ``record``'s recorder; its
    id is remembered as handled."""
    def drop(work: Work) -> ev.Action:
        anomaly = work.anomaly
        incident = incident_of(anomaly)
        decision = Decision(action="none", status="rate_limited", reason=work.dropped,
                            severity="info", targets={"job": anomaly.job, "dropped": True},
                            code=work.drop_code)
        event = action_event(decision, incident, clock() if clock else work.now)
        record.recorder.write(event)
        record.recorder.flush()
        state.note_incident(incident, work.now)
        state.note(decision, incident, event.ts)
        return event
    return drop


def build_pipeline(*, policy: Policy, state, recorder, capturer=None, directory=None,
                   notify=None, drivers: dict | None = None, correlator=None,
                   log: Callable[[str], None] | None = None,
                   clock: Callable[[], float] | None = None, orders=None,
                   progress=None, book=None,
                   sleep: Callable[[float], None] | None = None) -> Pipeline:
    """The one place where the chain is assembled. ``book`` (an
    :class:`~trainguard.actions.incidents.IncidentBook`) holds the worker's incidents, which
    :class:`~trainguard.actions.incidents.AwaitIncident` waits for and :class:`Correlate`
    uses (``sleep``: how a blocking wait for one sleeps); ``correlator`` correlates the
    anomalies no incident lists. ``orders`` (an
    :class:`~trainguard.actions.order_desk.OrderDesk`) sends the job actions to ``trainguard
    run`` where no driver carries them out; ``progress`` (a
    :class:`~trainguard.actions.confirm.JobProgress`) is where :class:`Confirm` looks whether
    a stalled job moved on, before and again after the stack capture."""
    record = Record(recorder, state, clock)
    return Pipeline([
        AwaitIncident(book, clock=clock or time.time, sleep=sleep or time.sleep),
        Correlate(correlator, state, directory, policy.limits.restart_settle_s, book=book),
        Dedup(state, policy),
        Confirm(policy, progress, record, when="before_capture", clock=clock),
        Investigate(policy, capturer, directory),
        Confirm(policy, progress, record, when="after_capture", clock=clock),
        Decide(policy, state),
        Limit(policy, state, directory),
        Act(drivers, orders),
        record,
        Dispatch(orders),
        Notify(recorder, state, notify, log=log or (lambda m: None), clock=clock),
    ], on_drop=record_drop(record, state, clock))


_stderr = service_logger("trainguard.actions.pipeline", "trainguard actions", stamp=False)
