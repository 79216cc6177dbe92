"""The NVML path of the node agent: the real PynvmlSource driven by a fake pynvml.

Only the error classes are real (``pynvml.NVMLError_*``); the GPU values are the fake's.
The last tests run the real pynvml on this machine, which has no GPU.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import pynvml
import pytest

from trainguard.collectors import kmsg
from trainguard.collectors.nvml import (NvmlUnavailable, PynvmlSource, gpu_event_payload)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fakes_nvml import H200_MEM_TOTAL, FakePynvml, hgx_node

XID = pynvml.nvmlEventTypeXidCriticalError
DBE = pynvml.nvmlEventTypeDoubleBitEccError
SBE = pynvml.nvmlEventTypeSingleBitEccError
FIELDS = {"index", "uuid", "util", "mem_used", "mem_total", "temp", "power", "sm_clock",
          "throttle", "ecc_sbe", "ecc_dbe", "remapped_pending", "remapped_failure",
          "pcie_replay", "nvlink_errors", "mem_clock", "power_limit", "pcie_tx_kbs",
          "pcie_rx_kbs"}


def source(fake: FakePynvml) -> PynvmlSource:
    src = PynvmlSource(lib=fake)
    src.init()
    return src


def validate_gpu_payload(payload: dict) -> None:
    """Check against the project's contract classes where they are importable."""
    events = pytest.importorskip("trainguard.events")
    events.from_dict({"v": 1, "type": "gpu", "job": "j1", "ts": time.time(), "node": "n1",
                      "rank": None, **payload})


def test_every_field_read_from_a_healthy_h100_node():
    fake = hgx_node("H100")
    src = source(fake)
    assert src.device_count() == 8
    gpus = src.sample()
    assert [g["index"] for g in gpus] == list(range(8))
    for g in gpus:
        assert set(g) == FIELDS
    g = gpus[2]
    assert g["uuid"] == fake.gpus[2].uuid and g["uuid"].startswith("GPU-")
    assert (g["util"], g["mem_used"], g["mem_total"]) == (98, 79_456_894_976, 85_520_809_984)
    assert (g["temp"], g["power"], g["sm_clock"]) == (60, 643.462, 1980)
    assert isinstance(g["power"], float) and isinstance(g["sm_clock"], int)
    assert g["throttle"] == []
    assert (g["ecc_sbe"], g["ecc_dbe"], g["pcie_replay"], g["nvlink_errors"]) == (0, 0, 0, 0)
    assert g["remapped_pending"] is False and g["remapped_failure"] is False
    assert all(v == "ok" for v in src.field_status()[2].values())
    validate_gpu_payload(gpu_event_payload(src))


def test_h200_memory_and_error_counters():
    fake = hgx_node("H200", n=2)
    g1 = fake.gpus[1]
    g1.ecc_sbe, g1.ecc_dbe, g1.pcie_replay = 12, 1, 7
    g1.remapped = (3, 1, 1, 0)
    g1.nvlink_counts = {(0, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT): 5,
                        (17, pynvml.NVML_NVLINK_ERROR_DL_REPLAY): 2,
                        (4, pynvml.NVML_NVLINK_ERROR_DL_RECOVERY): 1}
    src = source(fake)
    gpus = src.sample()
    assert gpus[0]["mem_total"] == H200_MEM_TOTAL
    g = gpus[1]
    assert (g["ecc_sbe"], g["ecc_dbe"], g["pcie_replay"], g["nvlink_errors"]) == (12, 1, 7, 8)
    assert g["remapped_pending"] is True and g["remapped_failure"] is False
    g1.remapped = (3, 2, 0, 1)
    assert src.sample()[1]["remapped_failure"] is True


def test_throttle_reasons_by_name_new_and_old_api():
    mask = (pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwSlowdown
            | pynvml.nvmlClocksEventReasonHwThermalSlowdown)
    for old_api in (False, True):
        fake = hgx_node(n=1, clock_reasons=mask)
        fake.old_api = old_api
        g = source(fake).sample()[0]
        assert g["throttle"] == ["sw_power_cap", "hw_slowdown", "hw_thermal"]
        used = ("nvmlDeviceGetCurrentClocksThrottleReasons" if old_api
                else "nvmlDeviceGetCurrentClocksEventReasons")
        assert fake.calls[used] == 1
    idle = source(hgx_node(n=1, clock_reasons=pynvml.nvmlClocksEventReasonGpuIdle
                           | pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown)).sample()[0]
    assert idle["throttle"] == ["gpu_idle", "hw_power_brake"]


def test_not_supported_fields_are_omitted_and_not_asked_again():
    unsupported = {"nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetRemappedRows",
                   "nvmlDeviceGetTotalEccErrors", "nvmlDeviceGetPowerUsage"}
    fake = hgx_node(n=2, unsupported=set(unsupported), nvlinks=0)  # a PCIe card, ECC off
    src = source(fake)
    first = src.sample()
    for g in first:
        assert set(g) == FIELDS - {"pcie_replay", "remapped_pending", "remapped_failure",
                                   "ecc_sbe", "ecc_dbe", "power", "nvlink_errors"}
    calls = dict(fake.calls)
    assert src.sample() == first
    for name in unsupported:
        assert fake.calls[name] == calls[name]
    status = src.field_status()[0]
    assert status["pcie_replay"] == status["nvlink_errors"] == "not_supported"
    validate_gpu_payload(gpu_event_payload(src))


def test_unsupported_nvlink_counter_type_is_skipped():
    fake = hgx_node(n=1, nvlink_counts={(1, pynvml.NVML_NVLINK_ERROR_DL_ECC_DATA): 50,
                                        (1, pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA): 4})
    fake.gpus[0].unsupported.add(("nvlink_counter", pynvml.NVML_NVLINK_ERROR_DL_ECC_DATA))
    src = source(fake)
    assert src.sample()[0]["nvlink_errors"] == 4
    before = fake.calls["nvmlDeviceGetNvLinkErrorCounter"]
    src.sample()
    assert fake.calls["nvmlDeviceGetNvLinkErrorCounter"] - before == 18 * 4


def test_other_nvml_errors_omit_the_field_and_log_once(caplog):
    fake = hgx_node(n=1, errors={"nvmlDeviceGetTemperature": pynvml.NVML_ERROR_NO_PERMISSION})
    src = source(fake)
    with caplog.at_level(logging.WARNING, logger="trainguard.collectors.nvml"):
        for _ in range(3):
            g = src.sample()[0]
            assert "temp" not in g and "util" in g
    assert len([r for r in caplog.records if "temp" in r.getMessage()]) == 1
    assert src.field_status()[0]["temp"] == "error: NVMLError_NoPermission"


def test_deprecated_temperature_call_falls_back_to_the_versioned_one():
    fake = hgx_node(n=1, errors={"nvmlDeviceGetTemperature": pynvml.NVML_ERROR_DEPRECATED})
    src = source(fake)
    assert src.sample()[0]["temp"] == 58
    assert fake.calls["nvmlDeviceGetTemperatureV"] == 1
    fake.gpus[0].unsupported.add("nvmlDeviceGetTemperatureV")
    src2 = source(fake)
    assert "temp" not in src2.sample()[0]
    assert src2.field_status()[0]["temp"] == "not_supported"


def test_lost_gpu_is_flagged_and_logged_once(caplog):
    fake = hgx_node()
    src = source(fake)
    assert all("lost" not in g for g in src.sample())
    fake.gpus[3].lost = True
    with caplog.at_level(logging.WARNING, logger="trainguard.collectors.nvml"):
        for _ in range(3):
            gpus = src.sample()
            assert gpus[3] == {"index": 3, "uuid": fake.gpus[3].uuid, "lost": True}
            assert all(set(g) == FIELDS for i, g in enumerate(gpus) if i != 3)
    assert len([r for r in caplog.records if "lost" in r.getMessage()]) == 1
    validate_gpu_payload(gpu_event_payload(src))
    fake.gpus[3].lost = False  # e.g. after a GPU reset
    assert set(src.sample()[3]) == FIELDS


def test_gpu_lost_before_init_and_midway_through_fields():
    fake = hgx_node(n=2)
    fake.gpus[0].lost = True
    src = source(fake)
    assert src.sample()[0] == {"index": 0, "uuid": "unknown", "lost": True}
    assert src.bus_id_map() == {"0000:2a:00": 1}
    fake2 = hgx_node(n=1, errors={"nvmlDeviceGetPcieReplayCounter":
                                  pynvml.NVML_ERROR_GPU_IS_LOST})
    assert source(fake2).sample()[0]["lost"] is True


def test_bus_id_map_matches_kernel_log_lines():
    src = source(hgx_node())
    bus_map = src.bus_id_map()
    assert bus_map["0000:18:00"] == 0 and bus_map["0000:db:00"] == 7 and len(bus_map) == 8
    rec = kmsg.parse_xid_line("[ 99.1] NVRM: Xid (PCI:0000:5d:00): 79, pid=1, name=python, "
                              "GPU has fallen off the bus.")
    follower = kmsg.KmsgFollower(bus_id_map=bus_map)
    assert follower.gpu_index(rec.bus_id) == 3
    assert follower.gpu_index("0000:9b:00") is None


def test_event_wait_timeout_returns_none():
    fake = hgx_node(n=2)
    src = source(fake)
    t0 = time.monotonic()
    assert src.wait_event(150) is None
    assert 0.12 < time.monotonic() - t0 < 2.0
    assert fake.calls["nvmlEventSetWait"] == 1
    assert fake.registered(0) == fake.registered(1) == XID | DBE  # no single-bit events
    src.shutdown()
    assert fake.event_sets[0].freed and fake.calls["nvmlShutdown"] == 1


def test_xid_79_and_double_bit_ecc_from_the_event_set():
    fake = hgx_node()
    src = source(fake)
    assert src.wait_event(10) is None  # registers
    fake.post_event(2, XID, 79)
    ev = src.wait_event(1000)
    assert ev["gpu"] == 2 and ev["xid"] == 79 and ev["source"] == "nvml"
    assert "fallen off the bus" in ev["message"]
    fake.post_event(5, DBE, 0)
    ev = src.wait_event(1000)
    assert (ev["gpu"], ev["xid"]) == (5, 48) and "Double Bit ECC" in ev["message"]
    events = pytest.importorskip("trainguard.events")
    events.from_dict({"v": 1, "type": "xid", "job": "j", "ts": 1.0, "node": "n", "rank": None,
                      **ev})


def test_event_thread_receives_events_and_shutdown_unblocks_it():
    fake = hgx_node()
    src = source(fake)
    got, done = [], threading.Event()

    def loop():
        while not done.is_set():
            ev = src.wait_event(200)
            if ev:
                got.append(ev)

    t = threading.Thread(target=loop)
    t.start()
    time.sleep(0.1)
    fake.post_event(7, XID, 119)
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        time.sleep(0.02)
    done.set()
    src.shutdown()
    t.join(2)
    assert not t.is_alive()
    assert got[0]["gpu"] == 7 and got[0]["xid"] == 119


def test_no_event_support_waits_without_spinning():
    fake = hgx_node(n=2, supported_events=0)
    src = source(fake)
    t0, c0 = time.monotonic(), time.process_time()
    for _ in range(3):
        assert src.wait_event(100) is None
    assert time.monotonic() - t0 >= 0.28
    assert time.process_time() - c0 < 0.1
    assert fake.calls["nvmlEventSetWait"] == 0


def test_event_wait_error_logged_once_and_waits(caplog):
    fake = hgx_node(n=1)
    fake.event_error = pynvml.NVML_ERROR_UNKNOWN
    src = source(fake)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="trainguard.collectors.nvml"):
        assert src.wait_event(100) is None and src.wait_event(100) is None
    assert time.monotonic() - t0 >= 0.18
    assert len([r for r in caplog.records if "nvmlEventSetWait" in r.getMessage()]) == 1


@pytest.mark.parametrize("code, words", [
    (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1"),
    (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "kernel driver is not loaded"),
    (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "different versions"),
    (pynvml.NVML_ERROR_UNKNOWN, "NVMLError_Unknown"),
])
def test_init_failures_become_unavailable(code, words):
    src = PynvmlSource(lib=FakePynvml([], init_error=code))
    with pytest.raises(NvmlUnavailable) as info:
        src.init()
    assert words in info.value.reason and info.value.reason.startswith("NVML is unavailable: ")
    payload = gpu_event_payload(src)
    assert payload == {"gpus": [], "status": "unavailable", "reason": info.value.reason}
    validate_gpu_payload(payload)


def test_fake_raises_the_real_pynvml_error_classes():
    fake = hgx_node(n=1)
    fake.nvmlInit()
    fake.gpus[0].lost = True
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        fake.nvmlDeviceGetUUID(fake.nvmlDeviceGetHandleByIndex(0))
    with pytest.raises(pynvml.NVMLError_Timeout):
        fake.nvmlEventSetWait(fake.nvmlEventSetCreate(), 1)
    assert type(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)) is pynvml.NVMLError_NotSupported


def _has_nvidia_gpu() -> bool:
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


@pytest.mark.skipif(_has_nvidia_gpu(), reason="this machine has an NVIDIA GPU")
def test_real_pynvml_without_a_gpu_reports_unavailable():
    src = PynvmlSource()
    payload = gpu_event_payload(src)
    assert payload["gpus"] == [] and payload["status"] == "unavailable"
    assert payload["reason"].startswith("NVML is unavailable: ")
    assert payload["reason"].endswith(".")
    validate_gpu_payload(payload)
    with pytest.raises(NvmlUnavailable):
        src.wait_event(10)
    src.shutdown()  # harmless when init never succeeded


def test_real_pynvml_either_samples_or_reports_unavailable():
    payload = gpu_event_payload(PynvmlSource())
    if payload.get("status") == "unavailable":
        assert payload["gpus"] == [] and payload["reason"]
    else:
        assert payload["gpus"] and all("uuid" in g for g in payload["gpus"])


# -- the counters for machine_outlier (issue 24) ------------------------------------------
NEW_FIELDS = {"mem_clock", "power_limit", "pcie_tx_kbs", "pcie_rx_kbs"}


def test_memory_clock_power_limit_and_pcie_throughput_with_their_units():
    fake = hgx_node("H200", n=2)
    fake.gpus[1].mem_clock, fake.gpus[1].power_limit_mw = 1593, 450_500   # a capped, slow GPU
    fake.gpus[1].pcie_tx_kbs, fake.gpus[1].pcie_rx_kbs = 12, 7
    src = source(fake)
    g0, g1 = src.sample()
    assert (g0["mem_clock"], g0["power_limit"]) == (3201, 700.0)          # MHz, W
    assert (g0["pcie_tx_kbs"], g0["pcie_rx_kbs"]) == (1_250_000, 3_400_000)   # KB/s
    assert (g1["mem_clock"], g1["power_limit"], g1["pcie_tx_kbs"], g1["pcie_rx_kbs"]) == \
        (1593, 450.5, 12, 7)
    assert type(g0["mem_clock"]) is int and type(g0["power_limit"]) is float
    assert all(src.field_status()[0][f] == "ok" for f in NEW_FIELDS)
    validate_gpu_payload(gpu_event_payload(src))
    fake.gpus[1].mem_clock = 1200                   # read again each sample
    assert src.sample()[1]["mem_clock"] == 1200


@pytest.mark.parametrize("unsupported, gone", [
    ({("clock", pynvml.NVML_CLOCK_MEM)}, {"mem_clock"}),
    ({"nvmlDeviceGetEnforcedPowerLimit"}, {"power_limit"}),
    ({"nvmlDeviceGetPcieThroughput"}, {"pcie_tx_kbs", "pcie_rx_kbs"}),
    ({("pcie", pynvml.NVML_PCIE_UTIL_RX_BYTES)}, {"pcie_tx_kbs", "pcie_rx_kbs"}),
])
def test_an_unsupported_new_counter_is_left_out_asked_once_and_said_once(unsupported, gone,
                                                                         caplog):
    fake = hgx_node(n=2, unsupported=set(unsupported))
    src = source(fake)
    with caplog.at_level(logging.INFO, logger="trainguard.collectors.nvml"):
        first = src.sample()
        calls = dict(fake.calls)
        for _ in range(3):
            assert src.sample() == first
    for g in first:
        assert set(g) == FIELDS - gone
    asked = {"power_limit": "nvmlDeviceGetEnforcedPowerLimit",
             "pcie_tx_kbs": "nvmlDeviceGetPcieThroughput"}
    for name in (asked[f] for f in gone if f in asked):
        assert fake.calls[name] == calls[name]              # not asked again
    said = [r for r in caplog.records if "not supported" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO     # said once, for all GPUs
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    validate_gpu_payload(gpu_event_payload(src))


def test_an_old_pynvml_without_the_new_functions_still_samples(caplog):
    fake = hgx_node(n=2)
    fake.missing = {"nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPcieThroughput"}
    src = source(fake)
    with caplog.at_level(logging.INFO, logger="trainguard.collectors.nvml"):
        for _ in range(3):
            gpus = src.sample()
    assert all(set(g) == FIELDS - {"power_limit", "pcie_tx_kbs", "pcie_rx_kbs"} for g in gpus)
    assert src.field_status()[1]["power_limit"] == "not_supported"
    said = [r.getMessage() for r in caplog.records if "not supported" in r.getMessage()]
    assert len(said) == 2 and all("pynvml is too old" in m for m in said)


def test_other_errors_of_the_new_counters_are_logged_once(caplog):
    fake = hgx_node(n=1, errors={"nvmlDeviceGetPcieThroughput": pynvml.NVML_ERROR_NO_PERMISSION,
                                 "nvmlDeviceGetEnforcedPowerLimit": pynvml.NVML_ERROR_UNKNOWN})
    src = source(fake)
    with caplog.at_level(logging.WARNING, logger="trainguard.collectors.nvml"):
        for _ in range(3):
            g = src.sample()[0]
            assert not {"power_limit", "pcie_tx_kbs", "pcie_rx_kbs"} & set(g)
            assert g["mem_clock"] == 2619
    assert len([r for r in caplog.records if "power_limit" in r.getMessage()]) == 1
    assert len([r for r in caplog.records if "pcie_tx_kbs" in r.getMessage()]) == 1
    del fake.gpus[0].errors["nvmlDeviceGetPcieThroughput"]     # a transient error: read again
    assert src.sample()[0]["pcie_rx_kbs"] == 3_400_000


def test_the_pcie_reader_thread_keeps_the_20ms_calls_out_of_the_sample_path():
    fake = hgx_node(n=4)
    src = source(fake)
    assert src.start_pcie_reader(interval_s=0.05) and not src.start_pcie_reader(0.05)
    try:
        deadline = time.monotonic() + 5
        while fake.calls["nvmlDeviceGetPcieThroughput"] < 16 and time.monotonic() < deadline:
            time.sleep(0.01)
        fake.gpus[2].pcie_rx_kbs = 99
        deadline = time.monotonic() + 5
        while src.sample()[2].get("pcie_rx_kbs") != 99 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert src.sample()[2]["pcie_rx_kbs"] == 99          # the reader's latest values
        src.shutdown()
        assert src._pcie_thread is None                      # joined at shutdown
        calls = fake.calls["nvmlDeviceGetPcieThroughput"]
        time.sleep(0.15)
        assert fake.calls["nvmlDeviceGetPcieThroughput"] == calls
    finally:
        src.shutdown()
    # values older than pcie_max_age_s are left out rather than sent stale
    stale = PynvmlSource(lib=hgx_node(n=1), pcie_max_age_s=0.0)
    stale.init()
    stale.start_pcie_reader(interval_s=3600)
    try:
        time.sleep(0.05)
        stale.pcie_max_age_s = 0.0
        assert "pcie_tx_kbs" not in stale.sample()[0]
    finally:
        stale.shutdown()


def test_cost_per_sample_of_an_8_gpu_machine():
    """What one sample costs in this process with the fake (the driver's own time is not in
    it); the PCIe reads are on the reader thread, as in the agent."""
    src = source(hgx_node("H100"))
    src.start_pcie_reader(interval_s=3600)
    try:
        src.sample()
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            src.sample()
        per_sample_us = (time.perf_counter() - t0) / n * 1e6
    finally:
        src.shutdown()
    print(f"NVML sample of 8 fake GPUs: {per_sample_us:.0f} us")
    assert per_sample_us < 20_000


def test_doctests():
    import doctest

    from trainguard.collectors import nvml
    assert doctest.testmod(nvml).failed == 0


# -- scripts/gpu_check.py ----------------------------------------------------------------------
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"


def _load_script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("tg_gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_script_full_path_with_the_fake(tmp_path, capsys):
    fake = hgx_node("H200", n=4, unsupported={"nvmlDeviceGetPcieReplayCounter"})
    fake.post_event(1, XID, 79)
    out = tmp_path / "check.json"
    rc = _load_script().main([str(out), "--seconds", "1.2", "--interval", "0.2",
                              "--event-wait-ms", "100"], lib=fake)
    assert rc == 0 and "4 GPU(s)" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["status"] == "ok" and report["device_count"] == 4
    assert report["support"]["pcie_replay"] == {"not_supported": 4}
    assert report["support"]["util"] == {"ok": 4}
    assert report["versions"]["driver"] == "550.127.08"
    assert report["event_wait"]["events"] == 1 and report["event_wait"]["timeouts"] >= 3
    kinds = [e["type"] for e in report["events"]]
    assert kinds.count("gpu") >= 5
    xid = next(e for e in report["events"] if e["type"] == "xid")
    assert (xid["gpu"], xid["xid"], xid["source"]) == (1, 79, "nvml")
    lines = (tmp_path / "check.events.jsonl").read_text().splitlines()
    assert len(lines) == len(report["events"])
    events = pytest.importorskip("trainguard.events")
    for line in lines:
        events.decode(line)
    assert fake.event_sets[0].freed and not fake.initialized


def test_gpu_check_script_standalone_without_a_gpu(tmp_path):
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # load by path
    out = tmp_path / "check.json"
    argv = ["timeout", "-s", "KILL", "120", sys.executable, str(SCRIPT), str(out),
            "--seconds", "1", "--interval", "0.5", "--no-kmsg"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=150)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    if report["status"] == "unavailable":
        assert report["reason"] in proc.stdout
        assert report["events"][0]["gpus"] == [] and report["events"][0]["status"] == "unavailable"
        proc = subprocess.run(argv + ["--require-gpu"], capture_output=True, env=env, timeout=150)
        assert proc.returncode == 3
    else:
        assert report["device_count"] >= 1
