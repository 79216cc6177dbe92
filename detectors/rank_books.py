"""The silent, crash and hang detectors' per-rank state as books (issue 21 point 1, step 2 of
the plan in docs/WORKER.md): what a rank's items leave, and the questions the detector asks of its
ranks. An answer is small (counts, extremes, a histogram of phases or steps) or, for a
finding, the ranks it names. A detector keeps one book; :mod:`.live_parts` keeps one per
telemetry partition, as the rank side would, and the detector merges their answers the same
way in both cases.

>>> book = PhaseBook()
>>> book.put(0, [10.0, "checkpoint", 4.0, 7, 7])
>>> book.put(1, [10.0, "backward", 9.0, 7, None])
>>> book.pause_starts(not_pauses=())
{'checkpoint': 4.0}
>>> book.positions(now=12.0, stale_s=10.0)          # the checkpoint has no place in a step
>>> book.forget(0)
>>> book.positions(now=12.0, stale_s=10.0)          # (fresh, lowest, at it, waits: there, else)
(1, (7, 3), 1, 1.0, inf)
"""
from __future__ import annotations

import math

from .phases import PHASE_ORDER, STEP_PHASES, is_allowed_phase

__all__ = ["HeardBook", "ExitBook", "PhaseBook", "NO_POSITIONS", "merge_positions", "book_of"]


def book_of(books: list, rank):
    """The book of ``rank``: its partition's (``rank % len(books)``), or the only one (any
    rank; the hot paths inline this).

    >>> book_of(["a", "b", "c"], 7), book_of(["a"], "7")
    ('b', 'a')
    """
    return books[rank % len(books)] if len(books) > 1 else books[0]


class HeardBook:
    """The silent detector's ranks: the job's clock when each was last heard, which exited,
    which were reported (and not heard since).

    >>> book = HeardBook()
    >>> for rank, clock in ((0, 3.0), (1, 9.0), (2, 4.0)):
    ...     book.hear(rank, clock, None)
    >>> book.hear(2, 5.0, "exit")
    >>> book.look(limit=4.0, going_on=8.0, half=6.0, unseen=(), node_of=str)
    ([(0, 3.0)], set(), True)
    >>> book.report([0]); book.settled([0, 1, 2])
    [0, 2]
    """

    def __init__(self):
        self.heard: dict = {}      # rank -> the job's clock when it was last heard
        self.exited: set = set()
        self.reported: set = set()

    def hear(self, rank, clock: float, event) -> None:
        """``rank`` heard at ``clock`` of the job; ``event``: a lifecycle item's (None: not
        one; any other than ``exit`` ends an exit)."""
        self.heard[rank] = clock
        if event == "exit":
            self.exited.add(rank)
        elif event is not None:
            self.exited.discard(rank)
        self.reported.discard(rank)

    def shift(self, gap: float) -> None:
        """Everything heard so far heard ``gap`` later (the whole job was quiet)."""
        heard = self.heard
        for rank in heard:
            heard[rank] += gap

    def look(self, limit: float, going_on: float, half: float, unseen, node_of) -> tuple:
        """``(quiet, pending, alive)``: the ranks last heard at ``limit`` or before and not
        reported yet ``[(rank, heard), ...]``, the machines of those heard after it but at
        ``half`` or before, and whether any rank was heard after ``going_on``; ranks that
        exited or are ``unseen`` (nobody reads them now) are left out."""
        quiet, pending, alive = [], set(), False
        exited, reported = self.exited, self.reported
        for rank, ts in self.heard.items():
            if rank in exited or (unseen and rank in unseen):
                continue
            if ts > limit:
                if ts > going_on:
                    alive = True
                if ts <= half:
                    pending.add(node_of(rank))
            elif rank not in reported:
                quiet.append((rank, ts))
        return quiet, pending, alive

    # -- the ranks a finding names ----------------------------------------------------------------
    def settled(self, ranks) -> list:
        """Of ``ranks`` (all this book's), those that exited or were reported."""
        exited, reported = self.exited, self.reported
        return [r for r in ranks if r in exited or r in reported]

    def exited_of(self, ranks) -> list:
        return [r for r in ranks if r in self.exited]

    def report(self, ranks) -> None:
        self.reported.update(ranks)


class ExitBook:
    """The crash detector's ranks: when each was last heard, its step then, and the time of
    its exit until it starts or steps again."""

    def __init__(self):
        self.last: dict = {}       # rank -> newest event time
        self.step: dict = {}       # rank -> its last step
        self.exit: dict = {}       # rank -> time of its exit, until it starts again

    def pending(self, since: float, unseen) -> dict:
        """``{rank: (last heard, last step)}`` of the ranks heard at ``since`` or later that
        have not exited, but ``unseen``."""
        exit, step = self.exit, self.step
        return {r: (ts, step.get(r)) for r, ts in self.last.items()
                if ts >= since and r not in exit and r not in unseen}

    def latest_exit(self) -> float:
        return max(self.exit.values(), default=-math.inf)


#: :meth:`PhaseBook.positions` of no fresh rank
NO_POSITIONS = (0, None, 0, math.inf, math.inf)


def merge_positions(answers):
    """The job's :meth:`PhaseBook.positions` from its books' (``None`` when any is).

    >>> merge_positions([(2, (7, 3), 1, 5.0, 2.0), (1, (7, 1), 1, 9.0, math.inf)])
    (3, (7, 1), 1, 9.0, 2.0)
    """
    answers = list(answers)
    if any(a is None for a in answers):
        return None
    lowest = min((a[1] for a in answers if a[0]), default=None)
    if lowest is None:
        return NO_POSITIONS
    fresh = at = 0
    wait_at = wait_else = math.inf
    for n, low, n_low, w_low, w_else in answers:
        fresh += n
        if not n:
            continue
        if low == lowest:
            at += n_low
            wait_at = min(wait_at, w_low)
            wait_else = min(wait_else, w_else)
        else:
            wait_else = min(wait_else, w_low, w_else)
    return fresh, lowest, at, wait_at, wait_else


class PhaseBook:
    """The hang detector's ranks: each one's latest heartbeat entry ``[ts, phase, since,
    step, first step in it (an allowed phase), or the step whose record ended it]``, the
    ranks in an allowed phase, each one's last allowed phase ``[phase, since, end, step]``,
    and the ranks that exited."""

    def __init__(self):
        self.hb: dict = {}
        self.pausing: set = set()
        self.ended: dict = {}
        self.exited: set = set()

    def put(self, rank, entry) -> None:
        self.hb[rank] = entry
        if is_allowed_phase(entry[1]):
            self.pausing.add(rank)
        else:
            self.pausing.discard(rank)

    def forget(self, rank) -> None:
        """``rank`` started again: its phases are new."""
        self.exited.discard(rank)
        self.hb.pop(rank, None)
        self.pausing.discard(rank)
        self.ended.pop(rank, None)

    # -- questions: a few numbers each ----------------------------------------------------------
    def pause_starts(self, not_pauses) -> dict:
        """``{phase: latest start}`` of the live ranks in an allowed phase that pauses."""
        hb, exited, out = self.hb, self.exited, {}
        for rank in self.pausing:
            _, phase, start, _, _ = hb[rank]
            if rank not in exited and phase not in not_pauses and start > out.get(phase, -math.inf):
                out[phase] = start
        return out

    def pausing_fresh(self, now: float, stale_s: float, not_pauses) -> bool:
        """Whether a live, fresh rank is in an allowed phase that pauses the job."""
        hb, exited = self.hb, self.exited
        return any(r not in exited and now - hb[r][0] < stale_s and hb[r][1] not in not_pauses
                   for r in self.pausing)

    def pausing_phases(self, not_pauses) -> set:
        """The allowed phases that pause, of every rank that entered one last."""
        return {self.hb[r][1] for r in self.pausing} - set(not_pauses)

    def _fresh(self, now: float, stale_s: float, unseen):
        exited = self.exited
        for rank, h in self.hb.items():
            if rank not in exited and now - h[0] < stale_s and not (unseen and rank in unseen):
                yield rank, h

    def fresh_count(self, now: float, stale_s: float, unseen=()) -> int:
        """How many live ranks (but ``unseen``) were heard within ``stale_s``."""
        exited, n = self.exited, 0
        for rank, h in self.hb.items():
            if now - h[0] < stale_s and rank not in exited and not (unseen and rank in unseen):
                n += 1
        return n

    def positions(self, now: float, stale_s: float, unseen=()):
        """Where the fresh live ranks are in the step (its number, then the phase's place in
        :data:`~.phases.PHASE_ORDER`): ``(fresh, lowest, how many there, their shortest wait,
        the others' shortest wait)``, a wait being how long a rank is in its phase by its own
        clock; ``None`` when one is in a phase with no place (a pause)."""
        n = at = 0
        lowest = None
        wait_at = wait_else = math.inf
        order = PHASE_ORDER
        for _, h in self._fresh(now, stale_s, unseen):
            place = order.get(h[1])
            if place is None:
                return None
            pos = (h[3] if h[3] is not None else -1, place)
            wait = h[0] - h[2]
            n += 1
            if lowest is None or pos < lowest:
                if lowest is not None:
                    wait_else = min(wait_else, wait_at)
                lowest, at, wait_at = pos, 1, wait
            elif pos == lowest:
                at += 1
                wait_at = min(wait_at, wait)
            else:
                wait_else = min(wait_else, wait)
        return (n, lowest, at, wait_at, wait_else) if n else NO_POSITIONS

    def phase_groups(self, now: float, stale_s: float, not_pauses, unseen=()) -> dict:
        """Per occurrence ``(phase, step)`` of an allowed phase that pauses, over the fresh
        live ranks: ``[inside, their longest wait, how many left it, the longest time one
        spent in it, the shortest time since one left it]``."""
        groups: dict = {}
        ended = self.ended
        for rank, h in self._fresh(now, stale_s, unseen):
            phase = h[1]
            if type(phase) is str and phase not in STEP_PHASES and phase not in not_pauses:
                g = groups.get((phase, h[3]))
                if g is None:
                    g = groups[(phase, h[3])] = [0, -math.inf, 0, -math.inf, math.inf]
                g[0] += 1
                wait = h[0] - h[2]
                if wait > g[1]:
                    g[1] = wait
            e = ended.get(rank)
            if e is not None and h[1] != e[0]:
                g = groups.get((e[0], e[3]))
                if g is None:
                    g = groups[(e[0], e[3])] = [0, -math.inf, 0, -math.inf, math.inf]
                g[2] += 1
                took, out = e[2] - e[1], h[0] - e[2]
                if took > g[3]:
                    g[3] = took
                if out < g[4]:
                    g[4] = out
        return groups

    def census(self, now: float, stale_s: float, unseen) -> dict:
        """Over the live ranks but ``unseen``: how many, how many fresh, how many of those wait
        in a collective, the phases of the others, and the fresh ranks' phases and steps
        (histograms)."""
        live = fresh = waiting = 0
        phases: dict = {}
        steps: dict = {}
        working: set = set()
        exited = self.exited
        for rank, h in self.hb.items():
            if rank in exited or (unseen and rank in unseen):
                continue
            live += 1
            if now - h[0] >= stale_s:
                continue
            fresh += 1
            phase, step = h[1], h[3]
            phases[phase] = phases.get(phase, 0) + 1
            steps[step] = steps.get(step, 0) + 1
            if phase == "collective":
                waiting += 1
            else:
                working.add(str(phase))
        return {"live": live, "fresh": fresh, "waiting": waiting, "working": working,
                "phases": phases, "steps": steps}

    # -- the ranks a finding names ----------------------------------------------------------------
    def stale(self, now: float, stale_s: float, unseen) -> list:
        exited = self.exited
        return [r for r, h in self.hb.items() if r not in exited and now - h[0] >= stale_s
                and not (unseen and r in unseen)]

    def fresh_where(self, now: float, stale_s: float, unseen, keep) -> list:
        """The fresh live ranks whose entry ``keep(entry)`` holds."""
        return [r for r, h in self._fresh(now, stale_s, unseen) if keep(h)]

    def at_position(self, pos, now: float, stale_s: float, unseen=()) -> list:
        order = PHASE_ORDER
        return self.fresh_where(now, stale_s, unseen, lambda h: (
            h[3] if h[3] is not None else -1, order.get(h[1])) == pos)
