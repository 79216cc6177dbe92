"""A small GPT trained data-parallel on CPU, instrumented for trainguard: the example to copy.

    python -m torch.distributed.run --nproc-per-node 4 --standalone examples/train.py \
        --job demo --steps 300 --checkpoint-every 20

A decoder-only transformer (byte-level, two blocks, 64 wide) learns two-digit additions
("37+45=82") generated from a seed, or the text of ``--data FILE``. Ranks train on different
batches with DistributedDataParallel over gloo.

trainguard, in about ten lines: ``trainguard.init`` starts this rank's collector (rank and world
size from torchrun's environment, Kafka from ``TRAINGUARD_BOOTSTRAP``); ``tg.step`` times every
step and ``s.report`` attaches loss, gradient norm and tokens; ``tg.phase`` tells the heartbeats
what the loop is doing, so a hang shows where it hangs; ``tg.watch_ddp`` measures how long each
rank waits in DDP's gradient all-reduce, which tells a straggler apart. The collector never
blocks or fails the loop when Kafka is unreachable.

Checkpoints: every ``--checkpoint-every`` steps rank 0 writes model, optimizer and step to
``--checkpoint-dir`` (default ``$TRAINGUARD_CHECKPOINT_DIR``, else ``./checkpoints``), atomically
(a temporary file, then a rename), keeping the newest three. It skips a checkpoint whose loss or
gradient norm is not finite, so a NaN is never saved. Every start resumes from the checkpoint
``trainguard.resume_step`` picks: the newest, or after a rollback the newest at or before
``TRAINGUARD_RESUME_STEP``: so do restarts by plain ``torchrun --max-restarts`` and relaunches by
``trainguard run`` (which also sets ``TRAINGUARD_RESUME=1``; that only shows in the log). A new
checkpoint directory starts a new run. Batches are a function of (seed, step, rank), so a
resumed run sees the same data it would have seen; each step reports ``samples``, the rank's
data position, so trainguard can check that a restart neither repeats nor skips data.

In-memory checkpoints (``--snapshot-every N``, docs/RECOVERY.md): every N steps each rank
snapshots model, optimizer, RNG and data position into host memory held by the node agent
(``--snapshot-dir``, default ``$TRAINGUARD_SNAPSHOT_DIR``, else /dev/shm/trainguard-snapshots),
copied off the training thread; ``--persist-every-min M`` also writes one to
``<checkpoint dir>/dcp`` with torch.distributed.checkpoint every M minutes. A restart restores the
newest step every rank has (from memory, the buddy machine's copy, or disk), or the rollback
step, unless a ``torch.save`` checkpoint is newer. Under ``trainguard run --standby`` (or
``examples/inplace.py``) a failed rank is taken over by a warm standby process instead of a
relaunch (docs/RECOVERY.md).

Chaos: faults from ``TRAINGUARD_CHAOS`` are injected by ``trainguard.apps.chaos`` (see
docs/CHAOS.md); each fires once per run, tracked in ``<checkpoint dir>/chaos-state`` unless
``TRAINGUARD_CHAOS_STATE`` says otherwise.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import random
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard
import trainguard.apps.chaos
import trainguard.checkpoint
from trainguard.checkpoint.inplace import InPlace
from trainguard.collectors.resume import requested_resume_step, rollback_identity


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--job", default="example-gpt", help="trainguard job id")
    p.add_argument("--steps", type=int, default=300, help="train until this step")
    p.add_argument("--checkpoint-every", type=int, default=20, metavar="N")
    p.add_argument("--checkpoint-dir", default=os.environ.get("TRAINGUARD_CHECKPOINT_DIR")
                   or "checkpoints")
    p.add_argument("--checkpoint-sleep", type=float, default=0.0, metavar="SECONDS",
                   help="extra seconds each checkpoint takes (a big model on slow storage)")
    p.add_argument("--sharded-checkpoint", action="store_true",
                   help="every rank spends --checkpoint-sleep in phase checkpoint (a sharded "
                        "save, each rank its shard); rank 0 still writes the file")
    p.add_argument("--step-sleep", type=float, default=0.0, metavar="SECONDS",
                   help="extra seconds of 'compute' per step, to pace the job")
    p.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help="gloo's collective timeout: how long a rank waits for a missing peer")
    p.add_argument("--data", default=None, metavar="FILE", help="train on this text file")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--step-log", default=None, metavar="FILE",
                   help="rank 0 appends {step, start, end} per step (for ETTR)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--snapshot-every", type=int, default=0, metavar="N",
                   help="in-memory snapshot every N steps (0: none)")
    p.add_argument("--snapshot-dir", default=trainguard.checkpoint.default_dir(),
                   help="the node agent's --snapshot-dir")
    p.add_argument("--persist-every-min", type=float, default=10.0, metavar="M",
                   help="write a snapshot to <checkpoint dir>/dcp every M minutes")
    # Under trainguard run --standby (TRAINGUARD_INPLACE=1) a rank whose peer died exits, and
    # warm standby processes take the ranks over, restoring from the in-memory snapshots.
    return p.parse_args(argv)


class GPT(nn.Module):
    """Decoder-only transformer: token + position embeddings, causal pre-norm blocks."""

    def __init__(self, vocab=256, dim=64, heads=4, layers=2, context=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(context, dim)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, x):
        t = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t)
        h = self.blocks(self.tok(x) + self.pos(torch.arange(t)), mask=mask, is_causal=True)
        return self.head(self.norm(h))


def load_corpus(path, seed):
    if path:
        text = Path(path).read_bytes()
    else:
        rng = random.Random(seed)
        pairs = [(rng.randrange(100), rng.randrange(100)) for _ in range(20000)]
        text = "".join(f"{a}+{b}={a + b}\n" for a, b in pairs).encode()
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def get_batch(corpus, step, rank, args):
    """The batch of (step, rank): the same after a restart, different on every rank."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 4099 + rank)
    starts = torch.randint(len(corpus) - args.context - 1, (args.batch,), generator=g)
    x = torch.stack([corpus[i:i + args.context] for i in starts])
    y = torch.stack([corpus[i + 1:i + args.context + 1] for i in starts])
    return x, y


def checkpoint_steps(directory: Path) -> list:
    return sorted(int(p.stem.split("_")[1]) for p in directory.glob("ckpt_*.pt"))


def save_checkpoint(directory: Path, step, model, opt, keep=3):
    """Atomically write the state to resume at ``step``; keep the newest ``keep`` files."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ckpt_{step:08d}.pt"
    tmp = directory / f".{path.name}.tmp"
    torch.save({"step": step, "model": model.state_dict(), "optim": opt.state_dict()}, tmp)
    os.replace(tmp, path)
    for old in sorted(directory.glob("ckpt_*.pt"))[:-keep]:
        old.unlink(missing_ok=True)
    return path


def init_distributed(timeout: float):
    """The gloo process group, its keys apart from those of earlier torchrun restarts.

    torchrun's agent keeps one store across restarts; a rank that reads a peer's address left
    there by the previous attempt fails with "connectFullMesh ... Connection refused".
    """
    env, timeout = os.environ, datetime.timedelta(seconds=timeout)
    rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
    agent_hosts = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)),
                          world, is_master=rank == 0 and not agent_hosts, timeout=timeout)
    store = dist.PrefixStore(f"attempt{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)


def restore_snapshot(args, model, opt, rank, world, node, log):
    """The in-memory checkpoint of this rank, and the step it restored (-1: none)."""
    from trainguard.checkpoint import InMemoryCheckpoint, SnapshotConfig

    config = SnapshotConfig(every=args.snapshot_every, dir=args.snapshot_dir,
                            persist_dir=str(Path(args.checkpoint_dir) / "dcp"),
                            persist_every_s=args.persist_every_min * 60.0)
    snapshots = InMemoryCheckpoint(config, job=args.job, rank=rank, world=world, node=node)
    snapshots.track(model=model, optimizer=opt,
                    extra=lambda done: {"samples": done * args.batch})  # the data position
    restored = snapshots.restore(at_most=requested_resume_step(),
                                 rollback=rollback_identity())
    if restored is None:
        return snapshots, -1
    print(f"[snapshot] {snapshots.describe(restored)}", flush=True)
    log(f"restored step {restored.step} from in-memory snapshots")
    return snapshots, restored.step


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    # The model and optimizer first: a warm standby has them built (the first AdamW costs
    # about a second of lazy imports) before it is given a rank; a restore overwrites them.
    torch.manual_seed(args.seed)
    corpus = load_corpus(args.data, args.seed)
    model = GPT(context=args.context)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    inplace = InPlace.from_env(timeout_s=args.timeout)   # under trainguard run --standby
    if inplace is not None:
        inplace.join()                     # a standby waits here for the rank it takes
    else:
        init_distributed(args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    tg = trainguard.init(job=args.job)
    ckpt_dir = Path(args.checkpoint_dir)
    chaos = trainguard.apps.chaos.from_env(rank=rank, node=tg.settings.node,
                                      default_state_dir=ckpt_dir / "chaos-state")
    log = (lambda msg: print(f"[train] {msg}", flush=True)) if rank == 0 else (lambda msg: None)

    snapshots, from_memory = None, -1
    if args.snapshot_every > 0:
        snapshots, from_memory = restore_snapshot(args, model, opt, rank, world, tg.settings.node,
                                                  log)

    # Rank 0 picks the checkpoint, so that all ranks resume from the same one: the newest, or
    # after a rollback the newest at or before TRAINGUARD_RESUME_STEP (trainguard.resume_step).
    chosen = trainguard.resume_step(checkpoint_steps(ckpt_dir)) if rank == 0 else None
    start = torch.tensor([chosen if chosen is not None else -1])
    dist.broadcast(start, src=0)           # every rank of a generation is new: all agree
    start = int(start.item())
    if 0 <= from_memory and start <= from_memory:
        start = from_memory
    elif start >= 0:
        state = torch.load(ckpt_dir / f"ckpt_{start:08d}.pt", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        log(f"resuming from {ckpt_dir}/ckpt_{start:08d}.pt at step {start} "
            f"(TRAINGUARD_RESUME={os.environ.get('TRAINGUARD_RESUME', '')}, "
            f"TRAINGUARD_RESUME_STEP={os.environ.get('TRAINGUARD_RESUME_STEP', '')})")
    else:
        start = 0
        log(f"starting at step 0 (no checkpoint in {ckpt_dir}), {world} ranks")
    if rank == 0 and requested_resume_step() is not None:   # a rollback: the checkpoints
        for later in (s for s in checkpoint_steps(ckpt_dir) if s > start):   # past it are
            (ckpt_dir / f"ckpt_{later:08d}.pt").unlink(missing_ok=True)    # the abandoned branch
    ddp = DDP(model)
    tg.watch_ddp(ddp)  # times the gradient all-reduce wait: compute_time tells stragglers apart

    t_log, n_log = time.perf_counter(), 0
    step_log = open(args.step_log, "a", buffering=1) if args.step_log and rank == 0 else None
    step = start
    while step < args.steps:
        try:
            began = time.time()
            with tg.step(step) as s:
                with tg.phase("data"):
                    chaos.in_data(step)
                    x, y = get_batch(corpus, step, rank, args)
                with tg.phase("forward"):
                    chaos.before_forward(step)
                    if args.step_sleep:
                        time.sleep(args.step_sleep)  # stands in for the compute of a bigger model
                    logits = ddp(x)
                    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                    loss = chaos.loss(step, loss)
                with tg.phase("backward"):
                    opt.zero_grad(set_to_none=True)
                    loss.backward()  # DDP all-reduces the gradients in here
                with tg.phase("optimizer"):
                    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    if torch.isfinite(grad_norm):
                        if snapshots is not None:
                            snapshots.before_update()  # waits only while a copy is unfinished
                        opt.step()  # a non-finite gradient skips the update, as loss scalers do
                with tg.phase("collective"):
                    mean_loss = loss.detach().clone()
                    dist.all_reduce(mean_loss)  # the job-wide loss, for the log
                # samples: this rank's data position, sequences consumed since the start of
                # training (a function of the step here, so a resume restores it exactly)
                s.report(loss=loss.item(), grad_norm=grad_norm.item(), tokens=x.numel(), lr=args.lr,
                         samples=(step + 1) * args.batch)
            if snapshots is not None and snapshots.after_step(step + 1) and step + 1 == \
                    args.snapshot_every:
                log(f"snapshots every {args.snapshot_every} steps into {args.snapshot_dir}")
            if step_log:
                step_log.write(f'{{"step": {step}, "start": {began}, "end": {time.time()}}}\n')
            chaos.after_step(step)
            done = step + 1
            finite = math.isfinite(loss.item()) and math.isfinite(grad_norm.item())
            due = done % args.checkpoint_every == 0 or done == args.steps
            if due and rank != 0 and args.sharded_checkpoint:
                with tg.phase("checkpoint"):         # each rank writes its shard (a sleep here)
                    chaos.in_checkpoint(step)
                    time.sleep(args.checkpoint_sleep)
            if due and rank == 0:
                with tg.phase("checkpoint"):
                    chaos.in_checkpoint(step)
                    if args.checkpoint_sleep:
                        time.sleep(args.checkpoint_sleep)
                    if finite:
                        log(f"checkpoint {save_checkpoint(ckpt_dir, done, model, opt)}")
                    else:
                        log(f"step {step}: loss or gradient norm not finite, checkpoint skipped")
            n_log += 1
            if done % args.log_every == 0:
                elapsed, t_log = time.perf_counter() - t_log, time.perf_counter()
                log(f"step {step} loss {mean_loss.item() / world:.4f} "
                    f"grad_norm {grad_norm.item():.3f} "
                    f"{elapsed / n_log * 1000:.0f} ms/step")
                n_log = 0
        except RuntimeError as exc:  # a peer died: its collective failed here
            if inplace is None:
                raise
            inplace.leave(exc, snapshots)       # a warm standby takes this rank over
        step += 1

    log(f"done: steps {start}..{args.steps - 1}")
    if snapshots is not None:
        snapshots.close()
        st = snapshots.stats
        log(f"snapshots: {st['committed']} taken, {st['bytes']} bytes each, "
            f"{st['refused']} refused, training waited "
            f"{st['stall_s'] * 1000:.1f} ms for them")
    dist.barrier()
    dist.destroy_process_group()
    tg.close()


if __name__ == "__main__":
    main()
