"""The sections of the configuration tree, and what each becomes for its component.

Sections are derived, not re-declared: every key is a field of the ``Config`` dataclass of
the component that owns its section, a ``kw_only`` dataclass of
:func:`~trainguard.setting.setting` declarations (default, meaning, range, live or not):
``kafka`` is :class:`~trainguard.kafka_settings.KafkaSettings`, ``security``
:class:`~trainguard.signing.SecuritySettings`, ``topics``
:class:`~trainguard.topics.TopicsSettings`, ``worker``
:class:`~trainguard.streams.settings.WorkerSettings`, ``detectors``
:class:`~trainguard.detectors.DetectorsConfig` (which nests each detector's own ``Config``),
``policy`` :class:`~trainguard.actions.policy.Policy`, ``alerts`` and ``driver`` the tables
of :class:`ServiceTables`, ``collector`` and ``agent``
:class:`~trainguard.collectors.settings.CollectorConfig` and ``AgentConfig``. So a default
is written once, in its component. The root, ``TrainguardConfig`` (:func:`root_class`), nests
them all, and it is the one thing walked: the keys of the loader, of the environment and flag
layers, of ``config show|check|docs`` and the live keys of runtime overrides are its settings
(:func:`keys_of`); :func:`root` builds it from a tree and checks it with
:func:`~trainguard.setting.validate` (:func:`check_tree`). A command loads only the sections
it reads (``load(sections=...)``): the same root restricted to them, so that it imports only
their rooms. The adapters below (:func:`kafka_config`, :func:`detector_config`,
:func:`worker_settings`, :func:`service_config`, ...) build the settings objects the
components take.

>>> tree = load(environ={"TRAINGUARD_DETECTORS__HANG__FLOOR_S": "45"})
>>> detector_config(tree).hang.floor_s, tree.source("detectors.hang.floor_s")
(45.0, 'env TRAINGUARD_DETECTORS__HANG__FLOOR_S')
>>> config = root(tree)
>>> type(config).__name__, config.detectors.hang.floor_s, config.topics.prefix
('TrainguardConfig', 45.0, 'tg')
"""
from __future__ import annotations

import dataclasses
import sys
from functools import lru_cache
from typing import Any, Mapping

from .config import Config, ConfigError, Topics, check_client_settings, load_client_settings
from .configtree import Key, Tree, env_name, read_toml, resolve
from .errors import UserError
from .fields import AnyObject, Bool, Int, ListOf, Nullable, Num, Str
from .setting import table, validate, walk

__all__ = ["all_keys", "keys_of", "load", "root", "root_class", "section", "section_class",
           "kafka_config", "topic_plan", "detector_config", "worker_settings",
           "policy_config", "service_config", "collector_kwargs", "signing_key", "check_tree",
           "SECTIONS", "COMMAND_FLAGS", "KAFKA_FLAGS"]

SECTIONS = ("kafka", "security", "topics", "worker", "detectors", "policy", "alerts", "driver",
            "collector", "agent")

#: argparse destination -> key, for the flags every Kafka command has ...
KAFKA_FLAGS = {"bootstrap": "kafka.bootstrap", "prefix": "topics.prefix",
               "kafka_config": "kafka.client_config"}
#: ... and per command
COMMAND_FLAGS = {
    "topics": {"partitions": "topics.other_partitions",
               "telemetry_partitions": "topics.telemetry_partitions"},
    "worker": {"web_port": "worker.web_port", "web_bind": "worker.web_bind",
               "data_dir": "worker.data_dir", "id": "worker.worker_id",
               "loglevel": "worker.loglevel", "evict_idle_s": "worker.evict_idle_s",
               "max_live_jobs": "worker.max_live_jobs",
               "max_live_ranks": "worker.max_live_ranks"},
    "actions": {"dry_run": "policy.dry_run"},
    "up": {"dry_run": "policy.dry_run"},
    "run": {"instrument": "collector.instrument"},
    "agent": {"node": "agent.node", "job": "agent.job", "interval": "agent.interval",
              "kmsg_extra": "agent.kmsg_extra", "runtime_dir": "agent.runtime_dir",
              "native": "agent.native"},
}


# -- derivation: every key is a field of the root -------------------------------------------

def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def from_dataclass(cls) -> list[Key]:
    """The keys of a ``Config`` dataclass (the root, :func:`root_class`): its
    :func:`~trainguard.setting.setting` fields, nested ``Config`` objects walked into, with
    their metadata."""
    return [Key(path=path, default=_plain(default), check=checker_of(f, default),
                help=f.metadata["help"], env=f.metadata.get("env"),
                secret=f.metadata.get("secret", False), live=f.metadata.get("live"))
            for path, f, default in walk(cls)]


def checker_of(f: dataclasses.Field, default) -> Any:
    """The checker of a :func:`~trainguard.setting.setting` field, from its metadata (the
    rest of its range, an open bound's end, a float's maximum or a bound between siblings,
    is :func:`~trainguard.setting.validate`'s)."""
    meta = f.metadata
    kind = meta.get("kind")
    bounds = meta["bounds"]
    if kind is bool:
        inner = Bool()
    elif kind is int:
        inner = Int(minimum=None if bounds.lo is None else
                    int(bounds.lo) + 1 if bounds.lo_open else bounds.lo, maximum=bounds.hi)
    elif kind is float:
        inner = Num(minimum=bounds.lo)
    elif kind is str:
        inner = Str(enum=meta["choices"] or None, pattern=meta.get("pattern"),
                    min_length=meta.get("min_length", 0))
    elif kind in (list, tuple):
        inner = ListOf(Str(enum=list(meta["choices"]) if meta["choices"] else None))
    else:
        inner = AnyObject()
    return Nullable(inner) if default is None else inner


# -- the sections: each one a component's own Config ------------------------------------------
# (a function each, importing its room only when the section is wanted)

def _kafka():
    from .kafka_settings import KafkaSettings

    return KafkaSettings


def _security():
    from .signing import SecuritySettings

    return SecuritySettings


def _topics():
    from .topics import TopicsSettings

    return TopicsSettings


def _worker():
    from .streams.settings import WorkerSettings

    return WorkerSettings


def _detectors():
    from .detectors import DetectorsConfig

    return DetectorsConfig


def _policy():
    from .actions.policy import Policy

    return Policy


@dataclasses.dataclass(kw_only=True)
class ServiceTables:
    """The action service's free-form tables, taken whole from the file."""

    alerts: dict = table("alert sinks: name -> table (docs/ALERTS.md); secrets as X_env or "
                         "X_file")
    driver: dict = table("scheduler driver: type = \"slurm\" or \"kubernetes\" and its "
                         "settings (docs/DRIVERS.md); empty: orders go to `trainguard run`")


def _collector():
    from .collectors.settings import CollectorConfig

    return CollectorConfig


def _agent():
    from .collectors.settings import AgentConfig

    return AgentConfig


#: section -> its ``Config`` class (None: a table of :class:`ServiceTables`), in the order
#: of the tree
_SECTIONS = {"kafka": _kafka, "security": _security, "topics": _topics, "worker": _worker,
             "detectors": _detectors, "policy": _policy, "alerts": None, "driver": None,
             "collector": _collector, "agent": _agent}
#: sections loaded with another's (a command that reads ``kafka`` may sign)
_GROUPS = {"kafka": ("kafka", "security"), "alerts": ("alerts", "driver")}
#: keys of the ``collector`` section that are not arguments of :func:`trainguard.init`
_NOT_INIT = ("instrument",)


def _loaded(sections) -> tuple[str, ...]:
    """``sections`` (None: all) with those loaded with them, in the order of the tree."""
    if sections is None:
        return SECTIONS
    wanted = {member for s in sections for member in _GROUPS.get(s, (s,))}
    return tuple(s for s in SECTIONS if s in wanted)


def root_class(sections: tuple[str, ...] | None = None):
    """``TrainguardConfig``: the whole configuration tree, one field per section, each the
    ``Config`` dataclass of the component that owns it (:func:`root` makes one of a tree).
    ``sections``: the same root restricted to those (with those loaded with them), so that
    a command imports only the rooms it reads; the whole root imports every room."""
    return _root_class(_loaded(sections))


@lru_cache(maxsize=None)
def _root_class(names: tuple[str, ...]):
    fields = []
    for name in names:
        builder = _SECTIONS[name]
        if builder is None:
            f = next(f for f in dataclasses.fields(ServiceTables) if f.name == name)
            fields.append((name, dict, dataclasses.field(default_factory=dict,
                                                         metadata=f.metadata)))
        else:
            cls = builder()
            fields.append((name, cls, dataclasses.field(default_factory=cls)))
    root = dataclasses.make_dataclass("TrainguardConfig", fields, kw_only=True)
    root.__module__ = __name__
    root.__doc__ = root_class.__doc__.split("(:func:")[0].strip()
    return root


def keys_of(sections: tuple[str, ...] | None = None) -> tuple[Key, ...]:
    """The keys of the tree (those of ``sections`` only, when given): the settings of
    :func:`root_class`, walked. The loader, the environment and flag layers, ``config
    show|check|docs`` and the live keys of runtime overrides all take them from here."""
    return _keys_of(_loaded(sections))


@lru_cache(maxsize=None)
def _keys_of(names: tuple[str, ...]) -> tuple[Key, ...]:
    return tuple(from_dataclass(_root_class(names)))


def all_keys() -> tuple[Key, ...]:
    return keys_of()


def load(config_file: str | None = None, environ: Mapping[str, str] | None = None,
         flags: Mapping[str, tuple] | None = None, sections: tuple[str, ...] | None = None
         ) -> Tree:
    """The tree from ``config_file`` (else ``TRAINGUARD_CONFIG``), the environment, flags.

    ``sections`` (default: all) limits what is declared and checked; the file's other
    sections are then left to ``trainguard config check`` (importing every component takes
    a second a short-lived command need not spend)."""
    from .configlegacy import RENAMED, upgrade

    environ = {} if environ is None else environ
    config_file = config_file or environ.get("TRAINGUARD_CONFIG") or None
    data = read_toml(config_file) if config_file else None
    if data:
        data, line = upgrade(data, str(config_file),
                             lambda: [k.path for k in keys_of(("detectors",))])
        if line:
            print(line, file=sys.stderr)
    renamed = {env_name(old): env_name(new) for old, new in RENAMED.items()}
    if any(var in environ for var in renamed):
        print(f"trainguard: warning: deprecated variables: "
              f"{', '.join(f'{v} -> {renamed[v]}' for v in renamed if v in environ)}",
              file=sys.stderr)
        environ = {renamed.get(var, var): text for var, text in environ.items()}
    keys = keys_of(sections)
    if sections is not None:
        loaded = _loaded(sections)
        if data:
            data = {k: v for k, v in data.items() if k in loaded or k not in SECTIONS}
        environ = {var: text for var, text in environ.items()
                   if "__" not in var or var[len("TRAINGUARD_"):].split("__")[0].lower()
                   in loaded}
    return resolve(keys, file_data=data, file_name=str(config_file or ""),
                   environ=environ, flags=flags)


def section_class(section: str):
    """The ``kw_only`` ``Config`` dataclass of one section (``worker``, ``detectors.hang``):
    its field's in the root."""
    cls = root_class((section.split(".")[0],))
    for name in section.split("."):
        cls = next(f for f in dataclasses.fields(cls) if f.name == name).default_factory
    return cls


# -- adapters: the settings objects the components take ------------------------------------

def kafka_config(tree: Tree) -> Config:
    path = tree.value("kafka.client_config")
    settings = load_client_settings(path) if path else {}
    settings.update({str(k): str(v) for k, v in tree.value("kafka.client").items()})
    if settings:
        check_client_settings(settings, path or "kafka.client")
    try:
        return Config(bootstrap=tree.value("kafka.bootstrap"),
                      topics=Topics(prefix=tree.value("topics.prefix")),
                      client_settings=settings)
    except ConfigError as exc:
        raise ConfigError(f"kafka.bootstrap = {tree.value('kafka.bootstrap')!r} (set in "
                          f"{tree.source('kafka.bootstrap')}): {exc}") from None


def topic_plan(tree: Tree):
    from .topics import TopicPlan

    return TopicPlan(**{k: v for k, v in tree.section("topics").items() if k != "prefix"})


def nested(tree: Tree, prefix: str = "") -> dict:
    """The values under ``prefix`` (default: all) as nested tables: ``{"hang": {"floor_s":
    20.0, ...}}``."""
    start = prefix + "." if prefix else ""
    out: dict = {}
    for path, (value, _) in tree.values.items():
        if path.startswith(start):
            *parents, name = path[len(start):].split(".")
            table = out
            for parent in parents:
                table = table.setdefault(parent, {})
            table[name] = value
    return out


def build_config(cls, values: dict):
    """An instance of the ``Config`` class ``cls`` from nested tables of values."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        nested_cls = f.default_factory if f.default_factory is not dataclasses.MISSING \
            else None
        value = values[f.name]
        if dataclasses.is_dataclass(nested_cls) and isinstance(value, dict):
            value = build_config(nested_cls, value)
        kwargs[f.name] = value
    return cls(**kwargs)


def section(tree: Tree, name: str):
    """Section ``name`` of the tree as that component's ``Config`` (its field of the root)."""
    return build_config(section_class(name), nested(tree, name))


def detector_config(tree: Tree):
    """The :class:`~trainguard.detectors.DetectorsConfig` of the ``detectors`` section."""
    return section(tree, "detectors")


def worker_settings(tree: Tree):
    """The ``worker`` section, with the topics' prefix and the data folder filled in."""
    from .broker import trainguard_home

    values = nested(tree, "worker")
    if values.get("data_dir") is None:
        values["data_dir"] = str(trainguard_home() / "worker")
    return build_config(section_class("worker"),
                        {**values, "prefix": tree.value("topics.prefix")})


def _policy_dict(tree: Tree) -> dict:
    out: dict = {}
    for path in tree.keys:
        if path.startswith("policy.") and tree.source(path) != "default":
            *parents, name = path.split(".")[1:]
            table = out
            for parent in parents:
                table = table.setdefault(parent, {})
            table[name] = tree.value(path)
    return out


def policy_config(tree: Tree, from_file=None):
    """The :class:`~trainguard.actions.policy.Policy` of the ``policy`` section, with what
    the Policy ``from_file`` (a JSON ``--policy FILE``) changes over it."""
    from .actions.policy import Policy

    data = _policy_dict(tree)
    if from_file is not None:
        data = _merge(data, _changed(from_file.to_dict(), Policy().to_dict()))
    try:
        return Policy.from_dict(data)
    except UserError as exc:          # a PolicyError names the key: policy.limits....
        raise ConfigError(str(exc)) from None


def service_config(tree: Tree, policy_file: str | None = None):
    """``(Policy, alerts, driver)`` for the action service: the tree's ``policy``, ``alerts``
    and ``driver``; a JSON ``--policy FILE`` still counts, over the tree."""
    from .actions.service import load_service_config

    alerts, driver = dict(tree.value("alerts")), dict(tree.value("driver"))
    from_file = None
    if policy_file:
        print(f"trainguard: warning: --policy {policy_file} (JSON) is deprecated: write its "
              "settings in the config file's [policy], [alerts] and [driver] tables",
              file=sys.stderr)
        from_file, file_alerts, file_driver = load_service_config(policy_file)
        alerts, driver = {**alerts, **file_alerts}, {**driver, **file_driver}
    return policy_config(tree, from_file), alerts, driver


def _changed(values: dict, defaults: dict) -> dict:
    out = {}
    for k, v in values.items():
        if isinstance(v, dict) and isinstance(defaults.get(k), dict) and k != "ladder":
            sub = _changed(v, defaults[k])
            if sub:
                out[k] = sub
        elif v != defaults.get(k):
            out[k] = v
    return out


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) \
            and k != "ladder" else v
    return out


def collector_kwargs(tree: Tree) -> dict:
    """Keyword arguments of :func:`trainguard.init` from the ``collector`` section."""
    return {k: v for k, v in tree.section("collector").items() if k not in _NOT_INIT}


def signing_key(tree: Tree) -> str | None:
    """The shared key of signed orders and commands (``security.signing_key``), or None."""
    return tree.value("security.signing_key")


def root(tree: Tree):
    """The :func:`root_class` (``TrainguardConfig``) of the tree's sections, each built by
    its component's own ``Config`` class, then checked as one
    (:func:`~trainguard.setting.validate`). The ``worker`` section takes ``topics.prefix``."""
    names = tuple(dict.fromkeys(path.split(".")[0] for path in tree.keys))
    values = nested(tree)
    if "worker" in values:
        values["worker"] = worker_settings(tree)
    if "policy" in values:
        values["policy"] = policy_config(tree)
    config = build_config(root_class(names), values)
    validate(config)
    return config


def check_tree(tree: Tree, environ: Mapping[str, str] | None = None) -> None:
    """Build every component's settings once, so that their own checks run too."""
    kafka_config(tree)
    config = root(tree)
    alerts, driver = config.alerts, config.driver
    if alerts:
        from .actions.alerts import build_sinks

        build_sinks(alerts, environ or {})
    if driver:
        _check_driver(driver)


def _check_driver(driver: dict) -> None:
    from .actions.drivers import DRIVER_TYPES

    if driver.get("type") not in DRIVER_TYPES:
        raise ConfigError(f"driver.type = {driver.get('type')!r}: must be one of "
                          f"{', '.join(sorted(DRIVER_TYPES))}")
