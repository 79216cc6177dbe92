"""Keeping what the worker writes under the broker's message size limit (1 MiB by default):
an oversized anomaly is shortened, never dropped.

Long strings in the ``summary`` and ``evidence`` are cut (``" [truncated from N chars]"``
appended) and ``evidence["truncated"]`` is set; if that is not enough the evidence keeps
only that mark. Dead-letter records are shortened in :mod:`.deadletter`.

>>> from trainguard import events as ev
>>> a = ev.Anomaly(job="j", ts=1.0, id="a1", kind="crash", severity="critical", ranks=[0],
...                nodes=[], onset_ts=1.0, detected_ts=1.0, detector="crash",
...                summary="rank 0 exited by signal " + "X" * 600_000,
...                evidence={"signal": "X" * 600_000})
>>> data = encode_anomaly(a, max_bytes=4096)
>>> back = ev.decode(data)
>>> len(data) <= 4096, back.evidence["truncated"], back.summary[-32:]
(True, True, 'XX [truncated from 600024 chars]')
"""
from __future__ import annotations

from trainguard import events as ev

__all__ = ["encode_anomaly", "encode_finding", "cut", "MAX_RECORD_BYTES"]

#: what the worker writes to a SPEC topic at most: well under the broker's default 1 MiB
MAX_RECORD_BYTES = 512 * 1024


def cut(text: str, limit: int) -> str:
    """``text`` at most about ``limit`` characters, saying how long it was.

    >>> cut("abcdefgh", 3), cut("abc", 3)
    ('abc [truncated from 8 chars]', 'abc')
    """
    if len(text) <= limit:
        return text
    return f"{text[:limit]} [truncated from {len(text)} chars]"


def _cut_tree(value, limit: int):
    t = type(value)
    if t is str:
        return cut(value, limit)
    if t is dict:
        return {cut(str(k), limit): _cut_tree(v, limit) for k, v in value.items()}
    if t is list or t is tuple:
        items = [_cut_tree(v, limit) for v in value[:limit]]
        if len(value) > limit:
            items.append(f"[truncated from {len(value)} items]")
        return items
    return value


def encode_anomaly(anomaly: ev.Anomaly, max_bytes: int = MAX_RECORD_BYTES) -> bytes:
    """``ev.encode(anomaly)``, shortened to at most ``max_bytes`` when it is larger."""
    data = ev.encode(anomaly)
    if len(data) <= max_bytes:
        return data
    for limit in (4096, 512, 64):
        evidence = _cut_tree(anomaly.evidence, limit)
        evidence["truncated"] = True
        data = ev.encode(anomaly.replace(summary=cut(anomaly.summary, limit),
                                         evidence=evidence))
        if len(data) <= max_bytes:
            return data
    return ev.encode(anomaly.replace(summary=cut(anomaly.summary, 64),
                                     evidence={"truncated": True}))


def encode_finding(event, max_bytes: int = MAX_RECORD_BYTES) -> bytes:
    """An anomaly as :func:`encode_anomaly` does; an incident with its summary cut until it
    fits (its id list is bounded by the event type)."""
    if event.TYPE != "incident":
        return encode_anomaly(event, max_bytes)
    data = ev.encode(event)
    for limit in (4096, 512, 64):
        if len(data) <= max_bytes:
            break
        data = ev.encode(event.replace(summary=cut(event.summary, limit)))
    return data
