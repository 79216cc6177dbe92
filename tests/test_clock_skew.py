"""Issue 21 point 2: steps by number, not by arrival. A machine whose clock runs a minute ahead
of (or behind) its peers' gets its slow rank named, its records land in their steps, and no
other machine is reported silent or hung: the job's clock comes from the step numbers
(detectors/clock.py), not from one machine's stamps. Offline (``trainguard analyze``) and
through the worker's job side alike (tests/test_replay_matches_analyze.py)."""
from __future__ import annotations

import dataclasses

import pytest

from scenarios import Fault, Scenario, recording
from trainguard.detectors.offline import analyze_events


def incidents(sc: Scenario) -> list:
    engine, summary = analyze_events(recording(sc)["events"])
    assert summary["rejected"] == 0
    return [(i["kind"], i["ranks"], i["nodes"]) for i in engine.incidents()]


@pytest.mark.parametrize("offset", [60.0, -60.0, 20.0, -20.0])
@pytest.mark.parametrize("dp,step_time", [(8, 0.5), (16, 2.0)])
def test_a_slow_rank_on_a_machine_whose_clock_is_off_is_named_and_nothing_else(
        offset, dp, step_time):
    sc = Scenario(name="skew", dp=dp, step_time=step_time, steps=160, checkpoint_every=0,
                  seed=3, clock_offsets={"n2": offset},
                  faults=(Fault(kind="straggler", step=60, ranks=(5,), factor=2.0),))
    assert incidents(sc) == [("straggler", [5], [])]


@pytest.mark.parametrize("offset", [60.0, -60.0])
def test_a_healthy_job_with_a_clock_a_minute_off_raises_nothing(offset):
    sc = Scenario(name="skew-ok", dp=12, step_time=1.0, steps=120, checkpoint_every=40,
                  checkpoint_s=30.0, seed=4, clock_offsets={"n3": offset})
    assert incidents(sc) == []


@pytest.mark.parametrize("offset", [60.0, -60.0])
def test_a_hang_on_the_machine_whose_clock_is_off_is_still_found(offset):
    sc = Scenario(name="skew-hang", dp=8, step_time=1.0, steps=120, checkpoint_every=0,
                  seed=5, clock_offsets={"n2": offset},
                  faults=(Fault(kind="hang", step=70, ranks=(6,)),))
    found = incidents(sc)
    assert [k for k, _, _ in found] == ["hang"], found
    assert found[0][1] == [6], found


def test_a_machine_read_behind_across_a_restart_does_not_set_the_others_clock():
    """Two machines, one read behind: after a restart from a checkpoint (steps 5-9 again),
    the late one's records of the run before are not compared with the new run's."""
    from trainguard.detectors.clock import JobClock

    clock = JobClock()
    step = lambda node, s, ts: clock.correct({"k": "step", "node": node, "step": s, "ts": ts})
    start = lambda node, ts: clock.correct({"k": "life", "node": node, "event": "start",
                                           "ts": ts})
    for s in range(10):
        step("n1", s, 100.0 + s)
        if s < 8:
            step("n2", s, 100.0 + s)
    start("n1", 140.0)                        # the restart, n1 read in time ...
    for s in range(5, 12):
        step("n1", s, 140.0 + s)
    step("n2", 8, 108.0)                      # ... n2 behind: its last steps of the run
    step("n2", 9, 109.0)                      # before, then its restart
    start("n2", 140.0)
    for s in range(5, 12):
        step("n2", s, 140.0 + s)
    for s in range(12, 20):
        step("n1", s, 140.0 + s)
        step("n2", s, 140.0 + s)
    assert (clock.offset("n1"), clock.offset("n2")) == (0.0, 0.0)
    assert clock.time("n1", 150.0) == clock.time("n2", 150.0) == 150.0


def test_a_clock_stepped_back_mid_job_sets_no_hang():
    """A machine's clock stepped back 30 s halfway (an NTP step): the first record of a new
    step may be its own, stamped in the past, before its offset is learned again; the job's
    progress does not go back with it (the hang detector took 30 s without progress). A
    clock stepped mid-job still raises false silents in many shapes: the job clock's open
    problem, see the fifteenth stop's note."""
    from scenario_library import HEALTHY

    sc = dataclasses.replace(next(s for s in HEALTHY if s.name == "plain-0.5s"), per_node=2)
    events = recording(sc)["events"]
    half = events[0].ts + (events[-1].ts - events[0].ts) / 2
    stepped = [dataclasses.replace(e, ts=e.ts - 30.0, **(
        {"phase_since": e.phase_since - 30.0} if getattr(e, "phase_since", None) is not None
        and e.phase_since >= half else {})) if e.node == "n1" and e.ts >= half else e
        for e in events]
    engine, _ = analyze_events(stepped)
    assert [(i["kind"], i["ranks"]) for i in engine.incidents()] == []
