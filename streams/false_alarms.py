"""The worker learns from the action service's false alarms (issue 10, point 6).

When the action service finds that a reported hang was none (the job moved on before any
restart, ``actions/confirm.py``), it writes one ``action`` record on ``<prefix>.actions``
with ``code: "false_alarm"`` and the marker ``targets.false_alarm`` (``kind``, ``phase``,
``stalled_s``). :class:`FalseAlarmFeed` reads those records on the job side's timer and
calls the job stage's ``note_false_alarm(phase, stalled_s)``: the hang detector widens that
phase's allowance (or, between steps, its step timeout), so the same pause is not reported
again.

Nothing read from Kafka is trusted: with a signing key configured a record counts only when
the action service signed it (and is fresh and not a replay, as orders are); the marker is
checked (a hang, a phase name of at most 64 characters or null, ``0 < stalled_s <=``
:data:`MAX_STALLED_S`). A refused record is dead-lettered with its reason. A record for a job
that has no live stage on this worker is another worker's (or an evicted job's) and is left.

The feed reads from the topic's end at start: a false alarm written while no worker ran is
not learned (the detector's own history still carries what it saw).
"""
from __future__ import annotations

import logging
import math

from trainguard import events as ev
from trainguard.deadletter import deadletter_record

from .feed_client import FeedClient

__all__ = ["FalseAlarmFeed", "learned_from", "MAX_STALLED_S"]

log = logging.getLogger(__name__)
#: the longest stall a false alarm may teach (a day): a forged or broken record cannot
#: switch hang detection off for good
MAX_STALLED_S = 86400.0


def learned_from(action) -> tuple | None:
    """``(phase, stalled_s)`` to learn from an ``ev.Action``, None when it is no false alarm;
    raises ``ValueError`` for a false alarm whose marker is not acceptable.

    >>> a = ev.Action(job="j", ts=1.0, incident="i", action="none", status="rate_limited",
    ...               reason="false_alarm: ...", targets={"false_alarm": {
    ...                   "kind": "hang", "phase": "checkpoint", "stalled_s": 52.0}},
    ...               extra={"code": "false_alarm"})
    >>> learned_from(a)
    ('checkpoint', 52.0)
    >>> learned_from(a.replace(targets={"false_alarm": {"kind": "hang", "stalled_s": 1e9}}))
    Traceback (most recent call last):
    ...
    ValueError: stalled_s 1000000000.0 is not in (0, 86400]
    """
    if (action.extra or {}).get("code") != "false_alarm":
        return None
    marker = (action.targets or {}).get("false_alarm")
    if type(marker) is not dict:
        raise ValueError("no false_alarm marker in targets")
    if marker.get("kind") != "hang":
        return None                     # silent ranks heard again: nothing to widen
    phase, stalled = marker.get("phase"), marker.get("stalled_s")
    if phase is not None and (type(phase) is not str or not 0 < len(phase) <= 64):
        raise ValueError(f"phase {str(phase)[:80]!r} is not a phase name")
    if type(stalled) not in (int, float) or not math.isfinite(stalled) \
            or not 0 < stalled <= MAX_STALLED_S:
        raise ValueError(f"stalled_s {stalled!r} is not in (0, {MAX_STALLED_S:.0f}]")
    return phase, float(stalled)


class FalseAlarmFeed(FeedClient):
    """See the module docstring. ``processor`` is the job side's ``JobProcessor``;
    ``verifier`` a :class:`~trainguard.signing.Verifier`."""

    TOPIC = "actions"
    GROUP = "tg-false-alarms"

    def handle(self, key, value, partition: int, offset: int) -> bool:
        """One record of the actions topic; True when a job stage learned from it."""
        if value is None or b"false_alarm" not in value:
            return False                  # the common case, without parsing it
        try:
            action = ev.decode(value)
        except ev.InvalidEvent:
            return False                  # not this reader's to judge
        if not isinstance(action, ev.Action):
            return False
        try:
            learned = learned_from(action)
        except ValueError as exc:
            return self._refuse(key, value, partition, offset, f"bad marker: {exc}")
        if learned is None:
            return False
        refusal = self.verifier.check(value, (action.extra or {}).get("action_id")
                                      or f"{partition}/{offset}")
        if refusal is not None:
            return self._refuse(key, value, partition, offset, str(refusal))
        slot = self.processor.state.slots.get(action.job.encode())
        if slot is None or not hasattr(slot.stage, "note_false_alarm"):
            return False                  # another worker's job, or an evicted one
        slot.stage.note_false_alarm(*learned)
        self.processor.state.dirty.add(action.job.encode())
        self.learned += 1
        self._count("false_alarms_learned")
        log.info("job %s: learned from a false alarm (phase %s, %.0fs stalled)", action.job,
                 learned[0], learned[1])
        return True

    def _refuse(self, key, value, partition, offset, reason: str) -> bool:
        self.refused += 1
        self._count("false_alarms_refused")
        log.warning("false-alarm record at %s/%d refused: %s", partition, offset, reason)
        record = deadletter_record(reason=f"false alarm refused: {reason}",
                                   topic=self.topics.actions, partition=partition,
                                   offset=offset, key=key, raw=value, ts=self.clock())
        self._produce(self.topics.deadletter, key, record)
        return False
