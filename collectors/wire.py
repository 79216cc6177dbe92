"""SPEC JSON for the collector's own records, written by hand for speed.

The collector queues plain tuples on the training thread; the producer's thread turns them
into message values here. Formatting the few known fields directly is several times faster
than building a dict for ``json.dumps``, which matters because the encoding thread shares the
GIL with the training loop. Floats are written with ``repr`` (valid JSON for finite values);
NaN and infinities as the strings of SPEC §1. Anything unusual (extra fields) goes through
``trainguard.events.dumps``.

>>> enc = RecordEncoder(job="j1", node="n1", rank=3)
>>> enc.step(1764680000.5, 7, 0.25, 0.125, (float("nan"), 1.5, 4096, None, 3e-4, None))
b'{"v":1,"type":"step","job":"j1","ts":1764680000.5,"node":"n1","rank":3,"step":7,"step_time":0.25,"compute_time":0.125,"loss":"NaN","grad_norm":1.5,"lr":0.0003,"tokens":4096}'
>>> enc.heartbeat(1764680001.0, 4242, None, "forward", 1764680000.75, 0)
b'{"v":1,"type":"heartbeat","job":"j1","ts":1764680001.0,"node":"n1","rank":3,"pid":4242,"phase":"forward","phase_since":1764680000.75,"dropped":0,"step":null}'
"""
from __future__ import annotations

import json
import math

from trainguard import events as ev

__all__ = ["RecordEncoder", "json_number"]

_FIELDS = (("loss", 0), ("grad_norm", 1), ("loss_scale", 3), ("lr", 4))


def json_number(value) -> str:
    """A float or int as JSON; non-finite floats as SPEC strings.

    >>> json_number(0.1), json_number(3), json_number(float("-inf"))
    ('0.1', '3', '"-Infinity"')
    """
    if type(value) is int:
        return str(value)
    if value != value:
        return '"NaN"'
    if value == math.inf:
        return '"Infinity"'
    if value == -math.inf:
        return '"-Infinity"'
    return repr(float(value))


class RecordEncoder:
    """Encodes step and heartbeat records of one rank (``job``, ``node``, ``rank``)."""

    def __init__(self, *, job: str, node: str | None, rank: int):
        self.job = job
        self.node = node
        self.rank = rank
        self._job = json.dumps(job)
        self._tail = f',"node":{json.dumps(node)},"rank":{int(rank)}'
        self._phases: dict[str, str] = {}

    def step(self, ts: float, step: int, step_time: float, compute: float | None,
             values: tuple | None) -> bytes:
        parts = ['{"v":1,"type":"step","job":', self._job, ',"ts":', json_number(ts),
                 self._tail, ',"step":', str(step), ',"step_time":', json_number(step_time)]
        if compute is not None:
            parts += (',"compute_time":', json_number(compute))
        if values is not None:
            for name, i in _FIELDS:
                value = values[i]
                if type(value) is float or type(value) is int:
                    parts += (',"', name, '":', json_number(value))
            tokens = values[2]
            if type(tokens) is float and tokens.is_integer():
                tokens = int(tokens)
            if type(tokens) is int and tokens >= 0:
                parts += (',"tokens":', str(tokens))
            if values[5]:
                return self._with_extra("".join(parts) + "}", values[5])
        parts.append("}")
        return "".join(parts).encode()

    def heartbeat(self, ts: float, pid: int, step: int | None, phase: str, since: float,
                  dropped: int) -> bytes:
        phase_json = self._phases.get(phase)
        if phase_json is None:
            phase_json = self._phases[phase] = json.dumps(phase)
        return "".join((
            '{"v":1,"type":"heartbeat","job":', self._job, ',"ts":', json_number(ts),
            self._tail, ',"pid":', str(pid), ',"phase":', phase_json, ',"phase_since":',
            json_number(since), ',"dropped":', str(dropped), ',"step":',
            "null" if step is None else str(step), "}")).encode()

    @staticmethod
    def _with_extra(text: str, extra: dict) -> bytes:
        obj = json.loads(text)
        for name, value in extra.items():
            obj.setdefault(name, value)
        return ev.dumps(obj).encode()
