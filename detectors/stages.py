"""The staged engine: per-rank compaction and per-machine GPU checks, then per-job
detection and correlation.

``RankStage`` (one per job and rank) turns a rank's ``step``, ``heartbeat`` and ``lifecycle``
events into compact summary dicts; ``NodeStage`` (one per job and machine) runs the GPU checks
on the machine's ``gpu`` and ``xid`` events and passes on small summaries and its findings;
``JobStage`` (one per job) takes all those summaries, runs the cross-rank detectors, names the
rank of a faulty GPU, correlates, and returns ``ev.Anomaly`` objects. ``Engine`` routes raw
events through all three, for offline analysis, as the worker does across Kafka.

>>> from trainguard import events as ev
>>> engine = Engine()
>>> out = []
>>> for step in range(3):
...     for rank in range(2):
...         loss = float("nan") if (step, rank) == (2, 1) else 2.0
...         out += engine.update(ev.Step(job="j1", ts=100.0 + step, node="n1", rank=rank,
...                                      step=step, step_time=1.0, loss=loss))
>>> [(a.kind, a.ranks, a.step) for a in out]
[('nan', [1], 2)]
>>> [(i["kind"], i["ranks"]) for i in engine.incidents()]
[('nan', [1])]
"""
from __future__ import annotations

import math
import struct
from collections import deque
from dataclasses import asdict

from trainguard import events as ev

from .base import INPUTS, Detector, Finding, json_number, to_anomaly
from .clock import JUMP_S, JobClock
from .config import DETECTORS, DetectorsConfig
from .correlate import Correlator
from .gpu import Placement
from .phases import STEP_PHASES
from .view import LEARNS_FROM, JobView
from .lessons import Lessons
from .machine_outlier import MachineVector
from .registry import detector_classes, plugins
from .steps import StepAggregator

__all__ = ["RankStage", "NodeStage", "launcher_summary", "on_grid", "JobStage", "Engine", "StepAggregator", "DETECTORS",
           "JOB_DETECTORS", "NODE_DETECTORS", "routes"]

#: The per-machine ones (registered with ``stage="node"``), which a NodeStage runs; a
#: JobStage runs the others. Both also run the plug-in detectors of their stage
#: (:func:`~.registry.plugins`), loaded before the stage was made.
NODE_DETECTORS = detector_classes("node", builtin_only=True)
JOB_DETECTORS = detector_classes("job", builtin_only=True)


#: The summary kinds a JobStage passes to detectors as they are (``step`` also goes on to
#: the step aggregator, whose ``jobstep`` and ``late`` items are routed in turn).
_SUMMARY_ROUTES = frozenset(("hb", "life", "gpu"))
#: The event types a RankStage compacts.
_RANK_EVENTS = frozenset(("step", "heartbeat", "lifecycle"))
#: a rank's last heartbeats whose stamps are kept, to tell one that comes again
STAMPS_KEPT = 16
_STAMP = struct.Struct("<d")       # kept packed: no float objects, 8 bytes a stamp


def _kept(stamps: bytes, packed: bytes) -> bool:
    """Whether ``packed`` is one of the stamps in ``stamps`` (at a multiple of 8)."""
    at = stamps.find(packed)
    while at > 0 and at % 8:
        at = stamps.find(packed, at + 1)
    return at >= 0


def routes(detectors) -> dict:
    """Each input of :data:`~trainguard.detectors.base.INPUTS` -> the detectors that declare
    it in ``CONSUMES``, in the order given: a stage feeds what each declares, no more.

    >>> from trainguard.detectors import HangDetector, NanDetector
    >>> r = routes([NanDetector(), HangDetector()])
    >>> [type(d).__name__ for d in r["jobstep"]], [type(d).__name__ for d in r["hb"]]
    (['NanDetector'], ['HangDetector'])
    >>> routes([type("Odd", (Detector,), {"CONSUMES": ("telepathy",)})()])
    Traceback (most recent call last):
    ...
    ValueError: Odd consumes unknown inputs ['telepathy']; known: ['end', 'gpu', 'hb', 'jobstep', 'late', 'life', 'step', 'tick', 'xid']
    """
    table: dict = {kind: [] for kind in INPUTS}
    for detector in detectors:
        unknown = [k for k in detector.CONSUMES if k not in INPUTS]
        if unknown:
            raise ValueError(f"{type(detector).__name__} consumes unknown inputs {unknown}; "
                             f"known: {sorted(INPUTS)}")
        for kind in detector.CONSUMES:
            table[kind].append(detector)
    return table


class RankStage:
    """Compacts one rank's events into summary dicts (plain JSON, non-finite numbers as the
    SPEC strings). A heartbeat is forwarded when the rank enters or leaves a ``checkpoint``,
    ``eval``, ``init`` or user-declared phase (they pause the hang clock), else once every
    ``config.heartbeat_summary_s``: enough for liveness and for naming a hang's odd ranks,
    while step progress travels in the step summaries. A lifecycle summary carries the rank's
    last step. A heartbeat stamped more than ``JUMP_S`` before the rank's last one, or
    that much more after it than the one before, is forwarded with ``jump``, how far (a step
    of its machine's clock, which :class:`JobClock` applies at once; one of a phase begun
    before a step back keeps the phase's age); so is a step's record stamped that much
    before the rank's last, or after it beyond the step's time. The two are measured apart:
    heartbeats are stamped as they are sent, by one thread, a step's record at the step's
    end, and it may be sent a step later, once its GPU timing is ready (after heartbeats of
    an eval between). The first step's record after a pause (not the process's first: its
    first step may be long) ended after the pause's heartbeats (save one sent a step late):
    stamped ``JUMP_S`` and twice its step's time before the last of them, its clock went
    back (an eval's heartbeats 5 s apart hid a step back of 28 s until after the first
    steps that followed it). Both are measured from a process's start or end; a jump back
    told by one moves the other's reference with it.

    A record stamped before the rank's last one of its kind is an old one, written again or
    overtaken by later ones (a recording whose recorder restarted; a producer's retry), when
    its step number says so (:meth:`_stale`): such a heartbeat is dropped, such a step
    record forwarded without ``jump``, and neither moves a reference. A step of the clock
    back leaves the step numbers going on, so it is told as before. A heartbeat out of
    order (not after the last, or after it by a jump) whose stamp is one of the rank's last
    :data:`STAMPS_KEPT` heartbeats' is one that came again (an at-least-once copy is the same
    record; a clock that went back stamps anew): dropped too, whatever its step (the newest
    one in a long step or phase), also the newest heartbeat again and a copy of one from
    before a step back. Not told apart: a copy older than those (16 heartbeats: 16 s at the
    collector's default interval), an old record of the run before a restart that resumed
    from an earlier step (but for its last heartbeats), or of the epoch before step numbers
    began again; each is taken for a step of the clock, as before. A producer that stamps
    whole seconds on a fixed timer and whose clock steps back by whole seconds in a pause
    (no step records to tell it) is taken for copies: its heartbeats are dropped for as long
    as the step (up to 16 of them), which can be a false ``silent``, and the step is not told.

    >>> from trainguard import events as ev
    >>> rs = RankStage()
    >>> hb = ev.Heartbeat(job="j", ts=10.0, node="n1", rank=0, pid=1, step=4,
    ...                   phase="forward", phase_since=9.5)
    >>> [len(rs.update(hb.replace(ts=t, step=int(t)))) for t in (10.0, 11.0, 12.0, 15.0)]
    [1, 0, 0, 1]
    >>> len(rs.update(hb.replace(ts=15.5, phase="checkpoint", phase_since=15.2)))
    1
    >>> rs.update(ev.Step(job="j", ts=16.0, node="n1", rank=0, step=5, step_time=1.0,
    ...                   loss=float("inf")))[0]["loss"]
    'Infinity'
    """

    def __init__(self, config: DetectorsConfig | None = None):
        # Only the one setting is kept: a worker snapshots thousands of these every few
        # seconds, and a DetectorsConfig in each would be ten times the size of the rest.
        config = config if config is not None else DetectorsConfig()
        self._every = config.stages.heartbeat_summary_s
        self._last_step = None
        self._hb_key = 0
        self._hb_ts = None
        self._ts = None           # the stamp of its last heartbeat
        self._gap = math.inf      # the time between its last two heartbeats
        self._step_ts = None      # the stamp of its last step record
        self._stepped = False     # a step record came since the process started
        self._since = None        # the phase_since of its last heartbeat
        self._moved = None        # [that phase's since, how far its clock went back since]
        self._stamps = b""        # its last heartbeats' stamps (STAMPS_KEPT, _STAMP)

    def _jumped(self, gap: float) -> float:
        """``gap``, how far the rank's heartbeats' or step records' stamps moved (see the
        class); a heartbeat's ``phase_since`` of a phase begun before a step back is moved
        with it."""
        if gap < 0.0 and self._since is not None:
            moved = self._moved
            self._moved = [self._since, gap + (moved[1] if moved and moved[0] == self._since
                                               else 0.0)]
        return gap

    def update(self, event) -> list[dict]:
        kind = event.TYPE
        jump = None
        if kind == "heartbeat":
            # stamped as sent, by one thread (a step's record may wait for its GPU timing)
            ts, last = event.ts, self._ts
            packed = _STAMP.pack(ts)
            if last is not None:
                gap = ts - last
                # not the next one in order: maybe written again or overtaken (the stamps
                # tell also a copy of one from before a step of the clock back)
                if (gap <= 0.0 or gap > JUMP_S + self._gap) and (
                        gap < 0.0 and self._stale(event) or _kept(self._stamps, packed)):
                    return []              # nothing new
            self._ts = ts
            stamps = self._stamps + packed
            self._stamps = stamps[-8 * STAMPS_KEPT:] if len(stamps) > 8 * STAMPS_KEPT else stamps
            if last is not None:
                # forward: more than its last gap (heartbeats 10 s apart in an eval are none)
                if gap > JUMP_S + self._gap or gap < -JUMP_S:
                    jump = self._jumped(gap)
                    if gap < 0.0 and self._step_ts is not None:
                        self._step_ts += gap   # its next step's record is on the new clock
                self._gap = gap if gap > 0.0 else 0.0
        elif kind == "step":           # stamped at its end, in order (maybe sent later)
            ts, last = event.ts, self._step_ts
            if last is not None and ts < last and self._stale(event):
                return [_step_summary(event, None)]     # its numbers count; no jump
            self._step_ts = ts
            gap = None
            if last is not None:
                gap = ts - last      # forward: more than the step took (a pause between)
                took = event.step_time or 0.0
                if gap > JUMP_S + took:
                    if self._stepped and self._ts is not None and \
                            ts < self._ts - JUMP_S - 2.0 * took:
                        gap = ts - self._ts    # the first after a pause ended after its
                                               # heartbeats (or a step, if sent late)
                elif gap >= -JUMP_S:
                    gap = None
            self._stepped = True
            if gap is not None:
                jump = self._jumped(gap)
                if gap < 0.0 and self._ts is not None:
                    self._ts += gap        # its next heartbeat is on the new clock
        elif kind == "lifecycle":      # a process starts or ends: measured from here
            self._ts, self._gap = event.ts, math.inf
            self._step_ts, self._stepped = event.ts, False
        if kind == "step":
            self._last_step = event.step
            return [_step_summary(event, jump)]
        if kind == "heartbeat":
            phase, since = event.phase, event.phase_since
            self._since = since
            moved = self._moved
            if moved is not None:
                if since == moved[0] and since is not None:
                    since = since + moved[1]
                else:
                    self._moved = None
            allowed = type(phase) is str and phase not in STEP_PHASES   # is_allowed_phase
            key = (phase, since) if allowed else None
            if jump is None and key == self._hb_key and \
                    0.0 <= event.ts - self._hb_ts < self._every:
                return []
            self._hb_key = key
            self._hb_ts = event.ts
            out = {"k": "hb", "job": event.job, "rank": event.rank, "node": event.node,
                   "ts": event.ts, "step": event.step, "phase": phase,
                   "phase_since": since, "pid": event.pid, "dropped": event.dropped}
            if jump is not None:
                out["jump"] = jump
            return [out]
        if kind == "lifecycle":
            if event.event == "start":
                self._last_step = None
                self._hb_key = 0
                self._moved = None
            return [{"k": "life", "job": event.job, "rank": event.rank, "node": event.node,
                     "ts": event.ts, "event": event.event, "exit_code": event.exit_code,
                     "signal": event.signal, "pid": event.pid, "world_size": event.world_size,
                     "local_rank": event.local_rank, "step": self._last_step,
                     "topology": event.topology}]
        return []

    def _stale(self, event) -> bool:
        """Whether ``event``, a heartbeat or step record stamped before the rank's last one
        of its kind, is an old one (see the class): a step record of a step the rank's step
        records had reached, a heartbeat whose last completed step they had gone past, or
        one without a step in ``init`` or a step's phase once they began."""
        last = self._last_step
        if last is None:
            return False
        step = event.step
        if event.TYPE == "step":
            return step <= last
        if step is None:         # before its first step; in a pause a producer may say none
            return event.phase == "init" or event.phase in STEP_PHASES
        return type(step) is int and step < last


def _step_summary(event, jump) -> dict:
    """A step record's summary (``jump``: see :class:`RankStage`)."""
    loss, grad_norm, loss_scale = event.loss, event.grad_norm, event.loss_scale
    extra = event.extra
    # json_number's test inline: a finite float or None is the common case
    if loss is not None and loss - loss != 0:
        loss = json_number(loss)
    if grad_norm is not None and grad_norm - grad_norm != 0:
        grad_norm = json_number(grad_norm)
    if loss_scale is not None and loss_scale - loss_scale != 0:
        loss_scale = json_number(loss_scale)
    out = {"k": "step", "job": event.job, "rank": event.rank, "node": event.node,
           "ts": event.ts, "step": event.step, "step_time": event.step_time,
           "compute_time": event.compute_time, "loss": loss,
           "grad_norm": grad_norm, "loss_scale": loss_scale, "tokens": event.tokens,
           "samples": extra.get("samples") if extra else None}
    if jump is not None:
        out["jump"] = jump
    return out


def on_grid(now: float, every: float) -> float:
    """The latest point of the event-time grid (multiples of ``every``) at or before ``now``:
    ``analyze`` and the worker advance the detectors on the same grid, so the same recording
    gives the same detection times through both.

    >>> on_grid(1764680012.74, 0.5), on_grid(3.0, 0.0)
    (1764680012.5, 3.0)
    """
    return math.floor(now / every) * every if every > 0 else now


def launcher_summary(event) -> dict:
    """The ``life`` summary (rank null) of a launcher's lifecycle event: ``trainguard run``
    marks the exit that announces its own restart with ``restart: true``.

    >>> from trainguard import events as ev
    >>> e = ev.Lifecycle(job="j", ts=5.0, node="n1", rank=None, event="exit",
    ...                  extra={"source": "supervisor", "restart": True})
    >>> launcher_summary(e)["restart"], launcher_summary(e)["rank"]
    (True, None)
    """
    extra = event.extra or {}
    return {"k": "life", "job": event.job, "rank": None, "node": event.node, "ts": event.ts,
            "event": event.event, "exit_code": event.exit_code, "signal": event.signal,
            "pid": event.pid, "world_size": event.world_size, "local_rank": None,
            "step": None, "source": extra.get("source"), "restart": extra.get("restart") is True}


class NodeStage:
    """The GPU checks of one machine of one job (:data:`NODE_DETECTORS`): its ``gpu`` and
    ``xid`` events in, summary dicts out (plain JSON), repartitioned by job with the ranks':

    - ``{"k": "gpu", "job", "node", "ts", "x"}`` for every GPU sample (the machine is alive;
      ``x``: its counters for machine_outlier, :class:`~.machine_outlier.MachineVector`);
    - ``{"k": "finding", "job", "node", "ts", "finding": {...}}`` for each finding, the fields
      of :class:`Finding` with no ranks yet: the JobStage knows which rank runs on the GPU.

    Run per machine, the GPU checks of a job of thousands of machines spread over the
    workers with the ranks' compaction, instead of all weighing on the job's one JobStage.

    >>> from trainguard import events as ev
    >>> ns = NodeStage()
    >>> sample = lambda t, dbe: ev.Gpu(job="j", ts=t, node="n1",
    ...                                gpus=[{"index": 0, "uuid": "GPU-0", "ecc_dbe": dbe}])
    >>> [(s["k"], s["ts"], len(s["x"])) for s in ns.update(sample(1.0, 0))]
    [('gpu', 1.0, 13)]
    >>> [(s["k"], s.get("finding", {}).get("summary")) for s in ns.update(sample(2.0, 1))]
    [('gpu', None), ('finding', 'uncorrectable ECC errors on GPU 0 of n1: ecc_dbe rose 0 -> 1')]
    """

    def __init__(self, config: DetectorsConfig | None = None):
        c = config if config is not None else DetectorsConfig()
        self.detectors = [cls(**c.params_for(cls))
                          for cls in (*NODE_DETECTORS, *plugins("node"))]
        self.vector = MachineVector()   # the machine's counters, for machine_outlier

    def update(self, event) -> list[dict]:
        kind = event.TYPE
        if kind == "gpu":
            out = [{"k": "gpu", "job": event.job, "node": event.node, "ts": event.ts}]
            if event.gpus and event.status != "unavailable":
                out[0]["x"] = self.vector.vector(event.ts, event.gpus,
                                                 event.host)
        elif kind == "xid":
            out = []
        else:
            return []
        for detector in self.detectors:
            if kind not in detector.CONSUMES:
                continue
            for finding in detector.update(event):
                out.append({"k": "finding", "job": event.job, "node": event.node,
                            "ts": finding.detected_ts, "finding": asdict(finding)})
        return out


class JobStage:
    """All cross-rank detection of one job, and its incident correlation.

    ``update(item)`` takes a RankStage or NodeStage summary dict, or an ``ev.Gpu`` /
    ``ev.Xid`` event (or its SPEC dict), which goes through a NodeStage of its own;
    ``advance(now)`` runs the time-driven checks (``final=True`` once the input ended, to
    decide what waits for more evidence). Both return new ``ev.Anomaly`` objects; an
    anomaly id is emitted once. Its whole state is plain data and objects of
    ``trainguard.detectors``, which the worker snapshots as data (never pickled:
    :mod:`trainguard.streams.statecodec`).
    """

    def __init__(self, config: DetectorsConfig | None = None):
        self.config = config if config is not None else DetectorsConfig()
        c = self.config
        self.detectors = {cls.PREFIX: cls(**c.params_for(cls))
                          for cls in (*JOB_DETECTORS, *plugins("job"))}
        self._routes = routes(self.detectors.values())
        self.view = JobView()          # the job as every detector sees it, kept here
        for detector in self.detectors.values():
            if getattr(detector, "USES_VIEW", False):
                detector.share_view(self.view)
        self.placement = Placement()   # names the rank of a GPU in NodeStage findings
        self._nodes: dict = {}         # node -> NodeStage, for node events given directly
        self.steps = StepAggregator(window=c.stages.step_window,
                                    window_s=c.stages.step_window_s)
        self.clock = JobClock()        # machines' clock offsets, learned from step numbers
        self.correlator = Correlator(**c.params_for(Correlator))
        self.job = None
        self.lessons = Lessons()       # what people's verdicts taught (trainguard feedback)
        self._emitted: set = set()
        self._emitted_order: deque = deque()
        self._changed: dict = {}      # incident id -> its dict, changed since take_incidents

    def update(self, item, clocked: bool = False) -> list[ev.Anomaly]:
        """``clocked``: ``item`` is on the job's clock already (the worker's job side
        restamps what it holds to order it, :meth:`JobClock.correct`)."""
        if type(item) is dict:
            k = item.get("k")
            if not clocked:
                self.clock.correct(item)        # one job clock, whatever a machine's says
            if k == "step":                     # the commonest item first
                if self.job is None:
                    self.job = item.get("job")
                self.view.learn(item)
                findings = []
                for d in self._routes["step"]:
                    found = d.update(item)
                    if found:
                        findings += found
                closed = self.steps.add(item)
                if closed:
                    for jobstep in closed:
                        findings += self._jobstep(jobstep)
                return self._emit(findings) if findings else []
            if k is None and "type" in item:
                return self.update(ev.from_dict(item))
            if self.job is None:
                self.job = item.get("job")
            if k in LEARNS_FROM:
                self.view.learn(item)
            if k == "finding":
                return self._emit([self._named(Finding(**item["finding"]))])
            targets = self._routes.get(k, ()) if k in _SUMMARY_ROUTES else ()
            if k == "life":
                self.steps.life(item)
                self.placement.learn(item)
                if item.get("event") == "start" and item.get("rank") is not None \
                        and type(item.get("ts")) in (int, float):
                    self.correlator.relaunched(self.job, item["ts"])   # a new problem after
        else:
            if self.job is None:
                self.job = item.job
            if item.TYPE not in ("gpu", "xid"):
                return []
            node = self._nodes.get(item.node)
            if node is None:
                node = self._nodes[item.node] = NodeStage(self.config)
            out = []
            for summary in node.update(item):
                out += self.update(summary)
            return out
        findings = []
        for d in targets:
            findings += d.update(item)
        return self._emit(findings) if findings else []

    def _jobstep(self, jobstep) -> list:
        if "late" in jobstep:
            detectors = self._routes["late"]
        else:
            self.placement.learn(jobstep)
            detectors = self._routes["jobstep"]
        findings = []
        for d in detectors:
            findings += d.update(jobstep)
        return findings

    def _named(self, finding: Finding) -> Finding:
        """A NodeStage finding with the rank that runs on its GPU, when known."""
        node = finding.nodes[0] if finding.nodes else None
        rank = None if finding.ranks else self.placement.rank_of(node, finding.evidence.get("gpu"))
        if rank is not None:
            finding.ranks = [rank]
            finding.evidence = {**finding.evidence, "rank_nodes": {str(rank): node}}
        return finding

    def advance(self, now: float, final: bool = False, steps_now: float | None = None,
                unseen: frozenset = frozenset()) -> list[ev.Anomaly]:
        """``steps_now``: the time up to which every source of the job has been heard (the
        worker's lowest partition; default ``now``). It closes steps by their age, and the
        detectors that judge an absence (a silent rank, a tear-down's grace) judge up to it
        (:meth:`JobView.judged`): a partition read behind the others still counts toward its
        steps, and its ranks are not missing. ``unseen``: ranks whose records nobody reads
        now (the worker's, :attr:`JobView.unseen`); they are not judged missing."""
        findings = []
        upto = now if steps_now is None or steps_now > now else steps_now
        self.view.heard_upto = None if upto == now else upto
        self.view.unseen = unseen
        for jobstep in self.steps.expire(upto):
            findings += self._jobstep(jobstep)
        for d in self._routes["tick"]:
            findings += d.advance(now)
        if final:      # the input ended: what waits for more evidence is decided now
            for d in self._routes["end"]:
                findings += d.finish(now)
        return self._emit(findings) if findings else []

    def incidents(self) -> list[dict]:
        return self.correlator.incidents()

    def note_false_alarm(self, phase: str | None, seconds: float) -> None:
        """The action service found a hang of this job to be none (it moved on): widen the
        allowance of ``phase`` (see :meth:`HangDetector.note_false_alarm`)."""
        self.detectors["hang"].note_false_alarm(phase, seconds)

    def note_feedback(self, verdict: str, incident: str | None, kind: str | None = None,
                      ts: float = 0.0) -> dict:
        """A person's verdict on one of this job's incidents (:mod:`.lessons`)."""
        from .lessons import apply_feedback

        return apply_feedback(self, verdict, incident, kind, ts)

    def _emit(self, findings) -> list[ev.Anomaly]:
        out = []
        for finding in findings:
            anomaly = to_anomaly(self.job or "unknown", finding)
            if anomaly.id in self._emitted:
                continue
            self._emitted.add(anomaly.id)
            self._emitted_order.append(anomaly.id)
            if len(self._emitted_order) > self.config.stages.emitted_ids_kept:
                self._emitted.discard(self._emitted_order.popleft())
            incident = self.correlator.add(anomaly)
            self._changed[incident["id"]] = incident
            out.append(anomaly)
        return out

    def take_incidents(self) -> list[dict]:
        """The incidents opened or grown since the last call (each once, as it is now): what
        a worker publishes as ``incident`` events (SPEC §6)."""
        changed, self._changed = list(self._changed.values()), {}
        return changed


class Engine:
    """Routes raw events through one RankStage per (job, rank) and one JobStage per job,
    which passes a machine's gpu and xid events through its NodeStage for that machine.

    ``advance(now)`` does work at most every ``config.stages.advance_grid_s`` of ``now``, at
    the latest point of that event-time grid (:func:`on_grid`), as the worker does (pass ``force=True`` for the final sweep at the end of the input: it also decides what
    still waits for more evidence, such as a tear-down within its grace period). Events other than step, heartbeat, lifecycle,
    gpu and xid are ignored, as are rank events without a rank.
    """

    def __init__(self, config: DetectorsConfig | None = None, tune_stage=None):
        self.config = config if config is not None else DetectorsConfig()
        #: called with (job, stage) for each new job stage: per-job overrides
        #: (``trainguard analyze --overrides``, :mod:`trainguard.overrides`)
        self.tune_stage = tune_stage
        self._ranks: dict = {}
        self._jobs: dict = {}
        self.next_advance_ts = float("-inf")   # advance(now) before this does nothing

    def job_stage(self, job: str) -> JobStage:
        stage = self._jobs.get(job)
        if stage is None:
            stage = self._jobs[job] = JobStage(self.config)
            stage.job = job
            if self.tune_stage is not None:
                self.tune_stage(job, stage)
        return stage

    def update(self, event) -> list[ev.Anomaly]:
        kind = event.TYPE
        if kind in _RANK_EVENTS:
            rank = event.rank
            if rank is None:
                if kind == "lifecycle":        # the launcher's (trainguard run's) own
                    return self.job_stage(event.job).update(launcher_summary(event))
                return []
            job = event.job
            rank_stage = self._ranks.get((job, rank))
            if rank_stage is None:
                rank_stage = self._ranks[(job, rank)] = RankStage(self.config)
            summaries = rank_stage.update(event)
            if not summaries:
                return []
            stage = self._jobs.get(job) or self.job_stage(job)
            if len(summaries) == 1:             # what a RankStage gives
                return stage.update(summaries[0])
            out = []
            for summary in summaries:
                out += stage.update(summary)
            return out
        if kind in ("gpu", "xid"):     # through the job's NodeStage of that machine
            return self.job_stage(event.job).update(event)
        return []

    def job_time(self, event) -> float:
        """``event.ts`` on its job's clock (its machine's learned offset taken off)."""
        stage = self._jobs.get(event.job)
        return stage.clock.time(event.node, event.ts) if stage is not None else event.ts

    def advance(self, now: float, force: bool = False) -> list[ev.Anomaly]:
        if not force and now < self.next_advance_ts:
            return []
        at = now if force else on_grid(now, self.config.stages.advance_grid_s)
        self.next_advance_ts = at + self.config.stages.advance_grid_s
        out = []
        for stage in self._jobs.values():
            out += stage.advance(at, final=force)
        return out

    def incidents(self) -> list[dict]:
        every = []
        for stage in self._jobs.values():
            every += stage.incidents()
        return sorted(every, key=lambda i: (i["onset_ts"], i["id"]))
