"""NVIDIA Xid errors from the kernel log: a line parser and a follower thread.

The NVIDIA driver reports GPU faults as kernel-log lines of the form::

    NVRM: Xid (PCI:0000:9b:00): 119, pid=2024380, name=nvidia-smi, Timeout after 6s ...

:func:`parse_xid_line` finds such a line whatever prefix the log tool put in front of it:
raw ``/dev/kmsg`` records (``6,1234,5678,-;NVRM: ...``), ``dmesg`` (``[  123.456] NVRM: ...``,
``[Sun Feb 23 16:24:18 2025] NVRM: ...``), ``dmesg --decode --time-format iso``
(``kern  :warn  : 2025-01-21T04:41:44,283302+00:00 NVRM: ...``) and syslog or journal lines
(``... kernel: NVRM: ...``). Only the driver's own ``NVRM: Xid (<bus>): <code>`` form counts;
other NVIDIA lines (``NVRM: GPU at PCI:...``, fabric manager, peermem, NCCL segfaults) give None.

:class:`KmsgFollower` tails the kernel log in a thread and hands each Xid to a callback or to an
iterator: ``/dev/kmsg`` where readable, else ``dmesg --follow``, else it reports why neither
works. An optional ``extra_source`` file is tailed too (chaos injection appends Xid lines there).
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import os
import queue
import re
import select
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional

__all__ = ["XidRecord", "parse_xid_line", "normalize_bus_id", "KmsgFollower"]

log = logging.getLogger(__name__)

_BUS_RE = re.compile(
    r"^(?:PCI:)?(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):"
    r"(?P<dev>[0-9a-fA-F]{1,2})(?:\.(?P<fn>[0-7]))?$")
# The driver prints "(PCI:dddd:bb:dd)"; drivers before ~R450 printed "(dddd:bb:dd)".
_XID_RE = re.compile(
    r"\bNVRM: Xid \((?P<bus>(?:PCI:)?[0-9a-fA-F]{1,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)\):"
    r" (?P<xid>\d+)(?:, ?(?P<rest>.*?))?\s*$")
_PID_RE = re.compile(r"^pid=(?P<pid>'[^']*'|[^,]*),\s*")
_NAME_RE = re.compile(r"^name=(?P<name>[^,]*),\s*")


def normalize_bus_id(bus_id: str) -> Optional[str]:
    """Normalize a PCI bus id to ``dddd:bb:dd``, lower case; None when it is not one.

    The domain is written with (at least) 4 hex digits, leading zeros beyond those dropped;
    bus and device with 2; the function is dropped (a GPU is function 0 and the kernel's
    Xid lines carry none). So the kernel's ``PCI:0000:9b:00``, NVML's ``00000000:9B:00.0``,
    NVML's legacy ``0000:9B:00.0`` and lspci's ``9b:00.0`` all become ``0000:9b:00``.

    >>> normalize_bus_id("00000000:9B:00.0"), normalize_bus_id("PCI:0000:9b:00")
    ('0000:9b:00', '0000:9b:00')
    >>> normalize_bus_id("not a bus") is None
    True
    """
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode("ascii", "replace")
    m = _BUS_RE.match(bus_id.strip())
    if not m:
        return None
    domain = int(m.group("domain") or "0", 16)
    return f"{domain:04x}:{int(m.group('bus'), 16):02x}:{int(m.group('dev'), 16):02x}"


@dataclass(frozen=True)
class XidRecord:
    """One Xid error from the kernel log.

    ``message`` is the rest of the line after the code, verbatim (``pid=..., name=..., text``);
    ``detail`` is that text with the leading ``pid=``/``name=`` fields removed. ``pid``/``name``
    are None where absent or printed as ``'<unknown>'``. ``raw`` is the line from ``NVRM:`` on.
    ``gpu`` is the GPU index, filled in by :class:`KmsgFollower` from its bus-id map.
    """

    bus_id: str
    xid: int
    message: str
    detail: str
    pid: Optional[int] = None
    name: Optional[str] = None
    raw: str = ""
    gpu: Optional[int] = None

    def to_payload(self) -> dict:
        """The SPEC ``xid`` event fields (without the envelope)."""
        return {"gpu": self.gpu, "xid": self.xid, "source": "kmsg", "message": self.message}


def parse_xid_line(line: str) -> Optional[XidRecord]:
    """Parse one kernel-log line; an :class:`XidRecord` for an NVIDIA Xid line, else None.

    >>> r = parse_xid_line("[  123.456] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, "
    ...                    "name=python, GPU has fallen off the bus.")
    >>> (r.bus_id, r.xid, r.pid, r.name, r.detail)
    ('0000:3b:00', 79, 1234, 'python', 'GPU has fallen off the bus.')
    >>> parse_xid_line("6,3964,206764307,-;nvidia-nvswitch2: open (major=510)") is None
    True
    """
    if isinstance(line, bytes):
        line = line.decode("utf-8", "replace")
    if "NVRM: Xid" not in line:
        return None
    m = _XID_RE.search(line.rstrip("\r\n"))
    if not m:
        return None
    bus_id = normalize_bus_id(m.group("bus"))
    if bus_id is None:
        return None
    message = m.group("rest") or ""
    detail, pid, name = message, None, None
    pm = _PID_RE.match(detail)
    if pm:
        value = pm.group("pid").strip("'")
        pid = int(value) if value.isdigit() else None
        detail = detail[pm.end():]
    nm = _NAME_RE.match(detail)
    if nm:
        value = nm.group("name").strip()
        name = None if value in ("", "<unknown>") else value
        detail = detail[nm.end():]
    return XidRecord(bus_id=bus_id, xid=int(m.group("xid")), message=message, detail=detail,
                     pid=pid, name=name, raw=line[m.start():].rstrip("\r\n"))


_STOP = object()
_DMESG_TS_RE = re.compile(r"^\[\s*(\d+\.\d+)\]")


class KmsgFollower:
    """Follow the kernel log in background threads and deliver each Xid as it is logged.

    Configuration only in the constructor; :meth:`start` opens the sources. Records go to
    ``callback(record)`` (called from a follower thread, one call at a time) or, without a
    callback, to an internal queue read by iterating the follower or by :meth:`get`.

    Kernel source, in order: ``kmsg_path`` (``/dev/kmsg``, opened non-blocking and polled, at
    its end unless ``replay``), else ``dmesg_argv`` (``dmesg --follow-new``, or ``--follow``
    with lines older than the start skipped unless ``replay``); else :attr:`available` is
    False and :attr:`reason` says why. ``extra_source`` is a file tailed like a log (from its
    end unless ``replay``; it may appear later, be replaced, or be truncated to less than
what was read). No thread busy-spins:
    ``/dev/kmsg`` waits in ``poll``, dmesg in a blocking read, the file in ``Event.wait``.
    """

    def __init__(self, callback: Optional[Callable[[XidRecord], None]] = None, *,
                 bus_id_map: Optional[Mapping[str, int]] = None,
                 kmsg_path: Optional[str] = "/dev/kmsg",
                 dmesg_argv: Optional[list] = None,
                 extra_source: Optional[str] = None, replay: bool = False,
                 poll_interval: float = 0.2):
        self.callback = callback
        self.kmsg_path = kmsg_path
        self.dmesg_argv = list(dmesg_argv) if dmesg_argv is not None else ["dmesg"]
        self.extra_source = extra_source
        self.replay = replay
        self.poll_interval = poll_interval
        self._bus_map = {normalize_bus_id(k) or k: v for k, v in (bus_id_map or {}).items()}
        self.kernel_source: Optional[str] = None  # "kmsg", "dmesg" or None
        self.reason: Optional[str] = None
        self._stop = threading.Event()
        self._threads: list = []
        self._queue: "queue.Queue" = queue.Queue()
        self._cb_lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self._fd: Optional[int] = None

    @property
    def available(self) -> bool:
        """Whether a kernel-log source is being followed."""
        return self.kernel_source is not None

    def set_bus_id_map(self, bus_id_map: Mapping[str, int]) -> None:
        """Replace the bus id → GPU index map (e.g. once NVML is up)."""
        self._bus_map = {normalize_bus_id(k) or k: v for k, v in bus_id_map.items()}

    def gpu_index(self, bus_id: str) -> Optional[int]:
        """GPU index of a bus id, None when unknown."""
        return self._bus_map.get(normalize_bus_id(bus_id) or bus_id)

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> "KmsgFollower":
        """Open the sources and start the threads; never raises for a missing source."""
        reasons = []
        if self.kmsg_path:
            try:
                self._fd = self._open_kmsg()
                self.kernel_source = "kmsg"
                self._spawn(self._run_kmsg, "kmsg")
            except OSError as e:
                reasons.append(f"{self.kmsg_path} is not readable ({e.strerror or e})")
        if self.kernel_source is None and self.dmesg_argv:
            err = self._start_dmesg()
            if err is None:
                self.kernel_source = "dmesg"
                self._spawn(self._run_dmesg, "dmesg")
            else:
                reasons.append(err)
        if self.kernel_source is None:
            self.reason = ("kernel log unavailable: " + "; ".join(reasons or ["no source configured"]))
            log.warning("%s", self.reason)
        if self.extra_source:
            # Where "the end" is gets fixed now, not when the thread first runs: a line written
            # right after start() must not be skipped.
            self._extra_start = None
            if not self.replay:
                try:
                    self._extra_start = os.stat(self.extra_source).st_size
                except OSError:
                    self._extra_start = 0
            self._spawn(self._run_file, "extra")
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the threads, end dmesg and close ``/dev/kmsg``; ends any iteration."""
        self._stop.set()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout)
        for t in self._threads:
            t.join(timeout)
        if self._proc is not None:
            for stream in (self._proc.stdout, self._proc.stderr):
                if stream:
                    stream.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._queue.put(_STOP)

    def __enter__(self) -> "KmsgFollower":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def get(self, timeout: Optional[float] = None) -> Optional[XidRecord]:
        """Next record from the queue (no callback mode); None on timeout or after stop."""
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is _STOP:
            self._queue.put(_STOP)
            return None
        return item

    def __iter__(self) -> Iterator[XidRecord]:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._queue.put(_STOP)
                return
            yield item

    # -- delivery --------------------------------------------------------------------------
    def _spawn(self, target, name: str) -> None:
        t = threading.Thread(target=target, name=f"trainguard-kmsg-{name}", daemon=True)
        self._threads.append(t)
        t.start()

    def _line(self, line: str) -> None:
        rec = parse_xid_line(line)
        if rec is None:
            return
        rec = dataclasses.replace(rec, gpu=self.gpu_index(rec.bus_id))
        if self.callback is None:
            self._queue.put(rec)
            return
        with self._cb_lock:
            try:
                self.callback(rec)
            except Exception:  # a broken callback must not kill the follower
                log.exception("kmsg callback failed on %r", rec)

    # -- /dev/kmsg -------------------------------------------------------------------------
    def _open_kmsg(self) -> int:
        fd = os.open(self.kmsg_path, os.O_RDONLY | os.O_NONBLOCK)
        if not self.replay:
            try:
                os.lseek(fd, 0, os.SEEK_END)
            except OSError:  # not seekable (a pipe in tests): nothing to skip
                pass
        return fd

    def _run_kmsg(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        pending = b""
        while not self._stop.is_set():
            if not poller.poll(self.poll_interval * 1000):
                continue
            try:
                chunk = os.read(self._fd, 8192)
            except BlockingIOError:
                continue
            except OSError as e:
                if e.errno == errno.EPIPE:  # records overwritten before we read them
                    continue
                if not self._stop.is_set():
                    self.reason = f"reading {self.kmsg_path} failed ({e.strerror or e})"
                    log.warning("%s", self.reason)
                return
            if not chunk:  # EOF (a pipe whose writer left): wait, do not spin
                self._stop.wait(self.poll_interval)
                continue
            # /dev/kmsg gives one record per read: "prefix;message\n" + " KEY=value" lines.
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                if raw and not raw.startswith(b" "):
                    self._line(raw.decode("utf-8", "replace"))

    # -- dmesg -----------------------------------------------------------------------------
    def _dmesg_command(self) -> tuple:
        """(argv, skip_before): ``--follow-new`` where dmesg has it, else ``--follow``."""
        argv = list(self.dmesg_argv)
        if any(a in ("-w", "-W", "--follow", "--follow-new") for a in argv[1:]):
            return argv, None
        if self.replay:
            return argv + ["--follow"], None
        try:
            helptext = subprocess.run(argv + ["--help"], capture_output=True, text=True,
                                      timeout=5).stdout
        except (OSError, subprocess.SubprocessError):
            helptext = ""
        if "--follow-new" in helptext:
            return argv + ["--follow-new"], None
        return argv + ["--follow"], time.clock_gettime(time.CLOCK_MONOTONIC)

    def _start_dmesg(self) -> Optional[str]:
        argv, self._dmesg_skip_before = self._dmesg_command()
        try:
            self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          stdin=subprocess.DEVNULL)
        except OSError as e:
            return f"cannot run {argv[0]} ({e.strerror or e})"
        try:  # a dmesg that cannot read the log exits at once
            self._proc.wait(0.5)
        except subprocess.TimeoutExpired:
            return None
        err = self._proc.stderr.read().decode("utf-8", "replace").strip()
        return f"{' '.join(argv)} exited with {self._proc.returncode}" + (f": {err}" if err else "")

    def _run_dmesg(self) -> None:
        skip_before = self._dmesg_skip_before
        for raw in iter(self._proc.stdout.readline, b""):
            if self._stop.is_set():
                return
            line = raw.decode("utf-8", "replace")
            if skip_before is not None:
                m = _DMESG_TS_RE.match(line)
                if m and float(m.group(1)) < skip_before:
                    continue
                skip_before = None  # the old buffer has been read
            self._line(line)
        if not self._stop.is_set():
            self.reason = f"dmesg ended with {self._proc.wait()}"
            err = self._proc.stderr.read().decode("utf-8", "replace").strip()
            if err:
                self.reason += f": {err}"
            self.kernel_source = None     # a dmesg slower to fail than start()'s wait
            log.warning("%s", self.reason)

    # -- extra file ------------------------------------------------------------------------
    def _run_file(self) -> None:
        path, fh, pending = self.extra_source, None, b""
        at_end = self._extra_start is not None
        while not self._stop.is_set():
            if fh is None:
                try:
                    fh = open(path, "rb")
                except OSError:  # not there yet: when it comes, read it all
                    at_end = False
                    self._stop.wait(self.poll_interval)
                    continue
                if at_end:
                    fh.seek(min(self._extra_start, os.fstat(fh.fileno()).st_size))
                at_end = False  # a file created or replaced later is read from its start
            chunk = fh.read(65536)
            if chunk:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    self._line(raw.decode("utf-8", "replace"))
                continue
            try:
                st = os.stat(path)
                if st.st_ino != os.fstat(fh.fileno()).st_ino or st.st_size < fh.tell():
                    fh.close()  # rotated or truncated: read the new file from its start
                    fh, pending = None, b""
                    continue
            except OSError:
                pass
            self._stop.wait(self.poll_interval)
        if fh is not None:
            fh.close()
