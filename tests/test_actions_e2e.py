"""End to end: a real torchrun (gloo) job of 2 or 3 ranks under ``trainguard run``, with
``trainguard worker``, ``agent`` and ``actions`` running, faults from ``trainguard.apps.chaos``.

Each scenario takes about a minute on two cores; they run with ``TRAINGUARD_E2E=1``, which
``make test`` sets (``TRAINGUARD_E2E=0 make test`` leaves them out).
"""
import contextlib
import os

import pytest

from actions_harness import Collector, Deployment, wait_for
from alertmanager_harness import BINARY, alertmanager, alerts_in
from http_receiver import HttpReceiver

pytestmark = [pytest.mark.broker, pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("TRAINGUARD_E2E") != "1",
                                 reason="end-to-end job scenarios run with TRAINGUARD_E2E=1")]

STEPS = 50
FAST_CAPTURE = {"rounds": 2, "interval_s": 1.0, "deadline_s": 5.0}


def steps_of(events, job):
    return [e for e in events if e.type == "step" and e.job == job]


@pytest.fixture
def world(kafka_config, tmp_path):
    topics = kafka_config.topics
    collectors = {name: Collector(kafka_config, getattr(topics, name))
                  for name in ("telemetry", "anomalies", "actions")}
    with HttpReceiver() as hook, Deployment(tmp_path, kafka_config, limit_s=300) as d:
        yield d, collectors, hook
    for c in collectors.values():
        c.close()


def test_hang_is_localized_restarted_and_resumed(world, tmp_path):
    d, c, hook = world
    alerts = {"webhook": {"url": hook.url("/hook"), "retries": 1}}
    with contextlib.ExitStack() as stack:
        if BINARY:
            am = stack.enter_context(alertmanager(tmp_path, hook.url("/am")))
            alerts["alertmanager"] = {"url": am}
        d.start(policy={"capture": FAST_CAPTURE, "alerts": alerts})
        _hang_scenario(d, c, hook)
        if BINARY:  # Alertmanager holds the alert and forwards it to its own receiver
            forwarded = hook.wait_for(lambda reqs: [
                a for a in alerts_in(reqs, "firing") if a["labels"]["training_job"] == "hang"],
                timeout=15)
            assert {a["labels"]["kind"] for a in alerts_in(forwarded, "firing")} & {
                "hang", "straggler", "crash"}


def _hang_scenario(d, c, hook):
    run = d.supervise("hang", d.torchrun(3, steps=STEPS, job="hang"),
                      chaos="hang@step=25,rank=1")
    wait_for(lambda: run.poll() is not None, timeout=240, interval=0.5, what="the job's end")
    assert run.returncode == 0, d.procs.log("run-hang")[-2000:]
    acts = [e for e in c["actions"].drain(1.0) if e.job == "hang"]
    capture = [a for a in acts if a.action == "capture_stacks" and a.status == "done"]
    assert capture and capture[0].targets["suspects"] == [1], d.procs.log("actions")[-3000:]
    assert [a.status for a in acts if a.action == "restart"
            and a.extra.get("ack_status") == "done"] == ["done"]
    fault = d.chaos_log("hang")[0]["injected_ts"]
    relaunch = min(e.ts for e in c["telemetry"].drain(1.0) if e.type == "lifecycle"
                   and e.job == "hang" and e.rank is None and e.event == "start"
                   and e.ts > fault)
    resumed = [s.step for s in steps_of(c["telemetry"].events, "hang") if s.ts > relaunch]
    assert resumed and min(resumed) <= 25 and max(resumed) == STEPS - 1
    hook.wait_for(lambda reqs: any(b"hang" in r.body for r in reqs), timeout=10)


def test_with_warm_standbys_a_hang_is_restarted_in_place_without_a_relaunch(world):
    """Issue 20 point 3 through the whole pipeline: the restart order names the hung rank,
    ``trainguard run --standby`` kills only its process and standbys take the ranks over."""
    d, c, _ = world
    d.start(policy={"capture": FAST_CAPTURE})
    run = d.supervise("inplace", d.script(steps=STEPS, job="inplace",
                                          extra=["--snapshot-every", "1"]),
                      chaos="hang@step=25,rank=1", standby=(3, 3))
    wait_for(lambda: run.poll() is not None, timeout=240, interval=0.5, what="the job's end")
    assert run.returncode == 0, d.procs.log("run-inplace")[-3000:]
    acts = [e for e in c["actions"].drain(1.0) if e.job == "inplace"]
    restarts = [a for a in acts if a.action == "restart" and a.extra.get("ack_status")]
    assert [(a.extra["ack_status"], a.extra.get("code")) for a in restarts] == \
        [("done", "restarted_in_place")], d.procs.log("actions")[-3000:]
    assert restarts[0].targets.get("ranks") == [1]
    telemetry = c["telemetry"].drain(1.0)
    launches = [e for e in telemetry if e.type == "lifecycle" and e.job == "inplace"
                and e.rank is None and e.event == "start"]
    assert len(launches) == 1                       # no relaunch
    fault = d.chaos_log("inplace")[0]["injected_ts"]
    resumed = [s.step for s in steps_of(telemetry, "inplace") if s.ts > fault + 1.0]
    assert resumed and max(resumed) == STEPS - 1
    assert "standby" in d.procs.log("run-inplace")


def test_crash_is_restarted_and_resumed(world):
    d, c, _ = world
    d.start(policy={"capture": FAST_CAPTURE})
    run = d.supervise("crash", d.torchrun(2, steps=STEPS, job="crash"),
                      chaos="crash@step=25,rank=1")
    wait_for(lambda: run.poll() is not None, timeout=240, interval=0.5, what="the job's end")
    assert run.returncode == 0, d.procs.log("run-crash")[-2000:]
    launches = [e for e in c["telemetry"].drain(1.0) if e.type == "lifecycle"
                and e.job == "crash" and e.rank is None and e.event == "start"]
    assert len(launches) == 2  # one restart, not one per dead rank
    assert max(s.step for s in steps_of(c["telemetry"].events, "crash")) == STEPS - 1


def test_repeated_failures_hit_the_restart_cap_and_page(world):
    d, c, hook = world
    d.start(policy={"capture": FAST_CAPTURE, "limits": {"max_restarts": 1},
                    "alerts": {"webhook": {"url": hook.url("/hook"), "retries": 1}}})
    chaos = "crash@step=12,rank=1;crash@step=22,rank=1;crash@step=32,rank=1"
    run = d.supervise("loop", d.torchrun(2, steps=STEPS, job="loop"), chaos=chaos,
                      max_restarts=5)
    wait_for(lambda: any(a.extra.get("code") == "page" for a in c["actions"].drain(0.5)
                         if a.job == "loop"), timeout=240, what="the page")
    capped = [a for a in c["actions"].events if a.job == "loop" and a.action == "restart"
              and a.extra.get("code") == "restart_cap"]
    assert capped and capped[0].status == "rate_limited"
    hook.wait_for(lambda reqs: any(b"restart_cap" in r.body for r in reqs), timeout=10)
    run.terminate()
