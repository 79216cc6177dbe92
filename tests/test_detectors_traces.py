"""Each detector, through the Engine, on synthetic jobs: healthy ones stay quiet, each injected
fault is found, named and timed right."""
import pytest

from trainguard.detectors import DetectorConfig
from trainguard.setting import with_values

from detector_traces import JobSim, by_kind, run_engine


def kinds(found):
    return sorted({a.kind for a in found})


def only(found, kind):
    got = by_kind(found).get(kind, [])
    assert len(got) == 1, f"expected one {kind}, got {[(a.kind, a.summary) for a in found]}"
    return got[0]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_healthy_job_with_checkpoints_evals_and_periodic_slow_steps_is_quiet(seed):
    sim = JobSim(steps=600, seed=seed, checkpoint_every=150, checkpoint_s=25.0, eval_every=200,
                 eval_s=12.0, slow_every=10, slow_factor=4.0, noise=0.03)
    found, engine = run_engine(sim.events())
    assert found == [] and engine.incidents() == []


def test_healthy_job_with_noisy_ranks_a_few_percent_apart_is_quiet():
    sim = JobSim(steps=400, noise=0.05).straggle([1, 5], 1.06, 0).straggle([3], 1.1, 0)
    found, _ = run_engine(sim.events())
    assert found == []


def test_one_off_slow_steps_of_single_ranks_are_not_stragglers():
    sim = JobSim(steps=300)
    for step, rank in ((50, 2), (51, 6), (90, 2), (130, 2), (131, 2), (200, 7)):
        sim.straggle([rank], 3.0, step, step + 1)
    found, _ = run_engine(sim.events())
    assert found == []


def test_straggler_named_exactly_and_quickly():
    sim = JobSim(steps=300).straggle([6], 1.5, 100)
    found, _ = run_engine(sim.events())
    a = only(found, "straggler")
    assert kinds(found) == ["straggler"]
    assert a.ranks == [6] and a.nodes == [] and a.step == 100
    assert a.evidence["detected_step"] - 100 <= 30


def test_two_stragglers_on_different_machines():
    sim = JobSim(steps=300).straggle([1, 6], 1.4, 100)
    a = only(run_engine(sim.events())[0], "straggler")
    assert a.ranks == [1, 6] and a.nodes == []


def test_slow_machine_is_named():
    sim = JobSim(steps=300, ranks=16, nodes=4).straggle([8, 9, 10, 11], 1.5, 100)
    a = only(run_engine(sim.events())[0], "straggler")
    assert a.ranks == [8, 9, 10, 11] and a.nodes == ["n3"]


def test_half_the_job_slow_on_one_of_two_machines_is_still_that_machine():
    sim = JobSim(steps=300).straggle([4, 5, 6, 7], 1.5, 100)
    a = only(run_engine(sim.events())[0], "straggler")
    assert a.ranks == [4, 5, 6, 7] and a.nodes == ["n2"]


def test_network_slowdown_is_a_throughput_drop_not_a_straggler():
    sim = JobSim(steps=400, slow_every=10).network(3.0, 200)
    found, _ = run_engine(sim.events())
    assert kinds(found) == ["throughput_drop"]
    a = found[0]
    assert a.ranks == [] and 200 <= a.step <= 215 and a.evidence["ratio"] > 1.25


def test_straggler_slowing_the_job_is_not_a_throughput_drop():
    sim = JobSim(steps=400).straggle([3], 2.0, 200)
    assert kinds(run_engine(sim.events())[0]) == ["straggler"]


def test_nan_blames_the_rank_whose_loss_went_first_within_one_step():
    sim = JobSim(steps=300).nan_loss(5, 150)
    events = sim.events()
    found, _ = run_engine(events)
    a = only(found, "nan")
    assert a.ranks == [5] and a.step == 150
    assert a.detected_ts <= sim.step_end_ts[150] + 0.1     # within the step itself


def test_nan_grad_norm_on_every_rank_blames_no_rank():
    found, _ = run_engine(JobSim(steps=300).nan_grad(150).events())
    a = only(found, "nan")
    assert a.ranks == [] and a.step == 150


def test_loss_scaler_overflow_skips_are_not_nan_but_a_run_of_them_is():
    quiet, _ = run_engine(JobSim(steps=300, loss_scale=65536.0).nan_grad(100, 2)
                          .nan_grad(200, 1).events())
    assert quiet == []
    found, _ = run_engine(JobSim(steps=300, loss_scale=65536.0).nan_grad(150, 20).events())
    assert only(found, "nan").step == 150


def test_loss_spike_found_once_and_baseline_not_poisoned():
    sim = JobSim(steps=500, checkpoint_every=0).spike(300, 1.5).spike(301, 1.4).spike(400, 1.5)
    found, _ = run_engine(sim.events())
    spikes = by_kind(found)["loss_spike"]
    assert [a.step for a in spikes] == [300, 400] and kinds(found) == ["loss_spike"]


def test_grad_spike():
    found, _ = run_engine(JobSim(steps=400, checkpoint_every=0).grad_spike(320, 6.0).events())
    assert [(a.kind, a.step) for a in found] == [("grad_spike", 320)]


def test_hang_names_the_rank_in_a_different_phase_within_30_seconds():
    sim = JobSim(steps=300).hang(5, 200, phase="data")
    found, _ = run_engine(sim.events())
    a = only(found, "hang")
    assert kinds(found) == ["hang"]
    assert a.ranks == [5] and a.step == 199
    assert a.onset_ts == pytest.approx(sim.stop_ts, abs=0.1)
    assert a.detected_ts - a.onset_ts <= 30


def test_25_second_checkpoints_and_long_evals_are_not_hangs():
    sim = JobSim(steps=400, checkpoint_every=50, checkpoint_s=25.0, eval_every=120, eval_s=60.0)
    events = sim.events()
    assert run_engine(events)[0] == []
    # ... because of the phase allowances: without them the same trace would hang.
    blind = with_values(DetectorConfig(), {"hang.checkpoint_s": 0.0, "hang.eval_s": 0.0})
    assert kinds(run_engine(events, blind)[0]) == ["hang"]


def test_checkpoint_longer_than_its_allowance_is_a_hang():
    config = with_values(DetectorConfig(), {"hang.checkpoint_s": 60.0})
    sim = JobSim(steps=300, checkpoint_every=100, checkpoint_s=200.0)
    found, _ = run_engine(sim.events(), config)
    assert kinds(found) == ["hang"] and found[0].step == 100


def test_clean_exit_is_not_a_hang_or_crash():
    sim = JobSim(steps=100, finish=True)
    events = sim.events()
    last = events[-1].ts
    from trainguard import events as ev
    tail = [ev.Gpu(job="j1", ts=last + t, node="n1", gpus=[]) for t in range(1, 120)]
    assert run_engine(events + tail)[0] == []


def test_crash_is_found_at_once():
    sim = JobSim(steps=300).crash(2, 200, exit_code=None, signal="SIGSEGV")
    found, engine = run_engine(sim.events())
    a = only(found, "crash")
    assert a.ranks == [2] and a.step == 199 and a.detected_ts - sim.stop_ts <= 2
    assert [i["kind"] for i in engine.incidents()] == ["crash"]


def test_zero_exit_code_is_no_crash():
    from trainguard import events as ev
    life = ev.Lifecycle(job="j1", ts=1.0, rank=0, event="exit", exit_code=0)
    assert run_engine([life])[0] == []


def test_silent_rank():
    sim = JobSim(steps=300).rank_silent(3, 200)
    found, _ = run_engine(sim.events())
    a = only(found, "silent")
    assert a.ranks == [3] and a.nodes == []


def test_silent_machine_is_named():
    sim = JobSim(steps=300, ranks=16, nodes=4).machine_down("n3", 200)
    found, engine = run_engine(sim.events())
    a = only(found, "silent")
    assert a.nodes == ["n3"] and a.ranks == [8, 9, 10, 11]
    assert [(i["kind"], i["nodes"]) for i in engine.incidents()] == [("silent", ["n3"])]


def test_xid_79_is_a_gpu_fault_and_application_xids_are_not():
    sim = JobSim(steps=300).xid("n2", 1, 79, 200)
    found, _ = run_engine(sim.events())
    xid = [a for a in found if a.evidence.get("xid") == 79]
    assert len(xid) == 1 and xid[0].ranks == [5] and xid[0].nodes == ["n2"]
    assert xid[0].detected_ts - sim.stop_ts <= 2
    for app_xid in (13, 31, 43):
        assert run_engine(JobSim(steps=200).xid("n1", 0, app_xid, 150).events())[0] == []


def test_double_bit_ecc_is_a_gpu_fault_within_two_seconds():
    sim = JobSim(steps=300).ecc_dbe("n1", 2, 200)
    found, _ = run_engine(sim.events())
    a = only(found, "gpu_fault")
    assert a.ranks == [2] and a.nodes == ["n1"]
    assert a.detected_ts - sim.step_end_ts[200] <= 2


def test_sustained_thermal_throttling_is_gpu_degraded():
    sim = JobSim(steps=300).throttle("n2", 3, 100)
    found, _ = run_engine(sim.events())
    a = only(found, "gpu_degraded")
    assert a.ranks == [7] and a.nodes == ["n2"] and a.evidence["condition"] == "throttle"
