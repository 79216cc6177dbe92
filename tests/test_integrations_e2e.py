"""End to end with ``trainguard up`` and ``trainguard run --instrument``: a plain 3-rank DDP
script that imports nothing of trainguard hangs (rank 2, in its data loader), is found, named,
restarted and resumed from its checkpoint; later rank 1 is SIGKILLed, the crash is found (the
detector names the survivors gloo failed, see docs/INTEGRATIONS.md), and the job resumes again
and finishes. Runs with ``TRAINGUARD_E2E=1`` (``make test``).
"""
from __future__ import annotations

import os

import pytest

from actions_harness import PYTHON, REPO, Collector, Procs, wait_for
from collector_harness import with_framework

pytestmark = [pytest.mark.broker, pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("TRAINGUARD_E2E") != "1",
                                 reason="end-to-end job scenarios run with TRAINGUARD_E2E=1")]

STEPS, HANG_AT, KILL_AT = 30, 8, 18


def test_plain_script_hang_and_crash_are_found_and_resumed(kafka_config, tmp_path):
    env = {"TRAINGUARD_BOOTSTRAP": kafka_config.bootstrap,
           "TRAINGUARD_TOPIC_PREFIX": kafka_config.topics.prefix,
           "TRAINGUARD_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1",
           # the deployment's key: `run` checks the service's orders and signs its acks
           "TRAINGUARD_SIGNING_KEY": "a-shared-test-key-of-the-deployment"}
    topics = kafka_config.topics
    seen = {name: Collector(kafka_config, getattr(topics, name))
            for name in ("telemetry", "anomalies", "actions")}
    procs = Procs(tmp_path)
    try:
        procs.trainguard("up", "up", env=env, limit_s=400)
        wait_for(lambda: "trainguard is up" in procs.log("up"), timeout=90,
                 what=f"trainguard up: {procs.log('up')[-1500:]}")
        job = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--standalone",
               str(REPO / "examples" / "plain_ddp.py"), "--steps", str(STEPS),
               "--step-sleep", "0.1", "--checkpoint-every", "4", "--timeout", "300"]
        run = procs.trainguard(
            "run", "run", "--job", "e2e-plain", "--instrument", "--max-restarts", "3",
            "--grace", "5", "--checkpoint-dir", str(tmp_path / "ckpt"), "--", *job,
            env={**env, "FAULT_HANG": f"2:{HANG_AT}", "FAULT_KILL": f"1:{KILL_AT}"},
            limit_s=360)
        wait_for(lambda: run.poll() is not None, timeout=350, interval=0.5,
                 what="the job's end")
        assert run.returncode == 0, procs.log("run")[-3000:]
        assert "WARNING: no signing key" not in procs.log("run") + procs.log("up")

        anomalies = [a for a in seen["anomalies"].drain(2.0) if a.job == "e2e-plain"
                     and a.type == "anomaly"]
        kinds = {a.kind for a in anomalies}
        assert "hang" in kinds and "crash" in kinds, [(a.kind, a.ranks) for a in anomalies]
        crash = [a for a in anomalies if a.kind == "crash" and a.severity == "critical"]
        # gloo fails the survivors at once (exit code 1) when a peer is SIGKILLed, before
        # torchrun's SIGTERM, and the crash detector names them: see docs/INTEGRATIONS.md
        assert crash, [(a.kind, a.ranks, a.summary) for a in anomalies]
        print("crash named", [(a.ranks, a.summary) for a in crash])
        actions = [a for a in seen["actions"].drain(1.0) if a.job == "e2e-plain"]
        captures = [a for a in actions if a.action == "capture_stacks" and a.status == "done"]
        hang = [a for a in anomalies if a.kind == "hang"]
        named = {tuple(a.ranks) for a in hang} | {tuple(a.targets.get("suspects") or ())
                                                  for a in captures}
        assert (2,) in named, (named, procs.log("actions")[-2000:])
        assert any(a.action == "restart" and a.status == "done" for a in actions)

        telemetry = seen["telemetry"].drain(1.0)
        launches = sorted(e.ts for e in telemetry if e.type == "lifecycle" and e.rank is None
                          and e.job == "e2e-plain" and e.event == "start")
        assert len(launches) == 3, launches  # the first launch, after the hang, after the crash
        steps = [e for e in telemetry if e.type == "step" and e.job == "e2e-plain"]
        for began, fault_step in zip(launches[1:], (HANG_AT, KILL_AT)):
            resumed = [e.step for e in steps if e.ts > began]
            assert resumed and fault_step - 4 <= min(resumed) <= fault_step, (fault_step,
                                                                              min(resumed))
        assert max(e.step for e in steps) == STEPS - 1
        assert all(e.compute_time is not None and e.loss is not None for e in steps)
    finally:
        procs.stop_all(grace=10.0)
        for c in seen.values():
            c.close()


@pytest.mark.parametrize("name", [with_framework("hf"), with_framework("lightning")])
def test_callback_jobs_resume_where_trainguard_says(name, kafka_config, tmp_path):
    """A 2-rank HF / Lightning job under ``trainguard run`` loses rank 1 (SIGKILL) after step
    22; the relaunch resumes, with no line of resume code in the script, from the checkpoint
    ``TRAINGUARD_RESUME_STEP=10`` names (not the newest, step 20), and finishes."""
    script = {"hf": ["examples/hf_trainer.py", "--steps", "26", "--save-steps", "10"],
              "lightning": ["examples/lightning_job.py", "--steps", "26", "--save-steps",
                            "10"]}[name]
    env = {"TRAINGUARD_BOOTSTRAP": kafka_config.bootstrap,
           "TRAINGUARD_TOPIC_PREFIX": kafka_config.topics.prefix,
           "TRAINGUARD_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "FAULT_KILL": "1:22",
           "TRAINGUARD_RESUME_STEP": "10"}
    telemetry = Collector(kafka_config, kafka_config.topics.telemetry)
    procs = Procs(tmp_path)
    try:
        job = [PYTHON, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               str(REPO / script[0]), *script[1:]]
        run = procs.trainguard("run", "run", "--job", f"resume-{name}", "--max-restarts", "2",
                               "--grace", "5", "--checkpoint-dir", str(tmp_path / "ckpt"),
                               "--", *job, env=env, limit_s=300)
        wait_for(lambda: run.poll() is not None, timeout=290, interval=0.5,
                 what="the job's end")
        assert run.returncode == 0, procs.log("run")[-3000:]
        events = [e for e in telemetry.drain(2.0) if e.job == f"resume-{name}"]
        launches = sorted(e.ts for e in events if e.type == "lifecycle" and e.rank is None
                          and e.event == "start")
        assert len(launches) == 2, launches
        steps = [e for e in events if e.type == "step"]
        before = [e.step for e in steps if e.ts < launches[1]]
        after = sorted({e.step for e in steps if e.ts > launches[1]})
        assert max(before) >= 20, before
        assert after[0] == 10 and after[-1] == 25, after   # resumed at 10, not at 20
    finally:
        procs.stop_all(grace=10.0)
        telemetry.close()
