"""End to end on a real Slurm cluster: a 2-node torchrun job (gloo, CPU) submitted with sbatch,
an Xid for one of its nodes, and the action service, through the Slurm driver, drains that
node with the incident in the reason, requeues (or resubmits) the job off it, and the job
resumes from its checkpoint on the other nodes. Under requeue, a later, unrelated crash
restarts the job again, and the drained node stays excluded. Real Kafka, worker, agent and
action service.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from actions_harness import Collector, Deployment, wait_for
from slurm_harness import skip_reason, slurm  # noqa: F401  (the fixture)
from slurm_jobs import train_script, xid_recovery
from test_slurm_cluster import expand

from trainguard.apps.chaos import xid_line

pytestmark = [pytest.mark.slow, pytest.mark.skipif(skip_reason() is not None,
                                                   reason=skip_reason() or "")]

STEPS = 60


def _steps(events, job, after=0.0):
    return [e for e in events if e.type == "step" and e.job == job and e.ts >= after]


def _rank_starts(events, job, after):
    return [e for e in events if e.type == "lifecycle" and e.job == job and e.event == "start"
            and e.rank is not None and e.ts >= after]


def _actions(events, job, action, status=None):
    return [e for e in events if e.type == "action" and e.job == job and e.action == action
            and (status is None or e.status == status) and e.extra.get("source") == "actions"]


@pytest.mark.parametrize("mode", ["requeue", "resubmit"])
def test_xid_drains_the_node_and_the_job_resumes_off_it(slurm, kafka_config, tmp_path, mode):
    job = f"slurm-{mode}"
    folder = tmp_path / "job"
    folder.mkdir()
    script = train_script(folder, job, steps=STEPS, checkpoint_every=10, step_sleep=0.1)
    home = tmp_path / "home"
    job_env = {**slurm.env, "TRAINGUARD_BOOTSTRAP": kafka_config.bootstrap,
               "TRAINGUARD_TOPIC_PREFIX": kafka_config.topics.prefix,
               "TRAINGUARD_HOME": str(home),
               "TRAINGUARD_CHAOS": "crash@step=45,rank=0" if mode == "requeue" else "",
               "TRAINGUARD_CHAOS_LOG": str(folder / "chaos.jsonl")}
    out = str(folder / "slurm-%j.out")
    sbatch_args = ["-N", "2", "-o", out, "-J", job]
    first_id = slurm.run("sbatch", "--parsable", "-H", "--requeue", *sbatch_args, str(script),
                         env=job_env).strip()
    driver = {"type": "slurm", "job_refs": {job: first_id}}
    if mode == "resubmit":
        driver.update(mode="resubmit", script=str(script), sbatch_args=["--requeue",
                                                                        *sbatch_args])
    t0 = time.monotonic()

    def mark(what):  # where the minutes go (pytest -s)
        print(f"{time.monotonic() - t0:6.1f}s {mode}: {what}", flush=True)

    telemetry = Collector(kafka_config, kafka_config.topics.telemetry)
    actions = Collector(kafka_config, kafka_config.topics.actions)
    with Deployment(tmp_path / "d", kafka_config, limit_s=400) as d:
        # The action service's environment is what a resubmitted job inherits (sbatch).
        d.env.update(SLURM_CONF=str(slurm.conf), TRAINGUARD_HOME=str(home),
                     TRAINGUARD_CHAOS=job_env["TRAINGUARD_CHAOS"],
                     TRAINGUARD_CHAOS_LOG=job_env["TRAINGUARD_CHAOS_LOG"])
        try:
            # No `trainguard run` here: the requeued ranks' starts must end the restart (the
            # crash comes ~10 s after it, well inside the 60 s settle).
            d.start(policy={"limits": {"restart_settle_s": 60.0}, "driver": driver},
                    agent=False)
            mark("services up")
            slurm.run("scontrol", "release", first_id)
            running = slurm.wait_job(first_id, "RUNNING", 30)
            good, bad = sorted(expand(running["NodeList"]))
            kmsg = tmp_path / "kmsg.log"
            kmsg.write_text("")
            d.procs.trainguard("agent", "agent", "--node", bad, "--job", job, "--kmsg-extra",
                               str(kmsg), "--runtime-dir", str(tmp_path / "agent-run"),
                               env=d.env, limit_s=400)
            wait_for(lambda: "listening for commands" in d.procs.log("agent"), timeout=60,
                     what="the agent")
            telemetry.wait(lambda ev: [e for e in _steps(ev, job) if e.step >= 22],
                           timeout=120, what="step 22")
            assert {e.node for e in _steps(telemetry.events, job)} == {good, bad}
            fault_ts = time.time()
            mark("step 22: Xid")
            with open(kmsg, "a") as f:
                f.write(xid_line(79, "0000:3b:00", 4242) + "\n")

            # The audit trail: the incident, the drain naming it, the restart off the node.
            [evict] = actions.wait(lambda ev: _actions(ev, job, "evict", "done"), timeout=60,
                                   what="the eviction")
            assert evict.targets["nodes"] == [bad]
            assert f"scontrol update NodeName={bad} State=DRAIN Reason=trainguard incident " \
                   f"{evict.incident}" in evict.reason and evict.reason.endswith(": done]")
            node = slurm.run("scontrol", "show", "node", "-o", bad)
            assert "DRAIN" in slurm.node(bad)["State"]
            assert f"Reason=trainguard incident {evict.incident}: " in node
            mark("evicted")
            [restart] = actions.wait(lambda ev: _actions(ev, job, "restart", "done"),
                                     timeout=60, what="the restart")
            assert restart.incident == evict.incident and restart.targets["exclude_nodes"] == [bad]
            if mode == "requeue":
                assert f"ExcNodeList={bad} StartTime=now: done" in restart.reason
                assert f"show job -o {first_id}: done -> old run finished after" in restart.reason
                current = first_id
            else:
                assert f"sbatch --parsable --exclude={bad}" in restart.reason
                current = restart.reason.split(f"{script}: done -> ")[1].split("]")[0]
                assert current != first_id and current.isdigit()

            mark("restarted")
            # The job resumes from its checkpoint, off the drained node.
            # The old run's last steps can arrive after the restart's record: the new run is
            # told apart by its ranks' start events.
            starts = telemetry.wait(lambda ev: _rank_starts(ev, job, after=restart.ts),
                                    timeout=120, what="the new run's start")
            new_run = min(e.ts for e in starts)
            resumed = telemetry.wait(lambda ev: _steps(ev, job, after=new_run),
                                     timeout=120, what="a step after the restart")
            again = slurm.wait_job(current, "RUNNING", 30)
            assert bad not in expand(again["NodeList"]) and bad in again["ExcNodeList"]
            assert {e.node for e in resumed} <= expand(again["NodeList"])
            before = max(e.step for e in _steps(telemetry.events, job) if e.ts < fault_ts)
            first_after = min(e.step for e in resumed)
            assert first_after % 10 == 0 and first_after <= before + 1, (first_after, before)
            assert first_after >= 20  # from a checkpoint, not from the start

            mark(f"resumed at step {first_after}")
            if mode == "requeue":
                # A second, unrelated restart (rank 0 crashes at step 45): still off the node.
                # (The resubmit driver's second restart: tests/test_slurm_cluster.py.)
                crash = actions.wait(lambda ev: [e for e in _actions(ev, job, "restart", "done")
                                                 if e.incident != evict.incident],
                                     timeout=120, what="the crash's restart")[0]
                assert crash.targets["exclude_nodes"] == [bad]
                assert f"ExcNodeList={bad} StartTime=now: done" in crash.reason
                telemetry.wait(lambda ev: _steps(ev, job, after=crash.ts), timeout=120,
                               what="a step after the second restart")
                mark("resumed after the crash")
            telemetry.wait(lambda ev: [e for e in _steps(ev, job) if e.step == STEPS - 1],
                           timeout=120, what="the last step")
            final = slurm.wait_job(current, ("COMPLETED", "FAILED"), 150)
            assert final["JobState"] == "COMPLETED", \
                Path(out.replace("%j", current)).read_text()[-2000:]
            assert bad not in expand(final["NodeList"])
            nodes_after = {e.node for e in _steps(telemetry.events, job, after=new_run)}
            assert bad not in nodes_after
            mark("finished")
        finally:
            slurm.cancel_all()
            telemetry.close()
            actions.close()
            slurm.resume_nodes(slurm.nodes)
            slurm.wait_idle()


def test_a_warm_spare_takes_the_evicted_nodes_place(slurm, kafka_config, tmp_path):
    """A 3-node allocation training on 2: trainguard run inside it obeys the eviction by
    relaunching its srun off the node (done, not not_applicable), onto the spare."""
    r = xid_recovery(slurm, kafka_config, tmp_path, "spare", log=print)
    assert r["evicted"] not in r["nodes_after"] and len(r["nodes_after"]) == 2
    spare = set(slurm.nodes) - set(r["nodes_before"])
    assert spare <= set(r["nodes_after"])
    evicts = [a for a in r["actions"] if a[0] == "evict" and a[2] is not None]  # the acks
    assert [a[1:3] for a in evicts] == [("done", "done")]
    assert f"--exclude={r['evicted']}" in evicts[0][3]
    # from a checkpoint (every 10 steps) the job had before it was stopped: the one at step
    # 10, or a later one where the eviction took longer (0.1 s steps: a loaded suite once
    # took 9 s and the job resumed at 20)
    assert r["resume_step"] % 10 == 0 and 10 <= r["resume_step"] <= r["last_step_before"] + 1, r
    assert "data_position" not in r["anomaly_kinds"]  # resumed exactly where it left the data
