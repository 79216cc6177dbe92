"""Issue 21 point 1, its first part: the step detectors (NaN, loss and gradient spikes,
throughput) from partials merged per step, against the same detectors from every rank's
record, in the same run.

Per size (4,096, 16,384 and 100,000 ranks, the records ``bench_scale`` sends: loss, gradient
norm, step and compute times, tokens), ``STEPS`` steps after ``WARM``:

- ``records_us_per_step``: the four detectors over one ``jobstep`` that holds every rank's
  record, as the job side runs them today (its CPU µs per step, and per rank-step);
- ``partial_us_per_rank_step``: a telemetry partition's :class:`PartialBuilder` turning its
  ranks' records of a step into one partial (the rank side's added work, spread over the
  workers);
- ``merged_us_per_step``: the job side merging the ``partitions`` partials of a step and the
  four detectors reading the result: what those detectors cost the job side once nothing
  per rank reaches it; ``merged_cpu_s_per_job_s`` the same at one step a second;
- ``partial_bytes``: one partial's JSON size (orjson), what each partition would send per
  step;
- ``same_findings``: whether both paths found the same (the bench's steps are healthy, with
  a NaN loss on one rank at one step and the job's step time doubled from step 60).

The automatic garbage collector is off while it runs, as in the worker.

- ``silent_*``: the silent detector's look, once a second of the job, over ranks all heard
  lately: its one book's loop over every rank today, per rank, against the books split by
  partition (the rank side's loops, per rank; the job side's merge of their answers, per
  look).
- ``silent_ticks_*``: the same looks judged from each partition's summary (its ``k`` = 8
  longest-unheard ranks, ``detectors/live_ticks.py``): the rank side's summaries per rank,
  the job side's look over the summaries, a summary's JSON size, and how many of the looks'
  summaries did not suffice (``asked``: none, the ranks are all heard lately).
- ``hang_ticks_*``: the same looks from each partition's summary (``PhaseSummary``, its
  full part, ``k`` = 8): the rank side's summaries per rank (light part alone: the ranks in
  a pause; with the full part), the job side's look over them.
- ``hang_*``: the hang detector's look (``advance``, twice a second of the job) while every
  rank sits in a checkpoint, the case in which it asks the most of its ranks (the
  deadline's pauses, the ranks left behind in a pause or in the step): one book against
  books per partition, as for the silent detector.

``python bench/run.py step_partials --json``; ``TG_PARTIALS_SIZES=4096`` for fewer.
"""
from __future__ import annotations

import gc
import os
import random
import time

SIZES = (4096, 16384, 100_000)
PARTITIONS = {4096: 24, 16384: 48, 100_000: 96}
WARM, STEPS = 5, 80


def _records(ranks: int, step: int, rng: random.Random) -> dict:
    slow = 2.0 if step >= 60 else 1.0
    straggler = ranks // 3 + 1
    out = {}
    for r in range(ranks):
        loss = 2.5 - step * 1e-3 + (r % 7) * 1e-4
        lag = 1.6 if r == straggler and 15 <= step < 35 else 1.0
        out[r] = {"k": "step", "job": "scale", "rank": r, "node": f"n{r // 8:05d}",
                  "ts": 1.8e9 + step + (r % 13) * 1e-3, "step": step,
                  "step_time": slow * (1.0 + rng.random() * 0.01),
                  "compute_time": lag * slow * (0.8 + (r % 5) * 1e-3 + rng.random() * 0.01),
                  "tokens": 4096,
                  "loss": "NaN" if (step, r) == (40, ranks // 3) else loss,
                  "grad_norm": 1.0 + rng.random() * 0.01}
    return out


def _detectors():
    from trainguard.detectors.timing import ThroughputDetector
    from trainguard.detectors.training import GradSpikeDetector, LossSpikeDetector, NanDetector

    return [NanDetector(), LossSpikeDetector(), GradSpikeDetector(),
            ThroughputDetector(warmup=10)]


def _straggler(ranks: int, partitions: int = 0):
    """A straggler detector that knows the job's TP 8 x PP 4 layout (its peers: a pipeline
    stage); with ``partitions``, its book split over them (:class:`PaceParts`)."""
    from trainguard.detectors.pace_parts import PaceParts
    from trainguard.detectors.straggler import StragglerDetector

    d = StragglerDetector()
    d.update({"k": "life", "job": "scale", "rank": 0, "node": "n00000", "ts": 1.8e9,
              "event": "start", "world_size": ranks,
              "topology": {"tp": 8, "pp": 4, "dp": ranks // 32}})
    if partitions:
        d._paces = PaceParts(partitions, arrays=True, n=d.n)
    return d


def one_size(ranks: int) -> dict:
    import orjson

    from trainguard.detectors import pace_parts
    from trainguard.detectors.partials import PartialBuilder, merge

    partitions = PARTITIONS.get(ranks, max(4, ranks // 1000))
    rng = random.Random(ranks)
    builders = [PartialBuilder() for _ in range(partitions)]
    by_records, by_partials = _detectors(), _detectors()
    straggler_records, straggler_parts = _straggler(ranks), _straggler(ranks, partitions)
    cpu = {"records": 0.0, "partial": 0.0, "merged": 0.0, "straggler_records": 0.0,
           "straggler_parts": 0.0, "straggler_answer": 0.0}
    found = {"records": [], "merged": [], "straggler_records": [], "straggler_parts": []}
    answer = pace_parts.answer

    def timed_answer(*args):
        t = time.process_time()
        try:
            return answer(*args)
        finally:
            cpu["straggler_answer"] += (time.process_time() - t) * (s >= WARM)

    pace_parts.answer = timed_answer
    size = 0
    for s in range(WARM + STEPS):
        records = _records(ranks, s, rng)
        groups = [{} for _ in range(partitions)]
        for r, rec in records.items():
            groups[r % partitions][r] = rec
        timed = s >= WARM
        jobstep = {"k": "jobstep", "job": "scale", "step": s, "ts": records[0]["ts"],
                   "first_ts": records[0]["ts"], "world": ranks, "ranks": records}
        t = time.process_time()
        for d in by_records:
            found["records"] += [(f.kind, f.ranks, f.step) for f in d.update(jobstep)]
        t1 = time.process_time()
        partials = [b.partial(g) for b, g in zip(builders, groups)]
        t2 = time.process_time()
        merged = {**{k: v for k, v in jobstep.items() if not k.startswith(("ranks", "_"))},
                  "agg": merge(partials)}
        for d in by_partials:
            found["merged"] += [(f.kind, f.ranks, f.step) for f in d.update(merged)]
        t3 = time.process_time()
        for name, d in (("straggler_records", straggler_records),
                        ("straggler_parts", straggler_parts)):
            t4 = time.process_time()
            found[name] += [(f.kind, f.ranks, f.step) for f in d.update(jobstep)]
            if timed:
                cpu[name] += time.process_time() - t4
        if timed:
            cpu["records"] += t1 - t
            cpu["partial"] += t2 - t1
            cpu["merged"] += t3 - t2
        size = max(size, max(len(orjson.dumps(p, option=orjson.OPT_NON_STR_KEYS))
                             for p in partials))
    pace_parts.answer = answer
    per_step = {k: v / STEPS * 1e6 for k, v in cpu.items()}
    rank_side = per_step["straggler_parts"] - per_step["straggler_answer"]
    return {"ranks": ranks, "partitions": partitions,
            "records_us_per_step": round(per_step["records"]),
            "records_us_per_rank_step": round(per_step["records"] / ranks, 3),
            "partial_us_per_rank_step": round(per_step["partial"] / ranks, 3),
            "merged_us_per_step": round(per_step["merged"]),
            "merged_cpu_s_per_job_s": round(per_step["merged"] / 1e6, 5),
            "merged_over_records": round(per_step["merged"] / per_step["records"], 4),
            "partial_bytes": size,
            "findings": found["records"],
            "same_findings": found["records"] == found["merged"],
            "straggler_records_us_per_rank_step": round(per_step["straggler_records"] / ranks, 3),
            "straggler_split_rank_side_us_per_rank_step": round(rank_side / ranks, 3),
            "straggler_split_job_side_us_per_step": round(per_step["straggler_answer"]),
            **silent_looks(ranks, partitions),
            **silent_ticks(ranks, partitions),
            **hang_looks(ranks, partitions),
            **hang_ticks(ranks, partitions),
            "straggler_findings": found["straggler_records"],
            "straggler_same_findings": found["straggler_records"] == found["straggler_parts"]}


def silent_looks(ranks: int, partitions: int, looks: int = 10) -> dict:
    """The silent detector's looks (one a second of the job) over ``ranks`` ranks heard every
    second: its one book today against books per partition (the rank side's loops, the job
    side's merge of their answers)."""
    from trainguard.detectors import live_parts, rank_books
    from trainguard.detectors.liveness import SilentDetector

    whole, split = SilentDetector(), live_parts.SilentParts(partitions)
    books = {"whole": 0.0, "split": 0.0, "rank_side": 0.0}
    look = rank_books.HeardBook.look
    timing = [False]

    def timed_look(self, *args):
        t = time.process_time()
        try:
            return look(self, *args)
        finally:
            if timing[0] and self not in whole._books:
                books["rank_side"] += time.process_time() - t

    rank_books.HeardBook.look = timed_look
    try:
        for second in range(looks + 2):
            for d in (whole, split):
                for r in range(ranks):
                    d.update({"k": "hb", "rank": r, "node": f"n{r // 8:05d}",
                              "ts": 1.8e9 + second + (r % 13) * 1e-3})
            timing[0] = second >= 2
            for name, d in (("whole", whole), ("split", split)):
                t = time.process_time()
                d.advance(1.8e9 + second + 0.5)
                if timing[0]:
                    books[name] += time.process_time() - t
    finally:
        rank_books.HeardBook.look = look
    merge = books["split"] - books["rank_side"]
    return {"silent_look_records_us_per_rank": round(books["whole"] / looks / ranks * 1e6, 3),
            "silent_split_rank_side_us_per_rank": round(
                books["rank_side"] / looks / ranks * 1e6, 3),
            "silent_split_job_side_us_per_look": round(merge / looks * 1e6)}


def silent_ticks(ranks: int, partitions: int, looks: int = 10, k: int = 8) -> dict:
    """The silent detector's looks from its partitions' summaries: each summary timed and
    recorded (the rank side), then the look again on the recorded summaries (the job
    side)."""
    import orjson

    from trainguard.detectors import live_ticks

    ticks = live_ticks.SilentTicks(partitions, k)
    original = live_ticks.heard_summary
    spent = {"rank_side": 0.0, "job_side": 0.0}
    tape: list = []

    def recorded(*args):
        t = time.process_time()
        out = original(*args)
        spent["rank_side"] += time.process_time() - t
        tape.append(out)
        return out

    try:
        for second in range(looks + 2):
            for r in range(ranks):
                ticks.update({"k": "hb", "rank": r, "node": f"n{r // 8:05d}",
                              "ts": 1.8e9 + second + (r % 13) * 1e-3})
            if second < 2:
                ticks.advance(1.8e9 + second + 0.5)
                continue
            tape.clear()
            live_ticks.heard_summary = recorded
            ticks._looked = None                # the same look twice
            assert ticks.advance(1.8e9 + second + 0.5) == []
            answers = iter(list(tape))
            live_ticks.heard_summary = lambda *args: next(answers)
            ticks._looked = None
            t = time.process_time()
            ticks.advance(1.8e9 + second + 0.5)
            spent["job_side"] += time.process_time() - t
    finally:
        live_ticks.heard_summary = original
    return {"silent_ticks_rank_side_us_per_rank": round(
                spent["rank_side"] / looks / ranks * 1e6, 3),
            "silent_ticks_job_side_us_per_look": round(spent["job_side"] / looks * 1e6),
            "silent_ticks_summary_bytes": len(orjson.dumps(tape[0])),
            "silent_ticks_asked": ticks.asked}


def hang_ticks(ranks: int, partitions: int, looks: int = 10, k: int = 8) -> dict:
    """The hang detector's looks while every rank is in a checkpoint, from its partitions'
    summaries: taken and timed first (the rank side), then the look over them (the job
    side)."""
    from trainguard.detectors import live_parts, live_ticks

    ticks = live_ticks.HangTicks(partitions, k)
    spent = {"light": 0.0, "full": 0.0, "job_side": 0.0}
    t0 = 1.8e9
    for step in range(8):
        for r in range(ranks):
            ticks.update({"k": "step", "rank": r, "node": f"n{r // 8:05d}",
                          "ts": t0 + step + (r % 13) * 1e-3, "step": step, "step_time": 0.9})
    for tick in range(2 * (looks + 2)):
        now = t0 + 8 + tick / 2
        if tick % 2 == 0:
            for r in range(ranks):
                ticks.update({"k": "hb", "rank": r, "node": f"n{r // 8:05d}",
                              "ts": now + (r % 13) * 1e-3, "step": 7,
                              "phase": "checkpoint", "phase_since": t0 + 8.0})
        t = time.process_time()
        summaries = [live_ticks.PhaseSummary(b, k, ticks.stale_s) for b in ticks._books]
        light = time.process_time()
        for summary in summaries:
            summary._take_full()
        full = time.process_time()
        ticks._ticked = summaries
        assert live_parts.HangParts.advance(ticks, now + 0.25) == []
        done = time.process_time()
        ticks._ticked = None
        if tick >= 4:
            spent["light"] += light - t
            spent["full"] += full - t
            spent["job_side"] += done - full
    n = 2 * looks
    return {"hang_ticks_light_us_per_rank": round(spent["light"] / n / ranks * 1e6, 3),
            "hang_ticks_full_us_per_rank": round(spent["full"] / n / ranks * 1e6, 3),
            "hang_ticks_job_side_us_per_look": round(spent["job_side"] / n * 1e6)}


def hang_looks(ranks: int, partitions: int, looks: int = 10) -> dict:
    """The hang detector's looks while every rank is in a checkpoint begun together (each
    rank heard once a second): one book against books per partition. The split's look runs
    twice: once with its books' answers timed and recorded (the rank side), once with the
    recorded answers given back at once (the job side: the merges and the rules; a look
    changes nothing while the checkpoint lasts)."""
    from trainguard.detectors import live_parts, rank_books
    from trainguard.detectors.liveness import HangDetector

    whole, split = HangDetector(), live_parts.HangParts(partitions)
    spent = {"whole": 0.0, "job_side": 0.0, "rank_side": 0.0}
    questions = ("pause_starts", "pausing_fresh", "pausing_phases", "fresh_count",
                 "positions", "phase_groups", "census", "stale", "fresh_where", "at_position")
    originals = {name: getattr(rank_books.PhaseBook, name) for name in questions}
    tape: list = []

    def recorded(method):
        def run(self, *args, **kwargs):
            t = time.process_time()
            out = method(self, *args, **kwargs)
            spent["rank_side"] += time.process_time() - t
            tape.append(out)
            return out
        return run

    def replayed(self, *args, **kwargs):
        return next(answers)

    t0 = 1.8e9
    for step in range(8):                       # steps to learn from, then the checkpoint
        for d in (whole, split):
            for r in range(ranks):
                d.update({"k": "step", "rank": r, "node": f"n{r // 8:05d}",
                          "ts": t0 + step + (r % 13) * 1e-3, "step": step, "step_time": 0.9})
    try:
        for tick in range(2 * (looks + 2)):
            now = t0 + 8 + tick / 2
            if tick % 2 == 0:
                for d in (whole, split):
                    for r in range(ranks):
                        d.update({"k": "hb", "rank": r, "node": f"n{r // 8:05d}",
                                  "ts": now + (r % 13) * 1e-3, "step": 7,
                                  "phase": "checkpoint", "phase_since": t0 + 8.0})
            if tick < 4:
                continue
            t = time.process_time()
            assert whole.advance(now + 0.25) == []
            spent["whole"] += time.process_time() - t
            tape.clear()
            for name, method in originals.items():
                setattr(rank_books.PhaseBook, name, recorded(method))
            assert split.advance(now + 0.25) == []
            answers = iter(list(tape))
            for name in originals:
                setattr(rank_books.PhaseBook, name, replayed)
            t = time.process_time()
            split.advance(now + 0.25)
            spent["job_side"] += time.process_time() - t
            for name, method in originals.items():
                setattr(rank_books.PhaseBook, name, method)
    finally:
        for name, method in originals.items():
            setattr(rank_books.PhaseBook, name, method)
    n = 2 * looks
    return {"hang_look_one_book_us_per_rank": round(spent["whole"] / n / ranks * 1e6, 3),
            "hang_split_rank_side_us_per_rank": round(spent["rank_side"] / n / ranks * 1e6, 3),
            "hang_split_job_side_us_per_look": round(spent["job_side"] / n * 1e6)}


def run() -> dict:
    sizes = [int(s) for s in os.environ.get("TG_PARTIALS_SIZES", "").split(",") if s] or SIZES
    gc.disable()           # as in the worker, which collects on its own schedule
    try:
        return {"sizes": [one_size(n) for n in sizes]}
    finally:
        gc.enable()
