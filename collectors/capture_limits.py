"""How many stack captures a node agent runs: per job and per machine, in a sliding window.

Every capture suspends each rank process it samples for a moment (py-spy stops it to read
its stack), so a flood of ``capture_stacks`` commands, forged or not, must not turn into a
flood of captures. The action service asks for ``capture.rounds`` captures per incident
(2 by default), so the defaults leave room for a few incidents a minute.

>>> limiter = CaptureLimiter(CaptureLimits(per_job=2, per_machine=3, window_s=60.0))
>>> [limiter.allow("j1", now) for now in (0.0, 1.0, 2.0)]
[True, True, False]
>>> limiter.allow("j2", 3.0), limiter.allow("j3", 4.0), limiter.allow("j1", 61.5)
(True, False, True)
"""
from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass

__all__ = ["CaptureLimits", "CaptureLimiter"]


@dataclass(kw_only=True, frozen=True)
class CaptureLimits:
    """At most ``per_job`` captures of one job and ``per_machine`` captures in all, in any
    ``window_s`` seconds."""

    per_job: int = 6
    per_machine: int = 20
    window_s: float = 60.0

    def __post_init__(self):
        for name in ("per_job", "per_machine"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"capture limit {name} must be an integer >= 1, got {value!r}")
        if not (isinstance(self.window_s, (int, float)) and math.isfinite(self.window_s)
                and self.window_s > 0):
            raise ValueError(f"capture window_s must be a positive number, got {self.window_s!r}")


class CaptureLimiter:
    """Counts the captures let through; thread-safe. Memory: at most ``per_machine`` times
    per window, so bounded whatever the number of job ids."""

    def __init__(self, limits: CaptureLimits = CaptureLimits()):
        self.limits = limits
        self._machine: deque = deque()
        self._jobs: dict[str, deque] = {}
        self._lock = threading.Lock()

    def allow(self, job: str, now: float) -> bool:
        """True (and counted) when one more capture of ``job`` at ``now`` is within limits."""
        lim = self.limits
        cut = now - lim.window_s
        with self._lock:
            while self._machine and self._machine[0][0] <= cut:
                _, old_job = self._machine.popleft()
                times = self._jobs.get(old_job)
                if times:
                    times.popleft()
                    if not times:
                        del self._jobs[old_job]
            times = self._jobs.get(job, ())
            if len(self._machine) >= lim.per_machine or len(times) >= lim.per_job:
                return False
            self._machine.append((now, job))
            self._jobs.setdefault(job, deque()).append(now)
            return True
