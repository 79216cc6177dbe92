"""The broker stopped in the middle of a run and started again: training goes on, and the
events produced after the restart arrive. Uses its own broker (never the shared one)."""
from __future__ import annotations

import json
import time

import pytest

from collector_harness import PYTHON, JOB_SCRIPT, by_type, consume, job_env, start, stop

pytestmark = [pytest.mark.slow, pytest.mark.broker]


@pytest.fixture
def own_broker(tmp_path):
    from trainguard.broker import free_port, local_broker

    broker = local_broker(port=free_port(), data=tmp_path / "broker")
    broker.start(log=lambda m: None)
    try:
        yield broker
    finally:
        broker.stop()


def restart(broker) -> None:
    """Start the stopped broker again; one retry (a start on this busy machine once exited)."""
    from trainguard.broker import BrokerError

    try:
        broker.start(log=lambda m: None)
    except BrokerError:
        time.sleep(1.0)
        broker.start(log=lambda m: None)


def test_broker_restart_mid_run(own_broker, tmp_path):
    from trainguard.config import Config, Topics
    from trainguard.topics import TopicPlan, create_topics

    config = Config(bootstrap=own_broker.bootstrap, topics=Topics(prefix="trestart"))
    create_topics(config, TopicPlan(telemetry_partitions=2, other_partitions=1))
    topic = config.topics.telemetry
    stop_file = tmp_path / "stop"
    out = tmp_path / "out"
    proc = start([PYTHON, JOB_SCRIPT, "--job", "tg-restart", "--forward-ms", "20",
                  "--heartbeat", "0.2", "--until-file", str(stop_file), "--max-seconds", "240",
                  "--out", str(out)],
                 job_env(own_broker.bootstrap, "trestart", tmp_path / "home"), timeout=300)
    try:
        before = consume(own_broker.bootstrap, topic, timeout=40,
                         done=lambda evs: len(by_type(evs, "step")) >= 10)
        assert len(by_type(before, "step")) >= 10, "no steps before the outage"

        down_at = time.time()
        own_broker.stop()
        time.sleep(2.0)  # the job trains on with the broker gone
        restart(own_broker)
        up_at = time.time()

        def after_restart(evs):
            return all(any(e.ts > up_at for e in by_type(evs, kind))
                       for kind in ("step", "heartbeat"))

        # the producer reconnects within librdkafka's backoff (at most 10 s), later on a
        # loaded machine: a minute, waited on the condition
        events = consume(own_broker.bootstrap, topic, done=after_restart, timeout=60)
        newest = max((e.ts for e in events if e.type in ("step", "heartbeat")), default=0.0)
        assert after_restart(events), ("no events produced after the restart arrived",
                                       f"newest event {newest - up_at:+.1f} s from the restart",
                                       f"job exit code {proc.poll()}")
        assert proc.poll() is None, "the job died during the outage"
    finally:
        stop_file.touch()
        try:
            proc.wait(30)
        except Exception:
            pass
        output = proc.stdout.read() if proc.stdout else ""
        stop(proc)
    assert proc.returncode == 0, output[-3000:]

    result = json.loads((out / "rank0.json").read_text())
    ends = result["step_end_times"]
    during = [t for t in ends if down_at < t < up_at]
    print(f"{len(during)} steps while the broker was down ({up_at - down_at:.1f} s); "
          f"max step {max(result['step_times']) * 1e3:.1f} ms, median "
          f"{result['median_step_time'] * 1e3:.1f} ms, dropped {result['dropped']}")
    assert len(during) >= 10, "training stalled while the broker was down"
    final = consume(own_broker.bootstrap, topic, timeout=20,
                    done=lambda evs: any(e.event == "exit"
                                         for e in by_type(evs, "lifecycle")))
    exits = [e for e in by_type(final, "lifecycle") if e.event == "exit"]
    assert exits and exits[0].exit_code == 0
