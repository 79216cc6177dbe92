"""Files written whole or not at all.

>>> import tempfile, pathlib
>>> path = pathlib.Path(tempfile.mkdtemp()) / "state.json"
>>> write_atomic(path, '{"step": 4}')
>>> path.read_text(), sorted(p.name for p in path.parent.iterdir())
('{"step": 4}', ['state.json'])
"""
from __future__ import annotations

import itertools
import os
from pathlib import Path

__all__ = ["write_atomic"]

_COUNT = itertools.count()


def write_atomic(path: str | os.PathLike, data: str | bytes, *, durable: bool = False) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` through a temporary file beside it and a
    rename, so a reader sees the old file or the new one, never a part. The temporary name
    is the process's and the call's own: threads and processes that write the same path at
    once do not write into each other's file. ``durable``: the bytes reach the disk before
    the rename (a power loss keeps the old file or the new one, not an empty one). The
    temporary file is removed when the write fails."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{next(_COUNT)}.tmp")
    try:
        with open(tmp, "wb") as out:
            out.write(data.encode("utf-8") if isinstance(data, str) else data)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
