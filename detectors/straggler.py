"""The straggler detector: ranks persistently slower than their peers and their own past.

Its rules are on the class. Each rank's usual pace and its last ``n`` steps are kept in one
of two books that apply the same rules to a step: :class:`PaceDicts`, a loop over the step's
ranks (fastest while a job is small), and :class:`PaceArrays`, numpy over all of them at
once (a job of 100,000 ranks: the loop costs about 3 us a rank and step, the arrays about
0.5 us; their fixed cost is about 100 us a step, five times the loop's at 8 ranks).
A job moves to arrays at its first step of ``peers.ARRAYS_FROM`` (128) ranks or more, for good;
``tests/test_straggler_books.py`` holds both books to the same findings.

>>> d = StragglerDetector(k=3, n=4, settle=0, warmup=3)
>>> out = []
>>> for s in range(9):
...     slow = 0.80 if s >= 4 else 0.50                       # rank 6 gets 1.6x slower
...     ct = [0.50, 0.51, 0.49, 0.50, 0.50, 0.52, slow, 0.50]
...     out += d.update(make_jobstep(s, 10.0 + s, compute_time=ct))
>>> [(f.kind, f.ranks, f.step) for f in out]
[('straggler', [6], 4)]
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from trainguard.setting import setting

from .base import Detector, Finding, fmt_ranks, make_jobstep, median
from .peers import (ARRAYS_FROM, RankRows, array_median, peer_ratio_array, peer_ratios,
                    step_times)
from .registry import register_detector
from .view import UsesView

__all__ = ["StragglerDetector", "PaceDicts", "PaceArrays", "ARRAYS_FROM"]

#: the weight of a step in a rank's learned spread (its mean absolute deviation)
_SPREAD_WEIGHT = 0.02


@register_detector(kinds="straggler", ladder=("capture", "evict_if_persistent", "alert"),
                   priority=60, causes={"straggler": "shared", "hang": "shared",
                                        "machine_outlier": "shared"})
class StragglerDetector(UsesView, Detector):
    """Ranks persistently slower than their peers of the same role, and than their own past.

    Peers: with a known topology (lifecycle ``topology``, Megatron layout: TP fastest, then
    DP, then PP) the ranks of the same pipeline stage, when a stage has ``min_ranks`` (a
    stage with fewer of them in a step, its other ranks' records late, is not judged in
    it); otherwise the whole job. Each rank has its own *usual share*: the log of its
    ``compute_time`` over its peers' (the mean of its first ``warmup`` steps, then moved by
    ``baseline_step`` towards each step within its own noise: a running median, which a
    noisy rank's slow half does not drag), and its own *spread* (the mean absolute deviation
    of its log ratio). A rank whose usual share came out at least ``ratio`` x its peers'
    while at most a quarter of them did is slow from its first step: its share is set back
    to its peers'. In a step every
    time is first divided by its rank's usual share, and a rank's *ratio* is its scaled time
    over the median of its peers' scaled times; so ranks that differ steadily from the start,
    or a steadily slower stage compared across the job, are not stragglers, and several
    ranks falling behind at once do not hide each other. A rank is *slow* in a step when its
    ratio is at least ``ratio`` and at least ``noise_z`` x its spread (a 12% wobble on a
    shared CPU is noise), and its time at least ``min_excess_s`` more. A rank slow in
    ``k`` of the last ``n`` steps it reported is a
    straggler, also when single normal steps break the run. When the first rank qualifies,
    the detector waits ``settle`` steps for others (a whole slow machine), and while another
    rank is falling behind too (slow in 2+ steps) up to ``n`` steps, then names the ranks
    that qualified meanwhile and are still slow in most steps; machines all of whose ranks
    are named are named too. A named rank is
    reported again only after it recovered (slow in at most ``n - k`` of the last ``n``).

    >>> d = StragglerDetector(k=3, n=4, settle=0, warmup=2)
    >>> out = []
    >>> for s in range(8):
    ...     ct = [0.50, 0.51, 0.49, 0.50, 0.50, 0.52, 0.80 if s >= 3 else 0.5, 0.50]
    ...     out += d.update(make_jobstep(s, 10.0 + s, compute_time=ct))
    >>> [(f.kind, f.ranks, f.step) for f in out]
    [('straggler', [6], 3)]
    """

    PREFIX = "straggler"
    CONSUMES = ("jobstep", "life")

    @dataclass(kw_only=True)
    class Config:
        ratio: float = setting(1.2, "slow in a step: compute_time >= ratio x usual", above=1,
                               live=(1.001, 100.0))
        min_excess_s: float = setting(0.002, "... and at least this many seconds more",
                                      live=(0.0, 3600.0))
        k: int = setting(6, "persistent: slow in k ...", minimum=1, at_most="n",
                         live=(1, 100_000))
        n: int = setting(10, "... of the last n steps it reported")
        settle: int = setting(2, "steps to wait for more ranks before naming them",
                              live=(0, 1000))
        min_ranks: int = setting(3, "ranks needed in a step (and a stage) to compare",
                                 minimum=2)
        warmup: int = setting(10, "steps each rank's own baseline is learned over (one step "
                                  "learns no noise)", minimum=2)
        baseline_step: float = setting(0.002, "... then moved this much (log) per step")
        noise_z: float = setting(3.0, "slow also needs >= z x the rank's own spread")

    def _start(self) -> None:
        self._paces = PaceDicts()       # each rank's usual pace and last steps
        self._init_view()              # where ranks run, ranks per pipeline stage
        self._pending = None           # steps left before naming
        self._waited = 0               # steps waited since the first rank qualified
        self._candidates: set = set()  # ranks that qualified meanwhile

    def update(self, item) -> list[Finding]:
        if type(item) is not dict:
            return []
        if self._own_view:
            self.view.learn(item)
        if item.get("k") != "jobstep":
            return []
        st = step_times(item)
        if len(st) < self.min_ranks:
            return []
        if len(st) >= ARRAYS_FROM and type(self._paces) is PaceDicts:
            self._paces = PaceArrays.of(self._paces, self)
        step, ts = item["step"], item["ts"]
        size = self._stage_size(item)
        qualifying = self._paces.judge(self, st, step, ts, size)
        if not qualifying and self._pending is None:
            return []
        if self._pending is None:
            self._pending, self._waited, self._candidates = self.settle, 0, set()
        self._candidates.update(qualifying)
        self._waited += 1
        if self._pending > 0 or (self._waited <= self.n
                                 and self._paces.rising(self, self._candidates)):
            self._pending -= 1
            return []
        self._pending = None
        # the ranks that qualified while waiting and are still slow in most steps
        slow_count = self._paces.slow_count
        qualifying = sorted(r for r in self._candidates if slow_count(r) * 2 > self.n)
        if not qualifying:
            return []
        self._paces.mark_named(qualifying)
        return [self._finding(qualifying, step, ts, size)]

    def _stage_size(self, jobstep) -> int:
        """Ranks per pipeline stage to compare within, 0: across the job. Not when a stage
        holds fewer than ``min_ranks``, nor when the step's world is not whole stages of it
        (a resize whose starts told no topology left the one before)."""
        size, world = self.view.stage_size, jobstep.get("world")
        if size < self.min_ranks or (type(world) is int and world % size):
            return 0
        return size

    def _finding(self, qualifying, step, ts, size: int) -> Finding:
        history = {r: self._paces.history(r) for r in qualifying}
        first = min((h for r in qualifying for h in history[r] if h[0]),
                    key=lambda h: (h[1], h[2]))
        mean_ratio = {str(r): round(sum(h[3] for h in history[r]) / len(history[r]), 3)
                      for r in sorted(qualifying)}
        nodes = self.view.whole_nodes(qualifying)
        where = f" (all of machine{'s' if len(nodes) > 1 else ''} {', '.join(nodes)})" if nodes else ""
        worst = max(float(v) for v in mean_ratio.values())
        peers = "the peers of their pipeline stage" if size else "their peers"
        return Finding(
            kind="straggler", severity="warning", ranks=sorted(qualifying), nodes=nodes,
            step=first[1], onset_ts=first[2], detected_ts=ts, detector=self.PREFIX,
            summary=(f"{fmt_ranks(qualifying)}{where} slower than {peers} (each against its "
                     f"usual pace) in {self.k}+ of {self.n} steps, up to {worst:.2f}x"),
            evidence={"mean_ratio": mean_ratio, "ratio_threshold": self.ratio,
                      "k": self.k, "n": self.n, "detected_step": step,
                      "stage_size": self.view.stage_size,
                      "rank_nodes": self.view.rank_nodes(qualifying)})


class PaceDicts:
    """Each rank's usual pace and last steps in dicts, a step judged rank by rank (the rules
    are :class:`StragglerDetector`'s)."""

    def __init__(self):
        self.base: dict = {}       # rank -> [log of its usual share, steps learned, share,
                                   #          mean absolute deviation of its log ratio]
        self.steps: dict = {}      # rank -> deque of (slow, step, ts, ratio), the last n
        self.slow_steps: dict = {}  # rank -> how many of its steps were slow
        self.named_ranks: set = set()  # named, not recovered since

    def judge(self, d: StragglerDetector, st, step, ts, size: int) -> list:
        """Learn one step (``size``: ranks per stage compared, 0: the whole job); returns the
        ranks that qualify now (not named yet)."""
        times = dict(zip(st.ranks, st.values))
        ratios = self._ratios(d, times, size)
        # the typical ratio of the step's ranks that are not slow: what a rank learns is its
        # ratio against it, so a straggler among few ranks (each normal rank's peer median
        # is then its slower normal peer) does not drag every usual share down, and with
        # them the straggler's ratio
        usual = sorted([r for r in ratios.values() if 0 < r < d.ratio])
        m = len(usual)
        shift = math.log(usual[m // 2] if m % 2 else (usual[m // 2 - 1] + usual[m // 2]) / 2) \
            if m else 0.0
        qualifying, learned_now = self.apply(d, times, ratios, shift, step, ts)
        if learned_now:
            self._slow_from_the_start(d, learned_now)
        return qualifying

    def apply(self, d: StragglerDetector, times: dict, ratios: dict, shift: float, step,
              ts) -> tuple:
        """Each rank's step judged from its ratio to its peers and learned (the work that
        needs no other rank's state): ``(qualifying ranks, ranks whose warm-up ended)``."""
        qualifying = []
        base_of, ratio = self.base, d.ratio
        log_ratio, warmup = math.log(ratio), d.warmup
        history, slow_steps, named, n, k = self.steps, self.slow_steps, self.named_ranks, d.n, d.k
        log, exp, min_excess, step_size = math.log, math.exp, d.min_excess_s, d.baseline_step
        z, half_ratio, spread_weight = d.noise_z, log_ratio / 2, _SPREAD_WEIGHT
        learned_now = []
        for rank, r in ratios.items():
            if r <= 0:
                continue
            rel = log(r)                    # judge the step, learn the rank's usual share
            base = base_of.get(rank)
            count = slow_steps.get(rank, 0)
            if base is None:
                base_of[rank] = [rel, 1, r, 0.0]
                slow, r = False, 1.0
            else:
                level, learned, _, dev = base
                # slow: past the ratio, and past the rank's own noise (a shared CPU's 12%)
                slow = (learned >= warmup and rel >= log_ratio and rel >= z * dev
                        and (t := times[rank]) - t / r >= min_excess)
                if learned < warmup:
                    base[0] = level = level + min(rel, log_ratio) / (learned + 1)
                    base[1] = learned + 1
                    base[2] = exp(level)
                    base[3] = dev + (min(abs(rel), log_ratio) - dev) / learned
                    if learned + 1 == warmup:
                        learned_now.append(rank)
                else:
                    own = rel - shift
                    twice = dev + dev
                    if count + count < k:
                        # its noise, slow steps included while it is not falling behind
                        size = own if own >= 0 else -own
                        cap = twice if twice > log_ratio else log_ratio
                        base[3] = dev + spread_weight * ((size if size < cap else cap) - dev)
                    # a slow step is not learned, nor a drift up beyond the rank's noise: it
                    # may grow. A fixed step towards each step: the median of a noisy rank's
                    # steps, not a mean pulled down by never learning their slow side
                    if rel < log_ratio and own != 0 and (
                            own < half_ratio or own < twice):
                        base[0] = level = level + (step_size if own > 0 else -step_size)
                        base[2] = exp(level)
            hist = history.get(rank)
            if hist is None:
                hist = history[rank] = deque(maxlen=n)
            if len(hist) == n and hist[0][0]:
                count -= 1                        # the oldest slow step leaves the window
            hist.append((slow, step, ts, r))
            count += slow
            slow_steps[rank] = count
            if rank in named:
                if count <= n - k:
                    named.discard(rank)
            elif count >= k:
                qualifying.append(rank)
        return qualifying, learned_now

    def _ratios(self, d, times: dict, size: int) -> dict:
        """Each rank's scaled time over the median of its peers' (see the detector); peers
        within a pipeline stage of ``size`` ranks (0: the whole job)."""
        base = self.base
        scaled = {}
        for rank, t in times.items():
            b = base.get(rank)
            scaled[rank] = t / b[2] if b is not None else t
        if not size:
            return peer_ratios(scaled)
        stages: dict = {}
        for rank, t in scaled.items():
            stages.setdefault(rank // size, {})[rank] = t
        ratios = {}
        for group in stages.values():
            # a stage short of peers in this step (records late, the job restarting) is
            # not judged: against the other stages, one slower by design would stand out
            ratios.update(peer_ratios(group) if len(group) >= d.min_ranks
                          else dict.fromkeys(group, 0.0))
        return ratios

    def _slow_from_the_start(self, d, learned_now) -> None:
        """A rank that learned a usual share of at least ``ratio`` x its peers' while at most a
        quarter of its peers did is slow from its first step, not different by design (as the
        several speeds of a heterogeneous job): its usual share is set back to its peers'."""
        cut = math.log(d.ratio)
        judged = {}                       # group -> (peers' median, how many at cut above it)
        for key, levels in self.warm_levels(d, learned_now).items():
            mid = median(levels)    # once per group: all ranks end warm-up together
            judged[key] = (mid, sum(1 for v in levels if v - mid >= cut), len(levels))
        self.set_back(d, learned_now, judged)

    def warm_levels(self, d, learned_now) -> dict:
        """``{group: [usual share's log of each of its ranks past warm-up]}``, for the
        groups of ``learned_now``."""
        base, size = self.base, d.view.stage_size
        wanted = {rank // size if size else 0 for rank in learned_now}
        groups: dict = {}
        for rank, b in base.items():
            key = rank // size if size else 0
            if key in wanted and b[1] >= d.warmup:
                groups.setdefault(key, []).append(b[0])
        return groups

    def set_back(self, d, learned_now, judged: dict) -> None:
        """Each of ``learned_now`` whose group ``(median, how many at the cut above it,
        ranks)`` says it is slow from the start gets its peers' share."""
        base, cut, size = self.base, math.log(d.ratio), d.view.stage_size
        for rank in learned_now:
            mid, high, peers = judged[rank // size if size else 0]
            b = base[rank]
            if b[0] - mid >= cut and high <= max(1, peers // 4):
                b[0] = mid
                b[2] = math.exp(mid)

    def rising(self, d, qualifying) -> bool:
        """Another rank slow in 2+ of its last steps, not yet qualifying: ranks falling
        behind together a few steps apart are named together (wait at most ``n`` steps)."""
        for rank, count in self.slow_steps.items():
            if 2 <= count < d.k and rank not in self.named_ranks and rank not in qualifying:
                return True
        return False

    def slow_count(self, rank) -> int:
        return self.slow_steps[rank]

    def history(self, rank) -> list:
        """A rank's last steps, oldest first: ``(slow, step, ts, ratio)``."""
        return list(self.steps[rank])

    def mark_named(self, ranks) -> None:
        """The detector named ``ranks``: each is named again only after it recovered."""
        self.named_ranks.update(ranks)


class PaceArrays:
    """Each rank's usual pace and last steps in arrays (a row per rank), a step judged over
    all its ranks at once with the rules of :class:`PaceDicts`."""

    _ARRAYS = ("level", "learned", "share", "dev", "slow", "named_row",
               "h_slow", "h_step", "h_ts", "h_ratio", "h_count")

    def __init__(self, n: int):
        self.n = n
        self.rows = RankRows()
        # per row: the log of its usual share, steps learned, the share, the mean absolute
        # deviation of its log ratio, how many of its last n steps were slow, named
        self.level = np.zeros(0)
        self.learned = np.zeros(0, dtype=np.int64)
        self.share = np.ones(0)
        self.dev = np.zeros(0)
        self.slow = np.zeros(0, dtype=np.int64)
        self.named_row = np.zeros(0, dtype=bool)
        # its last n steps, a ring: slow, step, ts, ratio; how many it ever recorded (the
        # next goes to that modulo n)
        self.h_slow = np.zeros((0, n), dtype=bool)
        self.h_step = np.zeros((0, n), dtype=np.int64)
        self.h_ts = np.zeros((0, n))
        self.h_ratio = np.zeros((0, n))
        self.h_count = np.zeros(0, dtype=np.int64)

    @classmethod
    def of(cls, dicts: PaceDicts, d: StragglerDetector) -> PaceArrays:
        """The same paces, moved from ``dicts``."""
        paces = cls(d.n)
        ranks = list(dicts.base)
        rows = paces.rows.rows(ranks, paces._grow)
        for row, rank in zip(rows.tolist(), ranks):
            level, learned, share, dev = dicts.base[rank]
            paces.level[row], paces.learned[row] = level, learned
            paces.share[row], paces.dev[row] = share, dev
            steps = dicts.steps.get(rank, ())
            for i, (slow, step, ts, ratio) in enumerate(steps):
                paces.h_slow[row, i], paces.h_step[row, i] = slow, step
                paces.h_ts[row, i], paces.h_ratio[row, i] = ts, ratio
            paces.h_count[row] = len(steps)
            paces.slow[row] = dicts.slow_steps.get(rank, 0)
        paces.mark_named(dicts.named_ranks)
        return paces

    def _grow(self, rows: int) -> None:
        have = len(self.level)
        if rows <= have:
            return
        size = max(rows, have + have // 4, 64)      # a snapshot holds the spare rows too
        for name in self._ARRAYS:
            old = getattr(self, name)
            new = np.ones(size) if name == "share" else np.zeros((size, *old.shape[1:]),
                                                                  dtype=old.dtype)
            new[:have] = old
            setattr(self, name, new)

    def judge(self, d: StragglerDetector, st, step, ts, size: int) -> list:
        """Learn one step (see :meth:`PaceDicts.judge`)."""
        rows = self.rows.rows(st.ranks, self._grow)
        times = st.times
        ratios = self._ratios(d, rows, times / self.share[rows], size)
        # the typical ratio of the step's ranks that are not slow (see PaceDicts.judge)
        usual = ratios[(ratios > 0) & (ratios < d.ratio)]
        shift = float(np.log(array_median(usual))) if len(usual) else 0.0
        qualifying, learned_now = self.apply(d, rows, times, ratios, shift, step, ts)
        if len(learned_now):
            self._slow_from_the_start(d, learned_now)
        return qualifying

    def apply(self, d: StragglerDetector, rows, times, ratios, shift: float, step,
              ts) -> tuple:
        """As :meth:`PaceDicts.apply`, over the rows of the step's ranks (``times`` and
        ``ratios`` arrays in their order): ``(qualifying ranks, rows whose warm-up ended)``."""
        log_ratio = float(np.log(d.ratio))
        judged = ratios > 0
        if not judged.all():
            rows, times, ratios = rows[judged], times[judged], ratios[judged]
        rel = np.log(ratios)               # judge the step, learn each rank's usual share
        level, learned, dev = self.level[rows], self.learned[rows], self.dev[rows]
        count = self.slow[rows]
        warmup = d.warmup
        # slow: past the ratio, and past the rank's own noise (a shared CPU's 12%)
        slow = ((learned >= warmup) & (rel >= log_ratio) & (rel >= d.noise_z * dev)
                & (times - times / ratios >= d.min_excess_s))
        first = learned == 0
        warming = ~first & (learned < warmup)
        settled = learned >= warmup
        new_level, new_dev = level.copy(), dev.copy()
        if first.any():
            new_level[first] = rel[first]
            new_dev[first] = 0.0
        if warming.any():
            lw, rw, dw = learned[warming], rel[warming], dev[warming]
            new_level[warming] = level[warming] + np.minimum(rw, log_ratio) / (lw + 1)
            new_dev[warming] = dw + (np.minimum(np.abs(rw), log_ratio) - dw) / lw
        learned_now = np.flatnonzero(warming & (learned + 1 == warmup))
        if settled.any():
            lv, rs, ds = level[settled], rel[settled], dev[settled]
            own = rs - shift
            twice = ds + ds
            noisy = count[settled] * 2 < d.k
            cap = np.where(twice > log_ratio, twice, log_ratio)
            size = np.abs(own)
            spread = ds + _SPREAD_WEIGHT * (np.where(size < cap, size, cap) - ds)
            new_dev[settled] = np.where(noisy, spread, ds)
            moves = (rs < log_ratio) & (own != 0) & ((own < log_ratio / 2) | (own < twice))
            step_size = d.baseline_step
            new_level[settled] = np.where(moves, lv + np.where(own > 0, step_size, -step_size),
                                          lv)
        moved = warming.copy()             # the rows whose level moved: their share follows
        if settled.any():
            moved[settled] = moves
        self.level[rows] = new_level
        self.dev[rows] = new_dev
        self.learned[rows] = np.where(learned < warmup, learned + 1, learned)
        if moved.any():
            self.share[rows[moved]] = np.exp(new_level[moved])
        if first.any():
            self.share[rows[first]] = ratios[first]
        count = self._remember(rows, slow, step, ts, np.where(first, 1.0, ratios), count)
        rank_of = self.rows.rank_of
        named_now = self.named_row[rows]
        recovered = rows[named_now & (count <= d.n - d.k)]
        if len(recovered):
            self.named_row[recovered] = False
        qualifying = [rank_of[i] for i in rows[~named_now & (count >= d.k)].tolist()]
        return qualifying, rows[learned_now]

    def _remember(self, rows, slow, step, ts, ratios, count) -> np.ndarray:
        """Each row's step in its ring of the last ``n``; returns the rows' new slow counts."""
        n = self.n
        recorded = self.h_count[rows]
        pos = recorded % n
        leaving = (recorded >= n) & self.h_slow[rows, pos]   # the oldest slow step leaves
        count = count - leaving + slow
        self.h_slow[rows, pos] = slow
        self.h_step[rows, pos] = step
        self.h_ts[rows, pos] = ts
        self.h_ratio[rows, pos] = ratios
        self.h_count[rows] = recorded + 1
        self.slow[rows] = count
        return count

    def _ratios(self, d, rows, scaled, size: int) -> np.ndarray:
        """As :meth:`PaceDicts._ratios`, over arrays."""
        if not size:
            return peer_ratio_array(scaled)
        gid = self.rows.group_ids(size)[rows]
        ratios = np.zeros(len(scaled))          # 0: a stage short of peers, not judged
        order = np.argsort(gid, kind="stable")
        bounds = np.flatnonzero(np.diff(gid[order])) + 1
        for part in np.split(order, bounds):
            if len(part) >= d.min_ranks:
                ratios[part] = peer_ratio_array(scaled[part])
        return ratios

    def _slow_from_the_start(self, d, learned_now) -> None:
        """As :meth:`PaceDicts._slow_from_the_start`, over arrays."""
        used, cut = len(self.rows), float(np.log(d.ratio))
        gid = self.rows.group_ids(d.view.stage_size)[:used]
        warm = self.learned[:used] >= d.warmup
        for group in np.unique(gid[learned_now]):  # once per group: all end warm-up together
            levels = self.level[:used][warm & (gid == group)]
            mid = array_median(levels)
            high = int(np.count_nonzero(levels - mid >= cut))
            mine = learned_now[gid[learned_now] == group]
            if high <= max(1, len(levels) // 4):
                reset = mine[self.level[mine] - mid >= cut]
                self.level[reset] = mid
                self.share[reset] = np.exp(mid)

    def warm_levels(self, d, learned_now) -> dict:
        """As :meth:`PaceDicts.warm_levels` (``learned_now``: ranks)."""
        size, used = d.view.stage_size, len(self.rows)
        ranks = np.array(self.rows.rank_of, dtype=np.int64)
        keys = ranks // size if size else np.zeros(used, dtype=np.int64)
        warm = self.learned[:used] >= d.warmup
        out = {}
        for key in {rank // size if size else 0 for rank in learned_now}:
            levels = self.level[:used][warm & (keys == key)]
            if len(levels):
                out[key] = levels.tolist()
        return out

    def set_back(self, d, learned_now, judged: dict) -> None:
        """As :meth:`PaceDicts.set_back` (``learned_now``: ranks)."""
        cut, size, row_of = math.log(d.ratio), d.view.stage_size, self.rows.row_of
        for rank in learned_now:
            mid, high, peers = judged[rank // size if size else 0]
            row = row_of[rank]
            if self.level[row] - mid >= cut and high <= max(1, peers // 4):
                self.level[row] = mid
                self.share[row] = np.exp(mid)          # as _slow_from_the_start

    def rising(self, d, qualifying) -> bool:
        """As :meth:`PaceDicts.rising`."""
        used = len(self.rows)
        count = self.slow[:used]
        rising = (count >= 2) & (count < d.k) & ~self.named_row[:used]
        if not rising.any():
            return False
        rank_of = self.rows.rank_of
        return any(rank_of[i] not in qualifying for i in np.flatnonzero(rising).tolist())

    def slow_count(self, rank) -> int:
        return int(self.slow[self.rows.row_of[rank]])

    def history(self, rank) -> list:
        """A rank's last steps, oldest first: ``(slow, step, ts, ratio)``."""
        row = self.rows.row_of[rank]
        recorded, n = int(self.h_count[row]), self.n
        length = min(recorded, n)
        start = (recorded - length) % n
        return [(bool(self.h_slow[row, i]), int(self.h_step[row, i]),
                 float(self.h_ts[row, i]), float(self.h_ratio[row, i]))
                for i in ((start + j) % n for j in range(length))]

    def mark_named(self, ranks) -> None:
        """The detector named ``ranks``: each is named again only after it recovered."""
        row_of = self.rows.row_of
        self.named_row[[row_of[r] for r in ranks if r in row_of]] = True
