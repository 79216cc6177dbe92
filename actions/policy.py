"""The escalation ladder: what an incident calls for, as pure decisions with named reasons.

A :class:`Policy` maps each anomaly kind to a *ladder*, an ordered list of steps, and holds
the thresholds the steps use. :func:`decide` turns one incident (plus what was already done
for it and the stack analysis, if any) into :class:`Decision` objects. Nothing here does
I/O or reads a clock: the pipeline passes ``now`` in. The defaults follow ByteRobust and are
documented in ``docs/POLICY.md``.

>>> gpu = Incident(id="i1", job="j1", kind="gpu_fault", severity="critical", ranks=[3],
...                nodes=["n2"], onset_ts=100.0, detected_ts=101.0, summary="Xid 79 on n2")
>>> [(d.action, d.targets.get("exclude_nodes")) for d in decide(Policy(), gpu, History())]
[('evict', ['n2']), ('restart', ['n2']), ('alert', None)]
>>> hang = Incident(id="i2", job="j1", kind="hang", severity="critical", ranks=[],
...                 nodes=[], onset_ts=100.0, detected_ts=160.0, summary="no step for 60s")
>>> loc = {"suspects": [2], "nodes": ["n1"], "groups": {}, "world_size": 4}
>>> for d in decide(Policy(), hang, History(), loc)[:2]:
...     print(d.action, "|", d.reason)
evict | hang_suspects: stack analysis blames rank(s) [2] on n1
restart | hang: restart after evicting n1

An incident gets the ladder of its most demanding member kind (:func:`ladder_kind`): a hang
that joins a NaN incident escalates it from an alert to the hang's capture and restart.

>>> nan = Incident(id="i3", job="j1", kind="nan", severity="critical", ranks=[1], nodes=[],
...                onset_ts=100.0, detected_ts=160.0, summary="loss is NaN on rank 1",
...                kinds=["nan", "hang"])
>>> for d in decide(Policy(), nan, History(done={"alert": "done"})):
...     print(d.action, "|", d.reason)
restart | escalated: hang joined nan incident i3: loss is NaN on rank 1
alert | escalated: hang joined nan incident i3: loss is NaN on rank 1
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from trainguard.errors import UserError

__all__ = ["Policy", "Limits", "CaptureSettings", "BacklogSettings", "IncidentSettings", "Incident", "Decision",
           "History", "PolicyError", "decide", "apply_limits", "covering_restart", "restart_over",
           "load_policy", "ladder_kind", "STEPS", "STRENGTH",
           "DEFAULT_LADDER", "JOB_ACTIONS", "DAY_S"]

STEPS = {
    "alert": "tell humans (every alert sink)",
    "capture": "capture the stacks of all ranks and aggregate them before deciding",
    "evict": "evict the incident's machines",
    "evict_if_repeated": "evict the machines that failed `crash_repeats` times in "
                         "`crash_window_s`",
    "evict_suspects": "evict the machines of the stack analysis' suspects (their parallel "
                      "group with `over_evict`)",
    "evict_if_persistent": "evict the incident's machines once it lasted `straggler_persist_s` "
                           "with a slowdown of at least `straggler_min_slowdown`",
    "restart": "restart the job from its latest checkpoint",
    "rollback": "restart from the newest checkpoint at or before the onset's step",
    "rollback_if_repeated": "roll back (as `rollback`) when the job had `repeat_count` "
                            "incidents of this kind within `repeat_window_s`, this one "
                            "included: one spike or NaN the optimizer rides out; a repeated "
                            "one means the state itself went bad",
}
DEFAULT_LADDER = {
    "gpu_fault": ("evict", "restart", "alert"),
    "crash": ("evict_if_repeated", "restart", "alert"),
    "hang": ("capture", "evict_suspects", "restart", "alert"),
    "straggler": ("capture", "evict_if_persistent", "alert"),
    "nan": ("rollback_if_repeated", "alert"),
    "loss_spike": ("rollback_if_repeated", "alert"),
    "grad_spike": ("rollback_if_repeated", "alert"),
    "throughput_drop": ("alert",),
    "gpu_degraded": ("alert",),
    "silent": ("alert",),
    "data_position": ("alert",),
    "machine_outlier": ("alert",),
}
#: How demanding a step is, for escalation: a ladder is as demanding as its strongest step.
#: The conditional evictions rank below a restart: they are a "maybe", and a straggler that
#: *may* be evicted one day must still escalate to a hang's restart.
STRENGTH = {"alert": 0, "capture": 1, "evict_if_repeated": 2, "evict_suspects": 2,
            "evict_if_persistent": 2, "restart": 3, "rollback": 3, "evict": 4,
            "rollback_if_repeated": 1.5}   # a maybe, and no machine's fault: below those
JOB_ACTIONS = ("restart", "evict", "rollback")  # what changes the job; dry-run stops these
ACTIONS = ("alert", "capture_stacks", "restart", "evict", "rollback", "none")
OVER_EVICT = (None, "tp", "pp", "dp")
#: Kinds that no restart of ours explains: their alert goes out even when another
#: incident's restart covers theirs.
HARDWARE_KINDS = ("gpu_fault", "gpu_degraded", "machine_outlier")
#: Kinds that are evidence and suspects only: whatever a policy file says, their own ladder
#: never restarts, rolls back or evicts (a learned model's warning, docs/DETECTION.md)
EVIDENCE_KINDS = ("machine_outlier",)
DAY_S = 86400.0


class PolicyError(UserError):
    """The policy file is wrong; the message names the key and how to mend it."""


def _positive(owner: str, name: str, value, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not value > 0 \
            or (not integer and not math.isfinite(value)):
        what = "a positive integer" if integer else "a positive number"
        raise PolicyError(f"{owner}.{name} must be {what}, got {value!r}")


@dataclass(kw_only=True, frozen=True)
class Limits:
    """Safety caps, per job (restarts) and per service (evictions per day)."""

    max_restarts: int = 3
    restart_window_s: float = 3600.0
    restart_settle_s: float = 120.0
    max_evictions_per_incident: int = 2
    max_evictions_per_day: int = 8
    page_cooldown_s: float = 900.0

    def __post_init__(self):
        for f in fields(self):
            _positive("limits", f.name, getattr(self, f.name), integer=f.type == "int")


@dataclass(kw_only=True, frozen=True)
class CaptureSettings:
    """How the stacks of a job are captured: ``rounds`` captures ``interval_s`` apart, each
    gathered until every expected rank answered or ``deadline_s``; with no known world size,
    until no rank answered for ``quiet_s``."""

    rounds: int = 2
    interval_s: float = 2.0
    deadline_s: float = 10.0
    quiet_s: float = 2.0

    def __post_init__(self):
        for f in fields(self):
            _positive("capture", f.name, getattr(self, f.name), integer=f.type == "int")


@dataclass(kw_only=True, frozen=True)
class BacklogSettings:
    """How many anomalies the service takes on at once (docs/POLICY.md, "Backlog"): at most
    ``max_queued`` waiting (beyond, the oldest of the least severe is dropped, with a
    record), at most ``max_in_flight`` under way (most of them waiting for stacks, which
    costs no thread); ``workers`` threads make the blocking calls (alert sinks)."""

    max_queued: int = 10_000
    max_in_flight: int = 4096
    workers: int = 4

    def __post_init__(self):
        for f in fields(self):
            _positive("backlog", f.name, getattr(self, f.name), integer=True)


@dataclass(kw_only=True, frozen=True)
class IncidentSettings:
    """How the service groups anomalies by the worker's ``incident`` events: an anomaly whose
    incident has not come yet waits for it at most ``wait_s`` after the anomaly arrived; when
    no incident came within ``expect_s`` (an older worker, ``publish_incidents`` off), the
    service groups anomalies with its own correlator at once."""

    wait_s: float = 2.0
    expect_s: float = 3600.0

    def __post_init__(self):
        for f in fields(self):
            _positive("incidents", f.name, getattr(self, f.name))


@dataclass(kw_only=True, frozen=True)
class Policy:
    """The whole policy; ``Policy()`` is the documented default."""

    dry_run: bool = False
    require_approval: tuple = ()
    ladder: dict = field(default_factory=lambda: dict(DEFAULT_LADDER))
    over_evict: str | None = None
    crash_repeats: int = 2
    crash_window_s: float = 3600.0
    repeat_count: int = 2
    repeat_window_s: float = 3600.0
    max_suspect_fraction: float = 0.5
    straggler_persist_s: float = 600.0
    straggler_min_slowdown: float = 1.3
    max_anomaly_age_s: float = 3600.0
    confirm_stalled: bool = True
    limits: Limits = field(default_factory=Limits)
    capture: CaptureSettings = field(default_factory=CaptureSettings)
    backlog: BacklogSettings = field(default_factory=BacklogSettings)
    incidents: IncidentSettings = field(default_factory=IncidentSettings)

    def __post_init__(self):
        if not isinstance(self.dry_run, bool):
            raise PolicyError(f"dry_run must be true or false, got {self.dry_run!r}")
        if not isinstance(self.confirm_stalled, bool):
            raise PolicyError(f"confirm_stalled must be true or false, got "
                              f"{self.confirm_stalled!r}")
        bad = [a for a in self.require_approval if a not in JOB_ACTIONS]
        if bad:
            raise PolicyError(f"require_approval: {bad} are not among {list(JOB_ACTIONS)}")
        object.__setattr__(self, "require_approval", tuple(self.require_approval))
        ladder = dict(DEFAULT_LADDER)
        for kind, steps in dict(self.ladder).items():
            if kind not in DEFAULT_LADDER:
                raise PolicyError(f"ladder: unknown anomaly kind {kind!r}; kinds are "
                                  f"{sorted(DEFAULT_LADDER)}")
            if isinstance(steps, str) or not all(isinstance(s, str) for s in steps):
                raise PolicyError(f"ladder.{kind} must be a list of step names")
            unknown = [s for s in steps if s not in STEPS]
            if unknown:
                raise PolicyError(f"ladder.{kind}: unknown step(s) {unknown}; steps are "
                                  f"{sorted(STEPS)}")
            ladder[kind] = tuple(steps)
        object.__setattr__(self, "ladder", ladder)
        if self.over_evict not in OVER_EVICT:
            raise PolicyError(f"over_evict must be null or one of tp, pp, dp, got "
                              f"{self.over_evict!r}")
        _positive("policy", "crash_repeats", self.crash_repeats, integer=True)
        _positive("policy", "repeat_count", self.repeat_count, integer=True)
        for name in ("crash_window_s", "repeat_window_s", "straggler_persist_s", "max_anomaly_age_s",
                     "straggler_min_slowdown"):
            _positive("policy", name, getattr(self, name))
        if not 0 < self.max_suspect_fraction <= 1:
            raise PolicyError("max_suspect_fraction must be in (0, 1], got "
                              f"{self.max_suspect_fraction!r}")

    def steps(self, kind: str) -> tuple:
        return self.ladder.get(kind, ("alert",))

    def wants_capture(self, kind: str) -> bool:
        return "capture" in self.steps(kind)

    def strength(self, kind: str) -> int:
        """How demanding the ladder of ``kind`` is (its strongest step, by :data:`STRENGTH`)."""
        return max((STRENGTH[s] for s in self.steps(kind)), default=-1)

    @classmethod
    def from_dict(cls, data: dict) -> "Policy":
        """Build from the JSON policy file's object; unknown keys are mistakes.

        >>> Policy.from_dict({"limits": {"max_restarts": 5}, "ladder": {"nan": ["alert",
        ...     "rollback"]}}).limits.max_restarts
        5
        >>> Policy.from_dict({"max_restart": 5})
        Traceback (most recent call last):
        ...
        trainguard.actions.policy.PolicyError: unknown policy key(s) ['max_restart']; known: ...
        """
        if not isinstance(data, dict):
            raise PolicyError("the policy file must hold one JSON object")
        data = {k: v for k, v in data.items() if not k.startswith("_")}  # "_comment" keys
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PolicyError(f"unknown policy key(s) {unknown}; known: {sorted(known)}")
        values = dict(data)
        for name, sub in (("limits", Limits), ("capture", CaptureSettings),
                          ("backlog", BacklogSettings), ("incidents", IncidentSettings)):
            if name in values:
                raw = values[name]
                if not isinstance(raw, dict):
                    raise PolicyError(f"{name} must be an object")
                subknown = {f.name for f in fields(sub)}
                bad = sorted(set(raw) - subknown)
                if bad:
                    raise PolicyError(f"unknown {name} key(s) {bad}; known: {sorted(subknown)}")
                values[name] = sub(**raw)
        try:
            return cls(**values)
        except TypeError as exc:
            raise PolicyError(f"policy: {exc}") from None

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["limits"] = {f.name: getattr(self.limits, f.name) for f in fields(Limits)}
        out["capture"] = {f.name: getattr(self.capture, f.name) for f in fields(CaptureSettings)}
        out["backlog"] = {f.name: getattr(self.backlog, f.name) for f in fields(BacklogSettings)}
        out["incidents"] = {f.name: getattr(self.incidents, f.name)
                            for f in fields(IncidentSettings)}
        out["ladder"] = {k: list(v) for k, v in self.ladder.items()}
        out["require_approval"] = list(self.require_approval)
        return out


def load_policy(path: str | Path | None, dry_run: bool = False) -> Policy:
    """The policy of a JSON file (defaults for what it leaves out); ``dry_run`` forces it on."""
    policy = Policy()
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise PolicyError(f"cannot read policy file {path}: {exc.strerror}") from None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise PolicyError(f"policy file {path} is not valid JSON: {exc}") from None
        policy = Policy.from_dict(data)
    return replace(policy, dry_run=True) if dry_run else policy


@dataclass(kw_only=True)
class Incident:
    """One problem of one job, made of one or more anomalies; ``kind`` is its root cause,
    ``kinds`` the kinds of its anomalies (empty: just ``kind``)."""

    id: str
    job: str
    kind: str
    severity: str
    ranks: list
    nodes: list
    onset_ts: float
    detected_ts: float
    summary: str
    step: int | None = None
    anomalies: list = field(default_factory=list)
    evidence: dict = field(default_factory=dict)
    kinds: list = field(default_factory=list)
    #: anomalies of the root kind among its members (episodes: a spike twice is two)
    same_kind: int = 1


@dataclass(kw_only=True, frozen=True)
class Decision:
    """One action for one incident; ``status`` starts ``planned`` and the safety stage may
    turn it into ``dry_run`` or ``rate_limited``; ``reason`` says why, for humans, and
    ``code`` the same as one word that programs decide on (``restart_cap``, ``dry_run``,
    ``covered``, ...; the reason starts with it). ``order_id``: the order that carries the
    decision out, once sent."""

    action: str
    reason: str
    targets: dict = field(default_factory=dict)
    status: str = "planned"
    severity: str = "warning"
    code: str | None = None
    order_id: str | None = None

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}")

    def with_status(self, status: str, reason: str, code: str | None = None) -> "Decision":
        return replace(self, status=status, reason=reason, code=code or self.code)


@dataclass(kw_only=True)
class History:
    """What the service already knows, for one incident: actions recorded for it
    (``{action: status}``), when the job's other failures happened per machine
    (``node_failures``: ``{node: [ts, ...]}``, this incident excluded), the machines
    already evicted from the job, and when the incident was first seen."""

    done: dict = field(default_factory=dict)
    node_failures: dict = field(default_factory=dict)
    excluded_nodes: list = field(default_factory=list)
    first_seen_ts: float | None = None
    #: when the job's earlier incidents of the same kind were first seen (this one excluded)
    same_kind_ts: list = field(default_factory=list)


def _job_targets(incident: Incident) -> dict:
    return {"job": incident.job, "onset_ts": incident.onset_ts}


def _suspect_nodes(policy: Policy, loc: dict) -> list:
    if policy.over_evict and loc.get("group_nodes", {}).get(policy.over_evict):
        return sorted(set(loc["group_nodes"][policy.over_evict]))
    return sorted(set(loc.get("nodes") or []))


def _slowdown(evidence: dict) -> float | None:
    for key in ("slowdown", "mean_ratio", "ratio", "slowdown_ratio"):
        value = evidence.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value):
            return float(value)
    return None


def ladder_kind(policy: Policy, incident: Incident) -> str:
    """The kind whose ladder the incident gets: its root kind, unless one of its anomalies is
    of a kind with a more demanding ladder (:meth:`Policy.strength`; the root kind wins ties).

    >>> inc = Incident(id="i", job="j", kind="straggler", severity="warning", ranks=[2],
    ...                nodes=[], onset_ts=0.0, detected_ts=1.0, summary="rank 2 is slow")
    >>> ladder_kind(Policy(), inc)
    'straggler'
    >>> inc.kinds = ["straggler", "hang"]
    >>> ladder_kind(Policy(), inc)
    'hang'
    """
    return max([incident.kind, *incident.kinds], key=policy.strength)


def _repeated(policy: Policy, incident: Incident, history: History) -> bool:
    """The job had ``repeat_count`` episodes of this kind within ``repeat_window_s``: earlier
    incidents, and the anomalies of this kind in this one (spikes close together are one
    incident).

    >>> inc = Incident(id="i2", job="j", kind="loss_spike", severity="warning", ranks=[],
    ...                nodes=[], step=40, onset_ts=5000.0, detected_ts=5000.0, summary="")
    >>> _repeated(Policy(), inc, History()), _repeated(Policy(), inc, History(same_kind_ts=[4000.0]))
    (False, True)
    """
    start = incident.detected_ts - policy.repeat_window_s
    earlier = sum(1 for t in history.same_kind_ts if t >= start)
    return earlier + incident.same_kind >= policy.repeat_count


def _evictions(policy: Policy, incident: Incident, history: History, loc: dict | None,
               steps: tuple, kind: str) -> tuple[list, str, str | None]:
    """Machines the ladder (of ``kind``) evicts now, why, and the step that evicts them."""
    if "evict" in steps and incident.nodes:
        return sorted(set(incident.nodes)), f"{kind}: {incident.summary}", "evict"
    if "evict_if_repeated" in steps and incident.nodes:
        window_start = incident.detected_ts - policy.crash_window_s
        repeated = [n for n in sorted(set(incident.nodes))
                    if 1 + sum(1 for t in history.node_failures.get(n, ())
                               if t >= window_start) >= policy.crash_repeats]
        if repeated:
            return repeated, (f"repeated_failure: {', '.join(repeated)} failed "
                              f"{policy.crash_repeats} times within {policy.crash_window_s:g}s"
                              ), "evict_if_repeated"
    if "evict_suspects" in steps and loc and loc.get("suspects"):
        suspects = loc["suspects"]
        world = loc.get("world_size") or 0
        nodes = _suspect_nodes(policy, loc)
        if world and len(suspects) > policy.max_suspect_fraction * world:
            return [], "", None
        if nodes:
            return nodes, (f"{kind}_suspects: stack analysis blames rank(s) "
                           f"{suspects} on {', '.join(nodes)}"), "evict_suspects"
    if "evict_if_persistent" in steps and incident.nodes:
        since = min(incident.onset_ts, history.first_seen_ts or incident.onset_ts)
        lasted = incident.detected_ts - since
        slowdown = _slowdown(incident.evidence)
        if lasted >= policy.straggler_persist_s and slowdown is not None \
                and slowdown >= policy.straggler_min_slowdown:
            return sorted(set(incident.nodes)), (
                f"persistent_{kind}: {slowdown:.2f}x slower for {lasted:.0f}s "
                f"(limits {policy.straggler_min_slowdown:g}x, {policy.straggler_persist_s:g}s)"
            ), "evict_if_persistent"
    return [], "", None


def decide(policy: Policy, incident: Incident, history: History,
           localization: dict | None = None) -> list[Decision]:
    """The decisions of the ladder of :func:`ladder_kind`: evictions first, then the restart
    or rollback, then the alert. Actions already recorded for the incident are not repeated.
    When a member's ladder is used rather than the root kind's, the restart, rollback and
    alert reasons start with ``escalated:``. ``localization`` is the stack analysis
    (``suspects``, ``nodes``, ``world_size``, and ``group_nodes`` per parallel dimension for
    over-eviction)."""
    kind = ladder_kind(policy, incident)
    steps = policy.steps(kind)
    if kind == "crash" and incident.evidence.get("external_stop"):
        # Every rank exited by SIGTERM with none vanished: a preemption or an operator's stop
        # (our own restarts are recognised earlier, as covered or expected). Say it; don't undo it.
        steps = [s for s in steps if s == "alert"]
    if kind in EVIDENCE_KINDS:
        steps = [s for s in steps if s in ("alert", "capture")]
    head = kind if kind == incident.kind else \
        f"escalated: {kind} joined {incident.kind} incident {incident.id}"
    escalated = "" if kind == incident.kind else head + "; "
    done = history.done
    out: list[Decision] = []
    code = "escalated" if escalated else None
    nodes, why, step = _evictions(policy, incident, history, localization, steps, kind)
    nodes = [n for n in nodes if n not in history.excluded_nodes]
    if nodes and "machine_outlier" in incident.kinds:
        why += "; machine_outlier: the machine's counters stand out from its peers'"
    if nodes and "evict" not in done:
        out.append(Decision(action="evict", reason=why, severity="critical", code=step, targets={
            **_job_targets(incident), "nodes": nodes,
            "exclude_nodes": sorted(set(history.excluded_nodes) | set(nodes))}))
    exclude = sorted(set(history.excluded_nodes) | set(nodes))
    if "rollback_if_repeated" in steps and "rollback" not in steps and \
            _repeated(policy, incident, history):
        steps = (*steps, "rollback")
    if "rollback" in steps and "rollback" not in done and "restart" not in done:
        onset_step = incident.evidence.get("onset_step", incident.step)
        # A checkpoint "at step k" resumes at step k: it holds steps 0..k-1, none of the
        # onset's step when k <= onset. TRAINGUARD_RESUME_STEP caps the checkpoint loaded.
        target = max(0, onset_step) if isinstance(onset_step, int) else None
        out.append(Decision(action="rollback", severity="critical", code=code or "rollback",
                            targets={**_job_targets(incident), "exclude_nodes": exclude,
                                     "rollback_step": target},
                            reason=escalated + (f"{kind}: restart from the last checkpoint at or before step "
                                f"{target}" if target is not None else
                                f"{kind}: restart from the last checkpoint (onset step "
                                f"unknown)")))
    elif ("restart" in steps or nodes) and "restart" not in done and "rollback" not in done:
        if nodes:
            why_restart = f"{escalated}{kind}: restart after evicting {', '.join(nodes)}"
        elif kind == "hang" and localization is not None:
            why_restart = (f"{escalated}hang: no outlier among the ranks' stacks "
                           f"({localization.get('summary', 'no summary')}); restart")
        else:
            why_restart = f"{head}: {incident.summary}"
        out.append(Decision(action="restart", reason=why_restart, severity="critical",
                            code=code or "restart",
                            targets={**_job_targets(incident), "exclude_nodes": exclude}))
    if "alert" in steps and ("alert" not in done or out):
        out.append(Decision(action="alert", severity=incident.severity, code=code or "alert",
                            reason=f"{head}: {incident.summary}",
                            targets={"job": incident.job, "ranks": list(incident.ranks),
                                     "nodes": list(incident.nodes)}))
    return out


def restart_over(ordered_ts: float, launches=(), settle_s: float = 120.0,
                 satisfied: bool = False) -> float:
    """When a restart ordered at ``ordered_ts`` is over: the next launch after it (by
    ``trainguard run``, or the new run's first rank start), at most ``settle_s`` later.
    Until then, ranks exiting "by signal" are our own doing; a problem beginning later is a
    new one. A restart that ``trainguard run`` answered ``already_satisfied`` (it had
    relaunched the job on its own after the incident began) tore nothing down: it was over
    when it was ordered.

    >>> restart_over(100.0, launches=[50.0, 104.5]), restart_over(100.0, settle_s=30)
    (104.5, 130.0)
    >>> restart_over(100.0, launches=[150.0], satisfied=True)
    100.0
    """
    if satisfied:
        return ordered_ts
    after = sorted(t for t in launches if t >= ordered_ts)
    return min(after[0], ordered_ts + settle_s) if after else ordered_ts + settle_s


def covering_restart(state, incident: Incident, launches=(), settle_s: float = 120.0,
                     satisfied=frozenset()):
    """``(restart entry, code, reason)`` of a restart of the job that already deals with this
    incident, or None: one ordered for another incident after this one began (``covered``),
    or one under way when this one began (``expected``; see :func:`restart_over`;
    ``satisfied``: the incidents whose restart ``trainguard run`` acked
    ``already_satisfied``)."""
    for r in state.restarts_since(incident.job, incident.onset_ts):
        if r["incident"] != incident.id:
            return r, "covered", (f"covered: job {incident.job} was already restarted for "
                                  f"incident {r['incident']} after this incident began")
    for r in state.restarts_since(incident.job, incident.onset_ts - settle_s):
        if r["incident"] != incident.id and \
                r["ts"] <= incident.onset_ts <= restart_over(r["ts"], launches, settle_s,
                                                             r["incident"] in satisfied):
            return r, "expected", (f"expected: began while job {incident.job} was being "
                                   f"restarted for incident {r['incident']}")
    return None


def apply_limits(decisions: list, incident: Incident, policy: Policy, state,
                 now: float, launches=(), satisfied=frozenset()) -> list:
    """Safety caps, approval and dry-run, in this order, on the planned decisions:

    - restart/rollback: ``covered``/``expected`` (see :func:`covering_restart`; unless
      machines are evicted now, which needs a new launch: rate-limited and no alert),
      ``restart_cap`` (``max_restarts`` in ``restart_window_s``: rate-limited, and a human
      is paged);
    - evict: ``evict_cap`` per incident and per day (rate-limited, paged; the restart goes
      on without excluding those machines);
    - ``approval_required`` (actions in ``require_approval``) and ``dry_run``: recorded as
      ``dry_run``, an alert tells humans what would have been done.
    """
    lim, job = policy.limits, incident.job
    out, pages, blocked = [], [], set()
    evicting = any(d.action == "evict" and d.status == "planned"
                   and d.code != "evict_if_repeated" for d in decisions)
    cover = None if evicting else covering_restart(state, incident, launches,
                                                   lim.restart_settle_s, satisfied)
    for d in decisions:
        if d.status != "planned" or d.action not in JOB_ACTIONS:
            out.append(d)
            continue
        if d.action == "evict" and cover:  # a repeat that our own restart explains
            blocked |= set(d.targets.get("nodes", []))
            out.append(d.with_status("rate_limited", f"{cover[2]} {now - cover[0]['ts']:.0f}s "
                                                     "ago; not a repeated failure", cover[1]))
            continue
        if d.action == "evict":
            nodes = d.targets.get("nodes", [])
            per_incident = len(state.incident_evictions(incident.id)) + len(nodes)
            per_day = len(state.evictions_since(now - DAY_S)) + len(nodes)
            if per_incident > lim.max_evictions_per_incident:
                why = (f"evict_cap: evicting {len(nodes)} more machine(s) would make "
                       f"{per_incident} for incident {incident.id} (limit "
                       f"{lim.max_evictions_per_incident})")
            elif per_day > lim.max_evictions_per_day:
                why = (f"evict_cap: evicting {len(nodes)} more machine(s) would make {per_day} "
                       f"in 24h (limit {lim.max_evictions_per_day})")
            else:
                why = None
            if why:
                blocked |= set(nodes)
                pages.append(why)
                out.append(d.with_status("rate_limited", why, "evict_cap"))
                continue
        else:
            if blocked:
                kept = [n for n in d.targets.get("exclude_nodes", []) if n not in blocked]
                d = replace(d, targets={**d.targets, "exclude_nodes": kept})
            in_window = state.restarts_since(job, now - lim.restart_window_s)
            if cover:
                d = replace(d, targets={**d.targets, "settled_by_ts": cover[0]["ts"]})
                out.append(d.with_status("rate_limited", (
                    f"{cover[2]} {now - cover[0]['ts']:.0f}s ago"), cover[1]))
                continue
            if len(in_window) >= lim.max_restarts:
                why = (f"restart_cap: {len(in_window)} restarts of job {job} in the last "
                       f"{lim.restart_window_s:g}s (limit {lim.max_restarts}); automatic "
                       f"restarts stop, a human must look")
                pages.append(why)
                out.append(d.with_status("rate_limited", why, "restart_cap"))
                continue
        if d.action in policy.require_approval:
            d = d.with_status("dry_run", f"approval_required: {d.action} needs a human's "
                                         f"approval (policy require_approval); {d.reason}",
                              "approval_required")
        elif policy.dry_run:
            d = d.with_status("dry_run", f"dry_run: would {d.action}; {d.reason}", "dry_run")
        out.append(d)
    if cover and incident.kind not in HARDWARE_KINDS and \
            any(d.code in ("covered", "expected") for d in out):
        out = [d for d in out if d.action != "alert"]  # the other incident's alert said it
    last_page = state.last_page(job)
    if pages and (last_page is None or now - last_page >= lim.page_cooldown_s):
        out.append(Decision(action="alert", severity="critical", reason="page: " + "; ".join(
            pages), code="page", targets={"job": job, "ranks": list(incident.ranks),
                                          "nodes": list(incident.nodes), "page": True}))
    needs_human = any(d.code == "approval_required" for d in out)
    if needs_human and not any(d.action == "alert" and d.status == "planned" for d in out):
        out.append(Decision(action="alert", severity="critical", targets={"job": job},
                            code="approval_required",
                            reason=f"approval_required: {incident.kind}: {incident.summary}"))
    return out
