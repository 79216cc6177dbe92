"""The configuration tree's mechanism: keys, one TOML file, the environment, flags.

A :class:`Key` is one setting (``worker.web_port``) with its default, its checker (the
``check(value, path)`` objects of :mod:`trainguard.fields`), its meaning, an optional legacy
environment variable and whether it is a secret. :func:`resolve` merges, in this order:

1. the defaults;
2. one TOML file (``--config FILE`` or ``TRAINGUARD_CONFIG``);
3. the environment: a key's own variable (``TRAINGUARD_BOOTSTRAP``) or the generic
   ``TRAINGUARD_<SECTION>__<KEY>`` (dots as double underscores, e.g.
   ``TRAINGUARD_DETECTORS__HANG__FLOOR_S=60``);
4. the command line's flags;

and remembers where each value came from. A bad value raises :class:`ConfigError` with one
line naming the key, the value, what is allowed and where it was set.

>>> from trainguard.fields import Int
>>> keys = [Key(path="worker.web_port", default=6066, check=Int(minimum=1, maximum=65535),
...             help="port of /metrics")]
>>> tree = resolve(keys, file_data={"worker": {"web_port": 7000}}, file_name="tg.toml",
...                environ={"TRAINGUARD_WORKER__WEB_PORT": "7001"})
>>> tree.value("worker.web_port"), tree.source("worker.web_port")
(7001, 'env TRAINGUARD_WORKER__WEB_PORT')
>>> resolve(keys, file_data={"worker": {"web_port": 0}}, file_name="tg.toml", environ={})
Traceback (most recent call last):
...
trainguard.config.ConfigError: worker.web_port: 0 is below the minimum 1 (set in tg.toml)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from .config import ConfigError
from .fields import AnyObject, InvalidEvent

__all__ = ["Key", "Tree", "resolve", "read_toml", "env_name", "SECRET_MASK"]

SECRET_MASK = "***"
ENV_PREFIX = "TRAINGUARD_"


@dataclass(frozen=True)
class Key:
    path: str                      # dotted: "detectors.hang.floor_s"
    default: Any
    check: Any                     # a trainguard.fields checker
    help: str = ""
    env: str | None = None         # a variable of its own, besides the generic one
    secret: bool = False
    live: Any = None               # the range it may take while a job runs (a Bounds), or None

    @property
    def section(self) -> str:
        return self.path.split(".", 1)[0]

    @property
    def is_table(self) -> bool:
        """A free-form table (alert sinks, a driver's settings): taken whole from the file."""
        return isinstance(self.check, AnyObject)


def env_name(path: str) -> str:
    """>>> env_name("detectors.hang.floor_s")
    'TRAINGUARD_DETECTORS__HANG__FLOOR_S'
    """
    return ENV_PREFIX + path.upper().replace(".", "__")


@dataclass
class Tree:
    """The effective configuration: ``{path: (value, source)}`` over declared keys."""

    keys: dict[str, Key]
    values: dict[str, tuple[Any, str]] = field(default_factory=dict)

    def value(self, path: str) -> Any:
        return self.values[path][0]

    def source(self, path: str) -> str:
        return self.values[path][1]

    def section(self, prefix: str) -> dict[str, Any]:
        """``{name: value}`` of the keys directly under ``prefix`` (``"worker"``)."""
        depth = prefix.count(".") + 1
        return {p.split(".")[depth]: v for p, (v, _) in self.values.items()
                if p.startswith(prefix + ".") and p.count(".") == depth}

    def shown(self, path: str) -> Any:
        value = self.value(path)
        return _mask(value) if self.keys[path].secret else _mask_entries(value)

    def to_json(self) -> dict:
        return {p: {"value": _jsonable(self.shown(p)), "source": s}
                for p, (_, s) in self.values.items()}


def _mask(value):
    return None if value in (None, "") else SECRET_MASK


_SENSITIVE = ("password", "secret", "token", "url", "key", "credential")


def _mask_entries(value):
    """A table with the entries that look secret masked (``sasl.password``, a sink's
    ``url``); ``X_env`` and ``X_file`` name where a secret is, and stay.

    >>> _mask_entries({"sasl.password": "pw", "slack": {"url": "https://x", "url_env": "U"}})
    {'sasl.password': '***', 'slack': {'url': '***', 'url_env': 'U'}}
    """
    if not isinstance(value, dict):
        return value
    out = {}
    for name, item in value.items():
        lowered = str(name).lower()
        if isinstance(item, dict):
            out[name] = _mask_entries(item)
        elif lowered.endswith(("_env", "_file", ".location")):
            out[name] = item
        elif any(word in lowered for word in _SENSITIVE):
            out[name] = _mask(item)
        else:
            out[name] = item
    return out


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def read_toml(path: str | Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:          # Python 3.10
        import tomli as tomllib
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _flatten(data: Mapping, keys: dict[str, Key], where: str) -> dict[str, Any]:
    """Dotted paths of a nested file's values; an unknown key is an error naming it."""
    prefixes = {".".join(p.split(".")[:i]) for p in keys for i in range(1, p.count(".") + 1)}
    out: dict[str, Any] = {}
    todo = [("", data)]
    while todo:
        base, table = todo.pop()
        for name, value in table.items():
            path = f"{base}{name}"
            if path in keys:
                out[path] = value
            elif path in prefixes and isinstance(value, dict):
                todo.append((path + ".", value))
            else:
                known = sorted({p[len(base):].split(".")[0] for p in keys if p.startswith(base)})
                parent = base.rstrip(".") or "the top level"
                raise ConfigError(f"{path}: unknown key in {parent} (set in {where}); known: "
                                  f"{', '.join(known)}")
    return out


def _from_env_text(key: Key, text: str, var: str):
    """An environment variable's text as the key's type, judged by its default."""
    default = key.default
    try:
        if isinstance(default, bool):
            lowered = text.strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError
            return lowered in ("1", "true", "yes", "on")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if isinstance(default, (list, tuple)):
            return [part for part in text.split(",") if part]
    except ValueError:
        kind = {bool: "true or false", int: "an integer", float: "a number"}.get(
            type(default), "a list")
        raise ConfigError(f"{key.path}: {var}={text!r} is not {kind}") from None
    if key.is_table:
        raise ConfigError(f"{key.path}: a table is set in the config file, not in {var}")
    return text


def resolve(keys: Iterable[Key], *, file_data: Mapping | None = None, file_name: str = "",
            environ: Mapping[str, str] | None = None, flags: Mapping[str, tuple] | None = None
            ) -> Tree:
    """Merge defaults, file, environment and ``flags`` (``{path: (value, "--flag")}``)."""
    by_path = {k.path: k for k in keys}
    tree = Tree(keys=by_path, values={p: (k.default, "default") for p, k in by_path.items()})
    if file_data:
        for path, value in _flatten(file_data, by_path, file_name).items():
            tree.values[path] = (value, file_name)
    environ = environ or {}
    own = {k.env: k for k in by_path.values() if k.env}
    for var, text in environ.items():
        if not var.startswith(ENV_PREFIX) or text == "":
            continue
        if var in own:
            key = own[var]
        elif "__" in var:
            path = var[len(ENV_PREFIX):].lower().replace("__", ".")
            if path not in by_path:
                raise ConfigError(f"{var} names no configuration key ({path}); see "
                                  "`trainguard config show`")
            key = by_path[path]
        else:
            continue
        tree.values[key.path] = (_from_env_text(key, text, var), f"env {var}")
    for path, (value, flag) in (flags or {}).items():
        tree.values[path] = (value, f"flag {flag}")
    for path, (value, source) in tree.values.items():
        key = by_path[path]
        if value is None and key.default is None:
            continue
        try:
            checked = key.check.check(value, path)
        except InvalidEvent as exc:
            raise ConfigError(f"{exc} (set in {source})") from None
        tree.values[path] = (checked, source)
    return tree
