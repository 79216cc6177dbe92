"""Timeline jobs for the hang detector (issue 19): per rank, segments ``(start, end, phase,
last step)``; a heartbeat every ``hb_every`` seconds tells the segment it falls in (as the rank
side forwards them), and a step record ends each step. Used by tests/test_hang_peers.py and
bench/bench_detection_quality.py's blind-window section."""
from __future__ import annotations

from dataclasses import dataclass, field

from trainguard.detectors import HangDetector

INF = float("inf")


@dataclass(kw_only=True)
class Job:
    world: int = 2
    step_s: float = 6.0
    steps: int = 12
    first_step_s: float = 6.0          # step 0 (compile) after a 10 s init
    checkpoint_after: tuple = ()       # checkpoints after these steps ...
    checkpoint_s: float = 45.0         # ... this long ...
    checkpoint_ranks: str = "all"      # ... on every rank, or "rank0" (the others block)
    rank0_extra_s: float = 0.0         # rank 0 stays this much longer in each checkpoint
    hang_step: int | None = None       # one rank hangs in data of this step ...
    hang_rank: int = 1
    stuck_checkpoint: int | None = None   # ... or in the checkpoint after this step
    skew: dict = field(default_factory=dict)   # rank -> its clock's offset in seconds
    hb_every: float = 1.0
    start: float = 1000.0
    end: float = INF                   # set when the job ends (every rank exits 0)
    peers_left: float | None = None    # set when the others left the stuck checkpoint

    def timelines(self):
        """Per rank: its segments, its step records ``(ts, step, step_time)``, and when the
        hang began: the hung rank's step began, or its peers left the stuck checkpoint."""
        segs = {r: [(self.start, self.start + 10.0, "init", None)] for r in range(self.world)}
        steps = {r: [] for r in range(self.world)}
        self.waited = {r: 0.0 for r in range(self.world)}   # blocked for a peer's checkpoint
        t = self.start + 10.0
        for s in range(self.steps):
            last = s - 1 if s else None
            long = self.first_step_s if s == 0 else self.step_s
            d, f = 0.1 * long, 0.4 * long
            if s == self.hang_step:
                for r in range(self.world):
                    if r == self.hang_rank:
                        segs[r].append((t, INF, "data", last))
                    else:
                        segs[r] += [(t, t + d, "data", last), (t + d, t + d + f, "forward", last),
                                    (t + d + f, INF, "backward", last)]
                return segs, steps, t
            for r in range(self.world):
                segs[r] += [(t, t + d, "data", last), (t + d, t + d + f, "forward", last),
                            (t + d + f, t + long - 0.1, "backward", last),
                            (t + long - 0.1, t + long, "collective", last)]
                steps[r].append((t + long, s, long + self.waited[r]))
                self.waited[r] = 0.0
            t += long
            if s in self.checkpoint_after:
                t = self._checkpoint(segs, s, t)
                if t == INF:
                    return segs, steps, self.peers_left
        self.end = t
        return segs, steps, None

    def _checkpoint(self, segs, s, t):
        ck = self.checkpoint_s
        if s == self.stuck_checkpoint:
            self.peers_left = t + ck
            for r in range(self.world):
                if r == self.hang_rank:
                    segs[r].append((t, INF, "checkpoint", s))
                else:
                    segs[r] += [(t, t + ck, "checkpoint", s), (t + ck, t + ck + 0.5, "data", s),
                                (t + ck + 0.5, INF, "backward", s)]
            return INF
        long = ck + self.rank0_extra_s
        for r in range(self.world):
            if r == 0:
                segs[r].append((t, t + long, "checkpoint", s))
            elif self.checkpoint_ranks == "all":
                segs[r] += [(t, t + ck, "checkpoint", s), (t + ck, t + long, "backward", s)]
                self.waited[r] = long - ck      # its next step reports the wait
            else:
                segs[r].append((t, t + long, "backward", s))
                self.waited[r] = long
        return t + long

    def items(self, until: float):
        segs, steps, hang_at = self.timelines()
        out = []
        for r in range(self.world):
            off = self.skew.get(r, 0.0)
            out.append((self.start, {"k": "life", "rank": r, "node": f"n{r}",
                                     "ts": self.start + off, "event": "start"}))
            for ts, s, long in steps[r]:
                out.append((ts, {"k": "step", "rank": r, "node": f"n{r}", "ts": ts + off,
                                 "step": s, "step_time": long}))
            if self.end < until:
                out.append((self.end + 0.5, {"k": "life", "rank": r, "node": f"n{r}",
                                             "ts": self.end + 0.5 + off, "event": "exit",
                                             "exit_code": 0}))
            t = self.start + 0.5
            while t < min(until, self.end):
                seg = next(g for g in segs[r] if g[0] <= t < g[1])
                out.append((t, {"k": "hb", "rank": r, "node": f"n{r}", "ts": t + off,
                                "phase": seg[2], "phase_since": seg[0] + off, "step": seg[3]}))
                t += self.hb_every
        out.sort(key=lambda x: x[0])
        return out, hang_at


def feed(detector, items, until: float, every: float = 1.0) -> list:
    """Feed ``(ts, item)`` pairs in time order, advancing every ``every`` s up to ``until``;
    the findings."""
    items = sorted(items, key=lambda x: x[0])
    found, i, t = [], 0, items[0][0]
    while t <= until:
        while i < len(items) and items[i][0] <= t:
            found += detector.update(items[i][1])
            i += 1
        found += detector.advance(t)
        t += every
    return found


def run(job: Job, until: float, detector: HangDetector | None = None, every: float = 0.5):
    """Feed the job in arrival order (the job's clock: rank 0's), advancing every ``every``."""
    d = detector if detector is not None else HangDetector()
    items, hang_at = job.items(until)
    return feed(d, items, until, every), hang_at, d


def to_events(job: Job, until: float, name: str = "pj", compute_frac: float = 0.9) -> list:
    """The job as SPEC events (``trainguard analyze`` and the worker's path: the rank side
    forwards step-phase heartbeats every 5 s only), in time order, stamped from ``job.start``
    on (event-time limits refuse stamps far in the past)."""
    from trainguard import events as ev

    items, _ = job.items(until)
    out = []
    for _, it in items:
        rank, node, ts = it["rank"], it["node"], it["ts"]
        if it["k"] == "step":
            out.append(ev.Step(job=name, ts=ts, node=node, rank=rank, step=it["step"],
                               step_time=it["step_time"],
                               compute_time=it["step_time"] * compute_frac, loss=2.0,
                               grad_norm=1.0))
        elif it["k"] == "hb":
            out.append(ev.Heartbeat(job=name, ts=ts, node=node, rank=rank, pid=100 + rank,
                                    phase=it["phase"], phase_since=it["phase_since"],
                                    step=it["step"]))
        elif it["event"] == "start":
            out.append(ev.Lifecycle(job=name, ts=ts, node=node, rank=rank, event="start",
                                    pid=100 + rank, world_size=job.world, local_rank=0))
        else:
            out.append(ev.Lifecycle(job=name, ts=ts, node=node, rank=rank, event="exit",
                                    pid=100 + rank, exit_code=it.get("exit_code")))
    return out
