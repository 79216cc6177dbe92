"""Test stand-ins for the action service's injected event source and clock, and for a
collector's producer."""
from __future__ import annotations

from typing import Iterable

from trainguard import events as ev


class FakeClock:
    """A clock for tests: ``clock()`` reads it, ``sleep(s)`` and ``advance(s)`` move it."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    sleep = advance


class ListSource:
    """Events from a list, in order; once empty, ``poll`` lets ``clock`` run for ``timeout``."""

    def __init__(self, events: Iterable[ev.Event] = (), clock: FakeClock | None = None):
        self.events = list(events)
        self.clock = clock

    def add(self, *events: ev.Event) -> None:
        self.events.extend(events)

    def poll(self, timeout: float) -> ev.Event | None:
        if self.events:
            return self.events.pop(0)
        if self.clock is not None:
            self.clock.advance(timeout)
        return None


class Sink:
    """Stands in for a collector's producer: keeps the records it is given."""

    dropped = 0

    def __init__(self):
        self.records = []

    def produce(self, record, key=None):
        self.records.append(record)


def steps_of(sink):
    """The step records a collector gave ``sink``."""
    return [r for r in sink.records if type(r) is tuple and r[0] == 1]
