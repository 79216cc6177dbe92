"""Garbage collection on a clock instead of on allocation counts, for the worker.

The worker allocates a few objects per event and keeps hundreds of thousands alive in its
stages (a 4,096-rank job's open steps, per-rank histories). CPython's collector, triggered
by allocation counts, walks those long-lived objects over and over: about a third of the
worker's CPU on the throughput benchmark's job (``bench/run.py stream_throughput``, measured
with collection on and off). Reference counting frees everything but cycles at once, so the
worker turns the automatic collector off and collects all generations itself every
``interval_s`` seconds, from the job side's timer. Cyclic garbage then lives at most that
long. Objects made while starting up are frozen out of every collection.

>>> import gc
>>> t = iter([0.0, 10.0, 31.0, 40.0])
>>> collection = ScheduledCollection(30.0, clock=lambda: next(t))
>>> collection.start()               # reads the clock: 0.0
>>> gc.isenabled()
False
>>> collection.maybe_collect(), collection.collections        # 10.0: not yet
(False, 0)
>>> collection.maybe_collect(), collection.collections        # 31.0: collected
(True, 1)
>>> collection.maybe_collect()                                 # 40.0: next at 61.0
False
>>> collection.stop(); gc.isenabled()
True
"""
from __future__ import annotations

import gc
import logging
import time

__all__ = ["ScheduledCollection"]

log = logging.getLogger(__name__)
#: a collection that takes longer than this is logged (the event loop waits meanwhile)
SLOW_COLLECTION_S = 1.0


class ScheduledCollection:
    """``start()`` once the process is set up; ``maybe_collect()`` from a periodic timer."""

    def __init__(self, interval_s: float, clock=time.monotonic):
        if not interval_s > 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self.clock = clock
        self.collections = 0
        self.seconds = 0.0          # spent collecting, all collections together
        self._next = None

    def start(self) -> None:
        gc.freeze()
        gc.disable()
        self._next = self.clock() + self.interval_s

    def stop(self) -> None:
        gc.enable()
        gc.unfreeze()

    def maybe_collect(self) -> bool:
        if self._next is None:
            return False
        now = self.clock()
        if now < self._next:
            return False
        began = time.perf_counter()
        gc.collect()
        took = time.perf_counter() - began
        self.collections += 1
        self.seconds += took
        self._next = now + self.interval_s
        if took > SLOW_COLLECTION_S:
            log.warning("garbage collection took %.1fs", took)
        return True
