"""Event-time sanity: the pre-filter that keeps one badly stamped event from poisoning a job.

Used by the stream worker (before the rank stages; a refused event is dead-lettered with
its reason) and by ``trainguard analyze`` (a refused event is counted, with its reason, in
the output); no detector ever sees such an event, so it never moves a clock.

Per job, an event is refused when

- its ``ts`` is more than ``future_s`` after the newest ``ts`` accepted for the job, or more
  than ``past_s`` before it (one machine's clock may run behind the others': ``past_s`` is
  large);
- online, its ``ts`` is more than ``future_s`` after the time the broker stamped on the
  message, or more than ``broker_past_s`` before it (a collector may send a backlog late);
- its ``step`` is above ``max_step``, or more than ``step_jump`` plus ``step_rate`` steps a
  second of event time ahead of the job's highest accepted step.

The first event of a job is taken as it is (offline there is nothing to judge it by). When
the job's time or steps really moved (a clock stepped, a job id reused), ``rejoin`` refused
events in a row that agree among themselves are taken as the job's new reference.

>>> from trainguard import events as ev
>>> f = EventTimeFilter()
>>> step = lambda ts, s: ev.Step(job="j", ts=ts, node="n1", rank=0, step=s, step_time=1.0)
>>> [f.check(step(1_764_000_000.0 + s, s)) for s in range(3)]
[None, None, None]
>>> f.check(step(1_764_000_003.0, 2**62))
'implausible step 4611686018427387904: above the largest plausible step 1000000000000'
>>> f.check(step(1_764_000_003.0, 5_000_000))
"implausible step 5000000: 4999998 steps past the job's highest step 2 within 1.0s (allowed 101000)"
>>> f.check(step(1.0, 3))
"implausible ts 1.000: 1764000001s before the job's newest event (1764000002.000; allowed 3600s)"
>>> f.check(step(4_102_444_800.0, 3), broker_ts=1_764_000_003.5)
'implausible ts 4102444800.000: 2338444796s after the broker received it (allowed 300s)'
>>> f.check(step(1_764_000_003.0, 3), broker_ts=1_764_000_003.5), f.rejected
(None, 4)
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EventTimeLimits", "EventTimeFilter"]


@dataclass(kw_only=True, frozen=True)
class EventTimeLimits:
    """How far an event may stray; generous, so that clock skew between machines and a
    collector's late backlog pass."""

    future_s: float = 300.0          # ahead of the job's newest event, or of the broker time
    past_s: float = 3600.0           # behind the job's newest event
    broker_past_s: float = 86400.0   # behind the broker time (a backlog sent late)
    max_step: int = 10 ** 12
    step_jump: int = 100_000         # steps ahead of the job's highest, plus ...
    step_rate: float = 1000.0        # ... this many a second of event time since it
    rejoin: int = 16                 # refused events in a row that agree: the new reference
    max_jobs: int = 100_000          # jobs remembered (the oldest are forgotten)

    def __post_init__(self):
        for name in ("future_s", "past_s", "broker_past_s", "step_rate"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        for name in ("max_step", "step_jump", "rejoin", "max_jobs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")


class _Job:
    __slots__ = ("newest", "top_step", "top_ts", "streak", "streak_ts", "streak_step")

    def __init__(self, ts):
        self.newest = ts
        self.top_step = None
        self.top_ts = ts
        self.streak = 0
        self.streak_ts = 0.0
        self.streak_step = None


class EventTimeFilter:
    """``check(event, broker_ts=None)``: None to accept the event (and learn from it), else
    the reason it is refused. ``rejected`` counts the refusals."""

    def __init__(self, limits: EventTimeLimits | None = None):
        self.limits = limits if limits is not None else EventTimeLimits()
        self.jobs: dict = {}
        self.rejected = 0
        lim = self.limits
        self._fast = (lim.past_s, lim.future_s, lim.step_jump, lim.max_step)
        self._broker_past, self._future = lim.broker_past_s, lim.future_s

    def check(self, event, broker_ts: float | None = None) -> str | None:
        ts = event.ts
        step = getattr(event, "step", None)
        job = self.jobs.get(event.job)
        if job is not None and not job.streak and (
                broker_ts is None
                or broker_ts - self._broker_past <= ts <= broker_ts + self._future):
            # the common case: well within every limit (what _check would accept)
            past, future, jump, max_step = self._fast
            newest = job.newest
            if newest - past <= ts <= newest + future:
                top = job.top_step
                if step is None or (top is not None and step - top <= jump
                                    and step <= max_step):
                    if ts > newest:
                        job.newest = ts
                    if step is not None and step > top:
                        job.top_step, job.top_ts = step, ts
                    return None
        return self._check(event, ts, step, job, broker_ts)

    def _check(self, event, ts, step, job, broker_ts) -> str | None:
        lim = self.limits
        if broker_ts is not None:
            if ts > broker_ts + lim.future_s:
                return self._refuse(f"implausible ts {ts:.3f}: {ts - broker_ts:.0f}s after the "
                                    f"broker received it (allowed {lim.future_s:.0f}s)")
            if ts < broker_ts - lim.broker_past_s:
                return self._refuse(f"implausible ts {ts:.3f}: {broker_ts - ts:.0f}s before "
                                    f"the broker received it (allowed {lim.broker_past_s:.0f}s)")
        if step is not None and step > lim.max_step:
            return self._refuse(f"implausible step {step}: above the largest plausible step "
                                f"{lim.max_step}")
        if job is None:
            if len(self.jobs) >= lim.max_jobs:
                del self.jobs[next(iter(self.jobs))]
            job = self.jobs[event.job] = _Job(ts)
        reason = None
        newest = job.newest
        if ts > newest + lim.future_s:
            reason = (f"implausible ts {ts:.3f}: {ts - newest:.0f}s after the job's newest "
                      f"event ({newest:.3f}; allowed {lim.future_s:.0f}s)")
        elif ts < newest - lim.past_s:
            reason = (f"implausible ts {ts:.3f}: {newest - ts:.0f}s before the job's newest "
                      f"event ({newest:.3f}; allowed {lim.past_s:.0f}s)")
        elif step is not None and job.top_step is not None:
            allowed = lim.step_jump + lim.step_rate * max(0.0, ts - job.top_ts)
            if step - job.top_step > allowed:
                reason = (f"implausible step {step}: {step - job.top_step} steps past the job's "
                          f"highest step {job.top_step} within {max(0.0, ts - job.top_ts):.1f}s "
                          f"(allowed {allowed:.0f})")
        if reason is not None and not self._rejoined(job, ts, step):
            return self._refuse(reason)
        job.streak = 0
        if ts > job.newest:
            job.newest = ts
        if step is not None and (job.top_step is None or step > job.top_step):
            job.top_step, job.top_ts = step, ts
        return None

    def _rejoined(self, job: _Job, ts: float, step) -> bool:
        """Count a refusal towards a new reference: True once ``rejoin`` in a row agree."""
        lim = self.limits
        if job.streak and abs(ts - job.streak_ts) <= lim.future_s and (
                step is None or job.streak_step is None
                or abs(step - job.streak_step) <= lim.step_jump):
            job.streak += 1
        else:
            job.streak, job.streak_ts, job.streak_step = 1, ts, step
        if job.streak < lim.rejoin:
            return False
        job.newest, job.top_step, job.top_ts = ts, step, ts
        return True

    def _refuse(self, reason: str) -> str:
        self.rejected += 1
        return reason
