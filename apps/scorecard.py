"""The demo's scorecard: ETTR of a run, and for each injected fault when it was detected,
what was done and when training resumed. Pure functions over recorded facts.

**ETTR** (effective training time ratio) is productive training time divided by wall time.
A step's time is productive when its progress was kept: a step that is run again later (after
a restart from an older checkpoint, or a rollback) was lost, and so was everything between.

>>> steps = [  # (step, start, end) of rank 0, in the order run
...     (0, 0.0, 1.0), (1, 1.0, 2.0), (2, 2.0, 3.0),   # then a crash; checkpoint was at step 1
...     (2, 10.0, 11.0), (3, 11.0, 12.0)]
>>> round(ettr(steps, wall_start=0.0, wall_end=12.0), 3)
0.333
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


def kept_steps(steps: list[tuple[int, float, float]]) -> list[tuple[int, float, float]]:
    """The step runs whose progress was kept: the last run of each step number."""
    last = {}
    for run in steps:
        last[run[0]] = run
    return sorted(last.values(), key=lambda run: run[1])


def ettr(steps: list[tuple[int, float, float]], wall_start: float, wall_end: float) -> float:
    """Productive seconds (kept steps' durations) over wall seconds."""
    wall = wall_end - wall_start
    if wall <= 0:
        return 0.0
    productive = sum(end - start for _, start, end in kept_steps(steps))
    return min(1.0, productive / wall)


@dataclass(kw_only=True)
class FaultOutcome:
    """One injected fault and what became of it (SPEC-like JSON via :meth:`to_dict`)."""

    kind: str
    ranks: list
    injected_ts: float
    step: int | None = None
    node: str | None = None
    detected_ts: float | None = None
    recovered_ts: float | None = None
    actions: list = field(default_factory=list)
    anomaly_kinds: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "ranks": self.ranks, "node": self.node, "step": self.step,
                "injected_ts": self.injected_ts, "detected_ts": self.detected_ts,
                "recovered_ts": self.recovered_ts, "actions": self.actions,
                "detected_as": self.anomaly_kinds}

    @property
    def lost_s(self) -> float | None:
        if self.recovered_ts is None:
            return None
        return self.recovered_ts - self.injected_ts


# Which anomaly kinds count as the detection of each injected fault kind.
DETECTED_AS = {
    "nan": ("nan",), "loss_spike": ("loss_spike",), "straggler": ("straggler",),
    "hang": ("hang", "silent"), "crash": ("crash", "silent", "hang"),
    "xid": ("gpu_fault",), "error": ("crash",),
}
DISRUPTIVE = ("hang", "crash", "xid", "error")
#: faults injected within this many seconds of each other count as one problem
TOGETHER_S = 1.0


def outcomes(injections: list[dict], anomalies: list[dict], actions: list[dict],
             steps: list[tuple[int, float, float]], window_s: float = 600.0) -> list[FaultOutcome]:
    """Match each injection (chaos log records, one per fault id) with the first anomaly of a
    matching kind after it, the actions of that anomaly's incident, and the first step that
    ended after the recovery action (for disruptive faults) or the detection (others)."""
    result = []
    faults = _one_per_fault(injections)
    founds = []
    for record in faults:
        kinds = DETECTED_AS.get(record["kind"], (record["kind"],))
        founds.append([a for a in anomalies if a["kind"] in kinds
                       and record["injected_ts"] - 1.0 <= a.get("ts", a["detected_ts"])
                       <= record["injected_ts"] + window_s])
    for index, record in enumerate(faults):
        outcome = FaultOutcome(kind=record["kind"], ranks=record.get("ranks") or [],
                               injected_ts=record["injected_ts"], step=record.get("step"),
                               node=record.get("node"))
        until = _next_fault_ts(faults, index, outcome.injected_ts + window_s)
        found = founds[index]
        # faults injected together (an Xid and the kill of its rank) are one problem: the
        # action service acts on the incident of whichever was found first
        together = {a["id"] for i, f in enumerate(faults)
                    if abs(f["injected_ts"] - outcome.injected_ts) <= TOGETHER_S
                    for a in founds[i]}
        later = {a["id"] for i, f in enumerate(faults)
                 if f["injected_ts"] > outcome.injected_ts + TOGETHER_S
                 for a in founds[i]} - together
        taken = _actions_for(actions, together, later, outcome.injected_ts, until)
        outcome.actions = _unique(a["action"] for a in taken if a["action"] != "none")
        restarts = [a["ts"] for a in taken if a["action"] in ("restart", "rollback")
                    and a.get("status") == "done"]
        if found:
            first = min(found, key=lambda a: a.get("ts", a["detected_ts"]))
            outcome.detected_ts = first.get("ts", first["detected_ts"])
            outcome.anomaly_kinds = sorted({a["kind"] for a in found})
        if outcome.kind in DISRUPTIVE:
            after = min(restarts) if restarts else outcome.injected_ts + 1.0
            outcome.recovered_ts = _first_step_end_after(steps, after)
        elif outcome.detected_ts is not None:
            outcome.recovered_ts = _first_step_end_after(steps, outcome.detected_ts)
        result.append(outcome)
    return result


def _actions_for(actions: list[dict], anomaly_ids: set, later_ids: set, since: float,
                 until: float) -> list:
    """The actions taken for these anomalies' incidents since the fault (the action service
    names the anomalies of each decision; the outcomes of its orders name the incident only),
    plus the supervisor's own restarts of a failed command (``trigger: "exit"``) between this
    fault and the next.

    An incident that a later fault's anomaly joined (a straggler, then a hang of the same
    rank) runs the later fault's ladder from the first decision naming that anomaly on:
    what follows belongs to the later fault."""
    incidents = {a["incident"] for a in actions if set(a.get("anomalies") or []) & anomaly_ids}
    incidents |= {f"inc-{i}" for i in anomaly_ids}
    cut = min((a["ts"] for a in actions if a.get("incident") in incidents
               and set(a.get("anomalies") or []) & later_ids), default=math.inf)
    return [a for a in actions
            if a.get("status") in ("done", "planned", "dry_run") and since <= a["ts"]
            and ((a.get("incident") in incidents and a["ts"] < cut)
                 or (a.get("source") == "supervisor" and a.get("trigger") in ("exit", "inplace")
                     and a["ts"] < until))]


def _next_fault_ts(faults: list[dict], index: int, default: float) -> float:
    """When the next fault began: the first injected more than ``TOGETHER_S`` after this
    one (faults injected together share their actions)."""
    this = faults[index]["injected_ts"]
    return next((f["injected_ts"] for f in faults[index + 1:]
                 if f["injected_ts"] > this + TOGETHER_S), default)


def _one_per_fault(injections: list[dict]) -> list[dict]:
    merged = {}
    for record in sorted(injections, key=lambda r: r["injected_ts"]):
        key = record.get("id") or (record["kind"], record.get("step"))
        if key in merged:
            ranks = set(merged[key].get("ranks") or []) | set(record.get("ranks") or [])
            merged[key]["ranks"] = sorted(ranks)
        else:
            merged[key] = dict(record)
    return list(merged.values())


def _first_step_end_after(steps, ts: float, gap_s: float = 0.0) -> float | None:
    ends = [end for _, start, end in steps if start >= ts - 1e-6]
    if gap_s:
        ends = [end for end in ends if end >= ts + gap_s]
    return min(ends) if ends else None


def _unique(items) -> list:
    seen = []
    for item in items:
        if item not in seen:
            seen.append(item)
    return seen
