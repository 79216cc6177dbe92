"""Where detectors are declared: one registration per detector, next to its code.

A detector is one file. Its class carries :func:`register_detector`, which declares what the
rest of trainguard needs to know of it:

- ``kinds``: the anomaly kinds it emits (``Finding.kind``);
- ``ladder``: each kind's default steps on the action ladder (``policy.ladder``,
  docs/POLICY.md), the first the lowest rung: ``("alert",)`` for a warning;
- ``priority``: each kind's rank as a root cause when anomalies are correlated into one
  incident (lower: more fundamental; None: never the root of another's incident);
- ``causes``: the kinds its anomalies may cause, and where (anywhere in the job, on a shared
  rank or machine, on the same rank), which join the cause's incident;
- ``stage``: ``"job"`` (a :class:`~.stages.JobStage` runs it, the default) or ``"node"`` (a
  :class:`~.stages.NodeStage`, per machine, on the raw ``gpu`` and ``xid`` events).

What it consumes (``CONSUMES``, from :data:`~.base.INPUTS`) and its settings (``Config``, a
``kw_only`` dataclass of :func:`trainguard.setting.setting` fields) are its class attributes;
the registration reads them. From the registrations come :data:`~.config.DETECTORS`, the
``detectors`` configuration section (:class:`~.config.DetectorsConfig`, so ``trainguard
config show|docs`` and docs/CONFIG.md), the correlation's :data:`~.correlate.PRIORITY` and
:data:`~.correlate.CONSEQUENCES`, the
action policy's ``DEFAULT_LADDER``, and the classes a worker's snapshot may hold
(:func:`trainguard.streams.snapshots.state_allowlist`). The kinds of the built-in detectors
are the contract's (``trainguard.events.ANOMALY_KINDS``, the shipped schemas): a test holds
them equal. A plug-in's kinds are an extension (docs/CONTRACT.md, "Anomaly kinds of plug-in
detectors"), accepted by the process that loaded it (:func:`trainguard.events.allow_anomaly_kinds`).

A plug-in detector lives outside the package: a module that registers its classes when
imported, loaded with ``trainguard analyze --detector-module MODULE`` or through the entry-point
group ``trainguard.detectors`` (docs/DETECTORS.md).

>>> [r.cls.__name__ for r in registrations()][:3]
['NanDetector', 'LossSpikeDetector', 'GradSpikeDetector']
>>> r = registration_of("hang")
>>> r.kinds, r.ladder["hang"], r.consumes
(('hang',), ('capture', 'evict_suspects', 'restart', 'alert'), ('step', 'hb', 'life', 'tick'))
>>> priority()[:3]
('gpu_fault', 'nan', 'crash')
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .base import Detector, Finding

__all__ = ["Registration", "register_detector", "registrations", "registration_of",
           "detector_classes", "anomaly_kinds", "default_ladder", "priority", "priority_ranks",
           "consequences", "plugins",
           "load_detector_modules", "ENTRY_POINT_GROUP", "BUILTIN_MODULES", "Detector",
           "Finding"]

#: The modules of the built-in detectors, in the order their detectors run. A new built-in
#: detector's module is added here (the one line outside its own file).
BUILTIN_MODULES = ("training", "straggler", "timing", "hang", "liveness", "gpu", "data_position",
                   "machine_outlier")
#: the entry-point group of plug-in detectors (``[project.entry-points."trainguard.detectors"]``)
ENTRY_POINT_GROUP = "trainguard.detectors"
STAGES = ("job", "node")
#: how a cause's anomaly explains its effect's: anywhere in the job, on a rank or machine
#: they share, on the same rank only
HOW = ("any", "shared", "same_rank")


@dataclass(frozen=True)
class Registration:
    """What one detector class declares (:func:`register_detector`)."""

    cls: type
    kinds: tuple
    ladder: dict
    priority: dict
    causes: dict = field(default_factory=dict)
    stage: str = "job"
    builtin: bool = field(default=False, compare=False)

    @property
    def consumes(self) -> tuple:
        return tuple(self.cls.CONSUMES)

    @property
    def config(self) -> type:
        return self.cls.Config

    @property
    def prefix(self) -> str:
        return self.cls.PREFIX


_REGISTERED: list[Registration] = []
#: cause kind -> {effect kind: how}; filled as detectors register (:func:`consequences`)
_CONSEQUENCES: dict = {}
#: kind -> its place in :func:`priority`; kept current likewise (:func:`priority_ranks`)
_RANKS: dict = {}
_builtins_loaded = False


def register_detector(*, kinds, ladder, priority=None, causes=None, stage: str = "job"):
    """The class decorator that registers a detector (see the module's text).

    ``kinds``: a kind or a tuple of kinds; ``ladder``: the steps of each kind, a tuple (for
    every kind) or ``{kind: steps}``; ``priority``: a number (every kind) or ``{kind:
    number}``, None for none; ``causes``: ``{effect kind: how}`` (for every kind, or
    ``{kind: {effect kind: how}}``), the anomalies it may cause, which then join its incident:
    ``"any"`` anywhere in the job, ``"shared"`` on a rank or machine they share,
    ``"same_rank"`` on the same rank only. Raises ValueError on a declaration that cannot be
    right."""
    kinds = (kinds,) if isinstance(kinds, str) else tuple(kinds)

    def per_kind(value, what) -> dict:
        table = value if isinstance(value, dict) else {k: value for k in kinds}
        if set(table) - set(kinds):
            raise ValueError(f"{what} names kinds {sorted(set(table) - set(kinds))} the "
                             f"detector does not declare")
        return table

    def register(cls):
        name = cls.__name__
        if not kinds or not all(isinstance(k, str) and k.isidentifier() and k.islower()
                                for k in kinds):
            raise ValueError(f"{name}: kinds must be lower-case names, got {kinds!r}")
        if not getattr(cls, "PREFIX", ""):
            raise ValueError(f"{name}: set PREFIX, its name in anomalies and configuration")
        if stage not in STAGES:
            raise ValueError(f"{name}: stage must be one of {STAGES}, got {stage!r}")
        steps = per_kind(ladder, "ladder")
        if set(steps) != set(kinds) or any(isinstance(v, str) or not v or not all(
                isinstance(s, str) for s in v) for v in steps.values()):
            raise ValueError(f"{name}: give the ladder (a tuple of steps) of each of its "
                             f"kinds {list(kinds)}")
        ladders = {k: tuple(steps[k]) for k in kinds}
        ranks = {k: v for k, v in per_kind(priority, "priority").items() if v is not None}
        per_cause = causes or {}
        if not all(k in kinds and isinstance(v, dict) for k, v in per_cause.items()):
            per_cause = {k: per_cause for k in kinds}
        if any(how not in HOW or not isinstance(effect, str)
               for table in per_cause.values() for effect, how in table.items()):
            raise ValueError(f"{name}: causes maps effect kinds to one of {HOW}")
        entry = Registration(cls=cls, kinds=kinds, ladder=ladders, priority=ranks,
                             causes={k: dict(v) for k, v in per_cause.items()}, stage=stage,
                             builtin=cls.__module__.startswith(__package__ + "."))
        for other in _REGISTERED:
            if other.cls.__qualname__ == cls.__qualname__ and \
                    other.cls.__module__ == cls.__module__:
                _REGISTERED.remove(other)      # the same module imported again
                break
        clash = [(o.cls.__name__, k) for o in _REGISTERED for k in o.kinds if k in kinds]
        clash += [(o.cls.__name__, f"PREFIX {cls.PREFIX!r}") for o in _REGISTERED
                  if o.prefix == cls.PREFIX]
        if clash:
            raise ValueError(f"{name}: {clash[0][1]} is already {clash[0][0]}'s")
        _REGISTERED.append(entry)
        _CONSEQUENCES.update(entry.causes)
        _RANKS.clear()
        _RANKS.update({k: i for i, k in enumerate(_by_priority(_REGISTERED))})
        cls.REGISTRATION = entry
        if not entry.builtin:
            from trainguard import events

            events.allow_anomaly_kinds(kinds)
        return cls

    return register


def _load_builtins() -> None:
    """Import the built-in detectors' modules, then the plug-ins of the entry-point group
    (once a process; first thing the registrations are read, so that a plug-in installed so
    has its section in the configuration like a built-in detector)."""
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        for name in BUILTIN_MODULES:
            importlib.import_module(f"{__package__}.{name}")
        _load_entry_points()


def _group_declared() -> bool:
    """Whether an installed distribution on ``sys.path`` may declare the group: a glance at
    their ``entry_points.txt`` files (a few ms), before ``importlib.metadata`` parses them
    all (some 40 ms, which every command that imports the detectors would pay)."""
    marker = f"[{ENTRY_POINT_GROUP}]"
    for folder in sys.path:
        try:
            names = os.listdir(folder or ".")
        except OSError:
            continue
        for name in names:
            if name.endswith((".dist-info", ".egg-info")):
                try:
                    with open(os.path.join(folder or ".", name, "entry_points.txt")) as f:
                        if marker in f.read():
                            return True
                except OSError:
                    continue
    return False


def _load_entry_points() -> list:
    from importlib.metadata import entry_points

    modules = []
    if not _group_declared():
        return modules
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            modules.append(importlib.import_module(ep.value.partition(":")[0].strip()))
        except Exception as exc:
            raise ImportError(f"the plug-in detector {ep.name} = {ep.value!r} (entry point "
                              f"group {ENTRY_POINT_GROUP}) fails to load: {exc}") from exc
    return modules


def registrations(builtin_only: bool = False) -> tuple[Registration, ...]:
    """Every registered detector: the built-in ones in :data:`BUILTIN_MODULES` order (in the
    order of their classes in a module), then the plug-ins in the order they were loaded."""
    _load_builtins()
    builtin = [r for r in _REGISTERED if r.builtin]
    order = {name: i for i, name in enumerate(BUILTIN_MODULES)}
    builtin.sort(key=lambda r: order.get(r.cls.__module__.rpartition(".")[2], len(order)))
    if builtin_only:
        return tuple(builtin)
    return (*builtin, *(r for r in _REGISTERED if not r.builtin))


def registration_of(prefix: str) -> Registration:
    return next(r for r in registrations() if r.prefix == prefix)


def detector_classes(stage: str | None = None, builtin_only: bool = False) -> tuple:
    return tuple(r.cls for r in registrations(builtin_only)
                 if stage is None or r.stage == stage)


def plugins(stage: str) -> tuple:
    """The plug-in detector classes of ``stage``, in the order they were loaded."""
    return tuple(r.cls for r in registrations() if not r.builtin and r.stage == stage)


def anomaly_kinds(builtin_only: bool = False) -> tuple:
    return tuple(k for r in registrations(builtin_only) for k in r.kinds)


def default_ladder(builtin_only: bool = False) -> dict:
    """``{kind: steps}``: each registered kind's default ladder."""
    return {k: v for r in registrations(builtin_only) for k, v in r.ladder.items()}


def priority(builtin_only: bool = False) -> tuple:
    """The kinds that have a priority as an incident's root cause, most fundamental first."""
    return _by_priority(registrations(builtin_only))


def _by_priority(entries) -> tuple:
    ranked = [(rank, k) for r in entries for k, rank in r.priority.items()]
    return tuple(k for _, k in sorted(ranked, key=lambda pair: pair[0]))


def priority_ranks() -> dict:
    """``{kind: place in priority()}``: the same dict each time, kept current as detectors
    register (a kind without a priority has none: it ranks after all of them)."""
    _load_builtins()
    return _RANKS


def consequences() -> dict:
    """``{cause kind: {effect kind: how}}`` of every registration (``causes=``). The same
    dict each time, which a detector registered later (a plug-in) extends."""
    _load_builtins()
    return _CONSEQUENCES


def load_detector_modules(names) -> list:
    """Import plug-in detector modules, whose import registers their detectors: each of
    ``names`` is an importable module name or the path of a ``.py`` file. Returns the
    modules; raises ImportError naming a module that fails."""
    _load_builtins()
    modules = []
    for name in names:
        path = Path(name)
        if not name.endswith(".py"):
            modules.append(importlib.import_module(name))
            continue
        if not path.is_file():
            raise ImportError(f"detector module {name}: no such file")
        module_name = path.stem
        known = sys.modules.get(module_name)
        if known is not None and \
                Path(getattr(known, "__file__", None) or "").resolve() == path.resolve():
            modules.append(known)
            continue
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
        modules.append(module)
    return modules
