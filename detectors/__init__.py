"""trainguard.detectors — pure detection logic and incident correlation (no I/O, no clock:
time comes with the inputs or as ``advance(now)``; only ``offline.py`` and ``parallel.py``,
the drivers of ``trainguard analyze``, read a recording file).

The stable API, used by ``streams/`` (online, on Faust) and ``offline.py`` (``trainguard
analyze``). The state of every stage and detector is plain data and objects of this package:
the worker snapshots it as data (:mod:`trainguard.streams.statecodec`), never pickled.

``RankStage(config)`` — one per (job, rank); partition key ``job/rank``.
    ``update(event) -> list[dict]`` takes that rank's ``ev.Step``, ``ev.Heartbeat`` and
    ``ev.Lifecycle`` events and returns compact, JSON-serializable summaries, to be
    repartitioned by job:

    - ``{"k": "step", "job", "rank", "node", "ts", "step", "step_time", "compute_time",
      "loss", "grad_norm", "loss_scale"}`` for every step (non-finite numbers as the SPEC
      strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``);
    - ``{"k": "hb", "job", "rank", "node", "ts", "step", "phase", "phase_since", "pid",
      "dropped"}`` when the rank enters or leaves an allowed phase (``checkpoint``, ``eval``,
      ``init`` or a user-declared one),
      else once every ``heartbeat_summary_s`` (5 s): liveness and a hang's odd ranks need no
      more, and progress travels in the step summaries;
    - ``{"k": "life", "job", "rank", "node", "ts", "event", "exit_code", "signal", "pid",
      "world_size", "local_rank", "step"}`` for lifecycle events (``step``: last step seen).

``NodeStage(config)`` — one per (job, machine); partition key ``job/node``.
    ``update(event) -> list[dict]`` takes that machine's ``ev.Gpu`` and ``ev.Xid`` events,
    runs the GPU detectors and returns:

    - ``{"k": "gpu", "job", "node", "ts", "x"}`` for every GPU sample (machine-level
      silence; ``x``: the machine's counters, compared with its peers' by
      :class:`MachineOutlierDetector`);
    - ``{"k": "finding", "job", "node", "ts", "finding": {...}}`` for each finding (the
      :class:`Finding` fields; the JobStage names the rank on the GPU).

``JobStage(config)`` — one per job; partition key ``job``.
    ``update(item) -> list[ev.Anomaly]`` takes the summaries above; node events (``ev.Gpu``,
    ``ev.Xid``, or their SPEC dicts) given directly go through a NodeStage of its own.
    ``advance(now) -> list[ev.Anomaly]`` runs the time-driven checks (hang, silent, step
    closing); call it with the wall clock online (about every second) and with event time
    offline.
    ``incidents() -> list[dict]`` gives the correlated incidents (SPEC §4 objects plus
    ``"anomalies": [ids]``). Anomalies carry stable ids (a sha1 prefix of job, kind,
    detector, first step or onset, ranks and nodes), so re-processing after a restart
    re-creates the same ids; a JobStage emits each id once.

``Engine(config)`` — routes raw events through the three stages, per key:
    ``update(event)``, ``advance(now, force=False)``, ``incidents()``.

``DetectorsConfig`` — the ``detectors`` section: each detector's own ``Config`` (a kw_only
    dataclass beside its code), the stages' and the correlation's; validated.

Detectors (river style; constructor = configuration; ``update(item) -> list[Finding]``,
``advance(now)`` for the time-driven ones; ``clone()``). Each declares what it consumes in
``CONSUMES`` (words of ``base.INPUTS``: ``step``, ``jobstep``, ``late``, ``hb``, ``life``,
``gpu``, ``xid``, ``tick`` for ``advance``, ``end`` for ``finish``); the stages build their
dispatch from those declarations (``stages.routes``), so a registered detector is fed
exactly what it declares, and ``tests/detector_checks.py`` holds it to its word. Each is
registered (``@register_detector``, :mod:`~trainguard.detectors.registry`) with its anomaly
kinds, default ladder, root-cause priority and what its anomalies may cause; ``DETECTORS``,
the configuration section, ``PRIORITY``, ``CONSEQUENCES`` and the policy's default ladder are
made from the registrations, and a plug-in detector registers itself alike
(docs/DETECTORS.md). What
every detector means alike (where ranks run, when each was last heard, ranks per pipeline
stage) is one :class:`~trainguard.detectors.view.JobView` per job, kept by the JobStage and
shared with the detectors that read it (``view.UsesView``): :class:`NanDetector`,
:class:`LossSpikeDetector`, :class:`GradSpikeDetector`, :class:`StragglerDetector`,
:class:`ThroughputDetector`, :class:`HangDetector`, :class:`SilentDetector`,
:class:`CrashDetector`, :class:`GpuFaultDetector`, :class:`GpuDegradedDetector`,
:class:`MachineOutlierDetector`.
Incident correlation: :class:`Correlator` (``correlate.py``, root-cause priority and rules).

>>> from trainguard import events as ev
>>> stage = JobStage()
>>> stage.update({"k": "life", "job": "j1", "rank": 2, "node": "n1", "ts": 5.0,
...               "event": "exit", "exit_code": 1, "signal": None, "step": 40})[0].kind
'crash'
"""
from .base import Detector, Finding, anomaly_id, make_jobstep, to_anomaly
from .config import DetectorConfig, DetectorsConfig, StagesConfig
from .registry import register_detector
from .correlate import PRIORITY, Correlator
from .gpu import FAULT_XIDS, XID_TABLE, GpuDegradedDetector, GpuFaultDetector, xid_info
from .liveness import CrashDetector, HangDetector, SilentDetector
from .machine_outlier import MachineOutlierDetector
from .stages import (DETECTORS, JOB_DETECTORS, NODE_DETECTORS, Engine, JobStage, NodeStage,
                     RankStage, StepAggregator)
from .straggler import StragglerDetector
from .timing import ThroughputDetector
from .training import GradSpikeDetector, LossSpikeDetector, NanDetector

__all__ = [
    "Detector", "Finding", "anomaly_id", "to_anomaly", "make_jobstep", "DetectorConfig",
    "DetectorsConfig", "StagesConfig", "register_detector",
    "Correlator", "PRIORITY", "XID_TABLE", "FAULT_XIDS", "xid_info", "NanDetector",
    "LossSpikeDetector", "GradSpikeDetector", "StragglerDetector", "ThroughputDetector",
    "HangDetector", "SilentDetector", "CrashDetector", "GpuFaultDetector",
    "GpuDegradedDetector", "MachineOutlierDetector", "RankStage", "NodeStage", "JobStage", "Engine", "StepAggregator",
    "DETECTORS", "JOB_DETECTORS", "NODE_DETECTORS",
]
