"""A Hugging Face Trainer job (a GPT-2 shrunk to two layers, random init, no downloads),
watched by trainguard with one line: ``callbacks=[TrainguardCallback()]``.

    HF_HUB_OFFLINE=1 trainguard run --job hf --checkpoint-dir out -- \
        torchrun --nproc-per-node 2 examples/hf_trainer.py --steps 60

Batches of random token ids are a function of (index, rank). Checkpoints ``checkpoint-N`` go
to ``--output-dir`` (default ``$TRAINGUARD_CHECKPOINT_DIR``, else ``./hf-out``) every
``--save-steps``; a relaunch by ``trainguard run`` resumes from the one trainguard names,
without a line of code. Faults for tests as in plain_ddp.py (``FAULT_SLOW``,
``FAULT_SLOW_DATA``, ``FAULT_HANG``, ``FAULT_KILL``).
"""
from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

import torch
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                          TrainingArguments)

from plain_ddp import fault, loader_delay
from trainguard.integrations.hf import TrainguardCallback


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, context: int, vocab: int, rank: int, batch: int, ckpt: Path):
        self.n, self.context, self.vocab, self.rank = n, context, vocab, rank
        self.batch, self.ckpt, self.hang, self.calls = batch, ckpt, fault("FAULT_HANG"), 0
        self.delay = loader_delay(rank) / batch  # per sample: the batch's delay in all

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.calls += 1
        if self.hang and self.hang[0] == self.rank and self.calls // self.batch >= self.hang[1]:
            marker = self.ckpt / f"hang-fired-{self.rank}"
            if not marker.exists():
                marker.touch()
                print(f"[hf] rank {self.rank} hangs in its data loader", flush=True)
                while True:
                    time.sleep(0.1)
        if self.delay:
            time.sleep(self.delay)
        g = torch.Generator().manual_seed(i * 31 + self.rank)
        ids = torch.randint(self.vocab, (self.context,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


class Faults(TrainerCallback):
    def __init__(self, rank, ckpt):
        self.rank, self.ckpt, self.kill = rank, ckpt, fault("FAULT_KILL")

    def on_step_begin(self, args, state, control, **kwargs):
        if self.kill and self.kill[0] == self.rank and state.global_step >= self.kill[1]:
            marker = self.ckpt / f"kill-fired-{self.rank}"
            if not marker.exists():
                marker.touch()
                print(f"[hf] rank {self.rank} SIGKILLs itself", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)


def _indexed_cpu(storage, location):
    """transformers <= 5.17 (the newest that installs beside faust's click < 8.4) resumes a
    CPU DDP job's optimizer with ``map_location="cpu:0"``, which torch does not restore (later
    transformers pass "cpu"): restore "cpu:N" as "cpu"."""
    return storage if location.startswith("cpu:") else None


def main(argv=None):
    torch.serialization.register_package(30, lambda obj: None, _indexed_cpu)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--output-dir", default=os.environ.get("TRAINGUARD_CHECKPOINT_DIR")
                   or "hf-out")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", 0))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=32, vocab_size=128,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    slow = fault("FAULT_SLOW")
    if slow and slow[0] == rank:
        calls = iter(range(1 << 62))
        model.register_forward_pre_hook(
            lambda module, inputs: time.sleep(slow[1]) if next(calls) >= slow[2] else None)
    training = TrainingArguments(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.batch,
        save_steps=args.save_steps, save_total_limit=3, logging_steps=10_000, report_to=[],
        use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True,
        learning_rate=1e-3, max_grad_norm=1.0, seed=0, save_only_model=False)
    data = Tokens(args.steps * args.batch * 2, 16, config.vocab_size, rank, args.batch, out)
    trainer = Trainer(model=model, args=training, train_dataset=data,
                      callbacks=[TrainguardCallback(), Faults(rank, out)])
    trainer.train()
    if rank == 0:
        print(f"[hf] done at step {trainer.state.global_step}", flush=True)


if __name__ == "__main__":
    main()
