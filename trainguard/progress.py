"""Progress of long commands on a terminal (rich, on stderr): ``analyze`` and ``replay`` by
bytes of the recording read, ``record`` by events kept, the demo's set-up by stage.

Nothing is drawn, and rich is not imported, when stderr is not a terminal, when ``--json`` is
given, or without rich (the base install). Updates are throttled by time and come per chunk
or batch, never per event."""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

#: seconds between two redraw requests at most
UPDATE_EVERY_S = 0.1


def wanted(json_output: bool = False, stream=None) -> bool:
    """Whether a command draws progress: stderr (or ``stream``) is a terminal, no ``--json``."""
    stream = sys.stderr if stream is None else stream
    if json_output or os.environ.get("TERM") == "dumb":
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):   # closed or stand-in streams
        return False


def _rich_progress(*columns, transient: bool = True):
    """A started-to-be rich ``Progress`` on stderr, or None without rich."""
    try:
        from rich.console import Console
        from rich.progress import Progress
    except ImportError:
        return None
    return Progress(*columns, console=Console(stderr=True), transient=transient,
                    refresh_per_second=8)


class _Throttle:
    def __init__(self, every: float = UPDATE_EVERY_S, clock=time.monotonic):
        self.every = every
        self.clock = clock
        self._last = float("-inf")

    def due(self) -> bool:
        now = self.clock()
        if now - self._last < self.every:
            return False
        self._last = now
        return True


@contextmanager
def reading(path, label: str, enabled: bool):
    """Yields ``on_read(position)`` for :func:`trainguard.recording.read_events` (a position in
    the file on disk, compressed or not), or None when no progress is drawn."""
    size = _size(path)
    progress = _byte_progress() if enabled and size else None
    if progress is None:
        yield None
        return
    task = progress.add_task(label, total=size)
    throttle = _Throttle()

    def on_read(position: int) -> None:
        if throttle.due():
            progress.update(task, completed=position)

    with progress:
        yield on_read
        progress.update(task, completed=size)


def _size(path) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0


def _byte_progress():
    try:
        from rich.progress import (BarColumn, DownloadColumn, TaskProgressColumn, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)
    except ImportError:
        return None
    return _rich_progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                          DownloadColumn(), TimeElapsedColumn(), TimeRemainingColumn())


@contextmanager
def counting(label: str, enabled: bool, seconds: float | None = None):
    """Yields ``show(count, detail="")`` for a command that counts what it handled, such as
    ``record``; with ``seconds``, a bar of the time it runs. None when no progress is drawn."""
    progress = _count_progress(bounded=seconds is not None) if enabled else None
    if progress is None:
        yield None
        return
    task = progress.add_task(label, total=seconds, detail="0 events")
    began = time.monotonic()
    throttle = _Throttle()

    def show(count: int, detail: str = "") -> None:
        if throttle.due():
            progress.update(task, completed=time.monotonic() - began,
                            detail=f"{count} events" + (f", {detail}" if detail else ""))

    with progress:
        yield show


def _count_progress(bounded: bool):
    try:
        from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
    except ImportError:
        return None
    middle = (BarColumn(),) if bounded else (SpinnerColumn(),)
    return _rich_progress(TextColumn("{task.description}"), *middle,
                          TextColumn("{task.fields[detail]}"), TimeElapsedColumn())


class Stages:
    """The stages of a set-up, one spinner line: ``stage(text)`` names the one now running."""

    def __init__(self, label: str, enabled: bool):
        self.label = label
        self.enabled = enabled
        self._progress = None
        self._task = None

    def __enter__(self):
        if self.enabled:
            self._progress = _stage_progress()
        if self._progress is not None:
            self._task = self._progress.add_task(self.label, total=None, stage="")
            self._progress.start()
        return self

    def stage(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, stage=text)

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _stage_progress():
    try:
        from rich.progress import SpinnerColumn, TextColumn, TimeElapsedColumn
    except ImportError:
        return None
    return _rich_progress(SpinnerColumn(), TextColumn("{task.description}: {task.fields[stage]}"),
                          TimeElapsedColumn())
