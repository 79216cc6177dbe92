"""Data position after a restart: did training resume exactly where its checkpoint left the
data? (SPEC §6 ``samples``: the samples a rank has consumed since the start of training.)

A rank's first step after a restart or rollback (a ``lifecycle`` start, or a step number
that goes back) is checked against what the same rank reported before: the same step must
carry the same ``samples``; a step that the earlier run did not reach must follow on from
the step before it by the rank's usual per-step increment. Anything else means data was
trained twice or skipped: a ``data_position`` finding (warning), once per resume. Ranks
that report no ``samples`` are never checked.

>>> d = DataPositionDetector()
>>> def step(k, samples, ts):
...     return {"k": "step", "rank": 0, "node": "n1", "ts": ts, "step": k, "samples": samples}
>>> [d.update(step(k, (k + 1) * 8, float(k))) for k in range(4)]
[[], [], [], []]
>>> d.update({"k": "life", "rank": 0, "event": "start", "ts": 9.0})
[]
>>> d.update(step(2, 3 * 8, 10.0))  # resumed from the checkpoint at step 2: same position
[]
>>> d.update({"k": "life", "rank": 0, "event": "start", "ts": 19.0})
[]
>>> [f.summary for f in d.update(step(2, 0, 20.0))]  # a restart that lost the data position
['rank 0 resumed at step 2 with data position 0, but was at 24 at that step before: 24 samples trained twice']
"""
from __future__ import annotations

from .base import Detector, Finding
from .registry import register_detector

__all__ = ["DataPositionDetector"]

KEEP_STEPS = 512  # steps of samples remembered per rank: enough to reach back to a checkpoint


# evidence for people (no priority): it is the root cause of no other anomaly
@register_detector(kinds="data_position", ladder=("alert",))
class DataPositionDetector(Detector):
    """Checks each rank's first step after a restart against its earlier data position."""

    PREFIX = "data_position"
    CONSUMES = ("step", "life")

    def _start(self) -> None:
        self._samples: dict = {}   # rank -> {step: samples}
        self._delta: dict = {}     # rank -> the last per-step increment seen
        self._last: dict = {}      # rank -> last step seen
        self._resumed: set = set()  # ranks whose next step is the first after a restart

    def update(self, item) -> list[Finding]:
        if type(item) is not dict:
            return []
        k = item.get("k")
        if k == "step" and item.get("samples") is None:
            return []               # the common case: a rank that reports no samples
        rank = item.get("rank")
        if rank is None:
            return []
        if k == "life":
            if item.get("event") == "start" and rank in self._samples:
                self._resumed.add(rank)
            return []
        samples = item.get("samples")
        if k != "step" or not isinstance(samples, int) or isinstance(samples, bool):
            return []
        step = item["step"]
        seen = self._samples.setdefault(rank, {})
        last = self._last.get(rank)
        findings = []
        if rank in self._resumed or (last is not None and step <= last):
            self._resumed.discard(rank)
            findings = self._check(item, step, samples, seen)
        elif last == step - 1 and last in seen:
            self._delta[rank] = samples - seen[last]
        seen[step] = samples
        if len(seen) > KEEP_STEPS:
            for old in sorted(seen)[:len(seen) - KEEP_STEPS]:
                del seen[old]
        self._last[rank] = step
        return findings

    def _check(self, item, step: int, samples: int, seen: dict) -> list[Finding]:
        rank = item["rank"]
        if step in seen:
            expected, basis = seen[step], "was at {e} at that step before"
        elif step - 1 in seen and rank in self._delta:
            expected = seen[step - 1] + self._delta[rank]
            basis = "should be at {e} (step " + str(step - 1) + " plus its usual increment)"
        else:
            return []
        if samples == expected:
            return []
        off = samples - expected
        what = f"{-off} samples trained twice" if off < 0 else f"{off} samples skipped"
        return [Finding(
            kind="data_position", severity="warning", ranks=[rank],
            nodes=[item["node"]] if item.get("node") else [], step=step,
            onset_ts=item["ts"], detected_ts=item["ts"], detector=self.PREFIX,
            summary=(f"rank {rank} resumed at step {step} with data position {samples}, but "
                     f"{basis.format(e=expected)}: {what}"),
            evidence={"samples": samples, "expected": expected, "off_by": off},
            key=f"s{step}t{item['ts']:.3f}")]
