"""Confirm before acting: a hang whose job moved on gets no restart and no eviction.

A hang is found when a job made no step for longer than its allowance; a checkpoint or an
eval that takes longer than the detector has learned looks the same until the next step
comes. So before a restart or an eviction for a hang (or for a silent rank, where its ladder
has one), :class:`Confirm` looks whether the job is still stalled: no step past the hang's
step since it began (for a silent rank: the rank not heard from since the detection). It
looks twice, before the stack capture and again after it (the capture takes seconds). A job
that moved on is a *false alarm*: the incident is closed with one ``action`` record, action
``none``, status ``rate_limited`` (a safety rule held the restart back; never ``done``),
reason ``false_alarm: ...`` and a structured marker for the detector to learn from::

    "targets": {"job": "j1", "false_alarm": {"kind": "hang", "phase": "checkpoint",
                "stalled_s": 52.0, "step": 40, "resumed_step": 41,
                "check": "before_capture", "anomaly": "a1"}}

``stalled_s`` is how long the job really stood still (from the hang's onset to the step
that came after it); ``phase`` is the phase the hang detector saw the job in
(``evidence.phase``, null where it named none). The stream worker's hang detector widens
that phase's allowance from it (docs/POLICY.md, "Confirm before acting").

:class:`JobProgress` knows the steps from the telemetry the action service watches:

>>> p = JobProgress()
>>> for step, ts in [(39, 100.0), (40, 101.0), (40, 101.2), (41, 153.0), (42, 154.0)]:
...     p.observe(ev.Step(job="j1", ts=ts, rank=0, step=step, step_time=1.0))
>>> p.progress_after("j1", 40, since_ts=101.0)
(41, 153.0)
>>> p.progress_after("j1", 42, since_ts=154.0) is None
True
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque
from typing import Callable

from trainguard import events as ev
from trainguard.actions.interfaces import (AnomalyIn, DecisionList, IncidentSlot,
                                           LedgerWrites, Records, Verdict)
from trainguard.actions.model import Decision
from trainguard.actions.policy import STRENGTH, Policy, ladder_kind

__all__ = ["JobProgress", "Confirm", "CONFIRMED_KINDS", "false_alarm_of"]

#: The kinds whose restarts and evictions wait for a confirmation.
CONFIRMED_KINDS = ("hang", "silent")
#: Ladders this demanding (an eviction or a restart) are confirmed; alert-only ones are not.
_ACTING = min(STRENGTH[s] for s in ("evict_if_repeated", "evict_suspects",
                                    "evict_if_persistent", "restart"))


class JobProgress:
    """Per job, the recent advances of its highest step (``(step, ts)``, the last ``keep``)
    and when each rank was last heard from (``step``, ``heartbeat``, ``lifecycle``), from the
    telemetry the action service watches. Thread-safe: fed by one thread, read by others.
    At most ``max_jobs`` jobs, the least recently heard forgotten first.

    A rank whose newer step has a lower number went back (a resume from a checkpoint): the
    advances start again from there, and steps stamped before it are not advances. So the
    steps of an earlier run never count as progress past a hang of the resumed one, and one
    made-up step far ahead is forgotten at its rank's next real step. With a ``clock``, an
    event stamped more than ``ahead_s`` after it is ignored (it would hide the real ones)."""

    def __init__(self, max_jobs: int = 10_000, keep: int = 256,
                 clock: Callable[[], float] | None = None, ahead_s: float = 300.0):
        self.max_jobs = max_jobs
        self.keep = keep
        self.clock = clock
        self.ahead_s = ahead_s
        self._jobs: OrderedDict = OrderedDict()  # job -> _Progress
        self._lock = threading.Lock()

    def observe(self, event: ev.Event) -> None:
        if not isinstance(event, (ev.Step, ev.Heartbeat, ev.Lifecycle)):
            return
        if self.clock is not None and event.ts > self.clock() + self.ahead_s:
            return
        with self._lock:
            entry = self._jobs.get(event.job)
            if entry is None:
                entry = self._jobs[event.job] = _Progress(deque(maxlen=self.keep))
                while len(self._jobs) > self.max_jobs:
                    self._jobs.popitem(last=False)
            else:
                self._jobs.move_to_end(event.job)
            if event.rank is not None and event.ts > entry.heard.get(event.rank, -math.inf):
                entry.heard[event.rank] = event.ts
            if isinstance(event, ev.Step):
                entry.step(event)

    def progress_after(self, job: str, step: int | None, since_ts: float
                       ) -> tuple[int, float] | None:
        """The first known advance past ``step`` (with ``step`` None: the first at or after
        ``since_ts``), as ``(step, ts)``; None when the job made none."""
        with self._lock:
            entry = self._jobs.get(job)
            advances = list(entry.advances) if entry else []
        for number, ts in advances:
            if (number > step) if step is not None else ts >= since_ts:
                return number, ts
        return None

    def heard_after(self, job: str, ranks, ts: float) -> dict:
        """``{rank: last ts}`` of the ``ranks`` heard from after ``ts``."""
        with self._lock:
            entry = self._jobs.get(job)
            heard = dict(entry.heard) if entry else {}
        return {r: heard[r] for r in ranks if heard.get(r, -math.inf) > ts}


class _Progress:
    """One job's advances, its ranks' last heard times and their last steps."""

    __slots__ = ("advances", "heard", "last_step", "since_ts")

    def __init__(self, advances: deque):
        self.advances = advances
        self.heard: dict = {}       # rank -> ts
        self.last_step: dict = {}   # rank -> (step, ts) of its newest step
        self.since_ts = -math.inf   # when the current run went back, if it did

    def step(self, event: ev.Step) -> None:
        last = self.last_step.get(event.rank)
        if last is not None and event.ts <= last[1]:
            return                  # redelivered, or older than the rank's newest
        self.last_step[event.rank] = (event.step, event.ts)
        if last is not None and event.step < last[0]:
            self.advances.clear()   # the rank went back: a resume from a checkpoint
            self.since_ts = event.ts
        elif event.ts < self.since_ts:
            return                  # a step of the run before the resume, arriving late
        if not self.advances or event.step > self.advances[-1][0]:
            self.advances.append((event.step, event.ts))


def false_alarm_of(action) -> dict | None:
    """The false-alarm marker of an ``action`` record (``targets.false_alarm``), or None:
    what a consumer such as the stream worker reads, never the reason's text.

    >>> rec = ev.Action(job="j1", ts=1.0, incident="i1", action="none", status="rate_limited",
    ...                 reason="false_alarm: ...", targets={"false_alarm": {
    ...                     "kind": "hang", "phase": "eval", "stalled_s": 80.0}})
    >>> false_alarm_of(rec)["phase"]
    'eval'
    """
    if getattr(action, "action", None) != "none":
        return None
    marker = (getattr(action, "targets", None) or {}).get("false_alarm")
    if not isinstance(marker, dict) or marker.get("kind") not in CONFIRMED_KINDS:
        return None
    stalled = marker.get("stalled_s")
    if isinstance(stalled, bool) or not isinstance(stalled, (int, float)) \
            or not math.isfinite(stalled) or stalled < 0:
        return None
    phase = marker.get("phase")
    return {**marker, "phase": phase if isinstance(phase, str) else None}


class Confirm:
    """Closes a hang (or silent) incident whose job moved on as a false alarm, before its
    ladder restarts or evicts anything (see the module's doc). ``when`` names the check
    (``before_capture``, ``after_capture``); ``record`` is the pipeline's
    :class:`~trainguard.actions.pipeline.Record` stage, which writes the false alarm with
    what was done so far (the capture). A step more than ``max_step_jump`` past the hang's,
    or stamped more than ``skew_s`` ahead of the service's clock, is not taken as
    progress (it would stop a real hang's restart)."""

    name = "confirm"
    exclusive = True
    reads = (AnomalyIn, IncidentSlot)
    writes = (DecisionList, Verdict, Records, LedgerWrites)   # the last two through ``record``

    def __init__(self, policy: Policy, progress: JobProgress | None, record, *,
                 when: str, clock: Callable[[], float] | None = None,
                 max_step_jump: int = 1_000_000, skew_s: float = 300.0):
        self.policy = policy
        self.progress = progress
        self.record = record
        self.when = when
        self.clock = clock
        self.max_step_jump = max_step_jump
        self.skew_s = skew_s

    def __call__(self, work) -> bool:
        if self.progress is None or not self.policy.confirm_stalled:
            return True
        incident = work.incident
        kind = ladder_kind(self.policy, incident)
        if kind not in CONFIRMED_KINDS or self.policy.strength(kind) < _ACTING:
            return True
        now = self.clock() if self.clock else work.now
        marker = self._moved_on(work, now)
        if marker is None:
            return True
        marker.update(check=self.when, anomaly=work.anomaly.id)
        what = (f"moved on to step {marker['resumed_step']}" if marker["kind"] == "hang"
                else f"heard from rank(s) {marker['ranks']} again")
        phase = f" in phase {marker['phase']}" if marker.get("phase") else ""
        work.decisions.append(Decision(
            action="none", status="rate_limited", severity="info", code="false_alarm",
            targets={"job": incident.job, "false_alarm": marker},
            reason=f"false_alarm: job {incident.job} {what} after {marker['stalled_s']:.0f}s "
                   f"stalled{phase} ({self.when.replace('_', ' ')}); no restart, no "
                   f"eviction"))
        work.false_alarm = marker
        self.record(work)
        return False

    def _moved_on(self, work, now: float) -> dict | None:
        anomaly, incident = work.anomaly, work.incident
        own = anomaly.kind in CONFIRMED_KINDS
        kind = anomaly.kind if own else ladder_kind(self.policy, incident)
        step = anomaly.step if own else incident.step
        onset = anomaly.onset_ts if own else incident.onset_ts
        evidence = anomaly.evidence if own else incident.evidence
        phase = evidence.get("phase") if isinstance(evidence.get("phase"), str) else None
        if kind == "hang":
            moved = self.progress.progress_after(incident.job, step, onset)
            if moved is None or moved[1] > now + self.skew_s or (
                    step is not None and moved[0] - step > self.max_step_jump):
                return None
            stalled = round(max(0.0, moved[1] - onset), 3)
            return {"kind": "hang", "phase": phase, "stalled_s": stalled, "step": step,
                    "resumed_step": moved[0]}
        ranks = sorted(set(anomaly.ranks if own else incident.ranks))
        detected = anomaly.detected_ts if own else incident.detected_ts
        heard = self.progress.heard_after(incident.job, ranks, detected)
        heard = {r: ts for r, ts in heard.items() if ts <= now + self.skew_s}
        if not ranks or set(heard) != set(ranks):
            return None
        return {"kind": "silent", "phase": phase, "ranks": ranks,
                "stalled_s": round(max(0.0, max(heard.values()) - onset), 3)}
