"""Events per second of ``trainguard analyze`` (``analyze_file``) on a generated recording of
~200k events (32 ranks on 4 machines, steps, heartbeats, GPU samples, a crash at the end).

Reported beside it, measured in the same run on the same file: the rate of reading and
decoding alone (``recording.read_events``, the core's ``ev.decode``; events are dropped as
they come, as analyze does), the rate of the detectors alone on already decoded events, and
the standard library's ``json.loads`` of the raw lines, for scale (``ev.decode`` parses with
orjson and validates, and is faster). Rates are per CPU second of this process, the best of
ROUNDS interleaved rounds; the wall-clock rate of the best run is given too.
Target: >= 100,000 events/s end to end.
"""
from __future__ import annotations

import gc
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROUNDS = 5
sys.path.insert(0, str(HERE.parent / "tests"))

from detector_traces import JobSim  # noqa: E402

from trainguard import events as ev  # noqa: E402
from trainguard.detectors.offline import analyze_events, analyze_file  # noqa: E402
from trainguard.recording import RecordingWriter, iter_lines, read_events  # noqa: E402


def _timed(fn):
    """``(cpu seconds, wall seconds, result)`` of one call. CPU seconds of this process: the
    machine is shared, so wall time mostly measures the neighbours."""
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn()
    return time.process_time() - cpu, time.perf_counter() - wall, out


def _keep_best(best: dict, name: str, cpu: float, wall: float) -> None:
    old = best.get(name)
    best[name] = (min(cpu, old[0]), min(wall, old[1])) if old else (cpu, wall)


def make_recording(path: Path, steps: int = 4000) -> int:
    sim = JobSim(job="bench", ranks=32, nodes=4, steps=steps, checkpoint_every=1000,
                 slow_every=25).crash(7, steps - 10)
    events = sim.events()
    with RecordingWriter(path) as out:
        for e in events:
            out.write_raw(ev.encode(e))
    return len(events)


def run() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.jsonl"
        n = make_recording(path)
        best: dict = {}
        for _ in range(ROUNDS):     # interleaved, so a noisy spell hits every measure alike
            cpu, wall, result = _timed(lambda: analyze_file(path))
            _keep_best(best, "total", cpu, wall)
            _keep_best(best, "json", *_timed(
                lambda: sum(1 for line in iter_lines(path) if json.loads(line)))[:2])
            _keep_best(best, "decode", *_timed(lambda: sum(1 for _ in read_events(path)))[:2])
            # The detectors alone need every event decoded beforehand; that list is dropped
            # before the next end-to-end run, whose garbage collections would walk it.
            decoded = list(read_events(path))
            _keep_best(best, "engine", *_timed(lambda: analyze_events(decoded))[:2])
            del decoded
            gc.collect()
        t_total, wall = best["total"]
        t_json, t_decode, t_engine = best["json"][0], best["decode"][0], best["engine"][0]
    return {
        "events": result["events"],
        "invalid": result["invalid"],
        "incidents": [i["kind"] for i in result["incidents"]],
        "cpu_seconds": round(t_total, 3),
        "wall_seconds": round(wall, 3),
        "events_per_s": round(n / t_total),
        "events_per_wall_s": round(n / wall),
        "target_events_per_s": 100_000,
        "decode_only_events_per_s": round(n / t_decode),
        "detectors_only_events_per_s": round(n / t_engine),
        "json_loads_only_events_per_s": round(n / t_json),
        "ratio_to_json_loads_only": round(t_json / t_total, 3),
        "decode_share_of_time": round(t_decode / t_total, 3),
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=2))
