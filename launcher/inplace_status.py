"""The standby launcher's ``--status`` file, as ``trainguard run`` reads it.

>>> import json, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "status.jsonl")
>>> reader = StatusReader(path)
>>> reader.new()                                   # not written yet
[]
>>> with open(path, "a") as out:
...     _ = out.write(json.dumps({"event": "generation", "generation": 1, "ts": 5.0}) + "\\n")
...     _ = out.write('{"event": "fallb')          # a line being written
>>> reader.new()
[{'event': 'generation', 'generation': 1, 'ts': 5.0}]
>>> with open(path, "a") as out:
...     _ = out.write('ack"}\\nnot json\\n')
>>> reader.new()
[{'event': 'fallback'}]
"""
from __future__ import annotations

import json
import os

__all__ = ["StatusReader"]


class StatusReader:
    """The JSON records appended to ``path`` since the last :meth:`new` (whole lines only;
    a line that is not a JSON object is skipped)."""

    def __init__(self, path):
        self.path = path
        self.offset = 0

    def new(self) -> list[dict]:
        try:
            if os.stat(self.path).st_size <= self.offset:
                return []
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out
