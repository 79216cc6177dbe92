"""``compute_time`` under ``--instrument`` for FSDP2, tensor parallel and pipeline parallel jobs:
real torchrun (gloo, CPU) runs of ``examples/parallel_plain.py`` (imports nothing of
trainguard), read back from the real broker.

One rank sleeps in every forward of its model from step ``SLOW_FROM`` on. Every rank's steps
arrive with step time and a compute time no larger than it, heartbeats show phases, the loss
comes where the rank has one (pipeline parallel: the last stage), and the slow rank's compute
time stands clearly above its peers' — for pipeline parallel, above the other rank of its own
stage (4 ranks: 2 pipelines x 2 stages; ranks 0, 1 run stage 0, ranks 2, 3 stage 1; once with
``ScheduleGPipe``, once with ``Schedule1F1B``).
``trainguard analyze`` names it a straggler. The pipeline job is told its layout with
``TRAINGUARD_TOPOLOGY`` (``--instrument`` cannot see it before the lifecycle start is sent):
the start events carry it, and a detector that compares 2 ranks names the slow rank against
the peer of its own stage.
"""
from __future__ import annotations

import statistics
from collections import defaultdict

import pytest

from collector_harness import by_type, watched_run, write_recording

pytestmark = [pytest.mark.slow, pytest.mark.broker]

STEPS = 36
# after the straggler detector learned each rank's usual share of the step (as in
# tests/test_integrations_torchrun.py)
SLOW_FROM = 12
#: the slow rank's sleep per forward: for pipeline parallel once per micro-batch (4 a step);
#: for TP 0.15 s, well above how far a peer's compute time wobbles on a loaded machine (with
#: 0.05 s, a peer's median came out above the slow rank's in 2 of 4 runs of the suite in three
#: lanes). FSDP2 0.25 s: on gloo part of a peer's wait for the slow rank is not a marked wait
#: (a fresh-clone suite saw the slow rank's median go up 0.11 s of a 0.15 s sleep and a
#: peer's 0.04 s), so the sleep must dwarf that share
SLOW_SECONDS = {"fsdp2": 0.25, "tp": 0.15, "pp-1f1b": 0.05}
#: the straggler detector's default ``ratio``: what the slow rank's time must be over a peer's
#: to be slow in a step
DETECTOR_RATIO = 1.2
#: job -> (its arguments, ranks, the slow rank, the ranks it is compared with, the ranks
#: that have a loss). Pipeline parallel: rank 1 runs stage 0 of pipeline 1, rank 0 is its
#: stage peer, ranks 2 and 3 run the last stage. (The same pipeline job with the GPipe
#: schedule passed every check here until 2026-12-06; it left to keep the suite within its
#: 15 minutes: 46 s of a lane for the schedule that differs least from 1F1B in what is sent.)
JOBS = {
    "fsdp2": (["fsdp2"], 3, 1, (0, 2), (0, 1, 2)),
    "tp": (["tp"], 3, 1, (0, 2), (0, 1, 2)),
    "pp-1f1b": (["pp", "--schedule", "1f1b"], 4, 1, (0,), (2, 3)),
}
PIPELINE_TOPOLOGY = {"tp": 1, "pp": 2, "dp": 2}


@pytest.fixture(scope="module", params=sorted(JOBS))
def parallel_job(request, tmp_path_factory, kafka_bootstrap):
    name = request.param
    args, nproc, slow, _, _ = JOBS[name]
    tmp = tmp_path_factory.mktemp(name)
    env = {"FAULT_SLOW": f"{slow}:{SLOW_SECONDS[name]}:{SLOW_FROM}"}
    if args[0] == "pp":
        env["TRAINGUARD_TOPOLOGY"] = "pp=2"  # dp: what the world size leaves
    code, out, events = watched_run(
        kafka_bootstrap, tmp, f"par-{name}",
        ["examples/parallel_plain.py", *args, "--steps", str(STEPS), "--step-sleep", "0.01"],
        nproc, instrument=True, extra_env=env)
    assert code == 0, out[-4000:]
    return name, events, write_recording(events, tmp / "recording.jsonl")


def per_rank_steps(events) -> dict[int, list]:
    steps = defaultdict(list)
    for e in by_type(events, "step"):
        steps[e.rank].append(e)
    return steps


def test_every_rank_sends_steps_with_compute_time_phases_and_loss(parallel_job):
    name, events, _ = parallel_job
    args, nproc, _, _, with_loss = JOBS[name]
    assert not [e for e in events if isinstance(e, Exception)], "invalid events on the topic"
    steps = per_rank_steps(events)
    assert set(steps) == set(range(nproc)), sorted(steps)
    for rank, got in steps.items():
        assert sorted(e.step for e in got) == list(range(STEPS)), (rank, [e.step for e in got])
        for e in got:
            assert e.job == f"par-{name}"
            assert e.step_time > 0 and e.compute_time is not None, e
            assert 0 <= e.compute_time <= e.step_time, e
            assert e.lr is not None
        losses = [e.loss for e in got if e.loss is not None]
        if rank in with_loss:
            assert len(losses) == STEPS, (rank, losses)
        else:
            assert not losses, (rank, losses)
    phases = defaultdict(set)
    for beat in by_type(events, "heartbeat"):
        phases[beat.rank].add(beat.phase)
    assert set(phases) == set(range(nproc))
    # heartbeats sample the phase once a second: a rank of a job this short may send only a
    # couple, each between two steps (idle); the job's ranks together show the step's phases
    seen = set().union(*phases.values())
    assert seen & {"forward", "backward", "collective", "optimizer"}, dict(phases)
    life = by_type(events, "lifecycle")
    assert {e.rank for e in life if e.event == "start"} == set(range(nproc))
    topology = PIPELINE_TOPOLOGY if args[0] == "pp" else None
    assert [e.topology for e in life if e.event == "start"] == [topology] * nproc
    assert {e.rank for e in life if e.event == "exit"} == set(range(nproc))


def test_the_rank_sleeping_in_its_forward_has_the_highest_compute_time(parallel_job):
    name, events, _ = parallel_job
    _, _, slow, peers, _ = JOBS[name]
    steps = per_rank_steps(events)
    medians = {rank: statistics.median(e.compute_time for e in got if e.step > SLOW_FROM)
               for rank, got in steps.items()}
    before = {rank: statistics.median(e.compute_time for e in got if 2 <= e.step < SLOW_FROM)
              for rank, got in steps.items()}
    print(name, "compute_time medians before", before, "after", medians)
    # the sleep is counted once per forward (for pp, once per micro-batch: 4 per step), over
    # the fastest rank's time before it (on a loaded machine the slow rank's own median before
    # the sleep was once 2.4x its peers'). At least half of it: the slow rank no longer waits
    # for its peers, and on gloo FSDP2 part of that wait was never marked (0.11 s of 0.15 once)
    assert medians[slow] > min(before.values()) + 0.5 * SLOW_SECONDS[name], (before, medians)
    for peer in peers:
        # above each peer by what the detector needs, and by a good part of the sleep (a peer
        # also carries the part of its wait for the slow rank that is not marked)
        assert medians[slow] > DETECTOR_RATIO * medians[peer], (peer, medians)
        assert medians[slow] > medians[peer] + 0.3 * SLOW_SECONDS[name], (peer, medians)


def test_trainguard_analyze_names_the_slow_rank_a_straggler(parallel_job):
    from trainguard.detectors.config import DetectorConfig
    from trainguard.detectors.offline import analyze_file
    from trainguard.setting import with_values

    name, _, recording = parallel_job
    _, _, slow, _, _ = JOBS[name]
    # On gloo a rank's data-parallel peer leaks part of its wait for the slow rank into its
    # compute time (not a marked wait): in one fresh-clone suite (ci50, pp-1f1b) rank 0 went
    # from 16 to 17-30 ms a step while rank 1 slept 200 ms more, enough over the default
    # 2 ms of excess to be named with it. The slow ranks here are 150-250 ms over.
    config = with_values(DetectorConfig(), {"straggler.min_excess_s": 0.02})
    stragglers = [i for i in analyze_file(str(recording), config)["incidents"]
                  if i["kind"] == "straggler"]
    print(name, "stragglers", [(i["ranks"], i.get("summary")) for i in stragglers])
    assert stragglers and {tuple(i["ranks"]) for i in stragglers} == {(slow,)}, stragglers
    # 2 ranks a stage are fewer than straggler_min_ranks: compared across the job
    assert all("than their peers" in i["summary"] for i in stragglers), stragglers


def test_a_pipeline_stage_compares_its_own_ranks(parallel_job):
    from trainguard.detectors.config import DetectorConfig
    from trainguard.setting import with_values
    from trainguard.detectors.offline import analyze_file

    name, _, recording = parallel_job
    if JOBS[name][0][0] != "pp":
        pytest.skip("pipeline parallel only")
    # two ranks a stage are below the default straggler_min_ranks (3), and a peer's 10 ms
    # compute wobbles by more than the default 2 ms of excess on this shared CPU (rank 3 at
    # 13 ms against rank 2 at 8 ms was named once): the slow rank is 200 ms over
    stage_of_two = with_values(DetectorConfig(), {"straggler.min_ranks": 2,
                                                  "straggler.min_excess_s": 0.02})
    stragglers = [i for i in analyze_file(str(recording), stage_of_two)["incidents"]
                  if i["kind"] == "straggler"]
    assert {tuple(i["ranks"]) for i in stragglers} == {(1,)}, stragglers
    assert all("peers of their pipeline stage" in i["summary"] for i in stragglers), stragglers
