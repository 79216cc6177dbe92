"""The standby launcher: restarts in place, with warm standby ranks, on one machine.

    trainguard run --job J --nproc 4 --standby 2 -- train.py --snapshot-every 1 ...
    python -m trainguard.launcher.inplace --nproc 4 --standby 2 -- train.py ...

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
import json
import os
import signal
import subprocess
import sys
import time

from trainguard.broker import free_port
from trainguard.checkpoint.inplace import ENABLED_ENV, STANDBY_ENV
from trainguard.launcher.inplace_status import StatusReader, control_path
from trainguard.launcher.supervisor import _die_with_parent

__all__ = ["main", "parse_args", "REFILL_AFTER_S"]

#: seconds after the last failure before new standbys start (the restoring ranks take about
#: half a second; faults can come a few seconds apart)
REFILL_AFTER_S = 2.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m trainguard.launcher.inplace",
                                description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--standby", type=int, default=None,
                   help="warm standby processes (default: one per rank)")
    p.add_argument("--max-restarts", type=int, default=3, help="in-place restarts at most")
    p.add_argument("--status", default=None, metavar="FILE",
                   help="append one JSON line per restart or fallback")
    p.add_argument("--control", default=None, metavar="FILE",
                   help="read requests (rollback) from FILE (default: beside --status)")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS...")
    args = p.parse_args(argv)
    if args.script and args.script[0] == "--":
        args.script = args.script[1:]
    if not args.script:
        p.error("give the training script after --")
    if args.nproc < 1 or (args.standby is not None and args.standby < 0):
        p.error("--nproc must be 1 or more, --standby 0 or more")
    return args


class _Status:
    def __init__(self, path):
        self.path = path

    def say(self, text: str, **record) -> None:
        print(f"[inplace] {text}", flush=True)
        if self.path and record:
            with open(self.path, "a") as out:
                out.write(json.dumps({**record, "ts": time.time()}) + "\n")


def main(argv=None) -> int:
    import torch.distributed as dist

    args = parse_args(argv)
    status = _Status(args.status)
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=300))
    store.set("generation", "0")
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
            "WORLD_SIZE": str(args.nproc), ENABLED_ENV: "1"}

    def spawn(rank: int, standby: int | None = None) -> subprocess.Popen:
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(max(rank, 0))}
        if standby is not None:
            env[STANDBY_ENV] = str(standby)
        return subprocess.Popen([sys.executable, *args.script], env=env,
                                preexec_fn=_die_with_parent())

    ranks = {r: (spawn(r), 0) for r in range(args.nproc)}
    standbys: list = []
    next_standby = 0
    for _ in range(args.nproc if args.standby is None else args.standby):
        standbys.append((next_standby, spawn(-1, next_standby)))
        next_standby += 1
    generation, finished, owed, last_failure, failure = 0, set(), 0, 0.0, {}
    def pids() -> dict:
        return {str(r): proc.pid for r, (proc, _) in ranks.items()}

    status.say(f"ranks {sorted(ranks)} started", event="ranks", generation=0, pids=pids())
    control = args.control or (control_path(args.status) if args.status else None)
    requests = StatusReader(control) if control else None
    rollback = None                 # the step the next generation restores at or before
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.append(signum))
    try:
        while len(finished) < args.nproc:
            time.sleep(0.01)
            if stop:                # torn down from outside: its ranks' exits are no failure
                return 128 + stop[0]
            if owed and time.monotonic() - last_failure > REFILL_AFTER_S:
                standbys.append((next_standby, spawn(-1, next_standby)))   # refill the pool,
                next_standby += 1                     # once the new generation is under way
                owed -= 1
            for request in requests.new() if requests is not None else ():
                if request.get("op") != "rollback" or type(request.get("step")) is not int \
                        or request["step"] < 0 or type(request.get("id")) is not str:
                    continue
                refused = ("restarts in place are used up" if generation >= args.max_restarts
                           else f"{len(standbys)} standby(s) for {args.nproc} ranks"
                           if len(standbys) < args.nproc else None)
                if refused:
                    status.say(f"rollback refused: {refused}", event="rollback_refused",
                               id=request["id"], reason=refused)
                    continue
                rollback = request["step"]
                status.say(f"rollback to step {rollback}: every rank stops", event="rollback",
                           id=request["id"], step=rollback)
                for proc, joined in ranks.values():
                    if joined == generation and proc.poll() is None:
                        proc.kill()
            for rank, (proc, joined) in list(ranks.items()):
                rc = proc.poll()
                if rc is None or rank in finished:
                    continue
                if rc == 0:
                    finished.add(rank)
                    continue
                if joined == generation:       # a new failure (not a peer leaving after it)
                    if generation >= args.max_restarts:
                        reason = (f"rank {rank} exited with status {rc} and "
                                  f"{args.max_restarts} in-place restarts are used up")
                        status.say(f"fallback to a relaunch: {reason}", event="fallback",
                                   reason=reason)
                        return 1
                    generation += 1
                    store.set("generation", str(generation))
                    failure = {"rank": rank, "status": rc, "failed_ts": time.time()}
                    if rollback is not None:
                        store.set(f"resume_step/{generation}", str(rollback))
                        failure["rollback_step"], rollback = rollback, None
                    status.say(f"rank {rank} exited with status {rc} at "
                               f"{failure['failed_ts']:.3f}: generation {generation}",
                               event="failure", generation=generation, **failure)
                while standbys and standbys[0][1].poll() is not None:
                    k, dead = standbys.pop(0)       # a standby that died while it waited
                    status.say(f"standby {k} exited with status {dead.returncode}")
                    owed += 1
                if not standbys:
                    reason = f"no standby left for rank {rank}"
                    status.say(f"fallback to a relaunch: {reason}", event="fallback",
                               reason=reason)
                    return 1
                k, standby = standbys.pop(0)
                store.set(f"standby/{k}", f"{rank} {generation}")
                ranks[rank] = (standby, generation)
                status.say(f"standby {k} takes rank {rank} in generation {generation}")
                owed += 1
                last_failure = time.monotonic()
                if all(joined == generation for _, joined in ranks.values()):
                    status.say(f"every rank of generation {generation} is taken over",
                               event="generation", generation=generation, **failure)
                    status.say(f"generation {generation} runs", event="ranks",
                               generation=generation, pids=pids())
        return 0
    finally:
        _stop_all([p for _, p in standbys] + [p for p, _ in ranks.values()])


def _stop_all(procs: list) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
