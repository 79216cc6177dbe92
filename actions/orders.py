"""The typed control channel (SPEC §6): orders on ``<prefix>.orders``, their acks, and the
checks every target passes before it is used.

The action service turns a planned job action into an :class:`~trainguard.events.Order`
(:func:`order_of`); ``trainguard run`` answers each with an :class:`~trainguard.events.Ack`
whose ``status`` (and ``code``) say what became of it; the service records that outcome on
the audit log (:func:`outcome_status`). No program reads a ``reason``: it is for humans.

An order's targets are typed per operation (:class:`RestartTargets`,
:class:`RollbackTargets`, :class:`EvictTargets`, :class:`StopTargets`; :data:`TARGETS` by
op); on the wire they are the JSON object of SPEC §6 (:meth:`~RestartTargets.to_wire`).
Targets come over the network, so they are checked against what a scheduler accepts
(:func:`targets_of`, :func:`check_targets` for the wire's dict) before anything reaches an
environment variable or a command line:

>>> targets_of("rollback", {"rollback_step": 120, "exclude_nodes": ["n1"], "job": "j1"})
RollbackTargets(exclude_nodes=('n1',), onset_ts=None, ranks=(), rollback_step=120)

>>> check_targets("evict", {"nodes": ["gpu-node-07", "n1.rack2"], "job": "j1"})
{'nodes': ['gpu-node-07', 'n1.rack2'], 'exclude_nodes': ['gpu-node-07', 'n1.rack2']}
>>> check_targets("rollback", {"rollback_step": 120, "onset_ts": 1764680000.5})
{'exclude_nodes': [], 'onset_ts': 1764680000.5, 'rollback_step': 120}
>>> check_targets("restart", {"exclude_nodes": ["$(touch /tmp/x)", "--help"]})
Traceback (most recent call last):
...
trainguard.actions.orders.InvalidTarget: exclude_nodes[0]: '$(touch /tmp/x)' is not a node name (1-253 of letters, digits, '-', '_', '.', starting with a letter or digit)
>>> check_targets("rollback", {"rollback_step": 2**62})
Traceback (most recent call last):
...
trainguard.actions.orders.InvalidTarget: rollback_step: 4611686018427387904 is above the maximum 1000000000000
"""
from __future__ import annotations

import math
import re
import uuid
from dataclasses import dataclass
from typing import ClassVar

from trainguard import events as ev
from trainguard.actions.model import JOB_ACTIONS
from trainguard.fields import Int, InvalidEvent

__all__ = ["InvalidTarget", "check_targets", "check_nodes", "order_of", "new_order_id",
           "outcome_status", "ack_of", "NODE_NAME", "MAX_NODES", "ACK_CODES", "JOB_OPS",
           "RestartTargets", "RollbackTargets", "EvictTargets", "StopTargets", "TARGETS",
           "targets_of", "order_targets"]

#: a scheduler's node name: Slurm and Kubernetes both accept these (Kubernetes: a DNS
#: subdomain, at most 253 characters); nothing that a shell or an option parser would read
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
NODE_HINT = "1-253 of letters, digits, '-', '_', '.', starting with a letter or digit"
MAX_NODES = 512
MAX_STEP = 10**12
MAX_RANK = 10**7
MAX_RANKS = 4096
STEP = Int(minimum=0, maximum=MAX_STEP)
JOB_OPS = JOB_ACTIONS
#: the ``code`` of an ack, by status (a program decides on these, never on ``reason``)
ACK_CODES = {
    "done": ("relaunched", "restarted_in_place", "excluded", "stopping"),
    "already_satisfied": ("relaunched_since_onset", "restarted_in_place", "incident_restarted",
                          "already_excluded"),
    "failed": ("budget_exhausted", "launch_failed"),
    "not_applicable": ("unsupported_op", "cannot_exclude"),
    "rejected": ("unsigned", "unknown_key", "bad_signature", "stale", "future", "replayed",
                 "malformed", "invalid_target"),
}


class InvalidTarget(ValueError):
    """An order's target that will not be used; the message names it and why."""


def _distinct(value, path: str, what: str, limit: int, valid, hint: str) -> list:
    """The distinct items of list ``value`` in order, each ``valid``, at most ``limit``;
    ``what``: the items' name (plural ``what + "s"``)."""
    if value is None:
        return []
    if type(value) is not list:
        raise InvalidTarget(f"{path}: expected a list of {what}s, got {type(value).__name__}")
    if len(value) > limit:
        raise InvalidTarget(f"{path}: {len(value)} {what.split()[0]}s, more than {limit}")
    out: list = []
    for i, item in enumerate(value):
        if not valid(item):
            shown = repr(item) if len(repr(item)) <= 60 else repr(item)[:57] + "..."
            raise InvalidTarget(f"{path}[{i}]: {shown} is not a {what} ({hint})")
        out.append(item)
    return list(dict.fromkeys(out))


def check_nodes(value, path: str) -> list[str]:
    """Distinct node names in order, each matching :data:`NODE_NAME`, at most
    :data:`MAX_NODES` of them."""
    return _distinct(value, path, "node name", MAX_NODES,
                     lambda name: type(name) is str and NODE_NAME.fullmatch(name), NODE_HINT)


def check_ranks(value, path: str) -> list[int]:
    """Distinct ranks in order, each an int from 0 to :data:`MAX_RANK`, at most
    :data:`MAX_RANKS` of them."""
    return _distinct(value, path, "rank", MAX_RANKS,
                     lambda rank: type(rank) is int and 0 <= rank <= MAX_RANK,
                     f"an integer from 0 to {MAX_RANK}")


def _step(value, path: str) -> int | None:
    if value is None:
        return None
    try:
        return STEP.check(value, path)
    except InvalidEvent as exc:
        raise InvalidTarget(str(exc)) from None


def _onset(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise InvalidTarget(f"onset_ts: {value!r} is not a Unix time")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class RestartTargets:
    """A restart: keep the job off ``exclude_nodes``; ``onset_ts``, when the incident began
    (a launch since then already answers the order); ``ranks``, the ranks the incident names
    (``trainguard run --standby`` replaces only their processes, in place)."""

    OP: ClassVar[str] = "restart"
    exclude_nodes: tuple = ()
    onset_ts: float | None = None
    ranks: tuple = ()

    @classmethod
    def check(cls, targets: dict) -> "RestartTargets":
        return cls(exclude_nodes=tuple(check_nodes(targets.get("exclude_nodes"),
                                                   "exclude_nodes")),
                   onset_ts=_onset(targets.get("onset_ts")),
                   ranks=tuple(check_ranks(targets.get("ranks"), "ranks")))

    def to_wire(self) -> dict:
        out: dict = {"exclude_nodes": list(self.exclude_nodes)}
        if self.onset_ts is not None:
            out["onset_ts"] = self.onset_ts
        if self.ranks:
            out["ranks"] = list(self.ranks)
        return out


@dataclass(frozen=True, kw_only=True)
class RollbackTargets(RestartTargets):
    """A restart from the newest checkpoint at or before ``rollback_step`` (None: unknown,
    the latest)."""

    OP: ClassVar[str] = "rollback"
    rollback_step: int | None = None

    @classmethod
    def check(cls, targets: dict) -> "RollbackTargets":
        base = RestartTargets.check(targets)
        return cls(exclude_nodes=base.exclude_nodes, onset_ts=base.onset_ts, ranks=base.ranks,
                   rollback_step=_step(targets.get("rollback_step"), "rollback_step"))

    def to_wire(self) -> dict:
        return {**super().to_wire(), "rollback_step": self.rollback_step}


@dataclass(frozen=True, kw_only=True)
class EvictTargets:
    """Evict ``nodes``; ``exclude_nodes`` (those and the ones excluded before) stay off the
    job's next launch."""

    OP: ClassVar[str] = "evict"
    nodes: tuple = ()
    exclude_nodes: tuple = ()

    @classmethod
    def check(cls, targets: dict) -> "EvictTargets":
        nodes = check_nodes(targets.get("nodes"), "nodes")
        exclude = check_nodes(targets.get("exclude_nodes"), "exclude_nodes")
        return cls(nodes=tuple(nodes), exclude_nodes=tuple(dict.fromkeys([*exclude, *nodes])))

    def to_wire(self) -> dict:
        return {"nodes": list(self.nodes), "exclude_nodes": list(self.exclude_nodes)}


@dataclass(frozen=True, kw_only=True)
class StopTargets:
    """A stop takes no targets (a malformed ``exclude_nodes`` is still refused)."""

    OP: ClassVar[str] = "stop"

    @classmethod
    def check(cls, targets: dict) -> "StopTargets":
        check_nodes(targets.get("exclude_nodes"), "exclude_nodes")
        return cls()

    def to_wire(self) -> dict:
        return {}


#: the targets of each order op (SPEC §6 ``order.op``)
TARGETS = {t.OP: t for t in (RestartTargets, RollbackTargets, EvictTargets, StopTargets)}
assert set(TARGETS) == set(ev.ORDER_OPS) and set(JOB_OPS) <= set(TARGETS)


def targets_of(op: str, targets):
    """The typed targets of an order of ``op``, checked and reduced to what ``op`` uses:
    ``nodes`` (evict), ``exclude_nodes`` (every job op; an eviction's nodes are excluded
    too), ``onset_ts``, ``ranks`` and ``rollback_step`` (restart, rollback). Anything else
    is left out.
    Raises :class:`InvalidTarget`."""
    if type(targets) is not dict:
        raise InvalidTarget("targets: expected an object")
    return TARGETS.get(op, StopTargets).check(targets)


def check_targets(op: str, targets) -> dict:
    """:func:`targets_of` as the wire's JSON object (what ``trainguard run`` reads)."""
    return targets_of(op, targets).to_wire()


def order_targets(order: ev.Order):
    """The typed targets of an order event (:func:`targets_of` of its op)."""
    return targets_of(order.op, order.targets)


def new_order_id() -> str:
    return f"o-{uuid.uuid4().hex}"


def order_of(decision, incident, ts: float, order_id: str | None = None) -> ev.Order:
    """The order carrying out a planned job decision (``restart``, ``evict``, ``rollback``).
    Raises :class:`InvalidTarget` when its targets would be refused anyway."""
    targets = targets_of(decision.action, dict(decision.targets))
    return ev.Order(job=incident.job, ts=ts, order_id=order_id or new_order_id(),
                    op=decision.action, targets=targets.to_wire(), incident=incident.id)


def ack_of(order: ev.Order, status: str, code: str | None, reason: str, ts: float,
           node: str | None = None) -> ev.Ack:
    """The answer to ``order``."""
    return ev.Ack(job=order.job, ts=ts, node=node, order_id=order.order_id, status=status,
                  code=code, reason=reason, op=order.op, incident=order.incident)


def outcome_status(ack: ev.Ack) -> str:
    """The ``action`` status an ack's outcome is recorded with.

    >>> a = ev.Ack(job="j", ts=1.0, order_id="o", status="failed", code="budget_exhausted",
    ...            reason="all 3 restarts of --max-restarts are spent")
    >>> outcome_status(a), outcome_status(a.replace(code="launch_failed"))
    ('rate_limited', 'failed')
    >>> outcome_status(a.replace(status="already_satisfied", code="relaunched_since_onset"))
    'done'
    >>> outcome_status(a.replace(status="not_applicable", code="cannot_exclude"))
    'not_applicable'
    """
    if ack.status in ("done", "already_satisfied"):
        return "done"  # the job is in the state the order asked for
    if ack.status == "not_applicable" and ack.code == "cannot_exclude":
        return "not_applicable"  # nothing to change where the job runs: not a failure
    if ack.status == "failed" and ack.code == "budget_exhausted":
        return "rate_limited"
    return "failed"
