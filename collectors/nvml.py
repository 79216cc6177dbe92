"""GPU health from NVML (nvidia-ml-py), behind a small interface.

:class:`NvmlSource` is what the node agent needs: per-GPU samples in the SPEC ``gpu`` entry
shape, the PCI bus id → index map for the kernel-log Xid parser, and Xid events from NVML's
event set. :class:`PynvmlSource` implements it with ``pynvml`` only; the module is injected
(``PynvmlSource(lib=fake)``) so tests drive the real code with a fake that raises the real
``pynvml`` error classes.

Beside the SPEC fields, each GPU entry carries, where the GPU and driver answer, the
trainguard extensions ``mem_clock`` (MHz, ``nvmlDeviceGetClockInfo(MEM)``), ``power_limit`` (W,
``nvmlDeviceGetEnforcedPowerLimit``) and ``pcie_tx_kbs``/``pcie_rx_kbs`` (KB/s,
``nvmlDeviceGetPcieThroughput``), for the machine_outlier detector. The PCIe call measures
for 20 ms each time (40 ms per GPU, 320 ms for an 8-GPU machine), so the node agent reads it
on a thread of its own (:meth:`PynvmlSource.start_pcie_reader`) and :meth:`~PynvmlSource.sample`
attaches the latest values (no older than ``pcie_max_age_s``); without that thread,
``sample`` reads it inline.

Error policy, per field read: ``NVMLError_NotSupported`` (or ``Deprecated``,
``FunctionNotFound``, or a pynvml too old to have the function) → the field is omitted, not
asked again for that GPU, and said once at INFO; any other NVML error → omitted and logged
once; ``NVMLError_GpuIsLost`` →
the GPU's entry becomes ``{"index", "uuid", "lost": True}`` (the trainguard extension of the
``gpu`` event; the detectors treat a lost or missing GPU as a ``gpu_fault``), logged once per
loss. ``NVMLError_LibraryNotFound``/``DriverNotLoaded`` (and any other failure) at ``nvmlInit``
→ :class:`NvmlUnavailable` with a sentence saying why, which :func:`gpu_event_payload` turns
into the SPEC ``{"gpus": [], "status": "unavailable", "reason": ...}``.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any, Optional, Protocol

from .kmsg import normalize_bus_id

__all__ = ["NvmlUnavailable", "NvmlSource", "PynvmlSource", "gpu_event_payload",
           "THROTTLE_REASONS", "XID_DESCRIPTIONS"]

log = logging.getLogger(__name__)

# SPEC throttle names → suffix of pynvml's nvmlClocksEventReason*/nvmlClocksThrottleReason*.
# ``gpu_idle`` is set on any idle GPU and is not a fault.
THROTTLE_REASONS = (
    ("gpu_idle", "GpuIdle"), ("applications_clocks_setting", "ApplicationsClocksSetting"),
    ("sw_power_cap", "SwPowerCap"), ("hw_slowdown", "HwSlowdown"), ("sync_boost", "SyncBoost"),
    ("sw_thermal", "SwThermalSlowdown"), ("hw_thermal", "HwThermalSlowdown"),
    ("hw_power_brake", "HwPowerBrakeSlowdown"), ("display_clocks_setting", "DisplayClockSetting"),
    ("board_limit", "BoardLimit"), ("reliability", "Reliability"),
)
# Short descriptions for the message of NVML Xid events (NVIDIA's Xid catalog).
XID_DESCRIPTIONS = {
    13: "Graphics Engine Exception", 31: "GPU memory page fault", 43: "GPU stopped processing",
    45: "Preemptive cleanup, due to previous errors", 48: "Double Bit ECC Error",
    61: "Internal micro-controller breakpoint/warning", 62: "Internal micro-controller halt",
    63: "ECC page retirement or row remapping recording event",
    64: "ECC page retirement or row remapper recording failure", 74: "NVLink Error",
    79: "GPU has fallen off the bus", 92: "High single-bit ECC error rate",
    94: "Contained ECC error", 95: "Uncontained ECC error", 119: "GSP RPC timeout",
    120: "GSP error", 140: "Unrecovered ECC error",
}
_NVLINK_COUNTERS = ("NVML_NVLINK_ERROR_DL_REPLAY", "NVML_NVLINK_ERROR_DL_RECOVERY",
                    "NVML_NVLINK_ERROR_DL_CRC_FLIT", "NVML_NVLINK_ERROR_DL_CRC_DATA",
                    "NVML_NVLINK_ERROR_DL_ECC_DATA")
_MISSING = object()
_NVML_NAME = re.compile(r"\b(nvml[A-Z]\w*|NVML_[A-Z0-9_]+)\b")


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this machine; ``reason`` is one human sentence."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class NvmlSource(Protocol):
    """What the node agent needs from NVML."""

    def init(self) -> None: ...
    def device_count(self) -> int: ...
    def sample(self) -> list: ...
    def bus_id_map(self) -> dict: ...
    def wait_event(self, timeout_ms: int) -> Optional[dict]: ...
    def shutdown(self) -> None: ...


class _Lost(Exception):
    """Internal: the GPU answered NVML_ERROR_GPU_IS_LOST."""


def _init_reason(err: BaseException) -> str:
    kinds = {
        "NVMLError_LibraryNotFound": "the NVIDIA management library (libnvidia-ml.so.1) was "
                                     "not found, so no NVIDIA driver is installed here",
        "NVMLError_DriverNotLoaded": "the NVIDIA kernel driver is not loaded on this machine",
        "NVMLError_NoPermission": "this process may not open the NVIDIA devices",
        "NVMLError_LibRmVersionMismatch": "the NVML library and the loaded kernel driver have "
                                          "different versions (reload the driver or reboot)",
    }
    name = type(err).__name__
    return "NVML is unavailable: " + kinds.get(name, f"nvmlInit failed with {name} ({err})") + "."


class _Device:
    """Per-GPU state: handle, identity, and which reads are known to be unsupported."""

    def __init__(self, index: int, handle: Any, uuid: str, bus_id: Optional[str]):
        self.index, self.handle, self.uuid, self.bus_id = index, handle, uuid, bus_id
        self.status: dict = {}  # field -> "ok" | "not_supported" | "error: NVMLError_X"
        self.nvlinks: Optional[list] = None  # [(link, counter), ...] that answered
        self.lost = False
        self.pcie: Optional[tuple] = None  # (tx KB/s, rx KB/s, time.monotonic() of the read)


class PynvmlSource:
    """:class:`NvmlSource` over ``pynvml`` (or any module-like ``lib`` with its API).

    ``lib``: the pynvml module or a fake (default: ``import pynvml`` at :meth:`init`).
    ``nvlink_counters``: names of the ``NVML_NVLINK_ERROR_*`` counters summed into
    ``nvlink_errors`` (default: replay, recovery, CRC flit, CRC data, ECC data).
    ``pcie_max_age_s``: PCIe rates read by the reader thread longer ago are left out.
    Event types registered: Xid critical errors and double-bit ECC errors (reported as
    Xid 48, which is how the driver logs them). Single-bit ECC events are not registered:
    they have no Xid code and the ``ecc_sbe`` counter of the samples carries them.
    """

    def __init__(self, lib: Any = None, *, nvlink_counters: Optional[tuple] = None,
                 pcie_max_age_s: float = 30.0):
        self.lib = lib
        self.nvlink_counters = nvlink_counters or _NVLINK_COUNTERS
        self.pcie_max_age_s = pcie_max_age_s
        self._pcie_thread: Optional[threading.Thread] = None
        self._pcie_lock = threading.Lock()   # a PCIe pass, or nvmlShutdown
        self._devices: list = []
        self._initialized = False
        self._event_set: Any = None
        self._events_ready = False
        self._event_lock = threading.Lock()
        self._closed = threading.Event()
        self._logged: set = set()

    # -- lifecycle -------------------------------------------------------------------------
    def init(self) -> None:
        """Initialize NVML and enumerate GPUs; :class:`NvmlUnavailable` when it cannot."""
        if self._initialized:
            return
        if self.lib is None:
            try:
                import pynvml
            except ImportError as e:
                raise NvmlUnavailable("NVML is unavailable: the nvidia-ml-py package (module "
                                      "pynvml) is not installed.") from e
            self.lib = pynvml
        lib = self.lib
        try:
            lib.nvmlInit()
            count = lib.nvmlDeviceGetCount()
        except lib.NVMLError as e:
            raise NvmlUnavailable(_init_reason(e)) from e
        except OSError as e:
            raise NvmlUnavailable(f"NVML is unavailable: loading it failed ({e}).") from e
        self._devices = [d for d in (self._open_device(i) for i in range(count)) if d]
        self._initialized = True
        self._closed.clear()

    def _open_device(self, index: int) -> Optional[_Device]:
        lib = self.lib
        try:
            handle = lib.nvmlDeviceGetHandleByIndex(index)
        except lib.NVMLError_GpuIsLost:
            self._log_once(("lost", index), "GPU %d is lost (NVML_ERROR_GPU_IS_LOST)", index)
            dev = _Device(index, None, "unknown", None)
            dev.lost = True
            return dev
        except lib.NVMLError as e:  # e.g. NoPermission: a GPU outside this container
            self._log_once(("open", index), "GPU %d skipped: %s", index, type(e).__name__)
            return None
        uuid, bus_id = "unknown", None
        try:
            uuid = _text(lib.nvmlDeviceGetUUID(handle))
            pci = lib.nvmlDeviceGetPciInfo(handle)
            bus_id = normalize_bus_id(_text(getattr(pci, "busId", b"") or pci.busIdLegacy))
        except lib.NVMLError as e:
            self._log_once(("ident", index), "GPU %d identity: %s", index, type(e).__name__)
        return _Device(index, handle, uuid, bus_id)

    def shutdown(self) -> None:
        """Free the event set and shut NVML down; waits for a running :meth:`wait_event`."""
        self._closed.set()
        reader, self._pcie_thread = self._pcie_thread, None
        if reader is not None and reader is not threading.current_thread():
            reader.join(2.0)
        if not self._initialized:
            return
        with self._event_lock, self._pcie_lock:
            if self._event_set is not None:
                try:
                    self.lib.nvmlEventSetFree(self._event_set)
                except self.lib.NVMLError:
                    pass
            self._event_set, self._events_ready = None, False
            try:
                self.lib.nvmlShutdown()
            except self.lib.NVMLError:
                pass
            self._initialized = False

    # -- queries ---------------------------------------------------------------------------
    def device_count(self) -> int:
        """Number of GPUs this process can see (after :meth:`init`)."""
        self.init()
        return len(self._devices)

    def bus_id_map(self) -> dict:
        """``{normalized bus id: index}`` (see :func:`kmsg.normalize_bus_id`)."""
        self.init()
        return {d.bus_id: d.index for d in self._devices if d.bus_id}

    def device_info(self) -> list:
        """Identity of each GPU: ``index``, ``uuid``, ``bus_id``, ``lost``, and how many
        (link, counter) NVLink pairs answer (None before the first sample)."""
        return [{"index": d.index, "uuid": d.uuid, "bus_id": d.bus_id, "lost": d.lost,
                 "nvlink_pairs": None if d.nvlinks is None else len(d.nvlinks)}
                for d in self._devices]

    def field_status(self) -> dict:
        """``{index: {field: "ok" | "not_supported" | "error: ..."}}`` from the reads so far."""
        return {d.index: dict(d.status) for d in self._devices}

    def sample(self) -> list:
        """One SPEC ``gpus`` list; initializes NVML first if needed."""
        self.init()
        if self._pcie_thread is None:
            self.read_pcie()
        fresh_after = time.monotonic() - self.pcie_max_age_s
        out = []
        for dev in self._devices:
            try:
                entry = self._sample_device(dev)
                if dev.pcie is not None and dev.pcie[2] >= fresh_after:
                    entry["pcie_tx_kbs"], entry["pcie_rx_kbs"] = dev.pcie[0], dev.pcie[1]
                if dev.lost:
                    log.warning("GPU %d answers NVML again", dev.index)
                    dev.lost = False
            except _Lost:
                if not dev.lost:
                    log.error("GPU %d (%s) is lost: NVML_ERROR_GPU_IS_LOST", dev.index, dev.uuid)
                dev.lost = True
                entry = {"index": dev.index, "uuid": dev.uuid, "lost": True}
            out.append(entry)
        return out

    def _sample_device(self, dev: _Device) -> dict:
        lib, h = self.lib, dev.handle
        if h is None:
            raise _Lost()
        e: dict = {"index": dev.index, "uuid": dev.uuid}
        v = self._read(dev, "util", lambda: lib.nvmlDeviceGetUtilizationRates(h).gpu)
        if v is not _MISSING:
            e["util"] = v
        mem = self._read(dev, "memory", lambda: lib.nvmlDeviceGetMemoryInfo(h))
        if mem is not _MISSING:
            e["mem_used"], e["mem_total"] = int(mem.used), int(mem.total)
        reads = (
            ("temp", lambda: self._temperature(h)),
            ("power", lambda: round(lib.nvmlDeviceGetPowerUsage(h) / 1000.0, 3)),
            ("sm_clock", lambda: int(lib.nvmlDeviceGetClockInfo(h, lib.NVML_CLOCK_SM))),
            ("mem_clock", lambda: int(lib.nvmlDeviceGetClockInfo(h, lib.NVML_CLOCK_MEM))),
            ("power_limit", lambda: round(lib.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0, 3)),
            ("throttle", lambda: self._throttle(h)),
            ("ecc_sbe", lambda: int(lib.nvmlDeviceGetTotalEccErrors(
                h, lib.NVML_MEMORY_ERROR_TYPE_CORRECTED, lib.NVML_VOLATILE_ECC))),
            ("ecc_dbe", lambda: int(lib.nvmlDeviceGetTotalEccErrors(
                h, lib.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, lib.NVML_VOLATILE_ECC))),
            ("pcie_replay", lambda: int(lib.nvmlDeviceGetPcieReplayCounter(h))),
            ("nvlink_errors", lambda: self._nvlink_errors(dev)),
        )
        for field, fn in reads:
            v = self._read(dev, field, fn)
            if v is not _MISSING:
                e[field] = v
        rows = self._read(dev, "remapped_rows", lambda: lib.nvmlDeviceGetRemappedRows(h))
        if rows is not _MISSING:
            e["remapped_pending"], e["remapped_failure"] = bool(rows[2]), bool(rows[3])
        return e

    def _read(self, dev: _Device, field: str, fn) -> Any:
        lib = self.lib
        if dev.status.get(field) == "not_supported":
            return _MISSING
        try:
            value = fn()
        except lib.NVMLError_GpuIsLost:
            raise _Lost() from None
        except (lib.NVMLError_NotSupported, _deprecated(lib), lib.NVMLError_FunctionNotFound,
                AttributeError) as err:
            if isinstance(err, AttributeError) and not _missing_function(err):
                raise                                    # a bug, not an old pynvml
            dev.status[field] = "not_supported"
            why = ("this pynvml is too old for it" if isinstance(err, AttributeError)
                   else type(err).__name__)
            self._log_once(("not_supported", field), "GPU %d: %s is not supported (%s); it is "
                           "left out of the samples", dev.index, field, why,
                           level=logging.INFO)
            return _MISSING
        except lib.NVMLError as err:
            dev.status[field] = f"error: {type(err).__name__}"
            self._log_once((field, dev.index, type(err).__name__),
                           "GPU %d: reading %s failed with %s", dev.index, field,
                           type(err).__name__)
            return _MISSING
        dev.status[field] = "ok"
        return value

    def _temperature(self, handle: Any) -> int:
        lib = self.lib
        try:
            return lib.nvmlDeviceGetTemperature(handle, lib.NVML_TEMPERATURE_GPU)
        except (lib.NVMLError_FunctionNotFound, _deprecated(lib)):
            if not hasattr(lib, "nvmlDeviceGetTemperatureV"):  # newer drivers' replacement
                raise
            return lib.nvmlDeviceGetTemperatureV(handle, lib.NVML_TEMPERATURE_GPU)

    def _throttle(self, handle: Any) -> list:
        lib = self.lib
        getter = getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None)
        mask = None
        if getter is not None:
            try:
                mask = getter(handle)
            except lib.NVMLError_FunctionNotFound:  # driver older than the event-reason API
                mask = None
        if mask is None:
            mask = lib.nvmlDeviceGetCurrentClocksThrottleReasons(handle)
        names = []
        for name, suffix in THROTTLE_REASONS:
            bit = getattr(lib, "nvmlClocksEventReason" + suffix,
                          getattr(lib, "nvmlClocksThrottleReason" + suffix, 0))
            if bit and mask & bit:
                names.append(name)
        return names

    def _nvlink_errors(self, dev: _Device) -> int:
        lib, h = self.lib, dev.handle
        if dev.nvlinks is None:  # discover once which (link, counter) pairs answer
            counters = [getattr(lib, c) for c in self.nvlink_counters if hasattr(lib, c)]
            pairs = []
            for link in range(getattr(lib, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    lib.nvmlDeviceGetNvLinkState(h, link)
                except lib.NVMLError_GpuIsLost:
                    raise
                except lib.NVMLError:  # NotSupported / InvalidArgument: no such link
                    continue
                pairs += [(link, c) for c in counters]
            dev.nvlinks = pairs
        total, answered = 0, []
        for link, counter in dev.nvlinks:
            try:
                total += int(lib.nvmlDeviceGetNvLinkErrorCounter(h, link, counter))
                answered.append((link, counter))
            except lib.NVMLError_GpuIsLost:
                raise
            except lib.NVMLError_NotSupported:
                continue
        dev.nvlinks = answered
        if not answered:
            raise lib.NVMLError(lib.NVML_ERROR_NOT_SUPPORTED)
        return total

    # -- PCIe throughput -------------------------------------------------------------------
    def read_pcie(self) -> None:
        """Read every GPU's PCIe TX and RX throughput once (KB/s over NVML's 20 ms window,
        so 40 ms per GPU); :meth:`sample` attaches what was read. Never raises for a GPU."""
        lib = self.lib
        if lib is None:
            return
        tx_id, rx_id = (getattr(lib, "NVML_PCIE_UTIL_TX_BYTES", 0),
                        getattr(lib, "NVML_PCIE_UTIL_RX_BYTES", 1))
        with self._pcie_lock:
            for dev in self._devices:
                if self._closed.is_set() or not self._initialized:
                    return
                if dev.lost or dev.handle is None:
                    continue
                if "not_supported" in (dev.status.get("pcie_tx_kbs"),
                                       dev.status.get("pcie_rx_kbs")):
                    continue                      # one without the other is not sent
                h = dev.handle
                try:
                    tx = self._read(dev, "pcie_tx_kbs",
                                    lambda: int(lib.nvmlDeviceGetPcieThroughput(h, tx_id)))
                    rx = _MISSING if tx is _MISSING else self._read(
                        dev, "pcie_rx_kbs",
                        lambda: int(lib.nvmlDeviceGetPcieThroughput(h, rx_id)))
                except _Lost:                     # the sample path reports the loss
                    continue
                if rx is not _MISSING:
                    dev.pcie = (tx, rx, time.monotonic())

    def start_pcie_reader(self, interval_s: float = 5.0) -> bool:
        """Read PCIe throughput on a daemon thread every ``interval_s`` from now on, so that
        :meth:`sample` does not wait for it; stops at :meth:`shutdown`. False when NVML is
        not up or the thread already runs."""
        if not self._initialized or self._pcie_thread is not None:
            return False
        self.pcie_max_age_s = max(self.pcie_max_age_s, 3.0 * interval_s)

        def run() -> None:
            while not self._closed.is_set():
                try:
                    self.read_pcie()
                except Exception as exc:          # an odd driver: say so, keep sampling
                    self._log_once(("pcie", type(exc).__name__), "PCIe throughput read "
                                   "failed: %s", exc)
                self._closed.wait(interval_s)

        self._pcie_thread = threading.Thread(target=run, name="trainguard-nvml-pcie",
                                             daemon=True)
        self._pcie_thread.start()
        return True

    # -- events ----------------------------------------------------------------------------
    def _setup_events(self) -> None:
        lib = self.lib
        self._events_ready = True
        wanted = lib.nvmlEventTypeXidCriticalError | lib.nvmlEventTypeDoubleBitEccError
        try:
            event_set = lib.nvmlEventSetCreate()
        except lib.NVMLError as e:
            self._log_once("evset", "NVML event set unavailable: %s", type(e).__name__)
            return
        registered = 0
        for dev in self._devices:
            if dev.handle is None:
                continue
            try:
                types = wanted & lib.nvmlDeviceGetSupportedEventTypes(dev.handle)
                if types:
                    lib.nvmlDeviceRegisterEvents(dev.handle, types, event_set)
                    registered += 1
            except lib.NVMLError as e:
                self._log_once(("evreg", dev.index), "GPU %d: no NVML events (%s)",
                               dev.index, type(e).__name__)
        if registered:
            self._event_set = event_set
        else:
            lib.nvmlEventSetFree(event_set)

    def wait_event(self, timeout_ms: int) -> Optional[dict]:
        """Wait up to ``timeout_ms`` for an Xid or double-bit ECC event.

        Returns ``{"gpu", "xid", "source": "nvml", "message"}`` or None on timeout (also when
        no GPU supports events: then it just waits, so a loop around it never spins).
        After :meth:`shutdown` it raises :class:`NvmlUnavailable` rather than reopen NVML.
        """
        if self._closed.is_set() and not self._initialized:
            raise NvmlUnavailable("NVML is unavailable: the source was shut down.")
        self.init()
        with self._event_lock:
            if not self._events_ready and not self._closed.is_set():
                self._setup_events()
            if self._event_set is not None:
                return self._wait_locked(timeout_ms)
        self._closed.wait(timeout_ms / 1000.0)
        return None

    def _wait_locked(self, timeout_ms: int) -> Optional[dict]:
        lib = self.lib
        try:
            data = lib.nvmlEventSetWait(self._event_set, int(timeout_ms))
        except lib.NVMLError_Timeout:
            return None
        except lib.NVMLError as e:
            self._log_once(("wait", type(e).__name__), "nvmlEventSetWait failed: %s",
                           type(e).__name__)
            self._closed.wait(timeout_ms / 1000.0)
            return None
        try:
            gpu = int(lib.nvmlDeviceGetIndex(data.device))
        except (lib.NVMLError, TypeError, ValueError):
            gpu = None
        if data.eventType & lib.nvmlEventTypeXidCriticalError:
            xid = int(data.eventData)
            what = XID_DESCRIPTIONS.get(xid, "Xid critical error")
        else:
            xid, what = 48, XID_DESCRIPTIONS[48]
        return {"gpu": gpu, "xid": xid, "source": "nvml",
                "message": f"{what} (NVML event 0x{int(data.eventType):x}, data {int(data.eventData)})"}

    def _log_once(self, key: Any, msg: str, *args: Any, level: int = logging.WARNING) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.log(level, msg, *args)


def _deprecated(lib: Any) -> type:
    """NVML_ERROR_DEPRECATED's class (newer pynvml only), treated like NotSupported."""
    return getattr(lib, "NVMLError_Deprecated", lib.NVMLError_NotSupported)


def _missing_function(err: AttributeError) -> bool:
    """The AttributeError says the pynvml module lacks an ``nvml*`` function or ``NVML_*``
    constant (a pynvml older than the driver's API), not that some other object lacks one.

    >>> _missing_function(AttributeError("module 'pynvml' has no attribute 'nvmlDeviceGetX'"))
    True
    >>> _missing_function(AttributeError("'NoneType' object has no attribute 'gpu'"))
    False
    """
    return _NVML_NAME.search(str(getattr(err, "name", None) or err)) is not None


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def gpu_event_payload(source: NvmlSource) -> dict:
    """The SPEC ``gpu`` event payload: ``{"gpus": [...]}``, or ``{"gpus": [], "status":
    "unavailable", "reason": ...}`` when NVML cannot be used.

    >>> class Missing:
    ...     def sample(self): raise NvmlUnavailable("NVML is unavailable: no driver.")
    >>> gpu_event_payload(Missing())
    {'gpus': [], 'status': 'unavailable', 'reason': 'NVML is unavailable: no driver.'}
    """
    try:
        return {"gpus": source.sample()}
    except NvmlUnavailable as e:
        return {"gpus": [], "status": "unavailable", "reason": e.reason}
