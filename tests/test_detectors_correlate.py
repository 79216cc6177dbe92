"""Incident correlation (root cause, time window, shared ranks/machines) and the Xid table."""
from trainguard import events as ev
from trainguard.detectors import FAULT_XIDS, XID_TABLE, Correlator, xid_info
from trainguard.detectors.gpu import APPLICATION_XIDS, NOTICE_XIDS

from detector_traces import JobSim, run_engine


def anomaly(kind, ts, ranks=(), nodes=(), onset=None, job="j", step=None, **evidence):
    return ev.Anomaly(job=job, ts=ts, id=f"{kind}-{ts:g}-{job}", kind=kind, severity="critical",
                      ranks=list(ranks), nodes=list(nodes), onset_ts=onset or ts,
                      detected_ts=ts, detector=kind, summary=f"{kind} at {ts:g}", step=step,
                      evidence=evidence)


def test_xid_table_follows_nvidias_catalog():
    """The immediate action of NVIDIA's Xid catalog for A100 and H100: a reset, a machine's
    restart or a workflow (48, NVLink) is a fault that takes the machine out; IGNORE (63: a
    row remap recorded, 92: a high single-bit error rate) and RESTART_APP (94: an ECC error
    contained to one process) leave the GPU in service."""
    assert FAULT_XIDS == {48, 64, 74, 79, 95, 119, 120}
    assert NOTICE_XIDS == {63, 92, 94} and not NOTICE_XIDS & FAULT_XIDS
    assert {13, 31, 43} <= APPLICATION_XIDS and not {13, 31, 43} & FAULT_XIDS
    assert xid_info(79)[0] == "GPU has fallen off the bus"
    assert xid_info(48)[0].startswith("Double Bit ECC")
    assert xid_info(9999) == ("Xid 9999", "unknown", None)
    for xid, (name, category, severity) in XID_TABLE.items():
        assert category in ("hardware", "application", "driver", "notice", "contained") \
            and name
        assert (severity is not None) == (category == "hardware")


def test_crash_then_hang_is_one_crash_incident():
    sim = JobSim(steps=300).crash(4, 200, exit_code=1)
    found, engine = run_engine(sim.events())
    assert sorted(a.kind for a in found) == ["crash", "hang"]
    [incident] = engine.incidents()
    assert incident["kind"] == "crash" and incident["ranks"] == [4]
    assert len(incident["anomalies"]) == 2 and incident["severity"] == "critical"


def test_xid79_silent_and_hang_are_one_gpu_fault_incident():
    sim = JobSim(steps=300).xid("n1", 3, 79, 200)
    found, engine = run_engine(sim.events())
    assert {"gpu_fault", "silent", "hang"} <= {a.kind for a in found}
    [incident] = engine.incidents()
    assert incident["kind"] == "gpu_fault"
    assert incident["ranks"] == [3] and incident["nodes"] == ["n1"]
    assert incident["step"] == 199
    assert set(incident) >= {"id", "kind", "job", "ranks", "nodes", "step", "onset_ts",
                             "detected_ts", "severity", "summary"}


def test_torn_down_ranks_after_the_first_crash_are_not_suspects():
    c = Correlator()
    c.add(anomaly("crash", 100.0, [3]))
    for r in (0, 1, 2, 4, 5):
        c.add(anomaly("crash", 130.0 + r, [r]))       # torchrun's SIGTERM to the others
    c.add(anomaly("hang", 140.0, onset=99.0))
    [incident] = c.incidents()
    assert incident["kind"] == "crash" and incident["ranks"] == [3]
    assert len(incident["anomalies"]) == 7


def test_higher_priority_cause_arriving_later_becomes_the_root():
    c = Correlator()
    c.add(anomaly("hang", 120.0, onset=99.0))
    c.add(anomaly("silent", 121.0, [5], onset=100.0))
    c.add(anomaly("gpu_fault", 122.0, [5], ["n2"], onset=100.0))
    [incident] = c.incidents()
    assert incident["kind"] == "gpu_fault" and incident["id"] == "inc-hang-120-j"


def test_unrelated_problems_stay_apart():
    c = Correlator()
    c.add(anomaly("straggler", 100.0, [1], rank_nodes={"1": "n1"}))
    c.add(anomaly("gpu_fault", 101.0, [12], ["n2"]))          # other machine: not its cause
    c.add(anomaly("loss_spike", 5000.0))                        # much later
    c.add(anomaly("crash", 102.0, [0], job="other"))          # other job
    assert sorted(i["kind"] for i in c.incidents()) == ["crash", "gpu_fault", "loss_spike",
                                                         "straggler"]


def test_a_gpu_fault_explains_the_straggler_on_its_machine():
    c = Correlator()
    c.add(anomaly("gpu_degraded", 100.0, [6], ["n1"]))
    c.add(anomaly("straggler", 130.0, [6], rank_nodes={"6": "n1"}))
    [incident] = c.incidents()
    assert incident["kind"] == "gpu_degraded"


def test_window_closes_incidents():
    c = Correlator(window_s=60.0)
    c.add(anomaly("crash", 100.0, [1]))
    c.add(anomaly("crash", 400.0, [1]))
    assert len(c.incidents()) == 2


def test_same_anomaly_twice_is_counted_once():
    c = Correlator()
    a = anomaly("nan", 10.0, [2])
    c.add(a)
    c.add(a)
    [incident] = c.incidents()
    assert incident["anomalies"] == [a.id]


def test_a_nan_explains_a_hang_or_crash_only_on_its_own_rank():
    # the demo: NaN on rank 1, then a hang blamed on rank 2 of the same machine
    c = Correlator()
    c.add(anomaly("nan", 100.0, [1], ["n0"]))
    c.add(anomaly("hang", 151.0, [2], onset=90.0, rank_nodes={"2": "n0"}))
    assert sorted(i["kind"] for i in c.incidents()) == ["hang", "nan"]
    c = Correlator()
    c.add(anomaly("nan", 100.0, [1]))
    c.add(anomaly("crash", 120.0, [0], rank_nodes={"0": "n0"}))
    assert sorted(i["kind"] for i in c.incidents()) == ["crash", "nan"]


def test_a_nan_explains_its_own_ranks_crash_and_hang():
    c = Correlator()
    c.add(anomaly("nan", 100.0, [2]))
    c.add(anomaly("hang", 151.0, [2], onset=90.0))
    c.add(anomaly("crash", 160.0, [2]))
    [incident] = c.incidents()
    assert incident["kind"] == "nan" and len(incident["anomalies"]) == 3


def test_a_fault_after_the_job_was_relaunched_is_a_new_incident():
    """Issue 10 point 5: the problem a restart dealt with is over; what begins after the
    relaunch is a new incident (the action service restarts once per incident)."""
    c = Correlator()
    c.add(anomaly("crash", 100.0, [1]))
    c.relaunched("j", 130.0)
    c.add(anomaly("crash", 131.0, [2], onset=128.0))    # the old problem's, found late
    c.add(anomaly("crash", 160.0, [1]))                  # began after the relaunch
    c.relaunched("other", 170.0)                         # another job's relaunch: no matter
    c.add(anomaly("crash", 175.0, [3]))
    assert [(i["ranks"], len(i["anomalies"])) for i in c.incidents()] == [
        ([1], 2), ([1], 2)]


def test_the_job_stage_tells_its_correlator_of_a_relaunch():
    from trainguard.detectors import JobStage

    stage = JobStage()
    stage.job = "j"
    stage.correlator.add(anomaly("crash", 100.0, [1]))
    stage.update({"k": "life", "job": "j", "rank": 0, "node": "n1", "ts": 130.0,
                  "event": "start", "world_size": 2})
    stage.correlator.add(anomaly("crash", 160.0, [1]))
    assert [len(i["anomalies"]) for i in stage.correlator.incidents()] == [1, 1]
