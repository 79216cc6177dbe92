"""What the job side takes for a telemetry partition that nobody reads, and what it does not.

A partition that went silent while no rank worker says it reads it holds its job back for
up to ``worker.unread_partition_s`` (its worker killed or stalled, its partitions moving to
another worker that reads their state back). A partition whose ranks merely went quiet must
not pass for one: its worker keeps saying it reads it, also after a move
(``tests/test_streams_ranks.py``), and what the workers said before a job's state was
loaded again is not taken as said of that job.
"""
from __future__ import annotations

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
