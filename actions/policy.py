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

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from trainguard.actions.model import JOB_ACTIONS, Decision, History, Incident
from trainguard.actions.safety import DAY_S, apply_limits, covering_restart, restart_over
from trainguard.actions.orders import MAX_RANK, MAX_RANKS
from trainguard.config import ConfigError
from trainguard.detectors.registry import default_ladder
from trainguard.errors import UserError
from trainguard.setting import setting, validate

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
#: Each anomaly kind's default ladder, as its detector's registration declares it
#: (``ladder=``, :mod:`trainguard.detectors.registry`).
DEFAULT_LADDER = default_ladder()
#: How demanding a step is, for escalation: a ladder is as demanding as its strongest step.
#: The conditional evictions rank below a restart: they are a "maybe", and a straggler that
#: *may* be evicted one day must still escalate to a hang's restart.
STRENGTH = {"alert": 0, "capture": 1, "evict_if_repeated": 2, "evict_suspects": 2,
            "evict_if_persistent": 2, "restart": 3, "rollback": 3, "evict": 4,
            "rollback_if_repeated": 1.5}   # a maybe, and no machine's fault: below those
OVER_EVICT = ("tp", "pp", "dp")
#: Kinds that are evidence and suspects only: whatever a policy file says, their own ladder
#: never restarts, rolls back or evicts (a learned model's warning, docs/DETECTION.md)
EVIDENCE_KINDS = ("machine_outlier",)


class PolicyError(UserError):
    """The policy file is wrong; the message names the key and how to mend it."""


def _ladder(value, path: str) -> dict:
    """The ``ladder`` setting's check: each kind's steps, over the default ladder."""
    if not isinstance(value, dict):
        raise ConfigError(f"{path} must be a table of anomaly kind -> steps, got {value!r}")
    ladder = dict(DEFAULT_LADDER)
    for kind, steps in value.items():
        if kind not in DEFAULT_LADDER:
            raise ConfigError(f"{path}: unknown anomaly kind {kind!r}; kinds are "
                              f"{sorted(DEFAULT_LADDER)}")
        if isinstance(steps, str) or not isinstance(steps, (list, tuple)) \
                or not all(isinstance(s, str) for s in steps):
            raise ConfigError(f"{path}.{kind} must be a list of step names")
        unknown = [s for s in steps if s not in STEPS]
        if unknown:
            raise ConfigError(f"{path}.{kind}: unknown step(s) {unknown}; steps are "
                              f"{sorted(STEPS)}")
        ladder[kind] = tuple(steps)
    return ladder


@dataclass(kw_only=True, frozen=True)
class Limits:
    """Safety caps, per job (restarts) and per service (evictions per day)."""

    max_restarts: int = setting(3, "restarts of a job per restart_window_s, then a page",
                                minimum=1)
    restart_window_s: float = setting(3600.0, "window of max_restarts", above=0)
    restart_settle_s: float = setting(120.0, "longest wait for a restart to show in the "
                                             "lifecycle", above=0)
    max_evictions_per_incident: int = setting(2, "machines evicted per incident at most",
                                              minimum=1)
    max_evictions_per_day: int = setting(8, "machines evicted per 24 h, all jobs", minimum=1)
    page_cooldown_s: float = setting(900.0, "a job is paged at most once per this", above=0)


@dataclass(kw_only=True, frozen=True)
class CaptureSettings:
    """How the stacks of a job are captured: ``rounds`` captures ``interval_s`` apart, each
    gathered until every expected rank answered or ``deadline_s``; with no known world size,
    until no rank answered for ``quiet_s``."""

    rounds: int = setting(2, "stack captures per incident", minimum=1)
    interval_s: float = setting(2.0, "seconds between the rounds", above=0)
    deadline_s: float = setting(10.0, "a round waits this long for every expected rank",
                                above=0)
    quiet_s: float = setting(2.0, "with no known world size: until no rank answered this "
                                  "long", above=0)


@dataclass(kw_only=True, frozen=True)
class BacklogSettings:
    """How many anomalies the service takes on at once (docs/POLICY.md, "Backlog"): at most
    ``max_queued`` waiting (beyond, the oldest of the least severe is dropped, with a
    record), at most ``max_in_flight`` under way (most of them waiting for stacks, which
    costs no thread); ``workers`` threads make the blocking calls (alert sinks)."""

    max_queued: int = setting(10_000, "anomalies waiting at most; then the oldest of the "
                                      "least severe is dropped, with a record", minimum=1)
    max_in_flight: int = setting(4096, "anomalies under way at once (waiting for stacks "
                                       "costs no thread)", minimum=1)
    workers: int = setting(4, "threads for blocking calls (alert sinks)", minimum=1)


@dataclass(kw_only=True, frozen=True)
class IncidentSettings:
    """How the service groups anomalies by the worker's ``incident`` events: an anomaly whose
    incident has not come yet waits for it at most ``wait_s`` after the anomaly arrived; when
    no incident came within ``expect_s`` (an older worker, ``publish_incidents`` off), the
    service groups anomalies with its own correlator at once."""

    wait_s: float = setting(2.0, "an anomaly waits this long at most for the worker's "
                                 "incident that lists it", above=0)
    expect_s: float = setting(3600.0, "no incident event within this: group anomalies with "
                                      "the service's own correlator", above=0)


@dataclass(kw_only=True, frozen=True)
class Policy:
    """The whole policy, the ``policy`` section of the configuration tree; ``Policy()`` is
    the documented default. Its settings are checked by :func:`trainguard.setting.validate`
    (a mistake is a :class:`PolicyError` naming the key)."""

    dry_run: bool = setting(False, "decide and record everything, carry nothing out")
    require_approval: tuple = setting((), "job actions (restart, evict, rollback) that wait "
                                          "for an operator", kind=tuple, choices=JOB_ACTIONS)
    ladder: dict = setting(DEFAULT_LADDER, "anomaly kind -> ordered steps (docs/POLICY.md); "
                                           "kinds left out keep their default ladder",
                           check=_ladder)
    over_evict: str | None = setting(None, "evict the whole tp, pp or dp group of a suspect",
                                     kind=str, choices=OVER_EVICT)
    crash_repeats: int = setting(2, "crashes of one rank within crash_window_s that make it "
                                    "'repeated'", minimum=1)
    crash_window_s: float = setting(3600.0, "window of crash_repeats", above=0)
    repeat_count: int = setting(2, "incidents of one kind in a job within repeat_window_s "
                                   "that make rollback_if_repeated roll back", minimum=1)
    repeat_window_s: float = setting(3600.0, "window of repeat_count", above=0)
    max_suspect_fraction: float = setting(0.5, "never evict more than this fraction of the "
                                               "job's machines", above=0, maximum=1)
    straggler_persist_s: float = setting(600.0, "a straggler slow this long is 'persistent'",
                                         above=0)
    straggler_min_slowdown: float = setting(1.3, "... and at least this much slower than its "
                                                 "peers", above=0)
    max_anomaly_age_s: float = setting(3600.0, "anomalies older than this are recorded, not "
                                               "acted on", above=0)
    confirm_stalled: bool = setting(True, "before a restart or eviction for a hang, check the "
                                          "job is still stalled; one that moved on is closed "
                                          "as a false alarm")
    limits: Limits = field(default_factory=Limits)
    capture: CaptureSettings = field(default_factory=CaptureSettings)
    backlog: BacklogSettings = field(default_factory=BacklogSettings)
    incidents: IncidentSettings = field(default_factory=IncidentSettings)

    def __post_init__(self):
        try:
            validate(self, "policy.")
        except ConfigError as exc:
            raise PolicyError(str(exc)) from None

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
        for name, sub in _NESTED.items():
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
        for name in _NESTED:
            out[name] = dataclasses.asdict(getattr(self, name))
        out["ladder"] = {k: list(v) for k, v in self.ladder.items()}
        out["require_approval"] = list(self.require_approval)
        return out


#: the nested settings of :class:`Policy`: field -> its class
_NESTED = {f.name: f.default_factory for f in fields(Policy)
           if dataclasses.is_dataclass(f.default_factory)}


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


def _job_targets(incident: Incident) -> dict:
    """A job order's targets; ``ranks`` (for a restart in place) only when the order may
    carry them: an incident of more ranks restarts the whole job anyway."""
    out = {"job": incident.job, "onset_ts": incident.onset_ts}
    ranks = sorted({r for r in incident.ranks if type(r) is int and 0 <= r <= MAX_RANK})
    if ranks and len(ranks) == len(set(incident.ranks)) and len(ranks) <= MAX_RANKS:
        out["ranks"] = ranks
    return out


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
