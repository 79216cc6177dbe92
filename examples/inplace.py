"""Restart in place: a launcher with warm standby ranks, for examples/train.py --inplace.

    python examples/inplace.py --nproc 4 --standby 1 -- examples/train.py --inplace \
        --snapshot-every 1 --job demo --steps 300

It starts ``--nproc`` rank processes and ``--standby`` standby processes (default: one per
rank; torch imported, waiting), and one TCPStore they all share. When a rank process dies (a
crash, or a hung rank killed by the action service), the launcher does not relaunch anything:
it raises the *generation* in the store. The other ranks, whose collectives failed when their
peer died, exit at once (a gloo collective blocked on a live peer is released only when that
peer's process goes; docs/RECOVERY.md), and each rank is handed to a standby, which forms the
next generation's process group (the same store, a new key prefix), restores the newest common
step from the in-memory snapshots and goes on. New standbys refill the pool
``REFILL_AFTER_S`` seconds after the last failure. With no standby left, or after
``--max-restarts`` in-place restarts, every process is stopped and the launcher exits with
status 1, so the outer launcher (``trainguard run``, torchrun) relaunches: the fallback, and the
launcher prints that it is one.

Each event is one line on stdout: ``[inplace] rank R exited with status S at T; standby K takes
it, generation G`` and ``[inplace] fallback to a relaunch: ...``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import signal
import socket
import subprocess
import sys
import time


class InPlace:
    """The rank side (examples/train.py under this launcher): join a generation's process
    group; when a collective fails, leave (the launcher hands the rank to a warm standby)."""

    #: the exit status of a rank that leaves because a peer failed
    LEFT = 75

    def __init__(self, args):
        self.args = args
        self.store = None
        self.generation = 0
        self.rank = self.world = -1

    def join(self) -> None:
        import torch.distributed as dist

        env = os.environ
        timeout = datetime.timedelta(seconds=self.args.timeout)
        self.store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                                   is_master=False, timeout=timeout)
        self.world = int(env["WORLD_SIZE"])
        standby = env.get("TRAINGUARD_STANDBY")
        if standby is None:
            self.rank = int(env["RANK"])
            self.generation = int(self.store.get("generation"))
        else:                                  # warm: torch imported; wait for a rank
            key = f"standby/{standby}"
            while True:
                try:
                    self.store.wait([key], datetime.timedelta(days=1))
                    break
                except Exception:               # the store's wait timed out: wait again
                    continue
            rank, generation = self.store.get(key).decode().split()
            self.rank, self.generation = int(rank), int(generation)
            env["RANK"], env["LOCAL_RANK"] = str(self.rank), str(self.rank)
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(f"generation{self.generation}", self.store),
            rank=self.rank, world_size=self.world, timeout=timeout)

    def leave(self, exc: BaseException, snapshots) -> None:
        """Exit at once (a gloo collective blocked on a live peer is released only when that
        peer's process goes: so every rank of the failed generation goes, and quickly)."""
        if snapshots is not None:
            snapshots.before_update()          # an unfinished copy: complete, or torn
        print(f"[inplace] rank {self.rank} leaves generation {self.generation} at "
              f"{time.time():.3f}: {type(exc).__name__}", flush=True)
        os._exit(self.LEFT)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--standby", type=int, default=None,
                   help="warm standby processes (default: one per rank)")
    p.add_argument("--max-restarts", type=int, default=3, help="in-place restarts at most")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    args = p.parse_args(argv)
    if args.script and args.script[0] == "--":
        args.script = args.script[1:]
    if not args.script:
        p.error("give the training script after --")
    return args


#: seconds after the last failure before new standbys start (their imports would slow the
#: restoring ranks down)
REFILL_AFTER_S = 10.0


def say(text: str) -> None:
    print(f"[inplace] {text}", flush=True)


def main(argv=None) -> int:
    import torch.distributed as dist

    args = parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=300))
    store.set("generation", "0")
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(args.nproc), "TRAINGUARD_INPLACE": "1"}

    def spawn(rank: int, standby: int | None = None) -> subprocess.Popen:
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(max(rank, 0))}
        if standby is not None:
            env["TRAINGUARD_STANDBY"] = str(standby)
        return subprocess.Popen([sys.executable, *args.script], env=env)

    ranks = {r: (spawn(r), 0) for r in range(args.nproc)}
    standbys: list = []
    next_standby = 0
    for _ in range(args.nproc if args.standby is None else args.standby):
        standbys.append((next_standby, spawn(-1, next_standby)))
        next_standby += 1
    generation, finished, owed, last_failure = 0, set(), 0, 0.0
    try:
        while len(finished) < args.nproc:
            time.sleep(0.01)
            if owed and time.monotonic() - last_failure > REFILL_AFTER_S:
                standbys.append((next_standby, spawn(-1, next_standby)))   # refill the pool,
                next_standby += 1                     # once the new generation is under way
                owed -= 1
            for rank, (proc, joined) in list(ranks.items()):
                rc = proc.poll()
                if rc is None or rank in finished:
                    continue
                if rc == 0:
                    finished.add(rank)
                    continue
                if joined == generation:       # a new failure (not a peer leaving after it)
                    if generation >= args.max_restarts:
                        say(f"fallback to a relaunch: rank {rank} exited with status {rc} "
                            f"and {args.max_restarts} in-place restarts are used up")
                        return 1
                    generation += 1
                    store.set("generation", str(generation))
                    say(f"rank {rank} exited with status {rc} at {time.time():.3f}: "
                        f"generation {generation}")
                if not standbys:
                    say(f"fallback to a relaunch: no standby left for rank {rank}")
                    return 1
                k, standby = standbys.pop(0)
                store.set(f"standby/{k}", f"{rank} {generation}")
                ranks[rank] = (standby, generation)
                say(f"standby {k} takes rank {rank} in generation {generation}")
                owed += 1
                last_failure = time.monotonic()
        return 0
    finally:
        for _, proc in standbys:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in ranks.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [p for _, p in standbys] + [p for p, _ in ranks.values()]:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
