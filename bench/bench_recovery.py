"""Recovery: seconds from a fault to its detection, to the restart, and to the first step after
the resume, for a hang and a crash of a real 4-rank torchrun (gloo, CPU) job.

Everything runs for real on this machine: a Kafka broker (``$TRAINGUARD_BOOTSTRAP``, else one
started here), ``trainguard worker``, ``agent`` and ``actions``, and ``examples/train.py``
under ``trainguard run`` with a fault from ``trainguard.apps.chaos``:

- hang: ``hang@step=25,rank=2`` (rank 2 blocks in its data loading for ever);
- crash: ``crash@step=25,rank=1`` (rank 1 SIGKILLs itself).

Times, all wall clock of this machine, from the fault's injection (the chaos log):

``detected_s``   the first anomaly of the job (its ``detected_ts``);
``decided_s``    the action service's first ``restart`` record for the job (planned);
``restarted_s``  the relaunch by ``trainguard run`` (its lifecycle ``start`` of launch 1);
``resumed_s``    the first training step completed after the relaunch.

A piece that is missing or that did not act leaves its number ``None`` and says why under
``missing``; nothing is estimated.

``slurm``: on a real Slurm cluster on this machine (tests/slurm_harness.py; needs root and
Debian's slurmctld/slurmd), an Xid for one node of a 2-node torchrun job, at step 12, two
ways (tests/slurm_jobs.py ``xid_recovery``): ``requeue`` (the Slurm driver drains the node and
requeues the job off it) and ``spare`` (the job holds a third node; ``trainguard run`` inside
the allocation relaunches off the node, onto the spare). ``resumed_s``: seconds from the Xid
to the first step after the restart; ``spare_over_requeue`` their ratio (target <= 0.5), with
an empty queue. Both again with a busy queue (``*_busy``: a 2-node job of ``QUEUE_S`` seconds
queued before the Xid, which a requeued job waits behind): ``spare_over_requeue_busy``.
``relaunched_s``, ``ranks_up_s`` and ``after_relaunch_s`` say where the time goes
(``SLURM_NOTE``).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

SCENARIOS = {"hang": "hang@step=25,rank=2", "crash": "crash@step=25,rank=1"}
QUEUE_S = 30.0
#: (result key, how, seconds of the job queued ahead): an empty queue, then a busy one
SLURM_RUNS = (("requeue", "requeue", 0.0), ("spare", "spare", 0.0),
              ("requeue_busy", "requeue", QUEUE_S), ("spare_busy", "spare", QUEUE_S))
SLURM_NOTE = (
    "seconds from the Xid. relaunched_s: the new launch began (requeue: the batch script "
    "started again; spare: trainguard run relaunched its srun); after_relaunch_s = "
    "resumed_s - relaunched_s, the part both paths share: srun, torchrun, Python and torch "
    "imports of fresh processes, the process group, the optimizer and checkpoint load, one "
    "step; it varies with the machine's load from run to run. *_relaunch ratios: of "
    "relaunched_s alone, the part where the two paths differ. *_busy: another 2-node job of %g s was queued before the Xid (a busy cluster); the "
    "requeued job waits behind it, the spare path never enters the queue; that wait grows "
    "with the queue, so spare_over_requeue_busy is an example, not a constant" % QUEUE_S)
STEPS = 60
TIMEOUT_S = 150.0


def _broker():
    if os.environ.get("TRAINGUARD_BOOTSTRAP"):
        return os.environ["TRAINGUARD_BOOTSTRAP"], None
    from trainguard.broker import free_port, local_broker

    broker = local_broker(port=free_port(), data=tempfile.mkdtemp(prefix="tg-bench-broker-"))
    broker.start(log=lambda m: None)
    return broker.bootstrap, broker


def _pieces() -> list[str]:
    import importlib

    missing = []
    for module in ("trainguard.streams.worker", "trainguard.collectors.agent",
                   "trainguard.collectors.api", "trainguard.apps.chaos", "trainguard.diagnosis.stacks",
                   "trainguard.detectors.correlate"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module}: {exc}")
    return missing


def _timeline(job: str, d, telemetry, anomalies, actions) -> dict:
    out = {"fault_ts": None, "detected_s": None, "decided_s": None, "restarted_s": None,
           "resumed_s": None, "detected_kind": None, "resume_step": None, "fault_step": None,
           "missing": []}
    chaos = d.chaos_log(job)
    if not chaos:
        out["missing"].append("the fault was never injected (no chaos log line)")
        return out
    fault = min(c["injected_ts"] for c in chaos)
    out["fault_ts"], out["fault_step"] = fault, chaos[0].get("step")
    mine = [a for a in anomalies.events if a.job == job and a.type == "anomaly"
            and a.detected_ts >= fault - 1.0]
    if mine:
        det = min(mine, key=lambda a: a.detected_ts)
        out["detected_s"], out["detected_kind"] = det.detected_ts - fault, det.kind
    else:
        out["missing"].append("no anomaly for the job (stream worker or detectors)")
    decided = [a for a in actions.events if a.job == job and a.action == "restart"
               and a.extra.get("source") == "actions" and a.ts >= fault]
    if decided:
        out["decided_s"] = min(a.ts for a in decided) - fault
        out["decision"] = sorted({f"{a.status}: {a.reason[:100]}" for a in decided})
    else:
        out["missing"].append("the action service wrote no restart for the job")
    launches = [e for e in telemetry.events if e.type == "lifecycle" and e.job == job
                and e.rank is None and e.event == "start" and e.ts >= fault]
    if not launches:
        out["missing"].append("trainguard run did not relaunch the job")
        return out
    relaunch = min(e.ts for e in launches)
    out["restarted_s"] = relaunch - fault
    steps = [e for e in telemetry.events if e.type == "step" and e.job == job
             and e.ts > relaunch]
    if steps:
        step = min(steps, key=lambda e: e.ts)
        out["resumed_s"], out["resume_step"] = step.ts - fault, step.step
    else:
        out["missing"].append("no training step after the relaunch")
    return out


def _scenario(name: str, chaos: str, config, folder: Path) -> dict:
    from actions_harness import Collector, Deployment, wait_for

    job = f"bench-{name}"
    topics = config.topics
    telemetry = Collector(config, topics.telemetry)
    anomalies = Collector(config, topics.anomalies)
    actions = Collector(config, topics.actions)
    try:
        with Deployment(folder / name, config, limit_s=int(TIMEOUT_S) + 60) as d:
            d.start(policy={"capture": {"rounds": 2, "interval_s": 1.0, "deadline_s": 5.0}})
            run = d.supervise(job, d.torchrun(4, steps=STEPS, job=job), chaos=chaos)
            started = time.monotonic()
            try:
                wait_for(lambda: run.poll() is not None, timeout=TIMEOUT_S,
                         interval=0.5, what=f"the {name} job to finish")
            except AssertionError:
                pass
            for c in (telemetry, anomalies, actions):
                c.drain(1.0)
            result = _timeline(job, d, telemetry, anomalies, actions)
            result["job_exit"] = run.poll()
            result["job_wall_s"] = round(time.monotonic() - started, 1)
            if run.poll() is None:
                result["missing"].append(f"the job did not finish within {TIMEOUT_S:g}s")
            if run.poll() not in (None, 0):
                result["missing"].append(f"the job ended with code {run.poll()}: "
                                         f"{d.procs.log(f'run-{job}')[-300:]}")
            return result
    finally:
        for c in (telemetry, anomalies, actions):
            c.close()


def _slurm(bootstrap: str, folder: Path) -> dict:
    from slurm_harness import skip_reason, slurm_cluster
    from slurm_jobs import xid_recovery

    from trainguard.config import Config, Topics
    from trainguard.topics import TopicPlan, create_topics

    why = skip_reason()
    if why:
        return {"skipped": why}
    out: dict = {}
    with slurm_cluster(folder / "slurm-cluster") as cluster:
        for name, how, queue_s in SLURM_RUNS:
            config = Config(bootstrap=bootstrap,
                            topics=Topics(prefix=f"bench{uuid.uuid4().hex[:8]}"))
            create_topics(config, TopicPlan(telemetry_partitions=4, other_partitions=2))
            try:
                r = xid_recovery(cluster, config, folder / f"slurm-{name}", how,
                                 queue_s=queue_s)
            except AssertionError as exc:
                r = {"how": how, "missing": [str(exc)[:300]]}
            r.pop("actions", None)
            if r.get("resumed_s") is not None and r.get("relaunched_s") is not None:
                r["after_relaunch_s"] = round(r["resumed_s"] - r["relaunched_s"], 2)
            out[name] = r
    for ratio, spare, requeue in (("spare_over_requeue", "spare", "requeue"),
                                  ("spare_over_requeue_busy", "spare_busy", "requeue_busy")):
        for key, suffix in (("resumed_s", ""), ("relaunched_s", "_relaunch")):
            a, b = out.get(spare, {}).get(key), out.get(requeue, {}).get(key)
            if a and b:
                out[ratio + suffix] = round(a / b, 2)
    out["note"] = SLURM_NOTE
    return out


def run() -> dict:
    from trainguard.config import Config, Topics
    from trainguard.topics import TopicPlan, create_topics

    missing = _pieces()
    if missing:
        return {"error": "pieces missing, nothing measured", "missing": missing}
    bootstrap, broker = _broker()
    folder = Path(tempfile.mkdtemp(prefix="tg-bench-recovery-"))
    try:
        results = {"slurm": _slurm(bootstrap, folder)}
        for name, chaos in SCENARIOS.items():
            config = Config(bootstrap=bootstrap,
                            topics=Topics(prefix=f"bench{uuid.uuid4().hex[:8]}"))
            create_topics(config, TopicPlan(telemetry_partitions=4, other_partitions=2))
            r = _scenario(name, chaos, config, folder)
            for key in ("detected_s", "decided_s", "restarted_s", "resumed_s"):
                if r.get(key) is not None:
                    r[key] = round(r[key], 2)
            r["chaos"] = chaos
            results[name] = r
        return {"ranks": 4, "steps": STEPS, "logs": str(folder), **results,
                "note": "wall-clock seconds from the fault's injection; detection of a hang "
                        "waits for the hang detector's timeout (floor 20 s by default)"}
    finally:
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
