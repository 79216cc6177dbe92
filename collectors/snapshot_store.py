"""The node agent's snapshot store: holds the ranks' in-memory snapshots and their replicas.

The ranks of this machine write their snapshots into ``<dir>/own/<job>/rank<R>/`` (files under
``/dev/shm``: memory that outlives a crashed rank; :mod:`trainguard.checkpoint.snapshot`). The
store, a part of ``trainguard agent`` (``--snapshot-dir``):

- **replicates** each new complete snapshot (manifest present, checksum matching) to this
  machine's *buddy* (:func:`trainguard.checkpoint.placement.buddies` over ``peers``, with the
  eviction ``domains``), over TCP, the header signed with the project's key;
- **receives** its buddies' replicas into ``<dir>/replica/<job>/rank<R>/step<S>.bin``, keeping
  the newest ``keep`` per rank; an unsigned (when a key is configured), forged, stale, replayed
  or torn one is refused with one line and never stored;
- **answers** its machine's ranks on ``<dir>/agent.sock`` (``steps``: every step of a rank held
  here or by a peer; ``fetch``: a step brought here from the peer that holds it), and its peers
  on ``listen`` (``list``, ``get``, ``put``). It asks the peers that can hold a rank's copies
  (its buddy, and where a rank that came from elsewhere was found: :mod:`.snapshot_holders`),
  not every machine of the job;
- **cleans up**: jobs whose files have not changed for ``retain_s`` are removed.
"""
from __future__ import annotations

import logging
import math
import os
import re
import shutil
import socketserver
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from trainguard import events as ev
from trainguard.checkpoint import layout
from trainguard.checkpoint.placement import PlacementError, buddies
from trainguard.signing import Freshness, Verifier, sign_object

from trainguard.checkpoint.wire import WireError, copy_body, read_header, request, write_message

from .snapshot_holders import Holders, gather

__all__ = ["SnapshotStoreConfig", "SnapshotStore", "parse_peers", "store_from_args"]

log = logging.getLogger(__name__)
_JOB_RE = re.compile(ev.JOB_PATTERN)


@dataclass(kw_only=True)
class SnapshotStoreConfig:
    """The node agent's snapshot store."""

    dir: str                                  #: its folder (under /dev/shm: memory)
    listen: Optional[str] = None              #: host:port for the peers (None: no replication)
    peers: dict = field(default_factory=dict)   #: {node: host:port} of the other agents
    domains: dict = field(default_factory=dict)  #: {node: eviction domain}
    keep: int = 2                             #: replicas kept per rank
    scan_interval_s: float = 0.1              #: how often new snapshots are looked for
    retain_s: float = 86400.0                 #: a job's files untouched this long are removed
    max_bytes: int = 1 << 40                  #: the largest replica accepted
    peer_timeout_s: float = 10.0              #: a request to a peer, its transfer included
    peer_connect_timeout_s: float = 2.0       #: ... its connection alone (a lost machine)
    peer_settle_s: float = 0.3                #: a lookup waits this long for the other peers
                                              #: once one answered with steps
    drop_retry_s: float = 5.0                 #: how often a drop a peer missed is sent again
    drop_give_up_s: float = 3600.0            #: ... and for how long


def parse_peers(text: str) -> dict:
    """``"n1=10.0.0.1:7070,n2=10.0.0.2:7070"`` as ``{node: address}``.

    >>> parse_peers("n1=127.0.0.1:7001, n2=127.0.0.1:7002")
    {'n1': '127.0.0.1:7001', 'n2': '127.0.0.1:7002'}
    """
    out = {}
    for item in filter(None, (p.strip() for p in (text or "").split(","))):
        node, sep, addr = item.partition("=")
        if not sep or ":" not in addr:
            raise ValueError(f"snapshot peer {item!r} must be NODE=HOST:PORT")
        out[node.strip()] = addr.strip()
    return out


def store_from_args(args, node: str, keys=None) -> Optional["SnapshotStore"]:
    """The store of ``trainguard agent --snapshot-dir ...``, or None without that flag."""
    from trainguard.checkpoint.placement import parse_domains
    from trainguard.errors import UserError

    folder = getattr(args, "snapshot_dir", None)
    if not folder:
        return None
    try:
        config = SnapshotStoreConfig(dir=str(Path(folder).expanduser()),
                                     listen=args.snapshot_listen or None,
                                     peers=parse_peers(args.snapshot_peers),
                                     domains=parse_domains(args.snapshot_domains))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if config.peers and not config.listen:
        raise UserError("--snapshot-peers needs --snapshot-listen (where the peers reach "
                        "this agent)")
    if config.peers:
        from trainguard.signing import warn_if_unsigned

        warn_if_unsigned(keys, "agent", "snapshot replicas between agents")
    return SnapshotStore(config, node=node, keys=keys)


def _ident(header: dict) -> Optional[str]:
    """(job, rank, step) of a header, checked: no path escapes a folder."""
    job, rank, step = header.get("job"), header.get("rank"), header.get("step", 0)
    if not (isinstance(job, str) and _JOB_RE.fullmatch(job) and type(rank) is int
            and rank >= 0 and type(step) is int and step >= 0):
        return None
    return job


class SnapshotStore:
    """``keys`` sign and check what travels between agents; ``clock`` is wall time."""

    def __init__(self, config: SnapshotStoreConfig, *, node: str, keys=None,
                 clock: Callable[[], float] = time.time):
        self.config = config
        self.node = node
        self.keys = keys
        self.clock = clock
        self.dir = Path(config.dir)
        self.verifier = Verifier(keys, freshness=Freshness(max_age_s=300.0), clock=clock)
        self.replies = Verifier(keys, clock=clock)
        self.stats = {"replicated": 0, "received": 0, "refused": 0, "fetched": 0}
        self._sent: dict = {}
        self._servers: list = []
        self._threads: list = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._rollbacks: dict = {}    # (job, rank) -> (step kept, wall time of the rollback)
        self._pending_drops: dict = {}  # (peer, job, rank) -> the drop it has not answered
        self._found: dict = {}          # (job, rank) -> {step: peer} of its last lookup
        self.buddy = self._buddy()
        self.holders = Holders(self.dir / "holders.json", buddy=self.buddy,
                               peers=[n for n in config.peers if n != node])

    def _buddy(self) -> Optional[str]:
        nodes = {**self.config.peers, self.node: self.config.listen or ""}
        if len(nodes) < 2:
            return None
        try:
            return buddies(nodes, self.config.domains)[self.node]
        except PlacementError as exc:
            log.warning("snapshots are not replicated: %s", exc)
            return None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> "SnapshotStore":
        self.dir.mkdir(parents=True, exist_ok=True)
        sock = self.dir / "agent.sock"
        sock.unlink(missing_ok=True)
        store = self

        class Handler(socketserver.StreamRequestHandler):
            local = False

            def handle(self):
                store._handle(self.rfile, self.wfile, local=self.local)

        class LocalHandler(Handler):
            local = True

        local = socketserver.ThreadingUnixStreamServer(str(sock), LocalHandler)
        self._servers.append(local)
        if self.config.listen:
            host, _, port = self.config.listen.rpartition(":")
            socketserver.ThreadingTCPServer.allow_reuse_address = True
            self._servers.append(socketserver.ThreadingTCPServer((host, int(port)), Handler))
        for server in self._servers:
            server.daemon_threads = True
            self._spawn(server.serve_forever, "trainguard-snapshot-server")
        self._spawn(self._replicate_loop, "trainguard-snapshot-replicate")
        log.info("snapshots: %s, ranks on %s, peers on %s, buddy %s", self.dir, sock,
                 self.config.listen or "(none)", self.buddy or "(none: not replicated)")
        return self

    def stop(self) -> None:
        self._stop.set()
        for server in self._servers:
            server.shutdown()
            server.server_close()
        for t in self._threads:
            t.join(2.0)

    def _spawn(self, target, name) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def memory_bytes(self) -> int:
        """Bytes of snapshot files this machine holds (its ranks' slots and the replicas)."""
        total = 0
        for root, _, files in os.walk(self.dir):
            for name in files:
                if name.endswith(".bin"):
                    try:
                        total += os.stat(os.path.join(root, name)).st_blocks * 512
                    except OSError:
                        pass
        return total

    # -- what is held here -----------------------------------------------------------------
    def held(self, job: str, rank: int) -> dict:
        """``{step: path}`` of the complete snapshots of (job, rank) on this machine."""
        out = {}
        for _, path, manifest in self._copies(job, rank):
            out.setdefault(manifest["step"], path)
        return out

    def _copies(self, job: str, rank: int):
        """``(folder, path, manifest)`` of each complete copy of (job, rank) held here: the
        slots the rank wrote on this machine (``own``), then the replicas from its buddy."""
        for folder, pattern in (("own", "slot*.bin"), ("replica", "step*.bin")):
            for path in (self.dir / folder / job / f"rank{rank}").glob(pattern):
                manifest = layout.read_manifest(path)
                if manifest is not None and manifest.get("job") == job \
                        and manifest.get("rank") == rank:
                    yield folder, path, manifest

    # -- replication -----------------------------------------------------------------------
    def _replicate_loop(self) -> None:
        next_cleanup = next_retry = 0.0
        while not self._stop.wait(self.config.scan_interval_s):
            if self.buddy is not None:
                for path in sorted((self.dir / "own").glob("*/rank*/slot*.bin")):
                    self._replicate(path)
            if self._pending_drops and time.monotonic() >= next_retry:
                next_retry = time.monotonic() + self.config.drop_retry_s
                self._retry_drops()
            if time.monotonic() >= next_cleanup:
                next_cleanup = time.monotonic() + 60.0
                self.cleanup()

    def _replicate(self, path: Path) -> None:
        manifest = layout.read_manifest(path)
        if manifest is None or self._sent.get(path) == manifest["checksum"]:
            return
        try:
            with open(path, "rb") as f:
                data = bytearray(manifest["nbytes"])
                f.readinto(data)
        except OSError:
            return
        if layout.digest(data, manifest["nbytes"]) != manifest["checksum"]:
            return                               # being overwritten: the next scan sees it
        header = {"op": "put", "id": uuid.uuid4().hex, "ts": self.clock(), "node": self.node,
                  "job": manifest["job"], "rank": manifest["rank"], "step": manifest["step"],
                  "nbytes": manifest["nbytes"], "sha256": layout.sha256(data, len(data)),
                  "manifest": manifest, "body": True}
        address = self.config.peers[self.buddy]
        try:
            reply, _ = request(address, sign_object(header, self.keys), data,
                               timeout=self.config.peer_timeout_s,
                               connect_timeout=self.config.peer_connect_timeout_s)
        except (OSError, WireError) as exc:
            log.debug("replica to %s (%s) not sent: %s", self.buddy, address, exc)
            return
        if reply.get("ok"):
            self._sent[path] = manifest["checksum"]
            self.stats["replicated"] += 1
        else:
            self._sent[path] = manifest["checksum"]      # refused: one line, not one per scan
            log.warning("buddy %s refused the replica of %s rank %s step %s: %s: %s",
                        self.buddy, manifest["job"], manifest["rank"], manifest["step"],
                        reply.get("code"), reply.get("reason"))

    # -- requests --------------------------------------------------------------------------
    def _refuse(self, out, code: str, reason: str, header: Optional[dict] = None) -> None:
        self.stats["refused"] += 1
        who = (header or {}).get("node", "?")
        log.warning("snapshot %s from %s refused: %s: %s", (header or {}).get("op", "request"),
                    who, code, reason)
        write_message(out, self._signed({"ok": False, "code": code, "reason": reason}))

    def _signed(self, obj: dict) -> dict:
        return sign_object({**obj, "ts": self.clock(), "node": self.node}, self.keys)

    def _handle(self, rfile, wfile, *, local: bool) -> None:
        try:
            header = read_header(rfile)
        except WireError as exc:
            return self._refuse(wfile, "malformed", str(exc))
        op = header.get("op")
        job = _ident(header)
        if job is None:
            return self._refuse(wfile, "malformed", "job, rank or step missing or invalid",
                                header)
        if not local:
            refusal = self.verifier.check(header, str(header.get("id")))
            if refusal is not None:
                return self._refuse(wfile, refusal.code, refusal.reason, header)
        rank, step = header["rank"], header.get("step", 0)
        if op in ("drop", "drop_newer") and type(header.get("step")) is not int:
            return self._refuse(wfile, "malformed", "a drop names the step it keeps", header)
        if op == "put" and not local:
            return self._receive(rfile, wfile, header, job, rank, step)
        if op == "list" and not local:
            return write_message(wfile, self._signed({"ok": True,
                                                      "steps": sorted(self.held(job, rank))}))
        if op == "get" and not local:
            return self._send(wfile, job, rank, step)
        if op == "drop" and not local:
            before = header.get("before")
            before = min(before, self.clock()) if type(before) in (int, float) \
                and math.isfinite(before) else None
            return write_message(wfile, self._signed({"ok": True, "dropped": self._drop_newer(
                job, rank, step, before)}))
        if op == "drop_newer" and local:
            return write_message(wfile, self._drop_everywhere(job, rank, step))
        if op == "steps" and local:
            return write_message(wfile, {"ok": True, "steps": self._all_steps(job, rank)})
        if op == "fetch" and local:
            return write_message(wfile, self._fetch(job, rank, step))
        return self._refuse(wfile, "malformed", f"unknown op {op!r}", header)

    def _receive(self, rfile, wfile, header, job, rank, step) -> None:
        nbytes, sha, manifest = header.get("nbytes"), header.get("sha256"), header.get("manifest")
        if not (type(nbytes) is int and 0 < nbytes <= self.config.max_bytes
                and isinstance(sha, str) and isinstance(manifest, dict)
                and isinstance(manifest.get("checksum"), str)
                and manifest.get("nbytes") == nbytes
                and manifest.get("job") == job and manifest.get("rank") == rank
                and manifest.get("step") == step):
            return self._refuse(wfile, "malformed", "size, digest or manifest inconsistent",
                                header)
        st = os.statvfs(self.dir)
        if nbytes > st.f_bavail * st.f_frsize:
            return self._refuse(wfile, "no_space", f"{nbytes} bytes do not fit in {self.dir}",
                                header)
        if self._abandoned(job, rank, manifest):
            return self._refuse(wfile, "abandoned", f"step {step} is past a rollback", header)
        folder = self.dir / "replica" / job / f"rank{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step{step:010d}.bin"
        tmp = folder / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "wb") as out:
                got = copy_body(rfile, nbytes, out)
            if got != sha:
                tmp.unlink(missing_ok=True)
                return self._refuse(wfile, "bad_digest", "the bytes do not match the signed "
                                                         "SHA-256", header)
            with self._lock:  # a drop that came while the bytes travelled wins
                if self._abandoned(job, rank, manifest):
                    tmp.unlink(missing_ok=True)
                    return self._refuse(wfile, "abandoned", f"step {step} is past a rollback",
                                        header)
                layout.manifest_path(path).unlink(missing_ok=True)
                os.replace(tmp, path)
                layout.write_manifest(path, {k: v for k, v in manifest.items()
                                             if k != "format"})
        except (OSError, WireError) as exc:
            tmp.unlink(missing_ok=True)
            return self._refuse(wfile, "incomplete", str(exc), header)
        self._prune(folder)
        self.stats["received"] += 1
        write_message(wfile, self._signed({"ok": True}))

    def _drop_newer(self, job: str, rank: int, step: int, before: Optional[float] = None) -> int:
        """The copies held here of (job, rank) past ``step`` taken before the rollback (wall
        time ``before``; default now), the branch it abandoned, go (replicas, and the slots
        the rank left here before it moved); a replica of them still on its way is refused
        when it arrives. A drop that comes late (retried) keeps what the rank took since.
        How many went."""
        dropped = 0
        before = self.clock() if before is None else before
        with self._lock:
            if self._rollbacks.get((job, rank), (0, -math.inf))[1] <= before:
                self._rollbacks[(job, rank)] = (step, before)
            for folder, path, manifest in list(self._copies(job, rank)):
                if manifest.get("step", -1) > step and not self._taken_after(manifest, before):
                    layout.manifest_path(path).unlink(missing_ok=True)
                    if folder == "replica":
                        path.unlink(missing_ok=True)
                    dropped += 1
            # the rank's slots past the step (their manifests gone) are sent again when taken
            # again, even bit for bit the same (a rollback replays the same data and RNG)
            own = self.dir / "own" / job / f"rank{rank}"
            for path in [p for p in self._sent if p.parent == own]:
                manifest = layout.read_manifest(path)
                if manifest is None or manifest.get("step", -1) > step:
                    self._sent.pop(path, None)
        return dropped

    @staticmethod
    def _taken_after(manifest: dict, when: float) -> bool:
        return isinstance(manifest.get("ts"), (int, float)) and manifest["ts"] > when

    def _abandoned(self, job: str, rank: int, manifest: dict) -> bool:
        """A snapshot taken before a rollback to an older step (its branch was abandoned)."""
        rollback = self._rollbacks.get((job, rank))
        return rollback is not None and manifest.get("step", -1) > rollback[0] \
            and not self._taken_after(manifest, rollback[1])

    def _drop_everywhere(self, job: str, rank: int, step: int) -> dict:
        """A rank rolled back to ``step``: its replicas past it go here and on every peer
        that answers; ``unreached`` names the peers that did not, to which the drop is sent
        again every ``drop_retry_s`` (:meth:`_retry_drops`)."""
        before = self.clock()
        header = {"op": "drop", "job": job, "rank": rank, "step": step, "before": before}
        targets = self.holders.targets(job, rank)
        if not (self.holders.known(job, rank) or self.held(job, rank)):
            targets = None            # where it ran before is not known here: every peer
        replies = self._ask_peers(header, targets)
        done = {n: r for n, r in replies.items() if r.get("ok")}
        dropped = self._drop_newer(job, rank, step, before) + sum(
            r["dropped"] for r in done.values() if type(r.get("dropped")) is int)
        asked = self._peer_names(targets)
        unreached = sorted(n for n in asked if n not in done)
        with self._lock:
            for node in asked:
                if node in unreached:
                    self._pending_drops[(node, job, rank)] = header
                else:              # a later rollback reached it: it covers the earlier one
                    self._pending_drops.pop((node, job, rank), None)
        return {"ok": True, "dropped": dropped, "unreached": unreached}

    def _retry_drops(self) -> None:
        """Send each drop a peer missed again; given up after ``drop_give_up_s``."""
        with self._lock:
            pending = list(self._pending_drops.items())
        silent = set()                   # peers that did not answer this round: asked once
        for (node, job, rank), header in pending:
            address = self.config.peers.get(node)
            given_up = self.clock() - header["before"] > self.config.drop_give_up_s
            reply = None if given_up or address is None or node in silent \
                else self._ask_peer(address, header)
            if not (given_up or (reply and reply.get("ok"))):
                silent.add(node)
                continue
            with self._lock:
                if self._pending_drops.get((node, job, rank)) is header:
                    del self._pending_drops[(node, job, rank)]
            if given_up:
                log.warning("snapshots: %s never answered the drop of rank %d of %s past step "
                            "%d; gave up", node, rank, job, header["step"])
            else:
                log.info("snapshots: %s dropped %s copies of rank %d of %s past step %d (sent "
                         "again)", node, reply.get("dropped"), rank, job, header["step"])

    def _prune(self, folder: Path) -> None:
        with self._lock:
            held = sorted(folder.glob("step*.bin"))
            for old in held[:-self.config.keep]:
                layout.manifest_path(old).unlink(missing_ok=True)
                old.unlink(missing_ok=True)

    def _send(self, wfile, job, rank, step) -> None:
        path = self.held(job, rank).get(step)
        manifest = layout.read_manifest(path) if path is not None else None
        if manifest is None:
            return write_message(wfile, self._signed({"ok": False, "code": "missing",
                                                      "reason": f"no step {step} here"}))
        with open(path, "rb") as f:
            data = bytearray(manifest["nbytes"])
            f.readinto(data)
        if layout.digest(data, manifest["nbytes"]) != manifest["checksum"]:
            return write_message(wfile, self._signed({"ok": False, "code": "torn",
                                                      "reason": f"step {step} is torn"}))
        write_message(wfile, self._signed({"ok": True, "body": True, "nbytes": manifest["nbytes"],
                                           "sha256": layout.sha256(data, len(data)),
                                           "manifest": manifest,
                                           "job": job, "rank": rank, "step": step}), data)

    # -- the ranks' side -------------------------------------------------------------------
    def _peer_names(self, nodes=None) -> list:
        """``nodes`` that are peers of this job (every peer when None)."""
        return [n for n in (self.config.peers if nodes is None else nodes)
                if n != self.node and n in self.config.peers]

    def _ask_peers(self, header: dict, nodes=None, settle_s: Optional[float] = None,
                   have: bool = False) -> dict:
        """``{node: reply}`` from each peer of ``nodes`` (default: every peer) that answers
        with a valid signature. With ``settle_s``, a lookup: once a peer answered with steps
        (or at once when this machine ``have`` some), the others have ``settle_s`` more, so
        that a lost machine's connection attempt (``peer_connect_timeout_s``) does not hold up
        a restore (:func:`.snapshot_holders.gather`)."""
        peers = {n: self.config.peers[n] for n in self._peer_names(nodes)}
        if not peers:
            return {}
        return gather(lambda address: self._ask_peer(address, header), peers, settle_s, have)

    def _ask_peer(self, address: str, header: dict) -> Optional[dict]:
        """The signed reply of one peer to ``header`` (signed here, fresh), or None."""
        try:
            reply, _ = request(address, sign_object({**header, "id": uuid.uuid4().hex,
                                                     "ts": self.clock(), "node": self.node},
                                                    self.keys),
                               timeout=self.config.peer_timeout_s,
                               connect_timeout=self.config.peer_connect_timeout_s)
        except (OSError, WireError):
            return None
        return reply if self.replies.check_signature(reply) is None else None

    def _listing(self, job: str, rank: int, here: bool) -> dict:
        """``{node: reply}`` of the peers asked for their steps of (job, rank): those that
        can hold its copies (:class:`Holders`); every peer when neither they nor this machine
        (``here``) hold one (the rank came from another machine), and then the peers that
        held one or did not answer are remembered."""
        header, settle = {"op": "list", "job": job, "rank": rank}, self.config.peer_settle_s
        listing = self._ask_peers(header, self.holders.targets(job, rank), settle, here)
        if here or any(reply.get("steps") for reply in listing.values()):
            return listing
        listing = self._ask_peers(header, None, settle)
        self.holders.learn(job, rank, [n for n in self._peer_names()
                                       if n not in listing or listing[n].get("steps")])
        return listing

    def _all_steps(self, job: str, rank: int) -> dict:
        held = self.held(job, rank)
        steps = {str(s): "local" for s in held}
        found = {}
        for node, reply in sorted(self._listing(job, rank, bool(held)).items()):
            for s in reply.get("steps") or []:
                if type(s) is int:
                    steps.setdefault(str(s), f"buddy:{node}")
                    found.setdefault(s, node)
        with self._lock:
            self._found[(job, rank)] = found   # the fetch that follows asks that peer first
        return steps

    def _fetch(self, job: str, rank: int, step: int) -> dict:
        held = self.held(job, rank)
        if step in held:
            return {"ok": True, "path": str(held[step]), "source": "local"}
        with self._lock:
            known = self._found.pop((job, rank), {}).get(step)
        if known is not None:
            got = self._get_from(known, job, rank, step)
            if got is not None:
                return self._fetched(got, known)
        listing = self._listing(job, rank, bool(held))
        for node in sorted(n for n, r in listing.items()
                           if step in (r.get("steps") or []) and n != known):
            got = self._get_from(node, job, rank, step)
            if got is not None:
                return self._fetched(got, node)
        return {"ok": False, "code": "missing", "reason": f"no peer holds step {step}"}

    def _fetched(self, path: Path, node: str) -> dict:
        self.stats["fetched"] += 1
        return {"ok": True, "path": str(path), "source": f"buddy:{node}"}

    def _get_from(self, node: str, job: str, rank: int, step: int) -> Optional[Path]:
        folder = self.dir / "replica" / job / f"rank{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"step{step:010d}.bin"
        tmp = folder / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
        header = sign_object({"op": "get", "id": uuid.uuid4().hex, "ts": self.clock(),
                              "node": self.node, "job": job, "rank": rank, "step": step},
                             self.keys)
        try:
            with open(tmp, "wb") as out:
                reply, sha = request(self.config.peers[node], header, out=out,
                                     timeout=self.config.peer_timeout_s,
                                     connect_timeout=self.config.peer_connect_timeout_s)
            refusal = self.replies.check_signature(reply)
            manifest = reply.get("manifest")
            if refusal is not None or not reply.get("ok") or sha != reply.get("sha256") \
                    or not isinstance(manifest, dict) or manifest.get("nbytes") != \
                    reply.get("nbytes") \
                    or manifest.get("step") != step or manifest.get("rank") != rank \
                    or manifest.get("job") != job:
                why = refusal or reply.get("reason") or "digest or manifest mismatch"
                log.warning("snapshot of %s rank %d step %d from %s refused: %s", job, rank,
                            step, node, why)
                tmp.unlink(missing_ok=True)
                return None
            os.replace(tmp, path)
            layout.write_manifest(path, {k: v for k, v in manifest.items() if k != "format"})
            return path
        except (OSError, WireError) as exc:
            tmp.unlink(missing_ok=True)
            log.warning("snapshot of %s rank %d step %d from %s failed: %s", job, rank, step,
                        node, exc)
            return None

    def cleanup(self) -> None:
        horizon = self.clock() - self.config.retain_s
        for folder in ("own", "replica"):
            for job_dir in (self.dir / folder).glob("*"):
                try:
                    newest = max((p.stat().st_mtime for p in job_dir.rglob("*")),
                                 default=job_dir.stat().st_mtime)
                except OSError:
                    continue
                if newest < horizon:
                    shutil.rmtree(job_dir, ignore_errors=True)
                    self.holders.forget(job_dir.name)
                    with self._lock:
                        for key in [k for k in self._found if k[0] == job_dir.name]:
                            del self._found[key]
                    log.info("snapshots of %s removed (untouched for %.0fs)", job_dir.name,
                             self.config.retain_s)
