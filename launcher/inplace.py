"""The standby launcher: restarts in place, with warm standby ranks, on one machine or many.

    trainguard run --job J --nproc 4 --standby 2 -- train.py --snapshot-every 1 ...
    python -m trainguard.launcher.inplace --nproc 4 --standby 2 -- train.py ...

On several machines, one launcher per machine, node rank 0's hosting the store, and spare
machines that hold only standbys (:mod:`trainguard.launcher.inplace_cluster`)::

    python -m trainguard.launcher.inplace --nproc 8 --nnodes 2 --node-rank 0 --master H:P -- ...
    python -m trainguard.launcher.inplace --nproc 8 --nnodes 2 --node-rank 1 --master H:P -- ...
    python -m trainguard.launcher.inplace --nproc 8 --spare --master H:P -- ...

A machine that stops marking itself alive is lost: its ranks go to a spare's standbys, the
other machines' ranks to their own, and the job goes on without a relaunch.

It starts ``--nproc`` rank processes of the Python script and ``--standby`` standby processes
(default: one per rank) of the same script, which do their imports and then wait in
:meth:`trainguard.checkpoint.inplace.InPlace.join`, and one TCPStore they all share. When a
rank process dies (a crash, or a hung rank killed), nothing is relaunched: the launcher raises
the *generation* in the store. The other ranks, whose collectives failed when their peer
died, leave at once (``InPlace.leave``: a gloo collective blocked on a live peer is released
only when that peer's process goes; docs/RECOVERY.md), and each rank is handed to a standby,
which forms the next generation's process group (the same store, a new key prefix), restores
the newest common step from the in-memory snapshots and goes on. New standbys refill the pool
``REFILL_AFTER_S`` seconds after the last failure (their imports would slow the restoring
ranks down). With no standby left, or after ``--max-restarts`` in-place restarts, every
process is stopped and the launcher exits with status 1, so that the outer launcher
(``trainguard run``) relaunches: the fallback, said as such.

Each event is one line on stdout (``[inplace] rank R exited with status S at T: generation
G``, ``[inplace] fallback to a relaunch: ...``) and, with ``--status FILE``, one JSON line
appended to FILE, which ``trainguard run`` reads to record the restart and to answer the
action service's restart order for the same incident:
``{"event": "generation", "generation": G, "ts": T, "rank": R, "status": S, "failed_ts": F}``
once standbys took every rank of generation G over (rank R failed with status S at F),
``{"event": "failure", "generation": G, "rank": R, "status": S, "failed_ts": F}`` as soon as it
raises the generation (``trainguard run`` holds a restart order back until the takeover is
done), ``{"event": "ranks", "generation": G, "pids": {"0": PID, ...}}`` at the start and after each
takeover (``trainguard run`` kills the processes of the ranks a restart order names, and
standbys take them over), and ``{"event": "fallback", "ts": T, "reason": "..."}``.

A rollback without a relaunch: ``trainguard run`` appends ``{"op": "rollback", "id": ID,
"step": S}`` to the ``--control`` file (default: ``control.jsonl`` beside the status file).
With a standby for every rank and restarts left, the launcher answers ``{"event":
"rollback", "id": ID, "step": S}``, SIGKILLs every rank and puts S in the store for the next
generation (``resume_step/<generation>``): the standbys that take the ranks over restore the
newest snapshot at or before S (``TRAINGUARD_RESUME_STEP``). Otherwise it answers
``{"event": "rollback_refused", "id": ID, "reason": "..."}`` and ``trainguard run``
relaunches.
"""
from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import time

from trainguard.broker import free_port
from trainguard.checkpoint.inplace import ENABLED_ENV, STANDBY_ENV
from trainguard.collectors.nodename import node_name
from trainguard.launcher.inplace_cluster import Cluster
from trainguard.launcher.inplace_status import StatusReader, append_record, control_path
from trainguard.launcher.supervisor import _die_with_parent

__all__ = ["main", "parse_args", "REFILL_AFTER_S"]

#: seconds after the last failure before new standbys start (the restoring ranks take about
#: half a second; faults can come a few seconds apart)
REFILL_AFTER_S = 2.0
#: seconds a rank of a generation that was replaced has to leave before it is killed
LEAVE_S = 5.0
#: seconds between two looks at the store for the other machines' news (several machines)
STORE_POLL_S = 0.05


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m trainguard.launcher.inplace",
                                description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="ranks on this machine")
    p.add_argument("--standby", type=int, default=None,
                   help="warm standby processes (default: one per rank)")
    p.add_argument("--max-restarts", type=int, default=3, help="in-place restarts at most")
    p.add_argument("--status", default=None, metavar="FILE",
                   help="append one JSON line per restart or fallback")
    p.add_argument("--control", default=None, metavar="FILE",
                   help="read requests (rollback) from FILE (default: beside --status)")
    p.add_argument("--nnodes", type=int, default=1,
                   help="machines with ranks (a spare too: the world is nproc x nnodes)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's number")
    p.add_argument("--spare", action="store_true",
                   help="a spare machine: standbys only, for the ranks of a lost machine")
    p.add_argument("--master", default=None, metavar="HOST:PORT",
                   help="the store, on node rank 0's launcher (needed with --nnodes > 1)")
    p.add_argument("--node", default=None, help="this machine's name (default: NODE_NAME, "
                   "else the host name)")
    p.add_argument("--lost-after", type=float, default=3.0, metavar="S",
                   help="a machine silent this long is lost (node rank 0 judges)")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    args = p.parse_args(argv)
    if args.script and args.script[0] == "--":
        args.script = args.script[1:]
    if not args.script:
        p.error("give the training script after --")
    if args.nproc < 1 or (args.standby is not None and args.standby < 0):
        p.error("--nproc must be 1 or more, --standby 0 or more")
    if (args.nnodes > 1 or args.spare) and not args.master:
        p.error("--nnodes > 1 and --spare need --master HOST:PORT")
    if not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank must be in 0..{args.nnodes - 1}")
    return args


class _Status:
    def __init__(self, path):
        self.path = path

    def say(self, text: str, **record) -> None:
        print(f"[inplace] {text}", flush=True)
        if self.path and record:
            append_record(self.path, {**record, "ts": time.time()})


class _Fallback(Exception):
    """Stop every process and exit 1: the outer launcher relaunches."""


class _Fenced(Exception):
    """This machine was taken for lost (it was silent too long) and its ranks run elsewhere:
    stop every process here and hand nothing over."""


class Launcher:
    """One machine's ranks and standbys (see the module's docstring)."""

    def __init__(self, args, store, status: _Status, base_env: dict, node: str):
        self.args, self.store, self.status, self.base = args, store, status, base_env
        self.node = node
        self.cluster = Cluster(store, node=node, nproc=args.nproc, node_rank=args.node_rank,
                               nnodes=args.nnodes, spare=args.spare,
                               lost_after_s=args.lost_after)
        self.world = args.nproc * args.nnodes
        self.ranks: dict = {}          # global rank -> (process, generation it joined)
        self.standbys: list = []       # (number, process), waiting for a rank
        self.next_standby = 0
        self.generation = 0
        self.finished: set = set()
        self.owed, self.last_failure, self.failure = 0, 0.0, {}
        self.rollback = None           # the step the next generation restores at or before
        self.replaced: dict = {}       # rank -> when its generation was replaced
        self.raised_at = float("-inf")  # when this launcher last saw the generation rise
        self.next_poll = 0.0

    def spawn(self, rank: int, standby: int | None = None) -> subprocess.Popen:
        local = max(rank, 0) % self.args.nproc
        env = {**self.base, "RANK": str(rank), "LOCAL_RANK": str(local)}
        if standby is not None:
            env[STANDBY_ENV] = f"{self.node}/{standby}"
        return subprocess.Popen([sys.executable, *self.args.script], env=env,
                                preexec_fn=_die_with_parent())

    def pids(self) -> dict:
        return {str(r): proc.pid for r, (proc, _) in self.ranks.items()}

    def start(self) -> None:
        if not self.args.spare:
            first = self.args.node_rank * self.args.nproc
            self.ranks = {r: (self.spawn(r), 0) for r in range(first, first + self.args.nproc)}
        count = self.args.nproc if self.args.standby is None else self.args.standby
        for _ in range(count):
            self._add_standby()
        if self.args.spare:
            self.cluster.offer(len(self.standbys))
        self.status.say(f"ranks {sorted(self.ranks)} started", event="ranks", generation=0,
                        pids=self.pids())

    def _add_standby(self) -> None:
        self.standbys.append((self.next_standby, self.spawn(-1, self.next_standby)))
        self.next_standby += 1

    # -- the loop ------------------------------------------------------------------------
    def step(self, requests) -> bool:
        """One pass; True once this machine's part is done."""
        if self.cluster.nnodes > 1 or self.cluster.spare:
            self._cluster_news()
        if self.owed and time.monotonic() - self.last_failure > REFILL_AFTER_S:
            self._add_standby()          # refill the pool once the new generation is under way
            self.owed -= 1
            if self.args.spare:
                self.cluster.offer(len(self.standbys))
        self._requests(requests)
        self._exits()
        self._reap_replaced()
        mine = len(self.ranks)
        return bool(mine) and len(self.finished) >= mine or (self.args.spare and self._all_done())

    def _cluster_news(self) -> None:
        """What the other machines' launchers did, from the store (at most every
        ``STORE_POLL_S``): a fallback, a new generation, a lost machine, ranks given to this
        spare."""
        now = time.monotonic()
        if now < self.next_poll:
            return
        self.next_poll = now + STORE_POLL_S
        self.cluster.beat()
        if self.store.check(["fallback"]):
            raise _Fallback(self.store.get("fallback").decode())
        if not self.cluster.spare and self.store.check([f"lost/{self.cluster.node_rank}"]):
            raise _Fenced()
        generation = int(self.store.get("generation"))
        if generation > self.generation:
            self.generation, self.raised_at = generation, now
        for lost in self.cluster.watch():
            self._lost(lost)
        given = self.cluster.assigned()
        if given is not None:
            self.status.say(f"ranks {given[1]} of a lost machine come here in generation "
                            f"{given[0]}")
            for i, rank in enumerate(given[1]):
                self._hand(rank, given[0], announce=i == len(given[1]) - 1)

    def _all_done(self) -> bool:
        return self.store.check(["finished"]) and int(self.store.get("finished")) >= self.world

    def _raise(self, seen: int) -> int:
        """Raise the generation from ``seen`` (once, whoever else tries); the generation now."""
        value = int(self.store.compare_set("generation", str(seen), str(seen + 1)))
        if value > self.generation:
            self.generation, self.raised_at = value, time.monotonic()
        return self.generation

    def _lost(self, node_rank: int) -> None:
        ranks = self.cluster.ranks_of(node_rank)
        # its ranks' deaths already raised the generation (their peers' collectives failed
        # and they left): they join that one; a machine that went silent raises it now
        generation = self.generation if self.raised_at > self.cluster.last_moved(node_rank) \
            else self._raise(self.generation)
        self.store.set(f"lost/{node_rank}", str(generation))   # should it come back: fenced
        spare = self.cluster.place(ranks, generation)
        if spare is None:
            reason = f"machine {node_rank} was lost and no spare has {len(ranks)} standbys"
            self.store.set("fallback", reason)
            raise _Fallback(reason)
        self.status.say(f"machine {node_rank} lost: its ranks {ranks} go to spare {spare} in "
                        f"generation {generation}", event="machine_lost", node_rank=node_rank,
                        spare=spare, generation=generation)

    def _requests(self, requests) -> None:
        for request in requests.new() if requests is not None else ():
            if request.get("op") != "rollback" or type(request.get("step")) is not int \
                    or request["step"] < 0 or type(request.get("id")) is not str:
                continue
            running = [proc for proc, joined in self.ranks.values()
                       if joined == self.generation and proc.poll() is None]
            refused = ("not on several machines" if self.args.nnodes > 1 or self.args.spare
                       else "restarts in place are used up"
                       if self.generation >= self.args.max_restarts
                       else "some ranks have finished" if self.finished
                       else "not every rank is running" if len(running) < len(self.ranks)
                       else f"{len(self.standbys)} standby(s) for {len(self.ranks)} ranks"
                       if len(self.standbys) < len(self.ranks) else None)
            if refused:
                self.status.say(f"rollback refused: {refused}", event="rollback_refused",
                                id=request["id"], reason=refused)
                continue
            self.rollback = request["step"]
            self.status.say(f"rollback to step {self.rollback}: every rank stops",
                            event="rollback", id=request["id"], step=self.rollback)
            for proc in running:
                proc.kill()

    def _exits(self) -> None:
        for rank, (proc, joined) in list(self.ranks.items()):
            rc = proc.poll()
            if rc is None or rank in self.finished:
                if rc is None and joined < self.generation:
                    self.replaced.setdefault(rank, time.monotonic())
                continue
            if rc == 0:
                self.finished.add(rank)
                self.store.add("finished", 1)
                continue
            if joined == self.generation:      # a new failure (not a peer leaving after it)
                if self.generation >= self.args.max_restarts:
                    raise _Fallback(f"rank {rank} exited with status {rc} and "
                                    f"{self.args.max_restarts} in-place restarts are used up")
                self._raise(joined)
                self.failure = {"rank": rank, "status": rc, "failed_ts": time.time()}
                if self.rollback is not None:
                    self.store.set(f"resume_step/{self.generation}", str(self.rollback))
                    self.failure["rollback_step"], self.rollback = self.rollback, None
                self.status.say(f"rank {rank} exited with status {rc} at "
                                f"{self.failure['failed_ts']:.3f}: generation {self.generation}",
                                event="failure", generation=self.generation, **self.failure)
            self.replaced.pop(rank, None)
            self._hand(rank, self.generation)

    def _hand(self, rank: int, generation: int, announce: bool = True) -> None:
        while self.standbys and self.standbys[0][1].poll() is not None:
            k, dead = self.standbys.pop(0)      # a standby that died while it waited
            self.status.say(f"standby {k} exited with status {dead.returncode}")
            self.owed += 1
        if not self.standbys:
            raise _Fallback(f"no standby left for rank {rank}")
        k, standby = self.standbys.pop(0)
        local = rank % self.args.nproc
        self.store.set(f"standby/{self.node}/{k}", f"{rank} {generation} {local}")
        self.ranks[rank] = (standby, generation)
        self.status.say(f"standby {k} takes rank {rank} in generation {generation}")
        self.owed += 1
        self.last_failure = time.monotonic()
        if announce and all(joined == generation for _, joined in self.ranks.values()):
            self.status.say(f"every rank of generation {generation} is taken over",
                            event="generation", generation=generation, **self.failure)
            self.status.say(f"generation {generation} runs", event="ranks",
                            generation=generation, pids=self.pids())

    def _reap_replaced(self) -> None:
        """A rank of a replaced generation that does not leave (blocked on a peer that is
        gone, not closed) is killed after ``LEAVE_S``."""
        now = time.monotonic()
        for rank, since in list(self.replaced.items()):
            proc, joined = self.ranks[rank]
            if joined < self.generation and proc.poll() is None and now - since > LEAVE_S:
                proc.kill()
                self.replaced.pop(rank)

    def stop_all(self) -> None:
        procs = [p for _, p in self.standbys] + [p for p, _ in self.ranks.values()]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def _store(args, hosting: bool):
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=300)
    if args.master:
        host, _, port = args.master.rpartition(":")
        return dist.TCPStore(host, int(port), is_master=hosting, wait_for_workers=False,
                             timeout=timeout if hosting else datetime.timedelta(seconds=60))
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                         timeout=timeout)


def main(argv=None) -> int:
    args = parse_args(argv)
    status = _Status(args.status)
    hosting = args.node_rank == 0 and not args.spare
    store = _store(args, hosting)
    if hosting:
        store.set("generation", "0")
    host = args.master.rpartition(":")[0] if args.master else "127.0.0.1"
    base = {**os.environ, "MASTER_ADDR": host, "MASTER_PORT": str(store.port),
            "WORLD_SIZE": str(args.nproc * args.nnodes), ENABLED_ENV: "1"}
    if "OMP_NUM_THREADS" not in os.environ and args.nproc > 1:
        base["OMP_NUM_THREADS"] = "1"     # as torchrun: ranks and standbys share the cores
    launcher = Launcher(args, store, status, base, args.node or node_name(os.environ))
    control = args.control or (control_path(args.status) if args.status else None)
    requests = StatusReader(control) if control else None
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    try:
        launcher.start()
        while True:
            time.sleep(0.01)
            if stop:                # torn down from outside: its ranks' exits are no failure
                return 128 + stop[0]
            try:
                if launcher.step(requests):
                    break
            except (RuntimeError, ValueError) as exc:    # the store is gone (its host ended)
                if args.spare and not launcher.ranks:
                    return 0
                if hosting:
                    raise
                status.say(f"fallback to a relaunch: the store at {args.master} is gone "
                           f"({exc})", event="fallback", reason="the store is gone")
                return 1
            except _Fenced:
                status.say("this machine was taken for lost and its ranks run elsewhere: "
                           "stopping everything here", event="fenced")
                return 0
            except _Fallback as exc:
                status.say(f"fallback to a relaunch: {exc}", event="fallback", reason=str(exc))
                if launcher.cluster.leader:
                    store.set("fallback", str(exc))
                return 1
        if launcher.cluster.leader:              # the others still use the store
            while not launcher._all_done() and not stop:
                launcher._cluster_news()          # still the judge of lost machines
                launcher._reap_replaced()
                time.sleep(0.05)
        return 0
    finally:
        launcher.stop_all()


if __name__ == "__main__":
    sys.exit(main())
