"""The hang detector's peers' evidence: ranks held up where their peers went on, found
without a learned timeout, and the suspects of a hang (see :mod:`.hang`). A mixin of
:class:`~.hang.HangDetector`, over its state."""
from __future__ import annotations

from .base import fmt_ranks
from .phases import PHASE_ORDER, STEP_PHASES, is_allowed_phase

__all__ = ["PeersEvidence"]


class PeersEvidence:
    """What a hang's peers tell: :meth:`left_behind` and :meth:`_suspects` (``HangDetector``
    keeps the state they read: ``_hb``, ``_exited``, ``_pausing``, ``_ended``, ...)."""

    def left_behind(self, now: float):
        """Ranks held up where their peers went on (see the module): ``(ranks, why)`` or
        ``None``. Every duration is taken on one rank's own clock (its heartbeat's time
        against its phase's start), so no machine's clock offset makes another look stuck.

        A healthy job is told apart without a look at every rank: a rank that entered its
        step phase less than the wait that would count before its last heartbeat leaves no
        one behind in the step (it is either behind, and not for long, or ahead, and its
        peers did not wait long), and only ranks in an allowed phase can be behind in one."""
        need = self._step_need()
        if (need is None or self._moved_within(need, now)) and not self._pausing_fresh(now):
            return None
        fresh = {r: h for r, h in self._hb.items()
                 if r not in self._exited and now - h[0] < self.stale_s}
        if len(fresh) < 2:
            return None
        return (need is not None and self._behind_in_step(fresh, need)) \
            or self._behind_in_phase(fresh)

    def _step_need(self) -> float | None:
        """How long ranks must have waited for peers still in an earlier point of the step
        (``None``: no step time known yet, nothing to compare with)."""
        known = self.known_step_s()
        if known <= 0:
            return None
        return max(self.floor_s, self.peer_factor * known,
                   self.max_margin * self._longest.get("step", 0.0))

    def _moved_within(self, need: float, now: float) -> bool:
        """Whether the rank heard of last, live and fresh, had been in its phase for less
        than ``need`` when it was heard."""
        rank = self._latest
        h = self._hb.get(rank)
        return h is not None and rank not in self._exited and now - h[0] < self.stale_s \
            and h[0] - h[2] < need

    def _pausing_fresh(self, now: float) -> bool:
        """Whether a live, fresh rank is in an allowed phase that pauses the job."""
        hb, exited, not_pauses = self._hb, self._exited, self._not_pauses
        return any(r not in exited and now - hb[r][0] < self.stale_s
                   and hb[r][1] not in not_pauses for r in self._pausing)

    def _behind_in_step(self, fresh, need: float):
        known = self.known_step_s()
        where = {}
        for r, h in fresh.items():
            order = PHASE_ORDER.get(h[1])
            if order is None:
                return None              # a pause (or an unknown phase) explains any wait
            where[r] = (h[3] if h[3] is not None else -1, order)
        first = min(where.values())
        behind = sorted(r for r, w in where.items() if w == first)
        if len(behind) * 2 > len(fresh):
            return None                  # most ranks are there: no peers went on without them
        waited = min(fresh[r][0] - fresh[r][2] for r, w in where.items() if w != first)
        if waited < need or min(fresh[r][0] - fresh[r][2] for r in behind) < waited:
            return None
        phase = fresh[behind[0]][1]
        return behind, (f"{fmt_ranks(behind)} still in {phase} while the others went on and "
                        f"waited {waited:.0f}s (the longest step known is {known:.1f}s)")

    def _behind_in_phase(self, fresh):
        groups: dict = {}
        for r, h in fresh.items():
            phase = h[1]
            if type(phase) is str and phase not in STEP_PHASES and phase not in self._not_pauses:
                groups.setdefault((phase, h[3]), []).append(r)
        for (phase, step), inside in groups.items():
            spread = self._spread.get(phase)
            if spread is None:
                continue                 # never seen complete on two ranks: its allowance
            left = [(self._ended[r], fresh[r][0]) for r in fresh
                    if r in self._ended and self._ended[r][0] == phase
                    and self._ended[r][3] == step and fresh[r][1] != phase]
            if len(left) < len(inside):
                continue                 # most of the occurrence's ranks are still in it
            their_time = max(e[2] - e[1] for e, _ in left)
            out = min(ts - e[2] for e, ts in left)
            need = max(self.peer_factor * max(spread, 1.0) * their_time,
                       self._longest.get(phase, 0.0))
            stuck = sorted(r for r in inside if fresh[r][0] - fresh[r][2] >= need)
            if stuck and out >= self.floor_s:
                return stuck, (f"{fmt_ranks(stuck)} still in {phase}, which the other ranks "
                               f"left after at most {their_time:.0f}s, {out:.0f}s ago")
        return None

    def _current_phase(self):
        """The allowed phase the job is in or just left (for false-alarm feedback)."""
        for _, phase, _, _, _ in self._hb.values():
            if is_allowed_phase(phase) and phase not in self._not_pauses:
                return phase
        return None if self._progress_ts is not None else "first_step"

    def _suspects(self, now: float):
        unseen = self.view.unseen        # their heartbeats look stale: nobody reads them
        live = {r: h for r, h in self._hb.items() if r not in self._exited and r not in unseen}
        fresh = {r: h for r, h in live.items() if now - h[0] < self.stale_s}
        stale = sorted(r for r in live if r not in fresh)
        if not fresh:
            return stale, "no heartbeats"
        waiting = [r for r, h in fresh.items() if h[1] == "collective"]
        working = sorted(r for r, h in fresh.items() if h[1] != "collective")
        if waiting and working and len(working) < len(live):
            # the ranks waiting in a collective wait for the ones that never came
            phases = sorted({str(fresh[r][1]) for r in working})
            return sorted(set(working) | set(stale)), \
                f"{fmt_ranks(waiting)} wait in a collective; the others are in {', '.join(phases)}"
        phases: dict = {}
        steps: dict = {}
        for _, phase, _, step, _ in fresh.values():
            phases[phase] = phases.get(phase, 0) + 1
            steps[step] = steps.get(step, 0) + 1
        phase = max(phases.items(), key=lambda kv: (kv[1], str(kv[0])))[0]
        step = max(steps.items(), key=lambda kv: (kv[1], kv[0] if kv[0] is not None else -1))[0]
        odd = [r for r, h in fresh.items() if h[1] != phase or h[3] != step]
        suspects = sorted(set(odd) | set(stale))
        if len(suspects) * 2 >= len(live):
            suspects = self._behind(fresh, live)
            if suspects:
                return suspects, "the others went further in the step and wait for them"
        return suspects, f"phase {phase}, step {step}"

    @staticmethod
    def _behind(fresh, live) -> list:
        """With no clear majority (two ranks, say): the ranks behind the others in the step
        (an earlier step, or an earlier phase of it) hold them up."""
        where = {}
        for r, h in fresh.items():
            order = PHASE_ORDER.get(h[1])
            if order is None:
                return []
            where[r] = (h[3] if h[3] is not None else -1, order)
        if len(set(where.values())) < 2:
            return []
        first = min(where.values())
        behind = sorted(r for r, w in where.items() if w == first)
        return behind if len(behind) * 2 <= len(live) else []
