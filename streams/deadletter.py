"""The dead-letter record: what the worker writes to ``<prefix>.deadletter`` for every
message it cannot use.

Value: one JSON object ``{"reason", "topic", "partition", "offset", "key_b64", "raw_b64",
"ts"}``: ``reason`` is the one-line validation error, ``topic``/``partition``/``offset``
locate the original message, ``key_b64``/``raw_b64`` are its key and value bytes in
base64 (``null`` where the message had none) and ``ts`` is the wall time at which the worker
dead-lettered it. The record's Kafka key is the original key, so a job's bad messages stay
together.

>>> rec = deadletter_record(reason="not valid UTF-8 JSON", topic="tg.telemetry", partition=3,
...                         offset=41, key=b"j1/0", raw=b"\\xff garbage", ts=1764680000.0)
>>> back = parse_deadletter(rec)
>>> back["reason"], back["offset"], original_value(back)
('not valid UTF-8 JSON', 41, b'\\xff garbage')
"""
from __future__ import annotations

import base64
import json

__all__ = ["deadletter_record", "parse_deadletter", "original_value"]

MAX_REASON = 500


def _b64(data) -> str | None:
    return None if data is None else base64.b64encode(bytes(data)).decode("ascii")


def deadletter_record(*, reason: str, topic: str, partition: int, offset: int, key, raw,
                      ts: float) -> bytes:
    return json.dumps({"reason": reason[:MAX_REASON], "topic": topic, "partition": partition,
                       "offset": offset, "key_b64": _b64(key), "raw_b64": _b64(raw),
                       "ts": ts}, separators=(",", ":")).encode()


def parse_deadletter(value) -> dict:
    return json.loads(value)


def original_value(record: dict) -> bytes | None:
    raw = record.get("raw_b64")
    return None if raw is None else base64.b64decode(raw)
