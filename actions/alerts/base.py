"""What every alert sink shares: delivery with retries, de-duplication, a rate limit, masking.

A sink's constructor is its configuration. ``send(message)`` never raises for a network or
receiver failure; it returns a :class:`SendResult`. Each sink:

1. drops a message whose ``(incident, state)`` it already delivered within ``dedup_window``;
2. takes a token from its own bucket (``rate_per_minute``, ``burst``) or answers
   ``rate_limited``;
3. POSTs with a timeout, retrying connection errors, timeouts, 408/425/429 and 5xx with
   exponential backoff (``backoff * 2**n``, at most ``backoff_max``, longer if the receiver
   sends ``Retry-After``, still capped).

Secrets (webhook URLs, signing keys, tokens) are never put in ``repr``, ``str``, log records
or error texts: a URL shows as ``scheme://host/***``.

>>> mask_url("https://hooks.slack.com/services/T000/B000/XXXX")
'https://hooks.slack.com/***'
>>> mask_url("http://admin:pw@127.0.0.1:9093")
'http://127.0.0.1:9093/***'
"""
from __future__ import annotations

import base64
import json
import logging
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar

from .message import AlertMessage

__all__ = ["Delivery", "TokenBucket", "Deduper", "SendResult", "HttpRequest", "Sink",
           "SinkFailure", "mask_url", "RESULT_STATUSES"]

log = logging.getLogger("trainguard.actions.alerts")

RESULT_STATUSES = ("sent", "failed", "rate_limited", "deduplicated")
RETRYABLE_HTTP = frozenset({408, 425, 429, 500, 502, 503, 504})
MAX_BODY = 64 * 1024
TOKEN_MIN = 16  # a URL piece this long is taken for a token and scrubbed from errors


def mask_url(url: str | None) -> str:
    """Scheme and host of a URL, nothing of its path, query or user info."""
    if not url:
        return "***"
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or "?"
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "***"
    return f"{parts.scheme}://{host}{port}/***"


@dataclass(kw_only=True)
class Delivery:
    """How hard a sink tries, and how often it may speak."""

    timeout: float = 5.0
    retries: int = 3
    backoff: float = 0.5
    backoff_max: float = 8.0
    dedup_window: float = 300.0
    rate_per_minute: float = 20.0
    burst: int = 5

    def __post_init__(self):
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
        if not (isinstance(self.retries, int) and 0 <= self.retries <= 20):
            raise ValueError(f"retries must be an int in 0..20, got {self.retries!r}")
        if self.backoff < 0 or self.backoff_max < self.backoff:
            raise ValueError("need 0 <= backoff <= backoff_max")
        if self.dedup_window < 0:
            raise ValueError("dedup_window must be >= 0 seconds")
        if not self.rate_per_minute > 0 or not (isinstance(self.burst, int) and self.burst >= 1):
            raise ValueError("rate_per_minute must be > 0 and burst an int >= 1")

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based).

        >>> d = Delivery(backoff=0.5, backoff_max=3.0)
        >>> [d.delay(n) for n in (1, 2, 3, 4)], d.delay(1, retry_after=2.0)
        ([0.5, 1.0, 2.0, 3.0], 2.0)
        """
        wait = self.backoff * 2 ** (attempt - 1)
        if retry_after is not None:
            wait = max(wait, retry_after)
        return min(wait, self.backoff_max)


@dataclass(kw_only=True)
class TokenBucket:
    """``rate`` tokens per second up to ``burst``; ``clock`` is injected.

    >>> now = [0.0]
    >>> b = TokenBucket(rate=0.5, burst=2, clock=lambda: now[0])
    >>> [b.take() for _ in range(3)]
    [True, True, False]
    >>> now[0] = 2.0
    >>> b.take(), b.take()
    (True, False)
    """

    rate: float
    burst: int
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self):
        if not self.rate > 0 or self.burst < 1:
            raise ValueError("TokenBucket needs rate > 0 and burst >= 1")
        self._tokens = float(self.burst)
        self._last = self.clock()

    def take(self) -> bool:
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
        self._last = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


@dataclass(kw_only=True)
class Deduper:
    """Remembers keys for ``window`` seconds of ``clock``.

    >>> now = [0.0]
    >>> d = Deduper(window=60, clock=lambda: now[0])
    >>> d.seen("k"), d.mark("k"), d.seen("k")
    (False, None, True)
    >>> now[0] = 61.0
    >>> d.seen("k")
    False
    """

    window: float
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self):
        self._at: dict[Any, float] = {}

    def seen(self, key: Any) -> bool:
        now = self.clock()
        for k in [k for k, t in self._at.items() if now - t >= self.window]:
            del self._at[k]
        return key in self._at

    def mark(self, key: Any) -> None:
        self._at[key] = self.clock()

    def forget(self, key: Any) -> None:
        self._at.pop(key, None)


@dataclass(kw_only=True, frozen=True)
class SendResult:
    """What became of one message at one sink.

    ``action_status`` maps to the SPEC ``action`` status (``None`` for a duplicate, which
    needs no record).
    """

    sink: str
    status: str
    attempts: int = 0
    http_status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "sent"

    @property
    def action_status(self) -> str | None:
        return {"sent": "done", "failed": "failed", "rate_limited": "rate_limited"}.get(self.status)


@dataclass(kw_only=True)
class HttpRequest:
    """One POST: where, the JSON body as bytes, extra headers."""

    url: str
    body: bytes
    headers: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"HttpRequest(url={mask_url(self.url)!r}, body={len(self.body)} bytes)"


class SinkFailure(Exception):
    """One failed attempt; ``retryable`` says whether another may succeed."""

    def __init__(self, message: str, *, retryable: bool, http_status: int | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.retryable = retryable
        self.http_status = http_status
        self.retry_after = retry_after


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def _retry_after(headers: Any) -> float | None:
    try:
        value = headers.get("Retry-After") if headers is not None else None
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


@dataclass(kw_only=True, repr=False, eq=False)
class Sink:
    """Base of all sinks. Subclasses set ``KIND`` and ``SECRETS`` and implement ``request``."""

    KIND: ClassVar[str] = "sink"
    SECRETS: ClassVar[tuple[str, ...]] = ("url",)

    name: str | None = None
    delivery: Delivery = field(default_factory=Delivery)
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self):
        self._lock = threading.Lock()
        self._bucket = TokenBucket(rate=self.delivery.rate_per_minute / 60.0,
                                   burst=self.delivery.burst, clock=self.clock)
        self._dedup = Deduper(window=self.delivery.dedup_window, clock=self.clock)

    @property
    def label(self) -> str:
        return self.name or self.KIND

    # ------------------------------------------------------------------ for subclasses
    def request(self, message: AlertMessage) -> HttpRequest:
        raise NotImplementedError

    def check(self, status: int, body: bytes) -> None:
        """Raise :class:`SinkFailure` when a 2xx answer still means failure."""

    # ------------------------------------------------------------------ sending
    def send(self, message: AlertMessage) -> SendResult:
        key = message.dedup_key
        with self._lock:
            if self._dedup.seen(key):
                log.debug("alert sink %s: %s/%s already sent", self.label, *key)
                return SendResult(sink=self.label, status="deduplicated")
            if not self._bucket.take():
                log.warning("alert sink %s: rate limit reached, dropped %s/%s", self.label, *key)
                return SendResult(sink=self.label, status="rate_limited")
            self._dedup.mark(key)
        result = self._deliver(message)
        with self._lock:
            if not result.ok:
                self._dedup.forget(key)
            elif message.state == "resolved":
                self._dedup.forget((message.incident, "firing"))
        return result

    def _deliver(self, message: AlertMessage) -> SendResult:
        d = self.delivery
        failure: SinkFailure | None = None
        for attempt in range(1, d.retries + 2):
            try:
                status = self._post(self.request(message))
                log.info("alert sink %s: sent %s/%s (HTTP %s)", self.label,
                         message.incident, message.state, status)
                return SendResult(sink=self.label, status="sent", attempts=attempt,
                                  http_status=status)
            except SinkFailure as exc:
                failure = exc
            log.warning("alert sink %s: attempt %d of %d failed: %s", self.label, attempt,
                        d.retries + 1, failure)
            if not failure.retryable or attempt == d.retries + 1:
                break
            self.sleep(d.delay(attempt, failure.retry_after))
        return SendResult(sink=self.label, status="failed", attempts=attempt,
                          http_status=failure.http_status, error=str(failure))

    def _post(self, req: HttpRequest) -> int:
        url, headers = req.url, {"Content-Type": "application/json; charset=utf-8",
                                 "User-Agent": "trainguard-alerts/1", **req.headers}
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise SinkFailure(f"URL scheme must be http or https, got {parts.scheme!r}",
                              retryable=False)
        if parts.username is not None:
            cred = f"{urllib.parse.unquote(parts.username)}:" \
                   f"{urllib.parse.unquote(parts.password or '')}"
            headers.setdefault("Authorization",
                               "Basic " + base64.b64encode(cred.encode()).decode())
            netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
            url = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
        http_req = urllib.request.Request(url, data=req.body, headers=headers, method="POST")
        try:
            with _OPENER.open(http_req, timeout=self.delivery.timeout) as resp:
                status, body = resp.status, resp.read(MAX_BODY)
        except urllib.error.HTTPError as exc:
            body = b""
            try:
                body = exc.read(MAX_BODY)
            except Exception:
                pass
            finally:
                exc.close()
            hint = " (redirects are not followed)" if 300 <= exc.code < 400 else ""
            raise SinkFailure(self._scrub(f"HTTP {exc.code}{hint}: {_snippet(body)}"),
                              retryable=exc.code in RETRYABLE_HTTP or exc.code >= 500,
                              http_status=exc.code,
                              retry_after=_retry_after(exc.headers)) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise SinkFailure(self._scrub(f"{type(exc).__name__}: {reason}"),
                              retryable=not isinstance(exc, ValueError)) from None
        self.check(status, body)
        return status

    # ------------------------------------------------------------------ secrets
    def _secret_values(self) -> list[str]:
        values = []
        for name in self.SECRETS:
            value = getattr(self, name, None)
            if isinstance(value, str) and value:
                values.append(value)
                parts = urllib.parse.urlsplit(value)
                pieces = [parts.path, parts.query, parts.password or "",
                          *parts.path.split("/"),
                          *(v for _, v in urllib.parse.parse_qsl(parts.query))]
                values += [p for p in pieces if len(p) >= TOKEN_MIN]
                values += _basic_auth_forms(parts)
        return sorted(set(values), key=len, reverse=True)

    def _scrub(self, text: str) -> str:
        for secret in self._secret_values():
            text = text.replace(secret, "***")
        return _AUTH_HEADER_RE.sub(r"\1 ***", text)

    def __repr__(self) -> str:
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("sleep", "clock", "wall_clock", "delivery") or value is None:
                continue
            if f.name in self.SECRETS:
                text = mask_url(value) if f.name.endswith("url") else "***"
                shown.append(f"{f.name}='{text}'")
            else:
                shown.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(shown)})"

    __str__ = __repr__


#: an ``Authorization`` value a receiver echoes back: whatever its credentials, never shown
_AUTH_HEADER_RE = re.compile(r"(?i)\b(Basic|Bearer|Token)\s+[A-Za-z0-9+/=._~-]{4,}")


def _basic_auth_forms(parts) -> list[str]:
    """The forms in which a URL's user info can come back: the password (however short),
    ``user:password`` raw and percent-decoded, and its base64 as sent in the header."""
    if parts.password is None:
        return []
    user = urllib.parse.unquote(parts.username or "")
    password = urllib.parse.unquote(parts.password)
    cred = f"{user}:{password}"
    forms = [parts.password, password, cred, base64.b64encode(cred.encode()).decode()]
    return [f for f in forms if f]


def _snippet(body: bytes) -> str:
    text = body[:200].decode("utf-8", "replace").strip()
    return text or "(empty body)"


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON, refusing NaN (messages are made JSON-safe before)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode("utf-8")
