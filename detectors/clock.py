"""One job's clock, whatever each machine's clock says: steps are matched by number.

The ranks of a synchronous job end a step within a fraction of a step of each other, so the
machines' stamps of one step number tell how far each machine's clock is off. For each step
the first record of every machine is kept; once the job is ``settle`` steps further, the
step's reference is the median of those stamps, and each machine's offset is the median of
its last ``samples`` differences from the references (a machine whose records of a step come
after it settled, its partition read behind, is measured against that step's reference, kept
for ``max_steps`` steps; a machine's records from before its ranks' latest start belong to
the run before a restart and are left out). Every item of a machine whose offset
is at least ``min_offset_s`` is restamped (``ts``, and a heartbeat's ``phase_since``) before
any detector sees it: a machine whose clock runs a minute ahead no longer drives the job's
notion of "now" (so its peers do not look silent or hung), and its records land in their
steps.

The reference is the lower median: with two machines the one behind (either could be
wrong; time that runs slow finds nothing false). Before the first settled step, a machine
whose first lifecycle ``start`` is ``start_min_s`` or more off the others' already gets that
as its offset (starts of one launch come within seconds), so a clock a minute ahead does not
move the job's "now" during start-up either; its steps then outvote it. A machine that stops
(hung, dead) keeps its last offset. An offset beyond ``max_offset_s`` is not applied (the
event-time filter refuses stamps further off anyway), so telemetry forged for made-up machines
can shift a job's clock by ten minutes at most. Memory: per machine its samples (at most
``max_nodes`` machines), per open step one stamp per machine.

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

from .base import median

__all__ = ["JobClock"]


class JobClock:
    """Per-machine clock offsets of one job, learned from step numbers (see the module)."""

    def __init__(self, settle: int = 2, samples: int = 9, min_offset_s: float = 1.0,
                 start_min_s: float = 10.0, max_offset_s: float = 600.0, max_steps: int = 16,
                 max_nodes: int = 100_000):
        self.settle = settle
        self.samples = samples
        self.min_offset_s = min_offset_s
        self.start_min_s = start_min_s
        self.max_offset_s = max_offset_s
        self.max_steps = max_steps
        self.max_nodes = max_nodes
        self._starts: dict = {}        # node -> its first start of this launch
        self._stamps: dict = {}        # step -> {node: first stamp}
        self._diffs: dict = {}         # node -> its last differences from the references
        self._offsets: dict = {}       # node -> offset applied (only those >= min_offset_s)
        self._top = None               # the highest step seen
        self._refs: dict = {}          # settled step -> [its reference, machines counted]
        self._runs: dict = {}          # node -> its ranks' latest start (its own clock)

    def offset(self, node) -> float:
        diffs = self._diffs.get(node)
        return median(diffs) if diffs else 0.0

    def time(self, node, ts: float) -> float:
        """``ts`` of machine ``node`` on the job's clock."""
        offset = self._offsets.get(node)
        return ts - offset if offset else ts

    def correct(self, item: dict) -> dict:
        """``item`` restamped by its machine's offset (in place), after learning from it."""
        node = item.get("node")
        if node is None:
            return item
        k = item.get("k")
        if k == "step":
            self._starts.clear()
            self._learn(node, item.get("step"), item.get("ts"))
        elif k == "life" and item.get("event") == "start":
            self._refs.clear()           # a new run: its steps are not the last run's
            self._run_start(node, item.get("ts"))
            self._learn_start(node, item.get("ts"))
        offset = self._offsets.get(node)
        if offset is not None:
            ts = item.get("ts")
            if type(ts) in (int, float):
                item["ts"] = ts - offset
            since = item.get("phase_since")
            if type(since) in (int, float):
                item["phase_since"] = since - offset
        return item

    def _run_start(self, node, ts) -> None:
        if type(ts) in (int, float) and ts > self._runs.get(node, ts - 1):
            if node in self._runs or len(self._runs) < self.max_nodes:
                self._runs[node] = ts

    def _learn(self, node, step, ts) -> None:
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
                self._add(node, ts - settled[0])
            return
        stamps = self._stamps.get(step)
        if stamps is None:
            stamps = self._stamps[step] = {}
        if stamps.get(node, ts) < self._runs.get(node, ts):
            del stamps[node]             # the run before the node's restart: this one counts
        stamps.setdefault(node, ts)
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

    def _add(self, node, diff) -> None:
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
            stamps = {node: ts for node, ts in self._stamps.pop(step).items()
                      if ts >= runs.get(node, ts)}   # not the run before a node's restart
            if len(stamps) < 2:
                continue
            reference = _lower_median(list(stamps.values()))
            self._refs[step] = [reference, set(stamps)]
            for node, ts in stamps.items():
                self._add(node, ts - reference)
        refs = self._refs
        if len(refs) > self.max_steps:
            for step in sorted(refs)[:len(refs) - self.max_steps]:
                del refs[step]


def _lower_median(values: list) -> float:
    values.sort()
    return values[(len(values) - 1) // 2]
