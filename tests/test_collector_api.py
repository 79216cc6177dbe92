"""The training-side API: init, step/report, phases, heartbeats, compute_time, exit paths."""
from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import textwrap
import threading
import time

import pytest

import trainguard
from trainguard import events as ev
from trainguard.collectors.api import (Collector, CollectorError, CollectorSettings,
                                       StepContext)
from trainguard.errors import UserError

from collector_harness import PYTHON, by_type, closed_port, consume, job_env


class Sink:
    """Stands in for the producer: keeps records."""

    dropped = 0

    def __init__(self):
        self.records = []
        self.closed = False

    def produce(self, record, key=None):
        self.records.append((record, key))
        return True

    def close(self, timeout=None):
        self.closed = True


def collector(world_size=4, **kw) -> Collector:
    settings = CollectorSettings(job="j1", rank=min(1, world_size - 1), world_size=world_size,
                                 node="n1", **kw)
    return Collector(settings, Sink(), handle_signals=False)


def decoded(c: Collector) -> list:
    return [ev.decode(c.encode(record)) for record, _ in c.producer.records]


class FakeTensor:
    """A 0-d tensor stand-in that counts host reads."""

    reads = 0

    def __init__(self, value):
        self.value = value

    def item(self):
        FakeTensor.reads += 1
        return self.value


# -- arguments -----------------------------------------------------------------------------
@pytest.mark.parametrize("job", ["", "has space", "x" * 129, "ümlaut", None])
def test_bad_job_id_is_a_clear_value_error(job):
    with pytest.raises(CollectorError, match=r"1-128 characters of \[A-Za-z0-9._-\]") as info:
        trainguard.init(job=job, bootstrap=f"127.0.0.1:{closed_port()}")
    assert isinstance(info.value, ValueError) and isinstance(info.value, UserError)


@pytest.mark.parametrize("kwargs, match", [
    ({"rank": 4, "world_size": 4}, "rank 4"),
    ({"report_every": 0}, "report_every"),
    ({"topology": {"tp": 0}}, "topology tp"),
    ({"topology": [2, 2]}, "topology must be a dict"),
    ({"heartbeat_interval": 0}, "heartbeat_interval"),
    ({"heartbeat_interval": 30.0}, r"heartbeat_interval must be in \(0, 10\] seconds, got 30.0"),
])
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises(CollectorError, match=match):
        CollectorSettings(job="j1", **{"world_size": 8, **kwargs})


def test_topology_fills_dp():
    assert CollectorSettings(job="j", world_size=16, topology={"tp": 4, "pp": 2}).topology == {
        "tp": 4, "pp": 2, "dp": 2}


def test_bad_step_and_phase_names_raise():
    c = collector()
    with pytest.raises(CollectorError):
        c.step(-1)
    with pytest.raises(CollectorError):
        c.phase("")
    assert StepContext(c, True + 2).step == 3  # anything with __index__


# -- init from the environment -------------------------------------------------------------
def test_init_reads_torchrun_env_and_registers_the_rank(tmp_path):
    environ = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
               "TRAINGUARD_BOOTSTRAP": f"127.0.0.1:{closed_port()}",
               "TRAINGUARD_TOPIC_PREFIX": "myprefix"}
    t0 = time.monotonic()
    tg = trainguard.init(job="env-job", environ=environ, runtime_dir=tmp_path,
                         handle_signals=False, stack_signal=None, flush_timeout=0.5)
    try:
        assert time.monotonic() - t0 < 1.0  # never waits for the (unreachable) broker
        s = tg.settings
        assert (s.rank, s.local_rank, s.world_size, s.node) == (5, 1, 8, socket.gethostname())
        assert tg.producer.topic == "myprefix.telemetry"
        assert trainguard.init(job="env-job", environ=environ) is tg  # idempotent
        entry = tg.registry.entries(job="env-job")
        assert [(e["rank"], e["local_rank"], e["pid"], e["world_size"]) for e in entry] == [
            (5, 1, os.getpid(), 8)]
        with tg.step(0) as st:
            st.report(loss=1.0)
    finally:
        t0 = time.monotonic()
        tg.close()
        assert time.monotonic() - t0 < 3.0
    assert tg.registry.entries(job="env-job") == []
    assert tg.dropped >= 3  # start, step, exit (and heartbeats) could not be delivered


def test_events_left_undelivered_at_exit_are_said_once_with_their_number(tmp_path, caplog):
    """No heartbeat follows the exit, so what the last flush could not deliver is logged."""
    tg = trainguard.init(job="exit-job", bootstrap=f"127.0.0.1:{closed_port()}",
                         environ={"RANK": "3"}, runtime_dir=tmp_path, handle_signals=False,
                         stack_signal=None, flush_timeout=0.3)
    for step in range(5):
        with tg.step(step):
            pass
    tg.close()
    tg.close()
    lost = [r.getMessage() for r in caplog.records if "not delivered" in r.getMessage()]
    assert len(lost) == 1, caplog.text
    assert lost[0].startswith("trainguard: rank 3 of job exit-job: ")
    assert int(lost[0].split(": ")[2].split()[0]) >= 6  # start, five steps, exit


@pytest.mark.parametrize("how", ["close", "uncaught"])
def test_a_sigterm_during_the_exit_flush_lets_it_say_what_it_lost(tmp_path, how):
    """torchrun SIGTERMs a rank that is already flushing at exit (a peer died while the broker
    failed over): the process still dies by SIGTERM, but after the collector said how many
    events it could not deliver (the signal killed the flush unsaid before: CI, ci63)."""
    code = textwrap.dedent(f"""
        import os, signal, sys, threading
        import trainguard
        tg = trainguard.init(job="flush-job", bootstrap="127.0.0.1:{closed_port()}",
                             environ={{"RANK": "0"}}, runtime_dir={str(tmp_path)!r},
                             stack_signal=None, flush_timeout=1.5)
        for step in range(5):
            with tg.step(step):
                pass
        timer = threading.Timer(0.4, os.kill, (os.getpid(), signal.SIGTERM))
        timer.daemon = True
        timer.start()
        if {how!r} == "close":
            tg.close()
        else:
            raise RuntimeError("a peer is gone")     # atexit closes
        print("survived", flush=True)
    """)
    proc = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert "survived" not in proc.stdout
    said = [line for line in proc.stderr.splitlines() if "were not delivered" in line]
    assert len(said) == 1 and said[0].startswith("trainguard: rank 0 of job flush-job: "), \
        proc.stderr


def test_a_sigterm_held_by_a_close_that_never_ends_still_ends_the_process(tmp_path):
    """A close can block for ever (an integration's last flush in a CUDA call of a hung
    collective): the SIGTERM it holds ends the process after flush_timeout + 2 s."""
    code = textwrap.dedent(f"""
        import os, signal, threading, time
        import trainguard
        tg = trainguard.init(job="stuck-close", bootstrap="127.0.0.1:{closed_port()}",
                             environ={{"RANK": "0"}}, runtime_dir={str(tmp_path)!r},
                             stack_signal=None, flush_timeout=0.5)
        tg.before_close.append(lambda: time.sleep(600))
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
        timer.daemon = True
        timer.start()
        tg.close()
    """)
    began = time.monotonic()
    proc = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert time.monotonic() - began < 30, proc.stderr
    assert "SIGTERM held 2.5 s by a close that did not end" in proc.stderr, proc.stderr


def test_bad_kafka_environment_disables_telemetry_but_never_raises(tmp_path, caplog):
    environ = {"TRAINGUARD_KAFKA_CONFIG": str(tmp_path / "missing.properties")}
    tg = trainguard.init(job="bad-env", environ=environ, runtime_dir=tmp_path,
                         handle_signals=False, stack_signal=None)
    with tg.step(0):
        pass
    tg.close(timeout=0.5)
    assert "telemetry disabled" in caplog.text
    assert tg.dropped >= 2


def test_init_in_a_thread_installs_no_signal_handler(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    box = []
    thread = threading.Thread(target=lambda: box.append(trainguard.init(
        job="threaded", bootstrap=f"127.0.0.1:{closed_port()}", runtime_dir=tmp_path)))
    thread.start()
    thread.join()
    try:
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        box[0].close(timeout=0.2)


# -- steps, reports, compute_time ----------------------------------------------------------
def test_step_events_are_contract_valid_and_carry_reported_values():
    c = collector()
    with c.step(7) as s:
        s.report(loss=float("nan"), grad_norm=FakeTensor(0.5), tokens=FakeTensor(4096.0),
                 loss_scale=65536, lr=3e-4, mfu=0.41)
    (step,) = decoded(c)
    assert step.type == "step" and (step.job, step.rank, step.node, step.step) == ("j1", 1,
                                                                                    "n1", 7)
    assert math.isnan(step.loss) and step.grad_norm == 0.5 and step.tokens == 4096
    assert step.loss_scale == 65536.0 and step.lr == 3e-4 and step.extra == {"mfu": 0.41}
    assert step.step_time >= 0 and step.compute_time is None  # 4 ranks, no method in use
    assert c.producer.records[0][1] == b"j1/1"


def test_report_every_reads_tensors_only_on_report_steps():
    c = collector(report_every=3)
    FakeTensor.reads = 0
    for n in range(7):
        with c.step(n) as s:
            s.report(loss=FakeTensor(1.0 + n))
    assert FakeTensor.reads == 3  # steps 0, 3, 6
    events = decoded(c)
    assert [e.step for e in events] == list(range(7))  # timings every step
    assert [e.loss for e in events] == [1.0, None, None, 4.0, None, None, 7.0]


def test_step_numbers_that_start_again_each_epoch_are_said_once_by_rank_0(caplog):
    for rank in (1, 0):
        c = Collector(CollectorSettings(job="j1", rank=rank, world_size=4, node="n1"), Sink(),
                      handle_signals=False)
        for epoch in range(3):
            for i in range(3):
                with c.step(i):
                    pass
    said = [r.getMessage() for r in caplog.records if "went back" in r.getMessage()]
    assert len(said) == 1, caplog.text
    assert said[0].startswith("trainguard: rank 0 of job j1: the step number went back from 2 "
                              "to 0 in the same process.")
    assert "(the global step)" in said[0]
    assert [e.step for e in decoded(c)] == [0, 1, 2] * 3      # sent as given


def test_a_job_without_compute_times_is_told_once_by_rank_0(caplog):
    for rank in (0, 1):
        settings = CollectorSettings(job="j1", rank=rank, world_size=4, node="n1")
        c = Collector(settings, Sink(), handle_signals=False)
        for i in range(5):
            with c.step(i):
                pass
    said = [r.getMessage() for r in caplog.records if "without a compute time" in r.getMessage()]
    assert said == [said[0]] and said[0].startswith("trainguard: job j1: 3 steps without"), \
        caplog.text
    assert "tg.watch_ddp(model)" in said[0] and "stragglers go unnamed" in said[0]
    caplog.clear()
    c = Collector(CollectorSettings(job="j1", rank=0, world_size=4, node="n1"), Sink(),
                  handle_signals=False)
    for i in range(5):
        with c.step(i):
            with c.phase("collective"):
                pass
    assert "without a compute time" not in caplog.text
    for i in range(5, 12):                 # marked now and then: never 3 in a row without
        with c.step(i):
            if i % 2:
                with c.phase("collective"):
                    pass
    assert "without a compute time" not in caplog.text


def test_report_every_keeps_plain_token_counts_on_every_step():
    """A count given as an int costs no device read: throughput is judged per token on
    every step; a tensor count is read on report steps only."""
    c = collector(report_every=4)
    FakeTensor.reads = 0
    for n in range(5):
        with c.step(n) as s:
            s.report(loss=FakeTensor(2.0), tokens=4096 + n)
            s.report(tokens=FakeTensor(7))
    assert FakeTensor.reads == 4          # steps 0 and 4: the loss and the tensor count
    events = decoded(c)
    assert [e.tokens for e in events] == [7, 4097, 4098, 4099, 7]
    assert [e.loss for e in events] == [2.0, None, None, None, 2.0]


def test_real_zero_dim_tensors():
    torch = pytest.importorskip("torch")
    c = collector()
    with c.step(0) as s:
        s.report(loss=torch.tensor(2.5), tokens=torch.tensor(128), grad_norm=torch.tensor(
            float("inf")))
    (step,) = decoded(c)
    assert (step.loss, step.tokens, step.grad_norm) == (2.5, 128, float("inf"))


def test_compute_time_methods():
    one = collector(world_size=1)
    with one.step(0):
        time.sleep(0.01)
    (e,) = decoded(one)
    assert e.compute_time == e.step_time  # no peers to wait for

    c = collector()
    with c.step(0):
        with c.phase("forward"):
            time.sleep(0.02)
        with c.phase("collective"):
            time.sleep(0.05)
    (e,) = decoded(c)
    assert e.compute_time == pytest.approx(e.step_time - 0.05, abs=0.02)
    assert e.compute_time < e.step_time - 0.03


def test_failed_step_sends_no_step_event():
    c = collector()
    with pytest.raises(RuntimeError):
        with c.step(0):
            raise RuntimeError("oom")
    assert c.producer.records == [] and c.phase_now[0] == "idle"


# -- phases and heartbeats -----------------------------------------------------------------
def test_heartbeats_follow_the_phases_also_while_stuck():
    settings = CollectorSettings(job="j1", rank=0, world_size=2, heartbeat_interval=0.05)
    c = Collector(settings, Sink(), handle_signals=False)
    c.start()
    try:
        time.sleep(0.12)
        with c.step(0):
            with c.phase("forward"):
                entered = time.time()
                with c.phase("collective"):
                    time.sleep(0.3)  # "stuck" in a collective: heartbeats go on
                assert c.phase_now[0] == "forward"
        time.sleep(0.12)
    finally:
        c.close()
    events = decoded(c)
    beats = by_type(events, "heartbeat")
    phases = [b.phase for b in beats]
    assert phases[0] == "init" and phases.count("collective") >= 3 and phases[-1] == "idle"
    stuck = [b for b in beats if b.phase == "collective"]
    assert all(b.phase_since >= entered and b.pid == os.getpid() for b in stuck)
    assert {b.step for b in stuck} == {None} and beats[-1].step == 0
    life = by_type(events, "lifecycle")
    assert [x.event for x in life] == ["start", "exit"] and life[1].exit_code == 0


# -- exit paths, in child processes --------------------------------------------------------
SCRIPT_HEAD = """
import os, signal, sys, time
import trainguard
tg = trainguard.init(job=JOB, heartbeat_interval=0.2)
print("ready", flush=True)
"""


def run_script(body: str, kafka_config, tmp_path, job: str, sigterm_after=None,
               wait_for="ready"):
    code = f"JOB = {job!r}\n" + textwrap.dedent(SCRIPT_HEAD) + textwrap.dedent(body)
    env = job_env(kafka_config.bootstrap, kafka_config.topics.prefix, tmp_path / "home")
    proc = subprocess.Popen([PYTHON, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        if sigterm_after is not None:
            while proc.stdout.readline().strip() != wait_for:
                assert proc.poll() is None
            time.sleep(sigterm_after)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            proc.wait(15)
            print(f"{job}: ended {time.monotonic() - sent:.2f} s after SIGTERM")
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = consume(kafka_config.bootstrap, kafka_config.topics.telemetry, timeout=15,
                     done=lambda evs: any(e.event == "exit" for e in by_type(evs, "lifecycle")
                                          if e.job == job))
    life = [e for e in by_type(events, "lifecycle") if e.job == job]
    return proc.returncode, out, life


@pytest.mark.broker
def test_sigterm_sends_exit_and_still_dies_by_sigterm(kafka_config, tmp_path):
    body = """
    if os.fork() == 0:   # a DataLoader-like child exits normally: no exit event for the rank
        sys.exit(0)
    os.wait()
    step = 0
    while True:
        with tg.step(step):
            time.sleep(0.01)
        step += 1
    """
    code, out, life = run_script(body, kafka_config, tmp_path, "sigterm-job", sigterm_after=0.3)
    assert code == -signal.SIGTERM, out
    exits = [e for e in life if e.event == "exit"]
    assert len(exits) == 1 and exits[0].signal == "SIGTERM" and exits[0].exit_code is None


@pytest.mark.broker
@pytest.mark.slow
def test_sigterm_while_stuck_in_native_code(kafka_config, tmp_path):
    body = """
    import torch
    print("stuck", flush=True)
    torch.futures.Future().wait()   # blocks in C++ forever; Python handlers cannot run
    """
    code, out, life = run_script(body, kafka_config, tmp_path, "stuck-job", sigterm_after=0.2,
                                 wait_for="stuck")
    assert code == -signal.SIGTERM, out
    exits = [e for e in life if e.event == "exit"]
    assert len(exits) == 1 and exits[0].signal == "SIGTERM"


@pytest.mark.broker
def test_sigterm_chains_to_a_previous_handler(kafka_config, tmp_path):
    code_text = """
    import os, signal, sys, time
    stop = []
    signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
    import trainguard
    tg = trainguard.init(job=JOB)
    print("ready", flush=True)
    while not stop:
        time.sleep(0.01)
    sys.exit(3)   # the user's own graceful shutdown
    """
    env = job_env(kafka_config.bootstrap, kafka_config.topics.prefix, tmp_path / "home")
    proc = subprocess.Popen([PYTHON, "-c", "JOB = 'chained'\n" + textwrap.dedent(code_text)],
                            env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 3
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = consume(kafka_config.bootstrap, kafka_config.topics.telemetry, timeout=15,
                     done=lambda evs: any(e.event == "exit" for e in by_type(evs, "lifecycle")))
    exits = [e for e in by_type(events, "lifecycle") if e.event == "exit"]
    assert len(exits) == 1 and exits[0].signal == "SIGTERM"


@pytest.mark.broker
def test_uncaught_exception_exits_with_code_1(kafka_config, tmp_path):
    code, out, life = run_script("raise RuntimeError('boom')\n", kafka_config, tmp_path,
                                 "crash-job")
    assert code == 1 and "boom" in out
    assert [(e.event, e.exit_code) for e in life] == [("start", None), ("exit", 1)]


def test_a_phase_around_steps_shows_between_them():
    c = collector()
    with c.step(0):
        pass
    assert c.phase_now[0] == "idle"
    with c.phase("eval"):
        with c.step(1):
            assert c.phase_now[0] == "step"
        assert c.phase_now[0] == "eval"
    assert c.phase_now[0] == "idle"


@pytest.mark.broker
def test_a_sigterm_handler_installed_after_init_owns_sigterm(kafka_config, tmp_path):
    code_text = """
    import signal, sys, time
    import trainguard
    tg = trainguard.init(job="later-handler")
    stop = []
    signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
    print("ready", flush=True)
    while not stop:
        time.sleep(0.01)
    time.sleep(2.5)   # longer than the collector's stuck grace: it must not kill us
    print("alive", flush=True)
    """
    env = job_env(kafka_config.bootstrap, kafka_config.topics.prefix, tmp_path / "home")
    proc = subprocess.Popen([PYTHON, "-c", textwrap.dedent(code_text)], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "alive" in out
