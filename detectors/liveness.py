"""Detectors of a job that stopped: hang (no progress), silent (no events), crash (exit).

They read the rank summaries (``step``, ``hb``, ``life``) and, for machines, ``ev.Gpu``
samples. ``advance(now)`` lets hang and silent notice what did not arrive, and crash decide a
tear-down; offline ``now`` is the recording's event time, online the job's clock.

>>> d = CrashDetector()
>>> life = {"k": "life", "job": "j", "rank": 5, "node": "n2", "ts": 50.0, "event": "exit",
...         "exit_code": None, "signal": "SIGSEGV", "step": 812}
>>> [(f.kind, f.ranks, f.step, f.summary) for f in d.update(life)]
[('crash', [5], 812, 'rank 5 on n2 exited by signal SIGSEGV after step 812')]
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from trainguard.setting import MONTH_S, setting

from .base import Detector, Finding, fmt_ranks
from .view import UsesView
from .hang import HangDetector
from .rank_books import ExitBook, HeardBook, book_of
from .registry import register_detector

__all__ = ["HangDetector", "SilentDetector", "CrashDetector"]


#: Signals (and the exit codes shells and ``subprocess`` use for them) by which a launcher,
#: a scheduler or a user stops processes from outside: a rank ending so is torn down, not
#: failing.
TEARDOWN_SIGNALS = frozenset(("SIGTERM", "SIGINT", "TERM", "INT"))
TEARDOWN_CODES = {-15: "SIGTERM", 143: "SIGTERM", -2: "SIGINT", 130: "SIGINT"}


@register_detector(kinds="silent", ladder=("alert",), priority=40,
                   causes={"silent": "any", "hang": "any", "machine_outlier": "shared"})
class SilentDetector(UsesView, Detector):
    """A rank, or a whole machine, that stops sending anything while the rest go on.

    A rank is silent after ``timeout_s`` without any summary from it while some other rank
    was heard within ``timeout_s``. "Heard" is on the job's clock (the newest event time of any
    rank or machine) when its summary came, not the rank's own time stamp: a machine whose
    clock runs seconds behind the others', or whose collector sends in bursts, is not quiet
    for that. Time in which nobody was heard at all (a gap between the job's records of
    ``timeout_s`` and of 20 s, twice the longest between a collector's heartbeats, or more:
    the job was down, or its first records after a restart are those of a machine whose
    clock stepped back meanwhile) counts toward nobody's silence. When every known rank of a
    machine is silent and that machine's GPU samples stopped too (or it never sent any), the
    machine is named. Ranks that exited are not silent. A rank is reported again only after
    it was heard from again.

    >>> d = SilentDetector(timeout_s=10.0)
    >>> for t in range(30):
    ...     for r in range(4):
    ...         if r < 2 or t < 5:      # n2 (ranks 2, 3) stops at t=4
    ...             _ = d.update({"k": "hb", "rank": r, "node": f"n{1 + r // 2}", "ts": float(t)})
    ...     found = d.advance(float(t))
    ...     if found:
    ...         print(t, found[0].nodes, found[0].ranks)
    14 ['n2'] [2, 3]
    """

    PREFIX = "silent"
    #: ranks last heard within this of each other stopped together (a job killed at once,
    #: whose partitions' last records a worker applied a moment apart): the rest does not
    #: go on, and none of them is silent
    TOGETHER_S = 2.0
    #: a rank's collector sends a heartbeat at least this often (``collectors.settings.
    #: MAX_HEARTBEAT_INTERVAL_S``): a gap in the job's records of twice that is the whole
    #: job quiet, and counts toward nobody's silence
    CADENCE_S = 10.0
    CONSUMES = ("step", "hb", "life", "gpu", "tick")

    @dataclass(kw_only=True)
    class Config:
        timeout_s: float = setting(15.0, "a rank or machine silent this long while others go "
                                         "on", live=(0.1, MONTH_S))

    def _start(self) -> None:
        self._init_view()          # where ranks run, when each was last heard
        self._gpu_seen: dict = {}  # node -> job clock at its last gpu sample
        self._clock = None         # the newest event time of the job
        self._books = [HeardBook()]   # when each rank was last heard, its exit, its report
        self._looked = None        # the time the detector last looked at

    def update(self, item) -> list[Finding]:
        if type(item) is dict:
            if self._own_view:
                self.view.learn(item)
            rank = item.get("rank")
            ts = item.get("ts")
            k = item.get("k")
            clock = self._tick(ts) if ts is not None else None
            if rank is None or ts is None or k not in ("step", "hb", "life"):
                if k == "gpu" and item.get("node") and ts is not None:
                    self._gpu_sample(item["node"], clock)    # a NodeStage's gpu summary
                return []
            upto = self.view.heard_upto
            if upto is not None and clock > ts:
                # online, a partition read ahead is applied up to a second before the others:
                # heard once every partition was heard up to here, as analyze hears it
                clock = max(ts, min(upto, clock))
            books = self._books       # book_of, inline: it runs for every item
            book = books[rank % len(books)] if len(books) > 1 else books[0]
            # a lifecycle item that is not an exit ends one (its event "" when it tells none)
            book.hear(rank, clock, (item.get("event") or "") if k == "life" else None)
        elif getattr(item, "TYPE", "") == "gpu" and item.node:
            self._gpu_sample(item.node, self._tick(item.ts))
        return []

    def _look(self, limit: float, going_on: float, half: float) -> tuple:
        """:meth:`~.rank_books.HeardBook.look` of the job: its books' answers merged."""
        unseen, node_of = self.view.unseen, self.view.node_of
        books = self._books
        if len(books) == 1:
            return books[0].look(limit, going_on, half, unseen, node_of)
        quiet, pending, alive = [], set(), False
        for book in books:
            q, p, a = book.look(limit, going_on, half, unseen, node_of)
            quiet += q
            pending |= p
            alive = alive or a
        return quiet, pending, alive

    def _by_book(self, ranks) -> list:
        """``[(book, its ranks of ranks), ...]``."""
        by: dict = {}
        for rank in ranks:
            by.setdefault(book_of(self._books, rank), []).append(rank)
        return list(by.items())

    @property
    def _every(self) -> float:
        """How often the detector looks, in the job's time."""
        return min(1.0, self.timeout_s / 10)

    def _tick(self, ts: float) -> float:
        """The job's clock, moved on to ``ts`` when that is newer. A leap of twice
        :attr:`CADENCE_S` and ``timeout_s`` or more, in which nobody was heard at all (the
        job was down, or the first records after it are a machine's whose clock stepped
        meanwhile), counts toward nobody's silence: what was heard before it is heard that
        much later. (A shorter one makes nobody silent at once; a rank's summaries come at
        least every ``stages.heartbeat_summary_s``, which must be below ``timeout_s``.)"""
        clock = self._clock
        if clock is None or ts > clock:
            if clock is not None and ts - clock >= self.CADENCE_S * 2.0 and \
                    ts - clock >= self.timeout_s:
                gap = ts - clock
                for book in self._books:
                    book.shift(gap)
                seen = self._gpu_seen
                for node in seen:
                    seen[node] += gap
            self._clock = clock = ts
        return clock

    def _gpu_sample(self, node, ts) -> None:
        prev = self._gpu_seen.get(node)
        if prev is None or ts > prev:
            self._gpu_seen[node] = ts

    def advance(self, now: float) -> list[Finding]:
        at = self.view.judged(now)       # a rank still on its way is not missing
        looked, every = self._looked, self._every
        # looks on a fixed grid of the job's time, however `at` moves
        if looked is not None and at < (math.floor(looked / every) + 1) * every:
            return []
        self._looked = at
        limit = at - self.timeout_s
        quiet, pending, alive = self._look(limit, limit + self.TOGETHER_S,
                                           at - self.timeout_s / 2)
        if not quiet or not alive:
            return []
        node_of = self.view.node_of
        by_node: dict = {}
        for rank, ts in quiet:
            by_node.setdefault(node_of(rank), []).append((rank, ts))
        findings = []
        for node, heard in sorted(by_node.items(), key=lambda kv: (str(kv[0]), kv[0] is None)):
            oldest = min(ts for _, ts in heard)
            if node is not None and at - oldest < self.timeout_s * 1.5 and node in pending:
                continue   # more ranks of this machine are going quiet: wait for them
            findings.append(self._finding(node, heard, at, looked))
        return findings

    def _finding(self, node, heard, at, looked) -> Finding:
        """Stamped when the evidence sufficed: the first look of the grid after the ranks'
        silence reached ``timeout_s``, if the detector last looked before it and ``at`` (the
        time up to which every source was heard) is past it; else ``at``. The same online
        (partitions heard up to a time that moves in jumps while the job is quiet) as in
        ``analyze``."""
        unseen = self.view.unseen
        ranks = [r for r, _ in heard]
        on_node = [r for r in self.view.ranks_on(node) if r not in unseen]
        by_book = self._by_book(on_node)
        settled = {r for b, of in by_book for r in b.settled(of)}    # exited or reported
        exited = {r for b, of in by_book for r in b.exited_of(of)}
        node_ranks = [r for r in on_node if r not in exited]
        all_quiet = node is not None and all(r in ranks or r in settled for r in node_ranks)
        gpu = self._gpu_seen.get(node)
        machine = all_quiet and (gpu is None or at - gpu >= self.timeout_s / 2)
        for book, of in self._by_book(ranks):
            book.report(of)
        onset = min(self.view.seen(r) for r in ranks)
        every = self._every
        due = math.ceil((max(ts for _, ts in heard) + self.timeout_s) / every) * every
        if looked is not None and looked < due < at:
            at = due
        if machine:
            ranks = sorted(node_ranks)
            summary = (f"machine {node} went silent: its {len(ranks)} rank(s) and its GPU samples "
                       f"stopped {at - onset:.0f}s ago while the rest of the job goes on")
        else:
            summary = (f"{fmt_ranks(ranks)}{' on ' + node if node else ''} stopped sending "
                       f"{at - onset:.0f}s ago while the rest of the job goes on")
        return Finding(kind="silent", severity="critical", ranks=sorted(ranks),
                       nodes=[node] if machine else [], step=None, onset_ts=onset,
                       detected_ts=at, detector=self.PREFIX, summary=summary,
                       evidence={"last_seen": {str(r): self.view.seen(r) for r in sorted(ranks)},
                                 "gpu_last_seen": gpu, "machine": machine,
                                 "rank_nodes": self.view.rank_nodes(ranks)})


@register_detector(kinds="crash", ladder=("evict_if_repeated", "restart", "alert"),
                   priority=30, causes={"crash": "any", "hang": "any", "silent": "any",
                                        "machine_outlier": "shared"})
class CrashDetector(UsesView, Detector):
    """A rank that failed: a lifecycle ``exit`` with a non-zero code or a signal, or a rank
    that vanished without one while the launcher tore the job down.

    - A non-zero code or a signal other than SIGTERM/SIGINT (SIGSEGV, SIGABRT, a SIGKILL
      reported by a supervisor) is a critical crash of that rank at once.
    - SIGTERM/SIGINT exits are a *tear-down*: torchrun stopping the survivors of a failure,
      or the whole job stopped from outside. They are gathered for ``grace_s`` after the
      latest of them (or until a rank starts or steps again), also when every rank exited:
      ``trainguard run``'s word of its own restart may be read after them, and decided
      together:

      * when ranks were torn down or failed, the ranks heard within ``vanish_s`` before the
        first exit, and not since, that sent no exit (a SIGKILL or the OOM killer leaves no
        exit event) are the crash: one critical finding naming them, the torn-down and
        failed peers in its evidence (``collateral``: with gloo, the peers of a killed rank
        fail with code 1 before torchrun stops them; the correlator names the vanished
        ranks, not them);
      * else, after a crash exit, nothing more (the tear-down follows that crash);
      * else, when more ranks were torn down than are still running, the whole job was
        stopped from outside (a preemption, Ctrl-C, our own restart whose word was not
        read): one ``warning`` finding naming no rank (``evidence["external_stop"]``), so
        that it is still seen; ``trainguard run``'s word of its restart, read after the
        exits it caused (another partition), still makes them its own within ``grace_s``;
      * else the few SIGTERMed ranks, while the rest went on, are a critical crash.

      Later exits of the same tear-down are folded into it; it ends when a rank starts, or
      steps again after its exit. ``finish(now)`` decides a pending tear-down at the end of
      the input.

    - trainguard's own restarts are no crash: ``trainguard run`` announces one with a
      launcher lifecycle ``exit`` (rank null) carrying ``"restart": true`` before it tears the
      job down; every exit (and every rank that vanishes) of that tear-down is folded into it
      without a finding, and its time is kept in ``own_restarts``. A failure that such a
      restart answers is decided once its exits settled (``grace_s`` after the restart and
      its latest exit, or when the ranks start again): the action service may order the
      restart within the second of a peer's failure, before the other peers' exits are read,
      and those still count as collateral of the rank that vanished.

    >>> d = CrashDetector(grace_s=3.0)
    >>> for r in range(4):           # rank 3 is SIGKILLed after step 160, torchrun stops the rest
    ...     _ = d.update({"k": "step", "rank": r, "node": "n1", "ts": 99.0, "step": 160})
    >>> for r in range(3):
    ...     _ = d.update({"k": "life", "rank": r, "node": "n1", "ts": 100.0, "event": "exit",
    ...                   "exit_code": None, "signal": "SIGTERM", "step": 160})
    >>> d.advance(102.0)
    []
    >>> [(f.ranks, f.severity, f.summary) for f in d.advance(103.0)]  # doctest: +NORMALIZE_WHITESPACE
    [([3], 'critical', 'rank 3 on n1 vanished without an exit event after step 160 (killed by
      SIGKILL or the OOM killer, most likely); ranks 0, 1, 2 were torn down by SIGTERM 1.0s
      later')]
    """

    PREFIX = "crash"
    CONSUMES = ("step", "hb", "life", "tick", "end")

    @dataclass(kw_only=True)
    class Config:
        grace_s: float = setting(3.0, "wait after a SIGTERM/SIGINT exit for the rest",
                                 live=(0.0, 3600.0))
        vanish_s: float = setting(10.0, "ranks heard this shortly before it, with no exit, "
                                        "vanished (SIGKILL, OOM killer)", live=(0.0, 3600.0))

    def _start(self) -> None:
        self._books = [ExitBook()]  # when ranks were last heard, their steps, their exits
        self._init_view()          # where ranks run
        self._wave = None          # the open tear-down, see _open
        self._answered = None      # a failure our restart answered, until its exits settled
        self.own_restarts: list = []   # times trainguard run announced a restart (last 20)
        self._own_span = None      # (from, to) of our last restart, to its first new start

    def update(self, item) -> list[Finding]:
        if type(item) is not dict:
            return []
        if self._own_view:
            self.view.learn(item)
        k = item.get("k")
        if k not in ("step", "hb", "life"):
            return []
        rank, ts = item.get("rank"), item.get("ts")
        if ts is None:
            return []
        found = []
        event = item.get("event")
        if rank is not None:
            books = self._books
            book = books[rank % len(books)] if len(books) > 1 else books[0]   # book_of, inline
            exits = book.exit
        elif event == "exit" and item.get("restart"):
            wave = self._wave
            if wave is not None and wave["failed"] and not wave["own"] \
                    and not wave["decided"]:
                found = self._decide_answered(ts)
                wave["answered"] = ts           # decided once its exits settled (advance)
                self._answered, self._wave = wave, None
            wave = self._open(ts)               # trainguard run restarting the job
            wave["own"] = True
            self.own_restarts.append(ts)
            del self.own_restarts[:-20]
            return found
        if rank is None:
            if event == "start":
                found = self._close(ts)
        else:
            if k == "step" and rank in exits and ts > exits[rank]:
                found = self._close(ts)                   # stepping again: a restart
                del exits[rank]
            elif event == "start":
                found = self._close(ts)
                exits.pop(rank, None)
            last = book.last                  # heard, inline: it runs for every summary
            if ts >= last.get(rank, ts):
                last[rank] = ts
                step = item.get("step")
                if step is not None:
                    book.step[rank] = step
        if event != "exit":
            return found
        code, sig = item.get("exit_code"), item.get("signal")
        if rank is not None:
            exits[rank] = ts
        if not sig and code in (0, None):
            return []
        teardown = sig in TEARDOWN_SIGNALS or (not sig and code in TEARDOWN_CODES)
        if rank is None:                             # the launcher itself
            return [] if teardown or self._wave is not None else [self._exited(item)]
        answered = self._answered
        if answered is not None and ts < answered["answered"]:
            # an exit of the failure our restart answers, read after the restart began
            answered["last"] = max(answered["last"], ts)
            if teardown:
                answered["torn"][rank] = sig or TEARDOWN_CODES[code]
                return []
            answered["failed"].append(rank)
            return [self._exited(item)]
        span = self._own_span
        if span is not None and span[0] <= ts <= span[1] and self._wave is None:
            return []     # our restart's exit, read after the job started again (a partition
                          # read behind the others)
        wave = self._open(ts)
        wave["last"] = max(wave["last"], ts)
        if not wave["decided"]:
            wave["start"] = min(wave["start"], ts)      # exits may arrive out of order
        if wave["own"]:
            wave["torn"][rank] = sig or TEARDOWN_CODES.get(code) or f"code {code}"
            return []                           # part of our own restart
        if not teardown:
            wave["failed"].append(rank)
            return [self._exited(item)]
        wave["torn"][rank] = sig or TEARDOWN_CODES[code]
        return []        # decided grace_s after the last exit: our restart's word may follow

    def advance(self, now: float) -> list[Finding]:
        answered = self._answered
        at = self.view.judged(now)      # exits and the restart's word still on their way
        # decided (and stamped) at ``at``: the same time online as in ``analyze``
        found = self._decide_answered(at) if answered is not None and at >= max(
            answered["answered"], answered["last"]) + self.grace_s else []
        return found + self._advance_wave(at)

    def _advance_wave(self, at: float) -> list[Finding]:
        wave = self._wave
        if wave is None or wave["decided"] or at < wave["last"] + self.grace_s:
            return []
        if self.view.launcher_unseen:
            return []     # our restart's word may be among what nobody reads
        if not wave["torn"] and at < wave["start"] + self.vanish_s:
            return []     # failures alone: a peer hung in the collective is heard again first
        return self._decide(at)

    def finish(self, now: float) -> list[Finding]:
        """The input ended: decide a tear-down still within its grace period."""
        wave = self._wave
        found = self._decide_answered(now)
        return found + (self._decide(now) if wave is not None and not wave["decided"] else [])

    def _decide_answered(self, now) -> list[Finding]:
        """Decide the failure a restart of ours answered (see ``update``), if one waits."""
        answered, self._answered = self._answered, None
        return self._decide(now, answered) if answered is not None else []

    def _open(self, ts) -> dict:
        if self._wave is None:
            self._wave = {"start": ts, "last": ts, "torn": {}, "failed": [], "decided": False,
                          "own": False}
        return self._wave

    def _close(self, now) -> list[Finding]:
        wave = self._wave
        if wave is not None and wave["own"]:
            self._own_span = (wave["start"], now)
        if wave is not None and not wave["decided"] and self.view.launcher_unseen:
            wave["decided"] = True  # not judged: our restart's word may be among the unseen
        found = self.finish(now)
        self._wave = None
        return found

    def _pending(self, wave) -> dict:
        """``{rank: (last heard, last step)}`` of the ranks heard shortly before the
        tear-down began that have not exited, in rank order."""
        since, unseen, pending = wave["start"] - self.vanish_s, self.view.unseen, {}
        for book in self._books:
            pending.update(book.pending(since, unseen))
        return dict(sorted(pending.items()))

    def _steps_of(self, ranks) -> list:
        """The last steps known of ``ranks``."""
        steps = (book_of(self._books, r).step.get(r) for r in ranks)
        return [step for step in steps if step is not None]      # (a step is never None)

    def _decide(self, now, wave=None) -> list[Finding]:
        wave = wave if wave is not None else self._wave
        wave["decided"] = True
        if wave["own"]:
            return []        # trainguard's own restart: recorded by the supervisor, no alert
        start, torn = wave["start"], wave["torn"]
        pending = self._pending(wave)
        vanished = [r for r, (last, _) in pending.items() if last < start]
        answered = wave.get("answered")
        stopped_by_us = answered is not None and max(
            b.latest_exit() for b in self._books) >= answered     # alive until our restart
        if not torn and not stopped_by_us and len(vanished) >= len(wave["failed"]):
            vanished = []   # as many silent as failed: hung in the collective, not killed
        running = [r for r, (last, _) in pending.items() if last >= start]
        evidence = {"exit_code": None, "signal": None, "teardown_ts": start,
                    "torn_down": {str(r): torn[r] for r in sorted(torn)},
                    "failed": sorted(wave["failed"]), "running": running}
        signals = "/".join(sorted(set(torn.values())))
        if vanished:
            onset = min(pending[r][0] for r in vanished)
            step = max((pending[r][1] for r in vanished if pending[r][1] is not None),
                       default=None)
            nodes = self.view.nodes_of(vanished)
            where = f" on {', '.join(nodes)}" if nodes else ""
            after = f" after step {step}" if step is not None else ""
            peers = (f"; {fmt_ranks(torn)} {'was' if len(torn) == 1 else 'were'} torn down by "
                     f"{signals} {start - onset:.1f}s later" if torn else "")
            return [Finding(
                kind="crash", severity="critical", ranks=vanished, nodes=[], step=step,
                onset_ts=onset, detected_ts=now, detector=self.PREFIX,
                summary=(f"{fmt_ranks(vanished)}{where} vanished without an exit event{after} "
                         f"(killed by SIGKILL or the OOM killer, most likely){peers}"),
                key=f"t{onset:.3f}",
                evidence={**evidence, "vanished": True,
                          "last_seen": {str(r): pending[r][0] for r in vanished},
                          # peers that failed or were stopped after it: its consequences
                          "collateral": sorted(set(torn) | set(wave["failed"])),
                          "rank_nodes": self.view.rank_nodes(vanished)})]
        if wave["failed"] or not torn:
            return []
        step = max(self._steps_of(torn), default=None)
        after = f" after step {step}" if step is not None else ""
        spread = wave["last"] - start
        if len(running) < len(torn):
            return [Finding(
                kind="crash", severity="warning", ranks=[], nodes=[], step=step,
                onset_ts=start, detected_ts=now, detector=self.PREFIX,
                summary=(f"the job was stopped from outside: {fmt_ranks(torn)} exited by signal "
                         f"{signals} within {spread:.1f}s{after} and no rank failed first "
                         f"(a restart, a preemption or Ctrl-C)"),
                key=f"t{start:.3f}", evidence={**evidence, "external_stop": True,
                                               "rank_nodes": {}})]
        ranks = sorted(torn)
        nodes = self.view.nodes_of(ranks)
        where = f" on {', '.join(nodes)}" if nodes else ""
        return [Finding(
            kind="crash", severity="critical", ranks=ranks, nodes=[], step=step,
            onset_ts=start, detected_ts=now, detector=self.PREFIX,
            summary=(f"{fmt_ranks(ranks)}{where} exited by signal {signals}{after} while "
                     f"{fmt_ranks(running)} went on"),
            key=f"t{start:.3f}", evidence={**evidence, "signal": signals,
                                           "rank_nodes": self.view.rank_nodes(ranks)})]

    def _exited(self, item) -> Finding:
        code, sig = item.get("exit_code"), item.get("signal")
        rank, node, ts = item.get("rank"), item.get("node"), item["ts"]
        how = f"by signal {sig}" if sig else f"with code {code}"
        who = f"rank {rank}" if rank is not None else "a process"
        where = f" on {node}" if node else ""
        after = f" after step {item['step']}" if item.get("step") is not None else ""
        ranks = [rank] if rank is not None else []
        return Finding(kind="crash", severity="critical", ranks=ranks, nodes=[],
                       step=item.get("step"), onset_ts=ts, detected_ts=ts,
                       detector=self.PREFIX, summary=f"{who}{where} exited {how}{after}",
                       key=f"t{ts:.3f}",
                       evidence={"exit_code": code, "signal": sig,
                                 "rank_nodes": {str(rank): node} if node and ranks else {}})
