"""The rank side of a restart in place (``trainguard run --standby``, docs/RECOVERY.md).

Under the standby launcher (:mod:`trainguard.launcher.inplace`, which sets
``TRAINGUARD_INPLACE=1``) a training script joins each *generation*'s process group through
the launcher's store instead of ``init_process_group`` from the environment, and leaves at
once when a collective fails because a peer died; a warm standby (the same script, started
ahead, its imports done) takes the rank, restores from the in-memory snapshots and goes on.
After a rollback in place the standby's ``TRAINGUARD_RESUME_STEP`` is the rollback's step
(:func:`trainguard.resume_step`)::

    inplace = InPlace.from_env(timeout_s=60)
    if inplace is not None:
        inplace.join()            # a standby waits here until it is given a rank
    else:
        dist.init_process_group("gloo")
    ...
    try:
        train_one_step()
    except RuntimeError as exc:   # a peer died: its collective failed here
        if inplace is None:
            raise
        inplace.leave(exc, snapshots)

torch is imported only in :meth:`InPlace.join`.
"""
from __future__ import annotations

import datetime
import os
import time

__all__ = ["InPlace", "ENABLED_ENV", "STANDBY_ENV"]

#: set by the standby launcher for every process it starts
ENABLED_ENV = "TRAINGUARD_INPLACE"
#: the number of a standby process (absent for the ranks of the first generation)
STANDBY_ENV = "TRAINGUARD_STANDBY"


class InPlace:
    """Join a generation's process group; when a collective fails, leave (the launcher hands
    the rank to a warm standby)."""

    #: the exit status of a rank that leaves because a peer failed
    LEFT = 75

    def __init__(self, timeout_s: float = 1800.0, environ=None):
        self.timeout_s = timeout_s
        self.environ = os.environ if environ is None else environ
        self.store = None
        self.generation = 0
        self.rank = self.world = -1

    @classmethod
    def from_env(cls, timeout_s: float = 1800.0, environ=None) -> "InPlace | None":
        """An :class:`InPlace` when this process runs under the standby launcher, else None."""
        environ = os.environ if environ is None else environ
        return cls(timeout_s, environ) if environ.get(ENABLED_ENV) == "1" else None

    @property
    def standby(self) -> bool:
        return self.environ.get(STANDBY_ENV) is not None

    def join(self) -> None:
        import torch.distributed as dist

        env = self.environ
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self.store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                                   is_master=False, timeout=timeout)
        self.world = int(env["WORLD_SIZE"])
        standby = env.get(STANDBY_ENV)
        if standby is None:
            self.rank = int(env["RANK"])
            self.generation = int(self.store.get("generation"))
        else:                                  # warm: imports done; wait for a rank
            key = f"standby/{standby}"
            parent = os.getppid()
            while True:
                try:
                    self.store.wait([key], datetime.timedelta(seconds=60))
                    break
                except Exception:       # timed out, or the launcher's store is gone
                    if os.getppid() != parent:
                        os._exit(self.LEFT)     # the launcher died: nothing to wait for
                    time.sleep(1.0)
            given = self.store.get(key).decode().split()     # rank generation [local rank]
            self.rank, self.generation = int(given[0]), int(given[1])
            env["RANK"], env["LOCAL_RANK"] = given[0], given[2] if len(given) > 2 else given[0]
            rollback = f"resume_step/{self.generation}"   # a rollback in place: restore
            if self.store.check([rollback]):                # at or before that step
                step = self.store.get(rollback).decode()
                env["TRAINGUARD_RESUME_STEP"] = env["TRAINGUARD_ROLLBACK_STEP"] = step
                env["TRAINGUARD_ROLLBACK_ID"] = f"inplace-{self.generation}"   # its own
            else:   # a step inherited from the launch was the first generation's: this
                env.pop("TRAINGUARD_RESUME_STEP", None)     # one resumes the newest, not
                env.pop("TRAINGUARD_ROLLBACK_STEP", None)   # that step again
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(f"generation{self.generation}", self.store),
            rank=self.rank, world_size=self.world, timeout=timeout)

    def leave(self, exc: BaseException, snapshots=None) -> None:
        """Exit at once: a gloo collective blocked on a live peer is released only when that
        peer's process goes, so every rank of the failed generation goes, and quickly.
        ``snapshots`` (an ``InMemoryCheckpoint``): its unfinished copy is completed or torn
        first."""
        if snapshots is not None:
            snapshots.before_update()
        print(f"[inplace] rank {self.rank} leaves generation {self.generation} at "
              f"{time.time():.3f}: {type(exc).__name__}", flush=True)
        os._exit(self.LEFT)
