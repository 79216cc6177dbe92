"""``trainguard analyze FILE``: the stream worker's detectors over a recording, in event time.

The clock is the recording's own: after each event the engine is advanced to the latest
event time seen so far, and once more at the end, so a hang at the end of a recording is
found from the heartbeats that kept coming while the steps stopped.

>>> import json, os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "crash.jsonl")
>>> lines = [{"v": 1, "type": "step", "job": "j", "ts": 100.0 + s, "node": "n1", "rank": r,
...           "step": s, "step_time": 1.0} for s in range(5) for r in range(2)]
>>> lines.append({"v": 1, "type": "lifecycle", "job": "j", "ts": 105.5, "node": "n1",
...               "rank": 1, "event": "exit", "exit_code": 139})
>>> with open(path, "w") as f:
...     _ = f.write("\\n".join(json.dumps(x) for x in lines) + "\\nnot json\\n")
>>> result = analyze_file(path)
>>> result["events"], result["invalid"], [(i["kind"], i["ranks"]) for i in result["incidents"]]
(11, 1, [('crash', [1])])
"""
from __future__ import annotations


from trainguard.eventtime import EventTimeFilter, EventTimeLimits
from trainguard.recording import ReadStats, read_events

from .config import DetectorConfig
from .stages import Engine

__all__ = ["analyze_file", "analyze_events", "result_of"]

_INCIDENT_KEYS = ("id", "kind", "job", "ranks", "nodes", "step", "onset_ts", "detected_ts",
                  "severity", "summary", "anomalies")


#: refusals listed in the output at most (all are counted)
MAX_REJECTIONS_LISTED = 100


def analyze_events(events, config: DetectorConfig | None = None,
                   limits: EventTimeLimits | None = None, tune_stage=None):
    """Run an :class:`Engine` over events in event time; returns ``(engine, summary)``.

    Events that :class:`~trainguard.eventtime.EventTimeFilter` refuses (an implausible
    ``ts`` or ``step``) are left out: ``summary["rejected"]`` counts them and
    ``summary["rejections"]`` lists the first ones with their reasons."""
    engine = Engine(config, tune_stage=tune_stage)
    update = engine.update
    job_time = engine.job_time
    check = EventTimeFilter(limits).check
    now = None
    next_advance = engine.next_advance_ts
    types: dict = {}
    jobs: set = set()
    first = None
    rejected = 0
    rejections = []
    for event in events:
        reason = check(event)
        if reason is not None:
            rejected += 1
            if len(rejections) < MAX_REJECTIONS_LISTED:
                rejections.append({"job": event.job, "type": event.TYPE, "rank": event.rank,
                                   "ts": event.ts, "reason": reason})
            continue
        kind = event.TYPE
        types[kind] = types.get(kind, 0) + 1
        jobs.add(event.job)
        update(event)
        ts = job_time(event)      # a machine's clock a minute off moves no job's "now"
        if now is None:
            now = first = ts
        elif ts > now:
            now = ts
        if now >= next_advance:
            engine.advance(now)
            next_advance = engine.next_advance_ts
    if now is not None:
        engine.advance(now, force=True)
    summary = {"types": types, "jobs": sorted(jobs), "first_ts": first, "last_ts": now,
               "rejected": rejected, "rejections": rejections}
    return engine, summary


def _overrides_book(overrides: dict | None, config):
    """The ``tune_stage`` of per-job overrides ``{job: {key: value}}`` (``--overrides``)."""
    if not overrides:
        return None
    from trainguard.overrides import Accepted, OverrideBook, check_values

    book = OverrideBook(base=config if config is not None else DetectorConfig())
    for job, values in overrides.items():
        book.set(Accepted(job=job, values=check_values(values, book.base), ts=0.0))
    return book.tune


def analyze_file(path, config: DetectorConfig | None = None,
                 overrides: dict | None = None, on_read=None) -> dict:
    """SPEC §4 ``{"events": N, "invalid": M, "incidents": [...]}`` for one recording.

    ``events`` counts the events analyzed, ``invalid`` the lines that were not: those that
    failed validation and those refused for an implausible ``ts`` or ``step``, which, when
    there are any, ``rejected`` counts and ``rejections`` lists (the first 100, with their
    reasons). ``on_read`` follows the reading of the file (:func:`read_events`). In one
    process; :func:`~.parallel.analyze_file_parallel` gives the same result over several.
    """
    stats = ReadStats()
    engine, summary = analyze_events(read_events(path, stats, on_read), config,
                                     tune_stage=_overrides_book(overrides, config))
    return result_of(engine, summary, stats.events, stats.invalid)


def result_of(engine, summary: dict, valid: int, invalid: int) -> dict:
    """The SPEC §4 dict of an analysis: ``valid`` and ``invalid`` lines read, ``engine`` and
    ``summary`` as :func:`analyze_events` returns them."""
    incidents = [{k: inc[k] for k in _INCIDENT_KEYS} for inc in engine.incidents()]
    rejected = summary["rejected"]
    out = {"events": valid - rejected, "invalid": invalid + rejected,
           "incidents": incidents}
    if rejected:
        out.update(rejected=rejected, rejections=summary["rejections"])
    return out
