"""The worker's incidents, as the action service uses them (SPEC §6 ``incident`` events).

Correlation runs once, in the stream worker: it publishes, on the anomalies topic, an
``incident`` event right after the anomalies that opened or grew it, in the same produce
batch and with the same key (the job), so on the same partition and in order; it publishes
the incident again, same id, each time it gains an anomaly. The service's consume loop hands
every incident event to an :class:`IncidentBook` (anomaly id -> the incident that lists it)
and every anomaly's arrival time too; the pipeline's first two stages read the book:

- :class:`AwaitIncident` (it waits, without a thread): an anomaly whose incident is not in
  the book yet waits for it, until ``wait_s`` after the anomaly *arrived* (a burst of
  anomalies waits once, not once each). It waits only while the topic carries incidents at
  all (the book saw one within ``expect_s``): an older worker, ``publish_incidents`` off,
  or a replay of anomalies alone cost no wait. Should a resent anomaly come after its
  incident, the book already knows it and nothing waits.
- :class:`~trainguard.actions.pipeline.Correlate` then builds the anomaly's incident from
  the worker's grouping (:meth:`IncidentBook.incident_id`), or, for an anomaly that has
  none, from the service's fallback correlator.

An incident event arrives over Kafka and is trusted no more than anything else: it is only a
*grouping*. The incident the service acts on (its root kind, ranks, machines) is summarised
from the anomalies the incident lists that the service itself received
(:func:`~trainguard.detectors.correlate.summarize`), so a forged incident can join anomalies
of one job into one problem, but never add a kind, a rank or a machine that no anomaly
named. The book is bounded (``max_anomalies`` ids, oldest first out), and an incident of
another job than the anomaly's is ignored.

>>> from trainguard import events as ev
>>> book = IncidentBook(wait_s=1.0)
>>> book.observe(ev.Incident(job="j1", ts=10.0, id="inc-c1", kind="crash",
...     severity="critical", ranks=[1], nodes=["n1"], onset_ts=9.0, detected_ts=10.0,
...     summary="rank 1 exited", anomalies=["c1", "h1"]), now=10.0)
>>> book.incident_id("h1", job="j1"), book.incident_id("h1", job="j2"), book.incident_id("x")
('inc-c1', None, None)
>>> book.arrived("x", now=10.0)
>>> book.waits_for("x", now=10.5), book.waits_for("x", now=11.0), book.waits_for("c1", 10.5)
(True, False, False)
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from trainguard import events as ev
from trainguard.actions.interfaces import (AnomalyIn, IncidentHistory, IncidentSlot,
                                           SeenAnomalies, narrow)
from trainguard.actions.model import Incident
from trainguard.actions.safety import restart_over
from trainguard.detectors.correlate import PRIORITY, incident_id_of, summarize

__all__ = ["IncidentBook", "AwaitIncident", "IncidentWait", "Correlate", "incident_of",
           "incident_from", "recaused_id", "restarts_seen"]


class IncidentBook:
    """Anomaly id -> ``(job, incident id)`` of the latest incident event that listed it, at
    most ``max_anomalies`` of them; each incident's latest list of anomaly ids (lists of at
    most ``max_anomalies`` ids in all, the oldest incidents out first); the arrival time of
    the anomalies not yet mapped (at most ``max_anomalies``). Written by the consume loop,
    read by the pipeline: thread-safe. Time is given (``now``), never read."""

    def __init__(self, *, wait_s: float = 2.0, expect_s: float = 3600.0,
                 max_anomalies: int = 100_000):
        self.wait_s = wait_s
        self.expect_s = expect_s
        self.max_anomalies = max_anomalies
        self._of: dict[str, tuple[str, str]] = {}
        self._listed: dict[tuple[str, str], tuple] = {}
        self._listed_ids = 0
        self._arrived: dict[str, float] = {}
        self._last_seen: float | None = None   # when an incident event last came
        self._lock = threading.Lock()
        self.observed = 0

    def observe(self, incident: ev.Incident, now: float) -> None:
        """One ``incident`` event (already validated by :func:`trainguard.events.decode`)."""
        pair = (incident.job, incident.id)
        with self._lock:
            self.observed += 1
            self._last_seen = now
            for anomaly_id in incident.anomalies:
                self._of.pop(anomaly_id, None)       # re-listed: now the newest
                self._of[anomaly_id] = pair
                self._arrived.pop(anomaly_id, None)
            _trim(self._of, self.max_anomalies)
            ids = tuple(incident.anomalies)
            self._listed_ids += len(ids) - len(self._listed.pop(pair, ()))
            self._listed[pair] = ids
            while self._listed_ids > self.max_anomalies:
                self._listed_ids -= len(self._listed.pop(next(iter(self._listed))))

    def listed(self, job: str, incident_id: str) -> tuple:
        """The anomaly ids of the worker's incident, as it last listed them (or none)."""
        return self._listed.get((job, incident_id), ())

    def arrived(self, anomaly_id: str, now: float) -> None:
        """An anomaly came off the topic at ``now``: its wait starts here."""
        with self._lock:
            if anomaly_id not in self._of and anomaly_id not in self._arrived:
                self._arrived[anomaly_id] = now
                _trim(self._arrived, self.max_anomalies)

    def incident_id(self, anomaly_id: str, job: str | None = None) -> str | None:
        """The worker's incident listing ``anomaly_id`` (of ``job``, when given), or None."""
        pair = self._of.get(anomaly_id)
        if pair is None or (job is not None and pair[0] != job):
            return None
        return pair[1]

    def expecting(self, now: float) -> bool:
        """Whether the topic carries incidents: one came within ``expect_s``."""
        return self._last_seen is not None and now - self._last_seen <= self.expect_s

    def waits_for(self, anomaly_id: str, now: float) -> bool:
        """Whether an anomaly should still wait for its incident at ``now``."""
        if anomaly_id in self._of or not self.expecting(now):
            return False
        with self._lock:
            start = self._arrived.setdefault(anomaly_id, now)
        return now - start < self.wait_s

    def done_with(self, anomaly_id: str) -> None:
        """The anomaly is taken up: its arrival is no longer needed."""
        with self._lock:
            self._arrived.pop(anomaly_id, None)


def _trim(table: dict, most: int) -> None:
    while len(table) > most:
        del table[next(iter(table))]   # the oldest


class IncidentWait:
    """A wait (:mod:`trainguard.actions.waits`) over when ``book`` no longer
    :meth:`~IncidentBook.waits_for` the anomaly."""

    def __init__(self, book: IncidentBook, anomaly_id: str, clock: Callable[[], float],
                 sleep: Callable[[float], None] = time.sleep, step_s: float = 0.02):
        self.book, self.anomaly_id = book, anomaly_id
        self.clock, self.sleep, self.step_s = clock, sleep, step_s

    def poll(self) -> tuple[bool, object]:
        return not self.book.waits_for(self.anomaly_id, self.clock()), None

    def block(self) -> object:
        while self.book.waits_for(self.anomaly_id, self.clock()):
            self.sleep(self.step_s)
        return None

    def __repr__(self) -> str:
        return f"IncidentWait({self.anomaly_id})"


class AwaitIncident:
    """The pipeline stage that waits (bounded) for an anomaly's incident; see the module's
    doc. Without a book it does nothing."""

    name = "await_incident"
    exclusive = False
    reads = (AnomalyIn,)
    writes = ()

    def __init__(self, book: IncidentBook | None = None, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep):
        self.book = book
        self.clock = clock
        self.sleep = sleep

    def __call__(self, work):
        book = self.book
        if book is None:
            return True
        anomaly_id = work.anomaly.id
        if not book.waits_for(anomaly_id, self.clock()):
            book.done_with(anomaly_id)
            return True
        return self._wait(anomaly_id)

    def _wait(self, anomaly_id: str):
        yield IncidentWait(self.book, anomaly_id, self.clock, self.sleep)
        self.book.done_with(anomaly_id)
        return True


#: one incident per anomaly (the fallback correlation): :meth:`Incident.of_anomaly`
incident_of = Incident.of_anomaly
#: the incident of the correlator's dict and the anomaly that joined it: :meth:`Incident.of_dict`
incident_from = Incident.of_dict


def restarts_seen(directory, job: str) -> tuple:
    """``(launches, satisfied)``: when ``trainguard run`` launched the job, and which
    incidents' restarts it acked ``already_satisfied`` (none without a directory)."""
    if directory is None:
        return (), frozenset()
    return directory.launches(job), directory.satisfied(job)


class Correlate:
    """Anomaly -> incident. The grouping is the stream worker's: with a ``book`` (an
    :class:`~trainguard.actions.incidents.IncidentBook`, fed with the worker's ``incident``
    events), an anomaly that an incident lists belongs to it, and the incident is summarised
    from the anomalies of it that the service received (:func:`~trainguard.detectors.
    correlate.summarize`: a forged incident adds no kind, rank or machine). An anomaly that
    no incident lists (an older worker, ``publish_incidents`` off, a replay of anomalies
    alone, or its incident late beyond the wait of :class:`~trainguard.actions.incidents.
    AwaitIncident`) is correlated by ``correlator`` (``add(anomaly) -> incident dict``, as
    :class:`~trainguard.detectors.correlate.Correlator`), the fallback; without one it is its
    own incident. Two refinements keep one restart per problem and no fewer, decided on the
    ledger (``state``), never on an id or a reason: an anomaly that began after the restart
    that dealt with its incident was over (:func:`~trainguard.actions.safety.restart_over`)
    is a new problem, an incident of its own (the worker opens a new incident itself when
    the job was relaunched or made progress since, see ``detectors/correlate.py``; this
    covers the fallback and an older worker); and an incident whose root kind became more
    fundamental since it was handled (a crash later explained by a GPU fault) is handled
    again, under the ledger id :func:`recaused_id`. At most ``keep`` anomalies are remembered."""

    name = "correlate"
    exclusive = True
    reads = (AnomalyIn, SeenAnomalies, IncidentHistory)
    writes = (IncidentSlot,)

    def __init__(self, correlator=None, state=None, directory=None, settle_s: float = 120.0,
                 book=None, keep: int = 10_000, root_slack_s: float = 2.0):
        self.correlator = correlator
        self.state = narrow(state, self)
        self.directory = directory
        self.settle_s = settle_s
        self.book = book
        self.keep = keep
        self.root_slack_s = root_slack_s
        self.received: dict = {}   # anomaly id -> anomaly (the last ``keep``)

    def __call__(self, work) -> bool:
        a = work.anomaly
        if self.state and self.state.seen_anomaly(a.id):
            work.incident = Incident.of_anomaly(a)
            return True
        self.received.pop(a.id, None)
        self.received[a.id] = a
        _trim(self.received, self.keep)
        found = self._worker_incident(a)
        if found is None and self.correlator is not None:
            found = self.correlator.add(a)
        if found is None:
            work.incident = Incident.of_anomaly(a)
            return True
        incident = Incident.of_dict(found, a, self._kinds(found))
        if self.state is not None:
            incident = self._refined(incident, a)
        work.incident = incident
        return True

    def _worker_incident(self, a: ev.Anomaly) -> dict | None:
        incident_id = self.book.incident_id(a.id, a.job) if self.book is not None else None
        if incident_id is None:
            return None
        ids = self.book.listed(a.job, incident_id)
        members = [self.received[i] for i in ids if i in self.received]   # received only
        if a.id not in ids:
            members.append(a)
        return summarize(incident_id, members, self.root_slack_s)

    def _kinds(self, found: dict) -> dict:
        return {i: self.received[i].kind for i in found.get("anomalies") or ()
                if i in self.received}

    def _refined(self, incident: Incident, a: ev.Anomaly) -> Incident:
        launches, satisfied = restarts_seen(self.directory, a.job)
        settled = self.state.settled_ts(incident.id)
        if settled is not None and a.onset_ts > restart_over(settled, launches, self.settle_s,
                                                             incident.id in satisfied):
            # began after the restart that dealt with its incident: a new problem
            fresh = summarize(incident_id_of(a.id), [a], self.root_slack_s)
            incident = Incident.of_dict(fresh, a, {a.id: a.kind})
            settled = self.state.settled_ts(incident.id)
        known_kind = self.state.incident_kind(incident.id)
        if known_kind and _deeper(incident.kind, known_kind) and (settled is None
                                                                  or a.onset_ts <= settled):
            incident.id = recaused_id(incident.id, incident.kind)  # an earlier cause, found later
        return incident


def _deeper(kind: str, than: str) -> bool:
    """Whether root kind ``kind`` is a more fundamental cause than ``than`` (a GPU fault
    than a crash): only that makes an incident handled again; a root kind that looks
    shallower (members not received) never does."""
    rank = {k: i for i, k in enumerate(PRIORITY)}
    return rank.get(kind, len(rank)) < rank.get(than, len(rank))


def recaused_id(incident_id: str, kind: str) -> str:
    """The ledger id under which an incident is handled again once its root kind became
    ``kind`` (its actions so far were for another cause). Nothing reads it back: it only
    keeps the two handlings apart in the ledger and the audit log."""
    return f"{incident_id}~{kind}"
