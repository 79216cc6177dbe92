"""Throughput of ``trainguard worker`` on a large synthetic job, through the real broker.

The load is one job of RANKS ranks on MACHINES machines: per step a ``step`` and a
``heartbeat`` from every rank and a ``gpu`` sample from every machine (one rank NaNs at
STEPS - 10, so detection is checked at scale), all detectors on. Protocol, in one run:

1. ``events_per_s``: one worker on fresh topics; once it owns its partitions the whole
   load is produced as a burst (pre-encoded, lz4 like the collectors) and the worker must
   drain it: events / (time the last event reached a job stage - time the burst began).
   The load generator and the broker's ingest share this machine's two cores with it.
2. ``p99_lag_s``: then a paced load at PACED_RATE events/s (at most half the burst rate)
   for PACED_S seconds, each event stamped when sent; the 99th percentile of (job stage
   update time - event ts), from the worker's own histogram (upper bound of its bucket).
3. ``ceiling_events_per_s``: a raw confluent-kafka consume of the same telemetry topic.
4. ``events_per_s_backlog``: the load produced first, then one worker started on it, timed
   from its first consumed batch until everything went through both sides; this is how the
   ceiling is read too, with no producer or broker ingest competing (start-up not counted,
   but the first steps of 4,096 new rank stages are).
5. ``events_per_s_2_workers``: two workers with one id on fresh topics, the same burst as 1.
6. ``faust_take_events_per_s``: a bare Faust agent (``stream.take_events(10000, 0.2)``,
   no processing) on the same events: Faust's per-message ceiling on this machine.

``side_cpu_s`` splits the one worker's CPU seconds of the burst into its rank side and its
job side (the worker's own metrics); the rest is Kafka clients, Faust and the event loop.
``job_side_share`` is the job side's share of the worker's CPU: one job's job side runs on
one worker, so N workers can do at most ``1 / (share + (1 - share) / N)`` times what one does
for this one large job (``bound_scaling_2_workers``, Amdahl's law).

``events_per_worker_cpu_s`` divides by the CPU time the workers used: on this shared
2-core machine, with the broker and the load generator on the same cores, it moves far
less from run to run than the wall-clock rates (see ``load_average_at_start``). Two
workers cannot run faster than one on two cores that the broker and the load generator
use too; ``projected_scaling_2_workers`` (the one worker's CPU seconds over the busier of
the two's, for the same burst) says what they would do with a core each: the busier one,
which also holds the job side of this one large job, sets the pace.

The worker collects garbage every ``gc_interval_s`` (30 s); a burst of a few seconds may
hold no collection. ``events_per_s_gc_amortized`` charges the burst its share, from the
duration of the next collection after it (``gc_seconds_per_collection``).

Uses ``$TRAINGUARD_BOOTSTRAP`` or starts its own broker. Workers are killed at the end.
"""
from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from trainguard.streams.settings import WorkerSettings

RANKS, MACHINES, STEPS = 4096, 512, 30
PARTITIONS = 12
PACED_S = 8.0
PACED_RATE = 8000.0   # events/s of the lag phase: a 4096-rank job at about one step a second
FAUST_PROBE_EVENTS = 60_000
TIMEOUT_S = 120.0
GC_INTERVAL_S = WorkerSettings.gc_interval_s
TRAINGUARD = str(Path(sys.executable).with_name("trainguard"))
PROBE = Path(__file__).with_name("faust_take_probe.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step_messages(s: int, ts_of, nan_at=None, job: str = "big"):
    """One step of the synthetic job: ``(key, value)``; ``ts_of()`` stamps each event."""
    from trainguard import events as ev

    per_node = RANKS // MACHINES
    for r in range(RANKS):
        node = f"node{r // per_node:04d}"
        loss = math.nan if (s, r) == nan_at else 2.5 - s * 1e-3 + (r % 7) * 1e-4
        key = f"{job}/{r}".encode()
        ts = ts_of()
        yield key, ev.encode(ev.Step(
            job=job, ts=ts + (r % 13) * 1e-3, node=node, rank=r, step=s, step_time=0.5,
            compute_time=0.4 + (r % 5) * 1e-3, loss=loss, grad_norm=1.0, tokens=4096, lr=3e-4))
        yield key, ev.encode(ev.Heartbeat(
            job=job, ts=ts + 0.25, node=node, rank=r, pid=1000 + r, step=s,
            phase="forward", phase_since=ts + 0.01, dropped=0))
    for m in range(MACHINES):
        node = f"node{m:04d}"
        yield f"{job}/{node}".encode(), ev.encode(ev.Gpu(
            job=job, ts=ts_of() + 0.3, node=node, gpus=[
                {"index": g, "uuid": f"GPU-{m}-{g}", "util": 97.0, "temp": 60.0,
                 "power": 600.0, "ecc_sbe": 0, "ecc_dbe": 0, "pcie_replay": 0,
                 "nvlink_errors": 0, "throttle": []} for g in range(per_node)]))


def load(t0: float, first_step: int = 0, steps: int = STEPS, nan_at=None) -> list:
    """``(key, value)`` of the synthetic job, step-major, as the collectors would send:
    a lifecycle start of every rank, then per step a step and a heartbeat of every rank
    and a gpu sample of every machine."""
    from trainguard import events as ev

    out = []
    if first_step == 0:
        per_node = RANKS // MACHINES
        out += [(f"big/{r}".encode(), ev.encode(ev.Lifecycle(
            job="big", ts=t0 - 1.0, node=f"node{r // per_node:04d}", rank=r, event="start",
            pid=1000 + r, world_size=RANKS, local_rank=r % per_node))) for r in range(RANKS)]
    for s in range(first_step, first_step + steps):
        out += _step_messages(s, lambda: t0 + s * 0.5, nan_at)
    return out


class Worker:
    def __init__(self, config, worker_id: str, tmp: Path, extra: tuple = ()):
        self.port = _free_port()
        self.log = tmp / f"{worker_id}-{self.port}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [TRAINGUARD, "worker", "--bootstrap", config.bootstrap, "--prefix",
                 config.topics.prefix, "--id", worker_id, "--web-port", str(self.port),
                 "--data-dir", str(tmp / worker_id), "--loglevel", "warn", *extra],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def metrics(self) -> dict:
        from trainguard.streams.metrics import parse_exposition

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics",
                                        timeout=5) as reply:
                return parse_exposition(reply.read().decode())
        except OSError:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker died: {self.log.read_text()[-2000:]}") from None
            return {}

    def cpu_s(self) -> float:
        """CPU seconds this worker used so far (all threads)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _sum(workers, name: str) -> float:
    return sum(w.metrics().get(name, 0.0) for w in workers)


def _wait_ready(workers, config, partitions: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    tel = f'trainguard_assigned_partitions{{topic="{config.topics.telemetry}"}}'
    while time.monotonic() < deadline:
        got = [w.metrics() for w in workers]
        summ = [sum(v for k, v in m.items()
                    if k.startswith("trainguard_assigned_partitions") and "summaries" in k)
                for m in got]
        # every worker owns partitions of both sides: one that joined the summaries group
        # late would take half the jobs over in the middle of the run
        if all(m.get(tel, 0) > 0 for m in got) and sum(m.get(tel, 0) for m in got) == \
                partitions and sum(summ) == partitions and \
                sum(1 for n in summ if n) == min(len(workers), partitions):
            return
        time.sleep(0.5)
    raise RuntimeError("workers did not get their partitions")


def _produce(config, messages, pace_per_s: float | None = None) -> None:
    from confluent_kafka import Producer

    producer = Producer(config.kafka(**{"linger.ms": 20, "compression.type": "lz4",
                                        "partitioner": "murmur2_random",
                                        "queue.buffering.max.messages": 2_000_000,
                                        "batch.num.messages": 10000}))
    topic = config.topics.telemetry
    began = time.monotonic()
    for i, (key, value, *stamp) in enumerate(messages):    # stamp: [ms], or none: now
        if pace_per_s and i % 500 == 0:
            delay = began + i / pace_per_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        while True:
            try:
                producer.produce(topic, value, key, timestamp=stamp[0] if stamp else 0)
                break
            except BufferError:
                producer.poll(0.01)
        if i % 5000 == 0:
            producer.poll(0)
    producer.flush(60)


def _drain(workers, n: int) -> float:
    """Seconds until every event went through both sides of ``workers``."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        m = [w.metrics() for w in workers]
        events = sum(x.get("trainguard_events_in_total", 0) for x in m)
        out = sum(x.get("trainguard_summaries_out_total", 0) for x in m)
        inn = sum(x.get("trainguard_summaries_in_total", 0) for x in m)
        lag = sum(v for x in m for k, v in x.items() if k.startswith("trainguard_consumer_lag_messages"))
        if events >= n and inn >= out and lag == 0:
            return time.monotonic()
        time.sleep(0.1)
    raise RuntimeError(f"the workers did not drain the load in time: {events:.0f} of {n} "
                       f"events in, summaries out {out:.0f} / in {inn:.0f}, lag {lag:.0f}")


SIDES = ("rank", "job")


class Burst:
    """What one burst measured: ``rate`` events/s, ``lost``, CPU seconds of each worker
    (``cpu``, the process; ``sides``, each worker's ``{"rank": s, "job": s}`` from its
    metrics), the wall seconds it took, and how many scheduled garbage collections it held."""

    def __init__(self, n, seconds, lost, cpu, gc_runs, sides):
        self.n, self.seconds, self.lost, self.cpu = n, seconds, lost, cpu
        self.gc_runs = gc_runs
        self.sides = sides
        self.rate = n / seconds
        self.per_cpu = n / sum(cpu)

    def job_side_share(self) -> float:
        """The job side's share of the workers' CPU: what one job cannot spread."""
        return sum(s["job"] for s in self.sides) / sum(self.cpu)


def _sides(worker) -> dict:
    m = worker.metrics()
    return {side: m.get(f"trainguard_{side}_side_cpu_seconds_total", 0.0) for side in SIDES}


def _burst(config, workers, messages) -> Burst:
    """One burst of ``messages`` produced while ``workers`` run, timed from the first
    produce call until everything went through both sides."""
    before = _sum(workers, "trainguard_events_in_total")
    gc_before = _sum(workers, "trainguard_gc_collections_total")
    sides = [_sides(w) for w in workers]
    cpu = [w.cpu_s() for w in workers]
    began = time.monotonic()
    _produce(config, messages)
    done = _drain(workers, before + len(messages))
    cpu = [w.cpu_s() - c for w, c in zip(workers, cpu)]
    sides = [{k: v - s[k] for k, v in _sides(w).items()} for w, s in zip(workers, sides)]
    lost = int(before + len(messages) - _sum(workers, "trainguard_events_in_total"))
    return Burst(len(messages), done - began, lost, cpu,
                 _sum(workers, "trainguard_gc_collections_total") - gc_before, sides)


def _one_collection_s(worker) -> float | None:
    """Seconds of the worker's next scheduled garbage collection (its heap as the burst
    left it), waiting at most one interval for it."""
    runs = worker.metrics().get("trainguard_gc_collections_total", 0)
    spent = worker.metrics().get("trainguard_gc_seconds_total", 0)
    deadline = time.monotonic() + GC_INTERVAL_S + 5
    while time.monotonic() < deadline:
        m = worker.metrics()
        if m.get("trainguard_gc_collections_total", 0) > runs:
            return (m["trainguard_gc_seconds_total"] - spent) / (
                m["trainguard_gc_collections_total"] - runs)
        time.sleep(0.5)
    return None


def _with_gc_amortized(burst: Burst, per_collection_s: float | None) -> float:
    """The burst's rate had it held its share of collections (one every GC_INTERVAL_S):
    a burst shorter than the interval may have held none."""
    if per_collection_s is None:
        return burst.rate
    owed = burst.seconds / GC_INTERVAL_S - burst.gc_runs
    return burst.n / (burst.seconds + max(0.0, owed) * per_collection_s)


def _drain_backlog(workers, n: int) -> tuple[float, int, float]:
    """(events/s, lost, events per worker CPU second) of workers started on a topic that
    already holds ``n`` events, from their first consumed batch until everything went
    through both sides (the process start and the group join are not counted; the job side
    may still be finishing its own start-up then, and that is)."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        seen = _sum(workers, "trainguard_events_in_total")
        if seen > 0:
            began, cpu = time.monotonic(), sum(w.cpu_s() for w in workers)
            break
        if time.monotonic() > deadline:
            raise RuntimeError("the workers consumed nothing")
        time.sleep(0.02)
    done = _drain(workers, n)
    cpu = sum(w.cpu_s() for w in workers) - cpu
    lost = int(n - _sum(workers, "trainguard_events_in_total"))
    return (n - seen) / (done - began), lost, (n - seen) / cpu


def _ceiling(config, n: int) -> float:
    from confluent_kafka import Consumer

    consumer = Consumer(config.kafka(**{"group.id": f"ceiling-{uuid.uuid4().hex}",
                                        "auto.offset.reset": "earliest",
                                        "enable.auto.commit": False}))
    consumer.subscribe([config.topics.telemetry])
    got, began = 0, None
    deadline = time.monotonic() + TIMEOUT_S
    while got < n and time.monotonic() < deadline:
        batch = consumer.consume(10000, 1.0)
        if batch and began is None:
            began = time.monotonic()
        got += sum(1 for m in batch if not m.error())
    rate = got / (time.monotonic() - began)
    consumer.close()
    return rate


def _faust_probe(config, tmp: Path, messages) -> float | None:
    """Faust's own rate on an uncompressed copy of the first messages (aiokafka cannot read
    the collectors' lz4 without the cramjam package)."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"{config.topics.prefix}.probe"
    admin = AdminClient(config.kafka())
    admin.create_topics([NewTopic(topic, num_partitions=PARTITIONS,
                                  replication_factor=-1)])[topic].result()
    producer = Producer(config.kafka(**{"linger.ms": 20, "partitioner": "murmur2_random",
                                        "queue.buffering.max.messages": 1_000_000}))
    for key, value in messages[:FAUST_PROBE_EVENTS]:
        producer.produce(topic, value, key)
    producer.flush(60)
    env = {**os.environ, "PROBE_BROKER": config.faust_broker(),
           "PROBE_TOPIC": topic, "PROBE_EVENTS": str(FAUST_PROBE_EVENTS),
           "PROBE_DATADIR": str(tmp / "probe"), "PROBE_APP": f"probe-{uuid.uuid4().hex[:8]}"}
    proc = subprocess.Popen([sys.executable, str(PROBE), "worker", "-l", "warn"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return None
    for line in out.decode(errors="replace").splitlines():
        if "RATE " in line:                 # Faust's worker logs what the probe prints
            return float(line.split("RATE ")[1].split()[0])
    return None


def _anomalies(config) -> list:
    from confluent_kafka import Consumer, TopicPartition

    from trainguard import events as ev

    consumer = Consumer(config.kafka(**{"group.id": uuid.uuid4().hex}))
    meta = consumer.list_topics(timeout=10).topics[config.topics.anomalies]
    consumer.assign([TopicPartition(config.topics.anomalies, p, 0) for p in meta.partitions])
    out = []
    for _ in range(4):
        out += [ev.decode(m.value()) for m in consumer.consume(1000, 0.5) if not m.error()]
    consumer.close()
    return out


def _loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError):
        return -1.0


def _fresh_config(bootstrap: str):
    from trainguard.config import Config, Topics
    from trainguard.topics import TopicPlan, create_topics

    config = Config(bootstrap=bootstrap, topics=Topics(prefix=f"b{uuid.uuid4().hex[:10]}"))
    create_topics(config, TopicPlan(telemetry_partitions=PARTITIONS, other_partitions=2))
    return config


def _p99_lag(worker, config, rate: float) -> float | None:
    """Paced load, each event stamped when it is sent; the 99th percentile of the worker's
    lag histogram (job stage update time - event ts) over it."""
    from trainguard.streams.metrics import LAG_BUCKETS, Metrics

    def buckets():
        m = worker.metrics()
        cum = [m.get(f'trainguard_event_lag_seconds_bucket{{le="{b}"}}', 0)
               for b in LAG_BUCKETS] + [m.get('trainguard_event_lag_seconds_bucket{le="+Inf"}', 0)]
        return [c - (cum[i - 1] if i else 0) for i, c in enumerate(cum)]

    before = buckets()
    per_step = 2 * RANKS + MACHINES
    steps = max(1, int(rate * PACED_S / per_step))

    def messages():           # another job: the burst's job has been quiet for a while
        for s in range(steps):
            yield from _step_messages(s, time.time, job="live")

    _produce(config, messages(), pace_per_s=rate)
    _drain([worker], 0)
    time.sleep(1.0)
    after = buckets()
    return Metrics().lag_quantile(0.99, [a - b for a, b in zip(after, before)])


def run() -> dict:
    from trainguard.broker import free_port, local_broker

    bootstrap = os.environ.get("TRAINGUARD_BOOTSTRAP")
    broker = None
    tmp = Path(tempfile.mkdtemp(prefix="tg-bench-stream-"))
    if not bootstrap:
        broker = local_broker(port=free_port(), data=tmp / "broker")
        broker.start(log=lambda m: None)
        bootstrap = broker.bootstrap
    workers = []
    load_before = _loadavg()
    try:
        messages = load(time.time(), nan_at=(STEPS - 10, 1234))
        n = len(messages)

        config = _fresh_config(bootstrap)
        workers = [Worker(config, "one", tmp)]
        _wait_ready(workers, config, PARTITIONS)
        one = _burst(config, workers, messages)
        rate1, lost1 = one.rate, one.lost
        per_collection_s = _one_collection_s(workers[0])
        paced = min(rate1 / 2, PACED_RATE)
        p99 = _p99_lag(workers[0], config, paced)
        found = _anomalies(config)
        for w in workers:
            w.stop()
        ceiling = _ceiling(config, n)
        faust = _faust_probe(config, tmp, messages)

        config_b = _fresh_config(bootstrap)
        _produce(config_b, messages)
        workers = [Worker(config_b, "backlog", tmp)]
        backlog, lost_b, _ = _drain_backlog(workers, n)
        workers[0].stop()

        config2 = _fresh_config(bootstrap)
        workers = [Worker(config2, "pair", tmp), Worker(config2, "pair", tmp)]
        _wait_ready(workers, config2, PARTITIONS)
        two = _burst(config2, workers, messages)
        rate2, lost2 = two.rate, two.lost
        for w in workers:
            w.stop()
        nan = [a for a in found if a.kind == "nan"]
        share = one.job_side_share()
        return {
            "events_per_s": round(rate1), "ceiling_events_per_s": round(ceiling),
            "lost": max(0, lost1) + max(0, lost_b) + max(0, lost2), "p99_lag_s": p99,
            "workers": 1, "events_per_s_backlog": round(backlog),
            "events_per_s_2_workers": round(rate2), "scaling_2_workers": round(rate2 / rate1, 2),
            "fraction_of_ceiling": round(rate1 / ceiling, 3),
            "events_per_s_gc_amortized": round(_with_gc_amortized(one, per_collection_s)),
            "gc_collections_in_burst": one.gc_runs,
            "gc_seconds_per_collection": (round(per_collection_s, 3)
                                          if per_collection_s is not None else None),
            "events_per_worker_cpu_s": round(one.per_cpu),
            "events_per_worker_cpu_s_2_workers": round(two.per_cpu),
            "worker_cpu_s_2_workers": [round(c, 2) for c in two.cpu],
            "projected_scaling_2_workers": round(sum(one.cpu) / max(two.cpu), 2),
            "side_cpu_s": {side: round(one.sides[0][side], 2) for side in SIDES},
            "side_cpu_s_2_workers": [{side: round(x[side], 2) for side in SIDES}
                                     for x in two.sides],
            "job_side_share": round(share, 3),
            "bound_scaling_2_workers": round(1 / (share + (1 - share) / 2), 2),
            "load_average_at_start": load_before,
            "faust_take_events_per_s": round(faust) if faust else None,
            "p99_lag_at_events_per_s": round(paced),
            "events": n, "ranks": RANKS, "machines": MACHINES, "steps": STEPS,
            "partitions": PARTITIONS, "cpus": len(os.sched_getaffinity(0)),
            "nan_found": bool(nan) and nan[0].ranks == [1234],
            "anomaly_kinds": sorted({a.kind for a in found}),
            "targets": {"events_per_s": 50000, "fraction_of_ceiling": 0.5,
                        "scaling_2_workers": 1.8},
        }
    finally:
        for w in workers:
            w.stop()
        if broker is not None:
            broker.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=2))
