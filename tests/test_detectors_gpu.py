"""GPU fault and degradation conditions one by one, on hand-made samples."""
import pytest

from trainguard import events as ev
from trainguard.detectors import GpuDegradedDetector, GpuFaultDetector


def gpu(index, **fields):
    return {"index": index, "uuid": f"GPU-{index}", **fields}


def sample(ts, gpus, node="n1"):
    return ev.Gpu(job="j", ts=float(ts), node=node, gpus=gpus)


def feed(detector, items):
    found = []
    for item in items:
        found += detector.update(item)
    return found


def placed(detector):
    """Teach the detector that ranks 8..11 run on n1's GPUs 0..3."""
    for local in range(4):
        detector.update({"k": "life", "job": "j", "rank": 8 + local, "node": "n1", "ts": 0.0,
                         "event": "start", "local_rank": local, "world_size": 16})
    return detector


def test_lost_gpu_is_a_fault_once():
    d = placed(GpuFaultDetector())
    found = feed(d, [sample(t, [gpu(0), gpu(1, lost=True)]) for t in range(5)])
    assert [(f.kind, f.ranks, f.nodes) for f in found] == [("gpu_fault", [9], ["n1"])]
    assert "lost" in found[0].summary


def test_remap_failure_and_dbe_rise():
    d = placed(GpuFaultDetector())
    items = [sample(t, [gpu(2, ecc_dbe=0, remapped_failure=False)]) for t in range(3)]
    items += [sample(3, [gpu(2, ecc_dbe=0, remapped_failure=True)])]
    items += [sample(t, [gpu(2, ecc_dbe=2, remapped_failure=True)]) for t in range(4, 7)]
    found = feed(d, items)
    assert [(f.detected_ts, f.ranks) for f in found] == [(3.0, [10]), (4.0, [10])]
    assert "remapping" in found[0].summary and "ecc_dbe rose 0 -> 2" in found[1].summary


def test_gpu_missing_from_samples():
    d = placed(GpuFaultDetector(missing_samples=2))
    items = [sample(t, [gpu(i) for i in range(4)]) for t in range(3)]
    items += [sample(t, [gpu(0), gpu(1), gpu(3)]) for t in range(3, 8)]
    found = feed(d, items)
    assert [(f.detected_ts, f.ranks, f.evidence["gpu"]) for f in found] == [(4.0, [10], 2)]


def test_unavailable_nvml_is_not_a_missing_gpu():
    d = GpuFaultDetector()
    items = [sample(t, [gpu(0), gpu(1)]) for t in range(3)]
    items += [ev.Gpu(job="j", ts=3.0 + t, node="n1", gpus=[], status="unavailable",
                     reason="NVML gone") for t in range(5)]
    assert feed(d, items) == []


@pytest.mark.parametrize("xid", [48, 64, 74, 79, 95, 119, 120])
def test_every_hardware_xid_is_a_fault_and_repeats_are_one(xid):
    d = GpuFaultDetector(repeat_s=300.0)
    x = ev.Xid(job="j", ts=10.0, node="n1", gpu=0, xid=xid, source="nvml", message="m")
    found = feed(d, [x, x.replace(ts=20.0), x.replace(ts=400.0)])
    assert [f.detected_ts for f in found] == [10.0, 400.0]
    assert feed(GpuDegradedDetector(), [x]) == []


@pytest.mark.parametrize("xid", [63, 92, 94])
def test_an_xid_that_leaves_the_gpu_in_service_is_an_alert_not_a_fault(xid):
    """NVIDIA's catalog: 63 and 92 IGNORE, 94 RESTART_APP (the process that hit it restarts,
    the GPU keeps running others): evicting the machine would hurt a healthy job. Through the
    engine: a gpu_degraded warning naming the rank of the GPU, whose ladder only alerts."""
    from trainguard.detectors import Engine
    from trainguard.detectors.registry import default_ladder

    x = ev.Xid(job="j", ts=10.0, node="n1", gpu=1, xid=xid, source="kmsg", message="m")
    assert feed(GpuFaultDetector(), [x]) == []
    found = feed(GpuDegradedDetector(xid_repeat_s=600.0),
                 [x, x.replace(ts=500.0), x.replace(ts=700.0), x.replace(gpu=0, ts=20.0)])
    assert [(f.detected_ts, f.evidence["gpu"]) for f in found] == [(10.0, 1), (700.0, 1),
                                                                  (20.0, 0)]
    engine = Engine()
    out = []
    for rank in range(2):
        out += engine.update(ev.Lifecycle(job="j", ts=1.0, node="n1", rank=rank, event="start",
                                          local_rank=rank, world_size=2, pid=100 + rank))
    out += engine.update(x)
    assert [(a.kind, a.severity, a.ranks, a.nodes) for a in out] == [
        ("gpu_degraded", "warning", [1], ["n1"])]
    assert default_ladder()["gpu_degraded"] == ("alert",)


def test_pcie_replays_rising():
    d = placed(GpuDegradedDetector(window_s=60.0, pcie_replays=50))
    items = [sample(t, [gpu(1, pcie_replay=100 + 3 * max(0, t - 20))]) for t in range(60)]
    found = feed(d, items)
    assert [(f.evidence["condition"], f.ranks) for f in found] == [("pcie_replay", [9])]
    assert found[0].onset_ts == 21.0


def test_nvlink_errors_increasing_but_a_single_blip_is_not():
    d = GpuDegradedDetector(nvlink_increments=3)
    blip = [sample(t, [gpu(0, nvlink_errors=5 if t >= 10 else 0)]) for t in range(100)]
    assert feed(d, blip) == []
    d = GpuDegradedDetector(nvlink_increments=3)
    climbing = [sample(t, [gpu(0, nvlink_errors=t // 10)]) for t in range(100)]
    found = feed(d, climbing)
    assert [f.evidence["condition"] for f in found] == ["nvlink_errors"]


def test_climbing_single_bit_errors():
    d = GpuDegradedDetector(sbe_increase=10, sbe_increments=2)
    items = [sample(t, [gpu(3, ecc_sbe=0 if t < 30 else (t - 30) * 2)]) for t in range(60)]
    found = feed(d, items)
    assert [f.evidence["condition"] for f in found] == ["ecc_sbe"]


def test_brief_or_software_power_throttling_is_not_degradation():
    d = GpuDegradedDetector()
    items = [sample(t, [gpu(0, throttle=["sw_power_cap"]),
                        gpu(1, throttle=["hw_slowdown"] if t % 5 == 0 else [])])
             for t in range(300)]
    assert feed(d, items) == []


@pytest.mark.parametrize("make,xid", [(GpuFaultDetector, 79), (GpuDegradedDetector, 94)])
def test_an_xid_told_by_nvml_and_by_a_kernel_log_without_the_gpu_is_one(make, xid):
    """Without a PCI bus id map the kernel log's Xid has no GPU index, so the same Xid told by
    NVML was a second finding (a second warning for an Xid that leaves the GPU in service).
    Either may come first; two GPUs with their indices are still two, and the same Xid a
    minute later is judged as before."""
    def x(ts, gpu, source):
        return ev.Xid(job="j", ts=ts, node="n1", gpu=gpu, xid=xid, source=source, message="m")

    d = make()
    assert len(feed(d, [x(10.0, None, "kmsg"), x(10.4, 3, "nvml")])) == 1
    assert len(feed(d, [x(20.0, 5, "nvml"), x(20.2, None, "kmsg")])) == 1
    d = make()
    assert len(feed(d, [x(10.0, 3, "nvml"), x(10.1, 5, "nvml")])) == 2
    assert len(feed(d, [x(10.3, None, "kmsg")])) == 0
    assert len(feed(make(), [x(10.0, None, "kmsg"), x(70.0, 2, "nvml")])) == 2
    # a review's cases: each finding pairs with one telling, so a second GPU's Xid told in
    # the same seconds, or one GPU's Xid told again and again, hides no other GPU's
    found = feed(make(), [x(10.0, 3, "nvml"), x(10.1, None, "kmsg"), x(12.0, 5, "nvml"),
                          x(12.1, None, "kmsg")])
    assert [f.evidence["gpu"] for f in found] == [3, 5]
    storm = [e for t in range(0, 400, 5) for e in (x(float(t), 3, "nvml"),
                                                  x(t + 0.1, None, "kmsg"))]
    assert 5 in [f.evidence["gpu"] for f in feed(make(), [*storm, x(400.0, 5, "nvml")])]


def test_an_xid_without_a_gpu_index_alone_is_still_an_alert_once_an_hour():
    """A machine without a PCI bus id map: its kernel log's Xid 94 every half hour is a
    warning once an hour, as for a GPU with its index (the pairing keeps its own stamps)."""
    d = GpuDegradedDetector()
    found = feed(d, [ev.Xid(job="j", ts=float(t), node="n1", gpu=None, xid=94, source="kmsg",
                            message="m") for t in range(0, 14401, 1800)])
    assert [f.detected_ts for f in found] == [0.0, 3600.0, 7200.0, 10800.0, 14400.0]


def test_made_up_gpu_indices_do_not_grow_the_state_without_end():
    """The GPU index of an xid event is whatever its sender wrote (trust nothing from Kafka):
    a flood of made-up ones keeps XID_KEYS_KEPT repeats at most, and a real fault that
    follows is still found."""
    from trainguard.detectors.gpu import XID_KEYS_KEPT

    fault, degraded = GpuFaultDetector(), GpuDegradedDetector()
    flood = [ev.Xid(job="j", ts=10.0 + i * 1e-3, node="n1", gpu=i, xid=xid, source="kmsg",
                    message="m") for i in range(3000) for xid in (79, 94)]
    feed(fault, flood)
    feed(degraded, flood)
    assert len(fault._xid_last) == len(degraded._xid_last) == XID_KEYS_KEPT
    real = ev.Xid(job="j", ts=20.0, node="n1", gpu=0, xid=48, source="nvml", message="DBE")
    assert [f.evidence["xid"] for f in feed(fault, [real])] == [48]
