#!/usr/bin/env python3
"""GPU check: run the node agent's NVML path against the real GPUs of this machine.

    python scripts/gpu_check.py OUT.json [--seconds 45] [--interval 1] [--no-kmsg]

For about ``--seconds`` it samples every GPU once per ``--interval`` through
:class:`PynvmlSource` (every field of the SPEC ``gpu`` event), while a thread waits on NVML's
event set (Xid critical errors, double-bit ECC) and, where the kernel log is readable, a
:class:`KmsgFollower` watches it. It also replays the kernel log once to record any Xid lines
already there. It writes OUT.json (what was recorded, which fields each GPU supports, timings)
and OUT.events.jsonl (the SPEC ``gpu``/``xid`` envelopes, usable as a recording fixture).

Needs only nvidia-ml-py: without an installed ``trainguard`` it loads ``collectors/nvml.py``
and ``collectors/kmsg.py`` by path, without running the package's ``__init__``. Where NVML
is missing it records the SPEC ``unavailable`` event and says why; the exit status is 0
either way (3 with ``--require-gpu``).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import socket
import sys
import threading
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_collectors():
    """(nvml, kmsg) modules: the installed package, else the repository's files by path."""
    try:
        from trainguard.collectors import kmsg, nvml
        return nvml, kmsg
    except Exception:
        pass
    name = "_tg_gpu_check_collectors"
    pkg = types.ModuleType(name)
    pkg.__path__ = [str(ROOT / "collectors")]
    sys.modules[name] = pkg  # a bare package: collectors/__init__.py is not run
    return importlib.import_module(f"{name}.nvml"), importlib.import_module(f"{name}.kmsg")


def envelope(kind: str, job: str, payload: dict) -> dict:
    return {"v": 1, "type": kind, "job": job, "ts": time.time(), "node": socket.gethostname(),
            "rank": None, **payload}


def _versions(lib) -> dict:
    out = {"python": platform.python_version()}
    try:
        from importlib.metadata import version
        out["nvidia-ml-py"] = version("nvidia-ml-py")
    except Exception:
        pass
    for key, fn in (("driver", "nvmlSystemGetDriverVersion"), ("nvml", "nvmlSystemGetNVMLVersion"),
                    ("cuda_driver", "nvmlSystemGetCudaDriverVersion")):
        try:
            value = getattr(lib, fn)()
            out[key] = value.decode() if isinstance(value, bytes) else value
        except Exception as e:
            out[key] = f"error: {type(e).__name__}"
    return out


def _support_summary(status: dict) -> dict:
    """field -> {"ok": n, "not_supported": n, "error: X": n} over all GPUs."""
    summary: dict = {}
    for fields in status.values():
        for field, state in fields.items():
            summary.setdefault(field, {}).setdefault(state, 0)
            summary[field][state] += 1
    return summary


def _event_types(src, lib) -> dict:
    out = {}
    for info in src.device_info():
        try:
            handle = lib.nvmlDeviceGetHandleByIndex(info["index"])
            out[info["index"]] = int(lib.nvmlDeviceGetSupportedEventTypes(handle))
        except Exception as e:
            out[info["index"]] = f"error: {type(e).__name__}"
    return out


def _replay_kernel_log(kmsg, bus_map: dict, seconds: float = 1.5) -> dict:
    found: list = []
    f = kmsg.KmsgFollower(found.append, bus_id_map=bus_map, replay=True).start()
    time.sleep(seconds)
    f.stop()
    return {"source": f.kernel_source, "reason": f.reason, "xid_lines": len(found),
            "records": [dataclasses.asdict(r) for r in found[-200:]]}


def run(args, lib=None) -> dict:
    nvml, kmsg = load_collectors()
    job, events, report = args.job, [], {"started": time.time(), "host": socket.gethostname()}
    src = nvml.PynvmlSource(lib=lib)
    try:
        src.init()
    except nvml.NvmlUnavailable as e:
        events.append(envelope("gpu", job, nvml.gpu_event_payload(src)))
        report.update(status="unavailable", reason=e.reason, events=events)
        return report
    lib = src.lib
    report.update(status="ok", versions=_versions(lib), device_count=src.device_count(),
                  bus_id_map=src.bus_id_map(), supported_event_types=_event_types(src, lib))
    names = {}
    for info in src.device_info():
        try:
            value = lib.nvmlDeviceGetName(lib.nvmlDeviceGetHandleByIndex(info["index"]))
            names[info["index"]] = value.decode() if isinstance(value, bytes) else value
        except Exception as e:
            names[info["index"]] = f"error: {type(e).__name__}"
    report["names"] = names

    stop, lock = threading.Event(), threading.Lock()
    waits = {"calls": 0, "timeouts": 0, "max_overrun_ms": 0.0, "events": 0}

    def on_xid(payload: dict) -> None:
        with lock:
            events.append(envelope("xid", job, payload))

    def event_loop() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                ev = src.wait_event(args.event_wait_ms)
            except nvml.NvmlUnavailable:  # shut down
                return
            elapsed_ms = (time.monotonic() - t0) * 1000
            waits["calls"] += 1
            if ev is None:
                waits["timeouts"] += 1
                waits["max_overrun_ms"] = max(waits["max_overrun_ms"],
                                              round(elapsed_ms - args.event_wait_ms, 1))
            else:
                waits["events"] += 1
                on_xid(ev)

    follower = None
    if not args.no_kmsg:
        report["kernel_log_replay"] = _replay_kernel_log(kmsg, src.bus_id_map())
        follower = kmsg.KmsgFollower(lambda r: on_xid(r.to_payload()),
                                     bus_id_map=src.bus_id_map()).start()
        report["kernel_log"] = {"source": follower.kernel_source, "reason": follower.reason}
    waiter = threading.Thread(target=event_loop, name="gpu-check-events", daemon=True)
    waiter.start()
    sample_ms, deadline = [], time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        payload = nvml.gpu_event_payload(src)
        sample_ms.append(round((time.monotonic() - t0) * 1000, 2))
        with lock:
            events.append(envelope("gpu", job, payload))
        stop.wait(max(0.0, args.interval - (time.monotonic() - t0)))
    stop.set()
    if follower is not None:
        follower.stop()
    src.shutdown()  # waits for the event thread's current wait to end
    waiter.join(args.event_wait_ms / 1000 + 5)
    report.update(
        devices=src.device_info(), field_status=src.field_status(),
        support=_support_summary(src.field_status()), event_wait=waits,
        sample_ms={"n": len(sample_ms), "min": min(sample_ms, default=None),
                   "max": max(sample_ms, default=None),
                   "mean": round(sum(sample_ms) / len(sample_ms), 2) if sample_ms else None},
        events=events)
    return report


def main(argv=None, lib=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="where to write the JSON report")
    ap.add_argument("--seconds", type=float, default=45.0, help="how long to sample")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    ap.add_argument("--event-wait-ms", type=int, default=1000, help="nvmlEventSetWait timeout")
    ap.add_argument("--job", default="gpu-check", help="job id in the envelopes")
    ap.add_argument("--no-kmsg", action="store_true", help="leave the kernel log alone")
    ap.add_argument("--require-gpu", action="store_true", help="exit 3 when NVML is unavailable")
    args = ap.parse_args(argv)
    report = run(args, lib=lib)
    report["finished"] = time.time()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, out)
    jsonl = out.with_name(out.stem + ".events.jsonl")
    jsonl.write_text("".join(json.dumps(e, default=str) + "\n" for e in report["events"]))
    if report["status"] != "ok":
        print(f"gpu_check: {report['reason']} Report in {out}.")
        return 3 if args.require_gpu else 0
    kinds = [e["type"] for e in report["events"]]
    print(f"gpu_check: {report['device_count']} GPU(s), {kinds.count('gpu')} samples, "
          f"{kinds.count('xid')} xid events; support: "
          + ", ".join(f"{k}={v}" for k, v in sorted(report["support"].items()))
          + f". Report in {out}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
