"""The demo's scorecard: ETTR and per-fault outcomes from recorded facts."""
from trainguard.apps.ettr_model import Recovery, ettr as ettr_at, projection, relaunch_s
from trainguard.apps.scorecard import ettr, kept_steps, outcomes


def test_redone_steps_are_lost():
    steps = [(0, 0, 1), (1, 1, 2), (2, 2, 3), (1, 10, 11), (2, 11, 12), (3, 12, 13)]
    assert [s for s, _, _ in kept_steps(steps)] == [0, 1, 2, 3]
    assert ettr(steps, 0, 13) == (1 + 1 + 1 + 1) / 13


def test_outcome_of_a_hang_detected_and_restarted():
    injections = [{"id": "f1", "kind": "hang", "ranks": [2], "step": 5, "injected_ts": 100.0}]
    anomalies = [{"id": "a1", "kind": "hang", "ts": 120.0, "detected_ts": 120.0, "ranks": [2]}]
    actions = [{"incident": "inc-a1", "action": "capture_stacks", "status": "done", "ts": 121.0,
                "anomalies": ["a1"]},
               {"incident": "inc-a1", "action": "restart", "status": "planned", "ts": 121.5,
                "anomalies": ["a1"], "source": "actions"},
               {"incident": "inc-a1", "action": "restart", "status": "done", "ts": 125.0,
                "source": "actions", "order_id": "o-1", "ack_status": "done"}]
    steps = [(4, 98.0, 99.0), (5, 130.0, 131.0)]
    [fault] = outcomes(injections, anomalies, actions, steps)
    assert fault.detected_ts == 120.0
    assert fault.actions == ["capture_stacks", "restart"]
    assert fault.recovered_ts == 131.0
    assert fault.lost_s == 31.0


def test_supervisor_restart_after_a_crash_counts_for_that_fault():
    injections = [{"id": "f1", "kind": "crash", "ranks": [3], "injected_ts": 100.0},
                  {"id": "f2", "kind": "hang", "ranks": [1], "injected_ts": 300.0}]
    actions = [{"incident": "j:exit:1:90", "action": "restart", "status": "done", "ts": 104.0,
                "source": "supervisor", "trigger": "exit"}]
    crash, hang = outcomes(injections, [], actions, [(7, 110.0, 111.0), (9, 320.0, 321.0)])
    assert crash.actions == ["restart"] and crash.recovered_ts == 111.0
    assert hang.actions == []


def test_undetected_fault_has_null_detection():
    injections = [{"id": "f1", "kind": "crash", "ranks": [3], "injected_ts": 100.0}]
    [fault] = outcomes(injections, [], [], [(7, 200.0, 201.0)])
    assert fault.detected_ts is None and fault.to_dict()["detected_ts"] is None
    assert fault.recovered_ts == 201.0


def test_projection_shows_its_inputs():
    p = projection([Recovery.relaunch(detect_s=20.0)])
    assert [r["gpus"] for r in p["rows"]] == [9600, 100_000]
    assert any("2407.21783" in s for s in p["sources"]) and p["recoveries"][0]["detect_s"] == 20.0


def test_projection_charges_the_relaunch_of_the_size_projected():
    today = Recovery.relaunch(detect_s=20.0)
    assert relaunch_s(2048) == 454.0 and relaunch_s(16384) == 768.0
    assert 600 < relaunch_s(9600) < 700 < relaunch_s(100_000)
    assert ettr_at(100_000, today) < ettr_at(9600, today) < 0.95
    # at 100,000 GPUs a fault comes every 30 minutes: still a ratio, never below zero
    assert 0.0 < ettr_at(100_000, today)


def test_in_memory_recovery_beats_the_relaunch_by_the_redone_work_and_in_place_restarts():
    today = Recovery.relaunch(detect_s=20.0)
    memory_only = Recovery.in_memory(detect_s=20.0, inplace_ratio=1.0, snapshot_every_s=60.0,
                                     snapshot_overhead=0.01)
    in_place = Recovery.in_memory(detect_s=20.0, inplace_ratio=0.2, snapshot_every_s=60.0,
                                  snapshot_overhead=0.01)
    for gpus in (9600, 100_000):
        assert ettr_at(gpus, today) < ettr_at(gpus, memory_only) < ettr_at(gpus, in_place)
    # an in-place restart is never projected faster than the published hot update
    assert Recovery.in_memory(detect_s=0, inplace_ratio=0.0, snapshot_every_s=60,
                              snapshot_overhead=0).restart_s(16384) == 0.78 * 768 + 0.22 * 65



def test_a_snapshot_blocks_a_share_of_one_step_not_of_all_the_time_between_snapshots():
    from trainguard.apps.ettr_model import STEP_S

    assert 6.0 < STEP_S < 6.5                     # Llama 3 405B's step, from its paper
    minute = Recovery.in_memory(detect_s=20.0, inplace_ratio=0.2, snapshot_every_s=60.0,
                                snapshot_overhead=0.01)
    assert minute.checkpoint_blocking_s == 0.01 * STEP_S       # 0.1% of the time, not 1%
    every_step = Recovery.in_memory(detect_s=20.0, inplace_ratio=0.2, snapshot_every_s=1.0,
                                    snapshot_overhead=0.01)
    assert every_step.checkpoint_every_s == STEP_S             # at most one a step
    assert every_step.checkpoint_blocking_s / every_step.checkpoint_every_s == 0.01
    assert ettr_at(9600, every_step) < ettr_at(9600, minute)

def test_a_later_fault_joining_the_incident_keeps_its_own_actions():
    # the demo: rank 2 straggles, then hangs; the hang joins the straggler's incident
    injections = [{"id": "f2", "kind": "straggler", "ranks": [2], "injected_ts": 62.0},
                  {"id": "f3", "kind": "hang", "ranks": [2], "injected_ts": 89.0},
                  {"id": "f5", "kind": "xid", "ranks": [], "injected_ts": 147.6},
                  {"id": "f6", "kind": "crash", "ranks": [0], "injected_ts": 147.7}]
    anomalies = [{"id": "s", "kind": "straggler", "ts": 66.0, "detected_ts": 66.0},
                 {"id": "h", "kind": "hang", "ts": 110.0, "detected_ts": 110.0},
                 {"id": "x", "kind": "gpu_fault", "ts": 147.6, "detected_ts": 147.7},
                 {"id": "c", "kind": "crash", "ts": 151.0, "detected_ts": 151.0}]
    inc = "inc-s"
    actions = [{"incident": inc, "action": "capture_stacks", "status": "done", "ts": 69.0,
                "anomalies": ["s"]},
               {"incident": inc, "action": "alert", "status": "done", "ts": 69.0,
                "anomalies": ["s"]},
               {"incident": inc, "action": "evict", "status": "planned", "ts": 112.0,
                "anomalies": ["s", "h"]},
               {"incident": inc, "action": "restart", "status": "planned", "ts": 112.0,
                "anomalies": ["s", "h"]},
               {"incident": "inc-x", "action": "restart", "status": "planned", "ts": 148.0,
                "anomalies": ["x"]},
               {"incident": "inc-x", "action": "alert", "status": "done", "ts": 148.0,
                "anomalies": ["x"]}]
    straggler, hang, xid, crash = outcomes(injections, anomalies, actions, [(1, 0.0, 1.0)])
    assert straggler.actions == ["capture_stacks", "alert"]
    assert hang.actions == ["evict", "restart"]
    assert xid.actions == crash.actions == ["restart", "alert"]


def test_actions_after_the_next_fault_began_still_count_for_their_own():
    injections = [{"id": "f1", "kind": "hang", "ranks": [2], "injected_ts": 100.0},
                  {"id": "f2", "kind": "nan", "ranks": [1], "injected_ts": 110.0}]
    anomalies = [{"id": "h", "kind": "hang", "ts": 121.0, "detected_ts": 121.0},
                 {"id": "n", "kind": "nan", "ts": 112.0, "detected_ts": 112.0}]
    actions = [{"incident": "inc-h", "action": "capture_stacks", "status": "done", "ts": 123.0,
                "anomalies": ["h"]},
               {"incident": "inc-h", "action": "restart", "status": "done", "ts": 125.0,
                "source": "actions", "order_id": "o-2", "ack_status": "done"},
               {"incident": "inc-n", "action": "alert", "status": "done", "ts": 112.5,
                "anomalies": ["n"]}]
    hang, nan = outcomes(injections, anomalies, actions, [(9, 130.0, 131.0)])
    assert hang.actions == ["capture_stacks", "restart"] and hang.recovered_ts == 131.0
    assert nan.actions == ["alert"]
