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
them all; :func:`root` builds it from a tree, so that every component's own checks run
(:func:`check_tree`). A command loads only the sections it reads (``load(sections=...)``),
and imports only their rooms; the adapters below (:func:`kafka_config`,
:func:`detector_config`, :func:`worker_settings`, :func:`service_config`, ...) build the
settings objects the components take.

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

__all__ = ["all_keys", "keys_of", "load", "root", "root_class", "section_class", "kafka_config",
           "topic_plan",
           "detector_config", "worker_settings", "service_config", "collector_kwargs",
           "signing_key", "check_tree", "SECTIONS", "COMMAND_FLAGS", "KAFKA_FLAGS"]

SECTIONS = ("kafka", "security", "topics", "worker", "detectors", "policy", "alerts", "driver",
            "collector", "agent")
_NAME = r"[A-Za-z0-9._-]{1,100}"

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


# -- derivation ------------------------------------------------------------------------------

def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def from_dataclass(prefix: str, cls, *, exclude=(), overrides: Mapping[str, dict] = {}
                   ) -> list[Key]:
    """The keys of a component's ``Config`` dataclass: its :func:`~trainguard.setting.setting`
    fields (nested ``Config`` objects walked into), with their metadata; ``overrides``
    changes a key's spec where the tree shows it differently (a default filled in later).
    ``prefix`` "": the fields are sections of their own (tables)."""
    keys = []
    for path, f, default in walk(cls):
        if path.split(".")[0] in exclude:
            continue
        spec = {"path": f"{prefix}.{path}" if prefix else path, "default": _plain(default),
                "check": checker_of(f, default), "help": f.metadata["help"],
                "env": f.metadata.get("env"), "secret": f.metadata.get("secret", False)}
        spec.update(overrides.get(path, {}))
        keys.append(Key(**spec))
    return keys


def checker_of(f: dataclasses.Field, default) -> Any:
    """The checker of a :func:`~trainguard.setting.setting` field, from its metadata (the
    rest of its range, an open bound or a bound between siblings, is
    :func:`~trainguard.setting.validate`'s)."""
    meta = f.metadata
    kind = meta.get("kind")
    bounds = meta["bounds"]
    lo = None if bounds.lo_open else bounds.lo
    if kind is bool:
        inner = Bool()
    elif kind is int:
        inner = Int(minimum=lo, maximum=bounds.hi)
    elif kind is float:
        inner = Num(minimum=lo)
    elif kind is str:
        inner = Str(enum=meta["choices"] or None, pattern=meta.get("pattern"),
                    min_length=meta.get("min_length", 0))
    elif kind in (list, tuple):
        inner = ListOf(Str())
    else:
        inner = AnyObject()
    return Nullable(inner) if default is None else inner


# -- the sections: each one a component's own Config ------------------------------------------
# (a function each, importing its room only when the section is wanted)

def _kafka():
    from .kafka_settings import KafkaSettings

    return KafkaSettings, {}


def _security():
    from .signing import SecuritySettings

    return SecuritySettings, {}


def _topics():
    from .topics import TopicsSettings

    return TopicsSettings, {}


def _worker():
    from .streams.settings import WorkerSettings

    return WorkerSettings, {"worker_id": {"check": Str(pattern=_NAME)},
                            "data_dir": {"default": None, "check": Nullable(Str(min_length=1))}}


def _detectors():
    from .detectors import DetectorsConfig

    return DetectorsConfig, {}


def _policy():
    from .actions.policy import OVER_EVICT, Policy

    return Policy, {"over_evict": {"check": Nullable(Str(enum=[o for o in OVER_EVICT if o]))}}


@dataclasses.dataclass(kw_only=True)
class ServiceTables:
    """The action service's free-form tables, taken whole from the file."""

    alerts: dict = table("alert sinks: name -> table (docs/ALERTS.md); secrets as X_env or "
                         "X_file")
    driver: dict = table("scheduler driver: type = \"slurm\" or \"kubernetes\" and its "
                         "settings (docs/DRIVERS.md); empty: orders go to `trainguard run`")


def _collector():
    from .collectors.settings import CollectorConfig

    return CollectorConfig, {}


def _agent():
    from .collectors.settings import AgentConfig

    return AgentConfig, {}


#: section -> its ``Config`` class and how the tree shows some of its keys differently (None:
#: a table of :class:`ServiceTables`), in the order of the tree
_SECTIONS = {"kafka": _kafka, "security": _security, "topics": _topics, "worker": _worker,
             "detectors": _detectors, "policy": _policy, "alerts": None, "driver": None,
             "collector": _collector, "agent": _agent}
#: sections loaded with another's (a command that reads ``kafka`` may sign)
_GROUPS = {"kafka": ("kafka", "security"), "alerts": ("alerts", "driver")}
_OWNER = {member: owner for owner, members in _GROUPS.items() for member in members
          if member != owner}
#: keys of the ``collector`` section that are not arguments of :func:`trainguard.init`
_NOT_INIT = ("instrument",)


def _section_keys(name: str) -> list[Key]:
    builder = _SECTIONS[name]
    if builder is None:
        return [k for k in from_dataclass("", ServiceTables) if k.path == name]
    cls, overrides = builder()
    return from_dataclass(name, cls, overrides=overrides)


@lru_cache(maxsize=None)
def keys_of(builders: tuple[str, ...]) -> tuple[Key, ...]:
    """The keys of sections ``builders`` (with those loaded with them, :data:`_GROUPS`)."""
    return tuple(k for name in builders for section in _GROUPS.get(name, (name,))
                 for k in _section_keys(section))


def all_keys() -> tuple[Key, ...]:
    return keys_of(tuple(s for s in _SECTIONS if s not in _OWNER))


@lru_cache(maxsize=None)
def root_class():
    """``TrainguardConfig``: the whole configuration tree, one field per section, each the
    ``Config`` dataclass of the component that owns it (:func:`root` makes one of a tree).
    Made on demand: it imports every room."""
    fields = []
    for name, builder in _SECTIONS.items():
        if builder is None:
            f = next(f for f in dataclasses.fields(ServiceTables) if f.name == name)
            fields.append((name, dict, dataclasses.field(default_factory=dict,
                                                         metadata=f.metadata)))
        else:
            cls = builder()[0]
            fields.append((name, cls, dataclasses.field(default_factory=cls)))
    root = dataclasses.make_dataclass("TrainguardConfig", fields, kw_only=True)
    root.__module__ = __name__
    root.__doc__ = root_class.__doc__.split("(:func:")[0].strip()
    return root


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
        data, line = upgrade(data, str(config_file))
        if line:
            print(line, file=sys.stderr)
    renamed = {env_name(old): env_name(new) for old, new in RENAMED.items()}
    if any(var in environ for var in renamed):
        print(f"trainguard: warning: deprecated variables: "
              f"{', '.join(f'{v} -> {renamed[v]}' for v in renamed if v in environ)}",
              file=sys.stderr)
        environ = {renamed.get(var, var): text for var, text in environ.items()}
    builders = tuple(s for s in _SECTIONS if s not in _OWNER) if sections is None else tuple(
        dict.fromkeys(_OWNER.get(s, s) for s in sections))
    if data and sections is not None:
        loaded = set(builders) | {s for s, owner in _OWNER.items() if owner in builders}
        data = {k: v for k, v in data.items() if k in loaded or k not in SECTIONS}
    if sections is not None:
        loaded_keys = keys_of(builders)
        names = {k.path.split(".")[0] for k in loaded_keys}
        environ = {var: text for var, text in environ.items()
                   if "__" not in var or var[len("TRAINGUARD_"):].split("__")[0].lower()
                   in names}
    return resolve(keys_of(builders), file_data=data, file_name=str(config_file or ""),
                   environ=environ, flags=flags)


def section_class(tree: Tree, section: str):
    """The ``kw_only`` dataclass of one section (``worker``, ``detectors.hang``)."""
    depth = section.count(".") + 1
    specs = [(p.split(".")[depth], Any, dataclasses.field(default=k.default,
                                                          metadata={"key": k})
              if not isinstance(k.default, (dict, list)) else
              dataclasses.field(default_factory=lambda d=k.default: type(d)(d),
                                metadata={"key": k}))
             for p, k in tree.keys.items()
             if p.startswith(section + ".") and p.count(".") == depth]
    name = "".join(part.title().replace("_", "") for part in section.split(".")) + "Section"
    return dataclasses.make_dataclass(name, specs, kw_only=True, frozen=True)


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


def nested(tree: Tree, prefix: str) -> dict:
    """The values under ``prefix`` as nested tables: ``{"hang": {"floor_s": 20.0, ...}}``."""
    out: dict = {}
    for path, (value, _) in tree.values.items():
        if path.startswith(prefix + "."):
            *parents, name = path[len(prefix) + 1:].split(".")
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


def detector_config(tree: Tree):
    """The :class:`~trainguard.detectors.DetectorsConfig` of the ``detectors`` section."""
    from .detectors import DetectorsConfig

    return build_config(DetectorsConfig, nested(tree, "detectors"))


def worker_settings(tree: Tree):
    from .broker import trainguard_home
    from .streams.settings import WorkerSettings

    values = dict(tree.section("worker"))
    if values.get("data_dir") is None:
        values["data_dir"] = str(trainguard_home() / "worker")
    try:
        return WorkerSettings(prefix=tree.value("topics.prefix"), **values)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"worker: {exc}") from None


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


def service_config(tree: Tree, policy_file: str | None = None):
    """``(Policy, alerts, driver)`` for the action service: the tree's ``policy``, ``alerts``
    and ``driver``; a JSON ``--policy FILE`` still counts, over the tree."""
    from .actions.policy import Policy
    from .actions.service import load_service_config

    data = _policy_dict(tree)
    alerts, driver = dict(tree.value("alerts")), dict(tree.value("driver"))
    if policy_file:
        print(f"trainguard: warning: --policy {policy_file} (JSON) is deprecated: write its "
              "settings in the config file's [policy], [alerts] and [driver] tables",
              file=sys.stderr)
        from_file, file_alerts, file_driver = load_service_config(policy_file)
        data = _merge(data, _changed(from_file.to_dict(), Policy().to_dict()))
        alerts, driver = {**alerts, **file_alerts}, {**driver, **file_driver}
    try:
        return Policy.from_dict(data), alerts, driver
    except UserError as exc:
        raise ConfigError(f"policy: {exc}") from None


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
    """The :func:`root_class` (``TrainguardConfig``) of a whole tree: each section built by
    its component's own ``Config`` class, so that its own checks run."""
    values: dict = {}
    for name, builder in _SECTIONS.items():
        if builder is not None:
            values[name] = build_config(builder()[0], nested(tree, name))
    values["worker"] = worker_settings(tree)
    values["detectors"] = detector_config(tree)
    values["policy"], values["alerts"], values["driver"] = service_config(tree)
    config = root_class()(**values)
    for name in ("kafka", "security", "topics", "collector", "agent"):
        validate(getattr(config, name), name + ".")
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
