"""Crashes and tear-downs: the rank that really died is named, not the peers the launcher
stopped by SIGTERM after it; a job stopped from outside is one warning, not a crash per rank."""
import dataclasses
import pickle
from pathlib import Path

import pytest

from trainguard.detectors import CrashDetector
from trainguard.detectors.offline import analyze_file
from trainguard.recording import read_events

from detector_traces import JobSim, by_kind, drive, run_engine, stage_items

DEMO = Path(__file__).parent / "data" / "incidents" / "demo-chaos-4ranks.jsonl.gz"


def crashes(found):
    return by_kind(found).get("crash", [])


def life(rank, ts, event="exit", code=None, signal=None, step=None, node="n1"):
    return {"k": "life", "job": "j", "rank": rank, "node": node, "ts": ts, "event": event,
            "exit_code": code, "signal": signal, "step": step}


def step(rank, ts, s, node="n1"):
    return {"k": "step", "job": "j", "rank": rank, "node": node, "ts": ts, "step": s}


@pytest.mark.parametrize("signal", ["SIGTERM", "SIGINT"])
def test_killed_rank_is_the_crash_not_its_torn_down_peers(signal):
    sim = JobSim(steps=300).kill(5, 200, teardown_s=0.5, signal=signal)
    found, engine = run_engine(sim.events())
    [a] = crashes(found)
    assert a.ranks == [5] and a.severity == "critical" and a.step == 199
    assert "vanished without an exit event" in a.summary and "on n2" in a.summary
    assert "SIGKILL" in a.summary and signal in a.summary
    assert a.evidence["vanished"] is True and a.evidence["rank_nodes"] == {"5": "n2"}
    assert sorted(a.evidence["torn_down"]) == ["0", "1", "2", "3", "4", "6", "7"]
    assert a.onset_ts <= sim.stop_ts + 0.1 and a.detected_ts - sim.stop_ts <= 6.0
    assert not any(x.kind == "hang" for x in found)   # torn down, not hung
    [incident] = engine.incidents()
    assert incident["kind"] == "crash" and incident["ranks"] == [5]


def test_killed_rank_is_the_crash_when_its_peers_fail_with_code_1_first():
    """With gloo the peers of a SIGKILLed rank fail (code 1) before torchrun stops them:
    they are crashes at once, and the rank that vanished is named once the exits settle;
    the incident names it alone."""
    sim = JobSim(steps=300).kill(5, 200, teardown_s=0.05, signal="gloo")
    found, engine = run_engine(sim.events())
    vanished = [a for a in crashes(found) if a.evidence.get("vanished")]
    assert [a.ranks for a in vanished] == [[5]]
    assert vanished[0].evidence["collateral"] == [0, 1, 2, 3, 4, 6, 7]
    # decided once a peer hung in the collective would have been heard again (vanish_s)
    assert vanished[0].detected_ts - sim.stop_ts <= 12.0
    assert min(a.detected_ts for a in crashes(found)) - sim.stop_ts <= 2.0
    [incident] = engine.incidents()
    assert incident["kind"] == "crash" and incident["ranks"] == [5]


def announce(ts):
    """``trainguard run`` saying it restarts the job (the service ordered it)."""
    return {"k": "life", "job": "j", "rank": None, "node": "n1", "ts": ts, "event": "exit",
            "exit_code": None, "signal": None, "restart": True}


def test_a_restart_announced_after_the_exits_it_caused_is_no_stop_from_outside():
    """trainguard run's word of its restart and the ranks' exits travel on other partitions:
    every exit read first, its word half a second later, is still its own restart."""
    d = CrashDetector(grace_s=3.0)
    for r in range(3):
        d.update(step(r, 99.0, 10))
    assert [f for r in range(3)
            for f in d.update(life(r, 100.0 + r * 0.01, signal="SIGTERM"))] == []
    assert d.update(announce(99.9)) == []
    assert d.advance(110.0) == []


def test_our_restarts_exits_read_after_the_job_started_again_are_no_stop_from_outside():
    """Issue 21, two workers: the half of the ranks whose partitions a lagging worker reads
    come with their exits after the other half already started again. Those exits belong to
    our restart, not to a new stop from outside."""
    d = CrashDetector(grace_s=3.0)
    for r in range(4):
        d.update(step(r, 99.0, 10))
    assert d.update(announce(99.9)) == []
    for r in (0, 1):                       # read in time: exit, then the relaunch
        assert d.update(life(r, 100.0 + r * 0.01, signal="SIGTERM")) == []
    for r in (0, 1):
        assert d.update(life(r, 106.0, event="start")) == []
    for r in (2, 3):                       # the lagging worker's: their exits, then starts
        assert d.update(life(r, 100.02 + r * 0.01, signal="SIGTERM")) == []
    assert d.advance(110.0) == []
    for r in (2, 3):
        assert d.update(life(r, 106.0, event="start")) == []
    assert d.advance(120.0) == [] and d.own_restarts == [99.9]


def test_a_tear_downs_grace_runs_on_the_time_every_source_was_heard_up_to():
    """Online, ``steps_now`` (the lowest telemetry partition's time) holds the grace of a
    tear-down until the restart's word, on a partition read behind, could be read."""
    from trainguard.detectors import JobStage

    stage = JobStage()
    for r in range(3):
        stage.update(step(r, 99.0, 10))
    for r in range(3):
        stage.update(life(r, 100.0 + r * 0.01, signal="SIGTERM"))
    assert stage.advance(110.0, steps_now=100.5) == []      # its partition is behind
    stage.update(announce(99.9))
    assert stage.advance(111.0, steps_now=111.0) == []
    assert stage.incidents() == []


def test_a_restart_ordered_before_the_exits_settled_still_names_the_killed_rank():
    """Rank 1 is SIGKILLed; its gloo peers fail with code 1. The action service answers the
    first failure with a restart within the second, before the second peer's exit is read:
    the failure is decided once its exits settled, so the rank that vanished is named, and
    the peers are its collateral."""
    d = CrashDetector(grace_s=3.0)
    for r in range(3):
        d.update(step(r, 99.0, 160))
    assert [a.ranks for a in d.update(life(0, 100.0, code=1, step=160))] == [[0]]
    assert d.update(announce(100.4)) == []
    assert [a.ranks for a in d.update(life(2, 100.1, code=1, step=160))] == [[2]]
    for r in (0, 2):                    # our restart's SIGTERMs find nothing left to stop
        assert d.update(life(r, 100.5, signal="SIGTERM")) == []
    assert d.advance(103.0) == []
    [a] = d.advance(103.5)
    assert a.ranks == [1] and a.evidence["vanished"] and a.evidence["collateral"] == [0, 2]
    assert d.advance(110.0) == [] and d.own_restarts == [100.4]


def test_a_peer_our_restart_stopped_shows_the_silent_rank_was_killed():
    """One peer failed (code 1), the other was still alive (in its data loader) when our
    restart stopped it: the silent rank is the one killed, not a peer hung in a collective."""
    d = CrashDetector(grace_s=3.0)
    for r in range(3):
        d.update(step(r, 99.0, 160))
    d.update(life(0, 100.0, code=1))
    d.update(announce(100.4))
    d.update(life(2, 100.5, signal="SIGTERM"))
    [a] = d.advance(103.5)
    assert a.ranks == [1] and a.evidence["collateral"] == [0]


def test_two_ranks_one_killed_one_failed_stays_ambiguous():
    d = CrashDetector(grace_s=3.0)
    for r in range(2):
        d.update(step(r, 99.0, 160))
    d.update(life(0, 100.0, code=1))
    d.update(announce(100.4))
    assert d.advance(104.0) == []      # the failed rank's own crash stands


def test_the_relaunch_starting_decides_an_answered_failure_at_once():
    d = CrashDetector(grace_s=3.0)
    for r in range(3):
        d.update(step(r, 99.0, 160))
    d.update(life(0, 100.0, code=1))
    d.update(life(2, 100.1, code=1))
    d.update(announce(100.4))
    [a] = d.update(life(0, 101.0, event="start"))
    assert a.ranks == [1] and a.evidence["collateral"] == [0, 2]


def test_whole_job_stopped_from_outside_is_one_warning_naming_no_rank():
    sim = JobSim(steps=300).stop(200)
    found, engine = run_engine(sim.events())
    assert [(a.kind, a.severity, a.ranks) for a in found] == [("crash", "warning", [])]
    a = found[0]
    assert a.evidence["external_stop"] is True and len(a.evidence["torn_down"]) == 8
    assert "stopped from outside" in a.summary
    [incident] = engine.incidents()
    assert incident["kind"] == "crash" and incident["severity"] == "warning"
    assert incident["ranks"] == []


@pytest.mark.parametrize("code, signal", [(1, None), (None, "SIGSEGV"), (None, "SIGKILL")])
def test_failed_rank_stays_a_critical_crash_at_once_and_its_peers_fold_in(code, signal):
    sim = JobSim(steps=300).crash(2, 200, exit_code=code, signal=signal, teardown_s=0.5)
    found, engine = run_engine(sim.events())
    [a] = crashes(found)
    assert a.ranks == [2] and a.severity == "critical" and a.step == 199
    assert a.detected_ts == a.onset_ts and a.detected_ts - sim.stop_ts <= 2.0
    assert [(i["kind"], i["ranks"]) for i in engine.incidents()] == [("crash", [2])]


def test_kill_at_the_end_of_the_input_is_decided_by_the_final_sweep():
    sim = JobSim(steps=300, tail_s=0.0, gpus=False).kill(3, 200)
    found, _ = run_engine(sim.events())
    assert [(a.kind, a.ranks) for a in found] == [("crash", [3])]


def test_few_ranks_sigtermed_while_the_rest_go_on_is_a_crash_of_those():
    d = CrashDetector(grace_s=3.0)
    found = []
    for t in range(12):
        for r in range(4):
            if r != 1 or t < 5:
                found += d.update(step(r, 100.0 + t, t))
        if t == 5:
            found += d.update(life(1, 105.0, signal="SIGTERM", step=4))
        found += d.advance(100.0 + t)
        assert bool(found) == (t >= 8)
    [a] = found
    assert a.ranks == [1] and a.severity == "critical" and a.evidence["running"] == [0, 2, 3]


def test_exits_arriving_before_the_killed_ranks_last_step_still_name_it():
    d = CrashDetector(grace_s=3.0)
    for r in range(4):
        assert d.update(step(r, 98.0, 39)) == []
    for r in range(3):                      # the peers' exits overtook rank 3's last step
        assert d.update(step(r, 99.0, 40)) == []
        assert d.update(life(r, 100.0 + 0.1 * r, signal="SIGTERM", step=40)) == []
    assert d.update(step(3, 99.5, 40)) == []
    assert d.advance(103.1) == []
    [a] = d.advance(103.3)
    assert a.ranks == [3] and a.onset_ts == 99.5 and a.detected_ts == 103.3 and a.step == 40


def test_all_ranks_exited_decides_after_the_grace_and_late_exits_fold_in():
    d = CrashDetector()
    for r in range(4):
        d.update(step(r, 99.0, 7))
    found = []
    for r in range(4):
        found += d.update(life(r, 100.0 + 0.1 * r, signal="SIGTERM", step=7))
    assert found == []                       # trainguard run's word of a restart may follow
    assert d.update(life(None, 101.0, code=1)) == []   # the launcher's own exit
    assert d.advance(103.2) == []
    found = d.advance(103.3)
    assert [(a.severity, a.ranks, a.detected_ts) for a in found] == [("warning", [], 103.3)]
    assert d.advance(200.0) == []


def test_a_restart_ends_the_tear_down_and_a_later_kill_is_found_again():
    d = CrashDetector()
    for r in range(4):
        d.update(step(r, 99.0, 7))
    found = [a for r in range(4) for a in d.update(life(r, 100.0, signal="SIGTERM"))]
    assert [a.severity for a in found + d.advance(103.0)] == ["warning"]
    for r in range(4):                      # restarted: start events, steps
        assert d.update(life(r, 110.0, event="start")) == []
    for r in range(4):
        d.update(step(r, 120.0, 8))
    for r in (0, 1, 3):                     # rank 2 killed after step 8
        assert d.update(life(r, 121.0, signal="SIGTERM", step=8)) == []
    [a] = d.advance(124.0)
    assert a.ranks == [2] and a.severity == "critical" and a.step == 8


def test_restart_without_start_events_also_ends_the_tear_down():
    d = CrashDetector()
    for r in range(2):
        d.update(step(r, 99.0, 7))
    assert [a.severity for r in range(2)
            for a in d.update(life(r, 100.0, signal="SIGTERM"))] == []
    stepping = [a for r in range(2) for a in d.update(step(r, 130.0, 0))]  # again: decided
    assert [a.severity for a in stepping] == ["warning"]
    assert [a.severity for r in range(2)
            for a in d.update(life(r, 140.0, signal="SIGTERM"))] + \
        [a.severity for a in d.advance(143.0)] == ["warning"]


def test_tear_down_state_pickles_mid_wave():
    items = stage_items(JobSim(steps=150, ranks=4, nodes=1).kill(2, 100).events())
    expected = [dataclasses.asdict(f) for f in drive(CrashDetector(), items)]
    assert len(expected) == 1
    cut = next(i for i, (op, x) in enumerate(items)
               if op == "u" and type(x) is dict and x.get("event") == "exit") + 1
    d = CrashDetector()
    before = drive(d, items[:cut])
    after = drive(pickle.loads(pickle.dumps(d)), items[cut:])
    assert [dataclasses.asdict(f) for f in before + after] == expected


def test_recorded_demo_names_the_sigkilled_ranks_and_one_restart():
    # trainguard demo: a hang, then our supervisor's restart (every rank SIGTERMed), SIGKILL
    # of rank 3 at step 160, Xid 79 and SIGKILL of rank 0 at step 200 (see tests/data).
    found, _ = run_engine(list(read_events(DEMO)))
    named = [(a.severity, a.ranks, a.step) for a in crashes(found)]
    assert named == [("warning", [], 119), ("critical", [3], 159), ("critical", [0], 199)]
    assert all("vanished" in a.summary for a in crashes(found)[1:])
    incidents = analyze_file(DEMO)["incidents"]
    # our restart after the hang, and the SIGKILL of rank 3; rank 0's joined the Xid incident
    assert [(i["severity"], i["ranks"]) for i in incidents if i["kind"] == "crash"] \
        == [("warning", []), ("critical", [3])]
