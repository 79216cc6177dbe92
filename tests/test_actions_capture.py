"""Stack capture orchestration: the gatherer on a list of events, rounds, localization."""
from trainguard import events as ev
from trainguard.actions.capture import (CaptureResult, JobDirectory, JobInfo, StackCapture,
                                        StackGatherer, localize)
from trainguard.actions.policy import CaptureSettings

from fakes import FakeClock, ListSource


def stack(rank, cid, fn="all_reduce", node="n0", job="j1", error=None):
    frames = [{"function": fn, "file": "/w/train.py", "line": 3},
              {"function": "<module>", "file": "/w/train.py", "line": 40}]
    return ev.Stack(job=job, ts=1.0, node=node, rank=rank, capture_id=cid, pid=10 + rank,
                    method="py-spy", error=error,
                    threads=[] if error else [{"name": "MainThread", "id": 1, "frames": frames}])


def test_gatherer_stops_when_every_expected_rank_answered():
    clock = FakeClock()
    source = ListSource([stack(0, "c1"), stack(1, "c1"), stack(2, "c1")], clock)
    got = StackGatherer(source, clock).gather("j1", "c1", expected={0, 1}, deadline_s=5)
    assert sorted(got) == [0, 1]
    assert source.events == [stack(2, "c1")]  # it did not read further than needed
    assert clock.now == 1000.0


def test_gatherer_ignores_other_captures_jobs_and_types():
    clock = FakeClock()
    noise = [stack(0, "old"), stack(1, "c1", job="j2"),
             ev.Heartbeat(job="j1", ts=1.0, rank=0, pid=1, phase="idle", phase_since=1.0),
             ev.Stack(job="j1", ts=1.0, node="n0", rank=None, capture_id="c1", pid=1,
                      method="py-spy", threads=[])]
    source = ListSource(noise + [stack(1, "c1")], clock)
    got = StackGatherer(source, clock).gather("j1", "c1", expected={0, 1}, deadline_s=3)
    assert sorted(got) == [1]
    assert clock.now >= 1003.0  # waited out the deadline for rank 0


def test_gatherer_without_world_size_waits_for_a_quiet_period():
    clock = FakeClock()
    source = ListSource([stack(0, "c1"), stack(1, "c1")], clock)
    got = StackGatherer(source, clock).gather("j1", "c1", expected=None, deadline_s=30,
                                              quiet_s=2)
    assert sorted(got) == [0, 1] and 1002.0 <= clock.now < 1003.0


def test_capture_rounds_tell_moving_from_stuck_ranks():
    clock = FakeClock()
    source = ListSource(clock=clock)
    sent = []

    def send(command):
        sent.append(command)
        n = len(sent)
        source.add(stack(0, command.capture_id, "all_reduce"),
                   stack(1, command.capture_id, "forward" if n == 1 else "backward"))

    cap = StackCapture(send=send, gatherer=StackGatherer(source, clock),
                       settings=CaptureSettings(rounds=3, interval_s=2.0, deadline_s=5.0),
                       sleep=clock.sleep, clock=clock, new_id=lambda label, n: f"{label}-{n}")
    result = cap.capture("j1", expected={0, 1}, label="inc7")
    assert result.capture_ids == ["inc7-0", "inc7-1", "inc7-2"]
    assert [c.capture_id for c in sent] == result.capture_ids
    assert all(ev.decode(ev.encode(c)) == c for c in sent)
    assert result.moving() == ([1], [0])
    assert clock.now == 1004.0  # two intervals; each round ended as soon as all answered


def test_localize_maps_suspects_to_machines_and_groups():
    rounds = [{r: stack(r, "c", "recv" if r == 5 else "all_reduce", node=f"n{r // 4}")
               for r in range(8) if r != 6}]
    info = JobInfo(world_size=8, topology={"tp": 2, "dp": 2, "pp": 2},
                   rank_to_node={r: f"n{r // 4}" for r in range(8)})
    loc = localize(CaptureResult(job="j1", capture_ids=["c"], rounds=rounds), info)
    assert loc["missing"] == [6]
    assert 6 in loc["suspects"] and loc["nodes"] == ["n1"]
    assert loc["groups"]["tp"] and loc["group_nodes"]["tp"] == ["n1"]
    assert loc["world_size"] == 8 and loc["answered"] == [0, 1, 2, 3, 4, 5, 7]
    assert "suspect" in loc["text"]


def test_failed_capture_of_one_rank_makes_it_a_suspect():
    rounds = [{0: stack(0, "c"), 1: stack(1, "c"), 2: stack(2, "c", error="ptrace denied")}]
    loc = localize(CaptureResult(job="j1", capture_ids=["c"], rounds=rounds), JobInfo())
    assert loc["suspects"] == [2]


def test_directory_learns_from_lifecycle_and_stacks():
    d = JobDirectory()
    d.observe(ev.Lifecycle(job="j1", ts=1.0, node="host", rank=None, event="start", pid=1,
                           world_size=4))
    assert d.info("j1").world_size is None  # a supervisor's guess is not trusted
    d.observe(ev.Lifecycle(job="j1", ts=2.0, node="n1", rank=0, event="start", pid=2,
                           world_size=2, topology={"tp": 2, "pp": 1, "dp": 1}))
    d.observe(stack(1, "c", node="n2"))
    info = d.info("j1")
    assert (info.world_size, info.rank_to_node, info.expected_ranks()) == (2, {0: "n1", 1: "n2"},
                                                                            {0, 1})
    assert d.info("other").world_size is None


def test_directory_keeps_at_most_max_jobs_the_least_recently_heard_forgotten():
    d = JobDirectory(max_jobs=3)
    for job in ("a", "b", "c"):
        d.observe(ev.Lifecycle(job=job, ts=1.0, node="n1", rank=0, event="start", pid=1,
                               world_size=2))
    d.observe(ev.Lifecycle(job="a", ts=2.0, node="n1", rank=1, event="start", pid=2,
                           world_size=2))                                  # a heard again
    d.observe(ev.Lifecycle(job="d", ts=2.0, node="n1", rank=0, event="start", pid=3))
    assert [d.info(job).world_size for job in "abcd"] == [2, None, 2, None]
    assert d.info("a").rank_to_node == {0: "n1", 1: "n1"}


def test_directory_sees_a_relaunch_without_trainguard_run_in_its_ranks_starts():
    """Slurm requeue, Kubernetes or torchrun itself relaunch the job without a job-level
    start: the first rank start of each later run is the launch; redelivered and late starts
    are not."""
    d = JobDirectory()

    def start(rank, ts):
        d.observe(ev.Lifecycle(job="j1", ts=ts, node="n1", rank=rank, event="start", pid=9,
                               world_size=4))

    for rank in range(4):
        start(rank, 10.0 + rank)
    start(2, 12.0)                       # redelivered
    assert d.launches("j1") == []
    start(3, 60.0)                       # the second run: rank 3 first
    for rank in range(3):
        start(rank, 61.0)
    start(1, 11.0)                       # a late copy of the first run's
    assert d.launches("j1") == [60.0]
    for rank in range(4):
        start(rank, 90.0 + rank)
    assert d.launches("j1") == [60.0, 90.0]


def test_directory_with_a_clock_takes_no_launch_from_a_start_stamped_far_ahead():
    d = JobDirectory(clock=lambda: 1000.0, ahead_s=300)

    def start(ts):
        d.observe(ev.Lifecycle(job="j1", ts=ts, node="n1", rank=0, event="start", pid=9))

    start(900.0)
    start(99_999.0)           # made up: had it counted, no real relaunch would after it
    start(990.0)
    assert d.launches("j1") == [990.0]

