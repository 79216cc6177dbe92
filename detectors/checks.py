"""The detector contract as checks anyone can run on a detector, their own included (as
``river.checks`` does for river estimators).

:func:`check_detector` runs every check of :func:`yield_checks` on a detector and raises
``AssertionError`` naming the first broken rule. The rules (docs in :mod:`.base`):

- it declares what it consumes (``CONSUMES``, words of
  :data:`~trainguard.detectors.base.INPUTS`): its stage feeds it that and nothing else, and
  calls ``advance``/``finish`` only when it declares ``tick``/``end``;
- the constructor is the configuration: every argument is stored under its own name, and a
  detector declares its settings once, in its ``Config`` (each with a meaning);
- :meth:`~trainguard.detectors.Detector.clone` gives a fresh detector of equal settings that
  finds the same as a fresh one;
- the same inputs give the same findings (no randomness);
- inputs with every optional field missing or null do not raise;
- findings are :class:`~trainguard.detectors.Finding` objects that make valid SPEC
  anomalies (severity known, evidence plain JSON, onset not after detection);
- given ``round_trip``, a function that stores a detector and gives it back (the stream
  worker's snapshot: ``lambda d: load_state(dump_state(d, 0))`` of
  :mod:`trainguard.streams.snapshots`, with the detector's class in its allowlist), the state
  survives it mid-stream and the restored detector goes on finding exactly the same.

``items`` are what a stage gives its detectors: ``("u", item)`` to ``update`` and
``("a", now)`` to ``advance``; :func:`stage_items` makes them from telemetry events (a
recording, say) the way the stages do. Without items the checks use :func:`bare_items`
(every input kind, optional fields missing). Give items on which the detector finds
something, so that clone and the round trip carry real state.

trainguard's own tests add what needs a test harness (tests/detector_checks.py): the
round trip through the worker's snapshots, no wall clock read in ``update``/``advance``,
and the fingerprints of the state the snapshots store.

>>> from trainguard.detectors import NanDetector
>>> check_detector(NanDetector())
>>> class Forgetful(NanDetector):
...     def __init__(self, window: int = 3):
...         super().__init__()
>>> check_detector(Forgetful())
Traceback (most recent call last):
...
AssertionError: Forgetful: constructor argument 'window' is not stored as self.window
"""
from __future__ import annotations

import copy
import dataclasses
import json
from typing import Callable, Iterator

from trainguard import events as ev

from .base import INPUTS, Detector, Finding, item_kind, to_anomaly

__all__ = ["check_detector", "yield_checks", "round_trip_check", "drive", "stage_items",
           "bare_items", "CHECKS"]

SEVERITIES = ("info", "warning", "critical")


def drive(detector, items) -> list:
    """Feed ``items`` to ``detector`` as a stage does: only the inputs it declares in
    ``CONSUMES`` (all of them when it declares none); returns every finding."""
    consumes = set(getattr(detector, "CONSUMES", ()) or INPUTS)
    found = []
    for op, x in items:
        if op == "u":
            if input_of(x) in consumes:
                found += detector.update(x)
        elif "tick" in consumes:
            found += detector.advance(x)
    return found


def input_of(item) -> str:
    """The :data:`~trainguard.detectors.base.INPUTS` name of a stage item."""
    kind = item_kind(item)
    return "late" if kind == "jobstep" and "late" in item else kind


def stage_items(events, config=None) -> list:
    """What a JobStage's detectors see: ``("u", item)`` for summaries, jobsteps and node
    events, ``("a", now)`` for each advance in event time."""
    from .config import DetectorsConfig
    from .stages import RankStage, StepAggregator

    config = config or DetectorsConfig()
    ranks: dict = {}
    steps = StepAggregator(window=config.stages.step_window,
                           window_s=config.stages.step_window_s)
    out = []
    now = None
    for e in events:
        now = e.ts if now is None or e.ts > now else now
        if e.type in ("gpu", "xid"):
            out.append(("u", e))
        elif e.type in ("step", "heartbeat", "lifecycle") and e.rank is not None:
            stage = ranks.setdefault(e.rank, RankStage(config))
            for summary in stage.update(e):
                out.append(("u", summary))
                if summary["k"] == "step":
                    out += [("u", js) for js in steps.add(summary)]
                elif summary["k"] == "life":
                    steps.life(summary)
        out += [("u", js) for js in steps.expire(now)]
        if not out or out[-1] != ("a", now):
            out.append(("a", now))
    return out


def bare_items() -> list:
    """Every input kind with all optional fields missing or null (three ranks, 40 steps, a
    machine losing a GPU, Xids, exits, an unknown item kind)."""
    items = []
    for s in range(40):
        for r in range(3):
            items.append(("u", {"k": "step", "job": "j", "rank": r, "node": None,
                                "ts": 10.0 + s, "step": s, "step_time": 0.5}))
        items.append(("u", {"k": "jobstep", "job": "j", "step": s, "ts": 10.0 + s,
                            "first_ts": 10.0 + s, "world": 3,
                            "ranks": {r: {"k": "step", "job": "j", "rank": r, "ts": 10.0 + s,
                                          "step": s, "step_time": 0.5, "compute_time": None,
                                          "loss": None, "grad_norm": None}
                                      for r in range(3)}}))
        items.append(("u", {"k": "hb", "job": "j", "rank": 0, "ts": 10.5 + s, "step": None,
                            "phase": "forward", "phase_since": None}))
        items.append(("u", ev.Gpu(job="j", ts=10.0 + s, gpus=[{"index": 0, "uuid": "G"}])))
        items.append(("u", ev.Gpu(job="j", ts=10.0 + s, node="n1",
                                  gpus=[{"index": 0, "uuid": "G"}, {"index": 1, "uuid": "H"}]
                                  if s < 20 else [{"index": 0, "uuid": "G"}])))
        items.append(("u", ev.Gpu(job="j", ts=10.2 + s, node="n1", gpus=[],
                                  status="unavailable", reason="no NVML")))
        items.append(("a", 10.9 + s))
    items.append(("u", ev.Xid(job="j", ts=60.0, xid=79, source="kmsg", message="")))
    items.append(("u", ev.Xid(job="j", ts=60.0, node="n1", xid=48, source="nvml", message="")))
    items.append(("u", {"k": "life", "job": "j", "rank": 1, "ts": 61.0, "event": "exit"}))
    items.append(("u", {"k": "life", "job": "j", "rank": None, "ts": 61.0, "event": "exit",
                        "exit_code": 3}))
    items.append(("u", {"k": "life", "job": "j", "rank": 2, "ts": 62.0, "event": "start"}))
    items.append(("u", {"k": "whatever", "ts": 63.0}))
    items.append(("a", 500.0))
    return items


def _name(detector) -> str:
    return type(detector).__name__


def _params(detector) -> dict:
    from .base import param_names

    names = param_names(type(detector))
    return {n: getattr(detector, n) for n in names if hasattr(detector, n)}


def _fresh(detector):
    """A new detector of the same settings, not by ``clone`` (whose rules are checked)."""
    return type(detector)(**_params(detector))


def _as_dicts(findings) -> list:
    return [dataclasses.asdict(f) if dataclasses.is_dataclass(f) else f for f in findings]


# ------------------------------------------------------------------ the checks
def check_declared_inputs(detector, items) -> None:
    """It declares what it consumes (its stage feeds nothing else), in known words, and
    declares ``tick``/``end`` exactly when it has ``advance``/``finish``."""
    consumes = getattr(detector, "CONSUMES", ())
    assert consumes, f"{_name(detector)}: CONSUMES is empty: no stage would feed it"
    unknown = sorted(set(consumes) - set(INPUTS))
    assert not unknown, f"{_name(detector)}: CONSUMES names unknown inputs {unknown}"
    timed = type(detector).advance.__qualname__ != Detector.advance.__qualname__
    assert timed == ("tick" in consumes), (
        f"{_name(detector)}: " + ("advance() without 'tick' in CONSUMES: never called" if timed
                                  else "'tick' in CONSUMES without an advance()"))
    ends = callable(getattr(detector, "finish", None))
    assert ends == ("end" in consumes), (
        f"{_name(detector)}: " + ("finish() without 'end' in CONSUMES: never called" if ends
                                  else "'end' in CONSUMES without a finish(now)"))


def check_params(detector, items) -> None:
    from .base import param_names

    for name in param_names(type(detector)):
        assert hasattr(detector, name), (
            f"{_name(detector)}: constructor argument {name!r} is not stored as self.{name}")


def check_config_defaults(detector, items) -> None:
    """A detector's ``Config`` (its settings, the one place of their defaults) gives each
    setting a meaning, and a default detector has those defaults."""
    cls = type(detector)
    if not getattr(cls.__init__, "from_config", False):
        return  # a user's own detector with its own constructor
    for f in dataclasses.fields(cls.Config):
        assert f.metadata.get("help"), (
            f"{cls.__name__}.Config.{f.name} has no meaning: declare it with setting()")
    defaults = dataclasses.asdict(cls.Config())
    assert cls()._get_params() == defaults, f"{cls.__name__}: defaults differ from its Config"


def check_clone(detector, items) -> None:
    trained = _fresh(detector)
    drive(trained, items)
    clone = trained.clone()
    assert type(clone) is type(detector), f"{_name(detector)}: clone() changed the type"
    assert _params(clone) == _params(trained), f"{_name(detector)}: clone() changed settings"
    assert repr(clone) == repr(trained), f"{_name(detector)}: clone's repr differs"
    assert _as_dicts(drive(clone, items)) == _as_dicts(drive(_fresh(detector), items)), (
        f"{_name(detector)}: a clone of a trained detector kept learned state")


def round_trip_check(round_trip: Callable) -> Callable:
    """The check that a detector stored and given back by ``round_trip`` mid-stream goes on
    finding exactly what it would have found."""
    def check_round_trip_mid_stream(detector, items) -> None:
        expected = _as_dicts(drive(_fresh(detector), items))
        for cut in (len(items) // 3, 2 * len(items) // 3):
            d = _fresh(detector)
            before = drive(d, items[:cut])
            try:
                restored = round_trip(d)
            except Exception as exc:
                raise AssertionError(f"{_name(detector)}: its state does not survive the round "
                                     f"trip: {type(exc).__name__}: {exc}") from None
            assert _as_dicts(before + drive(restored, items[cut:])) == expected, (
                f"{_name(detector)}: restored after {cut} items, it finds something else")
    return check_round_trip_mid_stream


def check_deterministic(detector, items) -> None:
    first = _as_dicts(drive(_fresh(detector), items))
    assert first == _as_dicts(drive(_fresh(detector), items)), (
        f"{_name(detector)}: the same inputs gave other findings")


def check_missing_optional_fields(detector, items) -> None:
    drive(_fresh(detector), bare_items())


def check_findings(detector, items) -> None:
    for f in drive(_fresh(detector), items) + drive(_fresh(detector), bare_items()):
        assert isinstance(f, Finding), f"{_name(detector)}: found a {type(f).__name__}"
        assert f.severity in SEVERITIES, f"{_name(detector)}: severity {f.severity!r}"
        assert f.onset_ts <= f.detected_ts, f"{_name(detector)}: onset after detection"
        json.dumps(f.evidence, allow_nan=False)
        ev.decode(ev.encode(to_anomaly("j", f)))


CHECKS = (check_declared_inputs, check_params, check_config_defaults, check_clone,
          check_deterministic, check_missing_optional_fields, check_findings)


def yield_checks(detector, round_trip: Callable | None = None) -> Iterator[Callable]:
    """Each check, a function ``(detector, items) -> None`` raising ``AssertionError``."""
    yield from CHECKS
    if round_trip is not None:
        yield round_trip_check(round_trip)


def check_detector(detector, items=None, round_trip: Callable | None = None) -> None:
    """Run every check on ``detector`` (its settings; it is not changed) over ``items``;
    with ``round_trip``, the round trip of its state mid-stream too."""
    items = list(items) if items is not None else bare_items()
    detector = copy.deepcopy(detector)
    for check in yield_checks(detector, round_trip):
        check(detector, items)
