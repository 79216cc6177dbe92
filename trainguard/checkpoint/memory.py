"""One object for a training loop: snapshots taken, and restored after a restart."""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Optional

from trainguard.files import write_atomic

from . import layout
from .restore import Restored, Sources, agree_and_load, all_min
from .snapshot import SnapshotConfig, Snapshotter
from .state import apply, capture

__all__ = ["InMemoryCheckpoint"]

log = logging.getLogger(__name__)

#: In a rank's snapshot folder: the rollback it applied (``{"id", "step"}``).
ROLLBACK_MARKER = "rollback.json"


class InMemoryCheckpoint:
    """Snapshots of one rank every ``config.every`` steps, and the restore after a restart.

    ``track`` names what a snapshot holds (model, optimizer, scheduler, data: anything with
    ``state_dict``/``load_state_dict``; RNG states are always kept). ``extra`` (called with the
    steps done, returning plain data, e.g. the data position) is stored too and handed back by
    :meth:`restore` as ``Restored.tree["extra"]``.
    """

    def __init__(self, config: SnapshotConfig, *, job: str, rank: int, world: int, node: str,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.job, self.rank, self.world, self.node = job, rank, world, node
        self.snapshotter = Snapshotter(config, job=job, rank=rank, world=world, node=node,
                                       clock=clock)
        self.sources = Sources(config, job=job, rank=rank)
        self._objects: dict = {}
        self._extra: Optional[Callable[[int], dict]] = None

    def track(self, *, model=None, optimizer=None, scheduler=None, data=None,
              extra: Optional[Callable[[int], dict]] = None) -> "InMemoryCheckpoint":
        self._objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
                         "data": data}
        self._extra = extra
        return self

    @property
    def stats(self) -> dict:
        return {**self.snapshotter.stats, "memory_bytes": self.snapshotter.memory_bytes()}

    def restore(self, *, group=None, at_most: Optional[int] = None,
                rollback: Optional[str] = None) -> Optional[Restored]:
        """Load the newest step every rank has (at most ``at_most``) into the tracked objects;
        None (nothing loaded) when there is none. A collective: every rank calls it.

        ``rollback`` tells this rollback from others to the same step (``trainguard.collectors
        .resume.rollback_identity``): a restart that finds it applied already by some rank,
        the environment of its job being the same for every restart inside it, resumes the
        newest step instead of rolling back again."""
        began = time.perf_counter()
        restored = self.find(group=group, at_most=at_most, rollback=rollback)
        if restored is not None:
            apply(restored.tree, **self._objects)
            restored.seconds = time.perf_counter() - began
        return restored

    def _unless_applied(self, at_most: Optional[int], rollback: Optional[str],
                        group) -> Optional[int]:
        """``at_most``, or None when the rollback to it was applied already (any rank's
        marker: a collective whenever ``at_most`` and ``rollback`` are given, as they are on
        every rank alike)."""
        if at_most is None or rollback is None:
            return at_most
        applied = self._marker() == {"id": rollback, "step": at_most}
        if all_min(0 if applied else 1, group) == 0:
            log.info("trainguard: the rollback to step %d (%s) was applied already; resuming "
                     "the newest step", at_most, rollback)
            return None
        return at_most

    def _marker(self) -> Optional[dict]:
        try:
            return json.loads((self.snapshotter.dir / ROLLBACK_MARKER).read_text())
        except (OSError, ValueError):
            return None

    def _after_rollback(self, restored: Optional[Restored], at_most: Optional[int],
                        rollback: Optional[str] = None) -> None:
        if at_most is None:
            return
        self.drop_newer(restored.step if restored is not None else at_most)  # from elsewhere
        if rollback is not None:          # applied: a restart in the same job goes on from here
            marker = self.snapshotter.dir / ROLLBACK_MARKER
            try:
                marker.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(marker, json.dumps({"id": rollback, "step": at_most}))
            except OSError as exc:
                log.warning("trainguard: %s not written (%s): a restart in this job would "
                            "roll back to step %d again", marker, exc, at_most)

    def drop_newer(self, step: int) -> int:
        """After a rollback to ``step``: this rank's snapshots of later steps are the abandoned
        branch; they go, so that a later restart cannot restore them: its own (their
        manifests), the replicas the node agents hold (here and on the peers that answer) and
        its disk copies. How many went."""
        own = 0
        for path in self.snapshotter.dir.glob("slot*.bin"):
            manifest = layout.read_manifest(path)
            if manifest is not None and manifest.get("step", -1) > step:
                layout.manifest_path(path).unlink(missing_ok=True)
                own += 1
        reply = self.sources.drop_agent_newer(step)
        replicas = reply.get("dropped") if reply and type(reply.get("dropped")) is int else 0
        disk = self.sources.drop_disk_newer(step)
        if reply is None:
            missed = "; no node agent answered: copies on other machines are not dropped"
        elif reply.get("unreached"):
            missed = (f"; peers not reached: {', '.join(map(str, reply['unreached']))} (the "
                      "node agent sends them the drop again)")
        else:
            missed = ""
        if own or replicas or disk or missed:
            log.warning("trainguard: rank %d rolled back to step %d: dropped the later "
                        "snapshots (%d own, %d replicas, %d on disk)%s", self.rank, step, own,
                        replicas, disk, missed)
        return own + replicas + disk

    def find(self, *, group=None, at_most: Optional[int] = None,
             rollback: Optional[str] = None) -> Optional[Restored]:
        """:meth:`restore` without loading: the newest step every rank has, read and verified,
        its state in ``Restored.tree`` (for a framework that loads each part itself, see
        :func:`~trainguard.checkpoint.state.apply`); after a rollback the later snapshots go,
        as there. A collective: every rank calls it."""
        began = time.perf_counter()
        at_most = self._unless_applied(at_most, rollback, group)
        restored = agree_and_load(self.sources, group=group, at_most=at_most)
        if restored is not None:
            restored.seconds = time.perf_counter() - began
        self._after_rollback(restored, at_most, rollback)
        return restored

    def describe(self, restored: Restored) -> str:
        """One line: ``rank R on NODE: newest N, restored step S from SOURCE in T ms``."""
        return (f"rank {self.rank} on {self.node}: newest {restored.newest}, restored step "
                f"{restored.step} from {restored.source} in {restored.seconds * 1000:.0f} ms")

    def after_step(self, done: int) -> bool:
        """Take a snapshot when ``done`` (steps completed) is due; True when one started."""
        if not self.snapshotter.due(done):
            return False
        extra = self._extra(done) if self._extra is not None else None
        tree = capture(done, extra=extra, **self._objects)
        return self.snapshotter.take(done, tree)

    def before_update(self) -> None:
        """Call before the optimizer changes the weights: waits for an unfinished copy."""
        self.snapshotter.before_update()

    def close(self) -> None:
        self.snapshotter.close()

    def __enter__(self) -> "InMemoryCheckpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
