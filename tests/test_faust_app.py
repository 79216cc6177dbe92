"""A real Faust worker consumes tg.telemetry from the real broker and counts what it saw."""
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Producer

from trainguard import events as ev

from events_factory import examples


@pytest.mark.slow
def test_faust_worker_counts_telemetry(kafka_config, tmp_path):
    out = tmp_path / "counts.json"
    env = {**os.environ, "COUNTER_BROKER": kafka_config.faust_broker(),
           "COUNTER_TOPIC": kafka_config.topics.telemetry, "COUNTER_OUT": str(out),
           "COUNTER_APP_ID": f"counter-{uuid.uuid4().hex[:8]}",
           "COUNTER_DATADIR": str(tmp_path / "faust")}
    producer = Producer(kafka_config.kafka())
    sent = [e for e in examples() if e.type in ("step", "heartbeat", "gpu", "xid", "lifecycle")]
    for event in sent:
        producer.produce(kafka_config.topics.telemetry, ev.encode(event))
    assert producer.flush(10) == 0
    app = Path(__file__).with_name("faust_counter_app.py")
    worker = subprocess.Popen([sys.executable, str(app), "worker", "-l", "warn"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)
    expected = {}
    for event in sent:
        expected[event.type] = expected.get(event.type, 0) + 1
    try:
        deadline = time.monotonic() + 90
        counts = {}
        while time.monotonic() < deadline and counts != expected:
            time.sleep(0.5)
            if out.exists():
                counts = json.loads(out.read_text())
            assert worker.poll() is None, worker.stdout.read().decode()[-2000:]
        assert counts == expected
    finally:
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(10)
