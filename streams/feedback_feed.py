"""The worker learns from people's verdicts on incidents (issue 24): ``trainguard feedback``.

``trainguard feedback INCIDENT --false-alarm | --confirmed`` (and ``--reset``) writes one
``feedback`` event (:class:`trainguard.events.Feedback`) on ``<prefix>.orders``, signed as
orders are. :class:`FeedbackFeed` reads that topic on the job side's timer, as
:class:`~.false_alarms.FalseAlarmFeed` reads the action service's false alarms: nothing is
trusted, so with a signing key configured a feedback counts only when signed, fresh and not
a replay; a refused one is dead-lettered with its reason. The job's stage learns from it
(:mod:`trainguard.detectors.lessons`) and the worker records what it learned on
``<prefix>.actions`` (an ``action`` with ``code: "feedback"`` and ``targets.learned``, the
job's lessons as ``trainguard config show --job`` prints them). A feedback for a job with no
live stage on this worker is another worker's and is left.
"""
from __future__ import annotations

import logging

from trainguard import events as ev
from trainguard.deadletter import deadletter_record

from .feed_client import FeedClient

__all__ = ["FeedbackFeed", "FeedGroup", "AUDIT_CODE"]

log = logging.getLogger(__name__)
AUDIT_CODE = "feedback"


class FeedbackFeed(FeedClient):
    """See the module docstring. ``processor`` is the job side's ``JobProcessor``;
    ``verifier`` a :class:`~trainguard.signing.Verifier`; ``keys`` sign the audit records."""

    TOPIC = "orders"
    GROUP = "tg-feedback"

    def __init__(self, *, keys=None, **kw):
        super().__init__(**kw)
        self.keys = keys

    def handle(self, key, value, partition: int, offset: int) -> dict | None:
        """One record of the orders topic; what the job learned, or None."""
        if value is None or b'"feedback"' not in value:
            return None                   # orders and acks, without parsing them
        try:
            feedback = ev.decode(value)
        except ev.InvalidEvent as exc:
            if b'"type":"feedback"' in value.replace(b" ", b""):
                return self._refuse(key, value, partition, offset, f"malformed: {exc}")
            return None
        if not isinstance(feedback, ev.Feedback):
            return None
        refusal = self.verifier.check(value, feedback.feedback_id)
        if refusal is not None:
            return self._refuse(key, value, partition, offset, str(refusal))
        job = feedback.job.encode()
        slot = self.processor.state.slots.get(job)
        if slot is None or not hasattr(slot.stage, "note_feedback"):
            return None                   # another worker's job, or an evicted one
        try:
            learned = slot.stage.note_feedback(feedback.verdict, feedback.incident,
                                               feedback.kind, feedback.ts)
        except LookupError as exc:
            return self._refuse(key, value, partition, offset, f"unknown_incident: {exc}")
        self.processor.state.dirty.add(job)
        self.learned += 1
        self._count("feedback_learned")
        log.info("job %s: %s on incident %s (%s): %s", feedback.job, feedback.verdict,
                 feedback.incident, learned["kind"], learned["changes"] or "nothing widened")
        self._audit(feedback, learned, slot.stage.lessons.summary())
        return learned

    def _audit(self, feedback, learned: dict, summary: dict) -> None:
        from trainguard.signing import sign

        changes = ", ".join(f"{k} {v[0]} -> {v[1]}" for k, v in learned["changes"].items())
        action = ev.Action(
            job=feedback.job, ts=self.clock(), incident=feedback.incident or "-",
            action="none", status="done",
            reason=f"feedback: {feedback.verdict} ({learned['kind'] or 'all'}) from "
                   f"{feedback.by or '?'}; " + (changes or "nothing widened"),
            targets={"job": feedback.job, "feedback": {
                "verdict": feedback.verdict, "kind": learned["kind"],
                "changes": learned["changes"]}, "learned": summary},
            extra={"code": AUDIT_CODE, "feedback_id": feedback.feedback_id})
        self._produce(self.topics.actions, feedback.job.encode(),
                      ev.encode(sign(action, self.keys)))

    def _refuse(self, key, value, partition, offset, reason: str) -> None:
        self.refused += 1
        self._count("feedback_refused")
        log.warning("feedback at %s/%d refused: %s", partition, offset, reason)
        self._produce(self.topics.deadletter, key, deadletter_record(
            reason=f"feedback refused: {reason}", topic=self.topics.orders,
            partition=partition, offset=offset, key=key, raw=value, ts=self.clock()))
        return None


class FeedGroup:
    """Feeds polled and closed together on the job side's timer."""

    def __init__(self, *feeds):
        self.feeds = [f for f in feeds if f is not None]

    def poll(self) -> int:
        return sum(f.poll() for f in self.feeds)

    def close(self) -> None:
        for f in self.feeds:
            f.close()

    def __getattr__(self, name):          # counters and handle() of the first feed
        return getattr(self.__dict__["feeds"][0], name)
