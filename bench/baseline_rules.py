"""A page of plain fixed-threshold rules: the baseline that trainguard's detectors must beat
(bench_detection_quality). What a team writes on its first day, without learning anything.

- crash: a rank exits with a non-zero code or by a signal;
- hang: no new step for 60 s while telemetry still arrives;
- silent: a rank not heard for 30 s while others are;
- nan: a non-finite loss (the ranks) or gradient norm (job-wide);
- spike: the job's loss above 2x, or its gradient norm above 10x, the mean of the last 50 steps;
- straggler: a rank's compute time above 1.5x the job's median in 5 steps in a row;
- throughput_drop: the mean step time of the last 20 steps above 1.5x that of steps 10-60;
- gpu_fault: a hardware Xid, or a rising double-bit ECC count; gpu_degraded: a GPU throttled
  in 10 samples in a row.

Findings of one kind within 120 s of each other are one incident.
"""
from __future__ import annotations

import math

FAULT_XIDS = {48, 63, 64, 74, 79, 92, 94, 95, 119, 120}


def _finite(x):
    return x is not None and not (math.isnan(x) or math.isinf(x))


def baseline_incidents(events) -> list[dict]:
    found = []
    last_seen, last_step_ts, max_step, hung = {}, None, None, False
    where, local = {}, {}
    losses, grads, step_times = [], [], []
    cur = None            # [step, {rank: event}]
    slow_run, silent = {}, set()
    throttled, dbe = {}, {}
    nan_on = False

    def add(kind, ts, ranks=(), nodes=(), summary=""):
        found.append({"kind": kind, "ranks": sorted(ranks), "nodes": sorted(nodes),
                      "detected_ts": ts, "onset_ts": ts, "severity": "warning",
                      "summary": summary or kind})

    def close(entry):
        nonlocal nan_on
        step, recs = entry
        ts = max(e.ts for e in recs.values())
        bad = sorted(r for r, e in recs.items() if e.loss is not None and not _finite(e.loss))
        badg = any(e.grad_norm is not None and not _finite(e.grad_norm) for e in recs.values())
        if (bad or badg) and not nan_on:
            add("nan", ts, bad)
        nan_on = bool(bad or badg)
        ls = sorted(e.loss for e in recs.values() if e.loss is not None and _finite(e.loss))
        gs = sorted(e.grad_norm for e in recs.values() if e.grad_norm is not None
                    and _finite(e.grad_norm))
        if ls:
            x = ls[len(ls) // 2]
            if len(losses) >= 50 and x > 2 * sum(losses[-50:]) / 50:
                add("loss_spike", ts)
            losses.append(x)
        if gs:
            x = gs[len(gs) // 2]
            if len(grads) >= 50 and x > 10 * sum(grads[-50:]) / 50:
                add("grad_spike", ts)
            grads.append(x)
        cts = {r: e.compute_time for r, e in recs.items() if e.compute_time}
        if len(cts) >= 3:
            med = sorted(cts.values())[len(cts) // 2]
            for r, c in cts.items():
                slow_run[r] = slow_run.get(r, 0) + 1 if c > 1.5 * med else 0
                if slow_run[r] == 5:
                    add("straggler", ts, [r])
        st = sorted(e.step_time for e in recs.values() if e.step_time)
        if st:
            step_times.append(st[len(st) // 2])
            if len(step_times) >= 80:
                base = sum(step_times[10:60]) / 50
                if sum(step_times[-20:]) / 20 > 1.5 * base:
                    add("throughput_drop", ts)
                    del step_times[60:]

    for e in events:
        ts = e.ts
        if e.type in ("step", "heartbeat", "lifecycle") and e.rank is not None:
            last_seen[e.rank] = ts
            silent.discard(e.rank)
            where[e.rank] = e.node
        if e.type == "lifecycle" and e.rank is not None:
            if e.event == "start":
                local[(e.node, e.local_rank)] = e.rank
                max_step, hung = None, False
            elif e.event == "exit":
                last_seen.pop(e.rank, None)
                if e.signal or e.exit_code not in (0, None):
                    add("crash", ts, [e.rank])
        elif e.type == "step":
            if max_step is None or e.step > max_step:
                max_step, last_step_ts, hung = e.step, ts, False
            if cur is not None and e.step != cur[0]:
                close(cur)
                cur = None
            cur = cur or [e.step, {}]
            cur[1][e.rank] = e
        elif e.type == "xid" and e.xid in FAULT_XIDS:
            rank = local.get((e.node, e.gpu))
            add("gpu_fault", ts, [rank] if rank is not None else [], [e.node])
        elif e.type == "gpu":
            for g in e.gpus or []:
                key = (e.node, g.get("index"))
                if g.get("ecc_dbe", 0) > dbe.get(key, 0):
                    rank = local.get(key)
                    add("gpu_fault", ts, [rank] if rank is not None else [], [e.node])
                dbe[key] = g.get("ecc_dbe", 0)
                throttled[key] = throttled.get(key, 0) + 1 if g.get("throttle") else 0
                if throttled[key] == 10:
                    rank = local.get(key)
                    add("gpu_degraded", ts, [rank] if rank is not None else [], [e.node])
        if last_step_ts is not None and not hung and ts - last_step_ts > 60 and last_seen:
            add("hang", ts)
            hung = True
        for r, seen in list(last_seen.items()):
            if r not in silent and ts - seen > 30:
                silent.add(r)
                add("silent", ts, [r])
    if cur is not None:
        close(cur)
    return _merge(found)


def _merge(found):
    out = []
    for f in sorted(found, key=lambda f: f["detected_ts"]):
        prev = next((o for o in reversed(out) if o["kind"] == f["kind"]), None)
        if prev is not None and f["detected_ts"] - prev["_last"] <= 120:
            prev["_last"] = f["detected_ts"]
            prev["ranks"] = sorted(set(prev["ranks"]) | set(f["ranks"]))
            continue
        out.append({**f, "_last": f["detected_ts"]})
    for o in out:
        del o["_last"]
    return out
