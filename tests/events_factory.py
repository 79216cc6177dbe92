"""One valid example of every SPEC §1 event type, for round trips and contract tests."""
from trainguard import events as ev

TS = 1764680000.25


def examples() -> list[ev.Event]:
    thread = {"name": "MainThread", "id": 140234, "active": True,
              "frames": [{"function": "wait", "file": "/x/distributed_c10d.py", "line": 12}]}
    return [
        ev.Step(job="j1", ts=TS, node="n1", rank=0, step=12, step_time=0.51, compute_time=0.4,
                loss=2.5, grad_norm=float("nan"), loss_scale=65536.0, tokens=4096, lr=3e-4),
        ev.Heartbeat(job="j1", ts=TS, node="n1", rank=3, pid=4242, step=11, phase="collective",
                     phase_since=TS - 1, dropped=0),
        ev.Gpu(job="j1", ts=TS, node="n1", gpus=[{
            "index": 0, "uuid": "GPU-1", "util": 97.0, "mem_used": 70 << 30,
            "mem_total": 80 << 30, "temp": 61.0, "power": 650.5, "sm_clock": 1980,
            "throttle": ["sw_power_cap"], "ecc_sbe": 0, "ecc_dbe": 0, "remapped_pending": False,
            "remapped_failure": False, "pcie_replay": 0, "nvlink_errors": 0}]),
        ev.Gpu(job="j1", ts=TS, node="n2", gpus=[], status="unavailable",
               reason="NVML library not found"),
        ev.Xid(job="j1", ts=TS, node="n1", gpu=3, xid=79, source="kmsg",
               message="GPU has fallen off the bus."),
        ev.Lifecycle(job="j1", ts=TS, node="n1", rank=0, event="start", pid=4242, world_size=8,
                     local_rank=0, topology={"tp": 2, "pp": 1, "dp": 4}, argv=["train.py"]),
        ev.Lifecycle(job="j1", ts=TS, node="n1", rank=0, event="exit", exit_code=None,
                     signal="SIGKILL"),
        ev.Command(job="j1", ts=TS, node="n1", command="capture_stacks", capture_id="c1",
                   ranks="all"),
        ev.Command(job="j1", ts=TS, command="capture_stacks", capture_id="c2", ranks=[0, 2]),
        ev.Stack(job="j1", ts=TS, node="n1", rank=2, capture_id="c1", pid=4242, method="py-spy",
                 threads=[thread]),
        ev.Anomaly(job="j1", ts=TS, id="a-1", kind="straggler", severity="warning", ranks=[6],
                   nodes=["n1"], step=181, onset_ts=TS - 40, detected_ts=TS, detector="straggler",
                   summary="rank 6 is 1.5x slower than its peers", evidence={"ratio": 1.5}),
        ev.Action(job="j1", ts=TS, incident="i-1", action="restart", targets={"ranks": [6]},
                  status="dry_run", reason="dry-run mode"),
        ev.Order(job="j1", ts=TS, order_id="o-1", op="evict", incident="i-1",
                 targets={"nodes": ["n3"], "exclude_nodes": ["n3"]}),
        ev.Ack(job="j1", ts=TS, node="n1", order_id="o-1", status="done", op="evict",
               reason="excluded n3 from the next launch", code=None, key_id="0123abcd",
               sig="0" * 64),
    ]
