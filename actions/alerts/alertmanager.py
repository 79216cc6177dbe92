"""Prometheus Alertmanager, API v2: ``POST /api/v2/alerts`` with one postable alert.

Labels identify the alert, so a firing and its resolution must carry the same ones:
``alertname`` (``Trainguard`` + the kind in CamelCase, unless configured), ``training_job``
(the training job's id: not ``job``, which is Prometheus's own label, the scrape job), ``kind``,
``severity``, ``ranks`` (compact ranges, ``"0-3,6"``), ``nodes`` (comma-separated), and
``incident``, plus any ``extra_labels``. Annotations: ``summary`` (the title and what
happened) and ``description`` (the whole text, stacks included).

A firing alert is sent with ``endsAt = ts + firing_for`` (default one hour), so that it stays
active without the re-sending Prometheus does; a resolved one with ``endsAt = ts``.

>>> from trainguard.actions.alerts.message import AlertMessage
>>> m = AlertMessage(incident="i-9", job="j1", kind="gpu_fault", severity="critical",
...                  summary="Xid 79 on GPU 3", ranks=[25, 24], nodes=["n4"],
...                  onset_ts=1764680000.0, ts=1764680010.0)
>>> sink = AlertmanagerSink(url="http://127.0.0.1:9093")
>>> [a] = sink.payload(m)
>>> a["labels"]
{'alertname': 'TrainguardGpuFault', 'training_job': 'j1', 'kind': 'gpu_fault', 'severity': 'critical', 'ranks': '24-25', 'nodes': 'n4', 'incident': 'i-9'}
>>> a["startsAt"], a["endsAt"]
('2025-12-02T12:53:20.000Z', '2025-12-02T13:53:30.000Z')
>>> sink.payload(m.resolved(ts=1764680100.0))[0]["endsAt"]
'2025-12-02T12:55:00.000Z'
"""
from __future__ import annotations

import datetime as _dt
import re
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar

from .base import HttpRequest, Sink, dumps
from .message import AlertMessage, format_ranks

__all__ = ["AlertmanagerSink", "rfc3339"]

LABEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: labels of every alert; ``job`` too, Prometheus's own (an alert's scrape job), so that
#: an extra label cannot make a trainguard alert look like one of a scrape job
RESERVED = ("alertname", "training_job", "job", "kind", "severity", "ranks", "nodes",
            "incident")


def rfc3339(ts: float) -> str:
    """UTC time with milliseconds, as Alertmanager takes it.

    >>> rfc3339(0.25)
    '1970-01-01T00:00:00.250Z'
    """
    d = _dt.datetime.fromtimestamp(ts, _dt.timezone.utc)
    return d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond // 1000:03d}Z"


def _camel(kind: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[^A-Za-z0-9]+", kind))


@dataclass(kw_only=True, repr=False, eq=False)
class AlertmanagerSink(Sink):
    """``url``: Alertmanager's base URL (``http://host:9093``; user info becomes basic auth);
    ``bearer_token``: for an Alertmanager behind an authenticating proxy."""

    KIND: ClassVar[str] = "alertmanager"
    SECRETS: ClassVar[tuple[str, ...]] = ("url", "bearer_token")

    url: str
    alertname: str | None = None
    extra_labels: dict = field(default_factory=dict)
    firing_for: float = 3600.0
    generator_url: str | None = None
    bearer_token: str | None = None
    wall_clock: Callable[[], float] = time.time

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.extra_labels, dict):
            raise ValueError("extra_labels must be a table of label names to strings, like "
                             f"{{\"cluster\": \"c1\"}}, got {type(self.extra_labels).__name__}")
        for name, value in self.extra_labels.items():
            if not LABEL_NAME.fullmatch(str(name)) or name in RESERVED:
                raise ValueError(f"extra label {name!r}: must match {LABEL_NAME.pattern} and "
                                 f"not be one of {', '.join(RESERVED)}")
            if not isinstance(value, str):
                raise ValueError(f"extra label {name!r}: value must be a string")
        if not self.firing_for > 0:
            raise ValueError("firing_for must be > 0 seconds")

    @property
    def endpoint(self) -> str:
        return self.url.rstrip("/") + "/api/v2/alerts"

    def labels(self, message: AlertMessage) -> dict:
        return {"alertname": self.alertname or f"Trainguard{_camel(message.kind)}",
                "training_job": message.job, "kind": message.kind, "severity": message.severity,
                "ranks": format_ranks(message.ranks), "nodes": ",".join(message.nodes),
                "incident": message.incident, **self.extra_labels}

    def payload(self, message: AlertMessage) -> list[dict]:
        now = message.ts if message.ts is not None else self.wall_clock()
        starts = message.onset_ts if message.onset_ts is not None else now
        ends = now if message.state == "resolved" else now + self.firing_for
        alert = {"labels": self.labels(message),
                 "annotations": {"summary": f"{message.title}: {message.what()}",
                                 "description": message.text()},
                 "startsAt": rfc3339(min(starts, ends)), "endsAt": rfc3339(ends)}
        if self.generator_url:
            alert["generatorURL"] = self.generator_url
        return [alert]

    def request(self, message: AlertMessage) -> HttpRequest:
        headers = {"Authorization": f"Bearer {self.bearer_token}"} if self.bearer_token else {}
        return HttpRequest(url=self.endpoint, body=dumps(self.payload(message)), headers=headers)
