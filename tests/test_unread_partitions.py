"""What the job side takes for a telemetry partition that nobody reads, and what it does not.

A partition that went silent while no rank worker says it reads it holds its job back for
up to ``worker.unread_partition_s`` (its worker killed or stalled, its partitions moving to
another worker that reads their state back). A partition whose ranks merely went quiet must
not pass for one: its worker keeps saying it reads it, also after a move
(``tests/test_streams_ranks.py``), and what the workers said before a job's state was
loaded again is not taken as said of that job.
"""
from __future__ import annotations

import pytest

from scenario_library import HEALTHY
from scenarios import Fault, Scenario, generate
from test_steps_by_number import LAST_WRITTEN, online, partition_of, worker_gone
from test_steps_by_number import by_rank as by_key
from trainguard.detectors import JobStage
from trainguard.streams.logic import Reading, encode_summaries
from trainguard.streams.processors import JobProcessor


def _job_side(plain: bool = False, **kwargs):
    """``(jobs, applied, send)``: ``applied`` records ``(rank, ts)`` of each item applied
    (not with ``plain``, whose stage is a JobStage, which snapshots)."""
    applied = []

    class Stage(JobStage):
        def update(self, item, clocked=False):
            applied.append((item["rank"], item["ts"]))
            return super().update(item, clocked)

    jobs = JobProcessor(JobStage if plain else Stage, advance_every_s=None, **kwargs)

    def send(p, offset, times, wall, job="j"):
        items = [(p, offset + n, 0, {"k": "hb", "job": job, "rank": p, "node": f"n{p}",
                                     "ts": t, "step": 1, "phase": "forward",
                                     "phase_since": 99.0}) for n, t in enumerate(times)]
        for value in encode_summaries(job, items, reading=Reading(parts=(p,), behind=())):
            jobs.apply(value, 0, wall)

    return jobs, applied, send


def test_a_job_loaded_again_waits_for_no_partition_it_was_told_of_before():
    """A job's state evicted as idle and loaded when it speaks again, in a worker that had
    heard the rank workers' words before: partition 1, whose ranks went quiet long before,
    last said to be read before the load, does not hold partition 0's items. Before, its
    word from before the load counted as not said since, so it passed for a partition
    nobody reads: the job's items waited ``unread_s`` (180 s)."""
    jobs, _, send = _job_side(evict_idle_s=60.0, plain=True)   # a stage that snapshots
    send(0, 0, [100.0], wall=100.0)
    send(1, 0, [100.0], wall=100.0)
    for wall in range(101, 111):                # partition 1's worker says it reads it
        send(1, 1, [], wall=float(wall))
        send(0, wall - 100, [float(wall)], wall=float(wall))
    jobs.evict(200.0)
    assert b"j" not in jobs.state.slots and b"j" in jobs.state.saved
    applied = jobs.applied
    send(0, 20, [1000.0], wall=1000.0)           # it speaks again; partition 1 stays quiet
    send(0, 21, [1012.0], wall=1012.0)
    jobs.advance(1012.5)
    assert jobs.applied == applied + 2 and jobs.state.slots[b"j"].held == []
    assert jobs.unread_partitions(1012.5) == set()


def test_a_job_moved_here_still_waits_for_a_partition_whose_worker_went_with_its_own():
    """The worker that ran job ``j``'s job side and partition 1's rank side is killed: the
    survivor loads ``j``'s state as its summaries partition moves there (``load_saved``).
    What the rank workers said before the load stands for such a job (it was not idle):
    partition 1, last said to be read before its worker died, holds ``j`` until it is read
    again. Taken as never told of, it would let partition 0's items and the job's clock
    run on while partition 1 is restored elsewhere: the false silent machines again."""
    dead, _, send_dead = _job_side(plain=True)
    send_dead(0, 0, [100.0], wall=100.0)
    send_dead(1, 0, [100.0], wall=100.0)
    survivor, _, send = _job_side(plain=True)
    send(1, 0, [100.0], wall=100.0, job="k")        # it heard partition 1's worker too
    for key, _, blob in dead.snapshot():
        survivor.restore(key, blob)
    assert survivor.load_saved({0}, now=101.0) == 1
    applied = survivor.applied
    for wall in range(101, 131):
        send(0, wall - 100, [float(wall)], wall=float(wall))
    survivor.advance(130.5)
    assert survivor.applied - applied <= 2 and 1 in survivor.unread_partitions(130.5)


def test_a_partition_nobody_reads_holds_the_job_until_its_successor_reads_it():
    """Live, partition 1's worker is gone (no word of it since its last record): partition
    0's items wait, up to ``unread_s``, and go on in time order once partition 1 is read
    again."""
    jobs, applied, send = _job_side(unread_s=180.0)
    send(0, 0, [100.0], wall=100.0)
    send(1, 0, [100.0], wall=100.0)
    for wall in range(101, 161):
        send(0, wall - 100, [float(wall)], wall=float(wall))
    assert jobs.unread_partitions(160.0) == {1}
    assert applied == [(0, 100.0), (1, 100.0), (0, 101.0)]
    send(1, 1, [111.5, 130.0, 155.0], wall=161.0)     # its successor reads it again
    times = [ts for _, ts in applied]
    assert times == sorted(times) and applied[-3:] == [(0, 155.0), (1, 155.0), (0, 156.0)]
    assert jobs.unread_partitions(161.0) == set()


# -- past the bound: the job goes on without the partition, and does not judge its ranks --------
LONG_GONE_SHAPES = ("plain-120.0s", "ckpt-rank0-6.0s", "own-restart-6.0s", "own-restart-0.05s",
                    "mixed-2")


def read_back_slowly(gone_s: float, at_s: float, speed: float):
    """:func:`worker_gone`, but the successor reads the partition's backlog at ``speed``
    times the rate it was written (a second of the job at most per record: a stopped job
    wrote nothing meanwhile), and what is written after it caught up as it comes."""
    first, reader = [], {}

    def delay(e, happened):
        if not first:
            first.append(happened)
        since = happened - first[0]
        if partition_of(e.node) != 1 or since < at_s:
            return 0.0
        last, at = reader.get("last", since), reader.get("at", at_s + gone_s)
        reader["last"], reader["at"] = since, max(since, at + min(since - last, 1.0) / speed)
        return reader["at"] - since

    _, down = worker_gone(gone_s, at_s)
    return delay, down


@pytest.mark.parametrize("gone_s, speed", [(300.0, None), (900.0, None), (300.0, 1.3)])
def test_a_rank_worker_gone_longer_than_the_job_waits_makes_no_machine_silent_or_job_hung(
        gone_s, speed):
    """Partition 1's rank worker gone for longer than ``unread_s`` (a pod that takes minutes
    to come back, a crash loop): the job goes on without the partition, and its ranks are
    not judged silent, their tear-downs not decided and the job not judged hung until it is
    read to the end again (``speed``: its successor reads the backlog that much faster than
    it was written, instead of at once). Before, 300 s gone raised a false ``silent`` (an
    eviction) in every healthy shape of the library with more than one machine (86 of 86
    long enough), a "stopped from outside" warning in six (trainguard's own restart, whose
    word was on the partition) and a false ``hang`` in two (ranks waiting on a rank 0 that
    checkpointed there)."""
    by_name = {sc.name: sc for sc in HEALTHY}
    for name in LONG_GONE_SHAPES:
        events, _ = generate(by_name[name])
        delay, down = (worker_gone(gone_s, at_s=30.0) if speed is None
                       else read_back_slowly(gone_s, 30.0, speed))
        assert online(events, delay, reading=True, down=down)[0] == [], name


def _gone_by_rank(gone_s: float, at_s: float):
    """:func:`worker_gone` with the collectors' keying by rank: partition 1 carries the odd
    ranks (of every machine)."""
    first = []

    def delay(e, happened):
        if not first:
            first.append(happened)
        since = happened - first[0]
        return at_s + gone_s - since if by_rank(e) == 1 and at_s <= since < at_s + gone_s \
            else 0.0

    def down(p, wall):
        return p == 1 and bool(first) and at_s <= wall - first[0] < at_s + gone_s
    return delay, down


def by_rank(e) -> int:
    return (e.rank or 0) % 2


@pytest.mark.parametrize("keyed", ["machine", "rank"])
def test_a_machine_lost_while_a_partition_is_unread_is_named_all_the_same(keyed):
    """A machine lost 80 s into a 5-minute outage of partition 1's worker, and not replaced:
    named as in order. With the collectors' keying by rank, its ranks on the partition still
    read name it during the outage (``silent`` of its even ranks, the machine with them), the
    rest once the partition is read again; with a machine's ranks all on the unread
    partition, once it is read again."""
    events, _ = generate(Scenario(
        name="lost-in-outage", tp=1, pp=1, dp=16, per_node=4, steps=400, step_time=1.0,
        first_step_s=5.0, seed=7,
        faults=(Fault(kind="machine", step=100, node="n1", restart_after_s=400.0),)))
    partition = by_rank if keyed == "rank" else None
    in_order, _ = online(events, lambda e, happened: 0.0, reading=True, partition=partition)
    assert ("silent", (0, 1, 2, 3), None) in in_order
    delay, down = (_gone_by_rank if keyed == "rank" else worker_gone)(300.0, at_s=20.0)
    found, _ = online(events, delay, reading=True, down=down, partition=partition)
    during = [("silent", (0, 2), None)] if keyed == "rank" else []
    assert found == sorted(in_order + during, key=str), found


def _send_ranks(jobs, p, ranks, offset, ts, wall, said=True, job="j", behind=False):
    items = [(p, offset + n, 0, {"k": "hb", "job": job, "rank": r, "node": f"n{r}", "ts": ts,
                                 "step": 1, "phase": "forward", "phase_since": 99.0})
             for n, r in enumerate(ranks)]
    reading = Reading(parts=(p,), behind=(p,) if behind else (), of=24) if said else None
    for value in encode_summaries(job, items, reading=reading):
        jobs.apply(value, 0, wall)


def test_a_partition_whose_worker_saw_its_ranks_go_quiet_is_judged_not_unseen():
    """A rank worker that kept saying it reads partition 1 for a minute after its last
    record saw its ranks go quiet (a lost machine alone there): when its words stop (it
    vouches for ``vouch_for_s`` after it last fed the job), the ranks are not unseen, and
    their silence stays theirs. A worker whose words stopped with its records (killed) leaves
    them unseen once ``unread_s`` passed."""
    for vouched_s, unseen in ((60, frozenset()), (0, frozenset({1}))):
        jobs = JobProcessor(JobStage, advance_every_s=None, unread_s=180.0)
        for wall in range(100, 500):
            _send_ranks(jobs, 0, [0], wall - 100, float(wall), float(wall))
            if wall == 100:
                _send_ranks(jobs, 1, [1], 0, 100.0, 100.0)
            elif wall <= 100 + vouched_s:
                _send_ranks(jobs, 1, [], 1, float(wall), float(wall))     # a word alone
            jobs.advance(wall + 0.5)
        slot = jobs.state.slots[b"j"]
        if unseen:         # and the launcher's word, whose partition is not known here
            unseen = unseen | {None}
        assert jobs.watch.unseen("j", slot, 499.5) == unseen, vouched_s
        assert slot.stage.view.unseen == unseen
        assert jobs.watch.unseen_ranks() == len(unseen - {None})


def test_the_ranks_of_a_partition_nobody_reads_are_known_without_their_items():
    """A job side that took the job over (its state loaded, nothing of the unread partition
    heard since) finds the ranks on it by the collectors' murmur2 partition of
    ``job/rank`` (ranks 0-3 of ``j`` are on partitions 14, 20, 8 and 21 of 24)."""
    jobs = JobProcessor(JobStage, advance_every_s=None, unread_s=180.0)
    _send_ranks(jobs, 14, [0], 0, 100.0, 100.0)
    _send_ranks(jobs, 20, [1], 0, 100.0, 100.0)
    _send_ranks(jobs, 8, [2], 0, 100.0, 100.0)
    for wall in range(101, 300):
        _send_ranks(jobs, 14, [0], wall - 100, float(wall), float(wall))
        _send_ranks(jobs, 20, [1], wall - 100, float(wall), float(wall))
    jobs.advance(300.0)
    slot = jobs.state.slots[b"j"]
    assert jobs.watch.unseen("j", slot, 300.0) == {2}
    jobs.watch.rank_parts.clear()                 # as after a takeover
    assert jobs.watch.unseen("j", slot, 301.0) == {2}
    assert jobs.unread_partitions(301.0) == {8}


def test_a_successor_that_stays_behind_leaves_the_ranks_unseen_for_a_bounded_time():
    """Partition 1's worker gone at 100 s; its successor reads it again from 400 s on and
    keeps saying it is behind (a pool short of workers): its ranks stay unseen while it says
    so, for ``unread_s`` at most, and are judged again after that; the same when it stops
    saying anything."""
    for says_behind in (True, False):
        jobs = JobProcessor(JobStage, advance_every_s=None, unread_s=180.0)
        slot = None
        seen = {}
        for wall in range(100, 700):
            _send_ranks(jobs, 0, [0], wall - 100, float(wall), float(wall))
            if wall == 100 or wall >= 400:
                _send_ranks(jobs, 1, [1], wall - 99, float(wall), float(wall),
                            said=says_behind or wall == 100, behind=wall >= 400)
            jobs.advance(wall + 0.5)
            slot = jobs.state.slots[b"j"]
            seen[wall] = jobs.watch.unseen("j", slot, wall + 0.5) - {None}   # ranks only
        assert seen[350] == {1} and seen[399] == {1}
        if says_behind:
            assert seen[579] == {1} and seen[582] == set()
        else:
            assert seen[401] == set()


def test_a_rank_that_vanishes_while_another_partition_is_unseen_is_still_a_crash():
    """Only the launcher's word (of a restart of ours) lets a tear-down wait for an unseen
    partition: a rank SIGKILLed (no exit) on a partition still read, its peers torn down by
    torchrun, is a crash while another partition's ranks are unseen."""
    stage = JobStage()
    for t in range(100, 130):
        for r in range(4):
            stage.update({"k": "step", "job": "j", "rank": r, "node": f"n{r // 2}",
                          "ts": float(t), "step": t - 100, "step_time": 1.0})
        stage.advance(float(t) + 0.5, unseen=frozenset({3}))
    for r in (0, 2):                         # rank 1 vanished; torchrun stops the rest
        stage.update({"k": "life", "job": "j", "rank": r, "node": f"n{r // 2}", "ts": 130.5,
                      "event": "exit", "exit_code": None, "signal": "SIGTERM", "step": 29})
    found = []
    for t in range(131, 140):
        found += stage.advance(float(t), unseen=frozenset({3}))
    assert [(a.kind, a.ranks) for a in found] == [("crash", [1])]
    launcher = JobStage()                    # ... and with the launcher's partition unseen
    for item in [{"k": "step", "job": "j", "rank": r, "node": "n0", "ts": 100.0, "step": 0,
                  "step_time": 1.0} for r in range(2)]:
        launcher.update(item)
    launcher.update({"k": "life", "job": "j", "rank": 0, "node": "n0", "ts": 100.5,
                     "event": "exit", "exit_code": None, "signal": "SIGTERM", "step": 0})
    assert sum((launcher.advance(float(t), unseen=frozenset({None})) for t in range(101, 140)),
               []) == []


def test_a_hang_is_declared_once_an_unseen_rank_cannot_be_pausing_any_more():
    """While a rank is unseen, the job's deadline hang waits for the longest allowance of a
    pause after the rank was last heard (it may checkpoint while the rest wait), not for
    ever; and it does not name the unseen rank, whose heartbeats only look stale (the hang's
    ladder evicts the machines it names)."""
    from trainguard.detectors import DetectorConfig
    from trainguard.setting import with_values

    config = with_values(DetectorConfig(), {f"hang.{name}": 60.0 for name in (
        "checkpoint_s", "eval_s", "phase_s", "first_step_s")})
    hung = {}
    for unseen in (frozenset(), frozenset({3})):
        stage = JobStage(config)
        for t in range(100, 140):
            for r in range(4):
                stage.update({"k": "step", "job": "j", "rank": r, "node": f"n{r // 2}",
                              "ts": float(t), "step": t - 100, "step_time": 1.0})
                stage.update({"k": "hb", "job": "j", "rank": r, "node": f"n{r // 2}",
                              "ts": float(t) + 0.5, "step": t - 100, "phase": "forward",
                              "phase_since": float(t)})
            stage.advance(float(t) + 0.5)
        for t in range(140, 400):             # rank 3 last heard at 139 s
            for r in range(3):
                stage.update({"k": "hb", "job": "j", "rank": r, "node": f"n{r // 2}",
                              "ts": float(t), "step": 39, "phase": "collective",
                              "phase_since": 139.5})
            hangs = [a for a in stage.advance(float(t) + 0.5, unseen=unseen)
                     if a.kind == "hang"]
            if hangs:
                hung[unseen] = (t, hangs[0].ranks)
                break
    assert hung[frozenset()][0] < 139 + 60 <= hung[frozenset({3})][0] <= 139 + 61, hung
    assert hung[frozenset()][1] == [3] and hung[frozenset({3})][1] == [], hung  # not blamed


def test_a_rank_worker_that_starts_later_than_the_job_waits_on_a_backlog_raises_nothing():
    """A backlog read 100 times faster than written, the ranks on 24 partitions by their
    key, the workers of the odd partitions starting 300 s late (more than ``unread_s``): the
    job goes on without them, and what they read later is late. Their ranks' lifecycle
    ``start``, stamped long before steps already closed, is no restart
    (``StepAggregator.life``): taken for one, it reopened step 0 and compared its loss with
    the baseline of the steps after it, a false ``loss_spike`` in 74 of the 112 healthy
    shapes with more than one machine."""
    by_name = {sc.name: sc for sc in HEALTHY}
    for name in ("plain-0.05s", "mixed-7"):
        events, _ = generate(by_name[name])
        first = events[0].ts

        def late(e, happened):
            arrival = LAST_WRITTEN + (happened - first) / 100 + (300.0 if by_key(e) % 2 else 0)
            return arrival - happened
        assert online(events, late, reading=True, partition=by_key, of=24)[0] == [], name


def test_a_job_that_stops_at_once_has_no_silent_machine_when_its_partitions_end_apart():
    """A job killed at once (no exit events): online, a worker applies the last records of
    its partitions up to a second or so apart, so some ranks are heard a moment after the
    others. Those did not go on: the silent detector names nobody (live through the broker,
    a worker restarted in the middle of the job left 9 healthy machines named silent at its
    end). A machine that stops while the rest go on is still named."""
    from trainguard.detectors.liveness import SilentDetector

    def run(last_of):
        d = SilentDetector(timeout_s=15.0)
        found = []
        for t in range(60, 140):
            for r in range(8):
                if t <= last_of(r):
                    d.update({"k": "hb", "rank": r, "node": f"n{r // 4}",
                              "ts": t + (0.7 if r >= 4 else 0.0)})
            found += d.advance(t + 0.5)
        return [(f.nodes, f.ranks) for f in found]
    assert run(lambda r: 100) == []
    assert run(lambda r: 100 if r < 4 else 200) == [(["n0"], [0, 1, 2, 3])]


def _fail_over(events, fail_over_s: float, at: float = 0.5, gap_s: float = 2.0):
    """A broker that led every third of 24 telemetry partitions (the collectors' keying by
    rank) dies ``at`` through the job: records of those partitions made in the next
    ``fail_over_s`` wait in their producers and arrive in order ``gap_s`` after it (the
    producers learn the new leader on their own schedule), and the batch in flight when it
    died comes again. The rank worker does not say it reads them meanwhile, nor for
    ``RETURN_GRACE_S`` after (``LeaderWatch``). ``(events in arrival order, delay,
    leaderless(p, wall))``."""
    import dataclasses

    from trainguard.streams.partition_leaders import MOST_S, RETURN_GRACE_S

    first, last = events[0].ts, events[-1].ts
    fail = first + (last - first) * at
    back = fail + fail_over_s + gap_s
    dead = lambda e: by_key(e) % 3 == 0     # noqa: E731
    out, arrive = [], {}
    for e in events:
        copy = dataclasses.replace(e)
        late = dead(e) and fail <= e.ts < back
        arrive[id(copy)] = back + (e.ts - fail) * 1e-3 if late else e.ts
        out.append(copy)
        if dead(e) and fail - 0.25 <= e.ts < fail:
            again = dataclasses.replace(e)
            arrive[id(again)] = back
            out.append(again)
    out.sort(key=lambda e: arrive[id(e)])
    unsaid = min(fail_over_s + RETURN_GRACE_S, MOST_S)

    def leaderless(p, wall):
        return p % 3 == 0 and fail <= wall < fail + unsaid
    return out, (lambda e, happened: arrive[id(e)] - happened), leaderless


#: healthy shapes in which a 14 s fail-over raised false ``silent``s (their ranks' last
#: summaries came up to 5 s before it, thinned heartbeats of long steps)
FAIL_OVER_SHAPES = ("shared-cpu-noise-2.0s", "mixed-1")


@pytest.mark.parametrize("name", FAIL_OVER_SHAPES)
def test_a_broker_fail_over_makes_no_rank_silent(name):
    """A partition without a connected leader is not said to be read (the rank side's
    ``LeaderWatch``), so the job waits for it. Said to be read, the job went on without
    its ranks and named some ``silent`` 15 s after their last summaries."""
    events, delay, leaderless = _fail_over(generate({sc.name: sc for sc in HEALTHY}[name])[0],
                                           14.0)
    said, _ = online(events, delay, reading=True, partition=by_key, of=24,
                     held_by_producer=True)
    assert said and {kind for kind, _, _ in said} == {"silent"}
    assert online(events, delay, reading=True, partition=by_key, of=24, down=leaderless,
                  held_by_producer=True)[0] == []


@pytest.mark.parametrize("rank", [4, 6])
def test_a_crash_during_a_fail_over_is_still_found(rank):
    """Rank 4's partition loses its leader, rank 6's does not; each crashes 3 s into the
    fail-over."""
    sc = Scenario(name="fo", dp=16, per_node=4, step_time=0.5, steps=200, checkpoint_every=0,
                  seed=5, faults=(Fault(kind="crash", step=100, ranks=(rank,)),))
    events, _ = generate(sc)
    crashed = next(e.ts for e in events if e.type == "lifecycle" and e.rank == rank
                   and e.event == "exit")
    at = (crashed - 3.0 - events[0].ts) / (events[-1].ts - events[0].ts)
    events, delay, leaderless = _fail_over(events, 14.0, at=at)
    found, _ = online(events, delay, reading=True, partition=by_key, of=24, down=leaderless,
                      held_by_producer=True)
    assert [(kind, ranks) for kind, ranks, _ in found] == [("crash", (rank,))]


def test_a_job_whose_first_item_is_the_launchers_start_advances_without_an_error():
    """The launcher's own start (no rank) first, its job's time then past a grid point:
    nothing of a rank heard yet. Before, the job side's advance raised there for every new
    job (``on_grid(-inf)``, logged as "job stage ... failed in advance()")."""
    from trainguard import events as ev
    from trainguard.detectors.stages import launcher_summary

    jobs = JobProcessor(JobStage, advance_every_s=0.5)
    start = ev.Lifecycle(job="j", ts=100.0, node="n1", rank=None, event="start", pid=1)
    items = [(0, 1, 0, launcher_summary(start)),
             (0, 2, 0, launcher_summary(start.replace(ts=101.2, event="exit", exit_code=0)))]
    for value in encode_summaries("j", items, reading=Reading(parts=(0,), behind=())):
        jobs.apply(value, 0, 101.3)
    jobs.advance(102.0)
    assert jobs.errors == 0
