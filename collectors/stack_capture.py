"""Python stacks of a rank process: py-spy from outside, or the rank's own handler from inside.

Node-agent side: :func:`capture_pid` runs ``py-spy dump --json --pid PID`` (an argv list, never
a shell). Where py-spy is missing or fails (typically no ptrace permission in a container) and
the process is alive, it falls back to in-process capture: it sends the process the signal its
trainguard collector registered, and reads the JSON the process writes to
``<runtime_dir>/stacks/<pid>.json``. It never raises; failures go into ``error``.

Training side: :func:`install_inproc_handler` (called by the collector, in the main thread)
installs a handler for ``SIGUSR2`` (configurable) that writes every thread's stack from
``sys._current_frames()``. A Python signal handler only runs when the main thread next executes
bytecode, which a rank hung inside a C call (a collective, a CUDA sync) never does; so the
handler also owns Python's signal wakeup fd (:func:`signal.set_wakeup_fd`) and a small daemon
thread blocked on it writes the dump at once. That works whenever the hung thread has released
the GIL, as blocking native calls do; a thread spinning while holding the GIL stops every
in-process method, and only py-spy can read it then. The handler is installed with
``siginterrupt(False)`` so interrupted system calls are restarted, and it leaves a marker
``<pid>.ready`` naming its signal. :func:`capture_pid` signals a process only when the kernel
says it catches that signal (``SigCgt`` in ``/proc/<pid>/status``), because the default action
of ``SIGUSR2`` would kill a rank that has no handler.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from trainguard.files import write_atomic

__all__ = ["capture_pid", "install_inproc_handler", "inproc_threads", "InprocDumper",
           "stack_file", "find_pyspy", "DEFAULT_SIGNAL"]

DEFAULT_SIGNAL = signal.SIGUSR2
_THIS_FILE = os.path.normcase(os.path.abspath(__file__))
_WAITING_FILES = ("threading.py", "selectors.py", "queue.py", "socket.py", "ssl.py",
                  "subprocess.py", "connection.py", "synchronize.py")


def stack_file(runtime_dir: os.PathLike, pid: int) -> Path:
    """Where process ``pid`` writes its in-process dump."""
    return Path(runtime_dir) / "stacks" / f"{pid}.json"


def _frames_of(frame) -> list:
    out = []
    while frame is not None:
        code = frame.f_code
        out.append({"function": getattr(code, "co_qualname", code.co_name),
                    "file": code.co_filename, "line": frame.f_lineno})
        frame = frame.f_back
    return out


def inproc_threads(frames: Optional[dict] = None, skip_thread: Optional[int] = None) -> list:
    """SPEC ``stack`` threads of this process from ``sys._current_frames()``, innermost first.

    Frames of this module at the top of a stack (the dump itself) are left out, and so is
    thread ``skip_thread``. ``active`` is a guess, as Python cannot see C-level waits: False
    when the innermost frame is in a waiting module (threading, queue, selectors, ...).

    >>> me = [t for t in inproc_threads() if t["id"] == threading.get_ident()][0]
    >>> me["name"], me["frames"][0]["function"]
    ('MainThread', '<module>')
    """
    frames = sys._current_frames() if frames is None else frames
    known = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, frame in frames.items():
        if ident == skip_thread:
            continue
        while frame is not None and os.path.normcase(frame.f_code.co_filename) == _THIS_FILE:
            frame = frame.f_back
        stack = _frames_of(frame)
        thread = known.get(ident)
        top = os.path.basename(stack[0]["file"]) if stack else ""
        entry = {"name": thread.name if thread else None, "id": ident,
                 "active": bool(stack) and top not in _WAITING_FILES, "frames": stack}
        if thread is not None and getattr(thread, "native_id", None) is not None:
            entry["native_id"] = thread.native_id
        out.append(entry)
    return out


class InprocDumper:
    """The training-side handler; see the module docstring. Configuration in the constructor,
    effects in :meth:`install` and :meth:`uninstall`, which must run in the main thread
    (``signal.signal`` raises ``ValueError`` elsewhere)."""

    def __init__(self, runtime_dir: os.PathLike, signum: int = DEFAULT_SIGNAL,
                 wakeup_thread: bool = True):
        self.runtime_dir = Path(runtime_dir)
        self.signum = int(signum)
        self.wakeup_thread = wakeup_thread
        self._prev_handler = None
        self._socks: Optional[tuple] = None
        self._thread: Optional[threading.Thread] = None
        self._pid = 0

    @property
    def path(self) -> Path:
        return stack_file(self.runtime_dir, os.getpid())

    def install(self) -> "InprocDumper":
        self._pid = os.getpid()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._prev_handler = signal.signal(self.signum, self._on_signal)
        signal.siginterrupt(self.signum, False)
        if self.wakeup_thread:
            self._start_wakeup_thread()
        marker = {"pid": self._pid, "signum": self.signum, "ts": time.time()}
        write_atomic(self.path.with_suffix(".ready"), json.dumps(marker))
        os.register_at_fork(after_in_child=self._after_fork_child)
        return self

    def uninstall(self) -> None:
        if self._prev_handler is not None:
            signal.signal(self.signum, self._prev_handler)
            self._prev_handler = None
        if self._socks is not None:
            rsock, wsock = self._socks
            current = signal.set_wakeup_fd(-1)
            if current not in (-1, wsock.fileno()):  # someone else's since: leave it
                signal.set_wakeup_fd(current)
            wsock.close()  # the wakeup thread reads EOF and ends
            if self._thread is not None:
                self._thread.join(1.0)
            rsock.close()
            self._socks, self._thread = None, None
        try:
            self.path.with_suffix(".ready").unlink()
        except OSError:
            pass

    def dump(self, skip_thread: Optional[int] = None) -> Path:
        """Write this process's stacks now; returns the file."""
        doc = {"pid": os.getpid(), "ts": time.time(), "method": "inproc",
               "threads": inproc_threads(skip_thread=skip_thread)}
        # the wakeup thread and the handler may write it at once: each call its own temp file
        write_atomic(self.path, json.dumps(doc))
        return self.path

    # -- internals -------------------------------------------------------------------------
    def _start_wakeup_thread(self) -> None:
        rsock, wsock = socket.socketpair()
        wsock.setblocking(False)
        try:
            old = signal.set_wakeup_fd(wsock.fileno(), warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            old = None
        if old != -1:  # someone (an asyncio loop) owns it: handler-only mode
            if old is not None:
                signal.set_wakeup_fd(old)
            rsock.close()
            wsock.close()
            return
        self._socks = (rsock, wsock)
        self._thread = threading.Thread(target=self._wakeup_loop, args=(rsock,),
                                        name="trainguard-stackdump", daemon=True)
        self._thread.start()

    def _wakeup_loop(self, rsock: socket.socket) -> None:
        while True:
            try:
                data = rsock.recv(64)
            except OSError:
                return
            if not data:
                return
            if self.signum in data and os.getpid() == self._pid:
                try:
                    self.dump(skip_thread=threading.get_ident())
                except Exception:
                    pass

    def _owns_wakeup_fd(self) -> bool:
        if self._socks is None or self._thread is None or not self._thread.is_alive():
            return False
        try:  # handlers run in the main thread, where this is allowed
            current = signal.set_wakeup_fd(-1)
            signal.set_wakeup_fd(current, warn_on_full_buffer=False)
        except ValueError:
            return False
        return current == self._socks[1].fileno()

    def _on_signal(self, signum, frame) -> None:
        try:  # a handler's exception would surface in the training loop: never raise
            if not self._owns_wakeup_fd():  # else the wakeup thread has written the dump
                self.dump()
        except Exception:
            pass

    def _after_fork_child(self) -> None:
        if self._socks is not None:
            try:  # the socket pair is the parent's: forget it in the child
                signal.set_wakeup_fd(-1)
            except ValueError:
                pass
            self._socks, self._thread = None, None


def install_inproc_handler(runtime_dir: os.PathLike, signum: int = DEFAULT_SIGNAL
                           ) -> InprocDumper:
    """Install the in-process stack dump handler (collector side, main thread)."""
    return InprocDumper(runtime_dir, signum).install()


# -- agent side ----------------------------------------------------------------------------
def find_pyspy(pyspy: Optional[str] = None) -> Optional[str]:
    """``pyspy`` if it is an executable file; else py-spy next to ``sys.executable``, else
    on PATH; None when there is none (a given ``pyspy`` that is not executable gives None)."""
    if pyspy is not None:
        return pyspy if os.path.isfile(pyspy) and os.access(pyspy, os.X_OK) else None
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("py-spy")


def _process_state(pid: int) -> Optional[str]:
    """None when ``pid`` is a live process, else why not."""
    if pid <= 0:
        return f"{pid} is not a process id"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"process {pid} does not exist"
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat[stat.rindex(")") + 2:].startswith(("Z", "X")):
            return f"process {pid} has exited"
    except (OSError, ValueError):
        pass
    return None


def _catches(pid: int, signum: int) -> Optional[bool]:
    """Whether ``pid`` has a handler for ``signum`` (None where /proc cannot tell)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _pyspy_threads(raw: list) -> list:
    out = []
    for t in raw:
        entry = {"name": t.get("thread_name"), "id": t.get("thread_id"),
                 "active": bool(t.get("active")),
                 "frames": [{"function": f.get("name") or "?", "file": f.get("filename") or "?",
                             "line": f.get("line")} for f in t.get("frames") or []]}
        if t.get("os_thread_id") is not None:
            entry["native_id"] = t["os_thread_id"]
        if t.get("owns_gil") is not None:
            entry["owns_gil"] = bool(t["owns_gil"])
        out.append(entry)
    return out


def _run_pyspy(exe: str, pid: int, native: bool, timeout: float) -> tuple:
    """(threads, None) or (None, error)."""
    argv = [exe, "dump", "--json", "--pid", str(int(pid))] + (["--native"] if native else [])
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"py-spy dump timed out after {timeout:g}s"
    except OSError as e:
        return None, f"cannot run py-spy ({e.strerror or e})"
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace").split("\n\nStack backtrace")[0].strip()
        return None, f"py-spy dump failed ({proc.returncode}): {err or 'no message'}"
    try:
        return _pyspy_threads(json.loads(proc.stdout)), None
    except (ValueError, TypeError, AttributeError) as e:
        return None, f"py-spy dump gave unreadable output ({e})"


def _inproc_capture(pid: int, runtime_dir: os.PathLike, signum: int, timeout: float) -> tuple:
    """(threads, None) or (None, error)."""
    path = stack_file(runtime_dir, pid)
    try:
        signum = int(json.loads(path.with_suffix(".ready").read_text())["signum"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = str(signum)
    if _catches(pid, signum) is False:
        return None, f"process {pid} has no {name} handler (trainguard's in-process handler " \
                     "is not installed)"
    try:
        path.unlink()
    except OSError:
        pass
    t0 = time.time()
    try:
        os.kill(pid, signum)
    except OSError as e:
        return None, f"cannot signal process {pid} ({e.strerror or e})"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            doc = json.loads(path.read_text())
            if doc.get("ts", 0) >= t0 - 1.0:
                threads = doc["threads"]
                if not isinstance(threads, list) or not all(
                        isinstance(t, dict) and isinstance(t.get("frames"), list)
                        for t in threads):
                    return None, f"malformed in-process dump in {path}"
                return threads, None
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if _process_state(pid):
            return None, f"{_process_state(pid)} before writing its stacks"
        time.sleep(0.02)
    return None, f"no in-process dump from {pid} within {timeout:g}s after {name}"


def capture_pid(pid: int, native: bool = False, timeout: float = 10,
                pyspy: Optional[str] = None, runtime_dir: Optional[os.PathLike] = None,
                signum: int = DEFAULT_SIGNAL) -> dict:
    """Stacks of process ``pid``: ``{"pid", "method", "threads", "error"}``; never raises.

    ``method`` is ``"py-spy"`` or ``"inproc"``; ``error`` is None on success. When the
    fallback was used, ``fallback_reason`` says why py-spy did not do. Each of the two steps
    may take up to ``timeout`` seconds. Without ``runtime_dir`` there is no fallback.
    """
    result = {"pid": pid, "method": "py-spy", "threads": [], "error": None}
    try:
        gone = _process_state(pid)
        if gone:
            result["error"] = gone
            return result
        exe = find_pyspy(pyspy)
        if exe is not None:
            threads, spy_error = _run_pyspy(exe, pid, native, timeout)
            if threads is not None:
                result["threads"] = threads
                return result
        else:
            spy_error = f"py-spy not found{f' at {pyspy}' if pyspy else ''}"
        gone = _process_state(pid)
        if gone or runtime_dir is None:
            result["error"] = f"{spy_error}; " + (gone or "no runtime dir for the in-process "
                                                   "fallback")
            return result
        result["method"] = "inproc"
        threads, in_error = _inproc_capture(pid, runtime_dir, signum, timeout)
        if threads is not None:
            result["threads"], result["fallback_reason"] = threads, spy_error
        else:
            result["error"] = f"{spy_error}; in-process capture: {in_error}"
    except Exception as e:  # never raise into the agent's command loop
        result["error"] = f"stack capture failed: {type(e).__name__}: {e}"
    return result
