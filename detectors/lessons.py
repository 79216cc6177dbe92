"""What a job's stage learned from people's verdicts on its incidents (``trainguard feedback``).

A *false alarm* widens the allowance of the detector that raised the incident, for this job
only, to cover what it saw (the finding's evidence) with a margin; a *confirmed* fault is
kept as a labelled example. Both are bounded: each kind widens at most
:data:`MAX_WIDENINGS` times and never past its cap (:data:`WIDEN`), and at most
:data:`MAX_EXAMPLES` verdicts of each are kept. ``reset`` puts every widened setting back.
A hang's false alarm goes to :meth:`HangDetector.note_false_alarm` (the allowance of that
phase), as the action service's confirm-before-acting does; that is learned state of the hang
detector, which a reset does not undo.

>>> from trainguard.detectors import JobStage
>>> stage = JobStage()
>>> lessons = Lessons()
>>> lessons.learn(stage, "false_alarm", "straggler", {"mean_ratio": 1.31}, "inc-1", 50.0)
{'straggler.ratio': [1.2, 1.441]}
>>> stage.detectors["straggler"].ratio
1.441
>>> lessons.learn(stage, "confirmed", "nan", {}, "inc-2", 60.0)
{}
>>> lessons.summary()["widened"], len(lessons.summary()["confirmed"])
({'straggler.ratio': {'was': 1.2, 'now': 1.441}}, 1)
>>> lessons.reset(stage), stage.detectors["straggler"].ratio
({'straggler.ratio': [1.441, 1.2]}, 1.2)
"""
from __future__ import annotations

from collections import deque

__all__ = ["Lessons", "WIDEN", "MAX_WIDENINGS", "MAX_EXAMPLES"]

MAX_WIDENINGS = 3
MAX_EXAMPLES = 20
MARGIN = 1.1
#: kind -> [(detector prefix, parameter, evidence key or None, cap)]: the parameter becomes
#: at least MARGIN x the evidence's number (or x 1.5 of itself without one), at most the cap
WIDEN = {
    "straggler": [("straggler", "ratio", "mean_ratio", 2.0)],
    "throughput_drop": [("throughput", "ratio", "ratio", 2.5)],
    "loss_spike": [("loss_spike", "min_ratio", "ratio", 5.0),
                   ("loss_spike", "early_min_ratio", "ratio", 5.0)],
    "grad_spike": [("grad_spike", "min_ratio", "ratio", 50.0),
                   ("grad_spike", "early_min_ratio", "ratio", 50.0),
                   ("grad_spike", "rise_ratio", "ratio", 100.0)],
    "machine_outlier": [("machine_outlier", "threshold", "score", 32.0)],
    "silent": [("silent", "timeout_s", None, 300.0)],
    "gpu_degraded": [("gpu_degraded", "pcie_replays", None, 800),
                     ("gpu_degraded", "sbe_increase", None, 160),
                     ("gpu_degraded", "nvlink_increments", None, 48),
                     ("gpu_degraded", "min_samples", None, 160)],
}
#: gpu_degraded widens only the condition it reported
_CONDITION = {"pcie_replays": "pcie_replay", "sbe_increase": "sbe",
              "nvlink_increments": "nvlink", "min_samples": "throttle"}


class Lessons:
    def __init__(self):
        self.widened: dict = {}      # "prefix.param" -> [value before any lesson, now]
        self.widenings: dict = {}    # kind -> false alarms that widened it
        self.false_alarms: deque = deque(maxlen=MAX_EXAMPLES)
        self.confirmed: deque = deque(maxlen=MAX_EXAMPLES)

    def learn(self, stage, verdict: str, kind: str | None, evidence: dict, incident: str,
              ts: float, nodes=()) -> dict:
        """Learn one verdict on an incident of ``kind`` (its root finding's ``evidence``);
        returns ``{"prefix.param": [old, new]}`` of what changed."""
        example = {"incident": incident, "kind": kind, "ts": ts,
                   "evidence": {k: v for k, v in (evidence or {}).items()
                                if type(v) in (int, float, str, bool)}}
        if verdict == "confirmed":
            self.confirmed.append(example)
            return {}
        self.false_alarms.append(example)
        if self.widenings.get(kind, 0) >= MAX_WIDENINGS:
            return {}
        changes = {}
        if kind == "hang":
            stalled = (evidence or {}).get("stalled_s")
            if type(stalled) in (int, float) and 0 < stalled <= 86400:
                stage.note_false_alarm((evidence or {}).get("phase"), float(stalled))
                changes["hang.allowance"] = [None, float(stalled)]
        for prefix, param, key, cap in WIDEN.get(kind, ()):
            if prefix == "gpu_degraded" and (evidence or {}).get("condition") \
                    != _CONDITION[param]:
                continue
            detector = stage.detectors.get(prefix)
            if detector is None:
                for node in stage._nodes.values():   # the NodeStage's gpu detectors
                    detector = next((d for d in node.detectors if d.PREFIX == prefix), None)
            if detector is None:
                continue
            now = getattr(detector, param)
            seen = (evidence or {}).get(key) if key else None
            if type(seen) in (int, float) and seen > 0:
                wanted = seen * MARGIN
            else:
                wanted = now * 1.5
            new = min(cap, max(now, wanted))
            new = int(round(new)) if type(now) is int else round(new, 4)
            if new != now:
                self._set(stage, prefix, param, new)
                changes[f"{prefix}.{param}"] = [now, new]
        if kind == "machine_outlier" and "machine_outlier" in stage.detectors:
            for node in nodes:
                stage.detectors["machine_outlier"].relearn(node)
        if changes:
            self.widenings[kind] = self.widenings.get(kind, 0) + 1
        return changes

    def _set(self, stage, prefix, param, value) -> None:
        name = f"{prefix}.{param}"
        targets = [stage.detectors[prefix]] if prefix in stage.detectors else \
            [d for node in stage._nodes.values() for d in node.detectors if d.PREFIX == prefix]
        for detector in targets:
            if name not in self.widened:
                self.widened[name] = [getattr(detector, param), value]
            detector.retune(**{param: value})
        if name in self.widened:
            self.widened[name][1] = value

    def reset(self, stage) -> dict:
        """Every widened setting back to what it was before any lesson; examples forgotten."""
        changes = {}
        for name, (was, now) in self.widened.items():
            prefix, param = name.split(".", 1)
            self._set(stage, prefix, param, was)
            changes[name] = [now, was]
        self.widened.clear()
        self.widenings.clear()
        self.false_alarms.clear()
        self.confirmed.clear()
        return changes

    def summary(self) -> dict:
        """Plain JSON: what ``trainguard config show --job`` prints."""
        return {"widened": {k: {"was": v[0], "now": v[1]} for k, v in self.widened.items()},
                "widenings": dict(self.widenings),
                "false_alarms": list(self.false_alarms), "confirmed": list(self.confirmed),
                "limits": {"widenings_per_kind": MAX_WIDENINGS, "examples": MAX_EXAMPLES}}


def apply_feedback(stage, verdict: str, incident: str | None, kind: str | None = None,
                   ts: float = 0.0) -> dict:
    """One verdict for ``stage`` (a JobStage with ``lessons``): the incident is looked up in
    its correlator (its root finding says which detector and what it saw); one it no longer
    holds is learned by ``kind`` alone. Returns ``{"kind", "changes"}``; raises
    ``LookupError`` when neither is known."""
    lessons = stage.lessons
    if verdict == "reset":
        return {"kind": None, "changes": lessons.reset(stage)}
    root = None
    correlator = stage.correlator
    for inc in correlator._open + correlator._closed:
        if inc.id == incident:
            root = inc.root()
            break
    if root is not None:
        kind, evidence, nodes = root.kind, root.evidence or {}, root.nodes
    elif kind is None:
        raise LookupError(f"incident {str(incident)[:80]!r} is not known to this job's stage "
                          "and the feedback names no kind (give --kind)")
    else:
        evidence, nodes = {}, []
    return {"kind": kind,
            "changes": lessons.learn(stage, verdict, kind, evidence, incident, ts, nodes)}
