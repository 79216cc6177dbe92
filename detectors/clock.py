"""One job's clock, whatever each machine's clock says: steps are matched by number.

The ranks of a synchronous job end a step within a fraction of a step of each other, so the
machines' stamps of one step number tell how far each machine's clock is off. For each step
the earliest stamp of every machine's records is kept, in whatever order its ranks' records
come (they are spread over telemetry partitions read apart); once the job is ``settle``
steps further, the step's reference is the median of those stamps, and each machine's
offset is the median of its last ``samples`` differences from the references (a machine
whose records of a step come after it settled, its partition read behind, is measured
against that step's reference, kept for ``max_steps`` steps; a machine's records from
before its ranks' latest start belong to the run before a restart and are left out; with
no start known, none are). Every item of a machine whose offset is at least
``min_offset_s`` is restamped (``ts``, and a heartbeat's ``phase_since``) before any
detector sees it: a machine whose clock runs a minute ahead no longer drives the job's
notion of "now" (so its peers do not look silent or hung), and its records land in their
steps.

The reference is the lower median: with two machines the one behind (either could be
wrong; time that runs slow finds nothing false). Before the first settled step, a machine
whose first lifecycle ``start`` is ``start_min_s`` or more off the others' already gets that
as its offset (starts of one launch come within seconds), so a clock a minute ahead does not
move the job's "now" during start-up either; its steps then outvote it. A machine that stops
(hung, dead) keeps its last offset. An offset beyond ``max_offset_s`` is not applied (the
event-time filter refuses stamps further off anyway), so telemetry forged for made-up machines
can shift a job's clock by ten minutes at most.

A machine's clock stepped mid-job (an NTP step, a migrated VM) is applied at once, not after
the steps that learning takes, since one record stamped half a minute ahead moves the job's
"now" (its peers look silent), and one stamped behind makes that machine the reference of
its steps. Each rank's RankStage says when the rank's own heartbeats, or its own step
records, jumped by more than ``jump_s`` (``jump`` in the item; see ``RankStage``):

- back, and now more than ``jump_s`` behind the job's newest time: the step is applied to the
  records of each rank of the machine that went back, from then on (a rank's records keep
  their order; its RankStage moves a phase begun before with it);
- forward, and now more than ``jump_s`` past the job's newest time: the machine's stamps
  past its newest before the step are held ``jump_s`` ahead of the job, unless machines
  that are at least half of those heard lately lead as far (the whole job was quiet: it
  goes on, and its time with it).

A step stands until a settled step's sample from a moved stamp confirms it (its offset is
learned from there on) or ``STEP_MISSES`` samples contradict it; a step's reference is taken
on the job's clock as it stands, of the machines not just stepped. A machine's GPU sample
more than ``jump_s`` past the job's newest time (its ranks have not told of the step yet) is
given as that far past and moves nothing, save its second in a row with no record of its
ranks between (they are quiet, and the job's time goes on with its samples); its
NodeStage's findings are restamped like its records. :meth:`JobClock.time` changes nothing.
Memory: per machine its samples, its ranks' newest stamp and a step not learned yet (at
most ``max_nodes`` machines), per open step one stamp per machine.

>>> c = JobClock()
>>> for s in range(6):
...     for node, off in (("n1", 0.0), ("n2", 0.0), ("n3", 60.0)):
...         _ = c.correct({"k": "step", "node": node, "step": s, "ts": 100.0 + s + off})
>>> round(c.offset("n3"), 3), round(c.offset("n1"), 3)
(60.0, 0.0)
>>> c.correct({"k": "hb", "node": "n3", "ts": 166.0, "phase_since": 165.5})
{'k': 'hb', 'node': 'n3', 'ts': 106.0, 'phase_since': 105.5}
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .base import median

__all__ = ["JobClock", "JUMP_S"]

#: a rank's stamps that move more than this between two of its records, or a machine's
#: stamps this far off the job's newest time, are a step of its clock (or the whole job quiet)
JUMP_S = 5.0
#: machines heard within this of the job's newest time count for :meth:`JobClock._confirmed`
LATELY_S = 30.0
#: step-learned samples that contradict a step of a machine's clock before it is let go
STEP_MISSES = 3
#: ranks of one machine counted as gone back (a machine runs a few; forged ranks are more)
MAX_CROSSED = 1024


@dataclass
class _Step:
    """A step of one machine's clock, applied at once, until its offset is learned."""
    before: float          # the machine's newest stamp before the step
    delta: float           # how far its clock moved (forward > 0)
    base: float            # its offset learned before the step
    crossed: set           # back: the ranks that went back (each rank's records keep order)
    level: float = -math.inf    # forward: its first time without the step (_confirmed)
    reach: float = -math.inf    # back: the newest stamp of a rank that went back
    misses: int = 0        # step-learned samples that did not confirm it


class JobClock:
    """Per-machine clock offsets of one job, learned from step numbers (see the module)."""

    def __init__(self, settle: int = 2, samples: int = 9, min_offset_s: float = 1.0,
                 start_min_s: float = 10.0, max_offset_s: float = 600.0, max_steps: int = 16,
                 max_nodes: int = 100_000, jump_s: float = JUMP_S):
        self.settle = settle
        self.samples = samples
        self.min_offset_s = min_offset_s
        self.start_min_s = start_min_s
        self.max_offset_s = max_offset_s
        self.max_steps = max_steps
        self.max_nodes = max_nodes
        self.jump_s = jump_s
        self._starts: dict = {}        # node -> its first start of this launch
        self._stamps: dict = {}        # step -> {node: first stamp}
        self._diffs: dict = {}         # node -> its last differences from the references
        self._offsets: dict = {}       # node -> offset applied (only those >= min_offset_s)
        self._top = None               # the highest step seen
        self._refs: dict = {}          # settled step -> [its reference, machines counted]
        self._runs: dict = {}          # node -> its ranks' latest start (its own clock)
        self._now = None               # the job's newest time given out
        self._high: dict = {}          # node -> its ranks' newest stamp
        self._steps: dict = {}         # node -> _Step of its clock, applied, not learned yet
        self._quiet: dict = {}         # node -> [its ranks' newest stamp, GPU samples ahead]

    def offset(self, node) -> float:
        diffs = self._diffs.get(node)
        return median(diffs) if diffs else 0.0

    def time(self, node, ts: float) -> float:
        """``ts`` of machine ``node`` (its GPU sample, say) on the job's clock, at most
        ``jump_s`` past the job's newest time: a machine's sample may come before its ranks'
        records tell that its clock stepped forward."""
        t = self._shifted(node, ts, None)
        now = self._now
        if now is not None and t > now + self.jump_s and self._high:
            return now + self.jump_s
        return t

    def correct(self, item: dict) -> dict:
        """``item`` restamped by its machine's offset (in place), after learning from it."""
        node = item.get("node")
        if node is None:
            return item
        k = item.get("k")
        if k == "finding":
            return self._found(node, item)
        ts = item.get("ts")
        rank = item.get("rank")
        if type(ts) is not float and type(ts) is not int:
            self._learn_from(k, item, node, rank, ts)
            return item
        jump = item.get("jump")
        if jump is not None:
            if type(jump) in (int, float) and self.jump_s < abs(jump) < math.inf \
                    and type(rank) is int:       # (how far it is off the job: _jumped, _lead)
                self._jumped(node, rank, ts, jump)
            else:
                jump = None
        offset = self._offsets.get(node)
        t = ts - offset if offset else ts
        if self._steps and node in self._steps:
            t = self._shifted(node, ts, rank)
        now = self._now
        high = self._high.get(node)
        if now is not None and t > now + self.jump_s:
            if jump is not None:
                t = self._lead(node, t, high)
            elif k == "gpu" and self._high and self._ahead(node, high):
                # a machine's sample before its ranks tell that its clock stepped: as far
                # ahead as the job allows, moving nothing
                item["ts"] = now + self.jump_s
                return item
        if k == "step" or k == "life":
            self._learn_from(k, item, node, rank, ts)
        if rank is not None and (high is None or ts > high):   # its ranks' (not a sample)
            if high is not None or len(self._high) < self.max_nodes:
                self._high[node] = ts
        if now is None or t > now:
            self._now = t
        if t != ts:
            item["ts"] = t
            since = item.get("phase_since")
            if type(since) in (int, float):
                item["phase_since"] = self._shifted(node, since, rank)
        return item

    def _learn_from(self, k, item: dict, node, rank, ts) -> None:
        if k == "step":
            self._starts.clear()
            self._learn(node, rank, item.get("step"), ts)
        elif k == "life" and item.get("event") == "start":
            self._refs.clear()           # a new run: its steps are not the last run's
            self._run_start(node, ts)
            self._learn_start(node, ts)

    def _found(self, node, item: dict) -> dict:
        """A machine's finding (its NodeStage's) with its times on the job's clock."""
        for where, key in ((item, "ts"), (item.get("finding"), "onset_ts"),
                           (item.get("finding"), "detected_ts")):
            if type(where) is dict and type(where.get(key)) in (int, float):
                where[key] = self._shifted(node, where[key], None)
        return item

    def _shifted(self, node, ts: float, rank) -> float:
        """``ts`` less the machine's offset and, after a step of its clock not learned yet,
        that step: forward, to every stamp past the machine's newest before it (a rank's
        record of before the step, read after another's of after it, is not moved); back, to
        the stamps of the ranks that went back (``rank``; without one, such as a machine's
        GPU sample, to stamps well before its newest)."""
        offset = self._offsets.get(node)
        t = ts - offset if offset else ts
        step = self._steps.get(node)
        if step is None:
            return t
        if step.delta > 0.0:
            after = ts > step.before + self.jump_s / 2
        elif rank is not None:
            after = rank in step.crossed
            if after and ts > step.reach:
                step.reach = ts
        else:                  # a GPU sample: well before its newest, or its ranks' time now
            after = ts < step.before - self.jump_s / 2 or ts <= step.reach or \
                step.reach >= step.before
        return t - step.delta if after else t

    def _ahead(self, node, high) -> bool:
        """Whether a GPU sample of ``node`` that leads the job is held back: not the second
        in a row with no record of its ranks between (its ranks are quiet, the job's time
        goes on with its samples)."""
        quiet = self._quiet.get(node)
        if quiet is None or quiet[0] != high:
            if node in self._quiet or len(self._quiet) < self.max_nodes:
                self._quiet[node] = [high, 1]
            return True
        quiet[1] += 1
        return False

    def _jumped(self, node, rank, ts: float, jump: float) -> None:
        """A rank of ``node`` whose stamps went back by ``-jump`` since its last record (its
        RankStage says so: ``jump`` in the item): a step of the machine's clock back when its
        time, on the job's clock, is now more than ``jump_s`` behind the job's newest time.
        (A step forward is found by its lead, :meth:`_lead`.)"""
        step = self._steps.get(node)
        if step is not None:
            if (step.delta > 0.0) == (jump > 0.0):
                if jump < 0.0 and len(step.crossed) < MAX_CROSSED:
                    step.crossed.add(rank)
            elif abs(jump + step.delta) <= 2 * self.jump_s and self._now is not None and \
                    abs(self._shifted(node, ts, rank) - self._now) > self.jump_s:
                del self._steps[node]          # set right again before it was learned
            return
        now = self._now
        if now is None or jump > 0.0:
            return
        lag = self._shifted(node, ts, rank) - now
        if -self.max_offset_s < lag < -self.jump_s:
            self._steps[node] = _Step(before=self._newest(node, ts - jump), delta=lag,
                                      base=self._offsets.get(node, 0.0), crossed={rank})

    def _lead(self, node, t: float, high) -> float:
        """``t`` of a record of ``node`` more than ``jump_s`` past the job's newest time, its
        rank's stamps having jumped forward: its clock stepped forward, unless other machines
        lead as far (:meth:`_confirmed`)."""
        if self._steps.get(node) is not None:
            return t
        if self._confirmed(node, t):
            self._now = t
            return t
        lead = t - self._now - self.jump_s      # held as far ahead as the job allows
        if lead >= self.max_offset_s:
            return t
        if lead < self.jump_s / 2:               # too small to tell from its stamps
            return t - lead
        self._steps[node] = _Step(before=high if high is not None else -math.inf,
                                  delta=lead, base=self._offsets.get(node, 0.0),
                                  crossed=set(), level=t)
        return t - lead

    def _moved(self, node, ts: float, rank, t: float | None = None) -> bool:
        """Whether ``ts`` (on the job's clock: ``t``) was moved by a step of its clock."""
        if t is None:
            t = self._shifted(node, ts, rank)
        return abs(ts - self._offsets.get(node, 0.0) - t) > self.jump_s / 2

    def _newest(self, node, before: float) -> float:
        high = self._high.get(node)
        return high if high is not None and high > before else before

    def _confirmed(self, node, t: float) -> bool:
        """Whether enough other machines lead as far as ``node`` at ``t`` (the whole job was
        quiet, and goes on): at least one, and half the machines heard lately, whose first
        record past the job's newest time was within ``jump_s`` of ``t``; or none was heard
        lately (a machine alone whose heartbeats stalled under load must not hold its time
        back: its hang would be found late). Their steps held are then let go."""
        steps, near = self._steps, self.jump_s
        peers = [n for n, step in steps.items()
                 if step.delta > 0.0 and n != node and abs(step.level - t) <= near]
        lately = self._now - LATELY_S
        offsets = self._offsets
        heard = sum(1 for n, high in self._high.items()
                    if high - offsets.get(n, 0.0) >= lately or n == node)
        if heard > 1 and len(peers) + 1 < max(2, (heard + 1) // 2):
            return False         # (alone in its job: no peer to tell a step from a stall)
        for n in peers:
            del steps[n]
            self._unmoved(n)
        return True

    def _unmoved(self, node) -> None:
        """The stamps kept of ``node``'s open steps, once its step is let go: unmoved."""
        for stamps in self._stamps.values():
            pair = stamps.get(node)
            if pair is not None:
                stamps[node] = (pair[0], self._shifted(node, pair[0], None))

    def _run_start(self, node, ts) -> None:
        if type(ts) in (int, float) and ts > self._runs.get(node, ts - 1):
            if node in self._runs or len(self._runs) < self.max_nodes:
                self._runs[node] = ts

    def _learn(self, node, rank, step, ts) -> None:
        if type(step) is not int or type(ts) not in (int, float):
            return
        if ts < self._runs.get(node, ts):
            return       # the run before its last start (a partition read behind)
        top = self._top
        if top is not None and step > top + self.max_steps:
            self._stamps.clear()         # a jump (a resume far ahead): start over
            self._refs.clear()
        elif top is not None and step < top - self.max_steps:
            return                       # far behind: late, or an earlier run's
        settled = self._refs.get(step)
        if settled is not None:          # a machine read late (its partition lags)
            if node not in settled[1]:
                settled[1].add(node)
                self._add(node, ts - settled[0], self._moved(node, ts, rank))
            return
        stamps = self._stamps.get(step)
        if stamps is None:
            stamps = self._stamps[step] = {}
        first = stamps.get(node)
        if first is not None and first[0] < self._runs.get(node, -math.inf):
            first = None                 # the run before the node's restart: this one counts
        if first is None or ts < first[0]:   # its earliest stamp, and that on the job's clock
            stamps[node] = (ts, self._shifted(node, ts, rank))
        if top is None or step > top:
            self._top = step
            self._settle(step - self.settle)

    def _learn_start(self, node, ts) -> None:
        if type(ts) not in (int, float) or node in self._starts:
            return
        self._starts[node] = ts
        if len(self._starts) < 2:
            return
        diff = ts - _lower_median(list(self._starts.values()))
        if abs(diff) >= self.start_min_s:
            self._add(node, diff)

    def _add(self, node, diff, moved: bool = True) -> None:
        """One sample of ``node``'s offset; ``moved``: from a stamp that a step of its clock,
        not learned yet, moved (one from before the step is no word on it)."""
        step = self._steps.get(node)
        if step is not None:             # a step of its clock applied: does this confirm it?
            if not moved:
                return
            if abs(diff - (step.base + step.delta)) <= 2 * self.jump_s:
                del self._steps[node]
                self._diffs.pop(node, None)      # learned from here on
            else:
                step.misses += 1
                if step.misses < STEP_MISSES:
                    return
                del self._steps[node]
        diffs = self._diffs.get(node)
        if diffs is None:
            if len(self._diffs) >= self.max_nodes:
                return
            diffs = self._diffs[node] = []
        diffs.append(diff)
        if len(diffs) > self.samples:
            del diffs[0]
        offset = median(diffs)
        if self.min_offset_s <= abs(offset) <= self.max_offset_s:
            self._offsets[node] = offset
        else:
            self._offsets.pop(node, None)

    def _settle(self, upto: int) -> None:
        for step in sorted(s for s in self._stamps if s <= upto):
            runs = self._runs
            stamps = {node: pair for node, pair in self._stamps.pop(step).items()
                      if pair[0] >= runs.get(node, pair[0])}   # not the run before a restart
            if len(stamps) < 2:
                continue
            # the job's clock as it stands, of the machines whose clock did not just step
            # (that step is known within the seconds between two of its records)
            steady = [t for node, (_, t) in stamps.items() if node not in self._steps]
            reference = _lower_median(steady or [t for _, t in stamps.values()])
            self._refs[step] = [reference, set(stamps)]
            for node, (ts, t) in stamps.items():
                self._add(node, ts - reference, self._moved(node, ts, None, t))
        refs = self._refs
        if len(refs) > self.max_steps:
            for step in sorted(refs)[:len(refs) - self.max_steps]:
                del refs[step]


def _lower_median(values: list) -> float:
    values.sort()
    return values[(len(values) - 1) // 2]
