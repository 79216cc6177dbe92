"""Issues 10 and 19, the online test: real 2-rank torchrun (gloo) jobs under ``trainguard
run`` with the worker, the node agent and the action service running (tests/actions_harness.py's
Deployment, what ``trainguard up`` starts). Four jobs run at once:

- ``healthy``: 6 s steps and a 45 s checkpoint after step 4 (four intervals learned before
  it), inside ``tg.phase("checkpoint")``: no anomaly, no action;
- ``early``: the same job, rank 1 hangs in its data loader at step 6 while rank 0 waits in
  the all-reduce (issue 19: no anomaly in 6 minutes before);
- ``again``: a crash of rank 0 after step 7 restarts the job from its step-5 checkpoint, and
  rank 1 hangs in the second step of that launch;
- ``stuck``: every rank checkpoints for 15 s (a sharded save); after one such checkpoint, rank 1
  stays in the next one, which rank 0 finished.

Each hung rank is found, named and restarted within 60 s of the hang, and each job finishes.
Slow: runs with ``TRAINGUARD_E2E=1``."""
import os

import pytest

from actions_harness import Collector, Deployment, wait_for

pytestmark = [pytest.mark.broker, pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("TRAINGUARD_E2E") != "1",
                                 reason="end-to-end job scenarios run with TRAINGUARD_E2E=1")]

SHAPE = ["--step-sleep", "6.0", "--checkpoint-sleep", "45.0"]
CHECKPOINT_S = 15.0
JOBS = {   # job: (steps, checkpoint every, extra arguments, chaos)
    "healthy": (9, 5, SHAPE, None),
    "early": (9, 5, SHAPE, "hang@step=6,rank=1"),
    "again": (10, 5, ["--step-sleep", "3.0"],
              "crash@step=7,rank=0;hang@step=6,rank=1,launch=1"),
    "stuck": (8, 3, ["--step-sleep", "2.0", "--checkpoint-sleep", str(CHECKPOINT_S),
                     "--sharded-checkpoint"], "hang@step=5,rank=1,phase=checkpoint"),
}


def test_early_and_phase_hangs_are_found_named_and_restarted_and_a_healthy_job_is_left_alone(
        kafka_config, tmp_path):
    topics = kafka_config.topics
    anomalies = Collector(kafka_config, topics.anomalies)
    actions = Collector(kafka_config, topics.actions)
    try:
        with Deployment(tmp_path, kafka_config, limit_s=600) as d:
            d.start(policy={"capture": {"rounds": 1, "interval_s": 1.0, "deadline_s": 5.0}})
            runs = {job: d.supervise(job, d.torchrun(2, steps=steps, job=job,
                                                     checkpoint_every=every, step_sleep=0.0,
                                                     extra=extra), chaos=chaos)
                    for job, (steps, every, extra, chaos) in JOBS.items()}
            wait_for(lambda: all(p.poll() is not None for p in runs.values()),
                     timeout=540, interval=1.0, what="every job's end")
            for job, proc in runs.items():
                assert proc.returncode == 0, d.procs.log(f"run-{job}")[-2000:]
            found = anomalies.drain(3.0)
            acts = actions.drain(1.0)
            assert [(a.kind, a.summary) for a in found if a.job == "healthy"] == []
            assert [(a.action, a.status) for a in acts if a.job == "healthy"] == []
            for job in ("early", "again", "stuck"):
                injected = [r for r in d.chaos_log(job) if r["kind"] == "hang"]
                assert len(injected) == 1, d.chaos_log(job)
                hung_at = injected[0]["injected_ts"]
                if job == "stuck":
                    hung_at += CHECKPOINT_S        # until then its peer was checkpointing too
                hangs = [a for a in found if a.job == job and a.kind == "hang"
                         and a.ts >= hung_at - 1.0]
                assert hangs and hangs[0].ranks == [1], \
                    (job, [(a.kind, a.ranks, a.summary) for a in found if a.job == job])
                assert not [a for a in found if a.job == job and a.kind == "crash"
                            and a.severity == "critical" and a.ts >= hung_at]   # our restart
                restarts = [a for a in acts if a.job == job and a.action == "restart"
                            and a.status == "done" and a.ts >= hung_at]
                assert restarts, (job, d.procs.log("actions")[-3000:])
                assert restarts[0].ts - hung_at <= 60.0, (job, restarts[0].ts - hung_at,
                                                          hangs[0].summary)
    finally:
        anomalies.close()
        actions.close()
