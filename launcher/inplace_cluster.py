"""The standby launchers of several machines, through the store of node rank 0's launcher.

Every launcher marks itself alive in the store every ``BEAT_S``: ``alive/<node rank>`` (a
counter; a spare's key is ``alive/spare-<name>``). The leader (node rank 0, which hosts the
store) takes a machine for lost when its counter has not moved for ``lost_after_s`` of the
leader's own clock (machines' clocks are never compared). It then raises the generation and
gives the lost machine's ranks to a spare machine with enough warm standbys:
``assign/<spare name>`` = ``"<generation> <rank>,<rank>,..."``. The spare's launcher hands
them to its standbys, which restore from the lost machine's buddies' copies (the node agents,
docs/RECOVERY.md). No spare: ``fallback`` is set, and every launcher stops and exits 1.

Each launcher counts its ranks that finished into ``finished``; the leader, which hosts the
store, waits for all of them before it exits.

>>> class Store(dict):                       # a TCPStore's calls, in memory
...     def set(self, k, v): self[k] = str(v).encode()
...     def check(self, keys): return all(k in self for k in keys)
...     def add(self, k, n): self[k] = str(int(self.get(k, b"0")) + n).encode(); return int(self[k])
>>> store, now = Store(), [0.0]
>>> leader = Cluster(store, node="m1", node_rank=0, nnodes=2, nproc=2, clock=lambda: now[0])
>>> spare = Cluster(store, node="m3", spare=True, nproc=2, clock=lambda: now[0])
>>> spare.offer(2)
>>> worker = Cluster(store, node="m2", node_rank=1, nnodes=2, nproc=2, clock=lambda: now[0])
>>> for t in (0.0, 0.5, 1.0):
...     now[0] = t; worker.beat(); spare.beat(); leader.watch()
[]
[]
[]
>>> now[0] = 5.0; spare.beat(); leader.watch()      # m2 has not moved for 4 s
[1]
>>> leader.place([2, 3], generation=1)
'm3'
>>> spare.assigned()
(1, [2, 3])
"""
from __future__ import annotations

import time

__all__ = ["Cluster", "BEAT_S"]

#: seconds between a launcher's marks in the store
BEAT_S = 0.5


class Cluster:
    def __init__(self, store, *, node: str, nproc: int, node_rank: int = 0, nnodes: int = 1,
                 spare: bool = False, lost_after_s: float = 3.0, clock=time.monotonic):
        self.store, self.node, self.nproc = store, node, nproc
        self.node_rank, self.nnodes, self.spare = node_rank, nnodes, spare
        self.lost_after_s, self.clock = lost_after_s, clock
        self.key = f"alive/spare-{node}" if spare else f"alive/{node_rank}"
        self._beats = 0
        self._next_beat = 0.0
        self._seen: dict = {}          # node rank -> (its counter, when it last moved)
        self.lost: set = set()
        self._assigned = None

    @property
    def leader(self) -> bool:
        return self.nnodes > 1 and not self.spare and self.node_rank == 0

    def beat(self) -> None:
        now = self.clock()
        if now < self._next_beat:
            return
        self._next_beat = now + BEAT_S
        self._beats += 1
        self.store.set(self.key, str(self._beats))

    def offer(self, standbys: int) -> None:
        """A spare machine: say how many warm standbys it holds."""
        if not self.store.check([f"spare/{self.node}"]):
            index = self.store.add("spares", 1) - 1
            self.store.set(f"spares/{index}", self.node)
        self.store.set(f"spare/{self.node}", str(standbys))

    def watch(self) -> list:
        """The leader: the node ranks newly taken for lost (and the spares' marks, so that
        :meth:`place` passes over a silent spare)."""
        if not self.leader:
            return []
        now, out = self.clock(), []
        for n in [*range(1, self.nnodes), *(f"spare-{name}" for name in self._spares())]:
            if n in self.lost or not self.store.check([f"alive/{n}"]):
                continue                      # not started yet: not watched yet
            value = self.store.get(f"alive/{n}")
            seen = self._seen.get(n)
            if seen is None or seen[0] != value:
                self._seen[n] = (value, now)
            elif now - seen[1] > self.lost_after_s and type(n) is int:
                self.lost.add(n)
                out.append(n)
        return out

    def _spares(self) -> list:
        count = int(self.store.get("spares")) if self.store.check(["spares"]) else 0
        return [self.store.get(f"spares/{i}").decode() for i in range(count)]

    def _silent(self, key, now: float) -> bool:
        seen = self._seen.get(key)
        return seen is not None and now - seen[1] > self.lost_after_s

    def last_moved(self, node_rank: int) -> float:
        """When (this clock) the leader last saw ``node_rank`` mark itself alive."""
        seen = self._seen.get(node_rank)
        return seen[1] if seen is not None else float("-inf")

    def ranks_of(self, node_rank: int) -> list:
        return [node_rank * self.nproc + i for i in range(self.nproc)]

    def place(self, ranks: list, generation: int) -> str | None:
        """The leader: give ``ranks`` to a spare with a standby for each; its name, or None."""
        now = self.clock()
        for name in self._spares():
            if self.store.check([f"assign/{name}"]) or self._silent(f"spare-{name}", now):
                continue                      # already took a machine's ranks, or is gone
            if int(self.store.get(f"spare/{name}")) >= len(ranks):
                self.store.set(f"assign/{name}", f"{generation} {','.join(map(str, ranks))}")
                return name
        return None

    def assigned(self) -> tuple | None:
        """A spare: ``(generation, ranks)`` the leader gave it, once."""
        if self._assigned is not None or not self.store.check([f"assign/{self.node}"]):
            return None
        generation, ranks = self.store.get(f"assign/{self.node}").decode().split()
        self._assigned = (int(generation), [int(r) for r in ranks.split(",")])
        return self._assigned
