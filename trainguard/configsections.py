"""The sections of the configuration tree, and what each becomes for its component.

Sections are derived, not re-declared: the keys of ``worker`` are the fields of
:class:`~trainguard.streams.settings.WorkerSettings`, those of ``detectors.<name>`` the
constructor arguments of each detector, ``policy`` the fields of
:class:`~trainguard.actions.policy.Policy`, and so on, with their defaults and, as the
meaning, the comment written beside them. So a default is written once, in its component,
and a constructor argument a detector gains shows up here by itself. Each section is a
``kw_only`` dataclass (:func:`section_class`), validated by :mod:`trainguard.fields`
checkers; the adapters below (:func:`kafka_config`, :func:`detector_config`,
:func:`worker_settings`, :func:`service_config`, ...) build the settings objects the
components already take, and their own checks run too (:func:`check_tree`).

>>> tree = load(environ={"TRAINGUARD_DETECTORS__HANG__FLOOR_S": "45"})
>>> detector_config(tree).hang_floor_s, tree.source("detectors.hang.floor_s")
(45.0, 'env TRAINGUARD_DETECTORS__HANG__FLOOR_S')
>>> section_class(tree, "worker")(**tree.section("worker")).web_bind
'127.0.0.1'
"""
from __future__ import annotations

import dataclasses
import inspect
import re
from functools import lru_cache
from typing import Any, Callable, Mapping

from .config import (DEFAULT_BOOTSTRAP, DEFAULT_PREFIX, Config, ConfigError, Topics,
                     check_client_settings, load_client_settings)
from .configtree import Key, Tree, read_toml, resolve
from .errors import UserError
from .fields import AnyObject, Bool, Int, ListOf, Nullable, Num, Str

__all__ = ["all_keys", "keys_of", "load", "section_class", "kafka_config", "topic_plan",
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

_FIELD_RE = re.compile(r"^(\s*)(\w+)\s*(?::[^=#]*)?=[^#]*?(?:#(?!:)\s*(.*))?$")
_COMMENT_RE = re.compile(r"^\s*#(:?)\s?(.*)$")


@lru_cache(maxsize=None)
def comments(obj) -> dict[str, str]:
    """Meanings written beside a class's fields: ``name = x  # meaning`` with its
    continuation lines, or ``#: meaning`` lines above it."""
    try:
        lines = inspect.getsource(obj).splitlines()
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    above: list[str] = []
    last, indent = None, 0
    for line in lines:
        comment = _COMMENT_RE.match(line)
        if comment:
            if comment.group(1):
                above.append(comment.group(2).strip())
            elif last is not None and line.index("#") > indent + 8:
                out[last] = f"{out[last]} {comment.group(2).strip()}".strip()
            else:
                last = None
            continue
        match = _FIELD_RE.match(line)
        if match and not line.lstrip().startswith(("def ", "return", "class ", "@")):
            name, trailing = match.group(2), (match.group(3) or "").strip()
            text = " ".join(above + ([trailing] if trailing else []))
            if text:
                out[name] = text
            last, indent = (name if trailing else None), len(match.group(1))
        else:
            last = None
        above = []
    return out


def checker_for(default, annotation: str = "") -> Any:
    """The checker of a setting, from its default (or, for ``None``, its annotation)."""
    if isinstance(default, bool):
        return Bool()
    if isinstance(default, int):
        return Int(minimum=0)
    if isinstance(default, float):
        return Num(minimum=0)
    if isinstance(default, str):
        return Str()
    if isinstance(default, (tuple, list)):
        return ListOf(Str())
    if isinstance(default, dict):
        return AnyObject()
    annotation = str(annotation)
    for word, inner in (("float", Num(minimum=0)), ("int", Int(minimum=0)), ("str", Str())):
        if word in annotation:
            return Nullable(inner)
    return AnyObject()


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def from_dataclass(prefix: str, cls, *, exclude=(), overrides: Mapping[str, dict] = {},
                   helps: Mapping[str, str] | None = None) -> list[Key]:
    helps = comments(cls) if helps is None else helps
    keys = []
    for f in dataclasses.fields(cls):
        if f.name in exclude or f.name.startswith("_"):
            continue
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not
                                    dataclasses.MISSING else None):
            keys += from_dataclass(f"{prefix}.{f.name}", f.default_factory)
            continue
        default = (f.default if f.default is not dataclasses.MISSING else
                   f.default_factory() if f.default_factory is not dataclasses.MISSING
                   else None)
        spec = {"path": f"{prefix}.{f.name}", "default": _plain(default),
                "check": checker_for(default, f.type), "help": helps.get(f.name, "")}
        spec.update(overrides.get(f.name, {}))
        keys.append(Key(**spec))
    return keys


def from_signature(prefix: str, func: Callable, *, only=None, exclude=(),
                   overrides: Mapping[str, dict] = {}, helps: Mapping[str, str] = {}
                   ) -> list[Key]:
    keys = []
    for name, p in inspect.signature(func).parameters.items():
        if name == "self" or name in exclude or (only is not None and name not in only):
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default = None if p.default is inspect.Parameter.empty else p.default
        spec = {"path": f"{prefix}.{name}", "default": _plain(default),
                "check": checker_for(default, p.annotation), "help": helps.get(name, "")}
        spec.update(overrides.get(name, {}))
        keys.append(Key(**spec))
    return keys


# -- the sections ------------------------------------------------------------------------------

def _kafka_keys() -> list[Key]:
    return [
        Key(path="kafka.bootstrap", default=DEFAULT_BOOTSTRAP, check=Str(min_length=1),
            env="TRAINGUARD_BOOTSTRAP", help="bootstrap servers, host:port[,host:port]"),
        Key(path="kafka.client_config", default=None, check=Nullable(Str(min_length=1)),
            env="TRAINGUARD_KAFKA_CONFIG",
            help="file of librdkafka key=value settings (SASL, SSL); ${VAR} is expanded"),
        Key(path="kafka.client", default={}, check=AnyObject(),
            help="librdkafka settings as a table, over those of client_config"),
        Key(path="security.signing_key", default=None, check=Nullable(Str(min_length=1)),
            env="TRAINGUARD_SIGNING_KEY", secret=True,
            help="shared key that signs orders and commands (HMAC); masked when shown"),
    ]


def _topic_keys() -> list[Key]:
    from .topics import TopicPlan

    return [Key(path="topics.prefix", default=DEFAULT_PREFIX, check=Str(pattern=_NAME),
                env="TRAINGUARD_TOPIC_PREFIX", help="topic prefix: <prefix>.telemetry, ...")
            ] + from_dataclass("topics", TopicPlan, overrides={
                n: {"check": Int(minimum=1)} for n in ("telemetry_partitions",
                                                        "other_partitions",
                                                        "deadletter_partitions")},
                helps={"telemetry_partitions": "partitions of the telemetry topic",
                       "other_partitions": "partitions of the other topics",
                       "deadletter_partitions": "partitions of the dead-letter topic"})


def _worker_keys() -> list[Key]:
    from .streams.settings import LOGLEVELS, WorkerSettings

    return from_dataclass("worker", WorkerSettings, exclude=("prefix", "extra"), overrides={
        "worker_id": {"check": Str(pattern=_NAME),
                      "help": "Faust app id; workers with one id share the work"},
        "web_port": {"check": Int(minimum=1, maximum=65535),
                     "help": "port of /metrics (flag --metrics-port, or --web-port)"},
        "web_bind": {"help": "address /metrics listens on (flag --metrics-bind); 0.0.0.0 "
                             "for every interface"},
        "data_dir": {"default": None, "check": Nullable(Str(min_length=1)),
                     "help": "Faust data folder (default: $TRAINGUARD_HOME/worker)"},
        "loglevel": {"check": Str(enum=LOGLEVELS),
                     "help": "log level (flag --log-level, or --loglevel)"},
    })


#: meanings of the settings whose components carry none beside them
_MEANINGS = {
    "detectors.hang.floor_s": "the hang timeout is never below this many seconds",
    "detectors.hang.factor": "timeout: factor x the quantile of the job's step intervals",
    "detectors.hang.quantile": "quantile of the step intervals the timeout scales",
    "detectors.silent.timeout_s": "a rank or machine silent this long while others go on",
    "detectors.gpu_degraded.window_s": "seconds of samples each condition is judged over",
    "detectors.gpu_degraded.throttle_fraction": "hardware throttling in this fraction of "
                                                "the samples ...",
    "detectors.gpu_degraded.min_samples": "... of at least this many samples",
    "detectors.loss_spike.tail_quantile": "quantile of the deviations' tail",
    "detectors.grad_spike.tail_quantile": "quantile of the deviations' tail",
    "policy.limits.max_restarts": "restarts of a job per restart_window_s, then a page",
    "policy.limits.restart_window_s": "window of max_restarts",
    "policy.limits.restart_settle_s": "longest wait for a restart to show in the lifecycle",
    "policy.limits.max_evictions_per_incident": "machines evicted per incident at most",
    "policy.limits.max_evictions_per_day": "machines evicted per 24 h, all jobs",
    "policy.limits.page_cooldown_s": "a job is paged at most once per this",
    "policy.capture.rounds": "stack captures per incident",
    "policy.capture.interval_s": "seconds between the rounds",
    "policy.capture.deadline_s": "a round waits this long for every expected rank",
    "policy.capture.quiet_s": "with no known world size: until no rank answered this long",
    "policy.backlog.max_queued": "anomalies waiting at most; then the oldest of the least "
                                 "severe is dropped, with a record",
    "policy.backlog.max_in_flight": "anomalies under way at once (waiting for stacks costs "
                                    "no thread)",
    "policy.backlog.workers": "threads for blocking calls (alert sinks)",
    "policy.incidents.wait_s": "an anomaly waits this long at most for the worker's incident "
                               "that lists it",
    "policy.incidents.expect_s": "no incident event within this: group anomalies with the "
                                 "service's own correlator",
}


def _detector_keys() -> list[Key]:
    from .detectors import DETECTORS, DetectorConfig

    helps = comments(DetectorConfig)
    by_arg: dict[str, str] = {}
    keys, claimed = [], set()
    for cls in DETECTORS:
        params = [n for n in inspect.signature(cls.__init__).parameters if n != "self"]
        own = {n: helps.get(f"{cls.PREFIX}_{n}", "") for n in params}
        for n, text in own.items():
            by_arg.setdefault(n, text) if text else None
        keys += from_signature(f"detectors.{cls.PREFIX}", cls.__init__, helps=own)
        claimed |= {f"{cls.PREFIX}_{n}" for n in params}
    keys = [dataclasses.replace(k, help=k.help or by_arg.get(k.path.rsplit(".", 1)[1], ""))
            for k in keys]
    for f in dataclasses.fields(DetectorConfig):     # the stages' and correlation's settings
        if f.name in claimed:
            continue
        group, name = ("correlate", f.name[len("correlate_"):]) \
            if f.name.startswith("correlate_") else ("stages", f.name)
        keys.append(Key(path=f"detectors.{group}.{name}", default=f.default,
                        check=checker_for(f.default, f.type), help=helps.get(f.name, "")))
    return keys


def _flat_detector_name(path: str) -> str:
    _, group, name = path.split(".")
    return name if group == "stages" else f"{group}_{name}"


def _policy_keys() -> list[Key]:
    from .actions.policy import OVER_EVICT, Policy

    return from_dataclass("policy", Policy, overrides={
        "dry_run": {"help": "decide and record everything, carry nothing out"},
        "require_approval": {"help": "job actions (restart, evict, rollback) that wait for "
                                     "an operator"},
        "ladder": {"help": "anomaly kind -> ordered steps (docs/POLICY.md); kinds left out "
                           "keep their default ladder"},
        "over_evict": {"check": Nullable(Str(enum=[o for o in OVER_EVICT if o])),
                       "help": "evict the whole tp, pp or dp group of a suspect"},
    }, helps={**comments(Policy), **_POLICY_HELP})


_POLICY_HELP = {
    "crash_repeats": "crashes of one rank within crash_window_s that make it 'repeated'",
    "crash_window_s": "window of crash_repeats",
    "repeat_count": "incidents of one kind in a job within repeat_window_s that make "
                    "rollback_if_repeated roll back",
    "repeat_window_s": "window of repeat_count",
    "max_suspect_fraction": "never evict more than this fraction of the job's machines",
    "straggler_persist_s": "a straggler slow this long is 'persistent'",
    "straggler_min_slowdown": "... and at least this much slower than its peers",
    "max_anomaly_age_s": "anomalies older than this are recorded, not acted on",
    "confirm_stalled": "before a restart or eviction for a hang, check the job is still "
                       "stalled; one that moved on is closed as a false alarm",
}


def _collector_keys() -> list[Key]:
    from .collectors.api import init

    return from_signature("collector", init, only=(
        "heartbeat_interval", "report_every", "flush_timeout", "max_queue_events",
        "max_queue_bytes"), overrides={
        "report_every": {"check": Int(minimum=1)},
        "heartbeat_interval": {"check": Num(minimum=0.01)}}, helps={
        "heartbeat_interval": "seconds between a rank's heartbeats",
        "report_every": "send every n-th step",
        "flush_timeout": "seconds to flush at exit",
        "max_queue_events": "events queued while Kafka is away; then the oldest are dropped",
        "max_queue_bytes": "bytes queued while Kafka is away"}) + [
        Key(path="collector.instrument", default=False, check=Bool(),
            env="TRAINGUARD_INSTRUMENT",
            help="`trainguard run` watches an unmodified PyTorch script through PyTorch's "
                 "hooks (`--instrument`, docs/INTEGRATIONS.md)")]


#: keys of the ``collector`` section that are not arguments of :func:`trainguard.init`
_NOT_INIT = ("instrument",)


def _agent_keys() -> list[Key]:
    from .collectors.agent import Agent

    return [Key(path="agent.node", default=None, check=Nullable(Str(min_length=1)),
                help="this machine's name (default: host name)"),
            Key(path="agent.job", default=None, check=Nullable(Str(pattern=_NAME)),
                help="job id of GPU and Xid events (default: every job seen locally)"),
            Key(path="agent.runtime_dir", default=None, check=Nullable(Str(min_length=1)),
                help="local registry of rank processes (default: $TRAINGUARD_HOME/run)"),
            ] + from_signature("agent", Agent.__init__, only=("interval", "kmsg_extra",
                                                               "native"), overrides={
                "interval": {"check": Num(minimum=0.01)}}, helps={
                "interval": "GPU sample period, seconds",
                "kmsg_extra": "files also tailed as kernel logs (chaos tests)",
                "native": "py-spy --native stacks"})


def _service_tables() -> list[Key]:
    return [Key(path="alerts", default={}, check=AnyObject(),
                help="alert sinks: name -> table (docs/ALERTS.md); secrets as X_env or X_file"),
            Key(path="driver", default={}, check=AnyObject(),
                help="scheduler driver: type = \"slurm\" or \"kubernetes\" and its settings "
                     "(docs/DRIVERS.md); empty: orders go to `trainguard run`")]


#: top-level section -> the function that declares its keys (``security`` comes with kafka)
_BUILDERS = {"kafka": _kafka_keys, "topics": _topic_keys, "worker": _worker_keys,
             "detectors": _detector_keys, "policy": _policy_keys, "alerts": _service_tables,
             "collector": _collector_keys, "agent": _agent_keys}
_OWNER = {"security": "kafka", "driver": "alerts"}


@lru_cache(maxsize=None)
def keys_of(builders: tuple[str, ...]) -> tuple[Key, ...]:
    keys = [k for name in builders for k in _BUILDERS[name]()]
    return tuple(dataclasses.replace(k, help=k.help or _MEANINGS.get(k.path, "")) for k in keys)


def all_keys() -> tuple[Key, ...]:
    return keys_of(tuple(_BUILDERS))


def load(config_file: str | None = None, environ: Mapping[str, str] | None = None,
         flags: Mapping[str, tuple] | None = None, sections: tuple[str, ...] | None = None
         ) -> Tree:
    """The tree from ``config_file`` (else ``TRAINGUARD_CONFIG``), the environment, flags.

    ``sections`` (default: all) limits what is declared and checked; the file's other
    sections are then left to ``trainguard config check`` (importing every component takes
    a second a short-lived command need not spend)."""
    environ = {} if environ is None else environ
    config_file = config_file or environ.get("TRAINGUARD_CONFIG") or None
    data = read_toml(config_file) if config_file else None
    builders = tuple(_BUILDERS) if sections is None else tuple(
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


def detector_config(tree: Tree):
    """The :class:`DetectorConfig` of the ``detectors`` sections."""
    from .detectors import DetectorConfig

    known = {f.name for f in dataclasses.fields(DetectorConfig)}
    flat = {}
    for path in tree.keys:
        if not path.startswith("detectors."):
            continue
        name = _flat_detector_name(path)
        if name in known:
            flat[name] = tree.value(path)
        elif tree.source(path) != "default":
            raise ConfigError(f"{path} is not used by this build's detectors")
    try:
        return DetectorConfig(**flat)
    except (TypeError, ValueError) as exc:
        text = str(exc)
        for path in tree.keys:
            if path.startswith("detectors."):
                text = re.sub(rf"\b{_flat_detector_name(path)}\b", path, text)
        raise ConfigError(text) from None


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


def check_tree(tree: Tree, environ: Mapping[str, str] | None = None) -> None:
    """Build every component's settings once, so that their own checks run too."""
    kafka_config(tree)
    topic_plan(tree)
    detector_config(tree)
    worker_settings(tree)
    _, alerts, driver = service_config(tree)
    if alerts:
        from .actions.alerts import build_sinks

        build_sinks(alerts, environ or {})
    if driver:
        _check_driver(driver)
    section_class(tree, "collector")(**collector_kwargs(tree))
    section_class(tree, "agent")(**tree.section("agent"))


def _check_driver(driver: dict) -> None:
    from .actions.drivers import DRIVER_TYPES

    if driver.get("type") not in DRIVER_TYPES:
        raise ConfigError(f"driver.type = {driver.get('type')!r}: must be one of "
                          f"{', '.join(sorted(DRIVER_TYPES))}")
