"""The control channel through the real broker, attacked: forged, replayed, stale and hostile
orders to a real ``trainguard run`` are dead-lettered and never carried out; a signed order
is obeyed and acked; forged acks are refused by the action service; a flood of commands to
a real node agent gives a bounded number of stack dumps."""
import json
import subprocess
import sys
import threading
import time
import uuid

import pytest

from actions_harness import PYTHON, Collector, Procs, produce, read_log, wait_for, write_child
from trainguard import events as ev
from trainguard.actions.orders import ack_of
from trainguard.actions.policy import Policy
from trainguard.actions.service import build_service
from trainguard.actions.state import ServiceState
from trainguard.signing import KEY_ENV, SigningKeys, sign

pytestmark = pytest.mark.broker

KEY = "orders-kafka-test-key-" + "0" * 16
KEYS = SigningKeys.parse(KEY)


def order(op="restart", order_id=None, job="jo", ts=None, **targets):
    return ev.Order(job=job, ts=time.time() if ts is None else ts,
                    order_id=order_id or f"o-{uuid.uuid4().hex}", op=op, targets=targets,
                    incident=f"inc-{op}")


def produce_raw(config, topic, *values, key=b"jo"):
    from confluent_kafka import Producer

    p = Producer(config.kafka(**{"linger.ms": 0, "partitioner": "murmur2_random"}))
    for value in values:
        p.produce(topic, key=key, value=value)
    assert p.flush(10) == 0


class DeadLetters:
    """The dead-letter records (JSON objects) of a topic, from its beginning."""

    def __init__(self, config):
        from confluent_kafka import Consumer, TopicPartition

        topic = config.topics.deadletter
        self.consumer = Consumer(config.kafka(**{"group.id": f"dl-{uuid.uuid4().hex}",
                                                 "enable.auto.commit": False}))
        meta = self.consumer.list_topics(topic, timeout=10).topics[topic]
        self.consumer.assign([TopicPartition(topic, p, 0) for p in meta.partitions])
        self.records: list = []

    def wait(self, count: int, timeout: float = 30.0) -> list:
        deadline = time.monotonic() + timeout
        while len(self.records) < count and time.monotonic() < deadline:
            msg = self.consumer.poll(0.2)
            if msg is not None and not msg.error():
                self.records.append(json.loads(msg.value()))
        return self.records

    def close(self):
        self.consumer.close()


@pytest.fixture
def io(kafka_config, tmp_path):
    procs = Procs(tmp_path)
    orders = Collector(kafka_config, kafka_config.topics.orders)
    dead = DeadLetters(kafka_config)
    yield procs, orders, dead
    procs.stop_all()
    orders.close()
    dead.close()


def acks(events, **match):
    return [e for e in events if isinstance(e, ev.Ack)
            and all(getattr(e, k) == v for k, v in match.items())]


@pytest.mark.slow
def test_forged_replayed_and_stale_orders_to_a_real_supervisor(kafka_config, tmp_path, io):
    procs, orders, dead = io
    script = write_child(tmp_path)
    log = tmp_path / "child.jsonl"
    env = {"TRAINGUARD_BOOTSTRAP": kafka_config.bootstrap,
           "TRAINGUARD_TOPIC_PREFIX": kafka_config.topics.prefix, KEY_ENV: KEY,
           "CHILD_LOG": str(log), "CHILD_MODE": "hang@3", "CHILD_STEPS": "200",
           "CHILD_STEP_S": "0.05"}  # after its relaunch, the child runs ~10 s more
    run = procs.trainguard("run", "run", "--job", "jo", "--max-restarts", "1",
                           "--checkpoint-dir", str(tmp_path / "ckpt"), "--grace", "1", "--",
                           PYTHON, str(script), env=env)
    wait_for(lambda: [e for e in read_log(log) if e["event"] == "hang"], timeout=30,
             what="the child's hang")
    assert KEY not in json.dumps([e for e in read_log(log) if e["event"] == "start"])
    now = time.time()
    other = SigningKeys.parse("not-the-key-of-this-deployment")
    good = ev.encode(sign(order(order_id="o-good", onset_ts=now), KEYS))
    forged = [
        ("unsigned", ev.encode(order(order_id="o-unsigned", onset_ts=now))),
        ("unknown_key", ev.encode(sign(order(order_id="o-other", onset_ts=now), other))),
        ("bad_signature", good.replace(b'"o-good"', b'"o-evil"')),
        ("stale", ev.encode(sign(order(order_id="o-stale", ts=now - 3600), KEYS))),
        ("future", ev.encode(sign(order(order_id="o-future", ts=now + 3600), KEYS))),
        ("invalid_target", ev.encode(sign(order(
            "evict", order_id="o-shell", nodes=["$(touch /tmp/pwned)", "--help", "n1"]), KEYS))),
    ]
    produce_raw(kafka_config, kafka_config.topics.orders, *[raw for _, raw in forged])
    rejected = orders.wait(lambda es: len(acks(es, status="rejected")) >= len(forged) and es,
                           timeout=30, what="the rejections")
    assert sorted(a.code for a in acks(rejected, status="rejected")) == \
        sorted(code for code, _ in forged)
    for a in acks(rejected):  # the supervisor signs its acks
        assert a.key_id == KEYS.key_id and len(a.sig) == 64
    records = dead.wait(len(forged))
    assert len(records) == len(forged), procs.log("run")[-2000:]
    assert all(r["topic"] == kafka_config.topics.orders and
               r["reason"].startswith("order refused: ") for r in records)
    assert len([e for e in read_log(log) if e["event"] == "start"]) == 1  # nothing obeyed

    produce_raw(kafka_config, kafka_config.topics.orders, good)
    orders.wait(lambda es: acks(es, order_id="o-good", status="done"), timeout=30,
                what="the signed order's ack")
    produce_raw(kafka_config, kafka_config.topics.orders, good)  # replayed
    orders.wait(lambda es: acks(es, order_id="o-good", status="rejected"), timeout=30,
                what="the replay's rejection")
    assert "replayed" in dead.wait(len(forged) + 1)[-1]["reason"]
    assert run.wait(timeout=90) == 0, procs.log("run")[-2000:]
    starts = [e for e in read_log(log) if e["event"] == "start"]
    assert len(starts) == 2 and starts[1]["exclude"] is None  # one relaunch, budget of 1 held
    assert "WARNING: no signing key" not in procs.log("run")


def test_the_action_service_signs_orders_and_refuses_forged_acks(kafka_config, tmp_path, io):
    _, orders, dead = io
    audit = Collector(kafka_config, kafka_config.topics.actions)
    stop = threading.Event()
    service, deadletter, close = build_service(kafka_config, Policy(), ServiceState(),
                                               stop=stop, log=lambda m: None, keys=KEYS)
    thread = threading.Thread(target=service.run_kafka, args=(kafka_config, stop, deadletter),
                              daemon=True)
    thread.start()
    try:
        now = time.time()
        produce(kafka_config, kafka_config.topics.anomalies, ev.Anomaly(
            job="jo", ts=now, id="c1", kind="crash", severity="critical", ranks=[1],
            nodes=["node-7"], onset_ts=now - 1, detected_ts=now, detector="crash",
            summary="rank 1 exited with code 1"))
        sent = orders.wait(lambda es: [e for e in es if isinstance(e, ev.Order)],
                           what="the order")[0]
        assert (sent.op, sent.incident, sent.key_id) == ("restart", "inc-c1", KEYS.key_id)
        planned = audit.wait(lambda es: [e for e in es if e.action == "restart"],
                             what="the planned record")[0]
        assert planned.status == "planned" and planned.extra["order_id"] == sent.order_id
        forged = ack_of(sent, "already_satisfied", "relaunched_since_onset", "forged", ts=now)
        produce(kafka_config, kafka_config.topics.orders, forged)
        records = dead.wait(1)
        assert records and "refused: unsigned" in records[0]["reason"]
        good = sign(ack_of(sent, "done", "relaunched", "relaunched as launch 1", ts=now), KEYS)
        produce(kafka_config, kafka_config.topics.orders, good)
        outcome = audit.wait(lambda es: [e for e in es if e.action == "restart"
                                         and e.status == "done"], what="the outcome")[0]
        assert outcome.extra["order_id"] == sent.order_id
        assert (outcome.extra["ack_status"], outcome.extra["code"]) == ("done", "relaunched")
        assert len(dead.wait(2, timeout=2)) == 1  # the good ack was not dead-lettered
    finally:
        stop.set()
        thread.join(15)
        close()
        audit.close()


@pytest.mark.slow
def test_a_command_flood_to_a_real_agent_gives_a_bounded_number_of_dumps(kafka_config,
                                                                         tmp_path, io):
    from trainguard.collectors.registry import Registry

    procs, _, dead = io
    stacks = Collector(kafka_config, kafka_config.topics.stacks)
    rank = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.1)"])
    try:
        Registry(tmp_path / "run").register({"job": "jf", "rank": 0, "local_rank": 0,
                                             "pid": rank.pid, "node": "n1",
                                             "start_time": time.time()})
        env = {KEY_ENV: KEY}
        agent = procs.trainguard("agent", "agent", "--bootstrap", kafka_config.bootstrap,
                                 "--prefix", kafka_config.topics.prefix, "--node", "n1",
                                 "--runtime-dir", str(tmp_path / "run"), "--interval", "5",
                                 env=env)
        wait_for(lambda: "listening for commands" in procs.log("agent"), timeout=60,
                 what=f"the agent: {procs.log('agent')[-500:]}")

        def command(i, signed):
            cmd = ev.Command(job="jf", ts=time.time(), command="capture_stacks",
                             capture_id=f"flood-{i}", ranks="all")
            return ev.encode(sign(cmd, KEYS) if signed else cmd)

        produce_raw(kafka_config, kafka_config.topics.commands,
                    *[command(i, signed=False) for i in range(1000)], key=b"jf")
        produce_raw(kafka_config, kafka_config.topics.commands,
                    *[command(1000 + i, signed=True) for i in range(200)], key=b"jf")
        assert len(dead.wait(1000, timeout=60)) == 1000, procs.log("agent")[-2000:]
        assert all("command refused: unsigned" in r["reason"] for r in dead.records)
        stacks.wait(lambda es: len(es) >= 6, timeout=60, what="the allowed dumps")
        time.sleep(3)  # whatever else the flood would cause has arrived by now
        dumps = stacks.drain(1.0)
        assert len(dumps) == 6  # CaptureLimits.per_job in its window, of 1,200 commands
        assert {e.capture_id for e in dumps} <= {f"flood-{1000 + i}" for i in range(200)}
        assert all(e.pid == rank.pid for e in dumps)
        assert agent.poll() is None
    finally:
        rank.kill()
        rank.wait(5)
        stacks.close()


def test_with_a_key_only_signed_audit_records_rebuild_the_ledger(kafka_config):
    """A forged `restart planned` on the audit log would use up a job's restart cap when the
    service reads the log back; with a key it is not read back."""
    from trainguard.actions.topic_io import read_back
    from trainguard.signing import Verifier

    now = time.time()
    record = ev.Action(job="jo", ts=now, incident="inc-x", action="restart", targets={},
                       status="planned", reason="x", extra={"source": "actions"})
    produce(kafka_config, kafka_config.topics.actions, record.replace(incident="inc-forged"),
            sign(record, KEYS))
    state = ServiceState()
    count = read_back(kafka_config, kafka_config.topics.actions, now - 60, state.absorb,
                      accept=lambda raw: Verifier(KEYS).check_signature(raw) is None)
    assert count == 1 and list(state.incidents) == ["inc-x"]
