"""In-memory checkpoints that survive a crashed rank and a lost machine (docs/RECOVERY.md).

    ckpt = trainguard.checkpoint.InMemoryCheckpoint(
        trainguard.checkpoint.SnapshotConfig(every=10, persist_dir="ckpt", persist_every_s=600),
        job="my-job", rank=rank, world=world, node=node)
    ckpt.track(model=model, optimizer=opt, scheduler=sched)
    restored = ckpt.restore(at_most=rollback_step)   # all ranks: the newest common step
    for step in range(restored.step if restored else 0, total):
        ...                       # forward, backward
        ckpt.before_update()      # waits only if the previous copy is still running
        opt.step()
        ckpt.after_step(step + 1)

torch is imported only when a snapshot is taken or restored; importing this package is cheap.
"""
from __future__ import annotations

__all__ = ["InMemoryCheckpoint", "SnapshotConfig", "Snapshotter", "Restored", "buddies",
           "default_dir"]


def __getattr__(name):
    if name == "InMemoryCheckpoint":
        from .memory import InMemoryCheckpoint
        return InMemoryCheckpoint
    if name in ("SnapshotConfig", "Snapshotter", "default_dir"):
        from . import snapshot
        return getattr(snapshot, name)
    if name == "Restored":
        from .restore import Restored
        return Restored
    if name == "buddies":
        from .placement import buddies
        return buddies
    raise AttributeError(name)
