"""One setting of the configuration tree, declared once beside the code that reads it.

A component owns a ``kw_only`` dataclass, its ``Config`` (``HangDetector.Config``,
``WorkerSettings``, ``Policy``...), whose fields are made with :func:`setting`: the default,
the meaning, the allowed range and, for a value that may change while a job runs (a per-job
override, :mod:`trainguard.overrides`), the range it may take then. :func:`validate` is the
one check of a configuration: it walks the fields' metadata, nested ``Config`` objects
included, and raises :class:`~trainguard.config.ConfigError` with one line naming the key.

>>> from dataclasses import dataclass
>>> @dataclass(kw_only=True)
... class Window:
...     k: int = setting(6, "flagged in k ...", minimum=1, at_most="n", live=(1, 1000))
...     n: int = setting(10, "... of the last n steps", minimum=1)
...     quantile: float = setting(0.99, "quantile of the intervals", above=0, maximum=1)
>>> validate(Window(k=3), "detectors.straggler.")
>>> validate(Window(k=12), "detectors.straggler.")
Traceback (most recent call last):
...
trainguard.config.ConfigError: detectors.straggler.k (12) must be between 1 and detectors.straggler.n (10)
>>> validate(Window(quantile=1.5), "x.")
Traceback (most recent call last):
...
trainguard.config.ConfigError: x.quantile must be in (0, 1], got 1.5
>>> live_bounds(Window, "k")
Bounds(lo=1, hi=1000, lo_open=False)
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator

from .config import ConfigError

__all__ = ["setting", "table", "Bounds", "validate", "live_bounds", "walk", "with_values",
           "help_of", "MONTH_S"]

MONTH_S = 30 * 86400.0


@dataclass(frozen=True)
class Bounds:
    """``lo`` (excluded with ``lo_open``) to ``hi``; None: no bound on that side."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False

    def holds(self, value) -> bool:
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or value <= self.hi

    def text(self, integer: bool) -> str:
        """What the bounds allow, in words.

        >>> Bounds(1, 65535).text(True), Bounds(0, 1, True).text(False), Bounds(1).text(True)
        ('an integer from 1 to 65535', 'in (0, 1]', 'a positive integer')
        """
        kind = "integer" if integer else "number"
        if self.hi is None and self.lo == 0 and not self.lo_open:
            return f"a non-negative {kind}"
        if self.hi is None and self.lo is not None and \
                self.lo == (0 if self.lo_open else 1 if integer else None):
            return f"a positive {kind}"
        if self.lo is None and self.hi is None:
            return "an integer" if integer else "a number"
        lo, hi = _plain(self.lo), _plain(self.hi)
        if self.lo_open:
            text = f"in ({lo}, {hi}]" if self.hi is not None else f"above {lo}"
        elif self.hi is not None:
            text = f"from {lo} to {hi}" if self.lo is not None else f"at most {hi}"
        else:
            text = f"at least {lo}"
        if not integer:
            return text
        return "an integer " + ("of " if text.startswith("at ") else "") + text


def _plain(x) -> str:
    if x is None:
        return ""
    return str(int(x)) if float(x).is_integer() else str(x)


def setting(default, help: str, *, minimum=0, maximum=None, above=None, at_most: str = "",
            live=None, choices=None, env: str | None = None, secret: bool = False,
            kind: type | None = None, pattern: str | None = None, min_length: int = 0,
            check=None):
    """A dataclass field with its metadata. Numbers are finite and non-negative unless said
    otherwise (``minimum=None``: any); ``above``: strictly greater than; ``at_most``: the
    name of a sibling field this one may not exceed; ``live``: ``(lo, hi)`` the value may
    take while a job runs (``True``: the allowed range); ``kind``: the type, where the
    default is None; ``choices``: the values allowed (of each item, for a list or tuple);
    ``pattern`` (a regular expression the whole text matches) and ``min_length``: a text's
    form; ``check``: ``check(value, path) -> value``, for a form the others cannot say (a
    table's), raising ConfigError; ``env``: a variable of its own besides
    ``TRAINGUARD_<SECTION>__<KEY>``."""
    bounds = Bounds(above, maximum, True) if above is not None else Bounds(minimum, maximum)
    if live is True:
        live = (bounds.lo, bounds.hi)
    metadata = {"help": help, "bounds": bounds, "at_most": at_most,
                "live": Bounds(*live) if live else None, "choices": choices, "env": env,
                "secret": secret, "kind": kind or (type(default) if default is not None
                                                   else None),
                "pattern": pattern, "min_length": min_length, "check": check}
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d),
                                 metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def table(help: str, *, env: str | None = None):
    """A free-form table (alert sinks, a driver's settings), taken whole from the file."""
    return setting({}, help, env=env)


def help_of(cls, name: str) -> str:
    return next(f.metadata.get("help", "") for f in dataclasses.fields(cls) if f.name == name)


def walk(obj_or_cls, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """``(dotted path, field, default)`` of every setting under a ``Config`` class (nested
    ones walked into), in declaration order; fields without metadata are not settings."""
    for f in dataclasses.fields(obj_or_cls):
        path = prefix + f.name
        nested = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(nested):
            yield from walk(nested, path + ".")
            continue
        if "help" not in f.metadata:
            continue
        default = (f.default if f.default is not dataclasses.MISSING else
                   f.default_factory() if f.default_factory is not dataclasses.MISSING
                   else None)
        yield path, f, default


def _check_one(f: dataclasses.Field, value, path: str):
    """``value`` of field ``f`` typed and in range (a whole number as a float where the
    setting is a float); raises ConfigError."""
    meta = f.metadata
    kind = meta.get("kind")
    if value is None:
        default = f.default if f.default is not dataclasses.MISSING else None
        if default is None:
            return None
        raise ConfigError(f"{path} must be set, got None")
    if kind is bool:
        if type(value) is not bool:
            raise ConfigError(f"{path} must be true or false, got {value!r}")
        return value
    if kind in (int, float):
        integer = kind is int
        ok = (type(value) is int) if integer else (type(value) in (int, float)
                                                   and math.isfinite(value))
        bounds = meta["bounds"]
        if not ok or not bounds.holds(value):
            raise ConfigError(f"{path} must be {bounds.text(integer)}, got {value!r}")
        return value if integer else float(value)
    if kind is str:
        pattern, min_length = meta.get("pattern"), meta.get("min_length", 0)
        if type(value) is not str or len(value) < min_length or \
                (pattern and not re.fullmatch(pattern, value)):
            what = f"match {pattern}" if pattern else "be a text" + (
                f" of at least {min_length} characters" if min_length else "")
            raise ConfigError(f"{path} must {what}, got {value!r}")
    choices = meta.get("choices")
    if kind in (list, tuple):
        if not isinstance(value, (list, tuple)) or (choices is not None and any(
                item not in choices for item in value)):
            among = f", each one of {', '.join(map(str, choices))}" if choices else ""
            raise ConfigError(f"{path} must be a list{among}, got {value!r}")
        value = value if type(value) is kind else kind(value)
    elif choices is not None and value not in choices:
        raise ConfigError(f"{path} must be one of {', '.join(map(str, choices))}, "
                          f"got {value!r}")
    if meta.get("check") is not None:
        value = meta["check"](value, path)
    return value


def validate(config, prefix: str = "") -> None:
    """The one check of a ``Config`` (and the ones nested in it): every setting's type and
    range, and ``at_most`` between siblings. Whole numbers of float settings become floats."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        path = prefix + f.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            validate(value, path + ".")
            continue
        if "help" not in f.metadata:
            continue
        checked = _check_one(f, value, path)
        if checked is not value:
            object.__setattr__(config, f.name, checked)
    for f in dataclasses.fields(config):
        other = f.metadata.get("at_most") if f.metadata else ""
        if other:
            value, limit = getattr(config, f.name), getattr(config, other)
            lo = f.metadata["bounds"].lo or 0
            if not lo <= value <= limit:
                raise ConfigError(f"{prefix}{f.name} ({value}) must be between {_plain(lo)} "
                                  f"and {prefix}{other} ({limit})")


def live_bounds(cls, name: str) -> Bounds | None:
    """The range setting ``name`` of ``cls`` may take while a job runs (None: not live)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            return f.metadata.get("live")
    return None


def with_values(config, values: dict):
    """A copy of ``config`` with ``{"hang.floor_s": 30.0, ...}`` (dotted, relative) set,
    nested ``Config`` objects copied where they change; unknown names raise TypeError."""
    grouped: dict = {}
    for path, value in values.items():
        head, _, rest = path.partition(".")
        if rest:
            grouped.setdefault(head, {})[rest] = value
        else:
            grouped[head] = value
    changes = {}
    for name, value in grouped.items():
        if isinstance(value, dict) and dataclasses.is_dataclass(getattr(config, name, None)):
            changes[name] = with_values(getattr(config, name), value)
        else:
            changes[name] = value
    return dataclasses.replace(config, **changes)
