"""The hang detector: no progress from the job for longer than its own history allows.

The no-progress clock starts at the later of the job's last new step and the end of the last
*allowed phase* (``checkpoint``, ``eval``, ``init`` or a user-declared one: any phase name
that is not one of the step's own, :data:`STEP_PHASES`). While a rank is inside an allowed
phase, the deadline is at least that phase's start plus its allowance. Allowances are learned
per job and phase (the longest this job ever spent in it, times ``phase_factor``) and never
drop below generous defaults; the first step after a (re)start has its own budget
(``first_step_s``). A user phase during which steps go on (one wrapped around the whole
loop) is no pause: it stops counting as an allowance for that job.

Between steps, the timeout is ``max(floor_s, factor x p99 of the job's step intervals,
max_margin x the longest interval seen)``, counted from the later of the last step and the
latest phase change of any rank within the step (a job-wide slow step still moves from
phase to phase; a hung job does not), or a later record of the newest step (its first may
come from a machine whose clock is behind, not learned yet). It is judged up to the time
every source of the job was heard (:meth:`JobView.judged`: on the worker's job side, a
machine whose records are stamped behind, or let go early, is not taken for stalled by
its peers' newer stamps). Until ``min_intervals`` intervals are learned, the
warm-up steps are judged on what is known: the longest interval and the longest step time the
ranks reported (step 0's holds its compile), times a margin that shrinks as intervals come in,
``max_margin + factor x early_margin / sqrt(n)`` after ``n >= 1`` intervals (13 after one, 7
after four, 2.2 after a hundred), never more than the first-step budget, which the second
step still gets (a job of 10-minute steps is not hung in it). The same margin on the longest
interval keeps counting after ``min_intervals``: a few dozen samples of a noisy step time say
little of its tail. A stall reported as a hang teaches no interval (false-alarm feedback
does). A one-rank hang early in a job is found sooner from its peers (below).

Peers' evidence finds a rank left behind without a learned timeout (:meth:`left_behind`):

- *in the step*: the ranks furthest behind in it (an earlier last step, or an earlier phase:
  ``data`` < ``forward`` < ``backward`` < ``optimizer`` < ``collective``) hold up the others,
  which have waited where they are for ``max(floor_s, peer_factor x the longest step known)``
  by their own clocks. Needs one known step time, and no rank in a pausing phase;
- *in an allowed phase*: a rank still in a phase that the other ranks of the same occurrence
  (same phase, same last step) all left, for ``k x`` their longest time in it, and at least
  ``floor_s`` after they left. ``k = peer_factor x`` the spread of that phase learned in
  earlier occurrences on this job (its slowest rank's time over its fastest's): a phase whose
  work is uneven by design (rank 0 writes, the others pass through) learns a large ``k``, and
  a phase not yet seen complete on two ranks is left to its allowance.

A hang is reported once per stall; progress ends the stall, so a later stall is a new finding
(its key holds the onset). :meth:`HangDetector.note_false_alarm` widens the allowance of a
phase after the action service found a reported hang to be none.

>>> d = HangDetector(floor_s=10.0)
>>> for s in range(30):
...     for r in range(4):
...         _ = d.update({"k": "step", "rank": r, "node": "n1", "ts": 100.0 + s, "step": s})
>>> hb = [{"k": "hb", "rank": r, "node": "n1", "ts": 138.0, "step": 29,
...        "phase": "data" if r == 2 else "collective", "phase_since": 130.0}
...       for r in range(4)]
>>> _ = [d.update(h) for h in hb]
>>> d.advance(135.0)
[]
>>> [(f.kind, f.ranks, f.step, f.onset_ts) for f in d.advance(140.0)]
[('hang', [2], 29, 129.0)]

A 45 s checkpoint after 6 s steps is no hang: the clock starts when it ends.

>>> d = HangDetector()
>>> for s in range(10):
...     _ = d.update({"k": "step", "rank": 0, "ts": 6.0 * s, "step": s})
>>> _ = d.update({"k": "hb", "rank": 0, "ts": 55.0, "step": 9, "phase": "checkpoint",
...               "phase_since": 54.0})
>>> _ = d.update({"k": "hb", "rank": 0, "ts": 100.0, "step": 9, "phase": "data",
...               "phase_since": 99.0})
>>> d.advance(110.0), d.deadline() - 99.0
([], 30.0)

Early in a job: four 6 s intervals known, rank 1 stuck in ``data`` at step 5 while rank 0
waits in ``backward``; it is named 20 s after rank 0 began to wait (its own clock).

>>> d = HangDetector()
>>> for s in range(5):
...     for r in range(2):
...         _ = d.update({"k": "step", "rank": r, "ts": 6.0 * s, "step": s, "step_time": 6.0})
>>> round(d.timeout(), 1)
42.0
>>> for t in (30.0, 50.0):
...     _ = d.update({"k": "hb", "rank": 1, "ts": t, "step": 4, "phase": "data",
...                   "phase_since": 24.5})
...     _ = d.update({"k": "hb", "rank": 0, "ts": t, "step": 4, "phase": "backward",
...                   "phase_since": 30.0})
>>> [(f.ranks, f.evidence["rule"]) for f in d.advance(50.0)]
[([1], 'left_behind')]
"""
from __future__ import annotations

from dataclasses import dataclass

from river import stats

from trainguard.setting import MONTH_S, setting

from .base import Detector, Finding, fmt_ranks
from .hang_peers import PeersEvidence
from .phases import STEP_PHASES, is_allowed_phase
from .rank_books import PhaseBook
from .view import UsesView
from .registry import register_detector

__all__ = ["HangDetector", "STEP_PHASES", "is_allowed_phase"]

_SECONDS = (0.1, MONTH_S)
_FACTOR = (1.0, 100.0)


@register_detector(kinds="hang", ladder=("capture", "evict_suspects", "restart", "alert"),
                   priority=70, causes={"hang": "any", "machine_outlier": "shared"})
class HangDetector(PeersEvidence, UsesView, Detector):
    """No new step from the job for longer than its learned timeout (see the module)."""

    PREFIX = "hang"
    CONSUMES = ("step", "hb", "life", "tick")

    @dataclass(kw_only=True)
    class Config:
        floor_s: float = setting(20.0, "the hang timeout is never below this many seconds",
                                 live=_SECONDS)
        factor: float = setting(2.0, "timeout: factor x the quantile of the job's step "
                                     "intervals", live=_FACTOR)
        quantile: float = setting(0.99, "quantile of the step intervals the timeout scales",
                                  above=0, maximum=1)
        window: int = setting(500, "step intervals the quantile is learned over", minimum=1)
        max_margin: float = setting(1.0, "... and never below this x the longest of them",
                                    live=(0.0, 100.0))
        min_intervals: int = setting(5, "before, the first-step budget applies",
                                     live=(0, 100_000))
        checkpoint_s: float = setting(1800.0, "default allowance of a `checkpoint` phase",
                                      live=_SECONDS)
        eval_s: float = setting(1800.0, "... of `eval`", live=_SECONDS)
        phase_s: float = setting(1800.0, "... of a user-declared phase", live=_SECONDS)
        first_step_s: float = setting(1800.0, "budget of `init` and the first step after a "
                                              "start", live=_SECONDS)
        phase_factor: float = setting(3.0, "allowance >= this x the longest seen in the job",
                                      live=(0.0, 100.0))
        stale_s: float = setting(10.0, "a rank with no heartbeat for this long is a suspect",
                                 live=_SECONDS)
        early_margin: float = setting(6.0, "timeout >= (max_margin + factor x this / sqrt(n)) "
                                           "x longest step", live=(0.0, 100.0))
        peer_factor: float = setting(2.0, "ranks left behind: peers waited this x the longest "
                                          "step", minimum=1, live=_FACTOR)

    def _start(self) -> None:
        self._intervals = stats.RollingQuantile(q=self.quantile, window_size=self.window)
        self._recent = []              # the last `window` intervals, for their maximum
        self._recent_max = 0.0
        self._n_intervals = 0
        self._step_time_max = 0.0      # the longest step time a rank reported ...
        self._paused_steps: list = []  # ... but in the latest steps a pause fell in
        self._longest: dict = {}       # phase -> longest duration seen (and false alarms)
        self._not_pauses: list = []    # user phases during which steps went on
        self._max_step = None
        self._progress_ts = None
        self._start_ts = None          # the job's latest (re)start, for the first step
        self._phase_end_ts = None      # end of the latest allowed phase
        self._moved_ts = None          # latest start of a step phase on any rank
        self._paused_since_progress = False
        self._books = [PhaseBook()]    # the ranks' heartbeat entries, phases, exits
        self._latest = None            # the rank whose entry was put last (left_behind)
        self._spread: dict = {}        # phase -> its slowest rank's time over its fastest's
        self._occurrence: dict = {}    # phase -> [step, shortest, longest] of its latest
        self._init_view()              # where ranks run, when each was last heard
        self._finished = False
        self._hung = False

    # -- learning -----------------------------------------------------------------------------
    def update(self, item) -> list[Finding]:
        if type(item) is not dict:
            return []
        if self._own_view:
            self.view.learn(item)
        k = item.get("k")
        ts = item.get("ts")
        if ts is None:
            return []
        if self._start_ts is None:
            self._start_ts = ts
        rank = item.get("rank")
        if rank is not None:
            books = self._books
            book = books[rank % len(books)] if len(books) > 1 else books[0]   # book_of, inline
        if k == "step":
            step = item["step"]
            if rank is not None:
                if book.exited:
                    book.exited.discard(rank)
                prev = book.hb.get(rank)
                if prev is not None and prev[1] not in STEP_PHASES and prev[2] < ts and \
                        type(prev[1]) is str and (prev[3] is None or step > prev[3]):
                    self._end_phase(book, rank, prev, ts)    # a later step proves it is over
                    self._put_hb(book, rank, [ts, "step", ts, step, step])   # (a record's)
                if self._max_step is None or step > self._max_step:
                    self._step(step, ts)
                elif step == self._max_step and ts > self._progress_ts and (
                        self._moved_ts is None or ts > self._moved_ts):
                    # a rank that ended the newest step went on to the next then: the
                    # first record of a step may come from a machine whose clock is behind
                    self._moved_ts = ts
                self._learn_step_time(step, item.get("step_time"))
                return []
            self._step(step, ts)
        elif k == "hb":
            if rank is None:
                return []
            self._heartbeat(book, rank, item, ts)
            book.exited.discard(rank)
        elif k == "life":
            if item.get("event") == "exit" and rank is None and item.get("restart"):
                self._finished = True           # trainguard run tears the job down
            elif item.get("event") == "exit":
                if rank is not None:
                    book.exited.add(rank)
                if item.get("exit_code") == 0 and not item.get("signal") and rank is not None:
                    self._finished = True
            elif item.get("event") == "start":
                if self._max_step is not None or self._finished or self._hung:
                    self._start_ts = ts          # a restart: a new first step
                self._finished = False
                self._hung = False
                self._max_step = None
                self._progress_ts = None
                self._phase_end_ts = None
                self._moved_ts = None
                if rank is not None:
                    book.forget(rank)              # a new run: its phases are new
        return []

    def _step(self, step, ts) -> None:
        if self._max_step is not None and step <= self._max_step:
            return
        if self._progress_ts is None:
            first = ts - self._start_ts
            if first > 0 and not self._paused_since_progress:
                self._learn_phase("first_step", first)
        elif not self._paused_since_progress and not self._hung:
            # a stall reported as a hang teaches nothing; the action service's false-alarm
            # feedback (note_false_alarm) widens the timeout when it was none
            interval = ts - self._progress_ts
            if interval > 0:
                self._intervals.update(interval)
                self._n_intervals += 1
                recent = self._recent
                recent.append(interval)
                if len(recent) > self.window:
                    gone = recent.pop(0)
                    if gone >= self._recent_max:
                        self._recent_max = max(recent)
                if interval > self._recent_max:
                    self._recent_max = interval
        if self._paused_since_progress and self._progress_ts is not None:
            self._paused_steps = (self._paused_steps + [step])[-4:]
        self._max_step = step
        if self._progress_ts is None or ts > self._progress_ts:
            self._progress_ts = ts   # never back: a new step's first record may come from a
                                     # machine whose clock was stepped back (not learned yet)
        if self._moved_ts is not None and self._moved_ts <= self._progress_ts:
            self._moved_ts = None    # (a rank heard of later than that still moved on then)
        self._paused_since_progress = False
        self._hung = False

    def _learn_step_time(self, step, step_time) -> None:
        """A rank's own step time, unless a pause fell in that step (a rank that waited in
        its all-reduce for a peer's checkpoint reports the checkpoint as its step time)."""
        if type(step_time) is float and step_time > self._step_time_max \
                and step_time - step_time == 0 and step not in self._paused_steps:
            self._step_time_max = step_time

    def _heartbeat(self, book, rank, item, ts) -> None:
        phase = item.get("phase")
        since = item.get("phase_since")
        since = ts if type(since) not in (int, float) or since > ts else since
        step = item.get("step")
        prev = book.hb.get(rank)
        if prev is not None and (ts < prev[0] or (
                prev[4] is not None and prev[1] == "step" and type(step) is int
                and step < prev[4])):
            # older than what the rank told since: delivered twice or reordered in transit
            # (at-least-once delivery), or sent before the step's record that ended its
            # phase (a rank's heartbeat tells its last step sent; on the worker's job side
            # the two are held and let go apart once its machine's clock offset is learned).
            # Taken, it would end the rank's phase before it began, or make the phase "one
            # that wraps steps" for good
            return
        if prev is not None and prev[1] != phase and is_allowed_phase(prev[1]):
            self._end_phase(book, rank, prev, since if since >= prev[2] else ts)
        if is_allowed_phase(phase):
            ended = book.ended.get(rank)
            if ended is not None and ended[0] == phase and ended[1] == since:
                if phase != "init" and phase not in self._not_pauses:
                    self._not_pauses.append(phase)     # back after a step: it wraps steps
                first_step = None
            elif prev is not None and prev[1] == phase and prev[2] == since:
                first_step = prev[4]
                if (phase != "init" and step is not None and first_step is not None
                        and step > first_step and phase not in self._not_pauses):
                    self._not_pauses.append(phase)     # steps go on inside it: no pause
            else:
                first_step = step
            self._put_hb(book, rank, [ts, phase, since, step, first_step])
            if phase not in self._not_pauses:
                self._paused_since_progress = True
        else:
            self._put_hb(book, rank, [ts, phase, since, step, None])
            if self._progress_ts is not None and since > self._progress_ts and (
                    self._moved_ts is None or since > self._moved_ts):
                self._moved_ts = since           # the rank moved on within the step

    def _put_hb(self, book, rank, entry) -> None:
        """A rank's heartbeat entry into its book (which tells the ranks in an allowed phase:
        the deadline looks at those only)."""
        book.hb[rank] = entry          # PhaseBook.put, inline: it runs for most items
        self._latest = rank
        if is_allowed_phase(entry[1]):
            book.pausing.add(rank)
        else:
            book.pausing.discard(rank)

    def _end_phase(self, book, rank, prev, end) -> None:
        """``prev`` (a heartbeat entry in an allowed phase) ended at ``end``."""
        phase, since, step = prev[1], prev[2], prev[3]
        book.ended[rank] = [phase, since, end, step]
        if phase not in self._not_pauses:
            self._learn_phase(phase, end - since)
            self._learn_spread(phase, step, end - since)
            if self._phase_end_ts is None or end > self._phase_end_ts:
                self._phase_end_ts = end

    def _learn_spread(self, phase, step, seconds) -> None:
        """How uneven ``phase`` is on this job: its slowest rank's time over its fastest's,
        over the ranks that ended one occurrence (same last step)."""
        occurrence = self._occurrence.get(phase)
        if occurrence is None or occurrence[0] != step:
            self._occurrence[phase] = [step, seconds, seconds]
            return
        occurrence[1] = min(occurrence[1], seconds)
        occurrence[2] = max(occurrence[2], seconds)
        spread = occurrence[2] / max(occurrence[1], 0.1)
        if spread > self._spread.get(phase, 0.0):
            self._spread[phase] = spread

    def _learn_phase(self, phase, seconds) -> None:
        if seconds > self._longest.get(phase, 0.0):
            self._longest[phase] = seconds

    def note_false_alarm(self, phase: str | None, seconds: float) -> None:
        """The action service found a reported hang to be none: the job moved on after
        ``seconds`` without progress in ``phase`` (``None``: between steps). That phase's
        allowance (or the step timeout) grows to cover it with the usual margin."""
        if seconds > 0:
            self._learn_phase(phase if is_allowed_phase(phase) else "step", seconds)
            if phase in self._not_pauses:
                self._not_pauses.remove(phase)

    # -- deciding -----------------------------------------------------------------------------
    def allowance(self, phase) -> float:
        """Seconds ``phase`` may last (``"first_step"``: the first step after a start)."""
        default = (self.checkpoint_s if phase == "checkpoint" else self.eval_s
                   if phase == "eval" else self.first_step_s
                   if phase in ("init", "first_step") else self.phase_s)
        return max(default, self.phase_factor * self._longest.get(phase, 0.0))

    def timeout(self) -> float:
        """Seconds without a new step before a hang, outside allowed phases."""
        if self._n_intervals >= max(self.min_intervals, 1):    # (0: as soon as one is known)
            learned = max(self.factor * self._intervals.get(),
                          self._margin() * self._recent_max)
        else:
            learned = self._warmup_timeout()
        widened = self.max_margin * self._longest.get("step", 0.0)
        return max(self.floor_s, learned, widened)

    def known_step_s(self) -> float:
        """The longest step this job is known to take: interval or reported step time
        (capped at the first-step budget, so no reported number blinds the detector longer
        than it was before any step); 0 before any."""
        return min(max(self._recent_max, self._step_time_max), self.allowance("first_step"))

    def _warmup_timeout(self) -> float:
        """Before ``min_intervals`` intervals: what is known times a margin that shrinks as
        intervals come in; the first-step budget before the first interval (step 0 can be
        much shorter than the steps after it, and tells too little alone)."""
        known = self.known_step_s()
        if known <= 0 or self._n_intervals == 0:
            return self.allowance("first_step")
        return min(self._margin() * known, self.allowance("first_step"))

    def _margin(self) -> float:
        """Times the longest step known: ``max_margin + factor x early_margin / sqrt(n)``
        after ``n`` intervals."""
        return self.max_margin + self.factor * self.early_margin / max(self._n_intervals, 1) ** 0.5

    def _unseen_may_pause(self, now: float) -> bool:
        """Whether a rank nobody reads now (:attr:`JobView.unseen`) may be in an allowed
        phase that the rest wait for: one of them was last heard less than the longest
        allowance of a pause before ``now``."""
        unseen = self.view.ranks_unseen
        if not unseen:
            return False
        seen = self.view.seen
        last = max((t for t in map(seen, unseen) if t is not None), default=None)
        if last is None:
            return False
        phases = {"checkpoint", "eval", "init", "phase", *self._longest}
        return now < last + max(self.allowance(p) for p in phases)

    def deadline(self) -> float | None:
        if self._start_ts is None:
            return None
        if self._progress_ts is None:
            since = self._start_ts
            if self._phase_end_ts is not None and self._phase_end_ts > since:
                since = self._phase_end_ts
            deadline = since + self.allowance("first_step")
        else:
            since = self._progress_ts
            if self._phase_end_ts is not None and self._phase_end_ts > since:
                since = self._phase_end_ts
            if self._moved_ts is not None and self._moved_ts > since:
                since = self._moved_ts
            deadline = since + self.timeout()
        for book in self._askable():       # the ranks in an allowed phase, not all of them
            for phase, start in book.pause_starts(self._not_pauses).items():
                deadline = max(deadline, start + self.allowance(phase))
        return deadline

    def advance(self, now: float) -> list[Finding]:
        if self._hung or self._finished or self._start_ts is None:
            return []
        deadline = self.deadline()
        rule = "timeout"
        if deadline is None or self.view.judged(now) < deadline:
            left = self.left_behind(now)
            if left is None:
                return []
            suspects, majority = left
            rule = "left_behind"
        elif self._over(now):
            return []      # every rank exited or went quiet after some exited: over, not hung
        elif self._unseen_may_pause(now):
            return []      # nobody reads some ranks now: one may be in a pause the rest wait for
        else:
            suspects, majority = self._suspects(now)
        self._hung = True
        onset = self._progress_ts if self._progress_ts is not None else self._start_ts
        clock = max(t for t in (onset, self._phase_end_ts, self._moved_ts) if t is not None)
        nodes = self.view.whole_nodes(suspects) if suspects else []
        stalled = now - onset
        what = (f"no new step after step {self._max_step}" if self._max_step is not None
                else "no first step")
        blame = (f"; {fmt_ranks(suspects)} differ from the rest ({majority})"
                 if suspects else f"; every rank looks alike ({majority})")
        paused = f" ({now - clock:.0f}s since any rank last moved on)" if clock > onset else ""
        return [Finding(
            kind="hang", severity="critical", ranks=suspects, nodes=nodes, step=self._max_step,
            onset_ts=onset, detected_ts=now, detector=self.PREFIX,
            summary=f"the job made no progress for {stalled:.0f}s{paused}: {what}{blame}",
            key=f"s{self._max_step}t{onset:.3f}",
            evidence={"rule": rule, "stalled_s": stalled, "timeout_s": self.timeout(),
                      "clock_start_ts": clock, "phase": self._current_phase(),
                      "majority": majority, "rank_nodes": self.view.rank_nodes(suspects)})]
