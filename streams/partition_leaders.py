"""Which telemetry partitions the rank side cannot read now: the broker it fetches each from
(its leader, or the replica it was sent to) is unknown, not connected, or not answering
(librdkafka's statistics, every second).

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

A partition is held back :data:`RETURN_GRACE_S` more after it can be read again: the
producers learn the new leader on their own schedule (a retry waits up to
``retry.backoff.max.ms``, 1 s), and until their held records land, the partition looks read
to the end. It is held back :data:`MOST_S` at most in all: by then its producers have
dropped what they held, waiting longer recovers nothing, and the jobs on it go on (a
partition with no leader for minutes shows its ranks as silent, as before).

>>> stats = {"brokers": {
...     "kafka-1:9092/1": {"nodeid": 1, "source": "learned", "state": "UP"},
...     "kafka-2:9092/2": {"nodeid": 2, "source": "learned", "state": "TRY_CONNECT"},
...     "kafka-3:9092/3": {"nodeid": 3, "source": "learned", "state": "INIT"},
...     "GroupCoordinator": {"nodeid": -1, "source": "logical", "state": "UP"}},
...   "topics": {"tg.telemetry": {"partitions": {
...     "0": {"partition": 0, "leader": 1, "broker": 1, "desired": True},
...     "1": {"partition": 1, "leader": 2, "broker": 2, "desired": True},
...     "2": {"partition": 2, "leader": -1, "broker": -1, "desired": True},
...     "3": {"partition": 3, "leader": 2, "broker": 2, "desired": False},
...     "4": {"partition": 4, "leader": 3, "broker": 1, "desired": True},
...     "-1": {"partition": -1, "leader": -1, "desired": False}}}}}
>>> sorted(unreadable_partitions(stats, "tg.telemetry"))
[1, 2]

Partition 4 is fetched from a follower (``client.rack``): its leader's connection does not
matter. Held back after it returns, and not forever:

>>> now = [100.0]
>>> watch = LeaderWatch("tg.telemetry", clock=lambda: now[0])
>>> import json
>>> watch.on_stats(json.dumps(stats)); sorted(watch.unreadable())
[1, 2]
>>> stats["brokers"]["kafka-2:9092/2"]["state"] = "UP"
>>> now[0] = 101.0; watch.on_stats(json.dumps(stats)); sorted(watch.unreadable())
[1, 2]
>>> now[0] = 101.0 + RETURN_GRACE_S; sorted(watch.unreadable())
[2]
>>> now[0] = 100.0 + MOST_S; sorted(watch.unreadable())
[]
>>> watch.on_stats("not json"), watch.bad_stats
(None, 1)

A broker that stopped answering (its machine frozen, its packets dropped) is still
connected until the consumer's ``socket.timeout.ms``: one that had requests waiting at every
statistics for :data:`UNANSWERED_S` and received nothing meanwhile is left out too:

>>> stats["brokers"]["kafka-1:9092/1"].update(waitresp_cnt=1, rx=40)
>>> for t in (200, 203, 205):                  # the statistics' ts, in µs
...     stats["ts"] = t * 10**6; watch.on_stats(json.dumps(stats)); print(t, sorted(watch.current))
200 [2]
203 [2]
205 [0, 2, 4]
>>> stats["brokers"]["kafka-1:9092/1"].update(rx=41)               # it answered
>>> stats["ts"] = 206 * 10**6; watch.on_stats(json.dumps(stats)); sorted(watch.current)
[2]
"""
from __future__ import annotations

import logging
import time

import orjson

__all__ = ["LeaderWatch", "MOST_S", "RETURN_GRACE_S", "STATS_INTERVAL_MS", "UNANSWERED_S",
           "unreadable_partitions"]

log = logging.getLogger(__name__)

#: how often librdkafka hands the rank side's consumer its statistics
STATS_INTERVAL_MS = 1000
#: a partition that can be read again is held back this much more (wall s)
RETURN_GRACE_S = 3.0
#: ... and this long at most in all: the collectors' ``message.timeout.ms`` (15 s) and more
MOST_S = 30.0
#: librdkafka's broker states in which requests go out (``rd_kafka_broker_state_is_up``)
_UP_STATES = frozenset(("UP", "UPDATE", "REAUTH"))
#: a connected broker that had requests waiting for an answer at every statistics for this
#: long, and received nothing meanwhile, is not answering (s, on the statistics' own clock):
#: a fetch waits ``fetch.wait.max.ms``, 0.5 s, at most
UNANSWERED_S = 5.0


def unreadable_partitions(stats: dict, topic: str,
                          unanswering: frozenset = frozenset()) -> frozenset:
    """The partitions of ``topic`` that this consumer wants (``desired``) whose broker (the
    one it fetches from, ``broker``, else the ``leader``) is unknown (-1), not connected, or
    one of ``unanswering`` (node ids, :meth:`LeaderWatch.on_stats`)."""
    brokers = stats.get("brokers")
    up = {b.get("nodeid") for b in brokers.values()
          if type(b) is dict and b.get("state") in _UP_STATES
          and b.get("source") != "logical"} if type(brokers) is dict else set()
    up -= unanswering
    topics = stats.get("topics")
    info = topics.get(topic) if type(topics) is dict else None
    parts = info.get("partitions") if type(info) is dict else None
    if type(parts) is not dict:
        return frozenset()
    out = set()
    for p in parts.values():
        if type(p) is not dict or not p.get("desired"):
            continue
        number, source = p.get("partition"), p.get("broker")
        if type(source) is not int or source < 0:
            source = p.get("leader")
        if type(number) is int and number >= 0 and (type(source) is not int or source < 0
                                                    or source not in up):
            out.add(number)
    return frozenset(out)


class LeaderWatch:
    """The consumer's ``stats_cb``: which partitions are unreadable (see the module), and
    since when, on ``clock`` (wall time)."""

    def __init__(self, topic: str, clock=time.time):
        self.topic = topic
        self.clock = clock
        self.current: frozenset = frozenset()   # unreadable by the latest statistics
        self.since: dict = {}          # partition -> when it became unreadable
        self.back: dict = {}           # partition -> when it could be read again
        self.went_unreadable = 0       # times a partition became unreadable
        self.bad_stats = 0
        self._waiting: dict = {}       # node id -> (responses received, since when) while
                                       # it had requests waiting at every statistics

    def on_stats(self, text) -> None:
        wall = self.clock()
        try:
            stats = orjson.loads(text)
            now = unreadable_partitions(stats, self.topic, self._unanswering(stats)) \
                if type(stats) is dict else frozenset()
        except Exception:              # never let it break the consume() serving it
            self.bad_stats += 1
            return
        new = sorted(p for p in now if p not in self.since)
        for p in now:
            self.since.setdefault(p, wall)
            self.back.pop(p, None)     # unreadable again: no return grace running
        for p in self.since:
            if p not in now and p not in self.back:
                self.back[p] = wall
        if new:
            self.went_unreadable += len(new)
            log.warning("telemetry partition(s) %s cannot be read now (no connected "
                        "broker to fetch from): the jobs on them wait for them", new)
        self.current = now
        self._forget(wall)

    def _unanswering(self, stats: dict) -> frozenset:
        """Brokers that had requests waiting (``waitresp_cnt``) at every statistics for
        :data:`UNANSWERED_S` and received no response (``rx``) meanwhile, on the statistics'
        own clock (``ts``, µs: those queued while the consumer was not polled come in a
        burst). A broker whose machine froze or whose network drops its packets keeps its
        connection up until the consumer's ``socket.timeout.ms``; meanwhile nothing is
        fetched from it. (Not ``rxidle``: a broker asked nothing for a while is idle that
        long before it answers.)"""
        brokers, taken = stats.get("brokers"), stats.get("ts")
        if type(brokers) is not dict or type(taken) is not int:
            self._waiting = {}
            return frozenset()
        taken_s = taken / 1e6
        waiting, out = {}, set()
        for b in brokers.values():
            if type(b) is not dict or b.get("source") == "logical":
                continue
            node, asked, rx = b.get("nodeid"), b.get("waitresp_cnt"), b.get("rx")
            if type(node) is not int or type(asked) is not int or asked <= 0 \
                    or type(rx) is not int:
                continue                   # nothing asked of it: nothing owed
            was = self._waiting.get(node)
            if was is None or was[0] != rx:
                was = (rx, taken_s)        # it answered since: counted from now
            waiting[node] = was
            if taken_s - was[1] >= UNANSWERED_S:
                out.add(node)
        self._waiting = waiting
        return frozenset(out)

    def unreadable(self) -> frozenset:
        """The partitions not to say this worker reads now."""
        wall = self.clock()
        self._forget(wall)
        return frozenset(p for p, since in self.since.items() if wall - since < MOST_S)

    def _forget(self, wall: float) -> None:
        for p, at in list(self.back.items()):
            if wall - at >= RETURN_GRACE_S:
                del self.back[p], self.since[p]
