"""Incident correlation: anomalies that share one root problem become one incident.

An incident's ``kind`` is its root cause: the member of highest :data:`PRIORITY`. A new
anomaly joins an open incident of the same job when it is close in time (its onset no later
than ``window_s`` after the incident's last detection, its detection no earlier than
``window_s`` before the incident's onset) and a member of the incident can cause it, or it
can cause a member, by :data:`CONSEQUENCES`, and the cause does not begin after its effect
(within :data:`CAUSE_LEAD_S`: an Xid three minutes after a NaN did not cause it). Some consequences follow from their cause
anywhere in the job (a crash makes *every* other rank hang); others only where they share a
rank or a machine (an Xid on GPU 3 of n1 explains rank 3 going silent, not rank 12 on n2),
and a few only on the same rank. A NaN is one rank's arithmetic, not its machine's: it can
make that rank's own code fail (a finiteness check that raises, a device-side assert on a NaN
index) or branch away from a collective the others entered, so it explains a crash or a hang
*blamed on that rank*; it explains neither on another rank, even on the same machine (on a
one-machine job every rank shares it). A crash it caused still explains the other ranks'
hang through ``crash -> hang``. Machines of ranks come from the anomalies' ``nodes`` and
``evidence["rank_nodes"]``.

A problem that begins after the job was dealt with is a new one: a hang whose onset (the
last progress) comes more than :data:`PROGRESS_SLACK_S` after an incident's last detection
joins none, nor does any anomaly that begins once ranks of the job started again after the
incident (:meth:`Correlator.relaunched`, told by the job stage: a restart by ``trainguard
run``, torchrun or a scheduler).

The incident's suspects (``ranks``, ``nodes``) are those of its root-kind members detected
within ``root_slack_s`` of the root's onset: the first crashed rank, not the ranks torn down
after it. Its id is taken from the first anomaly that opened it, so it is stable for a given
stream of anomalies.

>>> from trainguard import events as ev
>>> def a(kind, ts, ranks=(), nodes=(), onset=None, **evidence):
...     return ev.Anomaly(job="j", ts=ts, id=f"{kind}-{ts:g}", kind=kind, severity="critical",
...                       ranks=list(ranks), nodes=list(nodes), onset_ts=onset or ts,
...                       detected_ts=ts, detector=kind, summary=f"{kind} at {ts:g}",
...                       evidence=evidence)
>>> c = Correlator()
>>> _ = c.add(a("gpu_fault", 100.0, [3], ["n1"]))
>>> _ = c.add(a("silent", 115.0, [3], onset=100.2, rank_nodes={"3": "n1"}))
>>> _ = c.add(a("hang", 125.0, onset=99.8))
>>> [(i["kind"], i["ranks"], i["nodes"], len(i["anomalies"])) for i in c.incidents()]
[('gpu_fault', [3], ['n1'], 3)]
>>> _ = c.add(a("nan", 1000.0, [1]))
>>> _ = c.add(a("hang", 1050.0, [2], onset=990.0))  # blamed on another rank: not the NaN's
>>> [i["kind"] for i in c.incidents()]
['gpu_fault', 'hang', 'nan']
>>> _ = c.add(a("hang", 1150.0, [2], onset=1100.0))  # progress after 1050: a new stall
>>> [i["kind"] for i in c.incidents()]
['gpu_fault', 'hang', 'nan', 'hang']
>>> _ = c.add(a("crash", 2000.0, [1]))
>>> _ = c.add(a("crash", 2020.0, [0]))               # one crash leads to the next
>>> c.relaunched("j", 2030.0)                        # the job was restarted
>>> _ = c.add(a("crash", 2050.0, [1]))               # a crash after that is a new problem
>>> [(i["kind"], len(i["anomalies"])) for i in c.incidents()][-2:]
[('crash', 2), ('crash', 1)]
"""
from __future__ import annotations

from dataclasses import dataclass

from trainguard.setting import setting

from .registry import consequences, priority, priority_ranks

__all__ = ["PRIORITY", "CONSEQUENCES", "Correlator", "summarize", "incident_id_of"]

#: Root-cause priority, most fundamental first: the kinds of the detectors' registrations
#: (``priority=``, :mod:`~trainguard.detectors.registry`) in the order of their numbers.
PRIORITY = priority()
_RANK = priority_ranks()    # kind -> place in PRIORITY, kept current as plug-ins register

ANY, SHARED, SAME_RANK = "any", "shared", "same_rank"
#: cause kind -> {consequence kind: ANY (anywhere in the job), SHARED (same rank or machine)
#: or SAME_RANK (same rank only)}: the detectors' registrations (``causes=``), kept current
#: as plug-ins register
CONSEQUENCES = consequences()

_SEVERITY = {"info": 0, "warning": 1, "critical": 2}


def _places(anomaly) -> tuple:
    nodes = set(anomaly.nodes)
    where = (anomaly.evidence or {}).get("rank_nodes") or {}
    nodes.update(n for n in where.values() if n)
    return set(anomaly.ranks), nodes


def _relation(cause, effect):
    return CONSEQUENCES.get(cause.kind, {}).get(effect.kind)


#: How much later than its effect's onset a cause may begin: hang and silent onsets are the
#: last progress seen, which precedes their cause by up to a step; other effects follow it.
CAUSE_LEAD_S = {"hang": 30.0, "silent": 30.0}
CAUSE_LEAD_DEFAULT_S = 10.0


def _precedes(cause, effect) -> bool:
    lead = CAUSE_LEAD_S.get(effect.kind, CAUSE_LEAD_DEFAULT_S)
    return cause.onset_ts <= effect.onset_ts + lead


#: A hang's onset is the job's last progress: one that begins more than this after an
#: incident was detected follows progress made since (not a step already in flight), so it is
#: a new incident.
PROGRESS_SLACK_S = 5.0


def _external(anomaly) -> bool:
    """The whole job stopped from outside (a restart, a preemption, Ctrl-C): the end of
    whatever came before, the cause of nothing; an incident of its own."""
    return anomaly.kind == "crash" and bool((anomaly.evidence or {}).get("external_stop"))


def _linked(x, y) -> bool:
    if _external(x) or _external(y):
        return False
    for cause, effect in ((x, y), (y, x)):
        how = _relation(cause, effect)
        if how is None or not _precedes(cause, effect):
            continue
        if how == ANY:
            return True
        if how in (SHARED, SAME_RANK):
            (r1, n1), (r2, n2) = _places(cause), _places(effect)
            if r1 & r2 or (how == SHARED and n1 & n2):
                return True
    return False


def incident_id_of(anomaly_id: str) -> str:
    """The id of the incident that an anomaly opens."""
    return "inc-" + anomaly_id


def _collateral(root) -> set:
    """Ranks the root finding names as its consequences (``evidence["collateral"]``, as the
    crash detector's vanished rank names the peers that failed after it): they do not join
    the incident's suspects."""
    named = (root.evidence or {}).get("collateral") if type(root.evidence) is dict else None
    if type(named) is not list:
        return set()
    return {r for r in named if type(r) is int} - set(root.ranks)


class _Incident:
    def __init__(self, anomaly):
        self.id = incident_id_of(anomaly.id)
        self.job = anomaly.job
        self.members = [anomaly]
        self.first = anomaly.onset_ts
        self.last = anomaly.detected_ts
        self.relaunched = None    # when ranks of the job started again after it, first

    def root(self):
        return min(self.members, key=lambda a: (_RANK.get(a.kind, len(_RANK)), a.onset_ts,
                                               a.detected_ts))

    def add(self, anomaly):
        self.members.append(anomaly)
        self.first = min(self.first, anomaly.onset_ts)
        self.last = max(self.last, anomaly.detected_ts)

    def to_dict(self, root_slack_s: float) -> dict:
        root = self.root()
        ranks, nodes = set(), set()
        collateral = _collateral(root)
        for m in self.members:
            if m.kind == root.kind and m.detected_ts <= root.onset_ts + root_slack_s:
                ranks.update(r for r in m.ranks if r not in collateral)
                nodes.update(m.nodes)
        ranks.update(root.ranks)
        nodes.update(root.nodes)
        others = sorted({m.kind for m in self.members if m is not root})
        extra = len(self.members) - 1
        summary = root.summary
        if extra:
            summary += f" (with {extra} related finding{'s' if extra > 1 else ''}: " \
                       f"{', '.join(others)})"
        step = root.step
        if step is None:
            stepped = [m for m in self.members if m.step is not None]
            nearest = min(stepped, key=lambda m: abs(m.onset_ts - root.onset_ts), default=None)
            step = nearest.step if nearest is not None else None
        return {"id": self.id, "kind": root.kind, "job": self.job, "ranks": sorted(ranks),
                "nodes": sorted(nodes), "step": step,
                "onset_ts": min(m.onset_ts for m in self.members),
                "detected_ts": min(m.detected_ts for m in self.members),
                "severity": max((m.severity for m in self.members), key=_SEVERITY.get),
                "summary": summary, "anomalies": [m.id for m in self.members]}


class Correlator:
    """Groups anomalies (``ev.Anomaly``) into incidents; see the module docstring.

    ``add`` returns the incident (as SPEC §4 dict) the anomaly now belongs to. An anomaly id
    already seen is ignored (returns its incident unchanged). Incidents idle for longer than
    ``window_s`` are closed: later anomalies open new ones; only the last ``keep_closed``
    closed incidents are kept (bounded memory in a long-running worker).
    """

    PREFIX = "correlate"

    @dataclass(kw_only=True)
    class Config:
        window_s: float = setting(180.0, "anomalies this close in time may share a root")
        root_slack_s: float = setting(2.0, "root-kind anomalies this close are co-suspects")

    def __init__(self, keep_closed: int = 1000, **settings):
        config = self.Config(**settings)
        self.window_s = config.window_s
        self.root_slack_s = config.root_slack_s
        self.keep_closed = keep_closed
        self._open: list = []
        self._closed: list = []
        self._by_anomaly: dict = {}

    def add(self, anomaly) -> dict:
        known = self._by_anomaly.get(anomaly.id)
        if known is not None:
            return known.to_dict(self.root_slack_s)
        horizon = anomaly.detected_ts - self.window_s
        still = []
        for inc in self._open:
            (still if inc.last >= horizon else self._closed).append(inc)
        self._open = still
        while len(self._closed) > self.keep_closed:
            for member in self._closed.pop(0).members:
                self._by_anomaly.pop(member.id, None)
        best = None
        for inc in self._open:
            if inc.job != anomaly.job:
                continue
            if anomaly.onset_ts > inc.last + self.window_s:
                continue
            if anomaly.detected_ts < inc.first - self.window_s:
                continue
            if anomaly.kind == "hang" and anomaly.onset_ts > inc.last + PROGRESS_SLACK_S:
                continue     # the job made progress after the incident: a new problem
            if inc.relaunched is not None and anomaly.onset_ts >= inc.relaunched:
                continue     # began after the job was relaunched: a new problem
            if not any(_linked(m, anomaly) for m in inc.members):
                continue
            if best is None or _RANK.get(inc.root().kind, 99) < _RANK.get(best.root().kind, 99):
                best = inc
        if best is None:
            best = _Incident(anomaly)
            self._open.append(best)
        else:
            best.add(anomaly)
        self._by_anomaly[anomaly.id] = best
        return best.to_dict(self.root_slack_s)

    def relaunched(self, job: str, ts: float) -> None:
        """Ranks of ``job`` started at ``ts`` (a restart, by ``trainguard run``, torchrun or
        a scheduler): whatever its open incidents detected until then were about was dealt
        with, so an anomaly that begins from ``ts`` on joins none of them (findings of the
        old problem that began before still do)."""
        for inc in self._open:
            if inc.job == job and inc.relaunched is None and inc.last <= ts:
                inc.relaunched = ts

    def incidents(self) -> list[dict]:
        """All incidents, open and closed, by onset time."""
        every = [inc.to_dict(self.root_slack_s) for inc in self._closed + self._open]
        return sorted(every, key=lambda i: (i["onset_ts"], i["id"]))


def summarize(incident_id: str, members: list, root_slack_s: float = 2.0) -> dict:
    """The incident dict (as :meth:`Correlator.add` returns) of ``members`` (anomalies of one
    job, in arrival order) grouped under ``incident_id``: its root kind, suspects, onset and
    summary, computed from the members alone. The action service summarises a worker's
    incident this way from the anomalies it received itself.

    >>> from trainguard import events as ev
    >>> def a(kind, ts, ranks):
    ...     return ev.Anomaly(job="j", ts=ts, id=f"{kind}-{ts:g}", kind=kind, severity="critical",
    ...                       ranks=ranks, nodes=[], onset_ts=ts, detected_ts=ts,
    ...                       detector=kind, summary=f"{kind} at {ts:g}")
    >>> i = summarize("inc-1", [a("hang", 10.0, []), a("crash", 9.0, [3])])
    >>> i["id"], i["kind"], i["ranks"], i["anomalies"]
    ('inc-1', 'crash', [3], ['hang-10', 'crash-9'])
    """
    incident = _Incident(members[0])
    incident.id = incident_id
    for member in members[1:]:
        incident.add(member)
    return incident.to_dict(root_slack_s)


# The settings class at module level, so that a snapshot may hold it (its allowlist is the
# classes of the detectors' modules).
CorrelateConfig = Correlator.Config
