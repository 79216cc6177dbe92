"""What a stage of the action pipeline may read and write.

A stage (:class:`Stage`) is called with the :class:`Work` of one anomaly and declares, as
class attributes, the interfaces it ``reads`` and ``writes``. There are two sets of them,
each a :class:`typing.Protocol` as narrow as one concern:

- over the :class:`Work` (what is known about one anomaly): :class:`AnomalyIn` (the
  anomaly and the time it was taken up), :class:`IncidentSlot`, :class:`StackAnalysis`,
  :class:`DecisionList`, :class:`Verdict` (dropped, false alarm) and :class:`Records`;
- over the ledger (:class:`~trainguard.actions.state.ServiceState`, shared by all
  anomalies): :class:`SeenAnomalies`, :class:`IncidentHistory`, :class:`SafetyRecord`
  (what the caps count) and :class:`LedgerWrites`.

A stage that is given the ledger keeps only a :func:`narrow` view of it: the methods of the
ledger interfaces it declares, nothing else, so a stage cannot use what it did not declare.
:class:`WorkView` does the same for the work (tests run whole pipelines through it).

>>> from trainguard.actions.state import ServiceState
>>> class Peek:
...     name, exclusive = "peek", True
...     reads, writes = (AnomalyIn, SeenAnomalies), ()
...     def __init__(self, state):
...         self.state = narrow(state, self)
...     def __call__(self, work):
...         return not self.state.seen_anomaly(work.anomaly.id)
>>> peek = Peek(ServiceState())
>>> isinstance(peek, Stage), peek.state
(True, LedgerView(SeenAnomalies))
>>> peek.state.restarts_since("j1", 0.0)
Traceback (most recent call last):
...
AttributeError: stage 'peek' declares no ledger interface with 'restarts_since' (it reads and writes SeenAnomalies)
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from trainguard import events as ev
from trainguard.actions.model import Decision, History, Incident

__all__ = ["Stage", "Work", "AnomalyIn", "IncidentSlot", "StackAnalysis", "DecisionList",
           "Verdict", "Records", "SeenAnomalies", "IncidentHistory", "SafetyRecord",
           "LedgerWrites", "WORK_INTERFACES", "LEDGER_INTERFACES", "members", "narrow",
           "LedgerView", "WorkView"]


# ------------------------------------------------------------------------------ the work
@runtime_checkable
class AnomalyIn(Protocol):
    """The anomaly and when it was taken up (``now``); nobody changes them."""

    anomaly: ev.Anomaly
    now: float


@runtime_checkable
class IncidentSlot(Protocol):
    """The anomaly's incident (set by ``correlate``)."""

    incident: Incident | None


@runtime_checkable
class StackAnalysis(Protocol):
    """The stack analysis of the incident (``investigate``), or None."""

    localization: dict | None


@runtime_checkable
class DecisionList(Protocol):
    """The decisions so far, in order."""

    decisions: list


@runtime_checkable
class Verdict(Protocol):
    """Why the anomaly went no further: dropped (``drop``), or a false alarm."""

    dropped: str | None
    drop_code: str | None
    false_alarm: dict | None

    def drop(self, code: str, detail: str) -> bool: ...


@runtime_checkable
class Records(Protocol):
    """The ``action`` records written for the anomaly, and the pipeline's lock (taken to
    write them from a stage that runs without it)."""

    records: list
    lock: Any


WORK_INTERFACES = (AnomalyIn, IncidentSlot, StackAnalysis, DecisionList, Verdict, Records)


@dataclass(kw_only=True)
class Work:
    """Everything known about one anomaly as it goes down the chain (every interface of
    :data:`WORK_INTERFACES`)."""

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


# ------------------------------------------------------------------------------ the ledger
@runtime_checkable
class SeenAnomalies(Protocol):
    """Which anomalies were handled already."""

    def seen_anomaly(self, anomaly_id: str) -> bool: ...


@runtime_checkable
class IncidentHistory(Protocol):
    """What was done for an incident, and when its restart settled it."""

    def history(self, incident: Incident) -> History: ...

    def settled_ts(self, incident_id: str) -> float | None: ...

    def incident_kind(self, incident_id: str) -> str | None: ...


@runtime_checkable
class SafetyRecord(Protocol):
    """What the safety caps count: restarts, evictions, pages."""

    def restarts_since(self, job: str, since: float) -> list[dict]: ...

    def evictions_since(self, since: float) -> list[dict]: ...

    def incident_evictions(self, incident_id: str) -> list[dict]: ...

    def last_page(self, job: str) -> float | None: ...


@runtime_checkable
class LedgerWrites(Protocol):
    """Remember an incident and its decisions; save the ledger."""

    def note_incident(self, incident: Incident, ts: float) -> None: ...

    def note(self, decision: Decision, incident: Incident, ts: float) -> None: ...

    def save(self, now: float | None = None) -> None: ...


LEDGER_INTERFACES = (SeenAnomalies, IncidentHistory, SafetyRecord, LedgerWrites)


# ------------------------------------------------------------------------------ the stage
@runtime_checkable
class Stage(Protocol):
    """One step of the chain. Called with the work of one anomaly, it returns True to go
    on or False to stop (after :meth:`Verdict.drop`, or a false alarm), or it is a
    generator that yields waits (:mod:`trainguard.actions.waits`) and returns that answer.
    ``exclusive``: it runs under the pipeline's lock (False: one that waits or sends, and
    takes :attr:`Records.lock` itself to write). ``reads`` and ``writes``: the interfaces
    of this module it uses (a write includes reading)."""

    name: ClassVar[str]
    exclusive: ClassVar[bool]
    reads: ClassVar[tuple]
    writes: ClassVar[tuple]

    def __call__(self, work: Work) -> Any: ...


def members(interface) -> tuple:
    """The attribute and method names an interface of this module declares."""
    names = set(vars(interface).get("__annotations__", {}))
    names |= {n for n, v in vars(interface).items() if callable(v) and not n.startswith("_")}
    return tuple(sorted(names))


def _declared(stage) -> tuple:
    return (*type(stage).reads, *type(stage).writes)


class LedgerView:
    """The methods of some ledger interfaces, bound to one ledger; anything else is an
    ``AttributeError`` that names the stage."""

    def __init__(self, ledger, interfaces: tuple, owner: str):
        self._interfaces = tuple(dict.fromkeys(interfaces))
        self._owner = owner
        for interface in self._interfaces:
            for name in members(interface):
                setattr(self, name, getattr(ledger, name))

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        said = ", ".join(i.__name__ for i in self._interfaces) or "none"
        raise AttributeError(f"stage {self._owner!r} declares no ledger interface with "
                             f"{name!r} (it reads and writes {said})")

    def __repr__(self) -> str:
        return f"LedgerView({', '.join(i.__name__ for i in self._interfaces)})"


def narrow(ledger, stage):
    """``ledger`` as ``stage`` declared it (the ledger interfaces among its ``reads`` and
    ``writes``); None stays None."""
    if ledger is None:
        return None
    wanted = tuple(i for i in _declared(stage) if i in LEDGER_INTERFACES)
    return LedgerView(ledger, wanted, getattr(stage, "name", type(stage).__name__))


class WorkView:
    """The work as one stage declared it: it reads the attributes of its ``reads`` and
    ``writes``, sets (and changes in place) only those of its ``writes``; a list it only
    reads comes as a tuple. For checks (a whole pipeline run through it in tests); the
    pipeline itself hands stages the work as it is."""

    def __init__(self, work: Work, stage):
        readable, writable = set(), set()
        for interface in _declared(stage):
            if interface in WORK_INTERFACES:
                readable.update(members(interface))
        for interface in type(stage).writes:
            if interface in WORK_INTERFACES:
                writable.update(members(interface))
        object.__setattr__(self, "_work", work)
        object.__setattr__(self, "_readable", readable)
        object.__setattr__(self, "_writable", writable)
        object.__setattr__(self, "_owner", getattr(stage, "name", type(stage).__name__))

    def __getattr__(self, name: str):
        if name not in self._readable:
            raise AttributeError(f"stage {self._owner!r} reads {name!r} of the work without "
                                 f"declaring it")
        value = getattr(self._work, name)
        if name not in self._writable and isinstance(value, list):
            return tuple(value)
        return value

    def __setattr__(self, name: str, value) -> None:
        if name not in self._writable:
            raise AttributeError(f"stage {self._owner!r} sets {name!r} of the work without "
                                 f"declaring it")
        setattr(self._work, name, value)
