"""The action service's end of the control channel: it sends the orders and files the acks.

:meth:`OrderDesk.prepare` turns a planned job decision into a signed
:class:`~trainguard.events.Order` and gives the decision its ``order_id``;
:meth:`OrderDesk.dispatch` sends it to the orders topic once the decision is on the audit
log, so that an outcome is never recorded before its decision. :meth:`OrderDesk.receive` takes every
message of that topic: an ack of an order it sent is checked (with a signing key: signed by
it), its outcome recorded on the audit log (an ``action`` record with extra ``order_id``,
``ack_status`` and ``code``), and an ``already_satisfied`` restart is told to the
:class:`~trainguard.actions.capture.JobDirectory`. :meth:`OrderDesk.expire` records
orders nobody acked in time as ``failed`` (code ``no_ack``). Thread-safe: ``prepare`` and
``dispatch`` run in the pipeline's thread, ``receive`` and ``expire`` in the watcher's.

>>> from types import SimpleNamespace
>>> from trainguard.actions.model import Decision, Incident
>>> sent, audit = [], []
>>> recorder = SimpleNamespace(write=audit.append, flush=lambda: None)   # the audit log
>>> desk = OrderDesk(send=sent.append, recorder=recorder, clock=lambda: 100.0)
>>> inc = Incident(id="inc-a1", job="j1", kind="crash", severity="critical", ranks=[1],
...                nodes=["n1"], onset_ts=90.0, detected_ts=95.0, summary="rank 1 exited")
>>> d = desk.prepare(Decision(action="restart", reason="crash", targets={"job": "j1",
...                  "onset_ts": 90.0, "exclude_nodes": []}), inc)
>>> desk.dispatch([d])
1
>>> d.status, d.order_id == sent[0].order_id, sent[0].op, sent[0].targets
('planned', True, 'restart', {'exclude_nodes': [], 'onset_ts': 90.0})
>>> from trainguard.actions.orders import ack_of
>>> ack = ack_of(sent[0], "failed", "budget_exhausted", "all 3 restarts are spent", ts=101.0)
>>> desk.receive(ack, ev.encode(ack))
('filed', None)
>>> [(a.action, a.status, a.extra["ack_status"], a.extra["code"]) for a in audit]
[('restart', 'rate_limited', 'failed', 'budget_exhausted')]
>>> desk.receive(ack, ev.encode(ack))                    # the first ack of an order counts
('duplicate', None)
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import replace
from typing import Callable

from trainguard import events as ev
from trainguard.actions.model import RELAUNCHES
from trainguard.actions.orders import InvalidTarget, order_of, outcome_status
from trainguard.logs import context as log_context
from trainguard.signing import Refusal, SigningKeys, Verifier, sign

__all__ = ["OrderDesk", "DEFAULT_ACK_TIMEOUT_S"]

DEFAULT_ACK_TIMEOUT_S = 120.0


class OrderDesk:
    """``send(order_event)`` writes to the orders topic; ``recorder`` (``write``/``flush``)
    is the audit log; ``directory`` learns the ``already_satisfied`` restarts."""

    def __init__(self, *, send: Callable[[ev.Order], None], recorder, directory=None,
                 keys: SigningKeys | None = None, ack_timeout_s: float = DEFAULT_ACK_TIMEOUT_S,
                 clock: Callable[[], float] = time.time, log: Callable[[str], None] = None,
                 remember: int = 10_000):
        self._send = send
        self.recorder = recorder
        self.directory = directory
        self.keys = keys
        self.verifier = Verifier(keys, clock=clock)
        self.ack_timeout_s = ack_timeout_s
        self.clock = clock
        self.log = log or (lambda message: None)
        self.remember = remember
        self._orders: OrderedDict = OrderedDict()  # order_id -> {"order", "sent", "acked"}
        self._outbox: dict = {}  # order_id -> order, prepared and not sent yet
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ sending
    def prepare(self, decision, incident):
        """The order of a planned decision, kept until :meth:`dispatch`; returns the decision
        with its ``order_id`` (still ``planned``), or ``failed`` when its targets would be
        refused."""
        try:
            order = order_of(decision, incident, ts=self.clock())
        except InvalidTarget as exc:
            return decision.with_status("failed", f"invalid_target: not ordered: {exc}",
                                        "invalid_target")
        with self._lock:
            self._outbox[order.order_id] = order
        return replace(decision, order_id=order.order_id)

    def dispatch(self, decisions) -> int:
        """Sign and send the prepared orders of ``decisions`` (stamped now); returns how many
        went out. One that cannot be sent is recorded ``failed`` (``order_error``)."""
        count = 0
        for decision in decisions:
            with self._lock:
                order = self._outbox.pop(decision.order_id, None) if decision.order_id else None
            if order is None:
                continue
            now = self.clock()
            order = sign(order.replace(ts=now), self.keys)
            self._track(order, now)
            try:
                self._send(order)
                count += 1
            except Exception as exc:  # Kafka trouble: say so, and expect no ack
                with self._lock:
                    self._orders[order.order_id]["acked"] = True
                self._record(order, "failed", f"order_error: {type(exc).__name__}: {exc}",
                             "order_error", None)
        return count

    def _track(self, order: ev.Order, sent: float, acked: bool = False) -> None:
        with self._lock:
            self._orders[order.order_id] = {"order": order, "sent": sent, "acked": acked}
            while len(self._orders) > self.remember:
                self._orders.popitem(last=False)

    def seed(self, action: ev.Action) -> None:
        """Learn the orders of an earlier run of the service from its audit records (read
        back at start-up), so that their acks are still filed, and filed once."""
        extra = action.extra or {}
        order_id = extra.get("order_id")
        if extra.get("source") != "actions" or type(order_id) is not str \
                or action.action not in ev.ORDER_OPS:
            return
        with self._lock:
            known = self._orders.get(order_id)
        if "ack_status" in extra or extra.get("code") == "no_ack":
            if known is not None:
                known["acked"] = True
            else:
                self._track(self._order_from(action, order_id), action.ts, acked=True)
        elif action.status == "planned" and known is None:  # its ack may be read back yet:
            self._track(self._order_from(action, order_id), self.clock())  # time from now

    @staticmethod
    def _order_from(action: ev.Action, order_id: str) -> ev.Order:
        return ev.Order(job=action.job, ts=action.ts, order_id=order_id, op=action.action,
                        targets=dict(action.targets or {}), incident=action.incident)

    # ------------------------------------------------------------------ acks
    def receive(self, event: ev.Event, raw: bytes) -> tuple[str, Refusal | None]:
        """File one message of the orders topic; returns what became of it: ``order`` (not an
        ack), ``unknown`` (an ack of an order this service did not send), ``refused`` with
        the :class:`~trainguard.signing.Refusal` (a bad signature: the caller dead-letters
        it), ``duplicate`` or ``filed``."""
        if not isinstance(event, ev.Ack):
            return "order", None
        with self._lock:
            entry = self._orders.get(event.order_id)
        if entry is None:
            return "unknown", None
        order = entry["order"]
        if event.job != order.job or (event.op is not None and event.op != order.op):
            return "unknown", None
        refusal = self.verifier.check_signature(raw)
        if refusal is not None:
            return "refused", refusal
        with self._lock:
            if entry["acked"]:
                return "duplicate", None
            entry["acked"] = True
        if event.status == "already_satisfied" and order.op in RELAUNCHES \
                and self.directory is not None and order.incident:
            self.directory.note_satisfied(order.job, order.incident)
        self._record(order, outcome_status(event), event.reason, event.code, event.status,
                     node=event.node)
        with log_context(job=order.job, incident=order.incident):
            self.log(f"{order.op} order {order.order_id} (incident {order.incident}): "
                     f"{event.status}{f' ({event.code})' if event.code else ''}: "
                     f"{event.reason}")
        return "filed", None

    def expire(self) -> int:
        """Record the orders not acked within ``ack_timeout_s`` as failed; returns how many."""
        now = self.clock()
        with self._lock:
            late = [e for e in self._orders.values()
                    if not e["acked"] and now - e["sent"] > self.ack_timeout_s]
            for entry in late:
                entry["acked"] = True
        for entry in late:
            order = entry["order"]
            self._record(order, "failed", (
                f"no_ack: no answer to the {order.op} order within {self.ack_timeout_s:g}s "
                f"(is the job running under `trainguard run`, with the same signing key?)"),
                "no_ack", None)
        return len(late)

    def _record(self, order: ev.Order, status: str, reason: str, code: str | None,
                ack_status: str | None, node: str | None = None) -> None:
        extra = {"action_id": f"{order.incident or order.order_id}:{order.op}",
                 "source": "actions", "order_id": order.order_id}
        if ack_status is not None:
            extra["ack_status"] = ack_status
        if code is not None:
            extra["code"] = code
        self.recorder.write(ev.Action(job=order.job, ts=self.clock(), node=node,
                                      incident=order.incident or order.order_id,
                                      action=order.op if order.op in ev.ACTIONS else "none",
                                      targets=dict(order.targets), status=status,
                                      reason=reason, extra=extra))
        self.recorder.flush()
