"""The rank side's Kafka logic against fake clients that behave like librdkafka where it
matters: a backlog comes one partition after another, paused partitions stop coming,
commits and the compacted state topic persist across a "restart"."""
from __future__ import annotations

import math
import time

import pytest

from trainguard import events as ev
from trainguard.detectors import RankStage
from trainguard.streams.logic import decode_summaries
from trainguard.streams.metrics import Metrics
from trainguard.streams.processors import RankProcessor
from trainguard.streams.rank_side import RankService
from trainguard.streams.settings import WorkerSettings
from trainguard.streams.worker import WorkerTopics

TOPICS = WorkerTopics(telemetry="t.telemetry", anomalies="t.anomalies", deadletter="t.dl",
                      summaries="t.w-summaries", rank_state="t.w-rank-state")
PARTITIONS = 4


class TP:
    def __init__(self, topic, partition, offset=-1001):
        self.topic, self.partition, self.offset = topic, partition, offset


class Msg:
    def __init__(self, topic, partition, offset, key, value):
        self._v = (topic, partition, offset, key, value)

    def error(self):
        return None

    def topic(self):
        return self._v[0]

    def partition(self):
        return self._v[1]

    def offset(self):
        return self._v[2]

    def key(self):
        return self._v[3]

    def value(self):
        return self._v[4]

    def timestamp(self):
        return (0, -1)           # TIMESTAMP_NOT_AVAILABLE


class Broker:
    def __init__(self):
        self.logs: dict = {}          # (topic, partition) -> [(key, value)]
        self.committed: dict = {}     # (group, partition) -> offset

    def append(self, topic, partition, key, value):
        self.logs.setdefault((topic, partition), []).append((key, value))


class FakeProducer:
    def __init__(self, broker):
        self.broker = broker
        self.pending = []

    def produce(self, topic, value, key=None, partition=None, on_delivery=None):
        self.pending.append((topic, partition if partition is not None else 0, key, value))

    def poll(self, timeout=0):
        return 0

    def flush(self, timeout=None):
        for item in self.pending:
            self.broker.append(*item)
        self.pending = []
        return 0


class FakeConsumer:
    """Hands out a backlog in runs of ``run`` records, one partition after another."""

    def __init__(self, conf, broker, run=300):
        self.conf, self.broker, self.run = conf, broker, run
        self.group = conf.get("group.id")
        self.callbacks = None
        self.assigned: list = []
        self.at: dict = {}
        self.paused: set = set()
        self.pauses = 0

    def subscribe(self, topics, on_assign, on_revoke, on_lost):
        self.topic = topics[0]
        self.callbacks = (on_assign, on_revoke)

    def assign(self, tps):
        self.assigned = [(tp.topic, tp.partition) for tp in tps]
        for tp in tps:
            self.at[(tp.topic, tp.partition)] = 0

    def assignment(self):
        return [TP(t, p) for t, p in self.assigned]

    def committed(self, tps, timeout=None):
        return [TP(tp.topic, tp.partition, self.broker.committed.get((self.group, tp.partition),
                                                                     -1001)) for tp in tps]

    def commit(self, offsets, asynchronous=True):
        for tp in offsets:
            self.broker.committed[(self.group, tp.partition)] = tp.offset

    def consume(self, n, timeout):
        if self.callbacks and not self.assigned:
            self.assigned = [(self.topic, p) for p in range(PARTITIONS)]
            for t, p in self.assigned:
                start = self.broker.committed.get((self.group, p), 0)
                self.at[(t, p)] = max(0, start)
            self.callbacks[0](self, [TP(t, p) for t, p in self.assigned])
        for key in sorted(self.assigned, key=lambda k: k[1]):
            if key[1] in self.paused:
                continue
            log = self.broker.logs.get(key, [])
            pos = self.at[key]
            if pos < len(log):
                take = log[pos:pos + min(n, self.run)]
                self.at[key] = pos + len(take)
                return [Msg(key[0], key[1], pos + i, k, v) for i, (k, v) in enumerate(take)]
        return []

    def position(self, tps):
        return [TP(tp.topic, tp.partition, self.at.get((tp.topic, tp.partition), -1001))
                for tp in tps]

    def get_watermark_offsets(self, tp, cached=False, timeout=None):
        return 0, len(self.broker.logs.get((tp.topic, tp.partition), []))

    def pause(self, tps):
        self.paused.update(tp.partition for tp in tps)
        self.pauses += 1

    def resume(self, tps):
        self.paused.difference_update(tp.partition for tp in tps)

    def close(self):
        pass


def _service(broker, now, **settings):
    settings = WorkerSettings(prefix="t", worker_id="w",
                              **{"snapshot_interval_s": 3600.0, **settings})
    svc = RankService(kafka={"bootstrap.servers": "fake:1"}, settings=settings, topics=TOPICS,
                      processor=RankProcessor(RankStage), metrics=Metrics(),
                      state_partitions=PARTITIONS, clock=lambda: now[0],
                      consumer_factory=lambda conf: FakeConsumer(conf, broker),
                      producer_factory=lambda conf: FakeProducer(broker))
    svc.connect()
    return svc


def _load(broker, steps, ranks=16, first=0, nan_at=None):
    for s in range(first, first + steps):
        for r in range(ranks):
            loss = math.nan if (s, r) == nan_at else 2.0
            e = ev.Step(job="j", ts=1000.0 + s, node=f"n{r // 4}", rank=r, step=s,
                        step_time=1.0, loss=loss)
            broker.append(TOPICS.telemetry, r % PARTITIONS, f"j/{r}".encode(), ev.encode(e))


def _drain(svc, now, rounds=400):
    for _ in range(rounds):
        now[0] += 0.01
        svc._process(svc.consumer.consume(200, 0))
        svc.producer.flush()


def _summaries(broker):
    items = []
    for (topic, _), log in sorted(broker.logs.items()):
        if topic == TOPICS.summaries:
            for _, value in log:
                items += decode_summaries(value)[1]
    return items


def test_a_backlog_handed_over_partition_by_partition_comes_out_in_step_order():
    broker, now = Broker(), [0.0]
    _load(broker, steps=60)
    svc = _service(broker, now)
    _drain(svc, now)
    steps = [item["step"] for _, _, _, item in _summaries(broker)]
    assert len(steps) == 60 * 16
    assert max(a - b for a, b in zip(steps, steps[1:] + [steps[-1]])) <= 0    # never back
    assert svc.consumer.pauses > 0 and not svc.paused
    assert svc.aligner.stalls == 0


def test_summaries_say_which_partitions_the_worker_is_behind_on():
    """Each summaries message says which partitions this worker reads and which of them it
    has not read to the end (the job side waits for those while they are quiet); a job told
    that a partition was behind hears, without items if need be, once it is not (at most
    once a second)."""
    from trainguard.streams.logic import Reading, parse_summaries
    from trainguard.streams.processors import RankOutput

    broker, now = Broker(), [0.0]
    for p, records in ((0, 5), (1, 4)):
        for n in range(records):
            broker.append(TOPICS.telemetry, p, b"k/0", b"{}")
    svc = _service(broker, now)
    svc.consumer.consume(1, 0)                      # assigned the four partitions
    svc.fetched = {0: 5, 1: 3}                      # partitions 2 and 3 not read yet
    out = RankOutput(items={"k": [(1, 2, 0, {"k": "hb", "job": "k", "rank": 0})]})
    svc._tell_reading(out)
    assert out.reading == Reading(parts=(0, 1, 2, 3), behind=(1,))
    assert parse_summaries(out.messages()[0][1])[2] == out.reading
    svc.fetched[1] = 4                              # caught up on partition 1
    now[0] += 0.5
    soon = RankOutput()
    svc._tell_reading(soon)
    assert soon.items == {}                         # told 0.5 s ago: it still waits anyway
    now[0] += 0.6
    later = RankOutput()
    svc._tell_reading(later)
    assert later.items == {"k": []} and later.reading.behind == ()
    assert [parse_summaries(v)[1:] for _, v in later.messages()] == [([], later.reading)]
    assert svc._told == {}


def test_a_partition_read_as_it_is_written_is_not_said_to_be_behind():
    """The cached high watermark comes with each fetch, before consume() hands its records
    over: a partition fed a heartbeat a second was said behind for seconds, the job's clock
    stopped, and a
    one-partition job's hang in a checkpoint went unjudged until the job ended (the flake of
    test_overrides_e2e). It is behind once what the broker held is not fetched within
    KEEPS_UP_S and one poll_ms; one that brought nothing since it was assigned is behind at
    once."""
    from trainguard.streams.processors import RankOutput

    broker, now = Broker(), [0.0]
    broker.append(TOPICS.telemetry, 0, b"k/0", b"{}")
    broker.append(TOPICS.telemetry, 1, b"k/1", b"{}")
    svc = _service(broker, now)
    svc.consumer.consume(1, 0)                      # assigned the four partitions
    svc.fetched = {0: 1, 1: 0, 2: 0, 3: 0}
    svc.last_seen = {0: 0.0}

    def behind():
        out = RankOutput(items={"k": [(0, 0, 0, {"k": "hb", "job": "k", "rank": 0})]})
        svc._tell_reading(out)
        return out.reading.behind

    assert behind() == (1,)                          # 0 read to the end: keeping up;
    for second in range(1, 6):                       # 1 holds a record since assigned
        broker.append(TOPICS.telemetry, 0, b"k/0", b"{}")
        now[0] = second + 0.001                      # told between its write and its fetch
        assert behind() == (1,)
        svc.fetched[0], svc.last_seen[0] = second + 1, second + 0.002
    for _ in range(3):                               # what it held is not fetched
        broker.append(TOPICS.telemetry, 0, b"k/0", b"{}")
    now[0] += 0.5
    assert behind() == (1,)
    now[0] += svc.keeps_up_s                         # KEEPS_UP_S and one poll_ms
    assert behind() == (0, 1)
    svc.fetched[0] += 2                              # fetched some, not all it held then
    assert behind() == (0, 1)
    svc.fetched[0] += 1                              # all it held then, 1.5 s late: it
    broker.append(TOPICS.telemetry, 0, b"k/0", b"{}")   # did not keep up
    assert behind() == (0, 1)


def test_a_loop_that_polls_every_second_still_keeps_up():
    """With ``worker.poll_ms`` 1,000 an idle loop takes what was fetched only at its next
    poll, a second later: its grace is that much longer (``keeps_up_s``), or every poll
    looked like a loop that stood still and a partition read as it is written was said
    behind at every word (the flake's cause, in that setting). ``poll_ms`` is at most 1,000:
    with a grace of minutes a loop that stood still for a snapshot's flush would pass for
    one that waits between polls, and its backlog for records read as they are written."""
    from trainguard.streams.processors import RankOutput
    from trainguard.config import ConfigError
    from trainguard.streams.rank_side import KEEPS_UP_S

    with pytest.raises(ConfigError, match="poll_ms"):
        WorkerSettings(prefix="t", worker_id="w", poll_ms=1001)
    broker, now = Broker(), [0.0]
    broker.append(TOPICS.telemetry, 0, b"k/0", b"{}")
    svc = _service(broker, now, poll_ms=1000)
    assert svc.keeps_up_s == KEEPS_UP_S + 1.0
    svc.consumer.consume(1, 0)
    svc.fetched = {0: 1, 1: 0, 2: 0, 3: 0}
    svc.last_seen = {0: 0.0}

    def poll(fetch=True):
        svc._process([])
        if fetch:           # what was written since the last poll; the newest in flight
            svc.fetched[0], svc.last_seen[0] = broker_high() - 1, now[0]
        out = RankOutput(items={"k": [(0, 0, 0, {"k": "hb", "job": "k", "rank": 0})]})
        svc._tell_reading(out)
        return 0 in out.reading.behind

    def broker_high():
        return len(broker.logs[(TOPICS.telemetry, 0)])

    said = []
    for n in range(1, 8):                            # a poll every 1.05 s, a record a poll
        now[0] = 1.05 * n
        broker.append(TOPICS.telemetry, 0, b"k/0", b"{}")
        said.append(poll())
    assert said[0] and not any(said[1:]), said       # behind only until it kept up once
    now[0] += 1.05                                   # then it stops fetching: behind once
    assert not poll(fetch=False)                     # the longer grace ran out
    now[0] += 1.0
    assert poll(fetch=False)


def test_a_backlog_is_behind_from_the_first_word_and_until_it_is_read():
    """A review's case against the first cut of KEEPS_UP_S: a backlog's first fetched batch
    made its partition look read as it is written, and each time the fetch position passed
    the high watermark first seen a new grace began, seconds before the backlog's end. A
    word saying it was read to the end then let the job stop waiting for a partition nobody
    had read since its worker died (a false silent, in a simulation of the job side)."""
    from trainguard.streams.processors import RankOutput

    broker, now = Broker(), [0.0]
    for _ in range(6000):
        broker.append(TOPICS.telemetry, 0, b"k/0", b"{}")
    svc = _service(broker, now)
    svc.consumer.consume(1, 0)                      # assigned; nothing read yet
    said = []
    for batch in range(30):                          # 200 records a batch, 0.1 s apart
        now[0] += 0.1
        svc.fetched[0] = 200 * (batch + 1)
        svc.last_seen[0] = now[0]
        if batch % 10 == 9:                          # the producers go on writing
            broker.append(TOPICS.telemetry, 0, b"k/0", b"{}")
        out = RankOutput(items={"k": [(0, 0, 0, {"k": "hb", "job": "k", "rank": 0})]})
        svc._tell_reading(out)
        said.append(0 in out.reading.behind)
    assert all(said), said.index(False)


def test_a_partition_without_a_connected_leader_is_not_said_to_be_read():
    """librdkafka's statistics (the consumer's ``stats_cb``) name the partitions whose leader
    is unknown or not connected: a broker died. They are left out of what this worker says
    it reads, so the job side waits for them (``tests/test_unread_partitions.py``)."""
    import json

    from trainguard.streams.logic import Reading
    from trainguard.streams.partition_leaders import RETURN_GRACE_S
    from trainguard.streams.processors import RankOutput

    broker, now = Broker(), [0.0]
    svc = _service(broker, now)
    svc.consumer.consume(1, 0)
    svc.fetched = {0: 0, 1: 0, 2: 0, 3: 0}
    stats = {"brokers": {"b1:9092/1": {"nodeid": 1, "source": "learned", "state": "UP"},
                         "b2:9092/2": {"nodeid": 2, "source": "learned", "state": "DOWN"}},
             "topics": {TOPICS.telemetry: {"partitions": {
                 str(p): {"partition": p, "leader": 1 + p % 2, "desired": True}
                 for p in range(4)}}}}
    svc.consumer.conf["stats_cb"](json.dumps(stats))
    out = RankOutput(items={"k": [(0, 1, 0, {"k": "hb", "job": "k", "rank": 0})]})
    svc._tell_reading(out)
    assert out.reading == Reading(parts=(0, 2), behind=())
    stats["brokers"]["b2:9092/2"]["state"] = "UP"          # its partitions led again ...
    now[0] += 1.0
    svc.consumer.conf["stats_cb"](json.dumps(stats))
    soon = RankOutput(items={"k": []})
    svc._tell_reading(soon)
    assert soon.reading.parts == (0, 2)        # ... while the producers' held records land
    now[0] += RETURN_GRACE_S
    again = RankOutput(items={"k": []})
    svc._tell_reading(again)
    assert again.reading.parts == (0, 1, 2, 3)


def test_a_job_fed_lately_hears_every_second_that_its_partitions_are_read():
    """With nothing to send it, a job this worker fed within ``vouch_for_s`` still hears
    every second which partitions it reads (and that it read them to the end): the job side
    then knows their silence is its ranks', not a worker gone (``JobProcessor.unread_s``),
    for as long as it could take them for a worker gone. Until 2026-12-06 the worker said
    so for 60 s, and the job side waited 30 s; waiting 180 s, a job whose ranks on one
    partition all went quiet would have been held back from 60 s to 180 s after."""
    from trainguard.streams.logic import parse_summaries

    broker, now = Broker(), [0.0]
    _load(broker, steps=2, ranks=4)
    svc = _service(broker, now)
    assert svc.vouch_for_s >= svc.settings.unread_partition_s + 30.0
    assert _service(Broker(), now, unread_partition_s=10.0).vouch_for_s == 60.0
    _drain(svc, now, rounds=20)

    def words():
        said = [parse_summaries(v) for (topic, _), log in sorted(broker.logs.items())
                if topic == TOPICS.summaries for _, v in log]
        return [(job, reading.behind) for job, items, reading in said if not items]

    assert words() == [] and _summaries(broker)      # items, each with the reading
    start = now[0]
    while now[0] < start + 3.05:
        now[0] += 0.05
        svc._process([])
        svc.producer.flush()
    assert words() == [("j", ())] * 3                 # once a second, nothing behind
    now[0] = start + svc.vouch_for_s - 2             # still fed lately: it hears
    svc._process([])
    svc.producer.flush()
    assert len(words()) == 4
    now[0] = start + svc.vouch_for_s + 1
    svc._process([])
    now[0] += 1.5
    svc._process([])
    svc.producer.flush()
    assert len(words()) == 4 and svc._fed == {} and svc._heard_at == {}


def test_a_worker_that_takes_partitions_over_tells_their_quiet_jobs_what_it_reads():
    """Ranks that went quiet before their partitions moved to another worker (a rebalance,
    a restart): the new worker restores their state and says every second to their job
    what it reads, as if it had fed the job when they last sent, for ``vouch_for_s`` from
    then. Else the job side would take their partitions for ones nobody reads and hold the
    job for up to ``worker.unread_partition_s``."""
    from trainguard.streams.logic import parse_summaries

    broker, now = Broker(), [0.0]
    _load(broker, steps=2, ranks=4)
    svc = _service(broker, now)
    _drain(svc, now, rounds=20)
    assert svc.checkpoint_now("test")
    last_input = max(slot.touched for slot in svc.processor.state.slots.values())

    def words():
        return sum(1 for (topic, _), log in broker.logs.items() if topic == TOPICS.summaries
                   for _, v in log if not parse_summaries(v)[1])

    now[0] += 20.0
    again = _service(broker, now)             # the successor: restores, nothing new to read
    _drain(again, now, rounds=2)
    assert again._fed == {"j": last_input}
    said = words()
    for _ in range(3):
        now[0] += 1.0
        again._process([])
    again.producer.flush()
    assert words() == said + 3
    now[0] = last_input + again.vouch_for_s + 1.0
    again._process([])
    now[0] += 1.5
    again._process([])
    again.producer.flush()
    assert words() == said + 3 and again._fed == {}
    now[0] += 1.0
    late = _service(broker, now)             # restored after that: nothing to say
    _drain(late, now, rounds=2)
    assert late._fed == {} and late._heard_at == {}


def test_a_lost_word_of_what_a_worker_reads_is_not_produced_again_nor_holds_commits():
    """A summaries message with no items only says what the worker reads, as of when it was
    sent: one the broker refuses is counted, not produced again (the next word replaces it;
    a late copy would claim the partitions read as of its arrival) and holds no commit back.
    A refused message with items is produced again and holds the commit back, as before
    (a topic's size limit once refused every word for seconds, and the commit after it was
    lifted waited a snapshot longer: ci52)."""
    from trainguard.streams.logic import parse_summaries

    broker, now = Broker(), [0.0]
    _load(broker, steps=2, ranks=4)
    svc = _service(broker, now)
    _drain(svc, now, rounds=20)
    svc.producer.flush()
    refused = []

    class Refusing(FakeProducer):
        def produce(self, topic, value, key=None, partition=None, on_delivery=None):
            refused.append(value)
            on_delivery("MSG_SIZE_TOO_LARGE", type("Msg", (), {
                "topic": lambda self: topic, "value": lambda self: value,
                "key": lambda self: key, "partition": lambda self: -1})())

    svc.producer = Refusing(broker)
    start = now[0]
    while now[0] < start + 3.05:
        now[0] += 0.05
        svc._process([])
    assert len(refused) == 3 and svc.metrics.counters["deliveries_failed"] == 3
    assert svc._retry == [] and svc._failed == 0
    _load(broker, steps=1, ranks=4, first=2)
    _drain(svc, now, rounds=20)
    assert svc._retry and svc._failed == len(svc._retry)   # the items: again, and held
    assert all(parse_summaries(value)[1] for _, value, _, _ in svc._retry)


def test_checkpoint_commits_what_was_applied_and_a_restart_skips_it():
    broker, now = Broker(), [0.0]
    _load(broker, steps=200)
    svc = _service(broker, now)
    _drain(svc, now, rounds=6)                 # part of the backlog
    applied = dict(svc.positions)
    assert 0 < sum(applied.values()) < 200 * 16
    assert svc.checkpoint_now("test")
    committed = {p: o for (g, p), o in broker.committed.items()}
    assert committed == {p: o for p, o in applied.items() if o > 0}
    assert sum(len(v) for (t, _), v in broker.logs.items() if t == TOPICS.rank_state) > 0
    _load(broker, steps=5, first=200, nan_at=(202, 3))
    broker.committed = {k: max(0, v - 4) for k, v in broker.committed.items()}   # commit lags
    before = len(_summaries(broker))
    again = _service(broker, now)              # "restart": restores from the state topic
    _drain(again, now)
    assert again.metrics.counters["replayed"] == 4 * len(committed)
    items = _summaries(broker)[before:]
    per_rank = {}
    for p, o, i, item in items:
        per_rank.setdefault(item["rank"], []).append(item["step"])
    assert all(s == sorted(set(s)) for s in per_rank.values())            # nothing twice
    assert any(item["loss"] == "NaN" for _, _, _, item in items)


def test_revoke_checkpoints_and_forgets_the_partitions():
    broker, now = Broker(), [0.0]
    _load(broker, steps=5)
    svc = _service(broker, now)
    _drain(svc, now)
    svc._on_revoke(svc.consumer, [TP(TOPICS.telemetry, p) for p in (0, 1)])
    assert {p for (g, p) in broker.committed} == {0, 1, 2, 3}
    assert svc.assignment == {2, 3} and all(s.partition in (2, 3)
                                            for s in svc.processor.state.slots.values())


def test_a_costly_snapshot_puts_the_next_off_but_never_past_the_limit(monkeypatch):
    broker, now = Broker(), [100.0]
    _load(broker, steps=5)
    svc = _service(broker, now, snapshot_interval_s=2.0)
    _drain(svc, now, rounds=3)
    at = now[0]
    for cost, pause in ((0.01, 2.0), (0.1, 5.0), (3.0, 10.0)):   # share 2%, at most 10 s
        cpu = iter([50.0, 50.0 + cost])
        monkeypatch.setattr(time, "thread_time", lambda: next(cpu))
        svc._write_snapshot()
        assert svc._next_snapshot == pytest.approx(at + pause)
    monkeypatch.undo()
    assert svc.metrics.counters["snapshot_cpu_seconds"] == pytest.approx(3.11)


def test_after_the_loop_stood_still_no_partition_is_taken_to_keep_up():
    """A review's cases: the loop standing still (a snapshot's flush waits on a broker that
    stopped answering) while a backlog gathers, a gap closed late, and a watermark not
    known yet (before the first fetch) are no sign of keeping up."""
    from trainguard.streams.processors import RankOutput

    broker, now = Broker(), [0.0]
    svc = _service(broker, now)
    svc.consumer.consume(1, 0)                      # assigned; every partition empty
    svc.fetched = {0: 0, 1: 0, 2: 0, 3: 0}

    def behind():
        out = RankOutput(items={"k": [(0, 0, 0, {"k": "hb", "job": "k", "rank": 0})]})
        svc._tell_reading(out)
        return out.reading.behind

    svc._process([])
    assert behind() == () and svc._keeping == {0, 1, 2, 3}
    for _ in range(5000):                            # written while the loop stood still
        broker.append(TOPICS.telemetry, 0, b"k/0", b"{}")
    now[0] += 10.0
    svc._process([])
    assert behind() == (0,)
    now[0] += 0.5
    svc._process([])
    svc.fetched[0] = 5000                            # read, 0.5 s after it was seen
    assert behind() == ()
    broker.append(TOPICS.telemetry, 0, b"k/0", b"{}")
    assert behind() == ()                            # kept up since: a grace
    now[0] += 0.9
    svc._process([])
    now[0] += 0.9
    svc._process([])
    assert behind() == (0,)                          # ... of 1 s
    svc.fetched[0] = 5001                            # closed, but late
    broker.append(TOPICS.telemetry, 0, b"k/0", b"{}")
    assert behind() == (0,)
