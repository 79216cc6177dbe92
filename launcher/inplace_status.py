"""The link between ``trainguard run`` and the standby launcher it runs (``--standby``).

The launcher appends one JSON record per line to its ``--status`` file; ``trainguard run``
appends its requests to the launcher's ``--control`` file, which the launcher reads:

- ``{"op": "rollback", "id": ID, "step": S}``: stop every rank and let warm standbys take
  the ranks over, restoring the newest snapshot at or before step S (a NaN rollback without
  a relaunch). The launcher answers on the status file with ``{"event": "rollback", "id":
  ID, "step": S}``, or ``{"event": "rollback_refused", "id": ID, "reason": ...}`` when it
  cannot (too few standbys, restarts used up), and ``trainguard run`` relaunches instead.

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
import re
import time

__all__ = ["StatusReader", "StandbyLink", "append_record", "control_path"]


def control_path(status_path: str) -> str:
    """The control file beside a status file."""
    return os.path.join(os.path.dirname(status_path) or ".", "control.jsonl")


def append_record(path: str, record: dict) -> None:
    """One JSON line, appended in one write (the reader takes whole lines only)."""
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


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


class StandbyLink:
    """What ``trainguard run`` knows of its standby launcher: the ranks' processes, when
    standbys last took ranks over (``inplace_ts``), why the launcher gave up (``fallback``),
    and its answers to requests."""

    def __init__(self, status_path: str):
        self.reader = StatusReader(status_path)
        self.control = control_path(status_path)
        self.pids: dict = {}           # rank -> its process, in the standby launcher
        self.inplace_ts = 0.0
        self.fallback = None
        self._answers: dict = {}       # request id -> the launcher's answer
        self._takeovers: list = []
        self._failed = None            # the generation raised by a failure not yet taken over

    def news(self) -> list[dict]:
        """Read what the launcher wrote; returns the takeovers (``generation`` records) not
        returned before."""
        self._read()
        out, self._takeovers = self._takeovers, []
        return out

    def _read(self) -> None:
        for record in self.reader.new():
            event, ts = record.get("event"), record.get("ts")
            if event == "fallback":
                self.fallback = str(record.get("reason"))[:300]
                self._failed = None
            elif event == "failure" and type(record.get("generation")) is int:
                self._failed = record["generation"]
            elif event == "ranks" and isinstance(record.get("pids"), dict):
                self.pids = {int(r): pid for r, pid in record["pids"].items()
                             if re.fullmatch(r"[0-9]{1,9}", str(r)) and type(pid) is int}
            elif event == "generation" and type(ts) is float:
                self.inplace_ts = max(self.inplace_ts, ts)
                self._takeovers.append(record)
                if self._failed is not None and record.get("generation") == self._failed:
                    self._failed = None
            elif event in ("rollback", "rollback_refused") and type(record.get("id")) is str:
                self._answers[record["id"]] = record

    def settle(self, wait_s: float = 10.0, alive=lambda: True) -> bool:
        """Wait while a takeover is under way (a rank failed, its generation not yet taken
        over), so that an order about that failure is judged against its outcome; whether it
        is over."""
        deadline = time.monotonic() + wait_s
        self._read()
        while self._failed is not None and time.monotonic() < deadline and alive():
            time.sleep(0.02)
            self._read()
        return self._failed is None

    def forget(self) -> None:
        """The launcher was torn down: what it wrote is no news, and what was asked of it is
        not asked of the next one (its control file starts empty)."""
        self.reader.new()
        try:
            open(self.control, "w").close()
        except OSError:
            pass
        self.pids, self.fallback, self._answers, self._takeovers = {}, None, {}, []
        self._failed = None

    def pids_of(self, ranks: list, tree: set) -> list:
        """The processes of ``ranks``, each of which must be in ``tree`` (the command's
        processes: a pid is never taken on trust); none unless every rank named has one."""
        pids = [self.pids.get(rank) for rank in ranks]
        return pids if ranks and all(pid in tree for pid in pids) else []

    def rollback(self, step: int, request: str, wait_s: float = 5.0,
                 alive=lambda: True) -> dict | None:
        """Ask the launcher to roll back to ``step`` in place; its answer (a ``rollback`` or
        ``rollback_refused`` record), or None when it gave none within ``wait_s``."""
        append_record(self.control, {"op": "rollback", "id": request, "step": int(step)})
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and alive():
            self._read()
            if request in self._answers:
                return self._answers.pop(request)
            time.sleep(0.02)
        return None
