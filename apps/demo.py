"""``trainguard demo``: the main job on one machine.

A real 4-rank (gloo, CPU) training of ``examples/train.py`` under ``trainguard run
--standby`` (issue 20: in-memory snapshots every step, warm standby processes that take the
ranks over without a relaunch), with the stream worker, the action service and the node agent
running against the local broker, goes through a chaos schedule (NaN, straggler, hang, crash,
Xid 79). trainguard finds and handles each fault. Then the same job with the same schedule
runs under plain ``torchrun --max-restarts=3`` (checkpoints on disk) as the baseline. Both
runs' ETTR are measured the same way, from the training script's own step log; the scorecard,
the HTML report and a recording of every event land in the output folder.
"""
from __future__ import annotations

import json
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from trainguard.config import Config, Topics
from trainguard.errors import UserError
from trainguard.apps.ettr_model import LOST_MACHINE_RATIO, Recovery, projection
from trainguard.apps.scorecard import ettr, kept_steps, outcomes
from trainguard.services import ServiceSet, tail
from trainguard.topics import TopicPlan, create_topics
from trainguard.up import ensure_broker, kafka_args, start_pipeline

REPO = Path(__file__).resolve().parents[1]


@dataclass(kw_only=True)
class DemoPlan:
    """The job and its chaos schedule, in steps of the example script."""

    steps: int = 260
    checkpoint_every: int = 10
    step_sleep: float = 0.15
    gloo_timeout: float = 90.0
    ranks: int = 4
    snapshot_every: int = 1      #: trainguard's run: in-memory snapshots, every step

    def __post_init__(self):
        if self.steps < 200:
            raise ValueError("the chaos schedule needs at least 200 steps")

    def chaos(self, kmsg: Path) -> str:
        return ";".join([
            "nan@step=25,rank=1",
            "straggler@step=45-95,rank=2,factor=2.5",
            "hang@step=120,rank=2",
            "crash@step=160,rank=3",
            f"xid@step=200,rank=0,xid=79,kmsg={kmsg}",
            "crash@step=200,rank=0",
        ])


def example_script() -> Path:
    script = REPO / "examples" / "train.py"
    if not script.is_file():
        raise UserError(f"the example job {script} is missing: run the demo from a checkout of "
                        "the trainguard repository")
    return script


def script_argv(plan: DemoPlan, job: str, ckpt: Path, step_log: Path) -> list:
    return [str(example_script()), "--job", job, "--steps", str(plan.steps),
            "--checkpoint-every", str(plan.checkpoint_every), "--checkpoint-dir", str(ckpt),
            "--step-sleep", str(plan.step_sleep), "--timeout", str(plan.gloo_timeout),
            "--step-log", str(step_log), "--log-every", "20"]


def torchrun_argv(plan: DemoPlan, job: str, ckpt: Path, step_log: Path, *restarts: str) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={plan.ranks}", *restarts,
            *script_argv(plan, job, ckpt, step_log)]


def standby_argv(plan: DemoPlan, job: str, ckpt: Path, step_log: Path, snapshots: Path) -> list:
    """``trainguard run``'s arguments from ``--nproc`` on: the standby launcher, one warm
    standby per rank, snapshots every ``plan.snapshot_every`` steps into ``snapshots``."""
    return ["--nproc", str(plan.ranks), "--standby", str(plan.ranks), "--",
            *script_argv(plan, job, ckpt, step_log), "--snapshot-every",
            str(plan.snapshot_every), "--snapshot-dir", str(snapshots)]


def chaos_env(plan: DemoPlan, run_dir: Path) -> dict:
    kmsg = run_dir / "kmsg.log"
    kmsg.touch()
    return {"TRAINGUARD_CHAOS": plan.chaos(kmsg), "TRAINGUARD_CHAOS_LOG": str(run_dir / "chaos.jsonl"),
            "TRAINGUARD_CHAOS_STATE": str(run_dir / "chaos-state"),
            "TRAINGUARD_CHAOS_KMSG": str(kmsg), "OMP_NUM_THREADS": "1"}


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def step_runs(path: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["start"], r["end"]) for r in read_jsonl(path)]


def wait_for(child, deadline: float, on_tick=None) -> bool:
    while time.monotonic() < deadline:
        if child.proc.poll() is not None:
            return True
        if on_tick:
            on_tick()
        time.sleep(0.5)
    return False


def run_trainguard(plan: DemoPlan, config: Config, out: Path, minutes: float, view) -> dict:
    run_dir = out / "trainguard"
    run_dir.mkdir(parents=True)
    job = f"demo-{uuid.uuid4().hex[:6]}"
    node = socket.gethostname()
    from trainguard.signing import KEY_ENV, generate_key

    env = {**chaos_env(plan, run_dir), "TRAINGUARD_BOOTSTRAP": config.bootstrap,
           "TRAINGUARD_TOPIC_PREFIX": config.topics.prefix,
           "TRAINGUARD_HOME": str(run_dir / "home"),
           KEY_ENV: generate_key()}  # the demo's services sign and check orders and commands
    from trainguard.apps.live import EventTap

    tap = EventTap(config, run_dir / "recording.jsonl.gz", job=job)
    tap.start()
    # the in-memory snapshots: host memory, for this run only (removed after the services)
    with tempfile.TemporaryDirectory(prefix=f"trainguard-{job}-", dir="/dev/shm",
                                     ignore_cleanup_errors=True) as shm, \
            ServiceSet(log_dir=run_dir / "logs") as services:
        snapshots = Path(shm)
        view.status("set-up: starting the worker, the action service and the node agent")
        start_pipeline(services, config, env=env,
                       worker_args=["--data-dir", str(run_dir / "worker"), "--id",
                                    f"tg-demo-{job}", "--web-port", str(_free_port())],
                       actions_args=["--state", str(run_dir / "actions-state.json")],
                       agent_args=["--job", job, "--node", node, "--kmsg-extra",
                                   str(run_dir / "kmsg.log"), "--runtime-dir",
                                   str(run_dir / "home" / "run"), "--snapshot-dir",
                                   str(snapshots)])
        time.sleep(3)
        view.status(f"set-up done: training {job}, {plan.ranks} ranks under trainguard run")
        began = time.time()
        run = services.start_trainguard("run", [
            "run", "--job", job, "--checkpoint-dir", str(run_dir / "ckpt"), "--max-restarts", "8",
            "--grace", "5", *kafka_args(config),
            *standby_argv(plan, job, run_dir / "ckpt", run_dir / "steps.jsonl", snapshots)],
            env=env)
        finished = wait_for(run, time.monotonic() + minutes * 60,
                            on_tick=lambda: view.update(tap, step_runs(run_dir / "steps.jsonl")))
        ended = time.time()
        if not finished:
            view.note(f"time limit of {minutes:g} min reached; stopping the job")
        dead = [c.name for c in services.dead() if c.name != "run"]
        time.sleep(2)
    tap.stop()
    if dead:
        view.note(f"services that exited early: {', '.join(dead)} (logs in {run_dir / 'logs'})")
    steps = step_runs(run_dir / "steps.jsonl")
    faults = outcomes(read_jsonl(run_dir / "chaos.jsonl"), tap.anomalies(), tap.actions(), steps)
    return {"job": job, "began": began, "ended": ended, "finished": finished,
            "completed": bool(steps) and max(s for s, _, _ in steps) == plan.steps - 1,
            "ettr": ettr(steps, began, ended), "steps": steps, "faults": faults, "tap": tap,
            "log": tail(run.log, 8)}


def run_baseline(plan: DemoPlan, out: Path, minutes: float, view) -> dict:
    run_dir = out / "baseline"
    run_dir.mkdir(parents=True)
    env = {**chaos_env(plan, run_dir), "TRAINGUARD_BOOTSTRAP": "127.0.0.1:1",
           "TRAINGUARD_HOME": str(run_dir / "home")}
    job = f"baseline-{uuid.uuid4().hex[:6]}"
    with ServiceSet(log_dir=run_dir / "logs") as services:
        began = time.time()
        run = services.start("torchrun", torchrun_argv(plan, job, run_dir / "ckpt",
                                                       run_dir / "steps.jsonl",
                                                       "--max-restarts=3"), env=env)
        finished = wait_for(run, time.monotonic() + minutes * 60,
                            on_tick=lambda: view.baseline(step_runs(run_dir / "steps.jsonl")))
        ended = time.time()
    steps = step_runs(run_dir / "steps.jsonl")
    faults = outcomes(read_jsonl(run_dir / "chaos.jsonl"), [], [], steps)
    return {"ettr": ettr(steps, began, ended), "finished": finished, "steps": steps,
            "completed": bool(steps) and max(s for s, _, _ in steps) == plan.steps - 1,
            "faults": [f.to_dict() for f in faults], "wall_s": ended - began,
            "log": tail(run.log, 8)}


def _free_port() -> int:
    from trainguard.broker import free_port

    return free_port()


def median_detection_s(faults) -> float | None:
    """Seconds from injection to detection, the median over the faults that were detected."""
    delays = sorted(f.detected_ts - f.injected_ts for f in faults if f.detected_ts is not None)
    return delays[len(delays) // 2] if delays else None


def projection_at_scale(faults, baseline_faults=()) -> dict | None:
    """Today's relaunch against issue 20's recovery at 9,600 and 100,000 GPUs, with this run's
    detection time. The in-memory rows' in-place gain is this run's own: its seconds lost per
    fault over the baseline's (:func:`inplace_ratio`; 1.0, no gain, without a baseline);
    ``bench/run.py recovery_inplace`` measures the restart alone. The second in-memory row
    has warm spare machines (a lost machine's ranks restart in place on a spare's standbys,
    ``tests/test_recovery_snapshots.py``, at the measured ``LOST_MACHINE_RATIO`` of a
    relaunch); the first relaunches onto a spare."""
    detect = median_detection_s(faults)
    if detect is None:
        return None
    ratio = inplace_ratio(faults, baseline_faults)
    return projection([Recovery.relaunch(detect_s=detect)] + [
        Recovery.in_memory(detect_s=detect, inplace_ratio=ratio, snapshot_every_s=60.0,
                           snapshot_overhead=0.01, warm_spares=spares,
                           lost_ratio=LOST_MACHINE_RATIO)
        for spares in (False, True)])


def inplace_ratio(faults, baseline_faults) -> float:
    """Seconds lost under trainguard (in place) over the same under the baseline's relaunch
    (plain torchrun), summed over the faults of the schedule (the same, in the same order)
    that both recovered from; at most 1.0.

    >>> from types import SimpleNamespace as F
    >>> inplace_ratio([F(lost_s=9.0), F(lost_s=2.0), F(lost_s=1.0)],
    ...               [{"injected_ts": 0.0, "recovered_ts": None},
    ...                {"injected_ts": 0.0, "recovered_ts": 10.0},
    ...                {"injected_ts": 5.0, "recovered_ts": 15.0}])
    0.15
    >>> inplace_ratio([F(lost_s=2.0)], [])
    1.0
    """
    ours = theirs = 0.0
    for fault, base in zip(faults, baseline_faults):
        if fault.lost_s is not None and base.get("recovered_ts") is not None:
            ours += fault.lost_s
            theirs += base["recovered_ts"] - base["injected_ts"]
    return min(1.0, round(ours / theirs, 3)) if theirs > 0 else 1.0


def mean_loss_per_fault(faults, steps) -> float | None:
    """Training seconds lost per fault: from injection to the first kept step after it."""
    losses = [f.lost_s for f in faults if f.lost_s is not None]
    return sum(losses) / len(losses) if losses else None


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def set_up_kafka(config: Config, view) -> bool:
    """The broker (started if none answers; True then) and the demo's topics, with a spinner
    on a terminal: the first run fetches Kafka with Maven."""
    from trainguard.progress import Stages, wanted

    with Stages("demo set-up", enabled=view.enabled and wanted()) as setup:
        setup.stage("the local Kafka broker")
        started = ensure_broker(config, log=view.note)
        setup.stage("topics")
        create_topics(config, TopicPlan(telemetry_partitions=4, other_partitions=2))
    return started


def main(args, config: Config) -> int:
    from trainguard.apps.live import LiveView

    # Ctrl-C, and a SIGTERM from a scheduler, unwind through the ServiceSets, which stop every
    # process the demo started (also when SIGINT was ignored, as in a background job).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)

    out = Path(args.out or f"demo-out/{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = Config(bootstrap=config.bootstrap, client_settings=config.client_settings,
                    topics=Topics(prefix=f"demo{uuid.uuid4().hex[:6]}"))
    view = LiveView(enabled=not args.json and sys.stdout.isatty())
    started_broker = set_up_kafka(config, view)
    plan = DemoPlan()
    try:
        with view:
            ours = run_trainguard(plan, config, out, args.minutes, view)
            baseline = None
            if not args.no_baseline:
                view.note("baseline: the same job and chaos under plain torchrun --max-restarts=3")
                baseline = run_baseline(plan, out, args.minutes, view)
    finally:
        if started_broker:
            from trainguard.broker import local_broker

            local_broker(port=int(config.bootstrap.rpartition(":")[2])).stop()
    result = scorecard(ours, baseline, out)
    if args.json:
        print(json.dumps(result))
    else:
        view.print_summary(result)
    return 0 if ours["completed"] else 1


def scorecard(ours: dict, baseline: dict | None, out: Path) -> dict:
    from trainguard.apps.report import write_report

    faults = ours["faults"]
    loss = mean_loss_per_fault(faults, ours["steps"])
    tap = ours["tap"]
    report = out / "report.html"
    captures = tap.captures()
    result = {
        "faults": [f.to_dict() for f in faults],
        "ettr": round(ours["ettr"], 4),
        "baseline": ({"ettr": round(baseline["ettr"], 4), "faults": baseline["faults"],
                      "completed": baseline["completed"], "wall_s": round(baseline["wall_s"], 1)}
                     if baseline else None),
        "loss_per_fault_s": round(loss, 1) if loss is not None else None,
        "projection": projection_at_scale(faults, baseline["faults"] if baseline else ()),
        "completed": ours["completed"],
        "kept_steps": len(kept_steps(ours["steps"])),
        "wall_s": round(ours["ended"] - ours["began"], 1),
        "report": str(report),
        "recording": str(tap.path),
    }
    analysis = {"events": tap.count, "invalid": 0, "incidents": tap.incidents(),
                "ettr": result["ettr"],
                "baseline": {"ettr": result["baseline"]["ettr"]} if baseline else None}
    write_report(report, analysis, events=tap.events(), actions=tap.actions(),
                 captures=captures, faults=result["faults"], title="trainguard demo")
    (out / "scorecard.json").write_text(json.dumps(result, indent=2) + "\n")
    return result

