"""The machine's CPU and network counters from /proc, for the ``gpu`` event's ``host`` object.

:class:`HostCounters` reads three files under ``root`` (``/`` by default; tests give a
folder of fixture files) each time :meth:`HostCounters.sample` is called, and returns the
contract's ``host`` object (trainguard/events.py ``HOST``; docs/CONTRACT.md):

- ``cpu_util``: the share of CPU time that was busy since the previous sample, in percent
  (0-100) over all CPUs, from the ``cpu`` line of ``/proc/stat``: busy is user, nice,
  system, irq, softirq and steal; idle and iowait are not (guest time is already in user).
  Absent from the first sample (there is no interval yet).
- ``net_rx_bytes``, ``net_tx_bytes``: bytes received and sent since boot, summed over every
  interface of ``/proc/net/dev`` but the loopback (``lo``).
- ``tcp_retrans``, ``tcp_out_segs``: TCP segments retransmitted and sent since boot
  (``RetransSegs``, ``OutSegs`` of the ``Tcp:`` lines of ``/proc/net/snmp``).

The counters are cumulative on purpose: the consumer
(:class:`~trainguard.detectors.machine_outlier.MachineVector`) turns two samples into bytes/s
and retransmits per segment sent over the interval between them, so a lost sample loses no
traffic. A file that cannot be read or parsed leaves its fields out (logged once per file
and kind of failure); :meth:`sample` never raises for one. ``/proc/stat`` is the machine's
from any container. ``/proc/net/*`` are a network namespace's counters: those of process 1's
(``/proc/1/net/``) are read where they can be, which is the machine's on bare metal, under
systemd and in a pod with ``hostPID: true`` (the shipped DaemonSet); else the agent's own
(``/proc/net/``), which in a container without the host's pid or network namespace is the
container's, not the machine's.

>>> import tempfile, pathlib
>>> root = pathlib.Path(tempfile.mkdtemp())
>>> (root / "proc" / "net").mkdir(parents=True)
>>> def write(user, idle, rx, retrans):
...     (root / "proc/stat").write_text(f"cpu  {user} 0 0 {idle} 0 0 0 0 0 0\\n")
...     (root / "proc/net/dev").write_text(
...         "Inter-|   Receive |  Transmit\\n face |bytes packets|bytes packets\\n"
...         f"    lo: 999 1 0 0 0 0 0 0 999 1 0 0 0 0 0 0\\n"
...         f"  eth0: {rx} 10 0 0 0 0 0 0 500 5 0 0 0 0 0 0\\n")
...     (root / "proc/net/snmp").write_text(
...         "Tcp: RtoAlgorithm OutSegs RetransSegs\\nTcp: 1 1000 " + str(retrans) + "\\n")
>>> host = HostCounters(root)
>>> write(100, 900, 2000, 3)
>>> host.sample()
{'net_rx_bytes': 2000, 'net_tx_bytes': 500, 'tcp_retrans': 3, 'tcp_out_segs': 1000}
>>> write(400, 1600, 9000, 5)
>>> host.sample()["cpu_util"]
30.0
"""
from __future__ import annotations

import logging
import os
from typing import Optional

__all__ = ["HostCounters", "read_cpu_times", "read_net_dev", "read_tcp"]

log = logging.getLogger(__name__)

#: /proc/stat ``cpu`` columns counted as busy: user nice system [idle iowait] irq softirq steal
_BUSY = (0, 1, 2, 5, 6, 7)
_IDLE = (3, 4)
_CHUNK = 16384


def _read(path: str, limit: int) -> bytes:
    """A file's first ``limit`` bytes (all of it, for the /proc files read here), unbuffered:
    a /proc file is generated as it is read, so only what is asked for is made."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.read(fd, min(limit, _CHUNK))
        if len(data) < _CHUNK or limit <= _CHUNK:
            return data
        parts = [data]
        size = len(data)
        while size < limit:
            more = os.read(fd, _CHUNK)
            if not more:
                break
            parts.append(more)
            size += len(more)
        return b"".join(parts)
    finally:
        os.close(fd)


def read_cpu_times(data: bytes) -> tuple[int, int]:
    """``(busy, total)`` jiffies of the aggregate ``cpu`` line of /proc/stat.

    >>> read_cpu_times(b"cpu  324345 0 49983 229300 1769 0 1450 482 0 0\\ncpu0 1 2 3 4\\n")
    (376260, 607329)
    """
    line = data.split(b"\n", 1)[0].split()
    if not line or line[0] != b"cpu" or len(line) < 5:
        raise ValueError("no aggregate cpu line")
    values = [int(v) for v in line[1:9]]
    values += [0] * (8 - len(values))
    busy = sum(values[i] for i in _BUSY)
    return busy, busy + sum(values[i] for i in _IDLE)


def read_net_dev(data: bytes) -> tuple[int, int]:
    """``(rx_bytes, tx_bytes)`` summed over the interfaces of /proc/net/dev but ``lo``.

    >>> read_net_dev(b"h1\\nh2\\n  lo: 9 1 0 0 0 0 0 0 9 1\\n eth0:7 2 0 0 0 0 0 0 5 3\\n")
    (7, 5)
    """
    rx = tx = 0
    for line in data.split(b"\n")[2:]:
        name, sep, rest = line.partition(b":")
        if not sep:
            continue
        if name.strip() == b"lo":
            continue
        fields = rest.split()
        rx += int(fields[0])
        tx += int(fields[8])
    return rx, tx


def read_tcp(data: bytes) -> tuple[int, int]:
    """``(RetransSegs, OutSegs)`` of the ``Tcp:`` header and value lines of /proc/net/snmp.

    >>> read_tcp(b"Ip: a\\nIp: 1\\nTcp: OutSegs RetransSegs InErrs\\nTcp: 1190007 981 0\\n")
    (981, 1190007)
    """
    lines = [line for line in data.split(b"\n") if line.startswith(b"Tcp:")]
    if len(lines) < 2:
        raise ValueError("no Tcp lines")
    row = dict(zip(lines[0].split()[1:], lines[1].split()[1:]))
    return int(row[b"RetransSegs"]), int(row[b"OutSegs"])


class HostCounters:
    """See the module docstring; ``root`` is the folder holding ``proc/``."""

    def __init__(self, root: "str | os.PathLike" = "/"):
        root = os.fspath(root)
        self.stat_path = os.path.join(root, "proc", "stat")
        init_net = os.path.join(root, "proc", "1", "net")
        own_net = os.path.join(root, "proc", "net")
        net = init_net if os.access(os.path.join(init_net, "dev"), os.R_OK) else own_net
        self.dev_path = os.path.join(net, "dev")
        self.snmp_path = os.path.join(net, "snmp")
        self._cpu: Optional[tuple] = None
        self._logged: set = set()

    def sample(self) -> Optional[dict]:
        """The ``host`` object now, or None when none of its files could be read."""
        out: dict = {}
        cpu = self._part(self.stat_path, 4096, read_cpu_times)   # its first line
        if cpu is not None:
            prev, self._cpu = self._cpu, cpu
            if prev is not None:
                busy, total = cpu[0] - prev[0], cpu[1] - prev[1]
                if total > 0 and 0 <= busy <= total:
                    out["cpu_util"] = round(100.0 * busy / total, 2)
        net = self._part(self.dev_path, 1 << 22, read_net_dev)
        if net is not None:
            out["net_rx_bytes"], out["net_tx_bytes"] = net
        tcp = self._part(self.snmp_path, 1 << 18, read_tcp)
        if tcp is not None:
            out["tcp_retrans"], out["tcp_out_segs"] = tcp
        return out or None

    def _part(self, path: str, size: int, parse):
        try:
            value = parse(_read(path, size))
        except OSError as exc:
            self._log_once((path, "read"), "host counters: cannot read %s (%s); its fields "
                           "are left out", path, exc.strerror or exc)
            return None
        except (ValueError, IndexError, KeyError) as exc:
            self._log_once((path, "parse"), "host counters: cannot parse %s (%s); its fields "
                           "are left out", path, exc)
            return None
        if any(v < 0 for v in value):
            return None
        return value

    def _log_once(self, key, msg: str, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args)
