"""Issue 21 point 4: ``trainguard analyze FILE --workers N`` (detectors/parallel.py) gives
exactly the result of ``--workers 1``, byte for byte as SPEC JSON, on the scenario library,
the real traces and recordings, and on files that the split cannot take as they are (those
fall back to one process, with the same answer)."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard import events as ev
from trainguard.detectors import parallel
from trainguard.detectors.offline import analyze_file
from trainguard.detectors.parallel import analyze_file_parallel, analyze_lines_parallel

from real_traces import alibaba_job, loss_curve_job
from scenario_library import FAULTS, HEALTHY
from scenarios import Fault, Scenario, generate

DATA = Path(__file__).parent / "data"
#: one of each kind of fault and of each unusual healthy shape, small steps first
SUBSET = ("straggler-0.1s", "hang-0.5s", "crash-0.1s", "machine-down-0.5s", "xid79-0.1s",
          "dbe-0.5s", "nan-0.1s", "loss-spike-0.5s", "three-faults", "hang-restart-hang",
          "throttle", "spike-after-resume", "resume-0.5s", "own-restart-2.0s", "mixed-1",
          "checkpoints-0.2s")
BY_NAME = {sc.name: sc for sc in HEALTHY + FAULTS}


def write(path: Path, events, raw_lines=()) -> Path:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wb") as out:
        for e in events:
            out.write(ev.encode(e) + b"\n")
        for line in raw_lines:
            out.write(line + b"\n")
    return path


def same(path: Path, workers=(2, 3, 4), chunk_lines: int = 512, **kwargs) -> dict:
    """Assert every ``workers`` count (processes: one job side, the others the rank side)
    gives the one-process JSON; returns that result."""
    one = json.dumps(analyze_file(path, **kwargs))
    for n in workers:
        got = json.dumps(analyze_file_parallel(path, workers=n, chunk_lines=chunk_lines,
                                               **kwargs))
        assert got == one, f"--workers {n} differs from --workers 1 on {path.name}"
    return json.loads(one)


def split_is_used(path: Path, workers: int = 2) -> bool:
    """Whether the recording was analyzed split (not fallen back to one process)."""
    return analyze_lines_parallel(path, workers, chunk_lines=512) is not None


@pytest.mark.parametrize("name", SUBSET)
def test_workers_give_the_incidents_of_one_process(name, tmp_path):
    events, _ = generate(BY_NAME[name])
    path = write(tmp_path / f"{name}.jsonl", events)
    same(path)
    assert split_is_used(path)


def test_a_clock_a_minute_off_is_split_and_gives_the_same(tmp_path):
    sc = Scenario(name="skew", dp=8, step_time=0.5, steps=160, checkpoint_every=0, seed=3,
                  clock_offsets={"n2": 60.0},
                  faults=(Fault(kind="straggler", step=60, ranks=(5,), factor=2.0),))
    events, _ = generate(sc)
    path = write(tmp_path / "skew.jsonl", events)
    result = same(path)
    assert [(i["kind"], i["ranks"]) for i in result["incidents"]] == [("straggler", [5])]
    assert split_is_used(path)


@pytest.mark.parametrize("by", [30.0, -30.0])
def test_a_clock_stepped_mid_job_is_split_and_gives_the_same(by, tmp_path):
    """A machine's clock stepped halfway, a slow rank on it after the step: the rank side's
    word of the step (``jump``) reaches the job side alike, split or not."""
    from test_clock_skew import stepped

    sc = Scenario(name="stepped", dp=8, per_node=2, step_time=0.5, steps=200,
                  checkpoint_every=0, seed=7,
                  faults=(Fault(kind="straggler", step=130, ranks=(0,), factor=2.0),))
    events, _ = generate(sc)
    path = write(tmp_path / "stepped.jsonl", stepped(events, "n1", by))
    result = same(path)
    assert [(i["kind"], i["ranks"]) for i in result["incidents"]] == [("straggler", [0])]
    assert split_is_used(path)


def test_two_jobs_in_one_recording(tmp_path):
    """Jobs share the recording's "now": their events interleave in the file's order."""
    one, _ = generate(BY_NAME["hang-0.5s"])
    two, _ = generate(BY_NAME["straggler-0.5s"])
    events = sorted(one + [e.replace(job="k") for e in two], key=lambda e: e.ts)
    result = same(write(tmp_path / "two.jsonl", events))
    assert {i["job"] for i in result["incidents"]} == {"j", "k"}


def test_odd_lines_refusals_and_misplaced_keys_give_the_same(tmp_path):
    """Invalid lines, events the event-time filter refuses, JSON with spaces, escaped job
    names, a gpu event carrying a rank and a rank nested in ``extra`` before the real one:
    some go through the split, the others fall back; every answer is the one-process one."""
    events, _ = generate(BY_NAME["crash-0.1s"])
    spaced = [json.dumps(ev.to_dict(e)).encode() for e in events[:400]]
    far = ev.to_dict(events[500])
    far["ts"] += 10_000.0                         # refused by every filter
    raw = [b"not json", b"{}", b'{"v":1,"type":"step"}', json.dumps(far).encode()]
    path = write(tmp_path / "odd.jsonl", events[400:], raw)
    with open(path, "ab") as out:
        out.write(b"\n".join(spaced) + b"\n")
    result = same(path)
    assert result["invalid"] >= 4 and result["rejected"] >= 1
    assert split_is_used(path)

    escaped = [e.replace(job='j"\\x') for e in events]
    same(write(tmp_path / "escaped.jsonl", escaped))

    gpu = next(e for e in events if e.type == "gpu")
    line = ev.to_dict(gpu)
    line["rank"] = 5                              # keyed by its machine all the same
    misplaced = write(tmp_path / "gpu-rank.jsonl", events, [json.dumps(line).encode()])
    same(misplaced, workers=(3, 4, 5))

    step = ev.to_dict(next(e for e in events if e.type == "step" and e.rank == 3))
    nested = b'{"extra_first":{"rank":6},' + json.dumps(step).encode()[1:]
    same(write(tmp_path / "nested.jsonl", events, [nested]), workers=(3, 4, 5))


def test_filters_that_disagree_fall_back_to_the_same_answer(tmp_path):
    """A machine whose clock is 20 minutes ahead: the filter that sees only its ranks takes
    what the one that sees the whole job refuses; the answer is still the one-process one."""
    sc = Scenario(name="far", dp=8, step_time=0.5, steps=120, checkpoint_every=0, seed=9,
                  clock_offsets={"n2": 1200.0})
    events, _ = generate(sc)
    path = write(tmp_path / "far.jsonl", events)
    result = same(path, workers=(2, 4))
    assert result["rejected"] > 0


def test_compressed_recordings_and_the_recorded_ones(tmp_path):
    events, _ = generate(BY_NAME["straggler-0.5s"])
    same(write(tmp_path / "s.jsonl.gz", events))
    for path in sorted((DATA / "recordings").glob("*.jsonl*")):
        same(path, chunk_lines=64)


def test_per_job_overrides_apply_alike(tmp_path):
    events, _ = generate(BY_NAME["hang-0.5s"])
    path = write(tmp_path / "h.jsonl", events)
    overrides = {"j": {"detectors.hang.checkpoint_s": 30.0}}
    same(path, overrides=overrides)


def test_a_missing_or_truncated_file_says_so_as_one_process_does(tmp_path):
    from trainguard.recording import RecordingError

    with pytest.raises(RecordingError):
        analyze_file_parallel(tmp_path / "none.jsonl", workers=2)
    events, _ = generate(BY_NAME["straggler-0.1s"])
    whole = write(tmp_path / "t.jsonl.gz", events).read_bytes()
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(RecordingError) as one:
        analyze_file(cut)
    with pytest.raises(RecordingError) as split:
        analyze_file_parallel(cut, workers=2, chunk_lines=256)
    assert str(split.value) == str(one.value)


def test_cli_workers_flag(tmp_path):
    events, _ = generate(BY_NAME["nan-0.1s"])
    path = write(tmp_path / "n.jsonl", events)
    outs = [subprocess.run([sys.executable, "-m", "trainguard.cli", "analyze", str(path),
                            "--json", "--workers", n], capture_output=True, timeout=120)
            for n in ("1", "2")]
    assert [o.returncode for o in outs] == [0, 0], outs[1].stderr
    assert outs[0].stdout == outs[1].stdout
    bad = subprocess.run([sys.executable, "-m", "trainguard.cli", "analyze", str(path),
                          "--workers", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--workers" in bad.stderr


def test_the_partition_of_a_key_is_the_producers():
    """The Java client's murmur2 (what librdkafka's murmur2_random uses), checked against
    values the Kafka client tests list."""
    from aiokafka.partitioner import murmur2

    for key in (b"", b"a", b"ab", b"abc", b"abcd", b"llama/12", b"job/n17", bytes(range(37))):
        assert parallel.murmur2(key) == murmur2(key)


@pytest.mark.slow
def test_the_whole_library_and_the_real_traces(tmp_path, shared_data):
    """Every fault scenario, every third healthy one, and the shared real traces, over two
    processes (one rank side, no routing) and three (two rank sides, lines routed by key) in
    turn. The healthy scenarios are four fifths of the library's bytes and of this test's time
    (50 of 64 CPU s): a third of them, each shape family still in it, keeps the suite within
    its 15 minutes (the one-process results of all of them are checked elsewhere)."""
    import test_detectors_realdata as real

    for index, sc in enumerate(HEALTHY[::3] + FAULTS):
        events, _ = generate(sc)
        same(write(tmp_path / "sc.jsonl", events), workers=(2 + index % 2,), chunk_lines=2048)
    traces = [alibaba_job(n) for n in (2, 3, 4)]
    traces += [loss_curve_job([(s, loss) for s, loss, _ in real.nanogpt(shared_data, name)],
                              job=name) for name in sorted(real.NANOGPT)]
    for events in traces:
        same(write(tmp_path / "trace.jsonl", events), workers=(2, 3), chunk_lines=2048)
