"""Integrations without a broker: the compute timers (CUDA path on fake events), resume,
the watcher, the hooks on a real one-process training loop, explicit calls winning, hooks
never raising, and the ``--instrument`` environment in a fresh interpreter."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from fakes import Sink, steps_of
from trainguard.collectors.api import Collector, CollectorSettings
from trainguard.collectors.compute_timer import CudaComputeTimer, HostComputeTimer
from trainguard.collectors.resume import requested_resume_step, resume_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------- compute timers
class FakeGpu:
    """A GPU timeline: events complete when the test says the device got that far."""

    def __init__(self):
        self.now_ms = 0.0
        self.done_until = -1.0

    def event(self):
        gpu = self

        class Event:
            def record(self):
                self.at = gpu.now_ms

            def query(self):
                return self.at <= gpu.done_until

            def synchronize(self):
                gpu.done_until = max(gpu.done_until, self.at)

            def elapsed_time(self, other):
                assert self.query() and other.query(), "read before the device was done"
                return other.at - self.at
        return Event()


def test_cuda_timer_subtracts_stream_stalls_and_reads_one_step_late():
    gpu = FakeGpu()
    timer = CudaComputeTimer(event_factory=gpu.event)
    timer.begin()
    gpu.now_ms = 40.0          # forward + backward compute
    timer.wait_begin()          # last gradient ready: the stream waits for the all-reduce
    gpu.now_ms = 70.0
    timer.wait_end()
    gpu.now_ms = 80.0          # optimizer
    reading = timer.end()
    assert not reading.ready()  # the host is ahead of the device: nothing is read yet
    gpu.done_until = 80.0       # during the next step the device gets past this one
    assert reading.ready()
    assert reading.value() == pytest.approx(0.050)   # 80 ms - 30 ms stalled
    assert len(timer._free) == 4                     # events go back to the pool


def test_cuda_timer_nested_waits_count_once_and_close_waits_for_the_device():
    gpu = FakeGpu()
    timer = CudaComputeTimer(event_factory=gpu.event)
    timer.begin()
    timer.wait_begin()
    gpu.now_ms = 10.0
    timer.wait_begin()
    gpu.now_ms = 20.0
    timer.wait_end()
    gpu.now_ms = 30.0
    timer.wait_end()
    gpu.now_ms = 100.0
    reading = timer.end()
    assert reading.value() == pytest.approx(0.070)   # value() synchronizes at close only


def test_host_timer_marks_from_another_thread_and_an_unclosed_wait():
    ticks = iter([0.0, 1.0, 3.0])
    timer = HostComputeTimer(clock=lambda: next(ticks))
    timer.begin()
    timer.wait_begin()  # an exception skipped the wait's end: the step's end closes it
    assert timer.end().value() == 1.0


# ---------------------------------------------------------------------- resume
def test_resume_step_and_bad_values():
    assert resume_step([10, 20, 30], environ={"TRAINGUARD_ROLLBACK_STEP": "25"}) == 20
    assert requested_resume_step({"TRAINGUARD_RESUME_STEP": "soon"}) is None
    assert requested_resume_step({"TRAINGUARD_RESUME_STEP": "-3"}) is None
    import trainguard

    assert trainguard.resume_step([5, 9], environ={}) == 9


def test_checkpoint_to_resume_order_of_precedence():
    from trainguard.integrations.callbacks import checkpoint_to_resume

    found = {10: "c10", 20: "c20", 30: "c30"}
    assert checkpoint_to_resume(found, "mine", {}) == "mine"                      # first launch
    assert checkpoint_to_resume(found, None, {"TRAINGUARD_RESUME": "1"}) == "c30"  # relaunch
    assert checkpoint_to_resume(found, "mine", {"TRAINGUARD_RESUME": "1"}) == "mine"
    assert checkpoint_to_resume(found, "mine", {"TRAINGUARD_RESUME_STEP": "25"}) == "c20"
    assert checkpoint_to_resume(found, "mine", {"TRAINGUARD_RESUME_STEP": "5"}) is None


def test_hf_resume_checkpoint_lists_checkpoint_folders(tmp_path):
    pytest.importorskip("transformers")
    from trainguard.integrations.hf import resume_checkpoint

    for step in (10, 20, 30):
        (tmp_path / f"checkpoint-{step}").mkdir()
    (tmp_path / "runs").mkdir()
    env = {"TRAINGUARD_RESUME_STEP": "29"}
    assert resume_checkpoint(tmp_path, None, env) == str(tmp_path / "checkpoint-20")
    assert resume_checkpoint(tmp_path, True, {}) == str(tmp_path / "checkpoint-30")


# ---------------------------------------------------------------------- the watcher's steps
class Ticks:
    """A clock the test moves."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def two_rank_watcher():
    from trainguard.integrations.watcher import StepWatcher

    sink, clock = Sink(), Ticks()
    collector = Collector(CollectorSettings(job="unit", rank=1, world_size=2), sink)
    return StepWatcher(lambda: collector, clock=clock, cuda=False), clock, sink


def test_time_between_steps_is_the_next_steps_work_and_waits_are_not():
    watcher, clock, sink = two_rank_watcher()
    watcher.forward((), {}, True)
    clock.now = 1.0
    watcher.end()                   # step 0: 1 s, from its first mark
    clock.now = 1.3                 # 0.3 s in a loader no hook sees
    watcher.forward((), {}, True)
    clock.now = 1.4
    watcher.wait_begin()            # then 0.5 s waiting for peers
    clock.now = 1.9
    watcher.wait_end()
    clock.now = 2.0
    watcher.end()
    clock.now = 2.2
    watcher.wait_begin()            # a barrier between steps: a wait too
    clock.now = 2.6
    watcher.wait_end()
    watcher.end()
    got = [(step, round(step_time, 6), round(compute, 6))
           for _, _, step, step_time, compute, _ in steps_of(sink)]
    assert got == [(0, 1.0, 1.0), (1, 1.0, 0.5), (2, 0.6, 0.2)]


def test_a_framework_run_starts_its_first_step_at_its_first_mark():
    watcher, clock, sink = two_rank_watcher()
    watcher.forward((), {}, True)
    clock.now = 1.0
    watcher.end()
    clock.now = 50.0                # the script does something else, then trains again
    watcher.stop_clock()
    watcher.fetch()
    clock.now = 51.0
    watcher.end()
    assert [round(r[3], 6) for r in steps_of(sink)] == [1.0, 1.0]


# ---------------------------------------------------------------------- hooks on a real loop
@pytest.fixture
def watched():
    """Hooks installed on a collector with a stand-in producer; removed afterwards."""
    torch = pytest.importorskip("torch")
    from trainguard.integrations.torch_hooks import TorchHooks
    from trainguard.integrations.watcher import StepWatcher

    sink = Sink()
    collector = Collector(CollectorSettings(job="unit", rank=0, world_size=1), sink)
    hooks = TorchHooks(StepWatcher(lambda: collector, cuda=False)).install()
    try:
        yield torch, hooks, collector, sink
    finally:
        hooks.uninstall()


def train(torch, steps, explicit=None, bad_clip=False):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randn(steps * 2, 4), torch.randn(steps * 2, 1)), batch_size=2)
    for i, (x, y) in enumerate(data):
        ctx = explicit.step(100 + i) if explicit is not None else None
        if ctx is not None:
            ctx.__enter__()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():  # an eval pass between steps is not a step
            model(x)
        torch.save({"w": 1}, os.devnull)
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return model, opt


def test_hooks_send_one_step_per_optimizer_step_with_values(watched):
    torch, hooks, collector, sink = watched
    train(torch, 6)
    steps = steps_of(sink)
    assert [r[2] for r in steps] == list(range(6))
    for _, _, _, step_time, compute, values in steps:
        loss, grad_norm, tokens, _, lr, _ = values
        assert step_time > 0 and compute == step_time  # one rank: nothing to wait for
        assert loss > 0 and grad_norm > 0 and lr == 0.01
    assert len(hooks._grad_handles) == 1   # the last-gradient hook alone is left
    assert hooks._discovery == [] and hooks._root_handles
    assert collector.phase_now[0] == "eval"  # the no-grad pass after the last step


def test_mixed_precision_reports_the_loss_unscaled_and_its_scale(watched):
    """A GradScaler: backward gets loss x scale, and an overflow's grad norm is not finite
    while the scaler skips the step. The step reports the loss itself and the scale it was
    scaled by, so the NaN detector takes the overflows for the scaler's skips (a framework
    ends the steps, as Hugging Face's and Lightning's callbacks do)."""
    torch, hooks, collector, sink = watched
    from trainguard import events as ev
    from trainguard.detectors.offline import analyze_events

    hooks.end_steps_on_optimizer = False
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127)   # overflows at first
    losses = []
    for i in range(10):
        x, y = torch.randn(2, 4), torch.randn(2, 1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        hooks.end_step(step=i)
    steps = steps_of(sink)
    assert [r[2] for r in steps] == list(range(10))
    reported = [r[5][0] for r in steps]
    assert reported == pytest.approx(losses)                  # not loss x scale
    scales = [r[5][3] for r in steps]
    grads = [r[5][1] for r in steps]
    assert scales[0] == 2.0 ** 127 and scales[1] == 2.0 ** 126   # halved by the overflow
    assert not math.isfinite(grads[0]) and math.isfinite(grads[-1])
    events = [ev.Step(job="unit", ts=100.0 + r[2], node="n1", rank=0, step=r[2],
                      step_time=r[3], loss=r[5][0], grad_norm=r[5][1], loss_scale=r[5][3])
              for r in steps]
    engine, _ = analyze_events(events)
    assert engine.incidents() == []      # reported without the scale: a critical "nan"
    engine, _ = analyze_events([dataclasses.replace(e, loss_scale=None) for e in events])
    assert [i["kind"] for i in engine.incidents()] == ["nan"]


def test_explicit_api_wins_and_nothing_is_counted_twice(watched):
    torch, hooks, collector, sink = watched
    train(torch, 4, explicit=collector)
    numbers = [r[2] for r in steps_of(sink)]
    assert numbers == [100, 101, 102, 103]   # the explicit steps only
    assert not hooks.watcher.active


def test_a_failing_watcher_never_raises_into_the_loop(watched, monkeypatch):
    torch, hooks, collector, sink = watched

    def broken(*args, **kwargs):
        raise RuntimeError("boom")
    for name in ("begin", "backward_begin", "backward_end", "note_grad_norm", "phase",
                 "grad_ready", "wait_begin", "end", "abandon", "add_tokens", "fetch", "fetched",
                 "forward", "backward_done", "_start"):
        monkeypatch.setattr(hooks.watcher, name, broken)
    model, _ = train(torch, 3)
    assert model(torch.randn(1, 4)).shape == (1, 1)


def test_dcp_and_safetensors_saves_run_in_the_checkpoint_phase(watched, tmp_path,
                                                               monkeypatch):
    torch, hooks, collector, sink = watched
    import torch.distributed.checkpoint as dcp
    import safetensors.torch as st

    hooks.watcher.live()
    phases = []
    phase = hooks.watcher.phase
    monkeypatch.setattr(hooks.watcher, "phase", lambda name: phases.append(name) or phase(name))
    st.save_file({"w": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(tmp_path / "dcp"))
    assert phases.count("checkpoint") >= 2 and (tmp_path / "dcp" / ".metadata").exists()
    hooks.uninstall()
    assert {f.__module__ for f in (st.save_file, dcp.save, dcp.async_save)} == {
        "safetensors.torch", "torch.distributed.checkpoint.state_dict_saver"}


def test_in_phase_runs_a_framework_save_in_the_checkpoint_phase(watched):
    torch, hooks, collector, sink = watched
    from trainguard.integrations.callbacks import CallbackWatch, in_phase

    watch = CallbackWatch()
    watch.start()
    seen = []
    in_phase(watch, "checkpoint", lambda: seen.append(collector.phase_now[0]))()
    assert seen == ["checkpoint"] and collector.phase_now[0] != "checkpoint"


def test_the_hf_callback_puts_the_trainers_checkpoint_save_in_that_phase(tmp_path):
    transformers = pytest.importorskip("transformers")
    from trainguard.integrations.hf import TrainguardCallback

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    trainer = transformers.Trainer(model=model, args=args, callbacks=[TrainguardCallback()])
    assert getattr(trainer._save_checkpoint, "_trainguard", False)
    assert getattr(trainer.train, "_trainguard", False)


def test_the_hf_callback_reports_the_loss_given_to_backward_not_the_scaled_one(
        watched, monkeypatch, tmp_path, accumulation=2):
    """DeepSpeed's fp16 loss scaler multiplies the loss inside accelerate's backward: the
    step reports the losses backward was given in the step, summed (under gradient
    accumulation the Trainer gives each micro-batch its share): the step's loss, about 2.4
    for this random GPT-2 (the last micro-batch's share alone would be about 1.2)."""
    transformers = pytest.importorskip("transformers")
    accelerate = pytest.importorskip("accelerate")
    torch, hooks, collector, sink = watched
    from trainguard.integrations.hf import TrainguardCallback

    def scaled_backward(self, loss, **kwargs):      # as DeepSpeed's engine.backward does
        (loss * 1024.0).backward()
    monkeypatch.setattr(accelerate.Accelerator, "backward", scaled_backward)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8))
    data = [{"input_ids": torch.randint(0, 16, (8,)), "labels": torch.randint(0, 16, (8,))}
            for _ in range(8)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True,
                                          max_steps=3, per_device_train_batch_size=2,
                                          gradient_accumulation_steps=accumulation,
                                          save_strategy="no", logging_strategy="no")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=[TrainguardCallback(resume=False)])
    assert getattr(trainer.accelerator.backward, "_trainguard", False)
    trainer.train()
    losses = [r[5][0] for r in steps_of(sink)]
    assert len(losses) == 3 and all(2.0 < loss < 3.2 for loss in losses), losses


BOUND_AT_IMPORT = r'''
import json, torch
from trainguard.integrations.torch_hooks import TorchHooks
from trainguard.integrations.watcher import StepWatcher
TorchHooks(StepWatcher(lambda: None, cuda=False)).install()
from safetensors.torch import save_file
from torch.distributed.checkpoint import save, async_save
print(json.dumps([f.__module__ for f in (save_file, save, async_save)]))
'''


def test_writers_imported_after_the_hooks_are_bound_patched():
    """transformers binds ``from safetensors.torch import save_file`` at its import."""
    out = subprocess.run([sys.executable, "-c", BOUND_AT_IMPORT], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert set(json.loads(out.stdout.strip().splitlines()[-1])) == {
        "trainguard.integrations.torch_hooks"}


def test_uninstall_restores_torch(watched):
    torch, hooks, _, _ = watched
    patched = (torch.autograd.backward, torch.nn.utils.clip_grad_norm_, torch.save,
               torch.utils.data.dataloader._BaseDataLoaderIter.__next__)
    assert {f.__module__ for f in patched} == {"trainguard.integrations.torch_hooks"}
    hooks.uninstall()
    restored = (torch.autograd.backward, torch.nn.utils.clip_grad_norm_, torch.save,
                torch.utils.data.dataloader._BaseDataLoaderIter.__next__)
    assert all(f.__module__.startswith("torch") for f in restored)


# ---------------------------------------------------------------------- --instrument
INSTRUMENTED = r'''
import json, os, sys
import torch
from trainguard.collectors import api
c = api.running()
print(json.dumps({"collector": c is not None, "job": c.settings.job if c else None,
                  "implicit": c.implicit if c else None,
                  "wrapped": hasattr(torch.autograd.backward, "__wrapped__"),
                  "chained": os.environ.get("CHAINED_SITE") == "1" or "chained" in sys.modules}))
'''


def run_instrumented(tmp_path, code, **env):
    from trainguard.integrations.instrument import instrument_env

    other = tmp_path / "other_site"
    other.mkdir(exist_ok=True)
    (other / "sitecustomize.py").write_text("import sys, types\n"
                                            "sys.modules['chained'] = types.ModuleType('c')\n")
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    base.update(TRAINGUARD_BOOTSTRAP="127.0.0.1:1", TRAINGUARD_HOME=str(tmp_path / "home"),
                PYTHONPATH=str(other), **env)
    base.update(instrument_env(base))
    out = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_instrument_env_loads_the_hooks_in_a_torchrun_worker(tmp_path):
    got = run_instrumented(tmp_path, INSTRUMENTED, RANK="0", WORLD_SIZE="1",
                           TRAINGUARD_JOB="inst-1")
    assert got == {"collector": True, "job": "inst-1", "implicit": True, "wrapped": True,
                   "chained": True}


@pytest.mark.slow
def test_instrument_waits_for_training_outside_torchrun(tmp_path):
    got = run_instrumented(tmp_path, INSTRUMENTED)  # e.g. the torchrun agent: no collector
    assert got["collector"] is False and got["wrapped"] is True


def test_supervisor_passes_the_instrument_environment():
    from trainguard.launcher.supervisor import Supervisor
    from trainguard.integrations.instrument import SITE_DIR

    sup = Supervisor(job="j", cmd=["true"], environ={"PYTHONPATH": "/x"}, instrument=True)
    env = sup._env(resume=False)
    assert env["TRAINGUARD_INSTRUMENT"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [SITE_DIR, "/x"]
    plain = Supervisor(job="j", cmd=["true"], environ={}, instrument=False)._env(resume=False)
    assert "TRAINGUARD_INSTRUMENT" not in plain


def test_run_accepts_the_instrument_flag():
    from trainguard.cli import build_parser

    args = build_parser().parse_args(["run", "--job", "j", "--instrument", "--", "python", "t"])
    assert args.instrument and args.cmd[-2:] == ["python", "t"]


@pytest.mark.parametrize("argv, file, environ, expected", [
    (["--instrument"], "", {}, "flag --instrument"),
    ([], "[collector]\ninstrument = true\n", {}, "tg.toml"),
    ([], "", {"TRAINGUARD_INSTRUMENT": "1"}, "env TRAINGUARD_INSTRUMENT"),
    ([], "", {"TRAINGUARD_COLLECTOR__INSTRUMENT": "yes"}, "env TRAINGUARD_COLLECTOR__INSTRUMENT"),
    ([], "[collector]\ninstrument = true\n", {"TRAINGUARD_INSTRUMENT": "0"}, None),
    ([], "", {}, None),
])
def test_instrument_is_the_config_trees_collector_instrument(
        tmp_path, monkeypatch, argv, file, environ, expected):
    from trainguard.cli import build_parser
    from trainguard.configcli import apply_config

    for name in ("TRAINGUARD_INSTRUMENT", "TRAINGUARD_COLLECTOR__INSTRUMENT",
                 "TRAINGUARD_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "tg.toml"
    path.write_text(file)
    # the training command's own --instrument is not trainguard's
    argv = ["run", "--job", "j", "--config", str(path), *argv, "--", "python", "t.py",
            "--instrument"]
    parser = build_parser()
    args = parser.parse_args(argv)
    apply_config(parser, argv, args)
    assert args.instrument is (expected is not None)
    if expected is not None:
        source = args.tree.source("collector.instrument")
        assert source == (str(path) if expected == "tg.toml" else expected)


def test_resuming_replaces_the_checkpoint_given_by_position_or_keyword():
    from trainguard.integrations.callbacks import resuming

    seen = []
    wrapped = resuming(lambda ckpt, *a, **k: seen.append((ckpt, a, k)),
                       lambda given: "c20" if given is None else given)
    wrapped()
    wrapped("mine", 1, trial=2)
    wrapped(resume_from_checkpoint="kw")
    assert seen == [("c20", (), {}), ("mine", (1,), {"trial": 2}), ("kw", (), {})]
    off = resuming(lambda ckpt: seen.append(ckpt), lambda given: "c20", applies=lambda: False)
    off()
    assert seen[-1] is None
