"""A rank's in-memory snapshots: copied off the training thread into the node agent's memory.

Every ``every`` steps :meth:`Snapshotter.take` hands the state's tensors to a background
thread, which copies them into a *slot*: a file under the node agent's snapshot folder
(``/dev/shm``, memory, not disk), mapped once and reused, ``slots`` per rank. Then it writes the
manifest with the checksum of the bytes. The file belongs to the folder, not to the process: a
rank that crashes leaves its snapshots behind for its successor, and the agent replicates each
to its buddy machine (:mod:`trainguard.collectors.snapshot_store`).

The training thread waits only where it must: :meth:`Snapshotter.before_update` (call it before
the optimizer changes the weights) returns at once unless the copy of the previous snapshot is
still running. Every ``persist_every_s`` seconds a committed snapshot is also written to
``persist_dir`` with ``torch.distributed.checkpoint``, on a thread of its own.

Layout: ``<dir>/own/<job>/rank<R>/slot<i>.bin`` and ``slot<i>.json`` (the manifest);
``<persist_dir>/step_<S>/rank_<R>/`` for the disk copies.
"""
from __future__ import annotations

import logging
import mmap
import os
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from . import layout

__all__ = ["SnapshotConfig", "Snapshotter", "DEFAULT_DIR", "default_dir", "rank_dir"]

log = logging.getLogger(__name__)

DEFAULT_DIR = "/dev/shm/trainguard-snapshots"


def default_dir(environ=None) -> str:
    """The node agent's snapshot folder as a training script finds it:
    ``TRAINGUARD_SNAPSHOT_DIR``, else :data:`DEFAULT_DIR`.

    >>> default_dir({"TRAINGUARD_SNAPSHOT_DIR": "/dev/shm/tg"}), default_dir({}) == DEFAULT_DIR
    ('/dev/shm/tg', True)
    """
    environ = os.environ if environ is None else environ
    return environ.get("TRAINGUARD_SNAPSHOT_DIR") or DEFAULT_DIR


@dataclass(kw_only=True)
class SnapshotConfig:
    """In-memory checkpoints of one rank."""

    every: int = 0                        #: steps between snapshots (0: none)
    dir: str = DEFAULT_DIR                #: the node agent's snapshot folder (its --snapshot-dir)
    slots: int = 2                        #: snapshots kept per rank on its machine
    persist_dir: Optional[str] = None     #: where torch.distributed.checkpoint writes copies
    persist_every_s: float = 600.0        #: seconds between copies to disk
    persist_keep: int = 2                 #: disk copies kept per rank
    max_bytes: Optional[int] = None       #: refuse a snapshot bigger than this
    agent_timeout_s: float = 60.0         #: how long a restore waits for the agent's answers

    def __post_init__(self):
        if not (isinstance(self.every, int) and self.every >= 0):
            raise ValueError(f"snapshot every {self.every!r} must be a whole number of steps >= 0")
        if not (isinstance(self.slots, int) and self.slots >= 2):
            raise ValueError(f"snapshot slots {self.slots!r} must be at least 2 (one complete "
                             "while the next is copied)")
        if not self.persist_every_s > 0:
            raise ValueError(f"persist_every_s {self.persist_every_s!r} must be positive")


def rank_dir(root: "str | os.PathLike", job: str, rank: int) -> Path:
    return Path(root) / "own" / job / f"rank{int(rank)}"


class _Slot:
    def __init__(self, path: Path):
        self.path = path
        self.capacity = 0
        self.mm: Optional[mmap.mmap] = None
        self.fd: Optional[int] = None
        manifest = layout.read_manifest(path)
        self.step = manifest["step"] if manifest else -1

    def reserve(self, nbytes: int) -> None:
        if self.mm is not None and nbytes <= self.capacity:
            return
        self.close()
        capacity = max(nbytes + nbytes // 4, 1 << 16)     # room for a growing optimizer state
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self.fd, capacity)
        self.mm = mmap.mmap(self.fd, capacity)
        self.capacity = capacity

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
            os.close(self.fd)
        self.mm, self.fd, self.capacity = None, None, 0


class Snapshotter:
    """Takes a rank's snapshots; ``clock`` (monotonic seconds) paces the disk copies."""

    def __init__(self, config: SnapshotConfig, *, job: str, rank: int, world: int, node: str,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        self.config = config
        self.job, self.rank, self.world, self.node = job, rank, world, node
        self.clock, self.wall = clock, wall
        self.dir = rank_dir(config.dir, job, rank)
        self._slots: list = []
        self._cond = threading.Condition()
        self._pending: Optional[tuple] = None
        self._busy = False
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._persist_thread: Optional[threading.Thread] = None
        self._last_persist = clock()
        self._refused_once = False
        self.stats = {"taken": 0, "committed": 0, "refused": 0, "stall_s": 0.0, "copy_s": 0.0,
                      "hash_s": 0.0, "bytes": 0, "persisted": 0, "last_step": -1, "failed": 0}

    # -- the training thread ---------------------------------------------------------------
    def due(self, done: int) -> bool:
        return self.config.every > 0 and done > 0 and done % self.config.every == 0

    def take(self, done: int, tree: dict) -> bool:
        """Start a snapshot of ``tree`` (steps ``done``); False when it was refused."""
        self._wait()
        skeleton, tensors = layout.flatten(tree)
        sources, infos = layout.local_tensors(tensors)
        estimate = sum(t.numel() * t.element_size() for t in sources) + (1 << 16)
        if not self._fits(estimate):
            return False
        self._start()
        with self._cond:
            self._pending, self._busy = (done, skeleton, sources, infos), True
            self._cond.notify_all()
        self.stats["taken"] += 1
        return True

    def before_update(self) -> None:
        """Wait for the copy in progress (call before the optimizer changes the weights)."""
        self._wait()

    def memory_bytes(self) -> int:
        """Host memory held by this rank's snapshot slots."""
        return sum(s.capacity for s in self._slots)

    def close(self) -> None:
        self._wait()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)
        if self._persist_thread is not None:
            self._persist_thread.join(60.0)
        for s in self._slots:
            s.close()

    def _wait(self) -> None:
        if not self._busy:
            return
        began = time.perf_counter()
        with self._cond:
            while self._busy:
                self._cond.wait()
        self.stats["stall_s"] += time.perf_counter() - began

    def _fits(self, nbytes: int) -> bool:
        why = None
        if self.config.max_bytes is not None and nbytes > self.config.max_bytes:
            why = f"it needs {nbytes} bytes, more than max_bytes {self.config.max_bytes}"
        else:
            try:
                Path(self.config.dir).mkdir(parents=True, exist_ok=True)
                st = os.statvfs(self.config.dir)
                held = max((s.capacity for s in self._slots), default=0)
                if nbytes > st.f_bavail * st.f_frsize + held:
                    why = (f"it needs {nbytes} bytes and {self.config.dir} has "
                           f"{st.f_bavail * st.f_frsize} free")
            except OSError as exc:
                why = f"{self.config.dir}: {exc}"
        if why is None:
            return True
        self.stats["refused"] += 1
        if not self._refused_once:
            self._refused_once = True
            log.warning("trainguard: in-memory snapshot of rank %d refused (%s); training goes "
                        "on without it", self.rank, why)
        return False

    # -- the copy thread -------------------------------------------------------------------
    def _start(self) -> None:
        if self._thread is not None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self._slots = [_Slot(self.dir / f"slot{i}.bin") for i in range(self.config.slots)]
        self._thread = threading.Thread(target=self._run, name="trainguard-snapshot",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                done, skeleton, sources, infos = self._pending
                self._pending = None
            try:
                self._copy(done, skeleton, sources, infos)
            except Exception as exc:  # a snapshot lost is not a training failure
                self.stats["failed"] += 1
                if self.stats["failed"] in (1, 10, 100) or self.stats["failed"] % 1000 == 0:
                    log.warning("trainguard: snapshot of step %d failed (%d so far): %s", done,
                                self.stats["failed"], exc)
            finally:
                del sources
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _copy(self, done: int, skeleton, sources: list, infos: list) -> None:
        import torch

        p = layout.plan(skeleton, sources, infos, {"job": self.job, "rank": self.rank,
                                                   "step": done})
        slot = min(self._slots, key=lambda s: s.step)      # the oldest (or an empty one)
        layout.manifest_path(slot.path).unlink(missing_ok=True)   # torn from here on
        slot.step = -1
        slot.reserve(p.nbytes)
        began = time.perf_counter()
        layout.write_header(slot.mm, p)
        layout.zero_gaps(slot.mm, p)
        for dtype, offset, nbytes, members in p.groups:
            if nbytes:
                dst = torch.frombuffer(slot.mm, dtype=torch.uint8, count=nbytes, offset=offset)
                torch.cat([sources[i].reshape(-1) for i in members],
                          out=dst.view(getattr(torch, dtype)))
                del dst
        copied = time.perf_counter()
        checksum = layout.digest(slot.mm, p.nbytes)
        self.stats["copy_s"] += copied - began
        self.stats["hash_s"] += time.perf_counter() - copied
        layout.write_manifest(slot.path, {
            "job": self.job, "rank": self.rank, "world": self.world, "step": done,
            "node": self.node, "nbytes": p.nbytes, "checksum": checksum, "ts": self.wall()})
        slot.step = done
        self.stats["committed"] += 1
        self.stats["bytes"] = p.nbytes
        self.stats["last_step"] = done
        if self.config.persist_dir and self.clock() - self._last_persist >= \
                self.config.persist_every_s:
            self._persist_later(slot.path)

    # -- the disk copies -------------------------------------------------------------------
    def _persist_later(self, path: Path) -> None:
        if self._persist_thread is not None and self._persist_thread.is_alive():
            return                                  # the previous one is still writing
        self._last_persist = self.clock()
        self._persist_thread = threading.Thread(target=self._persist, args=(path,),
                                                name="trainguard-persist", daemon=True)
        self._persist_thread.start()

    def _persist(self, path: Path) -> None:
        try:
            manifest = layout.read_manifest(path)
            if manifest is None:
                return
            with open(path, "rb") as f:
                data = bytearray(manifest["nbytes"])
                f.readinto(data)
            if layout.digest(data, manifest["nbytes"]) != manifest["checksum"]:
                return                      # overwritten by the next snapshot meanwhile
            persist(self.config.persist_dir, self.rank, manifest, data,
                    keep=self.config.persist_keep)
            self.stats["persisted"] += 1
        except Exception as exc:
            log.warning("trainguard: disk copy of the snapshot failed: %s", exc)


def persist(root: "str | os.PathLike", rank: int, manifest: dict, data: bytearray,
            keep: int = 2) -> Path:
    """Write one snapshot with torch.distributed.checkpoint (each tensor an entry; no process
    group: each rank its own folder), then its manifest; keep the newest ``keep`` per rank."""
    import torch.distributed.checkpoint as dcp

    tree = _as_tensors(data)
    folder = Path(root) / f"step_{manifest['step']:08d}" / f"rank_{int(rank)}"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    with warnings.catch_warnings():             # "assuming ... a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tree, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    layout.write_manifest(folder / "snapshot.bin", {**manifest, "persisted": True})
    steps = sorted(Path(root).glob(f"step_*/rank_{int(rank)}/snapshot.json"))
    for old in steps[:-keep]:
        shutil.rmtree(old.parent, ignore_errors=True)
    return folder


def _as_tensors(data: bytearray) -> dict:
    """A snapshot's bytes as DCP's state dict: ``meta`` (the header) and ``t<i>`` (tensors)."""
    import json
    import struct

    import torch

    (length,) = struct.unpack("<Q", bytes(data[len(layout.MAGIC):len(layout.MAGIC) + 8]))
    head = len(layout.MAGIC) + 8 + length
    meta = json.loads(bytes(data[len(layout.MAGIC) + 8:head]))
    out = {"meta": torch.frombuffer(data, dtype=torch.uint8, count=head).clone()}
    for i, e in enumerate(meta["tensors"]):
        if e["nbytes"]:
            out[f"t{i}"] = torch.frombuffer(data, dtype=torch.uint8, count=e["nbytes"],
                                            offset=layout.data_start(length) + e["offset"])
    return out


def load_persisted(folder: "str | os.PathLike") -> bytearray:
    """The snapshot bytes written by :func:`persist` (checked against its manifest)."""
    import json
    import struct

    import torch
    import torch.distributed.checkpoint as dcp

    manifest = layout.read_manifest(Path(folder) / "snapshot.bin")
    if manifest is None:
        raise layout.TornSnapshot(f"{folder}: no manifest")
    reader = dcp.FileSystemReader(str(folder))
    md = reader.read_metadata().state_dict_metadata
    head = {"meta": torch.empty(md["meta"].size, dtype=torch.uint8)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(head, storage_reader=reader, no_dist=True)
    raw = head["meta"].numpy().tobytes()
    (length,) = struct.unpack("<Q", raw[len(layout.MAGIC):len(layout.MAGIC) + 8])
    meta = json.loads(raw[len(layout.MAGIC) + 8:len(layout.MAGIC) + 8 + length])
    data = bytearray(manifest["nbytes"])
    data[:len(raw)] = raw
    start = layout.data_start(length)
    tensors = {f"t{i}": torch.frombuffer(data, dtype=torch.uint8, count=e["nbytes"],
                                         offset=start + e["offset"])
               for i, e in enumerate(meta["tensors"]) if e["nbytes"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    if layout.digest(data, manifest["nbytes"]) != manifest["checksum"]:
        raise layout.TornSnapshot(f"{folder}: its bytes do not match the manifest")
    return data
