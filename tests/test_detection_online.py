"""Issue 10, the online test: a real 2-rank torchrun (gloo) job with 6 s steps and a 45 s
checkpoint inside ``tg.phase("checkpoint")``, under ``trainguard run`` with the worker, the
node agent and the action service running (tests/actions_harness.py's Deployment, what
``trainguard up`` starts). The healthy job raises no anomaly and gets no action; the same job
with one rank hung after the checkpoint has that rank blamed, is restarted, and finishes.

The shape is as short as it allows: six steps to learn the step time, the checkpoint, three
steps after it (where the false hang used to come), about two minutes each; both jobs run
at once. Slow: runs with ``TRAINGUARD_E2E=1``."""
import os

import pytest

from actions_harness import Collector, Deployment, wait_for

pytestmark = [pytest.mark.broker, pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("TRAINGUARD_E2E") != "1",
                                 reason="end-to-end job scenarios run with TRAINGUARD_E2E=1")]

STEPS = 9
SHAPE = ["--step-sleep", "6.0", "--checkpoint-sleep", "45.0"]


def test_six_second_steps_and_a_45s_checkpoint_no_false_hang_and_a_real_one_found(
        kafka_config, tmp_path):
    topics = kafka_config.topics
    anomalies = Collector(kafka_config, topics.anomalies)
    actions = Collector(kafka_config, topics.actions)
    try:
        with Deployment(tmp_path, kafka_config, limit_s=600) as d:
            d.start(policy={"capture": {"rounds": 1, "interval_s": 1.0, "deadline_s": 5.0}})
            healthy = d.supervise("healthy", d.torchrun(2, steps=STEPS, job="healthy",
                                                        checkpoint_every=6, step_sleep=0.0,
                                                        extra=SHAPE))
            hung = d.supervise("hung", d.torchrun(2, steps=STEPS, job="hung",
                                                  checkpoint_every=6, step_sleep=0.0,
                                                  extra=SHAPE),
                               chaos="hang@step=7,rank=1")
            wait_for(lambda: healthy.poll() is not None and hung.poll() is not None,
                     timeout=540, interval=1.0, what="both jobs' end")
            assert healthy.returncode == 0, d.procs.log("run-healthy")[-2000:]
            assert hung.returncode == 0, d.procs.log("run-hung")[-2000:]
            found = anomalies.drain(3.0)
            acts = actions.drain(1.0)
            assert [(a.kind, a.summary) for a in found if a.job == "healthy"] == []
            assert [(a.action, a.status) for a in acts if a.job == "healthy"] == []
            hangs = [a for a in found if a.job == "hung" and a.kind == "hang"]
            assert hangs and hangs[0].ranks == [1], [(a.kind, a.ranks, a.summary)
                                                      for a in found if a.job == "hung"]
            assert not [a for a in found if a.job == "hung" and a.kind == "crash"
                        and a.severity == "critical"]      # our own restart is no crash
            restarts = [a for a in acts if a.job == "hung" and a.action == "restart"
                        and a.status == "done"]
            assert restarts, d.procs.log("actions")[-3000:]
    finally:
        anomalies.close()
        actions.close()
