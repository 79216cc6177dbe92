"""Which telemetry partitions the rank side cannot read now: their leader is unknown, or its
broker is not connected (librdkafka's statistics, every second).

A broker that dies takes the partitions it leads with it until the cluster has elected new
leaders and the clients have learned them (Kafka fences a dead broker after
``broker.session.timeout.ms``, 9 s by default). Meanwhile the collectors' records for those
partitions wait in their producers (up to ``message.timeout.ms``, 15 s) and then arrive
late, in order. The rank side does not say that it reads such a partition
(:class:`~trainguard.streams.logic.Reading`), so the job side waits for it and does not
take its ranks' silence for theirs (:class:`~trainguard.streams.partition_watch.
PartitionWatch`), as for a partition whose worker is gone. Said to read it, the job side
went on without its ranks, and a fail-over of 11 to 15 s named healthy ranks ``silent``
(``tests/test_unread_partitions.py``).

>>> stats = {"brokers": {
...     "kafka-1:9092/1": {"nodeid": 1, "source": "learned", "state": "UP"},
...     "kafka-2:9092/2": {"nodeid": 2, "source": "learned", "state": "TRY_CONNECT"},
...     "GroupCoordinator": {"nodeid": -1, "source": "logical", "state": "UP"}},
...   "topics": {"tg.telemetry": {"partitions": {
...     "0": {"partition": 0, "leader": 1, "desired": True},
...     "1": {"partition": 1, "leader": 2, "desired": True},
...     "2": {"partition": 2, "leader": -1, "desired": True},
...     "3": {"partition": 3, "leader": 2, "desired": False},
...     "-1": {"partition": -1, "leader": -1, "desired": False}}}}}
>>> sorted(unreadable_partitions(stats, "tg.telemetry"))
[1, 2]
>>> watch = LeaderWatch("tg.telemetry")
>>> watch.on_stats('{"brokers": {}, "topics": {}}'), watch.unreadable
(None, frozenset())
>>> watch.on_stats("not json"), watch.unreadable, watch.bad_stats
(None, frozenset(), 1)
"""
from __future__ import annotations

import logging

import orjson

__all__ = ["LeaderWatch", "STATS_INTERVAL_MS", "unreadable_partitions"]

log = logging.getLogger(__name__)

#: how often librdkafka hands the rank side's consumer its statistics
STATS_INTERVAL_MS = 1000


def unreadable_partitions(stats: dict, topic: str) -> frozenset:
    """The partitions of ``topic`` that this consumer wants (``desired``) whose leader is
    unknown (-1) or not a broker it is connected to (``state`` ``UP``)."""
    brokers = stats.get("brokers")
    up = {b.get("nodeid") for b in brokers.values()
          if type(b) is dict and b.get("state") == "UP" and b.get("source") != "logical"} \
        if type(brokers) is dict else set()
    topics = stats.get("topics")
    info = topics.get(topic) if type(topics) is dict else None
    parts = info.get("partitions") if type(info) is dict else None
    if type(parts) is not dict:
        return frozenset()
    out = set()
    for p in parts.values():
        if type(p) is not dict or not p.get("desired"):
            continue
        number, leader = p.get("partition"), p.get("leader")
        if type(number) is int and number >= 0 and (type(leader) is not int or leader < 0
                                                    or leader not in up):
            out.add(number)
    return frozenset(out)


class LeaderWatch:
    """The consumer's ``stats_cb``: keeps :attr:`unreadable`, the latest
    :func:`unreadable_partitions` of ``topic``, and logs when it changes."""

    def __init__(self, topic: str):
        self.topic = topic
        self.unreadable: frozenset = frozenset()
        self.bad_stats = 0

    def on_stats(self, text) -> None:
        try:
            stats = orjson.loads(text)
        except (orjson.JSONDecodeError, TypeError):
            self.bad_stats += 1
            return
        now = unreadable_partitions(stats, self.topic) if type(stats) is dict else frozenset()
        if now != self.unreadable:
            if now:
                log.warning("telemetry partition(s) %s cannot be read now (no connected "
                            "leader): the jobs on them wait for them", sorted(now))
            else:
                log.info("every telemetry partition can be read again")
            self.unreadable = now
