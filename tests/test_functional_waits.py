"""The hooks time the waits of DTensor's functional collectives (tensor parallel): the module
is patched once the script imported it, a wait inside a step is not compute, torch.compile's
tracing sees the original, and nothing raises into the script; a DTensor loss or grad norm is
read only when that needs no collective. The real FSDP2 / tensor parallel / pipeline parallel
jobs are in tests/test_parallel_compute_time.py."""
from __future__ import annotations

import sys
import time

import pytest

from fakes import Sink, steps_of
from trainguard.collectors.api import Collector, CollectorSettings

torch = pytest.importorskip("torch")
funcol = pytest.importorskip("torch.distributed._functional_collectives")

from trainguard.integrations.torch_hooks import _FUNCOL, TorchHooks  # noqa: E402
from trainguard.integrations.watcher import StepWatcher  # noqa: E402

WAIT = 0.2


@pytest.fixture
def slow_waits(monkeypatch):
    """funcol's waits stand in for a peer 0.2 s late; hooks installed on a 2-rank collector."""
    calls = []

    def wait_tensor(tensor):
        calls.append(tensor)
        time.sleep(WAIT)
        return tensor

    monkeypatch.setattr(funcol, "wait_tensor", wait_tensor)
    sink = Sink()
    collector = Collector(CollectorSettings(job="unit", rank=0, world_size=2), sink)
    hooks = TorchHooks(StepWatcher(lambda: collector, cuda=False))
    yield hooks, sink, calls
    hooks.uninstall()


def test_a_functional_wait_in_a_step_is_not_compute(slow_waits):
    hooks, sink, calls = slow_waits
    hooks.install()
    assert funcol.wait_tensor.__wrapped__.__name__ == "wait_tensor"
    w = hooks.watcher
    w.begin()
    out = funcol.wait_tensor(torch.ones(2))  # the result passes through
    w.end()
    assert out.tolist() == [1.0, 1.0] and len(calls) == 1
    (_, _, step, step_time, compute, _), = steps_of(sink)
    assert step_time >= WAIT and compute <= step_time - 0.9 * WAIT, (step_time, compute)


def test_patched_once_the_script_imports_it(slow_waits, monkeypatch):
    hooks, sink, _ = slow_waits
    monkeypatch.delitem(sys.modules, _FUNCOL)
    hooks.install()
    assert not hasattr(funcol.wait_tensor, "__wrapped__")
    monkeypatch.setitem(sys.modules, _FUNCOL, funcol)
    layer = torch.nn.Linear(2, 2)
    torch.optim.SGD(layer.parameters(), lr=0.1).step()  # the first optimizer step finds it
    assert hasattr(funcol.wait_tensor, "__wrapped__")
    hooks.uninstall()
    assert not hasattr(funcol.wait_tensor, "__wrapped__")


def test_compiling_sees_the_original_and_a_broken_watcher_never_raises(slow_waits, monkeypatch):
    hooks, sink, calls = slow_waits
    compiling = [True]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling[0])
    hooks.install()
    w = hooks.watcher
    w.begin()
    # while traced, the watcher is not touched: that would fail the test
    monkeypatch.setattr(w, "wait_begin", pytest.fail)
    funcol.wait_tensor(torch.ones(1))
    compiling[0] = False

    def boom(*args):
        raise RuntimeError("boom")
    monkeypatch.setattr(w, "wait_begin", boom)
    monkeypatch.setattr(w, "phase", boom)
    assert funcol.wait_tensor(torch.ones(1)).item() == 1.0
    assert len(calls) == 2


_DTENSOR_CHECK = """
import sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from trainguard.integrations.watcher import _host_value

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
norm = torch.tensor(3.0)
print(_host_value(DTensor.from_local(norm, mesh, [Replicate()])),
      _host_value(DTensor.from_local(norm, mesh, [Partial()])))
dist.destroy_process_group()
"""


def test_a_dtensor_value_is_read_only_when_no_collective_is_needed(tmp_path):
    """A Partial grad norm (a DTensor) would need an all-reduce to read: it is left out; a
    replicated one is read. In a process of its own: DTensor keeps the process group in a
    thread-local cache that a later fork of the test process (the supervisor tests) would
    tear down in the child, and hang there."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _DTENSOR_CHECK, str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["3.0", "None"], out.stdout
