"""The hang detector's peers' evidence: ranks held up where their peers went on, found
without a learned timeout, and the suspects of a hang (see :mod:`.hang`). A mixin of
:class:`~.hang.HangDetector`, over its state."""
from __future__ import annotations

from .base import fmt_ranks
from .rank_books import book_of, merge_positions

__all__ = ["PeersEvidence"]


class PeersEvidence:
    """What a hang's peers tell: :meth:`left_behind` and :meth:`_suspects`, merged from the
    answers of ``HangDetector``'s books of ranks (``_books``: :class:`~.rank_books.PhaseBook`,
    one, or one per partition), over its state (``_latest``, ``_not_pauses``, ...)."""

    def left_behind(self, now: float):
        """Ranks held up where their peers went on (see the module): ``(ranks, why)`` or
        ``None``. Every duration is taken on one rank's own clock (its heartbeat's time
        against its phase's start), so no machine's clock offset makes another look stuck.

        A healthy job is told apart without a look at every rank: a rank that entered its
        step phase less than the wait that would count before its last heartbeat leaves no
        one behind in the step (it is either behind, and not for long, or ahead, and its
        peers did not wait long), and only ranks in an allowed phase can be behind in one."""
        need = self._step_need()
        pausing = self._pausing_fresh(now)
        if (need is None or self._moved_within(need, now)) and not pausing:
            return None
        books, stale_s = self._askable(), self.stale_s
        positions = None if pausing or need is None else merge_positions(
            b.positions(now, stale_s) for b in books)   # a rank in a pause has no position
        if positions is None:
            fresh = sum(b.fresh_count(now, stale_s) for b in books)
        else:
            fresh = positions[0]
        if fresh < 2:
            return None
        return (positions is not None and self._behind_in_step(positions, need, now)) \
            or (pausing and self._behind_in_phase(now)) or None

    def _step_need(self) -> float | None:
        """How long ranks must have waited for peers still in an earlier point of the step
        (``None``: no step time known yet, nothing to compare with)."""
        known = self.known_step_s()
        if known <= 0:
            return None
        return max(self.floor_s, self.peer_factor * known,
                   self.max_margin * self._longest.get("step", 0.0))

    def _askable(self) -> list:
        """What the questions are asked of: the books (a subclass may answer from their
        summaries, :mod:`.live_ticks`)."""
        return self._books

    def _rank_book(self, rank):
        return book_of(self._books, rank)

    def _moved_within(self, need: float, now: float) -> bool:
        """Whether the rank heard of last, live and fresh, had been in its phase for less
        than ``need`` when it was heard."""
        rank = self._latest
        if rank is None:
            return False
        book = self._rank_book(rank)
        h = book.hb.get(rank)
        return h is not None and rank not in book.exited and now - h[0] < self.stale_s \
            and h[0] - h[2] < need

    def _pausing_fresh(self, now: float) -> bool:
        """Whether a live, fresh rank is in an allowed phase that pauses the job."""
        return any(b.pausing_fresh(now, self.stale_s, self._not_pauses)
                   for b in self._askable())

    def _over(self, now: float) -> bool:
        """Whether some ranks exited and every rank exited or went quiet after them."""
        if not any(b.exited for b in self._books):
            return False
        return not self.view.heard_within(now, self.stale_s,
                                          lambda r: r in self._rank_book(r).exited)

    def _behind_in_step(self, positions, need: float, now: float):
        if positions is None:
            return None                  # a pause (or an unknown phase) explains any wait
        fresh, first, at, wait_at, waited = positions
        if at * 2 > fresh:
            return None                  # most ranks are there: no peers went on without them
        if waited < need or wait_at < waited:
            return None
        behind = sorted(r for b in self._askable()
                        for r in b.at_position(first, now, self.stale_s))
        phase = self._rank_book(behind[0]).hb[behind[0]][1]
        known = self.known_step_s()
        return behind, (f"{fmt_ranks(behind)} still in {phase} while the others went on and "
                        f"waited {waited:.0f}s (the longest step known is {known:.1f}s)")

    def _behind_in_phase(self, now: float):
        groups: dict = {}
        for book in self._askable():
            for key, g in book.phase_groups(now, self.stale_s, self._not_pauses).items():
                m = groups.get(key)
                if m is None:
                    groups[key] = list(g)
                else:
                    m[0] += g[0]
                    m[1] = max(m[1], g[1])
                    m[2] += g[2]
                    m[3] = max(m[3], g[3])
                    m[4] = min(m[4], g[4])
        for (phase, step), (inside, longest_wait, left, their_time, out) in sorted(
                groups.items(), key=lambda kv: (kv[0][0], _order_of_step(kv[0][1]))):
            spread = self._spread.get(phase)
            if not inside or spread is None:
                continue                 # never seen complete on two ranks: its allowance
            if left < inside:
                continue                 # most of the occurrence's ranks are still in it
            need = max(self.peer_factor * max(spread, 1.0) * their_time,
                       self._longest.get(phase, 0.0))
            if longest_wait >= need and out >= self.floor_s:
                stuck = sorted(r for b in self._askable() for r in b.fresh_where(
                    now, self.stale_s, (), lambda h: h[1] == phase and h[3] == step
                    and h[0] - h[2] >= need))
                return stuck, (f"{fmt_ranks(stuck)} still in {phase}, which the other ranks "
                               f"left after at most {their_time:.0f}s, {out:.0f}s ago")
        return None

    def _current_phase(self):
        """The allowed phase the job is in or just left (for false-alarm feedback; the first
        by name when ranks are in several)."""
        phases = set()
        for book in self._askable():
            phases |= book.pausing_phases(self._not_pauses)
        if phases:
            return min(phases)
        return None if self._progress_ts is not None else "first_step"

    def _suspects(self, now: float):
        unseen = self.view.unseen        # their heartbeats look stale: nobody reads them
        books, stale_s = self._askable(), self.stale_s
        census = [b.census(now, stale_s, unseen) for b in books]
        live = sum(c["live"] for c in census)
        stale = sorted(r for b in books for r in b.stale(now, stale_s, unseen))
        if not any(c["fresh"] for c in census):
            return stale, "no heartbeats"

        def named(keep) -> list:
            return sorted(r for b in books for r in b.fresh_where(now, stale_s, unseen, keep))

        waiting = sum(c["waiting"] for c in census)
        working = sum(c["fresh"] - c["waiting"] for c in census)
        if waiting and working and working < live:
            # the ranks waiting in a collective wait for the ones that never came
            phases = sorted(set().union(*(c["working"] for c in census)))
            return sorted(set(named(lambda h: h[1] != "collective")) | set(stale)), \
                (f"{fmt_ranks(named(lambda h: h[1] == 'collective'))} wait in a collective; "
                 f"the others are in {', '.join(phases)}")
        phases: dict = {}
        steps: dict = {}
        for c in census:
            for p, n in c["phases"].items():
                phases[p] = phases.get(p, 0) + n
            for s, n in c["steps"].items():
                steps[s] = steps.get(s, 0) + n
        phase = max(phases.items(), key=lambda kv: (kv[1], str(kv[0])))[0]
        step = max(steps.items(), key=lambda kv: (kv[1], _step_key(kv[0])))[0]
        odd = named(lambda h: h[1] != phase or h[3] != step)
        suspects = sorted(set(odd) | set(stale))
        if len(suspects) * 2 >= live:
            positions = merge_positions(b.positions(now, stale_s, unseen) for b in books)
            suspects = self._behind(positions, live, now, unseen)
            if suspects:
                return suspects, "the others went further in the step and wait for them"
        return suspects, f"phase {phase}, step {step}"

    def _behind(self, positions, live: int, now: float, unseen) -> list:
        """With no clear majority (two ranks, say): the ranks behind the others in the step
        (an earlier step, or an earlier phase of it) hold them up."""
        if positions is None:
            return []
        fresh, first, at, _, _ = positions
        if at == fresh:
            return []                    # all at one place
        if at * 2 > live:
            return []
        return sorted(r for b in self._askable()
                      for r in b.at_position(first, now, self.stale_s, unseen))


def _step_key(step) -> int:
    return step if step is not None else -1


def _order_of_step(step) -> tuple:
    """A step's place among pauses' steps: numbers first, in order (None before them), then
    anything else a heartbeat told, by its text."""
    if step is None:
        return (0, -1)
    if type(step) in (int, float):
        return (0, step)
    return (1, str(step))
