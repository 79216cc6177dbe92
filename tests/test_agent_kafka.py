"""``trainguard agent`` as a real process on the real broker: GPU samples where there is no
GPU, kernel-log Xids, and a real stack capture of a running 4-rank torchrun gloo job."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trainguard import events as ev

pytestmark = [pytest.mark.broker, pytest.mark.slow]

VENV = Path(sys.executable).parent
TRAINGUARD = str(VENV / "trainguard")
XID_LINE = ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, "
            "GPU has fallen off the bus.\n")
RANK_SCRIPT = '''
import sys, time
from pathlib import Path
import torch.distributed as dist
import trainguard

def load_batch(marker):
    marker.write_text("ready")
    while True:
        time.sleep(0.1)

def main():
    run = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    trainguard.init(job="j1", node="n1", runtime_dir=run)
    marker = run / f"ready.{rank}"
    if rank == 2:
        load_batch(marker)
    marker.write_text("ready")
    dist.barrier()

main()
'''


class Reader:
    """Decoded events of a topic from its beginning, read in a background thread."""

    def __init__(self, config, topic: str):
        from confluent_kafka import Consumer, TopicPartition

        self.consumer = Consumer(config.kafka(**{"group.id": "unused",
                                                 "enable.auto.commit": False}))
        meta = self.consumer.list_topics(topic, timeout=10).topics[topic]
        self.consumer.assign([TopicPartition(topic, p, 0) for p in meta.partitions])
        self.events: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            msg = self.consumer.poll(0.2)
            if msg is not None and not msg.error():
                self.events.append(ev.decode(msg.value()))  # the agent sends only valid ones

    def wait(self, predicate, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in list(self.events) if predicate(e)]
            if found:
                return found
            time.sleep(0.05)
        return []

    def close(self):
        self._stop.set()
        self._thread.join(2)
        self.consumer.close()


def start_agent(config, tmp_path: Path, *extra: str) -> tuple:
    argv = [TRAINGUARD, "agent", "--bootstrap", config.bootstrap, "--prefix",
            config.topics.prefix, "--node", "n1", "--runtime-dir", str(tmp_path / "run"),
            "--interval", "0.5", *extra]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines: list = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    return proc, lines


def stop_process(proc, sig=signal.SIGTERM, wait: float = 10.0):
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


def descendants(pid: int) -> list:
    """Pids of every process below ``pid`` (torchrun starts each worker in its own session,
    so killing torchrun's process group leaves the workers running)."""
    children: dict = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            ppid = int(text[text.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_tree(proc) -> None:
    for pid in descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_no_gpu_sample_and_a_kernel_log_xid(kafka_config, tmp_path):
    kmsg = tmp_path / "kmsg.log"
    kmsg.write_text("")
    reader = Reader(kafka_config, kafka_config.topics.telemetry)
    agent, lines = start_agent(kafka_config, tmp_path, "--job", "j1", "--kmsg-extra", str(kmsg))
    try:
        gpu = reader.wait(lambda e: e.type == "gpu", timeout=20)
        assert gpu, f"no gpu event; agent said: {''.join(lines)}"
        assert (gpu[0].job, gpu[0].node, gpu[0].rank) == ("j1", "n1", None)
        assert gpu[0].status == "unavailable" and gpu[0].gpus == [] and gpu[0].reason
        with open(kmsg, "a") as fh:
            fh.write(XID_LINE)
        xid = reader.wait(lambda e: e.type == "xid", timeout=10)
        assert xid, f"no xid event; agent said: {''.join(lines)}"
        assert (xid[0].xid, xid[0].source, xid[0].gpu, xid[0].job, xid[0].node) == \
            (79, "kmsg", None, "j1", "n1")
        assert xid[0].message == "pid=1234, name=python, GPU has fallen off the bus."
        # several sample periods have passed: "unavailable" was still sent only once
        assert len([e for e in reader.events if e.type == "gpu"]) == 1
        assert stop_process(agent) == 0
        assert any("stopped" in line for line in lines)
    finally:
        stop_process(agent, signal.SIGKILL)
        reader.close()


def test_the_agent_sends_the_new_gpu_counters_and_the_host_object(kafka_config, tmp_path):
    """The agent's real loop (Kafka producer, sampler, PCIe reader thread) with the fake NVML
    and /proc fixture files: what machine_outlier reads arrives on the telemetry topic."""
    from fakes_nvml import hgx_node
    from test_agent import write_proc
    from trainguard.collectors.agent import Agent
    from trainguard.collectors.nvml import PynvmlSource

    write_proc(tmp_path)
    fake = hgx_node("H200", n=2, unsupported={("clock", 2)})     # no memory clock here
    agent = Agent(config=kafka_config, node="n1", job="j1", interval=0.2,
                  runtime_dir=tmp_path / "run", source=PynvmlSource(lib=fake), kmsg_path=None,
                  dmesg_argv=[], proc_root=tmp_path)
    reader = Reader(kafka_config, kafka_config.topics.telemetry)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    thread.start()
    try:
        first = reader.wait(lambda e: e.type == "gpu", timeout=20)
        assert first and first[0].host["tcp_out_segs"] == 1_190_007
        write_proc(tmp_path, user=1400, idle=8400, retrans=990)    # 50% busy since
        later = reader.wait(lambda e: e.type == "gpu" and e.host
                            and e.host.get("tcp_retrans") == 990
                            and "cpu_util" in e.host, timeout=20)
        assert later and later[0].host["cpu_util"] == 50.0
        g = later[0].gpus[1]
        assert (g["power_limit"], g["pcie_tx_kbs"], g["pcie_rx_kbs"]) == (
            700.0, 1_250_000, 3_400_000)
        assert "mem_clock" not in g and g["sm_clock"] == 1980
        assert agent.source._pcie_thread is not None      # PCIe read off the sample path
    finally:
        stop.set()
        thread.join(15)
        reader.close()
    assert not thread.is_alive() and not fake.initialized


def test_real_stack_capture_of_a_4_rank_gloo_job(kafka_config, tmp_path):
    from confluent_kafka import Producer

    run = tmp_path / "run"
    run.mkdir()
    script = tmp_path / "train_hang.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "TRAINGUARD_BOOTSTRAP": kafka_config.bootstrap,
           "TRAINGUARD_TOPIC_PREFIX": kafka_config.topics.prefix, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", "4", str(script), str(run)],
                           env=env, cwd=tmp_path, start_new_session=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    from trainguard.broker import free_port

    metrics_port = free_port()
    agent, lines = start_agent(kafka_config, tmp_path, "--metrics-port", str(metrics_port))
    stacks = Reader(kafka_config, kafka_config.topics.stacks)
    producer = Producer(kafka_config.kafka())
    try:
        assert wait_until(lambda: len(list(run.glob("ready.*"))) == 4, 60), \
            f"the job did not start; agent said: {''.join(lines)}"
        assert wait_until(lambda: any("listening for commands" in l for l in lines), 20), \
            f"agent not listening; it said: {''.join(lines)}"

        def send(**fields):
            command = ev.Command(**{"job": "j1", "ts": time.time(), "command": "capture_stacks",
                                    "ranks": "all", **fields})
            producer.produce(kafka_config.topics.commands, ev.encode(command), b"j1")

        producer.produce(kafka_config.topics.commands, b"\xff not an event", b"j1")
        send(job="j2", capture_id="c-other-job")
        send(node="n2", capture_id="c-other-node")
        send(capture_id="c-real")
        producer.flush(10)
        assert wait_until(lambda: len([e for e in stacks.events
                                       if e.capture_id == "c-real"]) == 4, 30), \
            f"stacks: {[(e.capture_id, e.rank) for e in stacks.events]}; agent: {''.join(lines)}"
        time.sleep(0.5)  # anything the other commands would have caused has arrived by now
        assert {e.capture_id for e in stacks.events} == {"c-real"}
        by_rank = {e.rank: e for e in stacks.events}
        assert sorted(by_rank) == [0, 1, 2, 3]
        for rank, event in by_rank.items():
            assert (event.type, event.job, event.node) == ("stack", "j1", "n1")
            assert event.method == "py-spy" and event.error is None, event.error
            files = {f["file"] for t in event.threads for f in t["frames"]}
            assert str(script) in files or script.name in {Path(f).name for f in files}
        functions = lambda e: {f["function"] for t in e.threads for f in t["frames"]}
        assert "load_batch" in functions(by_rank[2])
        assert all("load_batch" not in functions(by_rank[r]) for r in (0, 1, 3))
        assert agent.poll() is None  # the garbage message did not stop it
        from test_service_metrics import scrape

        assert scrape(metrics_port)['trainguard_stack_captures_total{status="ok"}'] == 4
    finally:
        kill_tree(job)
        stop_process(agent)
        stacks.close()
