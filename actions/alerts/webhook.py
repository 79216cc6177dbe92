"""A generic webhook: the SPEC anomaly and action JSON, with the rendered text beside them.

Body (``"version": 1``)::

    {"version": 1, "source": "trainguard", "state": "firing" | "resolved",
     "incident": "...", "job": "...", "kind": "...", "severity": "...",
     "ranks": [...], "nodes": [...], "title": "...", "text": "...", "stacks": "..." | null,
     "anomaly": {SPEC anomaly envelope} | null, "actions": [{SPEC action}, ...]}

With a ``secret`` the request carries ``X-Trainguard-Timestamp: <unix seconds>`` and
``X-Trainguard-Signature: sha256=<hex HMAC-SHA256 of "<timestamp>." + body, keyed by the
secret>``; a receiver recomputes it and refuses a stale timestamp.

>>> webhook_signature(b'{"a":1}', "s3cret", 1764680000)
'sha256=c0b85eee64101f4594cabda10436dc4aec5e7b168ce790428a0c118e40253ef9'
"""
from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Callable, ClassVar

from .base import HttpRequest, Sink, dumps
from .message import AlertMessage

__all__ = ["WebhookSink", "webhook_signature"]


def webhook_signature(body: bytes, secret: str, timestamp: int) -> str:
    mac = hmac.new(secret.encode("utf-8"), f"{timestamp}.".encode("ascii") + body,
                   hashlib.sha256)
    return "sha256=" + mac.hexdigest()


@dataclass(kw_only=True, repr=False, eq=False)
class WebhookSink(Sink):
    """``url``: where to POST; ``secret``: HMAC signing key; ``bearer_token``: sent as
    ``Authorization: Bearer``. All three are secrets."""

    KIND: ClassVar[str] = "webhook"
    SECRETS: ClassVar[tuple[str, ...]] = ("url", "secret", "bearer_token")

    url: str
    secret: str | None = None
    bearer_token: str | None = None
    wall_clock: Callable[[], float] = time.time

    def payload(self, message: AlertMessage) -> dict:
        return {"version": 1, "source": "trainguard", "state": message.state,
                "incident": message.incident, "job": message.job, "kind": message.kind,
                "severity": message.severity, "ranks": message.ranks, "nodes": message.nodes,
                "title": message.title, "text": message.text(), "stacks": message.stacks,
                "note": message.note, "anomaly": message.anomaly, "actions": message.actions}

    def request(self, message: AlertMessage) -> HttpRequest:
        body = dumps(self.payload(message))
        headers = {}
        if self.secret:
            ts = int(self.wall_clock())
            headers["X-Trainguard-Timestamp"] = str(ts)
            headers["X-Trainguard-Signature"] = webhook_signature(body, self.secret, ts)
        if self.bearer_token:
            headers["Authorization"] = f"Bearer {self.bearer_token}"
        return HttpRequest(url=self.url, body=body, headers=headers)
