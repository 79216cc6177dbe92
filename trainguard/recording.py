"""SPEC §3 recordings: JSON Lines of envelopes, plain, gzip or zstd.

>>> import tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "r.jsonl.gz")
>>> with RecordingWriter(path) as out:
...     out.write_raw(b'{"v":1,"type":"heartbeat","job":"j","ts":1,"pid":1,"phase":"idle",'
...                   b'"phase_since":1,"dropped":0}')
...     out.write_raw(b'not json')
>>> stats = ReadStats()
>>> [e.type for e in read_events(path, stats)], stats.invalid
(['heartbeat'], 1)
"""
from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator

from .errors import UserError
from .events import Event, InvalidEvent, decode

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
_CHUNK = 1 << 20


class RecordingError(UserError):
    """The recording cannot be opened (missing, unreadable, unknown compression)."""


def _open_binary(path: Path, mode: str) -> IO[bytes]:
    name = path.name
    if name.endswith(".gz"):
        return gzip.open(path, mode)
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raise RecordingError(f"{path}: reading .zst needs the zstandard package") from None
        if "r" in mode:
            return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"))
        return zstandard.ZstdCompressor().stream_writer(open(path, "wb"))
    return open(path, mode)


def _zstd_chunks(path: Path, on_read=None) -> Iterator[bytes]:
    """Decompressed pieces of a ``.zst`` file of one or more frames; a file that ends inside
    a frame (a recorder killed mid-write, a cut download) is an error, not a short read."""
    import zstandard

    decompressor = zstandard.ZstdDecompressor()
    frame = decompressor.decompressobj()
    fed = False
    with open(path, "rb") as raw:
        while True:
            data = raw.read(_CHUNK)
            if not data:
                break
            if on_read is not None:
                on_read(raw.tell())
            while data:
                fed = True
                out = frame.decompress(data)
                if out:
                    yield out
                if not frame.eof:
                    break
                data, frame, fed = frame.unused_data, decompressor.decompressobj(), False
    if fed:
        raise EOFError("the file ends inside a zstd frame (truncated)")


def _decompressed_chunks(path: Path, on_read=None) -> Iterator[bytes]:
    """Pieces of the recording's text; ``on_read(position)`` after each read from the file on
    disk, ``position`` counted in the file's own (compressed) bytes."""
    if path.name.endswith(".zst"):
        try:
            import zstandard  # noqa: F401
        except ImportError:
            raise RecordingError(f"{path}: reading .zst needs the zstandard package") from None
        yield from _zstd_chunks(path, on_read)
        return
    with open(path, "rb") as disk:
        raw = gzip.GzipFile(fileobj=disk) if path.name.endswith(".gz") else disk
        while chunk := raw.read(_CHUNK):
            if on_read is not None:
                on_read(disk.tell())
            yield chunk


def _read_errors() -> tuple:
    errors: tuple = (OSError, EOFError, zlib.error)
    try:
        import zstandard
    except ImportError:
        return errors
    return (*errors, zstandard.ZstdError)


def iter_lines(path: str | Path, on_read=None) -> Iterator[bytes]:
    """Non-blank lines of a recording, without the ``\\n`` (whitespace around the JSON is
    the JSON reader's to skip); ``on_read`` as for :func:`read_events`."""
    path = Path(path)
    if not path.is_file():
        raise RecordingError(f"recording {path} does not exist or is not a file")
    try:
        partial: list = []       # the pieces of a line that spans chunks
        for chunk in _decompressed_chunks(path, on_read):
            lines = chunk.split(b"\n")
            if len(lines) == 1:
                partial.append(chunk)
                continue
            if partial:
                partial.append(lines[0])
                lines[0] = b"".join(partial)
            partial = [lines.pop()]
            for line in lines:
                if line and not line.isspace():
                    yield line
        rest = b"".join(partial)
        if rest and not rest.isspace():
            yield rest
    except _read_errors() as exc:
        raise RecordingError(f"cannot read {path}: {exc}") from None


@dataclass
class ReadStats:
    events: int = 0
    invalid: int = 0
    reasons: dict = field(default_factory=dict)

    def count_invalid(self, reason: str) -> None:
        self.invalid += 1
        key = reason.split(":")[0][:60]
        self.reasons[key] = self.reasons.get(key, 0) + 1


def read_events(path: str | Path, stats: ReadStats | None = None,
                on_read=None) -> Iterator[Event]:
    """Valid events in recorded order; invalid lines are counted in ``stats``, not fatal.
    ``on_read(position)``, if given, follows the reading (once per chunk of the file, for a
    progress bar): bytes of the file on disk read so far."""
    stats = stats if stats is not None else ReadStats()
    for line in iter_lines(path, on_read):
        try:
            event = decode(line)
        except InvalidEvent as exc:
            stats.count_invalid(str(exc))
            continue
        stats.events += 1
        yield event


class RecordingWriter:
    """Appends envelopes to a recording; compression follows the file name."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.name.endswith(SUFFIXES):
            raise RecordingError(f"{self.path}: a recording's name ends in one of "
                                 f"{', '.join(SUFFIXES)}")
        if self.path.is_dir():
            raise RecordingError(f"{self.path} is a folder; give a recording's file name")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._out = _open_binary(self.path, "wb")
        self.lines = 0

    def write_raw(self, value: bytes) -> None:
        self._out.write(value.rstrip(b"\n") + b"\n")
        self.lines += 1

    def close(self) -> None:
        self._out.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
