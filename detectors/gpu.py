"""GPU health from the node agents: faults (take the machine out) and degradation (watch it).

Inputs are ``ev.Xid`` and ``ev.Gpu`` events. The GPU of a rank is found from lifecycle
``start`` summaries (``local_rank`` = GPU index, as torchrun sets ``CUDA_VISIBLE_DEVICES``
defaults) or, failing that, from the order of the ranks seen on a machine. In the engine the
detectors run per machine in a ``NodeStage``, which sees no rank summaries: there the
``JobStage`` names the rank, with the same :class:`Placement`.

>>> from trainguard import events as ev
>>> d = GpuFaultDetector()
>>> x = ev.Xid(job="j", ts=10.0, node="n1", gpu=3, xid=79, source="kmsg",
...            message="GPU has fallen off the bus.")
>>> [(f.kind, f.nodes, f.severity) for f in d.update(x)]
[('gpu_fault', ['n1'], 'critical')]
>>> d.update(x.replace(ts=11.0, xid=13, message="Graphics Engine Exception"))
[]
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import islice

from trainguard.setting import setting

from .base import Detector, Finding
from .registry import register_detector

__all__ = ["XID_TABLE", "FAULT_XIDS", "APPLICATION_XIDS", "NOTICE_XIDS", "xid_info", "is_fault_xid",
           "Placement", "GpuFaultDetector", "GpuDegradedDetector"]

#: Xid -> (name, category, severity), after NVIDIA's Xid catalog ("Analyzing Xid Errors with
#: the Xid Catalog": its immediate-action bucket for A100 and H100). Category ``hardware``
#: means the GPU or its links failed and it must be reset or its machine restarted before it
#: runs work again (RESET_GPU, RESTART_BM, the Xid 48 and NVLink workflows): the machine is
#: taken out; ``application`` means the user's program faulted (bad address, illegal
#: instruction, a killed channel): the GPU is fine and the job's own code is to blame;
#: ``driver`` entries are follow-ons or driver-side events, not faults on their own;
#: ``notice`` (IGNORE) and ``contained`` (RESTART_APP: an ECC error contained to the process
#: that hit it, which must restart; other processes are unaffected) leave the GPU in service,
#: to be reset when convenient: :class:`GpuDegradedDetector` alerts, nobody is evicted.
XID_TABLE = {
    13: ("Graphics Engine Exception", "application", None),
    31: ("GPU memory page fault (MMU fault)", "application", None),
    43: ("GPU stopped processing (channel reset after an application fault)", "application", None),
    45: ("Preemptive cleanup, due to previous errors", "driver", None),
    48: ("Double Bit ECC Error (DBE)", "hardware", "critical"),
    61: ("Internal micro-controller breakpoint/warning", "driver", None),
    62: ("Internal micro-controller halt", "driver", None),
    63: ("ECC page retirement or row remapping recording event", "notice", None),
    64: ("ECC page retirement or row remapper recording failure", "hardware", "critical"),
    68: ("NVDEC0 Exception", "application", None),
    69: ("Graphics Engine class error", "application", None),
    74: ("NVLink Error", "hardware", "critical"),
    79: ("GPU has fallen off the bus", "hardware", "critical"),
    92: ("High single-bit ECC error rate", "notice", None),
    94: ("Contained ECC error", "contained", None),
    95: ("Uncontained ECC error", "hardware", "critical"),
    119: ("GSP RPC timeout", "hardware", "critical"),
    120: ("GSP error", "hardware", "critical"),
}
FAULT_XIDS = frozenset(x for x, (_, cat, _) in XID_TABLE.items() if cat == "hardware")
APPLICATION_XIDS = frozenset(x for x, (_, cat, _) in XID_TABLE.items() if cat == "application")
#: Xids that leave the GPU in service and are worth a person's look (alert only)
NOTICE_XIDS = frozenset(x for x, (_, cat, _) in XID_TABLE.items()
                        if cat in ("notice", "contained"))


def xid_info(xid: int) -> tuple:
    """``(name, category, severity)``; unknown Xids are ``("Xid N", "unknown", None)``.

    >>> xid_info(79)
    ('GPU has fallen off the bus', 'hardware', 'critical')
    >>> sorted(FAULT_XIDS), sorted(NOTICE_XIDS)
    ([48, 64, 74, 79, 95, 119, 120], [63, 92, 94])
    >>> is_fault_xid(43), is_fault_xid(95)
    (False, True)
    """
    return XID_TABLE.get(xid, (f"Xid {xid}", "unknown", None))


def is_fault_xid(xid: int) -> bool:
    return xid in FAULT_XIDS


#: Xid repeats remembered per detector, at most: the GPU index of an ``xid`` event is any
#: number its sender says, and a flood of made-up ones must not grow the state without end
#: (the oldest is forgotten first; a GPU forgotten early is reported again sooner)
XID_KEYS_KEPT = 1024


def _remember(last: dict, key, ts: float) -> None:
    if key not in last and len(last) >= XID_KEYS_KEPT:
        del last[next(iter(last))]
    last[key] = ts


#: an Xid told by both of a machine's sources (NVML, the kernel log), one of them without the
#: GPU's index (no PCI bus id map), is one Xid when the two come this close
SAME_XID_S = 10.0


def _twice_told(unpaired: dict, x) -> bool:
    """Whether Xid ``x`` is one the machine's other source told already, where one of the
    two has no GPU index: a finding of the same code on the same machine, from a telling of
    the other kind (with an index if ``x`` has none, and the other way round), within
    :data:`SAME_XID_S` and not paired yet. Each finding pairs with one telling, so a second
    GPU's Xid, or a repeat of one GPU's, hides no other."""
    other = (x.node, x.xid, x.gpu is None)
    seen = unpaired.get(other)
    if seen is not None and abs(x.ts - seen) < SAME_XID_S:
        del unpaired[other]
        return True
    return False


def _to_pair(unpaired: dict, x) -> None:
    """A finding of Xid ``x``, which the other source's telling may pair with."""
    _remember(unpaired, (x.node, x.xid, x.gpu is not None), x.ts)


def _told(x, name: str) -> tuple[str, dict]:
    """An Xid event's summary and evidence, as both GPU detectors report it."""
    gpu = f"GPU {x.gpu}" if x.gpu is not None else "a GPU"
    return (f"Xid {x.xid} ({name}) on {gpu} of {x.node or 'an unknown machine'}",
            {"xid": x.xid, "xid_name": name, "source": x.source, "message": x.message[:300]})


class Placement:
    """Which rank runs on which GPU of which machine, learned from summaries.

    >>> p = Placement()
    >>> for r in (9, 8):
    ...     p.learn({"k": "step", "rank": r, "node": "n2"})
    >>> p.rank_of("n2", 1), p.rank_of("n2", 5)
    (9, None)
    >>> p.learn({"k": "life", "event": "start", "rank": 8, "node": "n2", "local_rank": 1})
    >>> p.rank_of("n2", 1)
    8
    """

    def __init__(self):
        self.node_of: dict = {}      # rank -> node
        self.local: dict = {}        # (node, local_rank) -> rank, from lifecycle start

    def learn(self, item) -> None:
        k = item.get("k")
        if k == "jobstep":
            ranks = item["ranks"]
            if item["step"] % 16 and ranks.keys() <= self.node_of.keys():
                return          # known ranks: look for moves only every 16th step
            for rank, rec in ranks.items():
                node = rec.get("node")
                if node and self.node_of.get(rank) != node:
                    self.node_of[rank] = node
            return
        rank, node = item.get("rank"), item.get("node")
        if rank is None or not node:
            return
        self.node_of[rank] = node
        if k == "life" and item.get("event") == "start" and item.get("local_rank") is not None:
            self.local[(node, item["local_rank"])] = rank

    def rank_of(self, node, gpu):
        if gpu is None or node is None:
            return None
        rank = self.local.get((node, gpu))
        if rank is not None:
            return rank
        if any(n == node for n, _ in self.local):
            return None
        ranks = sorted(r for r, n in self.node_of.items() if n == node)
        return ranks[gpu] if gpu < len(ranks) else None


class _GpuDetector(Detector):
    def _start(self) -> None:
        self._placement = Placement()

    def _learn(self, item) -> bool:
        """Learn placement from a summary; True when the item was a summary."""
        if type(item) is dict:
            if item.get("k") in ("jobstep", "life"):
                self._placement.learn(item)
            return True
        return False

    def _finding(self, kind, severity, node, gpu, ts, summary, evidence, key, onset=None):
        rank = self._placement.rank_of(node, gpu)
        ranks = [rank] if rank is not None else []
        evidence = {"gpu": gpu, **evidence,
                    "rank_nodes": {str(rank): node} if rank is not None else {}}
        return Finding(kind=kind, severity=severity, ranks=ranks, nodes=[node] if node else [],
                       step=None, onset_ts=ts if onset is None else onset, detected_ts=ts,
                       detector=self.PREFIX, summary=summary, evidence=evidence, key=key)


@register_detector(kinds="gpu_fault", ladder=("evict", "restart", "alert"), priority=10,
                   stage="node", causes={
                       "hang": "any", "throughput_drop": "any", "silent": "shared",
                       "crash": "shared", "nan": "shared", "straggler": "shared",
                       "gpu_degraded": "shared", "gpu_fault": "shared", "loss_spike": "any",
                       "grad_spike": "any", "machine_outlier": "shared"})
class GpuFaultDetector(_GpuDetector):
    """Hardware faults: a hardware Xid of :data:`XID_TABLE`, a rise in ``ecc_dbe``,
    ``remapped_failure``, a GPU entry with ``lost``, or a GPU missing from its machine's
    samples for ``missing_samples`` samples in a row. The same Xid on the same GPU within
    ``repeat_s`` is one finding; the other conditions are reported once until they clear.
    """

    PREFIX = "gpu_fault"
    CONSUMES = ("gpu", "xid")

    @dataclass(kw_only=True)
    class Config:
        missing_samples: int = setting(2, 'samples a GPU must be absent to be "missing"',
                                       minimum=1)
        repeat_s: float = setting(300.0, "the same Xid on the same GPU within this is one")

    def _start(self) -> None:
        super()._start()
        self._xid_last: dict = {}       # (node, gpu, xid) -> ts
        self._unpaired: dict = {}       # (node, xid, with index) -> ts of a finding (_to_pair)
        self._dbe: dict = {}            # (node, index) -> count
        self._flags: set = set()        # (node, index, what) currently reported
        self._known: dict = {}          # node -> set of indices
        self._missing: dict = {}        # (node, index) -> consecutive samples absent

    def update(self, item) -> list[Finding]:
        if self._learn(item):
            return []
        kind = getattr(item, "TYPE", "")
        if kind == "xid":
            return self._xid(item)
        if kind == "gpu":
            return self._sample(item)
        return []

    def _xid(self, x) -> list[Finding]:
        name, category, severity = xid_info(x.xid)
        if category != "hardware":
            return []
        key = (x.node, x.gpu, x.xid)
        last = self._xid_last.get(key)
        _remember(self._xid_last, key, x.ts)
        if _twice_told(self._unpaired, x) or last is not None and 0 <= x.ts - last < self.repeat_s:
            return []
        _to_pair(self._unpaired, x)
        summary, evidence = _told(x, name)
        return [self._finding("gpu_fault", severity, x.node, x.gpu, x.ts, summary, evidence,
                              key=f"xid{x.xid}:{x.gpu}:{x.ts:.3f}")]

    def _flag(self, node, index, what, on, ts, summary, evidence) -> list[Finding]:
        """Report condition ``what`` of a GPU once until it clears. ``summary`` is a template
        of ``index`` and ``node``, formatted only when a finding is made (this runs for every
        GPU of every sample)."""
        key = (node, index, what)
        if not on:
            self._flags.discard(key)
            return []
        if key in self._flags:
            return []
        self._flags.add(key)
        summary = summary.format(index=index, node=node)
        return [self._finding("gpu_fault", "critical", node, index, ts, summary, evidence,
                              key=f"{what}:{index}:{ts:.3f}")]

    def _sample(self, g) -> list[Finding]:
        node = g.node
        if node is None or g.status == "unavailable":
            return []
        out = []
        present = set()
        ts = g.ts
        for gpu in g.gpus:
            index = gpu.get("index")
            if index is None:
                continue
            present.add(index)
            lost, failed = gpu.get("lost") is True, gpu.get("remapped_failure") is True
            if lost or self._flags:
                out += self._flag(node, index, "lost", lost, ts,
                                  "GPU {index} of {node} is lost (the driver cannot reach it)",
                                  {"lost": True})
            dbe = gpu.get("ecc_dbe")
            if dbe is not None:
                prev = self._dbe.get((node, index))
                if prev != dbe:
                    self._dbe[(node, index)] = dbe
                if prev is not None and dbe > prev:
                    out.append(self._finding(
                        "gpu_fault", "critical", node, index, ts,
                        f"uncorrectable ECC errors on GPU {index} of {node}: ecc_dbe rose "
                        f"{prev} -> {dbe}", {"ecc_dbe": dbe, "previous": prev},
                        key=f"dbe{dbe}:{index}"))
            if failed or self._flags:
                out += self._flag(node, index, "remap", failed, ts,
                                  "row remapping failed on GPU {index} of {node}",
                                  {"remapped_failure": True})
        known = self._known.get(node)
        if known is None:
            known = self._known[node] = set()
        if present and present != known:
            for index in known - present:
                n = self._missing.get((node, index), 0) + 1
                self._missing[(node, index)] = n
                if n >= self.missing_samples:
                    out += self._flag(node, index, "missing", True, ts,
                                      "GPU {index} is missing from {node}'s samples",
                                      {"missing_samples": n, "present": sorted(present)})
        if present and self._missing:
            for index in present:
                if self._missing.pop((node, index), None):
                    self._flag(node, index, "missing", False, ts, "", {})
        known |= present
        return out


_COUNTERS = ("pcie_replay", "nvlink_errors", "ecc_sbe")
_STRIDE = 6               # items of one sample in _Window.rows


class _Window:
    """One GPU's samples of the last window, with running counts (no rescans per sample).

    ``rows`` is flat, :data:`_STRIDE` items a sample: its time, whether the hardware
    throttled it, the three counters' values (None where not read), and which of them rose
    (bit ``col``). Numbers, bools and None only: the garbage collector tracks none of them.
    The samples of every GPU of a large job are most of the rank side's objects (6 M at
    100,000 GPUs and a 60 s window); as a tuple each, holding a constant tuple that
    ``gc.freeze()`` keeps tracked, they were walked by every collection of the worker until
    they left the window, and they took twice the memory."""

    def __init__(self):
        self.rows = deque()
        self.throttled = 0
        self.ups = [0, 0, 0]
        self.last = [None, None, None]
        self.run = 0                 # throttled samples in a row, and the first one's time
        self.run_ts = 0.0

    def add(self, ts, hw, values, horizon):
        last = self.last
        if values[0] == last[0] and values[1] == last[1] and values[2] == last[2]:
            rose = 0                             # the common case: no counter moved
        else:
            rose = self._rises(values)
        rows = self.rows
        rows.extend((ts, hw, values[0], values[1], values[2], rose))
        self.throttled += hw
        if hw:
            if not self.run:
                self.run_ts = ts
            self.run += 1
        else:
            self.run = 0
        pop = rows.popleft
        while rows[0] < horizon:
            pop()
            self.throttled -= pop()
            pop(), pop(), pop()
            old = pop()
            if old:
                for col in range(3):
                    if old >> col & 1:
                        self.ups[col] -= 1

    def __len__(self) -> int:
        return len(self.rows) // _STRIDE

    def column(self, col: int):
        """One column of the rows, oldest first: 0 the times, 1 throttled, 2-4 the counters,
        5 rose."""
        return islice(self.rows, col, None, _STRIDE)

    def _rises(self, values) -> int:
        rose = 0
        for col, value in enumerate(values):
            prev = self.last[col]
            if value is not None:
                self.last[col] = value
                if prev is not None and value > prev:
                    self.ups[col] += 1
                    rose |= 1 << col
        return rose


@register_detector(kinds="gpu_degraded", ladder=("alert",), priority=50, stage="node",
                   causes={"gpu_degraded": "shared", "straggler": "shared",
                           "throughput_drop": "any", "machine_outlier": "shared"})
class GpuDegradedDetector(_GpuDetector):
    """Sustained trouble short of a fault, per GPU over the last ``window_s`` seconds:

    - hardware throttling (a reason starting with ``hw_``, or ``sw_thermal``) in at least
      ``throttle_fraction`` of at least ``min_samples`` samples spanning half the window, or
      in ``min_samples`` samples in a row spanning a quarter of it;
    - PCIe replays rising by ``pcie_replays`` or more;
    - NVLink errors rising in ``nvlink_increments`` or more samples;
    - single-bit ECC errors rising by ``sbe_increase`` or more, in ``sbe_increments`` samples;
    - an Xid that leaves the GPU in service (:data:`NOTICE_XIDS`: a row remap recorded, a high
      single-bit error rate, an ECC error contained to the process that hit it): the same Xid
      of the same GPU once per ``xid_repeat_s``.

    Each condition of a GPU is reported once until it clears.

    >>> from trainguard import events as ev
    >>> d = GpuDegradedDetector(window_s=20.0, min_samples=5)
    >>> found = []
    >>> for t in range(30):
    ...     g = {"index": 0, "uuid": "GPU-0", "throttle": ["hw_thermal"] if t >= 5 else []}
    ...     found += d.update(ev.Gpu(job="j", ts=float(t), node="n1", gpus=[g]))
    >>> [(f.kind, f.evidence["condition"], f.onset_ts, f.detected_ts) for f in found]
    [('gpu_degraded', 'throttle', 5.0, 10.0)]
    >>> x = ev.Xid(job="j", ts=40.0, node="n1", gpu=2, xid=94, source="kmsg", message="m")
    >>> [(f.kind, f.severity, f.evidence["condition"]) for f in d.update(x)]
    [('gpu_degraded', 'warning', 'xid94')]
    >>> d.update(x.replace(ts=50.0)), d.update(x.replace(xid=79))
    ([], [])
    """

    PREFIX = "gpu_degraded"
    CONSUMES = ("gpu", "xid")

    @dataclass(kw_only=True)
    class Config:
        window_s: float = setting(60.0, "seconds of samples each condition is judged over")
        throttle_fraction: float = setting(0.8, "hardware throttling in this fraction of the "
                                                "samples ...", above=0, maximum=1)
        min_samples: int = setting(10, "... of at least this many samples")
        pcie_replays: int = setting(50, "PCIe replays per window")
        nvlink_increments: int = setting(3, "samples in the window in which NVLink errors "
                                            "rose")
        sbe_increase: int = setting(10, "single-bit ECC errors per window ...")
        sbe_increments: int = setting(2, "... rising in at least this many samples")
        xid_repeat_s: float = setting(3600.0, "the same Xid that leaves a GPU in service, on "
                                              "the same GPU, within this is one alert")

    def _start(self) -> None:
        super()._start()
        self._windows: dict = {}  # (node, index) -> _Window
        self._active: set = set()
        self._xid_last: dict = {}  # (node, gpu, xid) -> ts of its last alert
        self._unpaired: dict = {}  # (node, xid, with index) -> ts of an alert (_to_pair)

    def update(self, item) -> list[Finding]:
        if self._learn(item):
            return []
        kind = getattr(item, "TYPE", "")
        if kind == "xid":
            return self._xid(item)
        if kind != "gpu":
            return []
        if item.node is None or item.status == "unavailable":
            return []
        out = []
        ts, node, windows = item.ts, item.node, self._windows
        horizon = ts - self.window_s
        healthy_skip = self.throttle_fraction > 0      # as _judge's first test
        for gpu in item.gpus:
            index = gpu.get("index")
            if index is None or gpu.get("lost"):
                continue
            window = windows.get((node, index))
            if window is None:
                window = windows[(node, index)] = _Window()
            reasons = gpu.get("throttle")
            hw = bool(reasons) and any(r.startswith("hw_") or r == "sw_thermal" for r in reasons)
            window.add(ts, hw, (gpu.get("pcie_replay"), gpu.get("nvlink_errors"),
                                gpu.get("ecc_sbe")), horizon)
            ups = window.ups
            if (not window.throttled and healthy_skip and not self._active
                    and not (ups[0] or ups[1] or ups[2])):
                continue                           # a healthy GPU: nothing to judge
            out += self._judge(node, index, window, ts, reasons)
        return out

    def _xid(self, x) -> list[Finding]:
        if x.xid not in NOTICE_XIDS:
            return []
        key = (x.node, x.gpu, x.xid)
        last = self._xid_last.get(key)
        if _twice_told(self._unpaired, x):
            _remember(self._xid_last, key, x.ts)    # told: its repeats are repeats
            return []
        if last is not None and 0 <= x.ts - last < self.xid_repeat_s:
            return []
        _remember(self._xid_last, key, x.ts)
        _to_pair(self._unpaired, x)
        name, category, _ = xid_info(x.xid)
        summary, evidence = _told(x, name)
        todo = ("the process that hit it must restart; reset the GPU when convenient"
                if category == "contained" else "the GPU stays in service; watch it")
        return [self._degraded(x.node, x.gpu, f"xid{x.xid}", x.ts, x.ts,
                               f"{summary}: {todo}", evidence)]

    def _judge(self, node, index, window, ts, reasons) -> list[Finding]:
        ups = window.ups
        rising = ups[0] or ups[1] or ups[2]
        if (not window.throttled and self.throttle_fraction > 0 and not self._active
                and not rising):
            return []                              # a healthy GPU: nothing to judge
        out = []
        n = len(window)
        span = ts - window.rows[0]
        throttled = window.throttled
        on = (n >= self.min_samples and span >= self.window_s / 2
              and throttled >= self.throttle_fraction * n) or (
            window.run >= self.min_samples and ts - window.run_ts >= self.window_s / 4)
        active = self._active      # what can clear: nothing while it is empty (the common case)
        if (on or active) and self._newly_on(node, index, "throttle", on):
            onset = next((t for t, hw in zip(window.column(0), window.column(1)) if hw), ts)
            out.append(self._degraded(node, index, "throttle", ts, onset,
                                      f"GPU {index} of {node} throttled by hardware in "
                                      f"{throttled} of {n} samples "
                                      f"({', '.join(reasons or ()) or 'now clear'})",
                                      {"throttled_samples": throttled, "samples": n}))
        if not rising:                             # the common case: no counter rose
            if self._active:
                for name in _COUNTERS:
                    self._active.discard((node, index, name))
            return out
        least = (1, self.nvlink_increments, self.sbe_increments)
        for col, name in enumerate(_COUNTERS):
            incs = ups[col]
            if incs < least[col]:
                if active:
                    active.discard((node, index, name))
                continue
            rise = window.last[col] - next(v for v in window.column(2 + col) if v is not None)
            if col == 0:
                on = rise >= self.pcie_replays
            elif col == 1:
                on = incs >= self.nvlink_increments
            else:
                on = rise >= self.sbe_increase and incs >= self.sbe_increments
            on = on and rise > 0
            if not ((on or active) and self._newly_on(node, index, name, on)):
                continue
            onset = next(t for t, rose in zip(window.column(0), window.column(5))
                         if rose >> col & 1)
            out.append(self._degraded(node, index, name, ts, onset,
                                      f"{name} on GPU {index} of {node} rose by {rise} in "
                                      f"{span:.0f}s ({incs} increases)",
                                      {"rise": rise, "increases": incs, "span_s": span}))
        return out

    def _newly_on(self, node, index, what, on) -> bool:
        """Whether condition ``what`` of a GPU is to be reported now: it is on and was not
        (each is reported once until it clears). The finding is built only then: this runs
        for every GPU of every sample."""
        key = (node, index, what)
        if not on:
            self._active.discard(key)
            return False
        if key in self._active:
            return False
        self._active.add(key)
        return True

    def _degraded(self, node, index, what, ts, onset, summary, evidence) -> Finding:
        return self._finding("gpu_degraded", "warning", node, index, ts, summary,
                             {"condition": what, **evidence},
                             key=f"{what}:{index}:{onset:.3f}", onset=onset)
