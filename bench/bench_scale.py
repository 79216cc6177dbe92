"""Issue 21: where today's design stops, for one job of 4,096 to 100,000 ranks.

Today's design: the rank side (``RankProcessor``, spread over the telemetry partitions and the
workers) turns every rank's events into one summary per rank per step; the job side
(``JobProcessor``, one per job, on the worker that owns the job's summaries partition) takes
all of them. This bench runs both in one process, without the broker (the wire's cost is
measured by ``stream_throughput``), on synthetic jobs of TP 8 x PP 4 x DP layouts, 8 ranks per
machine, every rank sending a ``step`` and one ``heartbeat`` per second (the contract's rate,
SPEC §2), with a lifecycle ``start`` of every rank first. Per size, after ``WARM`` steps (the
stages are built and have learned), ``MEASURE`` steps are timed with ``time.process_time``:

- ``rank_side_us_per_event`` and ``rank_side_over_orjson``: the rank side's rate as a
  ratio to ``orjson.loads`` alone of the same records (issue 21's target: at least 0.33);
- ``job_side_cpu_s_per_job_s``: the job side's CPU seconds per second of the job (1 s
  steps; target at 100,000 ranks: at most 0.1), the machines' GPU samples' summaries
  included. With 10 s steps it is this divided by ten, plus the heartbeats, which the rank
  side forwards every 5 s when unchanged, and the GPU samples, one a second
  (``job_side_cpu_s_per_job_s_10s_steps``, measured on the smaller sizes);
- ``rank_side_bytes_per_rank`` / ``job_side_bytes_per_rank``: resident memory grown while
  each side built its stages, per rank;
- ``gpu_sample_us``: the rank side's CPU µs per machine's GPU sample (a ``gpu`` event of the
  node agent: eight H100s with every field the agent reads from NVML and the machine's
  ``host`` counters), about one per machine per second (SPEC §2), through the same rank side
  (its ``NodeStage`` per machine: the GPU checks and the machine's outlier vector), timed
  apart from the ranks' events; the job side's share of them is in its own time;
- ``cores_for_the_job``: rank side cores at the contract's rate (the ranks' events and the
  machines' GPU samples, spread over workers) plus the job side's (one process: above 1.0 it
  cannot keep up at any number of workers).

The automatic garbage collector is off while it runs, as in the worker, which collects every
``worker.gc_interval_s`` (30 s) instead; ``gc_s_per_collection`` is what one such collection
of both sides' objects costs (charge a thirtieth of it per second).

**Faults** (``faults``): per size, the scenario library's large job (``large_job`` in
tests/scenario_library.py, the same TP 8 x PP 4 x DP layout, 8 ranks per machine, 1 s steps)
with issue 21's four faults: a slow rank, a rank hung in its data loader (trainguard restarts
the job), a lost machine (restarted onto a spare) and a rank whose loss goes NaN. Its
recording goes through ``trainguard analyze``'s engine, which runs the worker's stages in
one process; each fault's detection latency (seconds, and steps for the straggler), whether
it was localized exactly (the ranks, and the machine for the lost one), the incidents that
match no fault, and the events per CPU second of that one process.

``python bench/run.py scale --json``; ``TG_SCALE_SIZES=4096,16384`` for fewer.
"""
from __future__ import annotations

import gc
import os
import sys
import time
from functools import partial
from pathlib import Path

SIZES = (4096, 16384, 100_000)
TP, PP, PER_NODE = 8, 4, 8
WARM, MEASURE = 2, 3
PARTITIONS = 24
JOB = "scale"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _records(ranks: int, step: int, t0: float, heartbeats: int = 1) -> list:
    """``(partition, offset, key, value)`` of one step: a ``step`` and ``heartbeats``
    heartbeats of every rank."""
    from trainguard import events as ev

    out = []
    ts = t0 + step * float(heartbeats)
    for r in range(ranks):
        node = f"n{r // PER_NODE:05d}"
        key = f"{JOB}/{r}".encode()
        p = r % PARTITIONS
        out.append((p, 0, key, ev.encode(ev.Step(
            job=JOB, ts=ts + (r % 13) * 1e-3, node=node, rank=r, step=step,
            step_time=float(heartbeats), compute_time=0.8 * heartbeats + (r % 5) * 1e-3,
            loss=2.5 - step * 1e-3 + (r % 7) * 1e-4, grad_norm=1.0, tokens=4096, lr=3e-4))))
        for h in range(heartbeats):
            out.append((p, 0, key, ev.encode(ev.Heartbeat(
                job=JOB, ts=ts + h + 0.5, node=node, rank=r, pid=1000 + r, step=step,
                phase="forward", phase_since=ts + h + 0.01, dropped=0))))
    return out


def _gpu_samples(ranks: int, step: int, t0: float) -> list:
    """One ``gpu`` event per machine for second ``step``: eight GPUs, every field the agent
    reads on an H100 (collectors/nvml.py), and the machine's host counters."""
    from trainguard import events as ev

    out = []
    ts = t0 + step + 0.3
    for m in range(ranks // PER_NODE):
        node = f"n{m:05d}"
        gpus = [{"index": i, "uuid": f"GPU-{node}-{i}", "util": 97, "mem_used": 75161927680,
                 "mem_total": 85899345920, "temp": 62 + (m + i) % 5, "power": 640.125,
                 "sm_clock": 1980, "mem_clock": 2619, "power_limit": 700.0, "throttle": [],
                 "ecc_sbe": 0, "ecc_dbe": 0, "pcie_replay": 0, "nvlink_errors": 0,
                 "remapped_pending": False, "remapped_failure": False,
                 "pcie_tx_kbs": 1200000 + i, "pcie_rx_kbs": 1100000 + i}
                for i in range(PER_NODE)]
        host = {"cpu_util": 35.5, "net_rx_bytes": (step + 1) * 10 ** 9,
                "net_tx_bytes": (step + 1) * 10 ** 9, "tcp_retrans": step,
                "tcp_out_segs": (step + 1) * 10 ** 6}
        out.append((m % PARTITIONS, 0, f"{JOB}/{node}".encode(), ev.encode(ev.Gpu(
            job=JOB, ts=ts, node=node, gpus=gpus, host=host))))
    return out


def _starts(ranks: int, t0: float) -> list:
    from trainguard import events as ev

    return [(r % PARTITIONS, 0, f"{JOB}/{r}".encode(), ev.encode(ev.Lifecycle(
        job=JOB, ts=t0 - 5.0, node=f"n{r // PER_NODE:05d}", rank=r, event="start",
        world_size=ranks, local_rank=r % PER_NODE, pid=1000 + r))) for r in range(ranks)]


def _numbered(records: list, first: int) -> list:
    """Offsets per partition, as the topic would give them."""
    return [(p, first + i, k, v) for i, (p, _, k, v) in enumerate(records)]


def one_size(ranks: int, heartbeats: int = 1) -> dict:
    import orjson

    from trainguard.detectors import DetectorsConfig, JobStage, NodeStage, RankStage
    from trainguard.streams.processors import JobProcessor, RankProcessor

    config = DetectorsConfig()
    rank_side = RankProcessor(partial(RankStage, config),
                              make_node_stage=partial(NodeStage, config),
                              max_live=10 * ranks)
    job_side = JobProcessor(partial(JobStage, config), advance_every_s=0.5)
    t0 = 1.8e9
    offset = 0
    cpu = {"rank": 0.0, "job": 0.0, "orjson": 0.0, "gpu": 0.0}
    events = samples = 0
    memory = {}

    def run_step(records: list, now: float, timed: bool, gpu: list = ()) -> None:
        nonlocal offset, events, samples
        records = _numbered(records, offset)
        offset += len(records)
        gpu = _numbered(gpu, offset)
        offset += len(gpu)
        if timed:
            start = time.process_time()
            for rec in records:
                orjson.loads(rec[3])
            cpu["orjson"] += time.process_time() - start
        start = time.process_time()
        out = rank_side.process(records, now=now)
        rank_cpu = time.process_time() - start
        outs = [out]
        if gpu:
            start = time.process_time()
            outs.append(rank_side.process(gpu, now=now))
            gpu_cpu = time.process_time() - start
        start = time.process_time()
        for got in outs:
            for _, value in got.messages():
                job_side.apply(value, 0, now)
        job_side.advance(now)
        job_cpu = time.process_time() - start
        if timed:
            cpu["rank"] += rank_cpu
            cpu["job"] += job_cpu
            events += len(records)
            if gpu:
                cpu["gpu"] += gpu_cpu
                samples += len(gpu)

    gc.collect()
    gc.disable()                 # as the worker does (streams/gc_schedule.py), see below
    try:
        before = _rss()
        run_step(_starts(ranks, t0), t0, False)
        for s in range(WARM + MEASURE):
            records = _records(ranks, s, t0, heartbeats)
            now = t0 + (s + 1) * heartbeats + 0.9
            gpu = [g for h in range(heartbeats) for g in _gpu_samples(ranks, s * heartbeats + h,
                                                                       t0)]
            run_step(records, now, s >= WARM, gpu)
            if s == 0:
                gc.collect()
                memory["after_first_step"] = _rss() - before
        start = time.process_time()
        gc.collect()
        collection_s = time.process_time() - start
    finally:
        gc.enable()
    rank_stages = len(rank_side.state.slots)
    step_s = float(heartbeats)
    result = {
        "ranks": ranks, "layout": f"TP{TP} x PP{PP} x DP{ranks // (TP * PP)}",
        "step_s": step_s, "events_timed": events,
        "rank_side_us_per_event": round(cpu["rank"] / events * 1e6, 2),
        "orjson_us_per_event": round(cpu["orjson"] / events * 1e6, 2),
        "rank_side_over_orjson": round(cpu["orjson"] / cpu["rank"], 3),
        "job_side_cpu_s_per_step": round(cpu["job"] / MEASURE, 3),
        "job_side_cpu_s_per_job_s": round(cpu["job"] / MEASURE / step_s, 3),
        "job_side_us_per_rank_step": round(cpu["job"] / MEASURE / ranks * 1e6, 2),
        "bytes_per_rank_both_sides": int(memory["after_first_step"] / ranks),
        "rank_stages": rank_stages,
        # the worker collects every gc_interval_s (30 s), both sides' objects in one process
        "gc_s_per_collection": round(collection_s, 3),
    }
    result["gpu_sample_us"] = round(cpu["gpu"] / max(samples, 1) * 1e6, 1)
    contract_events_per_s = 2.0 * ranks      # a step and a heartbeat per rank per second
    machines_per_s = ranks / PER_NODE         # and a GPU sample per machine per second
    rank_cores = contract_events_per_s * cpu["rank"] / events
    result["cores_rank_side_ranks_events"] = round(rank_cores, 2)
    rank_cores += machines_per_s * cpu["gpu"] / max(samples, 1)
    result["cores_rank_side_at_contract_rate"] = round(rank_cores, 2)
    result["cores_for_the_job"] = round(rank_cores + result["job_side_cpu_s_per_job_s"], 2)
    result["job_side_keeps_up"] = result["job_side_cpu_s_per_job_s"] < 1.0
    return result


def faults(ranks: int) -> dict:
    """Issue 21's four faults in one job of ``ranks`` (a multiple of 32), through the engine
    of ``trainguard analyze``; see the module."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from scenario_library import large_job
    from scenario_scoring import score
    from scenarios import recording

    from trainguard.detectors.offline import analyze_events

    rec = recording(large_job(ranks // (TP * PP)))
    events = rec["events"]
    start = time.process_time()
    engine, _ = analyze_events(events)
    cpu = time.process_time() - start
    result = score(engine.incidents(), rec["truth"], rec["step_ends"])
    out = {"ranks": ranks, "events": len(events), "analyze_cpu_s": round(cpu, 1),
           "events_per_cpu_s": int(len(events) / cpu),
           "faults": [{"kind": r["kind"], "label": r["label"], "found": r["found"],
                       "exact": r["exact"], "latency_s": r["latency_s"],
                       "latency_steps": r["latency_steps"]} for r in result["results"]],
           "false_incidents": [(i["kind"], i["ranks"][:8]) for i in result["false_incidents"]]}
    out["all_found_exactly"] = (all(r["found"] and r["exact"] for r in result["results"])
                                and not result["false_incidents"])
    del rec, events, engine
    gc.collect()
    return out


def run() -> dict:
    sizes = tuple(int(x) for x in os.environ.get("TG_SCALE_SIZES", "").split(",") if x) \
        or SIZES
    out = {"design": "today's: one summary per rank per step to one job side per job",
           "warm_steps": WARM, "measured_steps": MEASURE, "sizes": []}
    for ranks in sizes:
        out["sizes"].append(one_size(ranks))
        gc.collect()
    for ranks in sizes:
        if ranks <= 16384:
            ten = one_size(ranks, heartbeats=10)
            out.setdefault("ten_second_steps", []).append(
                {k: ten[k] for k in ("ranks", "job_side_cpu_s_per_job_s",
                                     "rank_side_us_per_event", "rank_side_over_orjson")})
            gc.collect()
    if os.environ.get("TG_SCALE_FAULTS", "1") != "0":
        out["faults"] = [faults(ranks) for ranks in sizes]
    biggest = out["sizes"][-1]
    out["targets"] = {"job_side_cpu_s_per_job_s_at_100k": 0.1, "rank_side_over_orjson": 0.33,
                      "cores_for_100k": 4}
    out["at_largest"] = {k: biggest[k] for k in ("ranks", "job_side_cpu_s_per_job_s",
                                                 "rank_side_over_orjson",
                                                 "cores_for_the_job", "job_side_keeps_up")}
    return out
