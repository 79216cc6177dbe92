"""A fake ``pynvml`` for tests: the real :class:`PynvmlSource` runs against it unchanged.

:class:`FakePynvml` is module-like: it implements the ``nvml*`` functions the node agent uses
with realistic H100/H200 values, takes constants and error classes from the real ``pynvml``
module, and raises the real error classes built the way pynvml builds them
(``pynvml.NVMLError(code)`` returns the matching ``NVMLError_*`` subclass instance).
Functions it does not implement raise ``AttributeError``, as a too-old pynvml would; so do
the names in ``missing`` (``FakePynvml(..., missing={"nvmlDeviceGetPcieThroughput"})``).
"""
from __future__ import annotations

import queue
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml

H100_MEM_TOTAL = 85_520_809_984    # "81559MiB" in nvidia-smi, H100 80GB HBM3
H200_MEM_TOTAL = 150_754_820_096   # "143771MiB", H200 141GB HBM3e
HGX_BUS_IDS = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")  # 8-GPU HGX board
ALL_EVENTS = (pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeSingleBitEccError
              | pynvml.nvmlEventTypeDoubleBitEccError)


def nvml_error(code: int) -> pynvml.NVMLError:
    """The real pynvml exception for an NVML return code, as pynvml itself builds it."""
    return pynvml.NVMLError(code)


@dataclass
class FakeGpu:
    """One GPU's state; change fields between samples to simulate faults."""

    index: int
    uuid: str
    bus_id: str                      # NVML form: "00000000:18:00.0"
    name: str = "NVIDIA H100 80GB HBM3"
    util: int = 97
    mem_used: int = 79_456_894_976
    mem_total: int = H100_MEM_TOTAL
    temp: int = 61
    power_mw: int = 652_318
    sm_clock: int = 1980
    mem_clock: int = 2619            # HBM3 (H100 SXM); H200's HBM3e: 3201
    power_limit_mw: int = 700_000    # enforced limit, mW (H100/H200 SXM: 700 W)
    pcie_tx_kbs: int = 1_250_000     # KB/s over NVML's 20 ms window
    pcie_rx_kbs: int = 3_400_000
    clock_reasons: int = 0
    ecc_sbe: int = 0
    ecc_dbe: int = 0
    remapped: tuple = (0, 0, 0, 0)   # corrected rows, uncorrected rows, pending, failure
    pcie_replay: int = 0
    nvlinks: int = 18                # H100 SXM: 18 NVLink4 links
    nvlink_counts: dict = field(default_factory=dict)   # (link, counter) -> count
    unsupported: set = field(default_factory=set)       # function names -> NotSupported;
    # also ("clock", NVML_CLOCK_*), ("pcie", NVML_PCIE_UTIL_*) for one kind of a call
    errors: dict = field(default_factory=dict)          # function name -> NVML error code
    lost: bool = False
    supported_events: int = ALL_EVENTS


class FakeHandle:
    """Opaque device handle (a ctypes pointer in the real module)."""

    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"FakeHandle({self.index})"


class FakePynvml:
    """Module-like stand-in for ``pynvml``; see the module docstring."""

    def __init__(self, gpus: list, *, init_error: int | None = None,
                 event_error: int | None = None, old_api: bool = False,
                 missing: set | None = None):
        self.missing = set(missing or ())   # nvml* functions this "pynvml" lacks
        self.gpus = gpus
        self.init_error = init_error
        self.event_error = event_error
        self.old_api = old_api       # no nvmlDeviceGetCurrentClocksEventReasons
        self.calls: Counter = Counter()
        self.initialized = False
        self.event_sets: list = []
        self._events: queue.Queue = queue.Queue()
        self._registered: dict = {}  # index -> event type mask

    def __getattribute__(self, name: str):
        if name.startswith("nvml") and name in object.__getattribute__(self, "missing"):
            raise AttributeError(f"FakePynvml does not implement {name}")
        return object.__getattribute__(self, name)

    def __getattr__(self, name: str):
        if name == "nvmlDeviceGetCurrentClocksEventReasons" and not self.old_api:
            return self._clock_event_reasons
        value = getattr(pynvml, name)
        if callable(value) and not isinstance(value, type):
            raise AttributeError(f"FakePynvml does not implement {name}")
        return value  # constants, NVMLError classes

    # -- helpers ---------------------------------------------------------------------------
    def post_event(self, index: int, event_type: int, data: int) -> None:
        """Queue an event as the driver would (e.g. Xid 79 on GPU ``index``)."""
        self._events.put((index, event_type, data))

    def _gpu(self, handle: FakeHandle, fn: str) -> FakeGpu:
        self.calls[fn] += 1
        if not self.initialized:
            raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)
        gpu = self.gpus[handle.index]
        if gpu.lost:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        if fn in gpu.unsupported:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if fn in gpu.errors:
            raise nvml_error(gpu.errors[fn])
        return gpu

    # -- init ------------------------------------------------------------------------------
    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise nvml_error(self.init_error)
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self.calls["nvmlShutdown"] += 1
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.127.08"

    def nvmlDeviceGetCount(self) -> int:
        if not self.initialized:
            raise nvml_error(pynvml.NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        if index >= len(self.gpus):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._gpu(FakeHandle(index), "nvmlDeviceGetHandleByIndex")
        return FakeHandle(index)

    def nvmlDeviceGetIndex(self, handle: FakeHandle) -> int:
        return handle.index

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        return self._gpu(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        return self._gpu(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle):
        gpu = self._gpu(handle, "nvmlDeviceGetPciInfo")
        domain, bus, rest = gpu.bus_id.split(":")
        legacy = f"{int(domain, 16):04X}:{bus}:{rest}".upper().encode()
        return SimpleNamespace(busId=gpu.bus_id.upper().encode(), busIdLegacy=legacy,
                               domain=int(domain, 16), bus=int(bus, 16),
                               device=int(rest.split(".")[0], 16))

    # -- samples ---------------------------------------------------------------------------
    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle):
        gpu = self._gpu(handle, "nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=gpu.util, memory=max(gpu.util - 30, 0))

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version=None):
        gpu = self._gpu(handle, "nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=gpu.mem_total, used=gpu.mem_used,
                               free=gpu.mem_total - gpu.mem_used)

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._gpu(handle, "nvmlDeviceGetTemperature").temp

    def nvmlDeviceGetTemperatureV(self, handle: FakeHandle, sensor: int, version=None) -> int:
        assert sensor == pynvml.NVML_TEMPERATURE_GPU
        return self._gpu(handle, "nvmlDeviceGetTemperatureV").temp

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        return self._gpu(handle, "nvmlDeviceGetPowerUsage").power_mw

    def nvmlDeviceGetClockInfo(self, handle: FakeHandle, clock_type: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetClockInfo")
        if ("clock", clock_type) in gpu.unsupported:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if clock_type == pynvml.NVML_CLOCK_MEM:
            return gpu.mem_clock
        assert clock_type == pynvml.NVML_CLOCK_SM
        return gpu.sm_clock

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: FakeHandle) -> int:
        return self._gpu(handle, "nvmlDeviceGetEnforcedPowerLimit").power_limit_mw

    def nvmlDeviceGetPcieThroughput(self, handle: FakeHandle, counter: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetPcieThroughput")
        if ("pcie", counter) in gpu.unsupported:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if counter == pynvml.NVML_PCIE_UTIL_TX_BYTES:
            return gpu.pcie_tx_kbs
        assert counter == pynvml.NVML_PCIE_UTIL_RX_BYTES
        return gpu.pcie_rx_kbs

    def _clock_event_reasons(self, handle: FakeHandle) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksEventReasons").clock_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: FakeHandle) -> int:
        return self._gpu(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").clock_reasons

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, error_type: int, counter: int):
        gpu = self._gpu(handle, "nvmlDeviceGetTotalEccErrors")
        assert counter == pynvml.NVML_VOLATILE_ECC
        if error_type == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return gpu.ecc_sbe
        assert error_type == pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
        return gpu.ecc_dbe

    def nvmlDeviceGetRemappedRows(self, handle: FakeHandle) -> tuple:
        return tuple(self._gpu(handle, "nvmlDeviceGetRemappedRows").remapped)

    def nvmlDeviceGetPcieReplayCounter(self, handle: FakeHandle) -> int:
        return self._gpu(handle, "nvmlDeviceGetPcieReplayCounter").pcie_replay

    def nvmlDeviceGetNvLinkState(self, handle: FakeHandle, link: int) -> int:
        gpu = self._gpu(handle, "nvmlDeviceGetNvLinkState")
        if link >= gpu.nvlinks:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, handle: FakeHandle, link: int, counter: int):
        gpu = self._gpu(handle, "nvmlDeviceGetNvLinkErrorCounter")
        if link >= gpu.nvlinks:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if ("nvlink_counter", counter) in gpu.unsupported:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu.nvlink_counts.get((link, counter), 0)

    # -- events ----------------------------------------------------------------------------
    def nvmlEventSetCreate(self):
        self.calls["nvmlEventSetCreate"] += 1
        event_set = SimpleNamespace(freed=False)
        self.event_sets.append(event_set)
        return event_set

    def nvmlDeviceGetSupportedEventTypes(self, handle: FakeHandle) -> int:
        return self._gpu(handle, "nvmlDeviceGetSupportedEventTypes").supported_events

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, event_types: int, event_set) -> None:
        gpu = self._gpu(handle, "nvmlDeviceRegisterEvents")
        if event_types & ~gpu.supported_events:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._registered[handle.index] = self._registered.get(handle.index, 0) | event_types

    def registered(self, index: int) -> int:
        """Event types registered for GPU ``index``."""
        return self._registered.get(index, 0)

    def nvmlEventSetWait(self, event_set, timeout_ms: int):
        self.calls["nvmlEventSetWait"] += 1
        assert not event_set.freed
        if self.event_error is not None:
            raise nvml_error(self.event_error)
        try:
            index, event_type, data = self._events.get(timeout=timeout_ms / 1000.0)
        except queue.Empty:
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT) from None
        if not self._registered.get(index, 0) & event_type:
            raise nvml_error(pynvml.NVML_ERROR_TIMEOUT)
        return SimpleNamespace(device=FakeHandle(index), eventType=event_type, eventData=data,
                               gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)

    nvmlEventSetWait_v2 = nvmlEventSetWait

    def nvmlEventSetFree(self, event_set) -> None:
        event_set.freed = True


def hgx_node(model: str = "H100", n: int = 8, **overrides) -> FakePynvml:
    """A FakePynvml of an 8-GPU HGX H100 or H200 board in training (busy, warm, no errors)."""
    gpus = []
    for i in range(n):
        gpu = FakeGpu(index=i, uuid=f"GPU-{0x509665ad + i:08x}-b600-ac93-3616-d754b23d63{i:02x}",
                      bus_id=f"00000000:{HGX_BUS_IDS[i % 8]}:00.0", temp=58 + i,
                      power_mw=640_000 + 1_731 * i, util=96 + i % 4)
        if model == "H200":
            gpu.name, gpu.mem_total, gpu.mem_used = ("NVIDIA H200", H200_MEM_TOTAL,
                                                     131_940_352_000)
            gpu.mem_clock = 3201
        for k, v in overrides.items():
            setattr(gpu, k, v)
        gpus.append(gpu)
    return FakePynvml(gpus)
