"""Aggregated stack analysis (trainguard.diagnosis.stacks): prefix tree, classes, suspects."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.diagnosis import stacks
from trainguard.diagnosis.stacks import (analyze_dir, analyze_threads, format_ranks, map_suspects,
                                       normalize_threads, render_tree_text)

DATA = Path(__file__).resolve().parent / "data" / "stacks"
PYSPY_HANG = DATA / "pyspy_hang"
C10D = "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py"


def thread(*frames, name="MainThread", tid=1):
    """A SPEC thread; ``frames`` innermost first, each "function" or (function, file, line)."""
    fs = []
    for f in frames:
        fn, file, line = f if isinstance(f, tuple) else (f, "/job/train.py", 10)
        fs.append({"function": fn, "file": file, "line": line})
    return {"name": name, "id": tid, "active": False, "frames": fs}


TOP = ("train_step", "main", "<module>")


def in_allreduce(*below):
    return [thread(*below, ("all_reduce", C10D, 2500), ("wrapper", "/t/c10d_logger.py", 83), *TOP)]


def in_loader():
    return [thread(("sleep_a_bit", "/job/data.py", 7), ("load_batch", "/job/data.py", 30), *TOP)]


def check_contract(r: dict) -> None:
    json.dumps(r)  # JSON-serializable
    for key, typ in (("ranks", int), ("classes", list), ("suspects", list), ("missing", list),
                     ("summary", str)):
        assert isinstance(r[key], typ), key
    for c in r["classes"]:
        assert set(c) >= {"ranks", "signature"} and c["ranks"] == sorted(c["ranks"])
    assert r["suspects"] == sorted(set(r["suspects"]))
    assert set(r["missing"]) <= set(r["suspects"])


# ----------------------------------------------------------------- synthetic stacks
def test_prefix_tree_and_classes():
    r = analyze_threads({0: in_allreduce(), 1: in_allreduce(), 2: in_loader(), 3: in_allreduce()})
    check_contract(r)
    assert r["ranks"] == 4 and r["missing"] == []
    assert [c["ranks"] for c in r["classes"]] == [[0, 1, 3], [2]]
    assert r["classes"][0]["signature"].startswith("<module> (train.py) > main (train.py)")
    assert r["classes"][0]["signature"].endswith("all_reduce (distributed_c10d.py)")
    tree = r["tree"]
    assert tree["ranks"] == [0, 1, 2, 3]
    node = tree
    for label in ("<module> (train.py)", "main (train.py)", "train_step (train.py)"):
        (node,) = node["children"]
        assert node["frame"] == label and node["count"] == 4
    assert [(c["frame"], c["ranks"]) for c in node["children"]] == [
        ("wrapper (c10d_logger.py)", [0, 1, 3]), ("load_batch (data.py)", [2])]
    assert r["suspects"] == [2]
    assert "all_reduce" in r["waiting_on"]
    assert "2" in r["summary"] and "load_batch" in r["summary"]


def test_minority_classes_below_a_collective_are_not_suspects():
    # 0,1,3 all wait in all_reduce but at different frames inside it: 3 classes among them.
    per_rank = {0: in_allreduce(("wait", C10D, 10)), 1: in_allreduce(),
                2: in_loader(), 3: in_allreduce(("_wait_impl", C10D, 99), ("wait", C10D, 10))}
    r = analyze_threads(per_rank)
    check_contract(r)
    assert len(r["classes"]) == 4
    assert r["suspects"] == [2]


def test_one_against_one_blames_the_rank_outside_the_collective():
    r = analyze_threads({0: in_loader(), 1: in_allreduce()})
    assert r["suspects"] == [0]


def test_mismatched_collective_minority_is_suspect():
    barrier = [thread(("barrier", C10D, 4000), *TOP)]
    r = analyze_threads({0: in_allreduce(), 1: in_allreduce(), 2: barrier, 3: in_allreduce()})
    assert r["suspects"] == [2]


def test_all_alike_no_suspects_and_says_what_they_wait_on():
    r = analyze_threads({k: in_allreduce() for k in range(8)})
    check_contract(r)
    assert r["suspects"] == [] and r["missing"] == []
    assert [c["ranks"] for c in r["classes"]] == [list(range(8))]
    assert "all_reduce (distributed_c10d.py)" in r["summary"]
    assert r["waiting_on"] == "all_reduce (distributed_c10d.py)"


def test_all_alike_inside_a_collective_names_innermost_common_frame():
    per_rank = {k: in_allreduce(("wait", C10D, 10 + k)) for k in range(3)}
    per_rank[3] = in_allreduce(("poll", C10D, 5), ("wait", C10D, 10))
    r = analyze_threads(per_rank)
    assert r["suspects"] == [] and len(r["classes"]) == 2
    assert r["waiting_on"] == "wait (distributed_c10d.py)"
    assert "they all wait in wait (distributed_c10d.py), inside all_reduce" in r["summary"]
    assert "differ only below" in r["summary"]


def test_all_alike_outside_collectives_names_innermost_common_frame():
    r = analyze_threads({k: [thread("spin", "compute", *TOP)] for k in range(3)})
    assert r["suspects"] == [] and "spin (train.py)" in r["summary"]


def test_line_numbers_are_ignored():
    a = [thread(("poll", "/job/x.py", 1), *TOP)]
    b = [thread(("poll", "/job/x.py", 2), *TOP)]
    r = analyze_threads({0: a, 1: b})
    assert len(r["classes"]) == 1 and r["suspects"] == []


def test_main_thread_is_picked_by_name():
    bg = thread("heartbeat", "run", name="tg-heartbeat", tid=2)
    per_rank = {0: [bg, *in_allreduce()], 1: [bg, *in_allreduce()], 2: [bg, *in_loader()]}
    r = analyze_threads(per_rank)
    assert r["suspects"] == [2]
    assert "heartbeat" not in json.dumps(r["classes"])


def test_missing_error_and_empty_ranks_are_suspects():
    r = analyze_threads({0: in_allreduce(), 1: in_allreduce(), 3: "ptrace: permission denied",
                         4: [], 5: in_allreduce()}, expected_ranks=range(6))
    check_contract(r)
    assert r["missing"] == [2]
    assert r["suspects"] == [2, 3, 4]
    assert {e["rank"] for e in r["errors"]} == {3, 4}
    assert "permission denied" in json.dumps(r["errors"])
    assert r["ranks"] == 6
    # a gap in the ranks seen is missing by default
    assert analyze_threads({0: in_allreduce(), 2: in_allreduce()})["missing"] == [1]


def test_render_tree_text_ranges_and_marks():
    per_rank = {k: in_allreduce() for k in (0, 1, 3, 4, 5)}
    per_rank[2] = in_loader()
    text = render_tree_text(analyze_threads(per_rank))
    lines = text.splitlines()
    assert lines[0].startswith("[0-5] <module> (train.py) > main (train.py) > train_step")
    assert any(line.strip().startswith("[0-1,3-5] wrapper (c10d_logger.py)") for line in lines)
    assert [line for line in lines if "suspect" in line] == [
        "  [2] load_batch (data.py) > sleep_a_bit (data.py)  <== suspect"]
    assert format_ranks([]) == "" and format_ranks([4]) == "4"


# ----------------------------------------------------------------- real py-spy output
def test_normalize_real_pyspy_output():
    data = json.loads((PYSPY_HANG / "rank0.json").read_text())
    threads = normalize_threads(data)
    assert [t["name"] for t in threads] == ["tg-heartbeat", "MainThread"]
    main = threads[1]
    assert main["frames"][0]["function"] == "wait_in_collective"
    assert main["frames"][-1]["function"] == "<module>"
    assert all(set(f) == {"function", "file", "line"} for f in main["frames"])
    assert isinstance(main["id"], int) and main["active"] is False


def test_pyspy_fixture_dir():
    r = analyze_dir(PYSPY_HANG)
    check_contract(r)
    assert r["ranks"] == 4 and r["missing"] == []
    assert r["suspects"] == [3]
    assert [c["ranks"] for c in r["classes"]] == [[0, 1, 2], [3]]
    assert "load_batch (fake_train.py)" in r["summary"]


def test_pyspy_all_alike(tmp_path):
    for k in range(3):
        shutil.copy(PYSPY_HANG / f"rank{k}.json", tmp_path / f"dump_{k}.json")
    r = analyze_dir(tmp_path)
    assert r["suspects"] == [] and r["missing"] == []
    assert "wait_in_collective (fake_train.py)" in r["summary"]


def test_missing_and_malformed_files(tmp_path):
    for k in (0, 1, 3, 4):
        shutil.copy(PYSPY_HANG / "rank0.json", tmp_path / f"rank{k}.json")
    (tmp_path / "rank4.json").write_text('[{"thread_name": "MainThread", "frames": [')
    (tmp_path / "rank5.json").write_text('"just a string"')
    (tmp_path / "notes.txt").write_text("ignored")
    (tmp_path / "rank6.json").write_bytes(b"\xff\xfe\x00garbage")
    r = analyze_dir(tmp_path)
    check_contract(r)
    assert r["missing"] == [2, 4, 5, 6]
    assert r["suspects"] == [2, 4, 5, 6]
    assert {e["file"] for e in r["errors"]} == {"rank4.json", "rank5.json", "rank6.json"}
    assert r["ranks"] == 7


def test_missing_dir_raises_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        analyze_dir(tmp_path / "nope")


def _stack_event(rank, threads, capture_id="c1", ts=1.0, **extra):
    return {"v": 1, "type": "stack", "job": "j1", "ts": ts, "node": "n0", "rank": rank,
            "capture_id": capture_id, "pid": 100 + rank, "method": "py-spy", "threads": threads,
            **extra}


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_recordings_of_stack_events(tmp_path, suffix):
    per = {k: normalize_threads(json.loads((PYSPY_HANG / f"rank{k}.json").read_text()))
           for k in range(4)}
    lines = ['{"v":1,"type":"heartbeat"}', "not json", ""]
    # an older capture where everybody looked alike, then the latest one
    lines += [json.dumps(_stack_event(k, per[0], capture_id="old", ts=1.0)) for k in range(4)]
    lines += [json.dumps(_stack_event(k, per[k], capture_id="new", ts=9.0)) for k in range(4)
              if k != 1]
    lines.append(json.dumps(_stack_event(1, [], capture_id="new", ts=9.5, error="timed out")))
    text = "\n".join(lines) + "\n"
    path = tmp_path / f"rec{suffix}"
    if suffix.endswith(".gz"):
        with gzip.open(path, "wt") as fh:
            fh.write(text)
    elif suffix.endswith(".zst"):
        zstandard = pytest.importorskip("zstandard")
        path.write_bytes(zstandard.ZstdCompressor().compress(text.encode()))
    else:
        path.write_text(text)
    r = analyze_dir(tmp_path)
    check_contract(r)
    assert r["suspects"] == [1, 3] and r["missing"] == []
    assert any(e["rank"] == 1 and "timed out" in e["error"] for e in r["errors"])
    assert any(e.get("file") == path.name and "1 invalid line" in e["error"] for e in r["errors"])


def test_corrupt_compressed_recordings_are_not_fatal(tmp_path):
    (tmp_path / "a.jsonl.gz").write_bytes(b"not gzip at all")
    (tmp_path / "b.jsonl.zst").write_bytes(b"not zstd at all")
    shutil.copy(PYSPY_HANG / "rank0.json", tmp_path / "rank0.json")
    r = analyze_dir(tmp_path)
    assert r["ranks"] == 1 and r["suspects"] == []
    assert {e["file"] for e in r["errors"]} == {"a.jsonl.gz", "b.jsonl.zst"}


# ----------------------------------------------------------------- live py-spy capture
def _pyspy() -> str | None:
    cand = Path(sys.executable).parent / "py-spy"
    return str(cand) if cand.exists() else shutil.which("py-spy")


@pytest.mark.slow
def test_live_pyspy_capture(tmp_path):
    pyspy = _pyspy()
    if not pyspy:
        pytest.skip("py-spy is not installed")
    procs, pids = [], []
    try:
        for k in range(4):
            p = subprocess.Popen(["timeout", "-s", "KILL", "60", sys.executable,
                                  str(DATA / "fake_train.py"), str(k), "3"],
                                 stdout=subprocess.PIPE, text=True)
            procs.append(p)
        for p in procs:
            pids.append(int(p.stdout.readline()))  # printed once inside the waiting function
        time.sleep(0.3)
        for k, pid in enumerate(pids):
            out = subprocess.run([pyspy, "dump", "--json", "--pid", str(pid)],
                                 capture_output=True, text=True, timeout=30)
            if out.returncode != 0:
                err = out.stderr.lower()
                if any(s in err for s in ("permission", "ptrace", "not permitted")):
                    pytest.skip(f"py-spy cannot attach here: {out.stderr.strip()[:200]}")
                pytest.fail(f"py-spy failed: {out.stderr[:500]}")
            (tmp_path / f"rank{k}.json").write_text(out.stdout)
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    r = analyze_dir(tmp_path)
    check_contract(r)
    assert r["suspects"] == [3]
    assert [c["ranks"] for c in r["classes"]] == [[0, 1, 2], [3]]
    (tmp_path / "rank1.json").unlink()
    r = analyze_dir(tmp_path)
    assert r["missing"] == [1] and r["suspects"] == [1, 3]


# ----------------------------------------------------------------- mapping
def test_map_suspects_megatron_layout():
    topo = {"tp": 2, "dp": 2, "pp": 2}
    r2n = {k: f"n{k // 4}" for k in range(8)}
    m = map_suspects([5], r2n, topo, 8)
    assert m["nodes"] == ["n1"]
    assert m["groups"] == {"tp": [[4, 5]], "dp": [[5, 7]], "pp": [[1, 5]]}
    m = map_suspects([0, 1, 6], r2n, topo)
    assert m["nodes"] == ["n0", "n1"]
    assert m["groups"]["tp"] == [[0, 1], [6, 7]]
    assert m["groups"]["pp"] == [[0, 4], [1, 5], [2, 6]]
    # another layout, fastest first
    m = map_suspects([1], {}, {"tp": 2, "dp": 2, "pp": 2, "layout": "tp-pp-dp"})
    assert m["groups"] == {"tp": [[0, 1]], "dp": [[1, 5]], "pp": [[1, 3]]}
    assert m["nodes"] == [] and m["unmapped"] == [1]
    assert map_suspects([2], {2: "a"}, None)["groups"] == {"tp": [], "dp": [], "pp": []}


# ----------------------------------------------------------------- properties
_PATHS = [in_allreduce(), in_loader(), [thread("spin", *TOP)], "capture failed", []]


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.integers(0, 12), st.integers(0, len(_PATHS) - 1), max_size=10))
def test_properties(choice):
    per_rank = {r: _PATHS[i] for r, i in choice.items()}
    r = analyze_threads(per_rank)
    check_contract(r)
    seen = set(per_rank)
    classed = [x for c in r["classes"] for x in c["ranks"]]
    assert sorted(classed) == sorted(seen)  # classes partition the ranks that answered
    assert set(r["missing"]) == set(range(max(seen, default=-1) + 1)) - seen
    assert r["ranks"] == len(seen | set(r["missing"]))
    if len({json.dumps(v) for v in per_rank.values()}) == 1 and per_rank and \
            isinstance(next(iter(per_rank.values())), list) and next(iter(per_rank.values())):
        assert set(r["suspects"]) == set(r["missing"])
    render_tree_text(r)


_junk = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5)),
                     lambda inner: st.one_of(st.lists(inner, max_size=3),
                                             st.dictionaries(st.sampled_from(
                                                 ["frames", "threads", "name", "function", "file",
                                                  "line", "filename"]), inner, max_size=4)),
                     max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(0, 6), _junk, max_size=5))
def test_junk_threads_never_crash(per_rank):
    check_contract(analyze_threads(per_rank))
