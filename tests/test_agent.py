"""The node agent's pure parts, without Kafka: command addressing, stack answers, the GPU
sample loop on the fake NVML, and the Xid paths (NVML event thread, kernel-log file)."""
from __future__ import annotations

import threading
import time

import pynvml
import pytest

from trainguard import events as ev
from trainguard.collectors import agent as agent_mod
from trainguard.collectors.agent import Agent, GpuSampler, Publisher, event_jobs
from trainguard.collectors.agent_commands import (CaptureRunner, CommandHandler, address,
                                                  stack_event)
from trainguard.collectors.capture_limits import CaptureLimiter, CaptureLimits
from trainguard.signing import SigningKeys, Verifier, sign
from trainguard.collectors.nvml import PynvmlSource
from trainguard.config import Config, Topics

from fakes_nvml import FakePynvml, hgx_node

NOW = 1_764_680_000.0
#: the registered ranks' first pid: above Linux's largest (PID_MAX_LIMIT, 2**22), so never a
#: live process here, which address() would take for a reused pid (this machine's pid_max is
#: 32768: a busy run wraps around to 1000 and beyond)
PID0 = 2**22 + 1000
FRAMES = [{"function": "load_batch", "file": "/x/train.py", "line": 7},
          {"function": "<module>", "file": "/x/train.py", "line": 20}]


def ranks(job="j1", node="n1", count=4, **extra):
    return [{"job": job, "rank": r, "local_rank": r, "pid": PID0 + r, "node": node,
             "start_time": NOW - 60, **extra} for r in range(count)]


def command(**changes) -> ev.Command:
    fields = dict(job="j1", ts=NOW, command="capture_stacks", capture_id="c1", ranks="all")
    fields.update(changes)
    return ev.Command(**fields)


def roundtrip(event: ev.Event) -> ev.Event:
    return ev.decode(ev.encode(event))


# -- addressing ----------------------------------------------------------------------------
def test_all_ranks_of_the_job_on_this_node():
    targets, why = address(command(), "n1", ranks() + ranks(job="j2"))
    assert why is None and [(e["job"], e["rank"]) for e in targets] == [("j1", r) for r in range(4)]


@pytest.mark.parametrize("changes, reason", [
    ({"job": "j2"}, "no local rank of job j2"),
    ({"node": "elsewhere"}, "addressed to node elsewhere"),
    ({"ranks": [7, 8]}, "none of ranks [7, 8] runs here"),
])
def test_commands_not_for_this_agent_are_ignored(changes, reason):
    targets, why = address(command(**changes), "n1", ranks())
    assert targets == [] and why.startswith(reason)


def test_node_may_be_the_agents_name_or_the_ranks_own():
    entries = ranks(node="gpu-host-7")
    for node in (None, "agent-name", "gpu-host-7"):
        targets, why = address(command(node=node), "agent-name", entries)
        assert why is None and len(targets) == 4


def test_rank_list_selects_local_ranks_only():
    targets, _ = address(command(ranks=[3, 1, 12]), "n1", ranks())
    assert [e["rank"] for e in targets] == [1, 3]


def test_malformed_entries_and_reused_pids_are_skipped():
    entries = ranks() + [{"job": "j1", "rank": "x", "pid": 5}, {"job": "j1", "rank": 9},
                         "not a dict"]
    started = {PID0: NOW - 70, PID0 + 1: NOW - 10, PID0 + 2: NOW + 3600, PID0 + 3: None}
    targets, why = address(command(), "n1", entries, started_at=lambda pid: started.get(pid))
    assert why is None and [e["rank"] for e in targets] == [0, 1, 3]  # rank 2: a new process


def test_only_the_enumerated_command_form_is_obeyed():
    assert address(ev.Heartbeat(job="j1", ts=NOW, pid=1, phase="idle", phase_since=NOW),
                   "n1", ranks())[0] == []


# -- the handler ---------------------------------------------------------------------------
class FakeRunner:
    max_pending = 8

    def __init__(self, accept=True):
        self.accept = accept
        self.got = []

    def submit(self, cmd, entries):
        self.got.append((cmd, entries))
        return self.accept


def test_handler_accepts_ignores_and_never_raises():
    runner = FakeRunner()
    handler = CommandHandler(node="n1", entries=lambda: ranks(), runner=runner,
                             clock=lambda: NOW + 1)
    ok = ev.encode(command(capture_id="c-ok"))
    assert handler.handle(ok) == "accepted"
    assert handler.handle(ok) == "duplicate"
    assert handler.handle(ev.encode(command(job="j2"))) == "ignored"
    shell = ev.to_dict(command(capture_id="c-x"))
    shell["command"] = "sh -c 'rm -rf /'"
    for bad in (b"\xff\xfe", b"[]", b'{"v":1}', None, ev.dumps(shell).encode(),
                ev.encode(ev.Heartbeat(job="j1", ts=NOW, pid=1, phase="idle", phase_since=NOW))):
        assert handler.handle(bad) == "invalid"
    assert [(c.capture_id, len(e)) for c, e in runner.got] == [("c-ok", 4)]


KEYS = SigningKeys.parse("agent-test-key-0123456789abcdef")


def test_handler_refuses_stale_future_forged_and_dead_letters_them():
    runner, dead = FakeRunner(), []
    handler = CommandHandler(
        node="n1", entries=lambda: ranks(), runner=runner, clock=lambda: NOW,
        verifier=Verifier(KEYS, clock=lambda: NOW),
        deadletter=lambda value, reason, msg: dead.append(reason))
    cases = {"unsigned": command(capture_id="c-unsigned"),
             "bad_signature": sign(command(capture_id="c-bad"), KEYS).replace(ranks=[0]),
             "unknown_key": sign(command(capture_id="c-k"),
                                 SigningKeys.parse("some-other-key-0123456789")),
             "stale": sign(command(capture_id="c-old", ts=NOW - 600), KEYS),
             "future": sign(command(capture_id="c-future", ts=NOW + 3600), KEYS)}
    for code, cmd in cases.items():
        assert handler.handle(ev.encode(cmd)) == "refused", code
        assert dead[-1].startswith(f"command refused: {code}")
    assert handler.handle(ev.encode(sign(command(job="j2"), KEYS))) == "ignored"  # not ours
    good = ev.encode(sign(command(capture_id="c-good"), KEYS))
    assert handler.handle(good) == "accepted" and handler.handle(good) == "duplicate"
    assert [c.capture_id for c, _ in runner.got] == ["c-good"] and len(dead) == len(cases)


def test_a_flood_of_commands_gives_a_bounded_number_of_captures():
    runner = FakeRunner()
    clock = {"now": NOW}
    handler = CommandHandler(node="n1", entries=lambda: ranks(), runner=runner,
                             clock=lambda: clock["now"],
                             limiter=CaptureLimiter(CaptureLimits(per_job=3, per_machine=5,
                                                                  window_s=60)))
    words = []
    for i in range(1000):  # 1,000 in 20 s, each with a new capture id
        clock["now"] = NOW + i * 0.02
        words.append(handler.handle(ev.encode(command(capture_id=f"c{i}", ts=clock["now"]))))
    assert words.count("accepted") == 3 and words.count("rate_limited") == 997
    clock["now"] = NOW + 61
    assert handler.handle(ev.encode(command(capture_id="later", ts=clock["now"]))) == "accepted"


def test_one_capture_per_pid_at_a_time():
    started, release = threading.Event(), threading.Event()

    def capture(pid, native, timeout, runtime_dir, signum):
        started.set()
        release.wait(5)
        return {"pid": pid, "method": "py-spy", "error": None, "threads": []}

    published = []
    runner = CaptureRunner(published.append, node="n1", runtime_dir=None, capture=capture,
                           clock=lambda: NOW)
    first = threading.Thread(target=runner.run, args=(command(capture_id="c1"), ranks()[:1]))
    first.start()
    assert started.wait(5)
    second = runner.run(command(capture_id="c2"), ranks()[:1])  # the same pid, meanwhile
    release.set()
    first.join(5)
    assert second[0].error.startswith(f"busy: a capture of pid {PID0}")
    assert [e.error for e in published if e.capture_id == "c1"] == [None]


def test_handler_survives_a_broken_registry_and_a_full_runner():
    def broken():
        raise OSError("disk gone")

    assert CommandHandler(node="n1", entries=broken, runner=FakeRunner(),
                          clock=lambda: NOW).handle(ev.encode(command())) == "ignored"
    assert CommandHandler(node="n1", entries=ranks, runner=FakeRunner(accept=False),
                          clock=lambda: NOW).handle(ev.encode(command())) == "dropped"


# -- stack answers -------------------------------------------------------------------------
def test_stack_event_is_contract_valid_and_keeps_the_fallback_reason():
    result = {"pid": 1002, "method": "inproc", "error": None,
              "fallback_reason": "py-spy dump failed (1): Permission denied",
              "threads": [{"name": "MainThread", "id": 1, "active": True, "frames": FRAMES,
                           "native_id": 77}]}
    event = roundtrip(stack_event(command(), ranks()[2], result, "agent-node", ts=NOW))
    assert (event.rank, event.node, event.pid, event.method) == (2, "n1", 1002, "inproc")
    assert event.extra == {"fallback_reason": result["fallback_reason"], "local_rank": 2}
    assert event.threads[0]["frames"][0]["function"] == "load_batch"


def test_failed_capture_reports_the_error_and_the_agents_node():
    entry = {"job": "j1", "rank": 5, "pid": 99}
    result = {"pid": 99, "method": "py-spy", "threads": [], "error": "process 99 has exited"}
    event = roundtrip(stack_event(command(), entry, result, "n7", ts=NOW))
    assert (event.node, event.error, event.threads) == ("n7", "process 99 has exited", [])


def test_huge_stacks_are_cut_to_fit_one_message():
    frame = {"function": "f" * 200, "file": "/very/long/path/" * 10, "line": 1}
    threads = [{"name": f"t{i}", "id": i, "active": False, "frames": [frame] * 500}
               for i in range(20)]
    result = {"pid": 1000, "method": "py-spy", "threads": threads, "error": None}
    event = stack_event(command(), ranks()[0], result, "n1", ts=NOW, max_bytes=200_000)
    assert len(ev.encode(event)) <= 200_000 and event.extra["truncated"] is True
    assert len(event.threads) == 20 and 0 < len(event.threads[0]["frames"]) < 500
    roundtrip(event)


def test_runner_captures_every_rank_in_parallel_and_survives_a_failing_capture():
    barrier = threading.Barrier(4, timeout=5)  # all four captures must run at once
    calls = []

    def capture(pid, native, timeout, runtime_dir, signum):
        calls.append((pid, native, runtime_dir))
        barrier.wait()
        if pid == PID0 + 3:
            raise RuntimeError("boom")
        return {"pid": pid, "method": "py-spy", "error": None,
                "threads": [{"name": "MainThread", "id": 1, "active": True, "frames": FRAMES}]}

    published = []
    runner = CaptureRunner(published.append, node="n1", runtime_dir="/run/tg", capture=capture,
                           clock=lambda: NOW)
    out = runner.run(command(native=True), ranks())
    assert sorted(e.rank for e in published) == [0, 1, 2, 3] and len(out) == 4
    assert all(native and rd == "/run/tg" for _, native, rd in calls)
    errors = {e.rank: e.error for e in published}
    assert errors[3].startswith("stack capture failed: RuntimeError") and errors[0] is None
    for event in published:
        roundtrip(event)


# -- GPU samples ---------------------------------------------------------------------------
def test_gpu_samples_from_the_fake_nvml_are_contract_valid():
    fake = hgx_node("H200")
    fake.gpus[3].clock_reasons = pynvml.nvmlClocksThrottleReasonHwThermalSlowdown
    ready = []
    sampler = GpuSampler(PynvmlSource(lib=fake), node="n1", on_available=lambda: ready.append(1))
    for t in range(3):
        events = sampler.tick(["j1", "j2"], now=NOW + t)
        assert [e.job for e in events] == ["j1", "j2"]
        for event in events:
            back = roundtrip(event)
            assert back.type == "gpu" and back.rank is None and back.node == "n1"
            assert back.status is None and len(back.gpus) == 8
    assert ready == [1]
    gpu3 = back.gpus[3]
    assert gpu3["throttle"] == ["hw_thermal"] and gpu3["mem_total"] == fake.gpus[3].mem_total
    assert {"util", "temp", "power", "sm_clock", "ecc_dbe", "nvlink_errors",
            "remapped_failure", "pcie_replay"} <= set(gpu3)


def test_lost_gpu_and_nvml_that_comes_and_goes():
    fake = FakePynvml(hgx_node(n=2).gpus, init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    ready = []
    sampler = GpuSampler(PynvmlSource(lib=fake), node="n1", unavailable_interval=60,
                         on_available=lambda: ready.append(1))
    first = sampler.tick(["j1"], now=NOW)
    assert [roundtrip(e).status for e in first] == ["unavailable"]
    assert "driver is not loaded" in first[0].reason and first[0].gpus == []
    assert sampler.tick(["j1"], now=NOW + 1) == [] and ready == []
    fake.init_error = None  # the driver is loaded: seen at the next retry
    assert sampler.tick(["j1"], now=NOW + 30) == []
    assert len(roundtrip(sampler.tick(["j1"], now=NOW + 61)[0]).gpus[1]) > 3
    fake.gpus[1].lost = True
    back = roundtrip(sampler.tick(["j1"], now=NOW + 62)[0])
    assert back.status is None and back.gpus[1] == {"index": 1, "uuid": fake.gpus[1].uuid,
                                                    "lost": True}
    assert ready == [1]


# -- host counters (/proc) -----------------------------------------------------------------
PROC_STAT = """cpu  {user} 120 {system} {idle} 1769 0 1450 {steal} 0 0
cpu0 145250 0 22401 134362 602 0 475 237 0 0
intr 1 2 3
ctxt 99
"""
NET_DEV = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed
    lo: 982259626 1111808    0    0    0     0          0         0 982259626 1111808    0    0    0     0       0          0
  eth0: {eth0_rx}  153430    0    0    0     0          0         0  {eth0_tx}   79847    0    0    0     0       0          0
  ib0: {ib0_rx} 10 0 0 0 0 0 0 {ib0_tx} 10 0 0 0 0 0 0
"""
SNMP = """Ip: Forwarding DefaultTTL InReceives
Ip: 2 64 1265159
Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors
Tcp: 1 200 120000 -1 52601 5059 47458 1349 12 1264475 {out} {retrans} 0 48844 0
Udp: InDatagrams NoPorts
Udp: 5 6
"""


def write_proc(root, *, user=1000, system=500, idle=8000, steal=0, eth0=(7_000, 6_000),
               ib0=(10**12, 2 * 10**12), out=1_190_007, retrans=981):
    (root / "proc" / "net").mkdir(parents=True, exist_ok=True)
    (root / "proc" / "stat").write_text(PROC_STAT.format(user=user, system=system, idle=idle,
                                                         steal=steal))
    (root / "proc" / "net" / "dev").write_text(NET_DEV.format(
        eth0_rx=eth0[0], eth0_tx=eth0[1], ib0_rx=ib0[0], ib0_tx=ib0[1]))
    (root / "proc" / "net" / "snmp").write_text(SNMP.format(out=out, retrans=retrans))


def test_host_counters_from_proc_files(tmp_path):
    from trainguard.collectors.host import HostCounters

    write_proc(tmp_path)
    host = HostCounters(tmp_path)
    first = host.sample()
    assert first == {"net_rx_bytes": 10**12 + 7_000, "net_tx_bytes": 2 * 10**12 + 6_000,
                     "tcp_retrans": 981, "tcp_out_segs": 1_190_007}   # lo is not counted
    # one second later: 4 CPUs 60% busy (steal counts as busy, iowait does not)
    write_proc(tmp_path, user=1000 + 200, system=500 + 20, steal=20, idle=8000 + 160,
               eth0=(7_000 + 5_000_000, 6_000 + 1_000), out=1_190_007 + 1000,
               retrans=981 + 7)
    second = host.sample()
    assert second["cpu_util"] == 60.0
    assert second["net_rx_bytes"] - first["net_rx_bytes"] == 5_000_000
    assert (second["tcp_retrans"] - first["tcp_retrans"],
            second["tcp_out_segs"] - first["tcp_out_segs"]) == (7, 1000)
    # the consumer turns two samples into bytes/s and retransmits per segment sent
    from trainguard.detectors.machine_outlier import FEATURES, MachineVector

    mv = MachineVector()
    mv.vector(100.0, [], first)
    x = mv.vector(101.0, [], second)
    assert x[FEATURES.index("host_cpu")] == 60.0
    assert x[FEATURES.index("net_bytes_rate")] == 5_001_000.0
    assert x[FEATURES.index("tcp_retrans")] == 0.007


def test_host_counters_leave_out_what_cannot_be_read_and_say_it_once(tmp_path, caplog):
    import logging

    from trainguard.collectors.host import HostCounters

    write_proc(tmp_path)
    (tmp_path / "proc" / "net" / "snmp").write_text("Ip: a\nIp: 1\n")       # no Tcp lines
    (tmp_path / "proc" / "net" / "dev").unlink()
    host = HostCounters(tmp_path)
    with caplog.at_level(logging.WARNING, logger="trainguard.collectors.host"):
        for _ in range(3):
            assert host.sample() is None        # /proc/stat unchanged: no interval to judge
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and any("cannot read" in m and "net/dev" in m for m in said)
    assert any("cannot parse" in m and "snmp" in m for m in said)
    assert HostCounters(tmp_path / "nowhere").sample() is None


def test_host_network_counters_prefer_process_1s_namespace(tmp_path):
    """In a pod with hostPID, /proc/1/net is the machine's network; /proc/net the pod's."""
    from trainguard.collectors.host import HostCounters

    write_proc(tmp_path, eth0=(1, 2), ib0=(0, 0), retrans=5)       # the agent's own
    machine = tmp_path / "proc" / "1" / "net"
    machine.mkdir(parents=True)
    (machine / "dev").write_text(NET_DEV.format(eth0_rx=10, eth0_tx=20, ib0_rx=300,
                                                ib0_tx=400))
    (machine / "snmp").write_text(SNMP.format(out=77, retrans=7))
    assert HostCounters(tmp_path).sample() == {"net_rx_bytes": 310, "net_tx_bytes": 420,
                                               "tcp_retrans": 7, "tcp_out_segs": 77}


def test_gpu_events_carry_the_host_object_and_stay_contract_valid(tmp_path):
    from trainguard.collectors.host import HostCounters

    write_proc(tmp_path)
    host = HostCounters(tmp_path)
    sampler = GpuSampler(PynvmlSource(lib=hgx_node("H100", n=2)), node="n1", host=host.sample)
    first = sampler.tick(["j1", "j2"], now=NOW)
    assert [roundtrip(e).host for e in first] == [first[0].host] * 2
    assert "cpu_util" not in first[0].host and first[0].host["tcp_retrans"] == 981
    write_proc(tmp_path, user=1300, idle=8100)
    back = roundtrip(sampler.tick(["j1"], now=NOW + 1)[0])
    assert back.host["cpu_util"] == 75.0
    g = back.gpus[0]
    assert (g["mem_clock"], g["power_limit"], g["pcie_tx_kbs"], g["pcie_rx_kbs"]) == (
        2619, 700.0, 1_250_000, 3_400_000)
    # no host counters (not Linux, a broken reader): the GPU sample goes without them
    broken = GpuSampler(PynvmlSource(lib=hgx_node(n=1)), node="n1",
                        host=lambda: 1 / 0)
    assert [roundtrip(e).host for e in broken.tick(["j1"], now=NOW)] == [None]
    down = GpuSampler(PynvmlSource(lib=FakePynvml(
        [], init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)), node="n1", host=host.sample)
    [unavailable] = down.tick(["j1"], now=NOW)
    assert unavailable.status == "unavailable" and roundtrip(unavailable).host is None


def test_cost_of_the_host_counters_per_sample(tmp_path):
    """Three small /proc reads per sample (this machine's own /proc)."""
    from trainguard.collectors.host import HostCounters

    host = HostCounters("/")
    host.sample()
    n = 300
    t0 = time.perf_counter()
    for _ in range(n):
        host.sample()
    per_sample_us = (time.perf_counter() - t0) / n * 1e6
    print(f"host counters: {per_sample_us:.0f} us per sample")
    assert per_sample_us < 5_000


def test_event_jobs_come_from_the_registry():
    assert event_jobs(None, ranks("a") + ranks("b") + [{"job": "../x"}]) == ["a", "b"]
    assert event_jobs(None, []) == [agent_mod.IDLE_JOB]


# -- Xid paths -----------------------------------------------------------------------------
class FakePublisher:
    def __init__(self):
        self.sent = []

    def send(self, topic, event, key):
        self.sent.append((topic, roundtrip(event), key))
        return True


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_xids_from_the_nvml_event_set_and_a_kernel_log_file(tmp_path):
    fake = hgx_node()
    kmsg_file = tmp_path / "kmsg.log"
    kmsg_file.write_text("")
    agent = Agent(config=Config(topics=Topics(prefix="tx")), node="n1", job="j1",
                  runtime_dir=tmp_path, kmsg_extra=[str(kmsg_file)],
                  source=PynvmlSource(lib=fake), kmsg_path=None, dmesg_argv=[],
                  clock=lambda: NOW)
    agent.publisher = FakePublisher()
    stop = threading.Event()
    agent._start_followers()
    GpuSampler(agent.source, node="n1", on_available=agent._nvml_up).tick(["j1"], NOW)
    thread = threading.Thread(target=agent._nvml_events, args=(stop,), daemon=True)
    thread.start()
    try:
        fake.post_event(6, pynvml.nvmlEventTypeXidCriticalError, 79)
        with open(kmsg_file, "a") as fh:  # bus 0x5d is GPU 3 of the HGX board
            fh.write("[  9.1] NVRM: Xid (PCI:0000:5d:00): 94, pid=4242, name=python, "
                     "Contained: SM (0x1). RST: No, D-RST: No\nunrelated line\n")
        assert wait_for(lambda: len(agent.publisher.sent) == 2)
    finally:
        stop.set()
        for follower in agent._followers:
            follower.stop(timeout=1)
        thread.join(3)
        agent.source.shutdown()
    got = {e.source: e for _, e, _ in agent.publisher.sent}
    assert (got["nvml"].gpu, got["nvml"].xid) == (6, 79)
    assert (got["kmsg"].gpu, got["kmsg"].xid) == (3, 94)
    assert got["kmsg"].message.startswith("pid=4242, name=python, Contained")
    assert {(t, k) for t, _, k in agent.publisher.sent} == {("tx.telemetry", b"j1/n1")}
    assert not thread.is_alive()


def test_publisher_drops_invalid_events_and_survives_a_full_queue():
    class FullProducer:
        def __init__(self, settings):
            self.settings, self.calls = settings, 0

        def produce(self, topic, value, key):
            self.calls += 1
            raise BufferError("queue full")

        def poll(self, timeout):
            return 0

        def flush(self, timeout):
            return 0

    pub = Publisher({"bootstrap.servers": "127.0.0.1:1"}, producer_factory=FullProducer)
    pub.start()
    try:
        bad = ev.Gpu(job="bad job!", ts=NOW, gpus=[])
        assert pub.send("t", bad, b"k") is False and pub._client.calls == 0
        good = ev.Gpu(job="j1", ts=NOW, gpus=[], status="unavailable", reason="none")
        assert pub.send("t", good, b"k") is False and pub._client.calls == 2
    finally:
        assert pub.close(0.1) == 0


def test_bad_flags_are_user_errors(tmp_path):
    from argparse import Namespace

    from trainguard.errors import UserError

    base = dict(node="n1", job=None, interval=1.0, kmsg_extra=[], runtime_dir=str(tmp_path),
                native=False)
    for bad in ({"job": "no spaces"}, {"interval": 0.0}, {"node": "x" * 300},
                {"kmsg_extra": [str(tmp_path / "missing" / "k.log")]}):
        with pytest.raises(UserError):
            agent_mod.main(Namespace(**{**base, **bad}), Config())
