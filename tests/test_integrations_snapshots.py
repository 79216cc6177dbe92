"""In-memory snapshots through the Hugging Face and Lightning callbacks (docs/RECOVERY.md).

For each framework, three runs of a tiny randomly initialised model on CPU, in this process (a
world of one), sharing one job id and one snapshot folder in /dev/shm:

1. snapshots on, a crash (an exception) after step k: the snapshots of the steps before stay;
2. snapshots off, from the start: it restores nothing and writes nothing, and each of its steps
   is the crashed run's step (taking snapshots changed nothing); it runs to the end and is the
   uninterrupted run;
3. snapshots on, started again with other initial weights: it resumes at the newest snapshot
   (the trainer's global step and epoch set to it) with the weights, optimizer and scheduler
   state of the uninterrupted run at that step, and ends with its final weights.

The callbacks' telemetry (the watch, to Kafka) is switched off: these tests are about the
snapshots.
"""
from __future__ import annotations

import logging
import shutil
import uuid
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


class Crash(Exception):
    """The fault of the first run."""


@pytest.fixture
def shm():
    root = Path("/dev/shm") / f"tg-callbacks-{uuid.uuid4().hex[:8]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_telemetry(monkeypatch):
    from trainguard.integrations.callbacks import CallbackWatch

    monkeypatch.setattr(CallbackWatch, "start", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(CallbackWatch, "stop", lambda self: None)
    for name in ("TRAINGUARD_RESUME", "TRAINGUARD_RESUME_STEP", "TRAINGUARD_ROLLBACK_STEP",
                 "TRAINGUARD_JOB", "TRAINGUARD_JOB_ID", "TRAINGUARD_SNAPSHOT_DIR", "RANK",
                 "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def copied(tree):
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: copied(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(copied(v) for v in tree)
    return tree


def differences(a, b, path="") -> list:
    """Where two state trees differ (tensors bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path} keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}/{i}")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def snapshot_files(root: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in root.rglob("*")} if root.exists() else {}


# -- Hugging Face -----------------------------------------------------------------------------
HF_STEPS, HF_EVERY, HF_CRASH_AFTER = 8, 2, 5


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 48

    def __getitem__(self, i):
        ids = torch.randint(32, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def hf_run(transformers, out: Path, callback, seed: int, crash_after: int | None = None):
    """A Trainer of a tiny GPT-2 (dropout on) with ``callback``; ``{step: state}`` after each
    optimizer step and ``"start"``: the global step and state when training began."""
    seen = {}

    def state(trainer_state, model, optimizer, scheduler):
        return {"global_step": trainer_state.global_step, "epoch": trainer_state.epoch,
                "model": copied(model.state_dict()), "optimizer": copied(optimizer.state_dict()),
                "lr": scheduler.get_last_lr()}

    class Probe(transformers.TrainerCallback):
        def on_train_begin(self, args, st, control, model, optimizer, lr_scheduler, **kw):
            seen["start"] = state(st, model, optimizer, lr_scheduler)

        def on_step_begin(self, args, st, control, **kwargs):
            if st.global_step == crash_after:
                raise Crash(f"after step {crash_after}")

        def on_step_end(self, args, st, control, model, optimizer, lr_scheduler, **kw):
            seen[st.global_step] = state(st, model, optimizer, lr_scheduler)

    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8, bos_token_id=0,
        eos_token_id=0))
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=HF_STEPS, per_device_train_batch_size=2,
        learning_rate=1e-2, lr_scheduler_type="linear", warmup_steps=2, save_strategy="no",
        logging_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        dataloader_num_workers=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   callbacks=[callback, Probe()])
    if crash_after is None:
        trainer.train()
    else:
        with pytest.raises(Crash):
            trainer.train()
        callback.snapshots.close()      # the process would be gone; its snapshots stay
    return trainer, seen


def test_hf_trainer_resumes_from_the_in_memory_snapshot(shm, tmp_path, monkeypatch, caplog):
    transformers = pytest.importorskip("transformers")
    from trainguard.integrations.hf import TrainguardCallback

    monkeypatch.setenv("TRAINGUARD_SNAPSHOT_DIR", str(shm))
    job = f"hf-{uuid.uuid4().hex[:6]}"

    _, crashed = hf_run(transformers, tmp_path / "1",
                        TrainguardCallback(job=job, snapshot_every=HF_EVERY), seed=0,
                        crash_after=HF_CRASH_AFTER)
    assert sorted(k for k in crashed if k != "start") == list(range(1, HF_CRASH_AFTER + 1))
    assert len(list(shm.glob(f"own/{job}/rank0/slot*.json"))) == 2      # steps 2 and 4

    files = snapshot_files(shm)
    off = TrainguardCallback(job=job)
    trainer, full = hf_run(transformers, tmp_path / "2", off, seed=0)
    assert full["start"]["global_step"] == 0 and snapshot_files(shm) == files
    assert not any(name in vars(trainer) for name in ("_load_from_checkpoint",
                                                       "_load_rng_state"))
    for step in range(1, HF_CRASH_AFTER + 1):
        assert differences(crashed[step], full[step]) == [], step

    resumed_at = HF_CRASH_AFTER - HF_CRASH_AFTER % HF_EVERY
    with caplog.at_level(logging.WARNING, logger="trainguard.integrations.callbacks"):
        _, again = hf_run(transformers, tmp_path / "3",
                          TrainguardCallback(job=job, snapshot_every=HF_EVERY), seed=1)
    assert f"newest {resumed_at}, restored step {resumed_at} from memory" in caplog.text
    start = again["start"]
    assert start["global_step"] == resumed_at and start["epoch"] == full[resumed_at]["epoch"]
    assert differences(start, full[resumed_at]) == []
    assert sorted(k for k in again if k != "start") == list(range(resumed_at + 1, HF_STEPS + 1))
    assert differences(again[HF_STEPS]["model"], full[HF_STEPS]["model"]) == []
    assert differences(again[HF_STEPS]["optimizer"], full[HF_STEPS]["optimizer"]) == []


# -- Lightning --------------------------------------------------------------------------------
PL_STEPS, PL_EVERY, PL_CRASH_AFTER, PL_BATCHES = 10, 3, 7, 3


def pl_run(pl, callback, seed: int, crash_after: int | None = None):
    """A Lightning fit of a tiny MLP (dropout on, a scheduler stepped every step, 3 batches an
    epoch) with ``callback``; states as :func:`hf_run`."""
    from torch import nn

    seen = {}

    def state(trainer, module):
        return {"global_step": trainer.global_step, "epoch": trainer.current_epoch,
                "model": copied(module.state_dict()),
                "optimizer": copied(trainer.optimizers[0].state_dict()),
                "lr": trainer.lr_scheduler_configs[0].scheduler.get_last_lr()}

    class Probe(pl.Callback):
        def on_train_start(self, trainer, module):
            seen["start"] = state(trainer, module)

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == crash_after:
                raise Crash(f"after step {crash_after}")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            seen[trainer.global_step] = state(trainer, module)

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    g = torch.Generator().manual_seed(123)
    x = torch.randn(4 * PL_BATCHES, 4, generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)),
                                       batch_size=4, shuffle=False)
    torch.manual_seed(seed)
    module = Tiny()
    torch.manual_seed(0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=PL_STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[callback, Probe()])
    if crash_after is None:
        trainer.fit(module, train_dataloaders=data)
    else:
        with pytest.raises(Crash):
            trainer.fit(module, train_dataloaders=data)
        callback.snapshots.close()
    return trainer, seen


def test_lightning_resumes_from_the_in_memory_snapshot(shm, caplog):
    pl = pytest.importorskip("lightning.pytorch")
    from trainguard.checkpoint import SnapshotConfig
    from trainguard.integrations.lightning import TrainguardCallback

    job = f"pl-{uuid.uuid4().hex[:6]}"
    config = SnapshotConfig(every=PL_EVERY, dir=str(shm))
    _, crashed = pl_run(pl, TrainguardCallback(job=job, snapshot_config=config), seed=0,
                        crash_after=PL_CRASH_AFTER)
    assert sorted(k for k in crashed if k != "start") == list(range(1, PL_CRASH_AFTER + 1))

    files = snapshot_files(shm)
    _, full = pl_run(pl, TrainguardCallback(job=job), seed=0)
    assert full["start"]["global_step"] == 0 and snapshot_files(shm) == files
    for step in range(1, PL_CRASH_AFTER + 1):
        assert differences(crashed[step], full[step]) == [], step

    resumed_at = PL_CRASH_AFTER - PL_CRASH_AFTER % PL_EVERY   # the end of an epoch
    with caplog.at_level(logging.WARNING, logger="trainguard.integrations.callbacks"):
        trainer, again = pl_run(pl, TrainguardCallback(job=job, snapshot_config=config),
                                seed=1)
    assert f"newest {resumed_at}, restored step {resumed_at} from memory" in caplog.text
    assert trainer.ckpt_path == f"in-memory snapshot of step {resumed_at}"
    start = again["start"]
    assert start["global_step"] == resumed_at
    assert start["epoch"] == resumed_at // PL_BATCHES == full[resumed_at + 1]["epoch"]
    assert differences({**start, "epoch": None}, {**full[resumed_at], "epoch": None}) == []
    assert sorted(k for k in again if k != "start") == list(range(resumed_at + 1, PL_STEPS + 1))
    assert differences(again[PL_STEPS], full[PL_STEPS]) == []


def test_lightning_snapshots_and_restores_an_fsdp2_sharded_model(shm, tmp_path):
    """Two ranks under torchrun, ``ModelParallelStrategy`` with FSDP2 (DTensor parameters):
    each rank snapshots its shards, a new fit resumes from memory with the crashed fit's
    sharded weights and optimizer state, and ends where the uninterrupted fit ends."""
    pytest.importorskip("lightning.pytorch")
    import json
    import subprocess
    import sys

    job = Path(__file__).with_name("lightning_sharded_job.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "--standalone", str(job), str(shm), str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    lines = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert len(lines) == 2, proc.stderr[-3000:]
    for line in lines:
        assert line["resumed"] == 4 and line["ckpt_path"] == "in-memory snapshot of step 4"
        assert line["crashed_steps"] == [1, 2, 3, 4, 5] and line["steps"] == [5, 6, 7, 8]
        assert line["differences"] == [] and line["end_differences"] == [], line


def test_models_sharded_without_dtensors_get_no_snapshots_and_one_line(shm, caplog):
    """DeepSpeed, FSDP1 (flat parameters) and the HF Trainer's FSDP: training goes on, with no
    snapshot taken and one warning that names the sharding."""
    from trainguard.checkpoint import SnapshotConfig
    from trainguard.integrations.callbacks import CallbackSnapshots

    model = torch.nn.Linear(2, 2)
    with caplog.at_level(logging.WARNING, logger="trainguard.integrations.callbacks"):
        snapshots = CallbackSnapshots(config=SnapshotConfig(every=1, dir=str(shm)))
        snapshots.start("j", model=model, optimizer=torch.optim.SGD(model.parameters(), 0.1),
                        sharded_by="DeepSpeedStrategy")
        snapshots.after_step(1)
        snapshots.close()
    assert snapshots.stopped and not list(shm.rglob("slot*.bin"))
    assert caplog.text.count("sharded by DeepSpeedStrategy are not supported") == 1
