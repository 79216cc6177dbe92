"""GPU and host counters of machines that degrade without a flag, for tests/scenarios.py.

A scenario with ``gpu_noise > 0`` gets counters that vary as real ones do (clocks, power
against its limit, temperature, PCIe traffic, host CPU and network), its ``gpu_bins``
(machine -> steady factor on SM clock and power: mixed GPU bins), and its machine faults
(:data:`KINDS`), from a random stream of their own (other scenarios are unchanged):

- ``power_cap``: the machine's power limit set to 450 W (of 700): power pinned under it,
  SM clocks 12% lower, throttle reason ``sw_power_cap`` only (no rule counts it);
- ``fan``: one GPU 18 °C hotter and 8% slower, below the thermal slowdown flag;
- ``mem_clock``: one GPU's memory clock dropped from 2619 to 1593 MHz;
- ``cpu``: host CPU contention, 35% -> 95% busy;
- ``nic``: the NIC retransmits 2% of its segments (1e-5 before), 20% less traffic.

A slowdown of the step time that follows is an ordinary ``straggler`` fault of the
machine's ranks at a later step.
"""
from __future__ import annotations

KINDS = ("power_cap", "fan", "mem_clock", "cpu", "nic")


class MachineCounters:
    def __init__(self, rng):
        self.rng = rng
        self.host: dict = {}          # node -> cumulative counters
        self.last: dict = {}          # node -> ts of its last sample

    def entry(self, sc, node, i, base: dict, active: set) -> dict:
        """GPU ``i`` of ``node``: ``base`` (the scenario's plain entry) with noise, bins and
        the machine faults in ``active`` (kinds; per-GPU ones hit GPU ``fault_gpu``)."""
        g, n = self.rng.gauss, sc.gpu_noise
        bin_ = sc.gpu_bins.get(node, 1.0)
        e = dict(base)
        e["util"] = min(100.0, round(base["util"] * (1 + n * g(0, 1) * 0.5), 1))
        e["sm_clock"] = int(base["sm_clock"] * bin_ * (1 + n * g(0, 1)))
        e["mem_clock"] = 2619
        e["power_limit"] = 700.0
        e["power"] = round(base["power"] * bin_ * (1 + 2 * n * g(0, 1)), 1)
        e["temp"] = round(base["temp"] + 1.5 * g(0, 1), 1)
        e["mem_used"], e["mem_total"] = 70 << 30, 80 << 30
        e["pcie_tx_kbs"] = round(4e6 * (1 + 5 * n * g(0, 1)), 0)
        e["pcie_rx_kbs"] = round(4e6 * (1 + 5 * n * g(0, 1)), 0)
        if "power_cap" in active:
            e["power_limit"] = 450.0
            e["power"] = round(min(e["power"], 440.0 + 5 * g(0, 1)), 1)
            e["sm_clock"] = int(e["sm_clock"] * 0.88)
            e["throttle"] = ["sw_power_cap"]
        if i == 0 and "fan" in active:
            e["temp"] = round(e["temp"] + 18.0, 1)
            e["sm_clock"] = int(e["sm_clock"] * 0.92)
        if i == 0 and "mem_clock" in active:
            e["mem_clock"] = 1593
        return e

    def host_of(self, sc, node, ts, active: set) -> dict:
        g = self.rng.gauss
        h = self.host.setdefault(node, {"net_rx_bytes": 0, "net_tx_bytes": 0,
                                        "tcp_retrans": 0, "tcp_out_segs": 0})
        dt = ts - self.last.get(node, ts - sc.gpu_s)
        self.last[node] = ts
        rate = 5e9 * (1 + 4 * sc.gpu_noise * g(0, 1)) * (0.8 if "nic" in active else 1.0)
        segs = int(rate / 9000 * dt)
        h["net_rx_bytes"] += int(rate * dt / 2)
        h["net_tx_bytes"] += int(rate * dt / 2)
        h["tcp_out_segs"] += segs
        h["tcp_retrans"] += int(segs * (0.02 if "nic" in active else 1e-5)
                                * (1 + 0.3 * abs(g(0, 1))))
        cpu = 95.0 if "cpu" in active else 35.0
        return {**h, "cpu_util": round(max(0.0, min(100.0, cpu + 3 * g(0, 1))), 1)}
