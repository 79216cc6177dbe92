"""Sinks from a config section, secrets from the environment, a file, or the config itself.

The section maps a name to one sink's settings (or to a list of them); the name is the sink
type unless the entry says ``type``. Each secret field ``X`` (``url``, ``secret``,
``bearer_token``) is given as exactly one of ``X`` (in the config file), ``X_env`` (the name
of an environment variable) or ``X_file`` (a file holding it, e.g. a mounted Kubernetes
secret). Delivery settings go beside them: ``timeout``, ``retries``, ``backoff``,
``backoff_max``, ``dedup_window``, ``rate_per_minute``, ``burst``; ``enabled: false`` skips one.

>>> sinks = build_sinks({"slack": {"url_env": "SLACK_WEBHOOK_URL", "retries": 1},
...                      "ops": {"type": "alertmanager", "url": "http://127.0.0.1:9093",
...                              "extra_labels": {"cluster": "c1"}}},
...                     {"SLACK_WEBHOOK_URL": "https://hooks.slack.com/services/T/B/xyz"})
>>> sinks
[SlackSink(url='https://hooks.slack.com/***'), AlertmanagerSink(name='ops', url='http://127.0.0.1:9093/***', extra_labels={'cluster': 'c1'}, firing_for=3600.0)]
>>> build_sinks({"slack": {"url_env": "NOPE"}}, {})
Traceback (most recent call last):
...
trainguard.actions.alerts.config.AlertConfigError: alerts.slack: url_env names NOPE, which is not set; export it, or give url or url_file instead
"""
from __future__ import annotations

import logging
import os
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from trainguard.errors import UserError

from .alertmanager import AlertmanagerSink
from .base import Delivery, SendResult, Sink
from .lark import LarkSink
from .message import AlertMessage
from .slack import SlackSink
from .teams import TeamsSink
from .webhook import WebhookSink

__all__ = ["build_sinks", "send_all", "SINK_TYPES", "AlertConfigError"]

log = logging.getLogger("trainguard.actions.alerts")

SINK_TYPES: dict[str, type[Sink]] = {
    "slack": SlackSink, "lark": LarkSink, "feishu": LarkSink, "teams": TeamsSink,
    "alertmanager": AlertmanagerSink, "webhook": WebhookSink,
}
_DELIVERY_KEYS = {f.name for f in fields(Delivery)}
_INJECTED = {"name", "delivery", "sleep", "clock", "wall_clock"}


class AlertConfigError(UserError):
    """The alerts section of the configuration is wrong."""


def _secret(where: str, key: str, entry: dict, environ: Mapping[str, str],
            required: bool) -> str | None:
    given = [k for k in (key, f"{key}_env", f"{key}_file") if k in entry]
    if len(given) > 1:
        raise AlertConfigError(f"{where}: give only one of {', '.join(given)}")
    if not given:
        if required:
            raise AlertConfigError(f"{where}: {key} is missing; give {key}, {key}_env or "
                                   f"{key}_file")
        return None
    how = given[0]
    if how == key:
        value = entry[key]
    elif how.endswith("_env"):
        var = entry[how]
        value = environ.get(var) if isinstance(var, str) else None
        if not value:
            raise AlertConfigError(f"{where}: {how} names {var}, which is not set; export it, "
                                   f"or give {key} or {key}_file instead")
    else:
        try:
            value = Path(entry[how]).read_text(encoding="utf-8").strip()
        except (OSError, TypeError, ValueError) as exc:
            raise AlertConfigError(f"{where}: {how} {entry[how]} cannot be read "
                                   f"({type(exc).__name__}); fix the path or its "
                                   f"permissions") from None
    if not isinstance(value, str) or not value:
        raise AlertConfigError(f"{where}: {key} must be a non-empty string")
    return value


def _one(where: str, kind: str, name: str | None, entry: dict, environ: Mapping[str, str],
         injected: dict) -> Sink:
    cls = SINK_TYPES[kind]
    own = {f.name: f for f in fields(cls)}
    plain = set(own) - _INJECTED - set(cls.SECRETS)
    allowed = ({"type", "enabled", "name"} | _DELIVERY_KEYS | plain
               | {f"{s}{suffix}" for s in cls.SECRETS for suffix in ("", "_env", "_file")})
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise AlertConfigError(f"{where}: unknown setting {', '.join(unknown)}; "
                               f"known: {', '.join(sorted(allowed - {'type'}))}")
    kwargs: dict[str, Any] = {k: entry[k] for k in plain if k in entry}
    for secret in cls.SECRETS:
        required = own[secret].default is MISSING and own[secret].default_factory is MISSING
        kwargs[secret] = _secret(where, secret, entry, environ, required)
    try:
        delivery = Delivery(**{k: entry[k] for k in _DELIVERY_KEYS if k in entry})
        return cls(name=entry.get("name", name), delivery=delivery, **kwargs,
                   **{k: v for k, v in injected.items()
                      if v is not None and (k != "wall_clock" or "wall_clock" in own)})
    except (TypeError, ValueError) as exc:
        raise AlertConfigError(f"{where}: {exc}") from None


def build_sinks(config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None, *,
                sleep: Callable[[float], None] | None = None,
                clock: Callable[[], float] | None = None,
                wall_clock: Callable[[], float] | None = None) -> list[Sink]:
    """The configured sinks, in config order. ``environ`` defaults to ``os.environ``;
    ``sleep``, ``clock`` (monotonic) and ``wall_clock`` are for tests."""
    environ = os.environ if environ is None else environ
    injected = {"sleep": sleep, "clock": clock, "wall_clock": wall_clock}
    if not config:
        return []
    if not isinstance(config, Mapping):
        raise AlertConfigError("alerts: must be a mapping of sink name to settings")
    sinks = []
    for key, value in config.items():
        entries = value if isinstance(value, list) else [value]
        for i, entry in enumerate(entries):
            where = f"alerts.{key}" + (f"[{i}]" if isinstance(value, list) else "")
            if not isinstance(entry, Mapping):
                raise AlertConfigError(f"{where}: must be a mapping of settings")
            entry = dict(entry)
            if entry.get("enabled", True) is False:
                continue
            kind = entry.get("type", key)
            if kind not in SINK_TYPES:
                raise AlertConfigError(f"{where}: unknown sink type {kind!r}; use one of "
                                       f"{', '.join(sorted(SINK_TYPES))} (or set type:)")
            name = None if key == kind else str(key)
            sinks.append(_one(where, kind, name, entry, environ, injected))
    return sinks


def send_all(sinks: Iterable[Sink], message: AlertMessage) -> list[SendResult]:
    """Send to every sink; a sink's own bug becomes a ``failed`` result, not an exception."""
    results = []
    for sink in sinks:
        try:
            results.append(sink.send(message))
        except Exception as exc:  # a bug in one sink must not silence the others
            log.error("alert sink %s: unexpected %s", sink.label, type(exc).__name__)
            results.append(SendResult(sink=sink.label, status="failed",
                                      error=f"unexpected {type(exc).__name__}"))
    return results

