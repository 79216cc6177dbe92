"""Waiting without holding a thread: what a pipeline stage yields while it waits.

A stage that has to wait (for the stacks of a capture, or between two capture rounds) is a
generator: it yields a *wait* and is resumed with the wait's value. A wait can be answered
two ways: :meth:`block` (sleep or read until it is over: one anomaly at a time, as in tests
and :meth:`~trainguard.actions.pipeline.Pipeline.process`), or :meth:`poll` (never blocks:
``(True, value)`` once it is over, else ``(False, None)``), which lets the scheduler
(:mod:`trainguard.actions.scheduler`) park thousands of waiting anomalies and go on with
others.

>>> now = [100.0]                         # a clock the example moves by hand
>>> clock, sleep = (lambda: now[0]), (lambda s: now.__setitem__(0, now[0] + s))
>>> def stage():
...     yield Pause(2.0, clock=clock, sleep=sleep)
...     return "done at %g" % clock()
>>> drive(stage())
'done at 102'
>>> pause = Pause(5.0, clock=clock, sleep=sleep)
>>> pause.poll(), sleep(5.0), pause.poll()
((False, None), None, (True, None))
"""
from __future__ import annotations

import time
from typing import Callable, Generator, Protocol

__all__ = ["Wait", "Pause", "Blocking", "drive"]


class Wait(Protocol):
    def poll(self) -> tuple[bool, object]: ...

    def block(self) -> object: ...


class Pause:
    """``seconds`` from now (``clock``) on."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.seconds = seconds
        self.clock = clock
        self.sleep = sleep
        self.start = clock()

    def poll(self) -> tuple[bool, object]:
        return (self.clock() - self.start >= self.seconds), None

    def block(self) -> object:
        left = self.seconds - (self.clock() - self.start)
        if left > 0:
            self.sleep(left)
        return None

    def __repr__(self) -> str:
        return f"Pause({self.seconds:g}s)"


class Blocking:
    """A blocking call (``call()``), made where it holds up nobody: on a worker thread of the
    scheduler, which calls :meth:`start_on` with its executor when the wait is parked
    (inline when there is none), or at once by :meth:`block`."""

    def __init__(self, call: Callable[[], object]):
        self.call = call
        self.future = None

    def start_on(self, executor) -> None:
        if executor is not None:
            self.future = executor.submit(self.call)
        else:
            from concurrent.futures import Future

            self.future = Future()
            try:
                self.future.set_result(self.call())
            except Exception as exc:
                self.future.set_exception(exc)

    def poll(self) -> tuple[bool, object]:
        if self.future is None or not self.future.done():
            return False, None
        return True, self.future.result()  # its exception, if any, goes to the stage

    def block(self) -> object:
        return self.call()

    def __repr__(self) -> str:
        return f"Blocking({getattr(self.call, '__name__', 'call')})"


def drive(steps: Generator):
    """Run a waiting generator to its end, blocking on each wait; returns its value."""
    value = None
    while True:
        try:
            wait = steps.send(value)
        except StopIteration as end:
            return end.value
        value = wait.block()
