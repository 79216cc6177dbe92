"""Training jobs on the test Slurm cluster (tests/slurm_harness.py), for the end-to-end tests
and bench/bench_recovery.py: a batch script running examples/train.py with ``torchrun``
across Slurm nodes (gloo on CPU), one torchrun agent per node started by ``srun``.

``train_script`` writes the batch script. On a requeue Slurm runs it again with
``SLURM_RESTART_COUNT`` raised; the script passes that on as ``TRAINGUARD_RESTART_COUNT`` (and
``TRAINGUARD_RESUME=1``), and examples/train.py resumes from its newest checkpoint. Each run
uses its own rendezvous port, derived from the job id and restart count (Slurm's, or
``trainguard run``'s).

``launcher="trainguard-run"`` puts ``trainguard run`` inside the allocation instead, its
command an ``srun`` over ``nodes`` of the allocation's nodes: the allocation's other nodes are
warm spares, and ``trainguard run`` relaunches the ``srun`` with ``--exclude`` of the machines
the action service evicted (see launcher/supervisor.py).
"""
from __future__ import annotations

import shlex
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = str(REPO / ".venv" / "bin" / "python")
TRAIN = str(REPO / "examples" / "train.py")


def train_script(folder: Path, job: str, *, nodes: int = 2, steps: int = 60,
                 checkpoint_every: int = 10, step_sleep: float = 0.1,
                 launcher: str = "sbatch", max_restarts: int = 2) -> Path:
    """The batch script of a 2-node training job ``job`` writing checkpoints and logs in
    ``folder``; ``launcher``: ``"sbatch"`` (Slurm restarts it) or ``"trainguard-run"``."""
    folder = Path(folder)
    ckpt = folder / f"ckpt-{job}"
    train = ("port=$(( 20000 + (SLURM_JOB_ID * 131 + TRAINGUARD_RESTART_COUNT * 17) % 20000 ));"
             f" exec {PYTHON} -m torch.distributed.run --nnodes={nodes} --nproc-per-node=1 "
             f"--node-rank=$SLURM_PROCID --master-addr=127.0.0.1 --master-port=$port "
             f"{TRAIN} --job {job} --steps {steps} --checkpoint-every {checkpoint_every} "
             f"--step-sleep {step_sleep} --timeout 60 --checkpoint-dir {ckpt}")
    step = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1", "bash", "-c", train]
    if launcher == "sbatch":
        run = "exec " + " ".join(shlex.quote(a) for a in step)
    elif launcher == "trainguard-run":
        run = (f"exec {PYTHON} -m trainguard.cli run --job {job} --max-restarts {max_restarts}"
               f" --grace 5 --checkpoint-dir {ckpt} -- " + " ".join(shlex.quote(a) for a in step))
    else:
        raise ValueError(f"launcher must be sbatch or trainguard-run, got {launcher!r}")
    script = folder / f"{job}.sbatch"
    script.write_text(f"""#!/bin/bash
export TRAINGUARD_RESTART_COUNT=${{SLURM_RESTART_COUNT:-0}}
if [ "$TRAINGUARD_RESTART_COUNT" -gt 0 ]; then export TRAINGUARD_RESUME=1; fi
export TRAINGUARD_CHECKPOINT_DIR={ckpt}
echo "launch job=$SLURM_JOB_ID restart=$TRAINGUARD_RESTART_COUNT nodes=$SLURM_JOB_NODELIST \
$(date +%s.%N)" >> {folder}/{job}.launches
{run}
""")
    script.chmod(0o755)
    return script


def xid_recovery(slurm, config, folder: Path, how: str, *, steps: int = 40,
                 fault_step: int = 12, timeout: float = 150.0, queue_s: float = 0.0,
                 log=lambda m: None) -> dict:
    """One Xid on one node of a 2-node training job, recovered ``how``:

    - ``"requeue"``: an sbatch job of 2 nodes, the action service's Slurm driver drains the
      node and requeues the job off it (Slurm allocates a node again);
    - ``"spare"``: an sbatch job of 3 nodes whose ``trainguard run`` runs the training on 2;
      the action service's orders go to ``trainguard run``, which relaunches the ``srun``
      off the evicted node, onto the spare, within the allocation.

    ``queue_s`` > 0: a busy cluster. Once the training steps, another 2-node job of
    ``queue_s`` seconds is submitted; it waits in the queue (``Reason=Resources``), ahead of
    any job submitted or requeued after it.

    Returns the timeline in seconds from the Xid (``detected_s``: the first anomaly;
    ``ordered_s``: the restart's record; ``relaunched_s``: the new launch began, the batch
    script's start after a requeue, ``trainguard run``'s relaunch of its ``srun`` on a spare;
    ``ranks_up_s``: the first rank of it called ``trainguard.init`` (its process started,
    imported torch, joined the process group); ``resumed_s``: the first step after the
    restart) and what happened (nodes before and after, the resume step, when the queued
    job ran, the action records: ``(action, status, ack_status, reason)``, ``ack_status``
    None where no order was acked)."""
    from actions_harness import Collector, Deployment, wait_for

    from trainguard.apps.chaos import xid_line
    from trainguard.signing import KEY_ENV, generate_key

    job = f"xid-{how}" + ("-busy" if queue_s else "")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    launcher = "trainguard-run" if how == "spare" else "sbatch"
    script = train_script(folder, job, steps=steps, checkpoint_every=10, step_sleep=0.1,
                          launcher=launcher)
    home = folder / "home"
    key = generate_key()  # the action service signs its orders; trainguard run checks them
    env = {"TRAINGUARD_BOOTSTRAP": config.bootstrap, "TRAINGUARD_HOME": str(home),
           "TRAINGUARD_TOPIC_PREFIX": config.topics.prefix, KEY_ENV: key}
    out = str(folder / "slurm-%j.out")
    job_id = slurm.run("sbatch", "--parsable", "-H", "--requeue", "-N",
                       "3" if how == "spare" else "2", "-o", out, "-J", job, str(script),
                       env=env).strip()
    policy: dict = {"limits": {"restart_settle_s": 10.0}}
    if how == "requeue":
        policy["driver"] = {"type": "slurm", "job_refs": {job: job_id}}
    telemetry = Collector(config, config.topics.telemetry)
    actions = Collector(config, config.topics.actions)
    anomalies = Collector(config, config.topics.anomalies)
    result: dict = {"how": how, "slurm_job": job_id}
    with Deployment(folder / "services", config, limit_s=int(timeout) + 200) as d:
        d.env.update(SLURM_CONF=str(slurm.conf), TRAINGUARD_HOME=str(home), **{KEY_ENV: key})
        try:
            d.start(policy=policy, agent=False)
            slurm.run("scontrol", "release", job_id)
            def nodes_stepping(ev, after=0.0):
                return sorted({e.node for e in ev if e.type == "step" and e.job == job
                               and e.ts > after})

            nodes = telemetry.wait(lambda ev: len(nodes_stepping(ev)) == 2 and
                                   nodes_stepping(ev), timeout=timeout, what="both nodes")
            bad = nodes[-1]
            queued_at = folder / "queued-job.started"
            if queue_s:
                slurm.run("sbatch", "--parsable", "-N", "2", "-o", "/dev/null", "-J", "queued",
                          "--wrap", f"date +%s.%N > {queued_at}; sleep {queue_s:g}")
            kmsg = folder / "kmsg.log"
            kmsg.write_text("")
            d.procs.trainguard("agent", "agent", "--node", bad, "--job", job, "--kmsg-extra",
                               str(kmsg), "--runtime-dir", str(folder / "agent-run"),
                               env=d.env, limit_s=int(timeout) + 200)
            wait_for(lambda: "listening for commands" in d.procs.log("agent"), timeout=60,
                     what="the agent")
            first = telemetry.wait(lambda ev: [e for e in ev if e.type == "step"
                                               and e.job == job and e.step >= fault_step],
                                   timeout=timeout, what=f"step {fault_step}")
            fault_ts = time.time()
            with open(kmsg, "a") as f:
                f.write(xid_line(79, "0000:3b:00", 4242) + "\n")
            log(f"{how}: Xid for {bad} at step {max(e.step for e in first)}")

            def restarted(ev):
                return [e for e in ev if e.type == "action" and e.job == job
                        and e.action == "restart" and e.status == "done"]
            restart = min(actions.wait(restarted, timeout=60, what="the restart"),
                          key=lambda e: e.ts)
            anomalies.drain(0.2)
            assert restart.ts > fault_ts, ("a restart before the Xid, of a healthy job", [
                (a.kind, a.ranks, a.summary) for a in anomalies.events
                if a.type == "anomaly" and a.job == job])
            ordered = min((e.ts for e in actions.events if e.type == "action"
                           and e.job == job and e.action == "restart"), default=restart.ts)
            resumed = telemetry.wait(
                lambda ev: [e for e in ev if e.type == "step" and e.job == job
                            and e.ts > restart.ts], timeout=timeout, what="a resumed step")
            telemetry.wait(lambda ev: len(nodes_stepping(ev, restart.ts)) == 2,
                           timeout=60, what="both nodes stepping again")
            anomalies.drain(0.5)
            found = [a for a in anomalies.events if a.type == "anomaly" and a.job == job]
            first_resumed = min(resumed, key=lambda e: e.ts)
            launches = [float(line.split()[-1]) for line in
                        (folder / f"{job}.launches").read_text().splitlines()]
            relaunch = [e.ts for e in telemetry.events if e.type == "lifecycle"
                        and e.job == job and e.rank is None and e.event == "start"
                        and (e.extra or {}).get("incarnation", 0) > 0]
            ranks_up = [e.ts for e in telemetry.events if e.type == "lifecycle"
                        and e.job == job and e.rank is not None and e.event == "start"
                        and e.ts > fault_ts]
            relaunched = min(relaunch) if how == "spare" and relaunch else \
                launches[1] if how != "spare" and len(launches) > 1 else None
            result.update(
                relaunched_s=round(relaunched - fault_ts, 2) if relaunched else None,
                ranks_up_s=round(min(ranks_up) - fault_ts, 2) if ranks_up else None)
            if queue_s:
                ran = float(queued_at.read_text()) if queued_at.exists() else None
                result.update(queue_s=queue_s, queued_job_started_s=round(ran - fault_ts, 2)
                              if ran else None)
            result.update(
                nodes_before=nodes, evicted=bad,
                detected_s=round(min(a.detected_ts for a in found) - fault_ts, 2)
                if found else None,
                ordered_s=round(ordered - fault_ts, 2),
                resumed_s=round(first_resumed.ts - fault_ts, 2),
                resume_step=first_resumed.step,
                last_step_before=max((e.step for e in telemetry.events if e.type == "step"
                                      and e.job == job and e.ts <= restart.ts), default=None),
                nodes_after=nodes_stepping(telemetry.events, restart.ts),
                anomaly_kinds=sorted({a.kind for a in found}),
                actions=[(e.action, e.status, e.extra.get("ack_status"), e.reason[:160])
                         for e in actions.events if e.type == "action" and e.job == job])
            log(f"{how}: resumed at step {first_resumed.step} on {result['nodes_after']}, "
                f"{result['resumed_s']} s after the Xid")
            return result
        finally:
            slurm.cancel_all()
            for c in (telemetry, actions, anomalies):
                c.close()
            slurm.resume_nodes(slurm.nodes)
            slurm.wait_idle()
