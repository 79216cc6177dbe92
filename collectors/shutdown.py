"""The rank's last words: a lifecycle ``exit`` at interpreter exit and on SIGTERM.

:class:`ExitHooks` calls ``on_exit(exit_code, signal_name, timeout)`` once:

* **at interpreter exit** (``atexit``): ``exit_code`` is 1 after an uncaught exception, else
  null (Python does not tell ``atexit`` the code of ``sys.exit(n)``; call ``tg.close()`` for
  an exact one); ``signal_name`` is ``"SIGTERM"`` when one was received and handled.
* **on SIGTERM**, when nobody had a handler for it before (the default action, terminate):
  the exit is sent with ``signal="SIGTERM"``, then the default action runs, so the process
  still dies by SIGTERM and its launcher (torchrun) sees exactly that. When a previous Python
  handler exists it is called instead (it decides whether the process ends; the exit event
  then comes from ``atexit`` or ``close``). When SIGTERM was ignored, nothing is installed.

A Python signal handler only runs when the main thread executes bytecode, and a rank hung in a
collective or a CUDA call never does, so a plain handler would make SIGTERM powerless until the
launcher's SIGKILL. Python also writes the signal number to its *wakeup fd*; the hooks own it
(forwarding every byte to a previous owner, such as the stack-dump handler or an asyncio loop)
and a daemon thread reading it, on SIGTERM, gives the main thread ``stuck_grace`` seconds to
run the handler; if it does not, the thread sends the exit itself and ends the process by
SIGTERM's default action. It does so only while the collector's handler is still the one
installed and nobody had a handler before (a handler installed later by the program owns
SIGTERM, and the watcher leaves the process alone).

When the hooks' own handler owns SIGTERM (no earlier Python handler), a SIGTERM that comes
while the collector closes (:meth:`ExitHooks.holding`: its last flush, from ``close``,
``atexit`` or an earlier signal) waits for the close to end, then ends the process as it
would have: otherwise it would kill the flush before the collector says how many events it
could not deliver (torchrun's SIGTERM to a rank that is already exiting because a peer died,
while the broker fails over). It waits ``hold_limit`` seconds at most (a close can block in a
CUDA call of a hung collective), then a helper thread ends the process all the same.

Signal handlers and the wakeup fd are only touched from the main thread; in a forked child
(DataLoader workers) the hooks forget the wakeup fd and do nothing but chain.
"""
from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import sys
import threading
import weakref
from contextlib import contextmanager
from typing import Callable, Iterator

__all__ = ["ExitHooks"]

log = logging.getLogger(__name__)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _die_by(signum: int) -> None:
    """End this process by ``signum``'s default action, from any thread."""
    try:
        if _in_main_thread():
            signal.signal(signum, signal.SIG_DFL)
        else:  # signal.signal is main-thread only; libc's is not
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.signal.restype = ctypes.c_void_p
            libc.signal(ctypes.c_int(signum), ctypes.c_void_p(0))  # SIG_DFL
        os.kill(os.getpid(), signum)
    finally:
        os._exit(128 + signum)  # only reached if the signal did not end us


class ExitHooks:
    """atexit + SIGTERM for one collector; :meth:`install` from the main thread when possible."""

    def __init__(self, on_exit: Callable[[int | None, str | None, float], None], *,
                 sigterm_timeout: float = 2.0, stuck_grace: float = 1.0,
                 hold_limit: float = 5.0, handle_signals: bool = True):
        self.on_exit = on_exit
        self.sigterm_timeout = sigterm_timeout
        self.stuck_grace = stuck_grace
        self.hold_limit = hold_limit
        self.handle_signals = handle_signals
        self._pid = 0
        self._prev = None
        self._installed_signal = False
        self._handler_started = threading.Event()
        self._signal_seen: str | None = None
        self._socks: tuple | None = None
        self._forward_fd: int | None = None
        self._holding = 0                    # closes under way (holding)
        self._deferred: int | None = None    # a signal that came meanwhile

    @contextmanager
    def holding(self) -> Iterator[None]:
        """A close under way: a SIGTERM that comes meanwhile ends the process when it is
        over, not before (it can still say what it could not deliver)."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1                # then read _deferred: see _on_sigterm
            deferred = self._deferred if not self._holding else None
            if deferred is not None and os.getpid() == self._pid:
                _die_by(deferred)

    def _die_when_held_too_long(self, signum: int) -> None:
        if self._deferred is not None and os.getpid() == self._pid:
            log.warning("SIGTERM held %g s by a close that did not end: terminating",
                        self.hold_limit)
            _die_by(signum)

    def install(self) -> "ExitHooks":
        self._pid = os.getpid()
        atexit.register(self._atexit)
        if self.handle_signals and _in_main_thread():
            prev = signal.getsignal(signal.SIGTERM)
            if prev is not signal.SIG_IGN:
                self._prev = prev
                signal.signal(signal.SIGTERM, self._on_sigterm)
                self._installed_signal = True
                self._start_watcher()
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (h := ref()) is not None
                            and h._after_fork_child())
        return self

    def uninstall(self) -> None:
        """Undo what :meth:`install` did, where still ours (main thread only for signals)."""
        atexit.unregister(self._atexit)
        if not (self._installed_signal and _in_main_thread() and os.getpid() == self._pid):
            return
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._prev if self._prev is not None
                          else signal.SIG_DFL)
        self._installed_signal = False
        if self._socks is not None:
            rsock, wsock = self._socks
            current = signal.set_wakeup_fd(-1)
            restore = (self._forward_fd if current == wsock.fileno() else current)
            signal.set_wakeup_fd(-1 if restore is None else restore, warn_on_full_buffer=False)
            self._socks = None
            wsock.close()  # the watcher reads EOF and ends
            rsock.close()

    # -- handlers ---------------------------------------------------------------------------
    def _atexit(self) -> None:
        if os.getpid() != self._pid:
            return
        failed = (getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)) is not None
        self.on_exit(1 if failed else None, self._signal_seen, self.sigterm_timeout)

    def _on_sigterm(self, signum, frame) -> None:
        self._handler_started.set()
        prev = self._prev
        mine = os.getpid() == self._pid
        if callable(prev):
            if mine:
                self._signal_seen = "SIGTERM"
            prev(signum, frame)
            return
        if mine:
            # set before _holding is read (holding() reads them the other way round): a
            # close on another thread that ends meanwhile dies by it, or this handler does
            self._deferred = signum
            if self._holding:              # a close under way ends the process when done
                self._signal_seen = signal.Signals(signum).name
                timer = threading.Timer(self.hold_limit, self._die_when_held_too_long,
                                        (signum,))
                timer.daemon = True
                timer.start()
                return
            self._report_signal(signum)
        _die_by(signum)

    def _report_signal(self, signum: int) -> None:
        try:
            self.on_exit(None, signal.Signals(signum).name, self.sigterm_timeout)
        except Exception as exc:  # dying anyway; never mask the signal
            log.debug("exit event on signal failed: %s", exc)

    # -- wakeup-fd watcher ------------------------------------------------------------------
    def _start_watcher(self) -> None:
        rsock, wsock = socket.socketpair()
        wsock.setblocking(False)
        try:
            old = signal.set_wakeup_fd(wsock.fileno(), warn_on_full_buffer=False)
        except ValueError:
            rsock.close()
            wsock.close()
            return
        self._forward_fd = old if old != -1 else None
        self._socks = (rsock, wsock)
        threading.Thread(target=self._watch, args=(rsock, self._forward_fd),
                         name="trainguard-signals", daemon=True).start()

    def _watch(self, rsock: socket.socket, forward: int | None) -> None:
        while True:
            try:
                data = rsock.recv(64)
            except OSError:
                return
            if not data:
                return
            if forward is not None:
                try:
                    os.write(forward, data)
                except OSError:
                    pass
            if (signal.SIGTERM in data and os.getpid() == self._pid
                    and not callable(self._prev)
                    and signal.getsignal(signal.SIGTERM) == self._on_sigterm):
                if not self._handler_started.wait(self.stuck_grace):
                    log.warning("SIGTERM while the main thread is stuck in native code: "
                                "sending the exit event and terminating from a helper thread")
                    self._report_signal(signal.SIGTERM)
                    _die_by(signal.SIGTERM)

    def _after_fork_child(self) -> None:
        if self._socks is not None:
            try:
                current = signal.set_wakeup_fd(-1)
                if current != self._socks[1].fileno():
                    signal.set_wakeup_fd(current, warn_on_full_buffer=False)
            except ValueError:
                pass
            self._socks = None
