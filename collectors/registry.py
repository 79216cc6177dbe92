"""The local registry of rank processes: one small JSON file per rank on its own machine.

Every collector writes ``<runtime_dir>/ranks/<job>/<rank>.json`` when it starts and removes it
when it closes. The node agent reads the folder to find the pids of a job's local ranks (for
stack capture) without needing Kafka. A file's fields: ``pid``, ``rank``, ``local_rank``,
``world_size``, ``job``, ``node``, ``start_time`` (Unix seconds), ``argv`` and, where the
collector installed the in-process stack handler, ``stack_signal`` (its signal number).

The runtime directory is ``$TRAINGUARD_HOME/run``, else ``~/.cache/trainguard/run``
(:func:`default_runtime_dir`; only ``trainguard.init`` and the agent read the environment).

>>> import tempfile, os
>>> reg = Registry(runtime_dir=tempfile.mkdtemp())
>>> path = reg.register({"job": "j1", "rank": 3, "pid": os.getpid(), "local_rank": 1})
>>> path.name, path.parent.name
('3.json', 'j1')
>>> [(e["job"], e["rank"]) for e in reg.entries(job="j1")]
[('j1', 3)]
>>> reg.unregister(job="j1", rank=3)
True
>>> reg.entries(job="j1")
[]
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

from trainguard.files import write_atomic

__all__ = ["Registry", "default_runtime_dir"]


def default_runtime_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$TRAINGUARD_HOME/run``, else ``~/.cache/trainguard/run``.

    >>> str(default_runtime_dir({"TRAINGUARD_HOME": "/opt/tg"}))
    '/opt/tg/run'
    """
    environ = os.environ if environ is None else environ
    home = environ.get("TRAINGUARD_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "trainguard"
    return base / "run"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Registry:
    """The rank files under ``runtime_dir``; writes are atomic (write, then rename)."""

    def __init__(self, runtime_dir: str | os.PathLike):
        self.runtime_dir = Path(runtime_dir)

    def path(self, job: str, rank: int) -> Path:
        return self.runtime_dir / "ranks" / job / f"{int(rank)}.json"

    def register(self, entry: Mapping) -> Path:
        """Write one rank's entry (needs ``job``, ``rank`` and ``pid``); returns its path."""
        path = self.path(entry["job"], entry["rank"])
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(dict(entry), sort_keys=True))
        return path

    def unregister(self, job: str, rank: int, pid: int | None = None) -> bool:
        """Remove the entry if it is this process's (or ``pid``'s); True when removed."""
        path = self.path(job, rank)
        pid = os.getpid() if pid is None else pid
        try:
            if json.loads(path.read_text(encoding="utf-8")).get("pid") != pid:
                return False  # a newer process of the same rank owns it now
            path.unlink()
            return True
        except (OSError, ValueError, AttributeError):
            return False

    def entries(self, job: str | None = None, alive_only: bool = True) -> list[dict]:
        """Entries of one job (or all), sorted by job and rank; dead pids left out."""
        root = self.runtime_dir / "ranks"
        folders = [root / job] if job is not None else sorted(p for p in root.glob("*")
                                                              if p.is_dir())
        out = []
        for folder in folders:
            for path in folder.glob("*.json"):
                try:
                    entry = json.loads(path.read_text(encoding="utf-8"))
                    pid = int(entry["pid"])
                except (OSError, ValueError, KeyError, TypeError):
                    continue
                if isinstance(entry, dict) and (not alive_only or _alive(pid)):
                    out.append(entry)
        return sorted(out, key=lambda e: (str(e.get("job")), e.get("rank", 0)))
