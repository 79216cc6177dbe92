"""The action service's chain of stages, after Alertmanager's notification pipeline.

Every stage is a small object called with the :class:`Work` of one anomaly (the
:class:`~trainguard.actions.interfaces.Stage` protocol); it adds to it and returns True to
go on, or sets ``work.dropped`` and returns False to stop. Each declares the interfaces of
:mod:`trainguard.actions.interfaces` it ``reads`` and ``writes`` (of the work, and of the
ledger, of which it keeps only that view); :meth:`Pipeline.describe` lists them. The stages
are in :mod:`trainguard.actions.stages`, :mod:`~trainguard.actions.incidents` and
:mod:`~trainguard.actions.confirm`; the values they pass (incident, decision) in
:mod:`trainguard.actions.model`. The chain is assembled in one place, :func:`build_pipeline`::

    await_incident -> correlate -> dedup -> confirm -> investigate -> confirm -> decide
                   -> limit -> act -> record -> dispatch -> notify

``await_incident`` and ``correlate`` give the anomaly its incident: the stream worker's
(SPEC §6 ``incident`` events, read from the anomalies topic into an
:class:`~trainguard.actions.incidents.IncidentBook`), waited for briefly when it is not there
yet, else the fallback correlator's (:mod:`trainguard.actions.incidents` says how).
``investigate`` (capture and aggregate the stacks) sits before ``decide`` because the
policy of a hang needs its suspects. ``confirm`` (:mod:`trainguard.actions.confirm`), before
and again after the capture, closes a hang whose job moved on as a false alarm. The
decisions themselves (``decide`` of :mod:`trainguard.actions.policy`, ``apply_limits`` of
:mod:`trainguard.actions.safety`) are pure; I/O comes in through injected objects:
``capturer`` (a :class:`~trainguard.actions.capture.StackCapture`), ``recorder`` (``write(action_event)`` and ``flush()``), ``notify`` (``AlertMessage ->
[SendResult]``) and ``drivers``.

>>> from types import SimpleNamespace
>>> from trainguard.actions.state import ServiceState
>>> audit = []
>>> recorder = SimpleNamespace(write=audit.append, flush=lambda: None)   # the audit log
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
from typing import Callable

from trainguard import events as ev
from trainguard.actions.confirm import Confirm
from trainguard.actions.incidents import (AwaitIncident, Correlate, incident_from, incident_of,
                                          recaused_id)
from trainguard.actions.interfaces import LedgerView, LedgerWrites, Stage, Work
from trainguard.actions.model import Decision, Incident
from trainguard.actions.policy import Policy
from trainguard.actions.safety import apply_limits, covering_restart
from trainguard.actions.stages import (Act, Decide, Dedup, Dispatch, Investigate, Limit, Notify,
                                       Record, action_event, driver_actions)
from trainguard.actions.waits import drive

__all__ = ["Work", "Stage", "Pipeline", "build_pipeline", "apply_limits", "covering_restart",
           "incident_of", "incident_from", "driver_actions",
           "AwaitIncident", "Correlate", "recaused_id", "Dedup", "Confirm", "Investigate",
           "Decide", "Limit", "Act", "Record",
           "Dispatch", "Notify", "action_event", "record_drop"]


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

    def describe(self) -> str:
        """One line per stage: its name, what it reads and what it writes (``*``: it runs
        without the pipeline's lock)."""
        def names(interfaces):
            return ", ".join(i.__name__ for i in interfaces) or "-"
        return "\n".join(
            f"{s.name + ('' if getattr(s, 'exclusive', True) else '*'):<16} "
            f"reads {names(getattr(s, 'reads', ()))}; writes {names(getattr(s, 'writes', ()))}"
            for s in self.stages)


def record_drop(record: Record, state, clock: Callable[[], float] | None = None):
    """``on_drop`` of :class:`Pipeline`: an ``action`` record ``none``, status
    ``rate_limited``, code ``work.drop_code`` (``backlog_full``, ...) and reason
    ``work.dropped``, for the anomaly's own incident, written with ``record``'s recorder; its
    id is remembered as handled."""
    ledger = LedgerView(state, (LedgerWrites,), "on_drop")

    def drop(work: Work) -> ev.Action:
        anomaly = work.anomaly
        incident = Incident.of_anomaly(anomaly)
        decision = Decision(action="none", status="rate_limited", reason=work.dropped,
                            severity="info", targets={"job": anomaly.job, "dropped": True},
                            code=work.drop_code)
        event = action_event(decision, incident, clock() if clock else work.now)
        record.recorder.write(event)
        record.recorder.flush()
        ledger.note_incident(incident, work.now)
        ledger.note(decision, incident, event.ts)
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
        # which incident: the worker's (waited for briefly), else the fallback correlator's
        AwaitIncident(book, clock=clock or time.time, sleep=sleep or time.sleep),
        Correlate(correlator, state, directory, policy.limits.restart_settle_s, book=book),
        Dedup(state, policy),
        # is the job still stalled, and what do the stacks say
        Confirm(policy, progress, record, when="before_capture", clock=clock),
        Investigate(policy, capturer, directory),
        Confirm(policy, progress, record, when="after_capture", clock=clock),
        # what to do, within the safety caps, and who carries it out
        Decide(policy, state),
        Limit(policy, state, directory),
        Act(drivers, orders),
        # the audit record first, then the orders and the alerts
        record,
        Dispatch(orders),
        Notify(recorder, state, notify, log=log or (lambda m: None), clock=clock),
    ], on_drop=record_drop(record, state, clock))
