"""Issue 21 point 2: steps by number, not by arrival. A machine whose clock runs a minute ahead
of (or behind) its peers' gets its slow rank named, its records land in their steps, and no
other machine is reported silent or hung: the job's clock comes from the step numbers
(detectors/clock.py), not from one machine's stamps. Offline (``trainguard analyze``) and
through the worker's job side alike (tests/test_replay_matches_analyze.py)."""
from __future__ import annotations

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
