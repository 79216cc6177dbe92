"""Which peers a node agent asks about a rank's snapshots: not every machine of the job.

A rank's copies lie where it ran: this machine (its slots, and the replicas this machine
holds as some machine's buddy) and this machine's buddy (the replicas sent there). A rank
that came here from another machine (a spare that took over a lost machine's ranks) has a copy
on neither: the first lookup asks every peer, and the peers that held a copy of it, or did not
answer, are remembered (in ``<dir>/holders.json``, so an agent restarted keeps them) and asked
from then on, with the buddy. So a restart costs each rank one request to its buddy, not one
to every machine, and a rollback's drop goes to the machines that can hold the rank's copies.

>>> import tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp())
>>> h = Holders(folder / "holders.json", buddy="b", peers=["b", "c", "d"])
>>> h.targets("j", 0), h.known("j", 0)
(['b'], False)
>>> h.learn("j", 0, ["d", "x"])           # x is no peer of this job: not remembered
>>> h.targets("j", 0), h.known("j", 0)
(['b', 'd'], True)
>>> Holders(folder / "holders.json", buddy="b", peers=["b", "c", "d"]).targets("j", 0)
['b', 'd']
"""
from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable, Iterable, Optional

from trainguard.files import write_atomic

__all__ = ["Holders", "gather"]

log = logging.getLogger(__name__)


class Holders:
    """``buddy``: the peer this machine replicates to (None: not replicated); ``peers``: the
    job's other machines."""

    def __init__(self, path: Path, *, buddy: Optional[str], peers: Iterable[str]):
        self.path = Path(path)
        self.buddy = buddy
        self.peers = set(peers)
        self._lock = threading.Lock()
        self._known: dict = self._load()    # "job/rank" -> peers that held a copy or were silent

    def _load(self) -> dict:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("snapshots: %s unreadable (%s); the ranks that came here from other "
                        "machines are looked up on every peer again", self.path, exc)
            return {}
        if not isinstance(raw, dict):
            return {}
        return {k: sorted(n for n in v if n in self.peers) for k, v in raw.items()
                if isinstance(k, str) and isinstance(v, list)}

    def targets(self, job: str, rank: int) -> list:
        """The peers to ask about (job, rank): the buddy and those remembered for it."""
        nodes = set(self._known.get(f"{job}/{rank}", ()))
        if self.buddy is not None:
            nodes.add(self.buddy)
        return sorted(nodes)

    def known(self, job: str, rank: int) -> bool:
        """Whether a lookup on every peer was made for (job, rank) (it came from elsewhere)."""
        return f"{job}/{rank}" in self._known

    def learn(self, job: str, rank: int, nodes: Iterable[str]) -> None:
        """After a lookup on every peer: the peers that held a copy or did not answer."""
        with self._lock:
            self._known[f"{job}/{rank}"] = sorted(
                set(self._known.get(f"{job}/{rank}", ())) | (set(nodes) & self.peers))
            self._save()

    def forget(self, job: str) -> None:
        """A job's files were cleaned up: its ranks are forgotten too."""
        with self._lock:
            gone = [k for k in self._known if k.rpartition("/")[0] == job]
            for key in gone:
                del self._known[key]
            if gone:
                self._save()

    def _save(self) -> None:
        """Under the lock."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(self.path, json.dumps(self._known))
        except OSError as exc:
            log.warning("snapshots: %s not written: %s", self.path, exc)


def gather(ask: Callable[[str], Optional[dict]], peers: dict,
           settle_s: Optional[float] = None, have: bool = False) -> dict:
    """``{node: reply}`` of ``ask(address)`` for each of ``peers`` (``{node: address}``), in
    parallel, None replies left out. With ``settle_s`` (a lookup), once a peer answered with
    steps, or from the start when the caller ``have`` some already, the others have
    ``settle_s`` more: a lost machine's connection attempt does not hold up a restore from
    this machine's or its buddy's copies (its thread ends on its own).

    >>> import time
    >>> def ask(address):
    ...     if address == "dead":
    ...         time.sleep(2.0)
    ...     return {"steps": [4]} if address == "buddy" else None
    >>> began = time.monotonic()
    >>> gather(ask, {"b": "buddy", "l": "dead"}, settle_s=0.1), time.monotonic() - began < 1
    ({'b': {'steps': [4]}}, True)
    >>> began = time.monotonic()
    >>> gather(ask, {"l": "dead"}, settle_s=0.1, have=True), time.monotonic() - began < 1
    ({}, True)
    """
    pool = ThreadPoolExecutor(max_workers=min(16, len(peers)) or 1)
    try:
        asked = {pool.submit(ask, address): node for node, address in peers.items()}
        out, pending = {}, set(asked)
        deadline = time.monotonic() + settle_s if settle_s is not None and have else None
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = wait(pending, timeout=left, return_when=FIRST_COMPLETED)
            if not done:
                break                              # settled: the rest did not answer in time
            for future in done:
                reply = future.result()
                if reply is None:
                    continue
                out[asked[future]] = reply
                if settle_s is not None and deadline is None and reply.get("steps"):
                    deadline = time.monotonic() + settle_s
        return out
    finally:
        pool.shutdown(wait=False)
