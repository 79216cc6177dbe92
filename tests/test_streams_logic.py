"""The stream worker's pure parts, without Kafka: sorting telemetry, dead-letter records,
the summaries wire format, event-time alignment, and restore from snapshots without
applying anything twice (the property the kill -9 test checks end to end)."""
import json
import math
import random

import pytest

from trainguard import events as ev
from trainguard.detectors import DetectorConfig, Engine, JobStage, NodeStage, RankStage
from trainguard.deadletter import original_value, parse_deadletter
from trainguard.streams.logic import (EventTimeAligner, InvalidSummaries, SourceMarks, classify,
                                      decode_summaries, encode_summaries, node_key)
from trainguard.streams.metrics import Metrics, parse_exposition
from trainguard.streams.processors import (JobProcessor, RankOutput, RankProcessor, dump_state,
                                           load_state, state_partition)

from events_factory import examples

T0 = 1764680000.0


def step(job, rank, s, loss=2.0, node=None, ts=None):
    return ev.Step(job=job, ts=T0 + s if ts is None else ts, node=node or f"n{rank // 2}",
                   rank=rank, step=s, step_time=1.0, compute_time=0.8, loss=loss, grad_norm=1.0)


def records(events, partitions=4, start=0):
    """Telemetry records ``(partition, offset, key, value)`` keyed by job/rank."""
    offsets: dict = {}
    out = []
    for event in events:
        p = (event.rank or 0) % partitions
        o = offsets.get(p, start)
        offsets[p] = o + 1
        out.append((p, o, f"{event.job}/{event.rank}".encode(), ev.encode(event)))
    return out


MALFORMED = [b"not json", b"\xff\xfe\x00", b"[]", b"42", b'{"v":1}', b'{"v":2,"type":"step"}',
             b'{"v":1,"type":"nope","job":"j","ts":1}', b'{"v":1,"type":"step","job":"j"}',
             b'{"v":1,"type":"step","job":"j","ts":1,"step":-1,"step_time":1}',
             b'{"v":1,"type":"step","job":"bad job","ts":1,"step":1,"step_time":1}',
             b'{"v":1,"type":"heartbeat","job":"j","ts":"x","pid":1,"phase":"a",'
             b'"phase_since":1,"dropped":0}', None, b""]


def test_classify_accepts_every_telemetry_type_and_rejects_the_rest():
    for event in examples():
        got, reason = classify(ev.encode(event))
        if event.type in ("step", "heartbeat", "gpu", "xid", "lifecycle"):
            assert reason is None and got.type == event.type
        else:
            assert got is None and "do not belong on the telemetry topic" in reason
    for raw in MALFORMED:
        got, reason = classify(raw)
        assert got is None and reason


def test_invalid_messages_become_deadletter_records_with_reason_and_raw_bytes():
    proc = RankProcessor(RankStage, telemetry_topic="tg.telemetry")
    recs = [(1, 10 + i, b"k", raw) for i, raw in enumerate(MALFORMED)]
    out = proc.process(recs, now=5.0)
    assert out.invalid == len(MALFORMED) == len(out.deadletters)
    for (p, o, key, raw), (dl_key, value) in zip(recs, out.deadletters):
        rec = parse_deadletter(value)
        assert (rec["topic"], rec["partition"], rec["offset"], dl_key) == ("tg.telemetry", p, o,
                                                                            key)
        assert rec["reason"] and original_value(rec) == raw
        assert set(rec) == {"reason", "topic", "partition", "offset", "key_b64", "raw_b64", "ts"}


def test_node_events_pass_through_without_node_stages_and_rankless_rank_events_are_ignored():
    proc = RankProcessor(RankStage)
    xid = ev.Xid(job="j1", ts=T0, node="n1", gpu=0, xid=79, source="kmsg", message="off the bus")
    rankless = ev.Step(job="j1", ts=T0, node="n1", step=1, step_time=1.0)
    out = proc.process([(0, 0, None, ev.encode(xid)), (0, 1, None, ev.encode(rankless))], 1.0)
    assert out.ignored == 1
    [(p, o, i, item)] = out.items["j1"]
    assert (p, o, i) == (0, 0, 0) and ev.from_dict(item) == xid


def test_summaries_round_trip_and_are_chunked():
    items = [(p, o, 0, {"k": "step", "rank": o, "loss": "NaN", "pad": "x" * 100})
             for p in range(3) for o in range(50)]
    messages = encode_summaries("j1", items, max_items=40, max_bytes=3000)
    assert len(messages) > 1 and all(len(m) <= 3000 + 300 for m in messages)
    back = []
    for message in messages:
        job, part = decode_summaries(message)
        assert job == "j1"
        back += [tuple(x) for x in part]
    assert back == [tuple(x) for x in items]
    for bad in (b"nope", b'{"v":9,"job":"j","items":[]}', b'{"v":1,"job":"j","items":[[1]]}',
                b'{"v":1,"items":[]}'):
        with pytest.raises(InvalidSummaries):
            decode_summaries(bad)


def test_source_marks_apply_each_item_once_per_partition():
    marks = SourceMarks()
    seen = [marks.advance(p, o, i) for p, o, i in
            [(0, 5, 0), (0, 5, 1), (1, 2, 0), (0, 5, 1), (0, 4, 0), (1, 3, 0), (1, 3, 0)]]
    assert seen == [True, True, True, False, False, True, False]


def test_aligner_keeps_partition_order_and_merges_by_time():
    rng = random.Random(1)
    aligner = EventTimeAligner(max_hold_s=100.0)
    streams = {p: [(float(t) + p / 10, (p, t)) for t in range(50)] for p in range(4)}
    cursor = dict.fromkeys(streams, 0)
    out = []
    now = 0.0
    while any(cursor[p] < 50 for p in streams):
        for p in streams:
            n = rng.randint(0, 12)
            aligner.add(p, streams[p][cursor[p]:cursor[p] + n], now)
            cursor[p] = min(50, cursor[p] + n)
        blocked = {p for p in streams if cursor[p] < 50}
        out += aligner.release(blocked, now)
        now += 0.01
    out += aligner.release(set(), now)
    assert len(out) == 200 and len(aligner) == 0
    for p in streams:
        assert [t for q, t in out if q == p] == list(range(50))
    times = [t + q / 10 for q, t in out]
    assert times == sorted(times)


def test_aligner_releases_after_a_stall_and_when_full():
    aligner = EventTimeAligner(max_hold_s=1.0, max_buffered=5)
    aligner.add(0, [(1.0, "a")], now=0.0)
    assert aligner.release({1}, now=0.5) == []          # waits for partition 1
    aligner.add(1, [(0.5, "b")], now=0.9)                # which comes, but not far enough
    assert aligner.release({1}, now=0.9) == ["b"]
    assert aligner.release({1}, now=1.5) == []          # time moved on at 0.9
    assert aligner.release({1}, now=1.95) == []         # a second without progress ...
    assert aligner.release({1}, now=1.96) == ["a"]      # ... and three calls: a stall
    aligner.add(0, [(float(t), t) for t in range(6)], now=2.0)
    assert len(aligner.release({1}, now=2.0)) == 6      # over max_buffered


def test_state_blobs_name_their_partition_and_compress_large_objects():
    big = {"x": list(range(20000))}
    for obj in ({"a": 1}, big):
        blob = dump_state(obj, 11)
        assert state_partition(blob) == 11 and load_state(blob) == obj
    assert len(dump_state(big, 0)) < len(json.dumps(big))


def test_a_snapshot_of_another_version_starts_its_stage_afresh():
    import pickle
    import struct

    jobs = JobProcessor(JobStage)
    jobs.apply(encode_summaries("j1", [(0, 0, 0, {"k": "step", "job": "j1", "rank": 0,
                                                  "node": "n", "ts": 1.0, "step": 0,
                                                  "step_time": 1.0})])[0], 0, 1.0)
    (key, part, blob), = jobs.snapshot()
    old = struct.pack(">ci", b"P", part) + pickle.dumps({"a": 1})   # trainguard 0.x: pickled
    again = JobProcessor(JobStage)
    again.restore(key, old)
    again.apply(encode_summaries("j1", [(0, 1, 0, {"k": "step", "job": "j1", "rank": 0,
                                                   "node": "n", "ts": 2.0, "step": 1,
                                                   "step_time": 1.0})])[0], 0, 2.0)
    assert again.state.restore_failures == 1 and again.errors == 0 and len(again) == 1


def _scenario(job="j1", ranks=4, steps=12, nan_at=(7, 2)):
    out = []
    for s in range(steps):
        for r in range(ranks):
            loss = math.nan if (s, r) == nan_at else 2.0 - s / 100
            out.append(step(job, r, s, loss))
    return out


def _run(rank_proc, job_proc, recs, now=T0 + 100):
    """One batch through both sides, the way the worker does it (minus Kafka)."""
    out = RankOutput()
    aligner = EventTimeAligner()
    for p, timed in rank_proc.decode(recs, out).items():
        aligner.add(p, timed, now)
    rank_proc.apply(aligner.release(set(), now), now, out)
    anomalies = []
    for key, value in out.messages():
        anomalies += job_proc.apply(value, 0, now)
    return out, anomalies


def test_worker_logic_finds_what_the_offline_engine_finds():
    events = _scenario()
    engine = Engine()
    offline = [a for e in events for a in engine.update(e)]
    config = DetectorConfig()
    ranks = RankProcessor(lambda: RankStage(config))
    jobs = JobProcessor(lambda: JobStage(config))
    _, online = _run(ranks, jobs, records(events))
    assert [(a.id, a.kind, a.ranks) for a in online] == [(a.id, a.kind, a.ranks) for a in offline]
    assert online[0].kind == "nan" and online[0].ranks == [2]


def _gpu_scenario(job="j1"):
    """Two machines of two ranks; ECC errors on GPU 1 of n1 at step 6, an Xid 79 on n0."""
    out = [ev.Lifecycle(job=job, ts=T0 - 1, node=f"n{r // 2}", rank=r, event="start", pid=r,
                        world_size=4, local_rank=r % 2) for r in range(4)]
    for s in range(10):
        out += [step(job, r, s) for r in range(4)]
        for n in range(2):
            gpus = [{"index": i, "uuid": f"GPU-{n}-{i}", "ecc_dbe": 3 if (n, i, s > 5) ==
                     (1, 1, True) else 0, "util": 90.0 + s} for i in range(2)]
            out.append(ev.Gpu(job=job, ts=T0 + s + 0.5, node=f"n{n}", gpus=gpus))
    out.append(ev.Xid(job=job, ts=T0 + 9.7, node="n0", gpu=0, xid=79, source="kmsg",
                      message="GPU has fallen off the bus"))
    return out


def test_node_stages_on_the_rank_side_find_what_the_offline_engine_finds():
    events = _gpu_scenario()
    engine = Engine()
    offline = [a for e in events for a in engine.update(e)]
    config = DetectorConfig()
    ranks = RankProcessor(lambda: RankStage(config), make_node_stage=lambda: NodeStage(config))
    jobs = JobProcessor(lambda: JobStage(config))
    out, online = _run(ranks, jobs, records(events))
    assert [(a.id, a.kind, a.ranks, a.nodes) for a in online] == \
        [(a.id, a.kind, a.ranks, a.nodes) for a in offline]
    assert [(a.kind, a.ranks, a.nodes) for a in online] == [
        ("gpu_fault", [3], ["n1"]), ("gpu_fault", [0], ["n0"])]
    # the job side gets one small item per sample, not the sample (x: the machine's 13
    # counters for machine_outlier)
    items = [item for value in (v for _, v in out.messages())
             for *_, item in decode_summaries(value)[1]]
    assert {tuple(sorted(i)) for i in items if i.get("k") == "gpu"} == {
        ("job", "k", "node", "ts", "x")}
    assert not any("type" in i for i in items)
    assert {key for key, _, _ in ranks.snapshot()} >= {node_key("j1", "n0"), node_key("j1", "n1")}
    assert ranks.process(records(events), now=T0 + 200).replayed == len(events)


@pytest.mark.parametrize("rank_snap,job_snap,crash", [
    (2, 2, 5), (3, 6, 9), (6, 3, 9), (1, 8, 8), (8, 1, 10), (0, 0, 7)])
def test_kill_and_restore_applies_everything_once_and_keeps_the_id(rank_snap, job_snap, crash):
    """The worker's rank and job sides checkpoint independently (snapshot, then commit). A
    kill -9 after step ``crash``; both restart from their snapshots and re-read from their
    commits. Every summary item reaches the job stage exactly once, and de-duplicated by
    id there is exactly one anomaly, the one the offline engine finds."""
    events = _scenario(steps=12, nan_at=(8, 2))
    engine = Engine()
    offline = {a.id for e in events for a in engine.update(e) if a.kind == "nan"}
    steps = [records(events)[s * 4:(s + 1) * 4] for s in range(12)]
    config = DetectorConfig()
    topic = []                                   # the summaries topic
    emitted = []

    def rank_step(proc, recs):
        out, _ = _run(proc, JobProcessor(JobStage), recs)   # rank side only
        topic.extend(value for _, value in out.messages())
        return out

    def job_read(proc, start):
        for value in topic[start:]:
            emitted.extend(proc.apply(value, 0, T0 + 100))
        return len(topic)

    ranks, jobs = RankProcessor(lambda: RankStage(config)), JobProcessor(lambda: JobStage(config))
    read = 0
    rank_state = job_state = None
    rank_commit = job_commit = 0
    for s in range(crash + 1):
        rank_step(ranks, steps[s])
        read = job_read(jobs, read)
        if s == rank_snap:
            rank_state, rank_commit = ranks.snapshot(), s * 4   # commit lags the snapshot
        if s == job_snap:
            job_state, job_commit = jobs.snapshot(), read
    applied_before = jobs.state.slots[b"j1"].marks.marks.copy()
    ranks, jobs = RankProcessor(lambda: RankStage(config)), JobProcessor(lambda: JobStage(config))
    for key, _, blob in rank_state:
        ranks.restore(key, blob)
    for key, _, blob in job_state:
        jobs.restore(key, blob)
    out = rank_step(ranks, [r for recs in steps for r in recs][rank_commit:])
    job_read(jobs, job_commit)
    assert out.replayed == rank_snap * 4 + 4 - rank_commit
    assert {a.id for a in emitted} == offline and len(offline) == 1
    marks = jobs.state.slots[b"j1"].marks.marks
    assert all(marks[p] >= applied_before[p] for p in applied_before)
    assert marks == {p: (11, 0) for p in range(4)}


def test_replayed_summaries_are_applied_once():
    events = _scenario(nan_at=(99, 0))
    config = DetectorConfig()
    ranks = RankProcessor(lambda: RankStage(config))
    jobs = JobProcessor(lambda: JobStage(config))
    out, _ = _run(ranks, JobProcessor(JobStage), records(events))
    messages = out.messages()
    for key, value in messages + messages:
        jobs.apply(value, 0, T0)
    assert jobs.applied == len(events) and jobs.replayed == len(events)


def test_slots_evict_idle_and_drop_revoked_partitions():
    ranks = RankProcessor(RankStage, idle_ttl_s=10.0)
    ranks.process(records([step("j", r, 0) for r in range(4)]), now=100.0)
    ranks.process(records([step("j", 0, 1)], start=1), now=105.0)
    assert sorted(k for k, p, blob in ranks.evict(now=112.0)) == [b"j/1", b"j/2", b"j/3"]
    ranks.drop({0})
    assert len(ranks) == 0


def test_job_processor_restores_and_advances_a_silent_job():
    jobs = JobProcessor(JobStage)
    ranks = RankProcessor(RankStage)
    _run(ranks, jobs, records([step("quiet", r, s, ts=1000.0 + s) for s in range(5)
                               for r in range(4)]), now=1004.0)
    [(key, part, blob)] = jobs.snapshot()
    fresh = JobProcessor(JobStage)
    fresh.restore(key, blob)
    assert fresh.load_saved({part}) == 1
    assert [a.kind for a in fresh.advance(1004.0 + 3600)] == ["hang"]


def test_a_failing_stage_is_logged_and_skipped():
    class Broken:
        def update(self, event):
            raise RuntimeError("detector bug")

    out = RankProcessor(Broken).process(records([step("j", 0, 0)]), now=1.0)
    assert out.errors == 1 and not out.items


def test_metrics_exposition_parses():
    m = Metrics()
    m.inc("events_in", 5)
    m.inc("anomalies_out")
    m.set_gauge("consumer_lag_messages", 3, topic="tg.telemetry")
    for lag in (0.02, 0.3, 0.3, 4.0):
        m.observe_lag(lag)
    values = parse_exposition(m.exposition())
    assert values["trainguard_events_in_total"] == 5
    assert values["trainguard_anomalies_out_total"] == 1
    assert values['trainguard_consumer_lag_messages{topic="tg.telemetry"}'] == 3
    assert values["trainguard_event_lag_seconds_count"] == 4
    assert m.lag_quantile(0.5) == 0.3 and m.lag_quantile(0.99) == 5.0


def test_a_backlog_read_late_is_judged_in_its_own_time():
    """Reading old data (a restart, an overloaded worker) finds no hang in it, and steps
    are not closed early; once the job sends nothing, its clock runs on with the wall."""
    events = _scenario(steps=40, nan_at=(30, 1))
    ranks = RankProcessor(RankStage)
    jobs = JobProcessor(JobStage)
    found = []
    wall = T0 + 3600.0                           # an hour behind
    for s in range(40):
        out, _ = _run(ranks, JobProcessor(JobStage), records(events)[s * 4:(s + 1) * 4])
        for _, value in out.messages():
            found += jobs.apply(value, 0, wall)
        found += jobs.advance(wall)
        wall += 0.05                             # reading ten times faster than real time
    assert [(a.kind, a.ranks) for a in found] == [("nan", [1])]
    assert [a.kind for a in jobs.advance(wall + 120.0)] == ["hang"]


@pytest.mark.parametrize("reading", [
    {"parts": [0, 1], "behind": [2]}, {"parts": "0", "behind": []},
    {"parts": [-1], "behind": []}, {"parts": [0], "behind": [], "of": "24"},
    {"parts": list(range(10_001)), "behind": []}, [0, 1]])
def test_a_malformed_reading_report_refuses_the_message(reading):
    value = json.dumps({"v": 1, "job": "j1", "items": [], "reading": reading}).encode()
    with pytest.raises(InvalidSummaries, match="malformed reading report"):
        decode_summaries(value)


def test_every_worker_metric_is_documented():
    from pathlib import Path

    from trainguard.streams.metrics import COUNTERS, GAUGES

    text = (Path(__file__).resolve().parents[1] / "docs" / "WORKER.md").read_text()
    names = [f"trainguard_{n}_total" for n in COUNTERS] + [f"trainguard_{n}" for n in GAUGES]
    assert [n for n in names if f"`{n}`" not in text] == []


def test_the_job_side_publishes_each_incident_after_the_anomalies_that_changed_it():
    """SPEC §6: an incident event after the anomalies that opened or grew it (once per
    message applied, as it is then); none without ``incidents``."""
    events = [step("j1", e.rank, e.step, math.nan) if (e.step, e.rank) == (9, 3) else e
              for e in _scenario(steps=12, nan_at=(6, 1))]
    ranks = RankProcessor(RankStage)
    jobs, quiet = JobProcessor(JobStage, incidents=True), JobProcessor(JobStage)
    out, _ = _run(ranks, JobProcessor(JobStage), records(events))
    found, plain = [], []
    for _, value in out.messages():
        found += jobs.apply(value, 0, T0 + 60.0)
        plain += quiet.apply(value, 0, T0 + 60.0)
    assert [e.TYPE for e in plain] == ["anomaly"] * len(plain) and plain
    anomalies = [e for e in found if e.TYPE == "anomaly"]
    incidents = [e for e in found if e.TYPE == "incident"]
    assert [a.id for a in anomalies] == [a.id for a in plain]
    assert found.index(incidents[0]) > found.index(anomalies[0])
    last = incidents[-1]
    assert last.kind == "nan" and set(last.anomalies) == {a.id for a in anomalies}
    assert last.anomaly_count == len(anomalies)
    assert ev.decode(ev.encode(last)) == last


def test_twenty_thousand_one_message_jobs_stay_within_the_caps_and_come_back():
    """Issue 14.5 without Kafka (bench/run.py worker_memory does 100,000 through the broker):
    each job id speaks once; live stages never pass the caps (a hundredth of the jobs), the
    rest are kept as snapshots of about a kilobyte, and a job that speaks again gets its
    stage back."""
    jobs_cap, ranks_cap, n = 200, 2000, 20_000
    config = DetectorConfig()        # one for all stages, as the worker builds them
    ranks = RankProcessor(lambda: RankStage(config), max_live=ranks_cap)
    jobs = JobProcessor(lambda: JobStage(config), max_live=jobs_cap)
    for first in range(0, n, 1000):
        batch = records([step(f"one-{i:05d}", 0, 1, ts=T0 + i * 1e-3)
                         for i in range(first, first + 1000)])
        out = ranks.process(batch, now=T0 + first * 1e-3)
        for key, value in out.messages():
            jobs.apply(value, 0, T0 + first * 1e-3)
        jobs.snapshot(), ranks.snapshot()
        assert len(jobs) <= jobs_cap and len(ranks) <= ranks_cap
    assert jobs.applied == n and jobs.state.evictions == n - jobs_cap
    kept = jobs.state.saved
    assert len(kept) == n - jobs_cap
    assert sum(map(len, kept.values())) / len(kept) < 4096
    out = ranks.process(records([step("one-00007", 0, 2, ts=T0 + 60)], start=10 ** 6),
                        now=T0 + 60)
    [(key, value)] = out.messages()
    jobs.apply(value, 0, T0 + 60)
    assert b"one-00007" not in kept and jobs.state.restore_failures == 0
    assert jobs.state.slots[b"one-00007"].stage.job == "one-00007"
