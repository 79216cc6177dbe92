"""``compute_time`` on any backend: the rank's own working time in a step, measured from marks.

A :class:`ComputeTimer` gets four marks from the training side
(:mod:`trainguard.integrations`): ``begin()`` when the step's work starts (for the
integrations, where the step before ended: data loading counts), ``wait_begin()`` /
``wait_end()`` around every stretch where this rank waits for its peers, and ``end()`` when the
step is over. ``end()`` returns a :class:`Reading`; its ``value()`` is

    compute_time = (end - begin) - sum(wait_end - wait_begin)

Waits may nest (an outer wait swallows inner ones) and come from any thread. Which stretches are
waits is the caller's business; the integrations mark (a) from the moment the last gradient of
a backward pass is ready until ``backward()`` returns (DDP's final all-reduce wait, no comm hook
needed) and (b) every ``Work.wait()`` of ``torch.distributed`` called from Python (blocking
collectives, FSDP2's and pipeline schedules' waits on asynchronous ones).

* :class:`HostComputeTimer` (CPU, gloo): the marks are host clock readings; a reading is ready
  at once. This is what the host sees, which on CPU is the truth.
* :class:`CudaComputeTimer` (GPU): each mark records a CUDA event on the current (compute)
  stream, so the wait is the time the *stream* stalled, which is where NCCL makes a fast rank
  wait. Nothing synchronizes: a reading is ready once its last event has completed
  (``query()``), usually one step later, and is read then. The events come from an
  ``event_factory`` (default ``torch.cuda.Event(enable_timing=True)``), so the bookkeeping is
  tested on CPU with fake events.

>>> ticks = iter([0.0, 0.2, 0.5, 1.0])
>>> timer = HostComputeTimer(clock=lambda: next(ticks))
>>> timer.begin(); timer.wait_begin(); timer.wait_end()
>>> timer.end().value()        # 1.0 s step, 0.3 s of it waiting for peers
0.7
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Protocol

__all__ = ["ComputeTimer", "Reading", "HostComputeTimer", "CudaComputeTimer",
           "make_compute_timer"]


class Reading(Protocol):
    def ready(self) -> bool: ...

    def value(self) -> float | None: ...


class ComputeTimer(Protocol):
    """Marks of one rank's steps; ``end()`` gives the step's reading (maybe not ready yet).
    ``now``: the caller's reading of the timer's clock at that moment, if it has one (a host
    timer uses it instead of reading the clock again; a device timer ignores it)."""

    def begin(self, now: float | None = None) -> None: ...

    def wait_begin(self) -> None: ...

    def wait_end(self) -> None: ...

    def end(self, now: float | None = None) -> Reading: ...


class _Ready:
    __slots__ = ("_value",)

    def __init__(self, value):
        self._value = value

    def ready(self) -> bool:
        return True

    def value(self):
        return self._value


class HostComputeTimer:
    """Host clock marks; waits that nest count once."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self._lock = threading.Lock()
        self._t0 = None
        self._depth = 0
        self._wait0 = 0.0
        self._blocked = 0.0

    def begin(self, now: float | None = None) -> None:
        self._t0 = self.clock() if now is None else now
        self._blocked = 0.0
        self._depth = 0

    def wait_begin(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._wait0 = self.clock()
            self._depth += 1

    def wait_end(self) -> None:
        with self._lock:
            if self._depth == 0:
                return
            self._depth -= 1
            if self._depth == 0:
                self._blocked += self.clock() - self._wait0

    def end(self, now: float | None = None) -> Reading:
        if now is None:
            now = self.clock()
        with self._lock:
            if self._depth:  # still inside a wait (an exception skipped its end)
                self._blocked += now - self._wait0
                self._depth = 0
            blocked, t0 = self._blocked, self._t0
        if t0 is None:
            return _Ready(None)
        return _Ready(max(0.0, (now - t0) - blocked))  # no round(x, 9): a dtoa, microseconds


class _CudaReading:
    __slots__ = ("_timer", "_first", "_last", "_waits", "_value")

    def __init__(self, timer, first, last, waits):
        self._timer, self._first, self._last, self._waits = timer, first, last, waits
        self._value = None

    def ready(self) -> bool:
        if self._last is None:
            return True
        try:
            return bool(self._last.query())
        except Exception:  # a broken device: give up on this reading, never raise
            self._last = None
            return True

    def value(self) -> float | None:
        if self._last is None:
            return self._value
        try:
            if not self._last.query():  # only at close: wait for the device this once
                self._last.synchronize()
            total = self._first.elapsed_time(self._last)
            waited = sum(a.elapsed_time(b) for a, b in self._waits)
            self._value = round(max(0.0, total - waited) / 1000.0, 9)
        except Exception:
            self._value = None
        self._timer._release(self._first, self._last, self._waits)
        self._last = None
        return self._value


class CudaComputeTimer:
    """CUDA events on the current stream at each mark; readings resolve when the GPU is past
    the step (``Reading.ready()``), without a synchronization. Events are pooled."""

    def __init__(self, event_factory: Callable | None = None):
        self.event_factory = event_factory or _cuda_event
        self._free: list = []
        self._lock = threading.Lock()
        self._first = None
        self._waits: list = []
        self._depth = 0
        self._open = None

    def _event(self):
        with self._lock:
            event = self._free.pop() if self._free else None
        if event is None:
            event = self.event_factory()
        event.record()
        return event

    def _release(self, first, last, waits) -> None:
        with self._lock:
            self._free.append(first)
            self._free.append(last)
            for a, b in waits:
                self._free += (a, b)

    def begin(self, now: float | None = None) -> None:
        self._first = self._event()
        self._waits = []
        self._depth = 0

    def wait_begin(self) -> None:
        if self._first is None:
            return
        with self._lock:
            self._depth += 1
            outer = self._depth == 1
        if outer:
            self._open = self._event()

    def wait_end(self) -> None:
        with self._lock:
            if self._depth == 0:
                return
            self._depth -= 1
            outer = self._depth == 0
            opened, self._open = (self._open, None) if outer else (None, self._open)
        if outer and opened is not None:
            self._waits.append((opened, self._event()))

    def end(self, now: float | None = None) -> Reading:
        if self._first is None:
            return _Ready(None)
        if self._depth and self._open is not None:
            self._waits.append((self._open, self._event()))
        self._depth, self._open = 0, None
        reading = _CudaReading(self, self._first, self._event(), self._waits)
        self._first, self._waits = None, []
        return reading


def _cuda_event():
    import torch

    return torch.cuda.Event(enable_timing=True)


def make_compute_timer(cuda: bool, clock: Callable[[], float] = time.perf_counter):
    """The timer for a rank whose step runs on a CUDA device (``cuda``) or on the host."""
    return CudaComputeTimer() if cuda else HostComputeTimer(clock=clock)
