"""Issue 21 point 2, online: steps by number, not by arrival, in the worker's job side.

The rank summaries of one job reach the job side (``JobProcessor``, as ``trainguard worker``
runs it) in another order than they happened: one telemetry partition's rank worker lags
behind the other's by some steps, or one machine's collector sends in bursts. While the lag
stays inside ``detectors.stages.step_window`` (steps) and the job's clock (the lowest
newest time of its partitions, ``JobSlot.heard``) has not passed ``step_window_s`` beyond a
step, the lagging records still count toward their steps: the job side finds what it finds
when everything arrives in order, and what ``trainguard analyze`` finds. Records beyond
the window are counted (``late``) and still checked for NaN.
"""
from __future__ import annotations

import math
from collections import defaultdict

import pytest

from scenario_library import HEALTHY
from scenarios import Fault, Scenario, generate
from trainguard.detectors import DetectorsConfig, JobStage, RankStage
from trainguard.detectors.stages import launcher_summary
from trainguard.detectors.offline import analyze_events
from trainguard.streams.logic import Reading, encode_summaries
from trainguard.streams.processors import JobProcessor

STEP_TIME = 0.5


def shape(*faults) -> Scenario:
    return Scenario(name="lagged", dp=16, per_node=4, step_time=STEP_TIME, steps=200,
                    checkpoint_every=0, seed=11, faults=faults)


def partition_of(node: str) -> int:
    return int(node[1:]) % 2          # n2 and n4 on partition 0, n1 and n3 on partition 1


def online(events, delay_s, clock_offsets=None, reading=False, partition=None, of=0,
           down=None, held_by_producer=False, **job_side) -> tuple[list, JobProcessor]:
    """The anomalies ``(kind, ranks, step)`` of the job side fed the rank side's summaries
    of ``events``, each arriving ``delay_s(event)`` after it happened (``clock_offsets``:
    how far each machine's stamps are off), with the worker's one-second wall-clock timer;
    and the processor. ``reading``: each partition has a rank worker of its own, which
    says with each message whether more of its partition was written than it read.
    ``partition(event)``: its telemetry partition (default: its machine's, ``partition_of``),
    and ``of`` the topic's partition count, told with the reading. With ``reading``, each
    rank worker also says so every second with no items, as the worker's rank side does
    (``RankService``), unless ``down(partition, wall)``: its worker is gone (killed, stalled)
    then, or cannot read it. ``held_by_producer``: a delayed record was written when it
    arrived (a producer held it: a partition without a leader), not when it happened (a
    backlog of the topic's)."""
    offsets = clock_offsets or {}
    config = DetectorsConfig()
    ranks: dict = {}
    arrivals = []
    for seq, e in enumerate(events):
        if e.TYPE not in ("step", "heartbeat", "lifecycle"):
            continue
        if e.rank is None:                  # trainguard run's own, keyed by job
            items = [launcher_summary(e)] if e.TYPE == "lifecycle" else []
        else:
            items = ranks.setdefault(e.rank, RankStage(config)).update(e)
        for item in items:
            happened = e.ts - offsets.get(e.node, 0.0)
            p = partition_of(e.node) if partition is None else partition(e)
            arrival = happened + delay_s(e, happened)
            written = arrival - 1e-6 if held_by_producer else happened
            arrivals.append((arrival, seq, p, item, written))
    arrivals.sort(key=lambda a: (a[0], a[1]))
    jobs = JobProcessor(lambda: JobStage(config), **job_side)
    sent: dict = defaultdict(int)
    written = _written_later(arrivals) if reading else {}
    found = []
    tick = arrivals[0][0]
    parts = sorted({a[2] for a in arrivals})

    def reading_of(q, wall):
        behind = written[q][sent[q]] <= wall     # written by now, not read yet
        return Reading(parts=(q,), behind=(q,) if behind else (), of=of)

    def vouch(wall):
        out = []
        for q in parts if reading else ():
            if sent[q] and not (down and down(q, wall)):
                for value in encode_summaries("j", [], reading=reading_of(q, wall)):
                    out += jobs.apply(value, 0, wall)
        return out

    for wall, _, p, item, _ in arrivals:
        while tick <= wall:
            found += vouch(tick)
            found += jobs.advance(tick)
            tick += 1.0
        sent[p] += 1
        said = reading_of(p, wall) if reading else None
        for value in encode_summaries("j", [(p, sent[p], 0, item)], reading=said):
            found += jobs.apply(value, 0, wall)
    for _ in range(120):                 # the job ended: its time-driven checks go on
        found += vouch(tick)
        found += jobs.advance(tick)
        tick += 1.0
    return sorted({(a.kind, tuple(a.ranks), a.step) for a in found if a.TYPE == "anomaly"},
                  key=str), jobs


def _written_later(arrivals) -> dict:
    """partition -> [when the earliest of its items from the i-th on was written]."""
    happened: dict = defaultdict(list)
    for _, _, p, _, written in arrivals:
        happened[p].append(written)
    out = {}
    for p, times in happened.items():
        later = [math.inf] * (len(times) + 1)
        for i in range(len(times) - 1, -1, -1):
            later[i] = min(times[i], later[i + 1])
        out[p] = later
    return out


def offline(events) -> list:
    engine, _ = analyze_events(events)
    return sorted({(i["kind"], tuple(i["ranks"])) for i in engine.incidents()}, key=str)


def lagging_partition(steps: int):
    """From step 20 on, partition 0's rank worker falls behind (it reads at half the rate
    the job writes) until its records arrive ``steps`` steps late. (A partition not heard of
    at all cannot hold the job's clock back: from the job's start, it would be late.)"""
    start = []

    def delay(e, happened):
        if not start:
            if e.TYPE != "step" or e.step < 20:
                return 0.0
            start.append(happened)
        if partition_of(e.node) != 0:
            return 0.0
        return min(steps * STEP_TIME, (happened - start[0]) / 2)
    return delay


def bursting_machine(node: str, every: int):
    """``node``'s collector sends what it has every ``every`` steps."""
    period = every * STEP_TIME
    return lambda e, happened: (period - happened % period) if e.node == node else 0.0


FAULTS = {
    "straggler": Fault(kind="straggler", step=80, ranks=(5,), factor=2.0),
    "loss_spike": Fault(kind="spike", step=120, factor=3.0),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("arrival", ["lagging-partition-10", "lagging-partition-25",
                                     "bursting-machine-8"])
def test_records_that_arrive_late_still_count_toward_their_steps(fault, arrival):
    events, _ = generate(shape(FAULTS[fault]))
    in_order, _ = online(events, lambda e, happened: 0.0)
    delay = {"lagging-partition-10": lagging_partition(10),
             "lagging-partition-25": lagging_partition(25),
             "bursting-machine-8": bursting_machine("n2", 8)}[arrival]
    lagged, jobs = online(events, delay)
    assert lagged == in_order, (lagged, in_order)
    assert {(k, r) for k, r, _ in in_order} == set(offline(events))
    assert fault in {k for k, _, _ in lagged}
    stage = jobs.state.slots[b"j"].stage
    assert stage.steps.late == 0


def test_a_healthy_job_whose_partition_lags_raises_nothing():
    events, _ = generate(shape())
    assert online(events, lagging_partition(25))[0] == []


def test_a_partition_further_behind_than_the_window_is_waited_for():
    """The job side applies its items in the job's time order up to the slowest partition
    (``JobProcessor.apply``): a partition 40 steps behind (more than ``step_window``) holds
    the others' items back, its records are not late, and the NaN is its rank's."""
    events, _ = generate(shape(Fault(kind="nan", step=150, ranks=(6,))))
    found, jobs = online(events, lagging_partition(40))
    assert ("nan", (6,), 150) in found
    assert jobs.state.slots[b"j"].stage.steps.late == 0
    assert online(events, lambda e, happened: 0.0)[0] == found


def test_beyond_the_window_records_are_late_and_still_checked_for_nan():
    """With too little room to hold the others' items (``max_held``), a partition 40 steps
    behind sends records of steps already closed: late, counted, and checked for NaN."""
    events, _ = generate(shape(Fault(kind="nan", step=150, ranks=(6,))))
    found, jobs = online(events, lagging_partition(40), max_held=50)
    assert ("nan", 150) in {(k, step) for k, _, step in found}    # (the blame may differ:
    # the job's other ranks' NaN of step 150 came in time, rank 6's first one did not)
    assert jobs.state.slots[b"j"].stage.steps.late > 0 and jobs.released_early > 0
    assert {k for k, _, _ in found} <= {"nan", "straggler", "throughput_drop", "silent"}, found


@pytest.mark.parametrize("offset", [60.0, -60.0])
def test_a_clock_a_minute_off_on_a_lagging_partition_still_names_its_slow_rank(offset):
    sc = Scenario(name="lagged-skew", dp=16, per_node=4, step_time=STEP_TIME, steps=200,
                  checkpoint_every=0, seed=11, clock_offsets={"n2": offset},
                  faults=(FAULTS["straggler"],))
    events, _ = generate(sc)
    found, jobs = online(events, lagging_partition(10), sc.clock_offsets)
    assert [(k, r) for k, r, _ in found] == [("straggler", (5,))], found
    assert jobs.state.slots[b"j"].stage.steps.late == 0


def _rec(rank, step, job="j"):
    return {"k": "step", "job": job, "rank": rank, "ts": float(step), "step": step}


def test_after_a_restart_with_no_world_size_a_step_waits_for_every_rank_again():
    from trainguard.detectors.stages import StepAggregator

    agg = StepAggregator(window=8)
    for s in range(10):
        for r in range(4):
            agg.add(_rec(r, s))
    agg.life({"event": "start"})                  # a restart; no world_size in the start
    closed = []
    for s in range(5, 9):                         # resumed from step 5
        for r in range(4):
            closed += agg.add(_rec(r, s))
    assert [sorted(js["ranks"]) for js in closed] == [[0, 1, 2, 3]] * 4
    assert agg.late == 0


def test_a_rank_that_stops_reporting_holds_its_peers_steps_one_window_at_most():
    from trainguard.detectors.stages import StepAggregator

    agg = StepAggregator(window=4)
    agg.life({"event": "start", "world_size": 3})
    for s in range(3):
        for r in range(3):
            agg.add(_rec(r, s))
    closed = []
    for s in range(3, 20):                        # rank 2 stops; ranks 0 and 1 go on
        for r in range(2):
            closed += [(js["step"], s) for js in agg.add(_rec(r, s))]
    assert closed == [(step, step + 4) for step in range(3, 16)]   # 4 steps late, in order
    assert len(agg._open) <= 5



def test_ranks_whose_records_are_still_on_their_way_are_not_silent():
    """Issue 21, two workers catching up on a backlog: one went 20 s of the job's time further
    than the other. The ranks the other reads are not missing while their records are on
    their way: the silent (and crash) detectors judge up to the time every telemetry
    partition was heard (``steps_now``, the worker's lowest partition), not the newest."""
    stage = JobStage()
    for t in range(100, 121):
        for rank in range(4):
            if rank < 2 or t <= 100:          # n2's ranks: read up to t=100 so far
                stage.update({"k": "hb", "job": "j", "rank": rank, "node": f"n{1 + rank // 2}",
                              "ts": float(t), "step": 1, "phase": "forward",
                              "phase_since": 99.0})
        assert stage.advance(float(t), steps_now=100.5) == []
    found = stage.advance(121.0, steps_now=121.0)      # heard up to now: n2 is gone
    assert [(a.kind, a.ranks, a.nodes) for a in found] == [("silent", [2, 3], ["n2"])]

def test_a_lost_machine_on_a_partition_read_behind_is_still_named_alone():
    events, _ = generate(shape(Fault(kind="machine", step=150, node="n2")))
    found, _ = online(events, lagging_partition(40))
    assert ("silent", (4, 5, 6, 7), None) in found
    assert {kind for kind, _, _ in found} <= {"silent", "hang"}, found


def recording_job_side() -> tuple:
    """A job side that records ``(rank, ts)`` of each item it applies, and ``send(p, offset,
    times, wall, reading=None)``: heartbeats at ``times`` of rank ``p``, on partition ``p``."""
    applied = []

    class Stage(JobStage):
        def update(self, item, clocked=False):
            applied.append((item["rank"], item["ts"]))
            return super().update(item, clocked)

    jobs = JobProcessor(Stage, advance_every_s=None)

    def send(p, offset, times, wall, reading=None):
        items = [(p, offset + n, 0, {"k": "hb", "job": "j", "rank": p, "node": f"n{p}",
                                     "ts": t, "step": 1, "phase": "forward",
                                     "phase_since": 99.0}) for n, t in enumerate(times)]
        for value in encode_summaries("j", items, reading=reading):
            jobs.apply(value, 0, wall)

    return jobs, applied, send


@pytest.mark.parametrize("node", ["n2", "n1"])      # on the partition behind, or not
def test_a_silence_judged_behind_a_partition_is_stamped_as_analyze_stamps_it(node):
    """The silent detector judges absence up to the time every partition was heard (a
    partition read behind still brings its ranks' records); its finding is stamped at that
    time, so online it carries the detection time ``analyze`` gives, within the second at
    which the detector looks (before, the newest time: 3.5 and 4.5 s later here, 3 s later
    through the broker with two workers)."""
    events, _ = generate(shape(Fault(kind="machine", step=150, node=node)))

    def stamps(jobs):
        return [i["detected_ts"] for i in jobs.state.slots[b"j"].stage.incidents()
                if i["kind"] == "silent"]

    [in_order] = stamps(online(events, lambda e, happened: 0.0)[1])
    [lagged] = stamps(online(events, lagging_partition(10))[1])
    assert abs(lagged - in_order) <= 1.0     # the detector looks once a second


def test_a_silence_decided_after_the_partitions_jumped_ahead_keeps_analyze_s_stamp():
    """The 256-rank job with four faults, its backlog read by rank workers of 24 partitions:
    the lost machine stops the job's collectives, its peers send only a heartbeat every few
    seconds, and the time up to which every partition was heard lags the newest by a second
    or more; the detector then looks next only when the job restarts, seconds later. Its
    finding is stamped at the look of the grid just after the machine's silence reached
    ``timeout_s`` (its ranks heard as analyze hears them), as ``analyze`` stamps it: before,
    3.5 s later here, and 2.5 to 3 s later through the broker with two workers at 4,096
    ranks."""
    from scenario_library import large_job

    events, _ = generate(large_job(8))
    engine, _ = analyze_events(events)
    [offline_stamp] = [i["detected_ts"] for i in engine.incidents() if i["kind"] == "silent"]
    _, jobs = online(events, backlog(), reading=True, partition=by_rank, of=24)
    assert [i["detected_ts"] for i in jobs.state.slots[b"j"].stage.incidents()
            if i["kind"] == "silent"] == [offline_stamp]


def test_the_job_side_applies_items_in_time_order_up_to_the_slowest_partition():
    """Two rank workers, one ahead of the other: what the one ahead sends waits until the
    other reached its time (or went quiet for ``hold_idle_s``), and goes in time order."""
    jobs, applied, send = recording_job_side()
    send(0, 0, [100.0], wall=1.0)
    send(1, 0, [100.0, 104.0, 108.0], wall=1.0)         # partition 1 runs ahead
    assert applied == [(0, 100.0), (1, 100.0)]
    send(0, 1, [103.0, 106.0], wall=2.0)                # partition 0 catches up
    assert applied[2:] == [(0, 103.0), (1, 104.0), (0, 106.0)]
    send(1, 3, [112.0], wall=3.0)                        # partition 0 stays quiet ...
    assert applied[5:] == []
    jobs.advance(4.5)                                    # ... for longer than hold_idle_s
    assert applied[5:] == [(1, 108.0), (1, 112.0)]
    assert jobs.state.slots[b"j"].held == []


def test_a_partition_its_worker_said_is_behind_holds_the_others_while_quiet():
    """A rank worker says with each message which of its partitions still have records to
    read: one that is behind holds the others back while it sends nothing (a worker paused
    in a backlog), within ``unread_s``; once caught up, as before (``hold_idle_s``)."""
    jobs, applied, sent = recording_job_side()

    def send(p, offset, times, wall, behind):
        sent(p, offset, times, wall, Reading(parts=(p,), behind=(p,) if behind else ()))

    send(0, 0, [100.0], wall=100.0, behind=True)
    send(1, 0, [100.0, 104.0, 108.0], wall=100.0, behind=False)
    assert applied == [(0, 100.0), (1, 100.0)]
    jobs.advance(108.0)                   # partition 0 quiet for 8 s, but behind: it waits
    assert applied[2:] == []
    assert jobs.state.slots[b"j"].now(108.0) == 104.0   # the job's clock waits at 104 too
    send(0, 1, [], wall=109.0, behind=False)            # caught up: nothing more of it
    assert applied[2:] == [(1, 104.0), (1, 108.0)]
    send(0, 1, [], wall=109.5, behind=True)             # behind again, and quiet ...
    send(1, 3, [120.0], wall=109.5, behind=False)
    jobs.advance(279.5)                                 # ... for unread_s (180 s)
    assert applied[4:] == []
    jobs.advance(280.5)                                 # ... and more: on it goes
    assert applied[4:] == [(1, 120.0)]


def backlog(pause_s: float = 0.0, at_s: float = 0.0, speed: float = 100.0):
    """A recording read ``speed`` times faster than it was written, starting a minute after
    it ended, by two rank workers (one per partition); the second pauses ``pause_s`` of wall
    time when it reached ``at_s`` of the job (a snapshot, a collection, a rebalance)."""
    first = []

    def delay(e, happened):
        if not first:
            first.append(happened)
        arrival = LAST_WRITTEN + (happened - first[0]) / speed
        paused = LAST_WRITTEN + at_s / speed
        if partition_of(e.node) == 1 and paused <= arrival < paused + pause_s:
            arrival = paused + pause_s
        return arrival - happened
    return delay


LAST_WRITTEN = 2.0e9


@pytest.mark.parametrize("pause_s", [4.0, 150.0])
def test_a_rank_worker_that_pauses_in_a_backlog_lets_nothing_go_first(pause_s):
    """Issue 21's four faults in a 256-rank job, read as a backlog by two rank workers, one of
    which pauses for seconds around the restart: the same anomalies as without the pause,
    whether it says meanwhile that it is behind or says nothing. Before the workers said
    which partitions they were behind on, the other worker's items went on after 2 s
    (``hold_idle_s``): its ranks' exits of our restart came before the launcher's word of it:
    a false critical crash naming many healthy ranks (a restart and an eviction) and a false
    "stopped from outside". Until the held items waited ``unread_s`` (30 s) for a partition
    said to be behind, instead of ``source_idle_s`` (10 s), a pause of 12 to 28 s did the
    same, and also hid the lost machine and named no rank of the hangs; until ``unread_s``
    was 180 s, a pause of 40 s or more did (a rebalance restores a worker's state for up to
    two minutes)."""
    from scenario_library import large_job

    events, _ = generate(large_job(8))
    in_order, _ = online(events, backlog(), reading=True)
    assert {kind for kind, _, _ in in_order} == {"straggler", "hang", "silent", "nan"}
    paused = backlog(pause_s, at_s=61.0)
    assert online(events, paused, reading=True)[0] == in_order
    start = LAST_WRITTEN + 61.0 / 100.0

    def mute(p, wall):                   # the paused worker says nothing either
        return p == 1 and start <= wall < start + pause_s
    assert online(events, paused, reading=True, down=mute)[0] == in_order
    unsaid, _ = online(events, paused)
    assert [r for kind, r, _ in unsaid if kind == "crash"], unsaid


def test_a_first_message_of_many_steps_waits_for_the_partitions_of_the_other_ranks():
    """A rank worker's first message of a backlog holds seconds of its ranks' steps. The
    world size of the starts in it (before they are applied) and the topic's partition
    count say which other partitions carry the job's ranks: its steps wait for them. Before,
    through the broker at 256 ranks, 17 ranks' first 27 steps closed alone, and the other
    239 ranks' steps were taken for a restart: 768 late records and a missed lost machine."""
    from trainguard import events as ev
    from trainguard.detectors.parallel import event_key, murmur2

    def partition(e):
        return (murmur2(event_key(e)) & 0x7FFFFFFF) % 2      # ranks 3 and 5 on partition 1

    events = [ev.Lifecycle(job="j", ts=99.0, node=f"n{r // 4}", rank=r, event="start",
                           world_size=8, local_rank=r % 4, pid=100 + r) for r in range(8)]
    events += [ev.Step(job="j", ts=100.0 + s, node=f"n{r // 4}", rank=r, step=s, step_time=1.0,
                       compute_time=0.8) for s in range(12) for r in range(8)]
    sizes = []

    class Stage(JobStage):
        def _jobstep(self, jobstep):
            sizes.append(len(jobstep["ranks"]))
            return super()._jobstep(jobstep)

    jobs = JobProcessor(Stage, advance_every_s=0.5)
    ranks: dict = {}
    for p, wall in ((0, 200.0), (1, 201.0)):         # partition 1's worker begins a second later
        items = [(p, n, 0, item) for n, e in enumerate(x for x in events if partition(x) == p)
                 for item in ranks.setdefault(e.rank, RankStage()).update(e)]
        for value in encode_summaries("j", items, reading=Reading(parts=(p,), behind=(), of=2)):
            jobs.apply(value, 0, wall)
    assert jobs.state.slots[b"j"].stage.steps.late == 0
    assert len(sizes) >= 11 and set(sizes) == {8}, sizes


def by_rank(e) -> int:
    """The telemetry partition of 24 that the collectors' key puts ``e`` on."""
    from trainguard.detectors.parallel import event_key, murmur2

    return (murmur2(event_key(e) or e.job.encode()) & 0x7FFFFFFF) % 24


@pytest.mark.parametrize("late_s", [3.0, 90.0])
def test_a_rank_worker_that_starts_late_on_a_backlog_lets_nothing_go_first(late_s):
    """The same job's backlog, its ranks spread over 24 partitions by their key: the workers
    of the odd partitions start ``late_s`` of wall time after the others (300 to 2,500 s of
    the job). The job side knows from the world size and the topic's partition count which
    partitions carry the job's ranks, and waits for those not heard of yet (within
    ``unread_s`` of the job's first message; ``source_idle_s`` until a 15 s late start gave
    a false crash and named the lost machine without three of its ranks, and 30 s until
    2026-12-06), unless their
    worker said it read them to the end. Before, nothing waited for a partition not heard
    of: the false crashes again, and a lost machine named without two of its ranks."""
    from scenario_library import large_job

    events, _ = generate(large_job(8))
    first = events[0].ts

    def late(e, happened):
        arrival = LAST_WRITTEN + (happened - first) / 100 + (late_s if by_rank(e) % 2 else 0)
        return arrival - happened

    in_order, _ = online(events, backlog(), reading=True, partition=by_rank, of=24)
    assert online(events, late, reading=True, partition=by_rank, of=24)[0] == in_order
    unknown, _ = online(events, late, reading=True, partition=by_rank)     # no "of"
    assert [r for kind, r, _ in unknown if kind == "crash"], unknown


RESTARTING = [sc for sc in HEALTHY if sc.name.startswith(("resume-", "own-restart-", "mixed-"))]


@pytest.mark.parametrize("sc", RESTARTING, ids=[sc.name for sc in RESTARTING])
def test_healthy_jobs_that_restart_raise_nothing_with_a_partition_read_behind(sc):
    """The library's healthy resumes, own restarts and mixed shapes, one partition read up to
    5 s behind: nothing. (Before the job side held what came ahead, four of them raised a
    false hang online, one naming a whole machine; every one of the 115 healthy shapes, with
    a lagging partition or a bursting machine, raises nothing now.)"""
    events, _ = generate(sc)
    assert online(events, lagging_partition(10))[0] == []


def test_a_partition_that_stays_behind_holds_the_others_for_source_idle_s_at_most():
    """A machine whose clock offset is not learned yet (or learned wrong) looks like a
    partition that stays behind while it sends: what the others send goes on after
    ``source_idle_s`` (10 s) of wall time, as it did before the job side held anything."""
    jobs = JobProcessor(JobStage, advance_every_s=None)

    def send(p, offset, ts, wall):
        item = {"k": "hb", "job": "j", "rank": p, "node": f"n{p}", "ts": ts, "step": 1,
                "phase": "forward", "phase_since": 99.0}
        for value in encode_summaries("j", [(p, offset, 0, item)]):
            jobs.apply(value, 0, wall)

    for second in range(12):
        send(0, second, 100.0, wall=float(second))          # stuck at 100
        send(1, second, 110.0 + second, wall=float(second))
    held = jobs.state.slots[b"j"].held
    assert sorted(round(h[0]) for h in held) == list(range(111, 122))   # 110 waited 11 s
    assert jobs.released_early == 1


def worker_gone(gone_s: float, at_s: float):
    """Live, the rank worker of partition 1 is gone for ``gone_s`` from ``at_s`` of the job:
    killed (its partition moves to another worker after ``session_timeout_s``, which reads
    on from the last commit) or stalled. ``(delay, down)`` for :func:`online`."""
    first = []

    def delay(e, happened):
        if not first:
            first.append(happened)
        since = happened - first[0]
        if partition_of(e.node) == 1 and at_s <= since < at_s + gone_s:
            return at_s + gone_s - since
        return 0.0

    def down(p, wall):
        return p == 1 and bool(first) and at_s <= wall - first[0] < at_s + gone_s
    return delay, down


GONE_SHAPES = ("plain-120.0s", "checkpoints-0.05s", "user-phase-30.0s", "mixed-1",
               "shared-cpu-noise-2.0s", "loader-stalls-600.0s")


@pytest.mark.parametrize("gone_s", [12.0, 170.0])
def test_a_rank_worker_gone_while_caught_up_makes_no_machine_silent_or_job_hung(gone_s):
    """A worker of a group killed while live: its partitions move after the session timeout
    (10 s), their state is restored (up to two minutes) and they are read again. Nobody
    says meanwhile that they are read, so their silence is not their machines': the job is
    judged up to their last records, for up to ``unread_s`` (180 s). Before, 12 s gone
    raised a false ``silent`` for the machines of the partition in 13 of 58 healthy shapes
    and 25 s in most, and a job all on that partition was reported hung (a restart of a
    healthy job); while ``unread_s`` was 30 s, so did 40 s and more."""
    by_name = {sc.name: sc for sc in HEALTHY}
    for name in GONE_SHAPES:
        events, _ = generate(by_name[name])
        delay, down = worker_gone(gone_s, at_s=(events[-1].ts - events[0].ts) / 2)
        assert online(events, delay, reading=True, down=down)[0] == [], name


def test_a_worker_gone_a_minute_around_a_lost_machine_lets_only_the_faults_be_named():
    """Issue 21's 256-rank job with four faults, live; partition 1's worker is gone for 60 s
    from the hung rank's restart on, through the machine's loss (its machine is on that
    partition): the same four faults as without the outage, the lost machine named once its
    partition is read again. While the job side waited 30 s for such a partition and held
    only its judged time, 16 healthy machines were reported silent beside the lost one (an
    eviction of each), and the other partition's exits of trainguard's restart, whose word
    was on the unread partition, a "stopped from outside" warning. Waiting 30 s now, the job
    goes on without the partition after them, and judges none of its ranks until it is read
    again: nothing false, the lost machine named (its hang, over by then, is not)."""
    from scenario_library import large_job

    events, _ = generate(large_job(8))
    in_order, _ = online(events, lambda e, happened: 0.0, reading=True)
    delay, down = worker_gone(60.0, at_s=60.0)
    assert online(events, delay, reading=True, down=down)[0] == in_order
    short, _ = online(events, delay, reading=True, down=down, unread_s=30.0)
    assert set(short) <= set(in_order) and ("silent", tuple(range(168, 176)), None) in short


def test_the_partitions_nobody_says_it_reads_are_counted_while_they_hold_a_job():
    """``trainguard_unread_partitions``: partition 1's worker gone 25 s in the middle of a
    healthy job: counted once it is silent for ``source_idle_s``, until it is read again."""
    events, _ = generate({sc.name: sc for sc in HEALTHY}["plain-120.0s"])
    half = (events[-1].ts - events[0].ts) / 2
    delay, down = worker_gone(25.0, at_s=half)
    seen = {}
    advance = JobProcessor.advance

    def counting(self, now):
        seen[round(now - events[0].ts)] = self.unread_partitions(now)
        return advance(self, now)
    JobProcessor.advance = counting
    try:
        assert online(events, delay, reading=True, down=down)[0] == []
    finally:
        JobProcessor.advance = advance
    counted = sorted(t for t, parts in seen.items() if parts)
    assert all(seen[t] == {1} for t in counted), seen
    # from source_idle_s (10 s) after the partition's last record (a heartbeat summary
    # comes every 5 s) until its worker's successor reads it again
    assert counted and half + 5 <= counted[0] <= half + 11 and counted[-1] <= half + 26, \
        (half, counted)


def test_a_machine_lost_behind_a_worker_that_says_it_reads_is_found_as_before():
    """The live workers say every second which partitions they read: a partition gone quiet
    behind such a worker is its machines' silence, judged as without the workers' word."""
    from scenario_library import large_job

    events, _ = generate(large_job(8))
    said, _ = online(events, lambda e, happened: 0.0, reading=True)
    unsaid, _ = online(events, lambda e, happened: 0.0)
    assert said == unsaid and "silent" in {kind for kind, _, _ in said}, (said, unsaid)
