"""Stack capture with real processes: py-spy, the in-process fallback, dead processes."""
from __future__ import annotations

import doctest
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from trainguard.collectors import stack_capture
from trainguard.collectors.stack_capture import (InprocDumper, capture_pid, find_pyspy,
                                                 inproc_threads, install_inproc_handler,
                                                 stack_file)

CHILD = r'''
import os, sys, threading, time, ctypes, importlib.util
mode, runtime_dir, module_path = sys.argv[1:4]
if mode != "plain":  # the module has no package-relative imports: load it by path
    spec = importlib.util.spec_from_file_location("tg_stack_capture", module_path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.InprocDumper(runtime_dir, wakeup_thread=(mode != "handler-only")).install()

def tg_marker_helper():
    threading.Event().wait(120)

def tg_marker_sleeper():
    time.sleep(120)

def tg_marker_stuck_in_c():
    # a blocking native call that the kernel restarts after a signal (SA_RESTART):
    # the main thread never returns to Python, as in a hung collective
    r, w = os.pipe()
    buf = ctypes.create_string_buffer(1)
    ctypes.CDLL(None, use_errno=True).read(r, buf, 1)

threading.Thread(target=tg_marker_helper, name="tg-helper", daemon=True).start()
print(os.getpid(), flush=True)
(tg_marker_stuck_in_c if mode == "stuck" else tg_marker_sleeper)()
'''


@pytest.fixture
def spawn(tmp_path):
    """Start a child python (under ``timeout -s KILL``); returns (pid, runtime_dir)."""
    procs = []
    script = tmp_path / "child.py"
    script.write_text(CHILD)

    def start(mode: str):
        proc = subprocess.Popen(["timeout", "-s", "KILL", "90", sys.executable, str(script),
                                 mode, str(tmp_path / "rt"), stack_capture.__file__],
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        pid = int(proc.stdout.readline())
        time.sleep(0.3)  # let it enter the blocking call
        return pid, tmp_path / "rt"

    yield start
    for proc in procs:
        proc.terminate()  # timeout forwards SIGTERM to the child
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()


def _functions(result: dict) -> set:
    return {f["function"] for t in result["threads"] for f in t["frames"]}


def _thread(result: dict, name: str) -> dict:
    return next(t for t in result["threads"] if t["name"] == name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _validate(result: dict) -> None:
    events = pytest.importorskip("trainguard.events")
    events.from_dict({"v": 1, "type": "stack", "job": "j", "ts": 1.0, "node": "n", "rank": 0,
                      "capture_id": "c1", **result})


def test_doctests():
    assert doctest.testmod(stack_capture).failed == 0


def test_pyspy_dump_of_a_sleeping_child(spawn):
    assert find_pyspy() is not None, "py-spy is a dependency; it must be found"
    pid, _ = spawn("plain")
    result = capture_pid(pid, timeout=30)
    assert result["error"] is None, result["error"]
    assert result["method"] == "py-spy" and result["pid"] == pid
    main = _thread(result, "MainThread")
    assert [f["function"] for f in main["frames"][:2]] == ["tg_marker_sleeper", "<module>"]
    assert main["frames"][0]["file"].endswith("child.py") and main["frames"][0]["line"] > 0
    assert main["active"] is False
    helper = _thread(result, "tg-helper")
    assert "tg_marker_helper" in [f["function"] for f in helper["frames"]]
    _validate(result)


def test_pyspy_native_frames(spawn):
    pid, _ = spawn("plain")
    result = capture_pid(pid, native=True, timeout=30)
    if result["error"] and "native" in result["error"].lower():
        pytest.skip(f"py-spy without native unwinding here: {result['error']}")
    assert result["error"] is None and "tg_marker_sleeper" in _functions(result)


def test_inproc_fallback_when_pyspy_is_missing(spawn):
    pid, runtime = spawn("sleep")
    result = capture_pid(pid, pyspy="/nonexistent/py-spy", runtime_dir=runtime, timeout=10)
    assert result["error"] is None, result["error"]
    assert result["method"] == "inproc"
    assert "py-spy not found" in result["fallback_reason"]
    main = _thread(result, "MainThread")
    assert main["frames"][0]["function"] == "tg_marker_sleeper"  # handler frames left out
    assert main["frames"][-1]["function"] == "<module>"
    helper = _thread(result, "tg-helper")
    assert "tg_marker_helper" in [f["function"] for f in helper["frames"]]
    assert helper["active"] is False and helper["frames"][0]["file"].endswith("threading.py")
    assert not any(t["name"] == "trainguard-stackdump" for t in result["threads"])
    assert stack_file(runtime, pid).exists()
    _validate(result)
    again = capture_pid(pid, pyspy="/nonexistent/py-spy", runtime_dir=runtime, timeout=10)
    assert again["error"] is None and again["threads"]  # a second capture works too


def test_inproc_capture_of_a_process_stuck_in_native_code(spawn):
    pid, runtime = spawn("stuck")
    result = capture_pid(pid, pyspy="/nonexistent/py-spy", runtime_dir=runtime, timeout=10)
    assert result["error"] is None, result["error"]
    main = _thread(result, "MainThread")
    assert main["frames"][0]["function"] == "tg_marker_stuck_in_c"
    assert _alive(pid)


def test_handler_only_mode_also_dumps(spawn):
    pid, runtime = spawn("handler-only")
    result = capture_pid(pid, pyspy="/nonexistent/py-spy", runtime_dir=runtime, timeout=10)
    assert result["error"] is None, result["error"]
    assert _thread(result, "MainThread")["frames"][0]["function"] == "tg_marker_sleeper"


def test_bogus_pyspy_and_no_handler_never_kills_the_process(spawn, tmp_path):
    pid, runtime = spawn("plain")
    result = capture_pid(pid, pyspy="/nonexistent/py-spy", runtime_dir=runtime, timeout=3)
    assert result["threads"] == [] and result["method"] == "inproc"
    assert "py-spy not found" in result["error"] and "no SIGUSR2 handler" in result["error"]
    time.sleep(0.2)
    assert _alive(pid)
    bogus = tmp_path / "fake-py-spy"
    bogus.write_text("#!/bin/sh\necho 'Permission Denied: Try running again with elevated "
                     "permissions' >&2\nexit 1\n")
    bogus.chmod(0o755)
    result = capture_pid(pid, pyspy=str(bogus), timeout=3)
    assert result["method"] == "py-spy" and "Permission Denied" in result["error"]
    assert "no runtime dir" in result["error"]


def test_dead_pid_gives_an_error_not_an_exception():
    proc = subprocess.Popen(["timeout", "-s", "KILL", "30", sys.executable, "-c",
                             "import os; print(os.getpid())"], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    proc.wait(30)
    proc.stdout.close()
    for kwargs in ({}, {"pyspy": "/nonexistent/py-spy", "runtime_dir": "/tmp/x"}):
        result = capture_pid(pid, timeout=5, **kwargs)
        assert result["threads"] == [] and "does not exist" in result["error"]
    assert "not a process id" in capture_pid(-5)["error"]


def test_zombie_pid_gives_an_error(tmp_path):
    proc = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if open(f"/proc/{proc.pid}/stat").read().split(")")[1].split()[0] == "Z":
            break
        time.sleep(0.02)
    result = capture_pid(proc.pid, runtime_dir=tmp_path, timeout=3)
    proc.wait()
    assert result["threads"] == [] and "exited" in result["error"]


def test_inproc_threads_of_this_process():
    ready, release = threading.Event(), threading.Event()

    def tg_marker_waiting():
        ready.set()
        release.wait(30)

    t = threading.Thread(target=tg_marker_waiting, name="tg-waiter")
    t.start()
    ready.wait(5)
    try:
        threads = inproc_threads()
    finally:
        release.set()
        t.join(5)
    waiter = next(x for x in threads if x["name"] == "tg-waiter")
    names = [f["function"] for f in waiter["frames"]]
    marker = next(i for i, n in enumerate(names) if n.endswith("tg_marker_waiting"))
    assert names[0].endswith("wait") and marker < 4
    assert marker < names.index("Thread.run" if sys.version_info >= (3, 11) else "run")
    assert waiter["active"] is False and waiter["id"] == t.ident
    me = next(x for x in threads if x["id"] == threading.get_ident())
    assert me["active"] is True
    assert me["frames"][0]["function"].endswith("test_inproc_threads_of_this_process")
    json.dumps(threads)


def test_install_in_this_process_and_signal_self(tmp_path):
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    previous = signal.getsignal(signal.SIGUSR1)
    dumper = install_inproc_handler(tmp_path, signum=signal.SIGUSR1)
    try:
        marker = json.loads(stack_file(tmp_path, os.getpid()).with_suffix(".ready").read_text())
        assert marker["signum"] == signal.SIGUSR1
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not stack_file(tmp_path, os.getpid()).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        doc = json.loads(stack_file(tmp_path, os.getpid()).read_text())
        assert doc["method"] == "inproc" and doc["pid"] == os.getpid()
        mine = next(t for t in doc["threads"] if t["id"] == threading.get_ident())
        assert any(f["function"].endswith("test_install_in_this_process_and_signal_self")
                   for f in mine["frames"][:5])
    finally:
        dumper.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == previous
    assert not stack_file(tmp_path, os.getpid()).with_suffix(".ready").exists()
    assert signal.set_wakeup_fd(-1) == -1  # the wakeup fd was given back


def test_dumps_at_once_and_a_failing_dump_never_raise(tmp_path, monkeypatch):
    """The wakeup thread and the handler may write the same dump at once (a rank hung in a
    Python loop runs both): each write has its own temporary file, and the handler never
    raises into the training loop, whatever the dump does."""
    dumper = InprocDumper(tmp_path, signal.SIGUSR1)
    dumper.path.parent.mkdir(parents=True)
    errors = []

    def dump_many():
        try:
            for _ in range(50):
                dumper.dump()
        except Exception as exc:  # pragma: no cover - the failure this test is about
            errors.append(exc)

    threads = [threading.Thread(target=dump_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and json.loads(dumper.path.read_text())["pid"] == os.getpid()
    assert [p.name for p in dumper.path.parent.iterdir()] == [dumper.path.name]

    monkeypatch.setattr(dumper, "dump", lambda: 1 / 0)
    dumper._on_signal(signal.SIGUSR1, None)   # no wakeup thread: the handler dumps, and fails
