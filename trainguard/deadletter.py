"""The dead-letter record: what the stream worker (and the action service, the node agent and
``trainguard run``) write to ``<prefix>.deadletter`` for every message they cannot use.

Value: one JSON object ``{"reason", "topic", "partition", "offset", "key_b64", "raw_b64",
"ts"}``: ``reason`` is the one-line validation error, ``topic``/``partition``/``offset``
locate the original message, ``key_b64``/``raw_b64`` are its key and value bytes in
base64 (``null`` where the message had none) and ``ts`` is the wall time at which the worker
dead-lettered it. The record's Kafka key is the original key, so a job's bad messages stay
together. A record that would exceed ``MAX_RECORD_BYTES`` keeps the first bytes of the value
(and of the key) only and says so: ``"truncated": true`` and the original sizes
``"raw_bytes"`` and ``"key_bytes"``; the reason is always kept.

>>> rec = deadletter_record(reason="not valid UTF-8 JSON", topic="tg.telemetry", partition=3,
...                         offset=41, key=b"j1/0", raw=b"\\xff garbage", ts=1764680000.0)
>>> back = parse_deadletter(rec)
>>> back["reason"], back["offset"], original_value(back)
('not valid UTF-8 JSON', 41, b'\\xff garbage')
>>> big = parse_deadletter(deadletter_record(reason="not valid UTF-8 JSON", topic="t",
...     partition=0, offset=1, key=b"j/0", raw=b"x" * 900_000, ts=1.0))
>>> big["truncated"], big["raw_bytes"], len(original_value(big)) < 400_000
(True, 900000, True)
"""
from __future__ import annotations

import base64
import json

__all__ = ["deadletter_record", "parse_deadletter", "original_value"]

MAX_REASON = 500
#: a record at most this large (base64 makes bytes a third larger): the broker's default
#: message limit is 1 MiB
MAX_RECORD_BYTES = 512 * 1024
#: of a larger message, the value keeps this many bytes, the key a thousand
KEEP_RAW_BYTES = 256 * 1024
KEEP_KEY_BYTES = 1024


def _b64(data) -> str | None:
    return None if data is None else base64.b64encode(bytes(data)).decode("ascii")


def deadletter_record(*, reason: str, topic: str, partition: int, offset: int, key, raw,
                      ts: float) -> bytes:
    record = {"reason": reason[:MAX_REASON], "topic": topic, "partition": partition,
              "offset": offset, "key_b64": _b64(key), "raw_b64": _b64(raw), "ts": ts}
    data = json.dumps(record, separators=(",", ":")).encode()
    if len(data) <= MAX_RECORD_BYTES:
        return data
    record.update(key_b64=_b64(None if key is None else bytes(key)[:KEEP_KEY_BYTES]),
                  raw_b64=_b64(None if raw is None else bytes(raw)[:KEEP_RAW_BYTES]),
                  truncated=True, raw_bytes=len(raw) if raw is not None else None,
                  key_bytes=len(key) if key is not None else None)
    return json.dumps(record, separators=(",", ":")).encode()


def parse_deadletter(value) -> dict:
    return json.loads(value)


def original_value(record: dict) -> bytes | None:
    raw = record.get("raw_b64")
    return None if raw is None else base64.b64decode(raw)
