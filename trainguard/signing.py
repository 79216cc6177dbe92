"""HMAC signatures of orders, acks and commands, and the checks made before one is obeyed.

The signature is HMAC-SHA256, under a key shared by the action service, ``trainguard run``
and the node agents, over the *canonical JSON* of the message without its ``sig`` field:
keys sorted, no spaces, ASCII only, non-finite numbers as the strings of SPEC §1. The
message carries ``key_id`` (which key signed it, so keys can be rotated) and ``sig``
(hex). Its timestamp is the envelope's ``ts`` and its id the ``order_id`` or ``capture_id``;
both are signed, so neither can be changed without the key.

>>> keys = SigningKeys.parse("0123456789abcdef0123456789abcdef")
>>> from trainguard import events as ev
>>> order = sign(ev.Order(job="j1", ts=1000.0, order_id="o-1", op="restart",
...                       targets={"exclude_nodes": ["n3"]}), keys)
>>> order.key_id == keys.key_id, len(order.sig)
(True, 64)
>>> verifier = Verifier(keys, clock=lambda: 1001.0)
>>> wire = ev.encode(order)
>>> verifier.check(wire, order.order_id) is None
True
>>> verifier.check(wire, order.order_id).code             # the same order again
'replayed'
>>> forged = wire.replace(b'"n3"', b'"n4"')
>>> verifier.check(forged, "o-2").code
'bad_signature'

The key is read from the environment in one place only, :func:`signing_key_from_env`,
called by each service's entry point and handed down as a parameter.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass

from .errors import UserError
from .setting import setting

__all__ = ["KEY_ENV", "SigningKeys", "SigningError", "Freshness", "Refusal", "Verifier",
           "REFUSAL_CODES", "signing_key_from_env", "generate_key", "canonical", "sign", "sign_object",
           "warn_if_unsigned", "SecuritySettings"]

KEY_ENV = "TRAINGUARD_SIGNING_KEY"
MIN_KEY_CHARS = 16
#: why a message was refused; the same words are ack ``code``s and dead-letter reasons
REFUSAL_CODES = ("unsigned", "unknown_key", "bad_signature", "stale", "future", "replayed",
                 "malformed")


class SigningError(UserError):
    """The signing key is unusable; the message says how to mend it."""


def key_id(key: bytes) -> str:
    """Eight hex digits naming a key without giving it away."""
    return hashlib.sha256(b"trainguard-key-id:" + key).hexdigest()[:8]


@dataclass(frozen=True)
class SigningKeys:
    """The keys in use: the first signs, every one verifies (the others are the previous keys
    of a rotation)."""

    keys: tuple

    def __post_init__(self):
        if not self.keys:
            raise SigningError(f"{KEY_ENV} holds no key")
        for key in self.keys:
            if len(key) < MIN_KEY_CHARS:
                raise SigningError(f"a signing key must have at least {MIN_KEY_CHARS} "
                                   f"characters (got {len(key)}); make one with "
                                   "`python -c 'import secrets; print(secrets.token_hex(32))'`")

    @classmethod
    def parse(cls, text: str) -> "SigningKeys":
        """``KEY[,PREVIOUS_KEY...]``: comma-separated, the signing key first."""
        return cls(tuple(part.strip().encode() for part in text.split(",") if part.strip()))

    @property
    def key_id(self) -> str:
        return key_id(self.keys[0])

    def find(self, wanted: str):
        return next((k for k in self.keys if hmac.compare_digest(key_id(k), wanted)), None)

    def __repr__(self) -> str:  # never print a key
        return f"SigningKeys(key_ids={[key_id(k) for k in self.keys]})"


def signing_key_from_env(environ=None) -> SigningKeys | None:
    """The one place the signing key is read: ``TRAINGUARD_SIGNING_KEY`` (``KEY[,OLD...]``),
    None when unset or empty."""
    environ = os.environ if environ is None else environ
    text = environ.get(KEY_ENV, "").strip()
    return SigningKeys.parse(text) if text else None


def generate_key() -> str:
    """A fresh random key (256 bits, hex)."""
    return secrets.token_hex(32)


def canonical(obj: dict) -> bytes:
    """What is signed: the message without ``sig``, as canonical JSON.

    >>> canonical({"b": 1, "a": [1.5, "é"], "sig": "x"})
    b'{"a":[1.5,"\\\\u00e9"],"b":1}'
    """
    from .events import _nonfinite_as_strings

    body = {k: v for k, v in obj.items() if k != "sig"}
    return json.dumps(_nonfinite_as_strings(body), sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True, allow_nan=False).encode("ascii")


def _mac(key: bytes, body: bytes) -> str:
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def sign(event, keys: SigningKeys | None):
    """``event`` with ``key_id`` and ``sig`` set (declared fields of orders, acks and
    commands; extra fields of other types, such as the ``action`` records of the audit log);
    unchanged without keys."""
    if keys is None:
        return event
    from .events import to_dict

    if "sig" in event.OPTIONAL:
        unsigned = event.replace(key_id=keys.key_id, sig=None)
        return unsigned.replace(sig=_mac(keys.keys[0], canonical(to_dict(unsigned))))
    extra = {k: v for k, v in event.extra.items() if k != "sig"}
    unsigned = event.replace(extra={**extra, "key_id": keys.key_id})
    mac = _mac(keys.keys[0], canonical(to_dict(unsigned)))
    return unsigned.replace(extra={**unsigned.extra, "sig": mac})


def sign_object(obj: dict, keys: SigningKeys | None) -> dict:
    """A plain JSON object (a record that is no event, such as a config override) with
    ``key_id`` and ``sig`` set; unchanged without keys."""
    if keys is None:
        return obj
    unsigned = {k: v for k, v in obj.items() if k != "sig"}
    unsigned["key_id"] = keys.key_id
    return {**unsigned, "sig": _mac(keys.keys[0], canonical(unsigned))}


@dataclass(kw_only=True, frozen=True)
class Freshness:
    """How old a message may be, and how far in the future its clock may run (skew between
    machines), in seconds."""

    max_age_s: float = 120.0
    max_skew_s: float = 30.0

    def __post_init__(self):
        for name in ("max_age_s", "max_skew_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


@dataclass(frozen=True)
class Refusal:
    """Why a message is not obeyed: ``code`` (one of :data:`REFUSAL_CODES`) and a sentence."""

    code: str
    reason: str

    def __str__(self) -> str:
        return f"{self.code}: {self.reason}"


class Verifier:
    """Signature (with keys), freshness and replay checks of received messages.

    Without keys, signatures are not checked (anyone who can write the topic is obeyed; the
    services say so loudly at start-up), but stale, future and replayed messages are still
    refused. An id is remembered only once every check passed, for as long as a message of
    that age could still pass (``max_age_s + max_skew_s``), at most ``remember`` of them.
    """

    def __init__(self, keys: SigningKeys | None = None, *, freshness: Freshness | None = None,
                 remember: int = 100_000, clock=time.time):
        self.keys = keys
        self.freshness = freshness or Freshness()
        self.remember = remember
        self.clock = clock
        self._seen = OrderedDict()

    def check(self, raw, ident: str) -> Refusal | None:
        """None when the message (raw bytes, or its parsed JSON object) may be obeyed, else
        the :class:`Refusal`. ``ident`` is its order or capture id."""
        obj = _parsed(raw)
        if isinstance(obj, Refusal):
            return obj
        refusal = self._signature(obj)
        if refusal is None:
            refusal = self._fresh(obj)
        if refusal is None:
            refusal = self._first(ident)
        return refusal

    def check_signature(self, raw) -> Refusal | None:
        """The signature check alone (for acks and records read back later, whose age and
        repetition are judged elsewhere)."""
        obj = _parsed(raw)
        return obj if isinstance(obj, Refusal) else self._signature(obj)

    def _signature(self, obj: dict) -> Refusal | None:
        if self.keys is None:
            return None
        sig, kid = obj.get("sig"), obj.get("key_id")
        if sig is None and kid is None:
            return Refusal("unsigned", "no signature, and a signing key is configured")
        if type(sig) is not str or type(kid) is not str:
            return Refusal("malformed", "sig and key_id must both be strings")
        key = self.keys.find(kid)
        if key is None:
            return Refusal("unknown_key", f"signed with key {kid[:8]!r}, which is not "
                                          "configured here")
        try:
            expected = _mac(key, canonical(obj))
        except (TypeError, ValueError) as exc:
            return Refusal("malformed", f"cannot be put in canonical form: {exc}")
        if not hmac.compare_digest(expected, sig):
            return Refusal("bad_signature", "the signature does not match the message")
        return None

    def _fresh(self, obj: dict) -> Refusal | None:
        ts = obj.get("ts")
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            return Refusal("malformed", f"ts {ts!r} is not a finite number")
        now = self.clock()
        f = self.freshness
        if now - ts > f.max_age_s:
            return Refusal("stale", f"sent {now - ts:.0f}s ago (accepted up to "
                                    f"{f.max_age_s:g}s)")
        if ts - now > f.max_skew_s:
            return Refusal("future", f"stamped {ts - now:.0f}s in the future (clock skew "
                                     f"allowed up to {f.max_skew_s:g}s)")
        return None

    def _first(self, ident: str) -> Refusal | None:
        now = self.clock()
        horizon = now - self.freshness.max_age_s - self.freshness.max_skew_s
        seen = self._seen
        while seen and (next(iter(seen.values())) < horizon or len(seen) >= self.remember):
            seen.popitem(last=False)
        if ident in seen:
            return Refusal("replayed", f"id {ident[:80]!r} was already received")
        seen[ident] = now
        return None


def _parsed(raw):
    """The JSON object of a message, parsed with the standard library: it keeps integers of
    any size exactly, as the sender's canonical form has them."""
    try:
        if isinstance(raw, (bytes, bytearray, memoryview)):
            raw = bytes(raw).decode("utf-8")
        obj = json.loads(raw) if isinstance(raw, str) else raw
    except (UnicodeDecodeError, ValueError, RecursionError):
        return Refusal("malformed", "not valid JSON")
    return obj if type(obj) is dict else Refusal("malformed", "not a JSON object")


def warn_if_unsigned(keys: SigningKeys | None, service: str, what: str) -> None:
    """One loud start-up line when no signing key is configured."""
    if keys is not None:
        return
    from trainguard.logs import configured

    text = (f"WARNING: no signing key ({KEY_ENV} is not set): {what} are neither signed nor "
            "checked, so anyone who can write to Kafka can forge them. Set the same key for "
            "every service (see docs/SECURITY.md).")
    if configured():          # the command's log (trainguard.logs): its format, its level
        import logging

        logging.getLogger(f"trainguard.{service}.signing").warning(f"*** {text} ***")
        return
    print(f"*** trainguard {service}: {text} ***", file=sys.stderr, flush=True)


@dataclass(kw_only=True)
class SecuritySettings:
    """The ``security`` section of the configuration tree."""

    signing_key: str | None = setting(None, "shared key that signs orders and commands (HMAC); "
                                            "masked when shown", env=KEY_ENV,
                                      secret=True, kind=str, min_length=1)
