"""What every detector shares: the :class:`Finding`, the base class, stable ids, small helpers.

A detector is a small river-style object: its constructor is its configuration (every argument
stored under its own name, so :meth:`Detector.clone` can rebuild it), ``update(item)`` learns
from one input and returns findings, ``advance(now)`` lets time-driven ones notice that
something did *not* happen. Time always comes from the inputs or from ``now``; no detector
reads a clock. Inputs are the stage items described in :mod:`trainguard.detectors`
(summary dicts with a ``"k"`` key, ``jobstep`` dicts, and ``ev.Gpu`` / ``ev.Xid`` events);
a detector ignores items that are not for it.

>>> f = Finding(kind="crash", severity="critical", ranks=[3], nodes=[], step=41,
...             onset_ts=100.0, detected_ts=100.0, detector="crash", summary="rank 3 died")
>>> a = to_anomaly("j1", f)
>>> a.kind, a.ranks, a.id == to_anomaly("j1", f).id, len(a.id)
('crash', [3], True, 16)
>>> median([3.0, 1.0, 2.0, 10.0])
2.5
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
from dataclasses import dataclass, field

from trainguard import events as ev


@dataclass(kw_only=True)
class Finding:
    """One detector's verdict, before it becomes an :class:`ev.Anomaly` of a job."""

    kind: str
    severity: str
    ranks: list
    nodes: list
    step: int | None
    onset_ts: float
    detected_ts: float
    detector: str
    summary: str
    evidence: dict = field(default_factory=dict)
    #: what identifies the finding besides kind, detector, ranks and nodes; default: the step,
    #: or the onset time when there is no step
    key: str = ""


def anomaly_id(job: str, finding: Finding) -> str:
    """Deterministic id: the same finding re-emitted after a restart gets the same id."""
    key = finding.key or (f"s{finding.step}" if finding.step is not None
                          else f"t{finding.onset_ts:.3f}")
    text = "|".join((job, finding.kind, finding.detector, key,
                     ",".join(map(str, sorted(finding.ranks))),
                     ",".join(sorted(finding.nodes))))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def to_anomaly(job: str, finding: Finding) -> ev.Anomaly:
    return ev.Anomaly(job=job, ts=finding.detected_ts, id=anomaly_id(job, finding),
                      kind=finding.kind, severity=finding.severity,
                      ranks=sorted(finding.ranks), nodes=sorted(finding.nodes),
                      step=finding.step, onset_ts=finding.onset_ts,
                      detected_ts=finding.detected_ts, detector=finding.detector,
                      summary=finding.summary, evidence=finding.evidence)


#: What a stage can feed a detector (a detector's ``CONSUMES`` names some of them):
INPUTS = {
    "step": "a rank's step summary, as it comes",
    "jobstep": "a step closed across the job's ranks (make_jobstep)",
    "late": "a rank's step record that came after its step was closed",
    "hb": "a rank's heartbeat summary",
    "life": "a lifecycle summary (a rank's, or the launcher's with rank null)",
    "gpu": "a machine's GPU sample: ev.Gpu on a NodeStage, its summary on a JobStage",
    "xid": "a machine's ev.Xid (NodeStage)",
    "tick": "advance(now): time passed without input",
    "end": "finish(now): the input ended; decide what waits for more evidence",
}


@dataclass(kw_only=True)
class NoSettings:
    """The ``Config`` of a detector without settings."""


class Detector:
    """Base class: settings, cloning, a readable repr; no-op ``update`` and ``advance``.

    A detector declares its settings once, as its ``Config`` (a ``kw_only`` dataclass of
    :func:`trainguard.setting.setting` fields: default, meaning, range, live or not); the
    constructor takes them as keyword arguments, stores each under its own name and calls
    :meth:`_start` to set up what is learned. (A detector of one's own may instead write
    its own ``__init__``: its arguments are then its parameters.)"""

    #: name used in ``Anomaly.detector`` and as the key of its section, ``detectors.<PREFIX>``
    PREFIX = ""
    #: what the detector consumes, from :data:`INPUTS`; its stage feeds it exactly these
    CONSUMES: tuple = ()
    Config = NoSettings

    def __init__(self, **params):
        self.__dict__.update(vars(self.Config(**params)))
        self._start()

    __init__.from_config = True

    def _start(self) -> None:
        """Set up the learned state, from the settings."""

    def update(self, item) -> list[Finding]:
        return []

    def advance(self, now: float) -> list[Finding]:
        return []

    def retune(self, **params) -> None:
        """Change constructor parameters in place, keeping what was learned (a per-job
        override at runtime, :mod:`trainguard.overrides`); only parameters read when a
        decision is made may change so."""
        for name, value in params.items():
            setattr(self, name, value)
        self._derive()

    def _derive(self) -> None:
        """Recompute what the constructor derived from its parameters."""

    def _get_params(self) -> dict:
        return {n: getattr(self, n) for n in param_names(type(self))}

    def clone(self) -> "Detector":
        """A fresh detector with the same configuration and no learned state."""
        return type(self)(**self._get_params())

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._get_params().items())
        return f"{type(self).__name__}({args})"


def param_names(cls) -> tuple:
    """The settings of detector class ``cls``: its ``Config``'s fields, or the arguments of
    its own ``__init__``."""
    names = cls.__dict__.get("_param_names")
    if names is None:
        if getattr(cls.__init__, "from_config", False):
            names = tuple(f.name for f in dataclasses.fields(cls.Config))
        else:
            names = tuple(n for n in inspect.signature(cls.__init__).parameters
                          if n != "self")
        cls._param_names = names
    return names


def item_kind(item) -> str:
    """``"step"``, ``"hb"``, ``"life"``, ``"jobstep"`` for dicts; ``"gpu"``, ``"xid"`` for events."""
    if type(item) is dict:
        return item.get("k", "")
    return getattr(item, "TYPE", "")


def num(value):
    """A summary number back to a float: the SPEC strings ``"NaN"``/``"Infinity"`` included."""
    if type(value) is str:
        try:
            return float(value)
        except ValueError:
            return None
    return value


def is_finite(value) -> bool:
    return value is not None and value - value == 0


def median(values: list) -> float:
    s = sorted(values)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2


def fmt_ranks(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 8:
        return f"{len(ranks)} ranks ({', '.join(map(str, ranks[:8]))}, ...)"
    return "ranks " + ", ".join(map(str, ranks))


def make_jobstep(step: int, ts: float, *, loss=None, grad_norm=None, compute_time=None,
                 step_time=None, loss_scale=None, tokens=None, nodes=None,
                 job: str = "j") -> dict:
    """A ``jobstep`` item (one closed step of all ranks) from per-rank lists, for examples.

    >>> js = make_jobstep(5, 10.0, loss=[2.0, float("nan")], nodes=["n1", "n1"])
    >>> js["step"], sorted(js["ranks"]), js["ranks"][1]["loss"]
    (5, [0, 1], 'NaN')
    """
    columns = {"loss": loss, "grad_norm": grad_norm, "compute_time": compute_time,
               "step_time": step_time, "loss_scale": loss_scale, "tokens": tokens}
    size = max(len(v) for v in columns.values() if v is not None)
    ranks = {}
    for r in range(size):
        rec = {"k": "step", "job": job, "rank": r, "node": nodes[r] if nodes else f"n{r // 8}",
               "ts": ts, "step": step, "step_time": 1.0}
        for name, column in columns.items():
            if column is not None:
                rec[name] = json_number(column[r])
        ranks[r] = rec
    return {"k": "jobstep", "job": job, "step": step, "ts": ts, "first_ts": ts, "world": size,
            "ranks": ranks}


def json_number(value):
    """Non-finite floats as the SPEC strings, so summaries stay plain JSON."""
    if value is not None and value - value != 0:
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    return value
