"""After a restart: the step every rank can restore, and its bytes from the nearest copy.

Each rank lists the steps it can get (its machine's memory, its node agent's replicas and the
peers' copies, the disk copies), capped at the rollback step when the action service chose one.
The ranks agree through the process group: the newest step all of them have (``all_reduce``
MIN of each rank's newest, then MIN of "I have it"; else the next older). Each rank then reads
that step from its own machine's memory, else from its buddy's copy (through the node agent),
else from disk, and checks its checksum; only when every rank holds verified bytes is the state
loaded, so a torn snapshot on one rank moves all ranks to an older step together.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from . import layout
from .snapshot import SnapshotConfig, load_persisted, rank_dir

__all__ = ["Restored", "Sources", "agree_and_load", "all_min", "agreement_group"]

log = logging.getLogger(__name__)


@dataclass
class Restored:
    """What a restore found: the step, where this rank's bytes came from, the state tree;
    ``newest``: the newest step this rank had; ``seconds``: how long the restore took."""

    step: int
    source: str
    tree: Any
    newest: int = -1
    seconds: float = 0.0


class Sources:
    """The copies of one rank's snapshots: ``own`` (this machine's memory), ``agent`` (the node
    agent: its replicas and its peers'), ``disk``."""

    def __init__(self, config: SnapshotConfig, *, job: str, rank: int):
        self.config, self.job, self.rank = config, job, rank
        self.agent_socket = str(Path(config.dir) / "agent.sock")
        self._agent_steps: dict = {}

    def own(self) -> dict:
        out = {}
        for path in rank_dir(self.config.dir, self.job, self.rank).glob("slot*.bin"):
            manifest = layout.read_manifest(path)
            if manifest is not None and manifest.get("rank") == self.rank:
                out[manifest["step"]] = path
        return out

    def agent(self) -> dict:
        reply = self._ask({"op": "steps", "job": self.job, "rank": self.rank})
        steps = reply.get("steps") if reply and reply.get("ok") else None
        self._agent_steps = {int(s): src for s, src in (steps or {}).items()}
        return self._agent_steps

    def disk(self) -> dict:
        """``{step: folder}`` of this rank's complete disk copies of this job (another job's
        copies in the same folder are not ours)."""
        if not self.config.persist_dir:
            return {}
        out = {}
        for m in Path(self.config.persist_dir).glob(f"step_*/rank_{self.rank}/snapshot.json"):
            manifest = layout.read_manifest(m.with_suffix(".bin"))
            if manifest is not None and manifest.get("job") in (self.job, None):
                out[manifest["step"]] = m.parent
        return out

    def steps(self) -> set:
        return set(self.own()) | set(self.agent()) | set(self.disk())

    def drop_agent_newer(self, step: int) -> Optional[dict]:
        """After a rollback to ``step``: the node agent drops the replicas of this rank past
        it, on this machine and on its peers (None: no agent answered)."""
        return self._ask({"op": "drop_newer", "job": self.job, "rank": self.rank, "step": step})

    def drop_disk_newer(self, step: int) -> int:
        """After a rollback to ``step``: this rank's disk copies past it go; how many."""
        import shutil

        dropped = 0
        for done, folder in self.disk().items():
            if done > step:
                shutil.rmtree(folder, ignore_errors=True)
                try:
                    folder.parent.rmdir()         # the step's folder, once every rank left it
                except OSError:
                    pass
                dropped += 1
        return dropped

    def _ask(self, header: dict) -> Optional[dict]:
        from .wire import WireError, request

        try:
            reply, _ = request(self.agent_socket, header, timeout=self.config.agent_timeout_s)
            return reply
        except (OSError, WireError) as exc:
            log.debug("node agent at %s: %s", self.agent_socket, exc)
            return None

    def load(self, step: int) -> Optional[Restored]:
        """The verified state of ``step`` from the nearest copy, or None."""
        path = self.own().get(step)
        if path is not None:
            tree = _read(path)
            if tree is not None:
                return Restored(step, "memory", tree)
        if step in self._agent_steps:
            reply = self._ask({"op": "fetch", "job": self.job, "rank": self.rank, "step": step})
            if reply and reply.get("ok"):
                tree = _read(Path(reply["path"]))
                if tree is not None:
                    src = reply.get("source", "agent")
                    return Restored(step, "memory" if src == "local" else src, tree)
        folder = self.disk().get(step)
        if folder is not None:
            try:
                data = load_persisted(folder)
                return Restored(step, "disk", layout.read_snapshot(data))
            except (layout.TornSnapshot, OSError, RuntimeError, ValueError) as exc:
                log.warning("trainguard: disk copy %s not restored: %s", folder, exc)
        return None


def _read(path: Path) -> Optional[Any]:
    """The tree of a snapshot file, its bytes copied and checked; None when torn."""
    manifest = layout.read_manifest(path)
    if manifest is None:
        return None
    try:
        with open(path, "rb") as f:
            data = bytearray(manifest["nbytes"])
            if f.readinto(data) != manifest["nbytes"]:
                raise layout.TornSnapshot("shorter than its manifest")
        return layout.read_snapshot(data, manifest["nbytes"], manifest["checksum"])
    except (OSError, layout.TornSnapshot, KeyError, ValueError) as exc:
        log.warning("trainguard: snapshot %s not restored: %s", path, exc)
        return None


def all_min(value: int, group=None) -> int:
    """The smallest ``value`` of all ranks (a collective); ``value`` without a process group."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


_all_min = all_min


def agreement_group():
    """The process group for the restore's agreement (CPU tensors): None (the default group)
    without one or when it takes CPU tensors (gloo, or ``cpu:gloo,cuda:nccl``), else a new
    gloo group of all ranks (a collective: every rank calls it)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    if "gloo" in str(dist.get_backend()):
        return None
    return dist.new_group(backend="gloo")


def agree_and_load(sources: Sources, *, group=None, at_most: Optional[int] = None,
                   all_min: Callable[[int, Any], int] = _all_min) -> Optional[Restored]:
    """The newest step every rank can restore, loaded and verified on every rank (None: start
    from scratch). Every rank makes the same collective calls, in the same order."""
    ceiling = at_most if at_most is not None else 1 << 62
    have = sources.steps()
    while True:
        mine = max((s for s in have if s <= ceiling), default=-1)
        step = all_min(mine, group)
        if step < 0:
            return None
        if all_min(1 if step in have else 0, group):
            restored = sources.load(step)
            if all_min(1 if restored is not None else 0, group):
                restored.newest = max(have)
                return restored
            log.warning("trainguard: step %d could not be restored on every rank; trying an "
                        "older one", step)
        ceiling = step - 1
