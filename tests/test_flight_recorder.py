"""Flight Recorder dump analysis (trainguard.diagnosis.flight_recorder)."""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import uuid
from pathlib import Path

import pytest

from trainguard.diagnosis import flight_recorder as fr
from trainguard.diagnosis.flight_recorder import (UnsafePickleError, analyze_dir, analyze_dumps,
                                                load_dump)

LOCK_GIL = Path(__file__).resolve().parents[2] / "shared" / "data" / "flight-recorder" / "lock_gil_1st"


@pytest.fixture
def lock_gil() -> Path:
    if not (LOCK_GIL / "_dump_0").is_file():
        pytest.skip(f"real Flight Recorder dumps not found at {LOCK_GIL} (the project's ../shared/data)")
    return LOCK_GIL


def check_contract(r: dict) -> None:
    json.dumps(r)
    assert {"ranks", "classes", "suspects", "missing", "summary"} <= set(r)
    assert r["suspects"] == sorted(set(r["suspects"]))
    assert set(r["missing"]) <= set(r["suspects"])


# ----------------------------------------------------------------- real dumps
def test_lock_gil_1st_suspects_are_the_injected_ranks(lock_gil):
    injected = [int(x) for x in
                (lock_gil / "fault_injection.log").read_text().split("[", 1)[1].split("]")[0].split(",")]
    assert injected == [9, 14]
    r = analyze_dir(lock_gil)
    check_contract(r)
    assert r["suspects"] == [9, 14]
    assert r["missing"] == [] and r["ranks"] == 16 and "errors" not in r
    assert [c["ranks"] for c in r["classes"]] == [list(range(8)), [8, 10, 11, 12, 13, 15], [9, 14]]
    assert r["classes"][2]["signature"] == "nothing pending in any group"
    assert r["summary"].startswith("rank(s) 9,14 hold up the job")
    tp = {g["name"]: g for g in r["groups"]}
    assert tp["37"]["behind"] == [9] and tp["37"]["waiting"] == [8, 10, 11]
    assert tp["38"]["behind"] == [14]
    # stage-0 ranks wait on stage 1 only through point-to-point ops, each on its own peer
    assert r["waits_for"]["0"] == [8] and r["waits_for"]["6"] == [14]
    assert r["waits_for"]["8"] == [9, 14]
    assert "9" not in r["waits_for"] and "14" not in r["waits_for"]


def test_megatron_layout_of_map_suspects_matches_the_real_groups(lock_gil):
    from trainguard.diagnosis.stacks import map_suspects
    r = analyze_dir(lock_gil)
    m = map_suspects(r["suspects"], {k: f"node{k // 8}" for k in range(16)},
                     {"tp": 4, "dp": 2, "pp": 2}, 16)
    assert m["nodes"] == ["node1"]
    real = {}
    for k in r["suspects"]:
        cfg = load_dump(lock_gil / f"_dump_{k}")["pg_config"]
        for g in cfg.values():
            real.setdefault(g["desc"], set()).add(tuple(json.loads(g["ranks"])))
    assert {tuple(g) for g in m["groups"]["tp"]} == real["TENSOR_MODEL_PARALLEL_GROUP"]
    assert {tuple(g) for g in m["groups"]["dp"]} == real["DATA_PARALLEL_GROUP_WITH_CP"]
    assert {tuple(g) for g in m["groups"]["pp"]} == real["PIPELINE_MODEL_PARALLEL_GROUP"]


def test_lock_gil_1st_with_a_missing_dump(lock_gil, tmp_path):
    for f in lock_gil.iterdir():
        if f.name != "_dump_14":
            shutil.copy(f, tmp_path / f.name)
    r = analyze_dir(tmp_path)
    check_contract(r)
    assert r["missing"] == [14]
    assert r["suspects"] == [9, 14]
    assert r["ranks"] == 16


def test_missing_last_rank_is_found_from_group_config(lock_gil, tmp_path):
    for k in range(15):
        shutil.copy(lock_gil / f"_dump_{k}", tmp_path / f"_dump_{k}")
    r = analyze_dir(tmp_path)
    assert r["missing"] == [15] and 15 in r["suspects"] and r["ranks"] == 16


# ----------------------------------------------------------------- security
class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_nothing_runs(tmp_path):
    marker = f"/tmp/pwned_{uuid.uuid4().hex}"
    payload = pickle.dumps({"entries": [_Evil(marker)], "pg_config": {}})
    path = tmp_path / "_dump_3"
    path.write_bytes(payload)
    with pytest.raises(UnsafePickleError, match="refused to load global"):
        load_dump(path)
    assert not os.path.exists(marker)
    for proto in range(0, pickle.HIGHEST_PROTOCOL + 1):  # GLOBAL and STACK_GLOBAL opcodes
        with pytest.raises(pickle.UnpicklingError):
            fr.PlainDataUnpickler(io.BytesIO(pickle.dumps(_Evil(marker), protocol=proto))).load()
    # in a directory: the rank is unreadable, missing and suspect; the analysis goes on
    (tmp_path / "_dump_0").write_bytes(pickle.dumps(_dump({"0": ("default_pg", [0, 1, 2, 3], 5, 5)})))
    (tmp_path / "_dump_1").write_bytes(pickle.dumps(_dump({"0": ("default_pg", [0, 1, 2, 3], 5, 5)})))
    r = analyze_dir(tmp_path)
    check_contract(r)
    assert not os.path.exists(marker)
    assert r["missing"] == [2, 3] and r["suspects"] == [2, 3]
    assert [e["rank"] for e in r["errors"]] == [3]
    assert "UnsafePickleError" in r["errors"][0]["error"]


def test_other_globals_are_refused_too(tmp_path):
    for obj in (eval, Path("/x"), {1, 2}, bytearray(b"x"), frozenset([1]), 1j):
        for proto in (2, pickle.HIGHEST_PROTOCOL):  # sets: EMPTY_SET opcode, no global
            with pytest.raises(UnsafePickleError):
                fr.PlainDataUnpickler(io.BytesIO(pickle.dumps({"x": [obj]}, protocol=proto))).load()


def test_plain_data_and_json_dumps_load(tmp_path):
    data = {"version": "2.9", "entries": [], "pg_config": {}, "pg_status": {}, "b": b"\x00",
            "t": (1, 2.5, None, True)}
    (tmp_path / "p").write_bytes(pickle.dumps(data))
    assert load_dump(tmp_path / "p") == data
    (tmp_path / "j").write_text(json.dumps({"entries": []}))
    assert load_dump(tmp_path / "j") == {"entries": []}
    (tmp_path / "l").write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(ValueError, match="not a Flight Recorder dump"):
        load_dump(tmp_path / "l")


def test_corrupt_and_unrelated_files(tmp_path):
    good = _dump({"0": ("default_pg", [0, 1], 3, 3)})
    (tmp_path / "_dump_0").write_bytes(pickle.dumps(good))
    (tmp_path / "_dump_1").write_bytes(pickle.dumps(good)[:20])  # truncated
    (tmp_path / "fault_injection.log").write_text("Fault ranks: [1]")
    (tmp_path / "README").write_text("no rank here")
    r = analyze_dir(tmp_path)
    check_contract(r)
    assert r["missing"] == [1] and r["suspects"] == [1]
    assert [e["file"] for e in r["errors"]] == ["_dump_1"]


def test_missing_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        analyze_dir(tmp_path / "nope")


# ----------------------------------------------------------------- synthetic dumps
def _dump(groups: dict, p2p: dict | None = None, with_status: bool = True) -> dict:
    """A v2.x dump. ``groups``: name -> (desc, ranks, completed, enqueued); pending ops
    C+1..E become scheduled entries. Local ids are spaced (0, 2, 4, ...) on purpose."""
    p2p = p2p or {}
    config, status, entries = {}, {}, []
    for i, name in enumerate(sorted(groups, key=int)):
        desc, ranks, c, e = groups[name]
        config[name] = {"name": name, "desc": desc, "ranks": str(ranks)}
        status[str(2 * i)] = {"last_completed_collective": c, "last_enqueued_collective": e,
                              "last_started_collective": -1}
        for seq in range(1, e + 1):
            peer = p2p.get(name)
            entries.append({
                "pg_id": 2 * i, "process_group": (name, desc), "is_p2p": peer is not None,
                "collective_seq_id": 0 if peer else seq, "p2p_seq_id": seq if peer else 0,
                "profiling_name": peer or "nccl:all_reduce", "record_id": len(entries),
                "state": "completed" if seq <= c else "scheduled"})
    out = {"version": "2.9", "pg_config": config, "entries": entries}
    if with_status:
        out["pg_status"] = status
    return out


def test_rank_that_never_reached_the_collective():
    g = lambda c, e: {"0": ("default_pg", [0, 1, 2, 3], c, e)}
    r = analyze_dumps({0: _dump(g(10, 11)), 1: _dump(g(10, 11)), 2: _dump(g(10, 10)),
                       3: _dump(g(10, 11))})
    check_contract(r)
    assert r["suspects"] == [2]
    assert [c["ranks"] for c in r["classes"]] == [[0, 1, 3], [2]]
    assert "never reached" in r["summary"] and "#11" in r["summary"]


def test_rank_that_never_completed_an_earlier_collective():
    g = lambda c, e: {"0": ("default_pg", [0, 1, 2], c, e)}
    r = analyze_dumps({0: _dump(g(10, 11)), 1: _dump(g(8, 11)), 2: _dump(g(10, 11))})
    assert r["suspects"] == [1] and "never completed #9" in r["summary"]


def test_all_waiting_in_the_same_collective_blames_nobody():
    g = {"0": ("default_pg", [0, 1, 2, 3], 10, 11)}
    r = analyze_dumps({k: _dump(g) for k in range(4)})
    check_contract(r)
    assert r["suspects"] == [] and "no rank lags behind" in r["summary"]
    assert [c["ranks"] for c in r["classes"]] == [[0, 1, 2, 3]]
    idle = analyze_dumps({k: _dump({"0": ("default_pg", [0, 1], 4, 4)}) for k in range(2)})
    assert idle["suspects"] == [] and "no collective is pending" in idle["summary"]


def test_blocked_ranks_in_other_groups_are_not_root_causes():
    # 0 waits on 1 in group A; 1 waits on 2 in group B; 2 has nothing pending.
    d0 = _dump({"0": ("W", [0, 1, 2], 5, 5), "1": ("A", [0, 1], 3, 4)})
    d1 = _dump({"0": ("W", [0, 1, 2], 5, 5), "1": ("A", [0, 1], 3, 3), "2": ("B", [1, 2], 7, 8)})
    d2 = _dump({"0": ("W", [0, 1, 2], 5, 5), "2": ("B", [1, 2], 7, 7)})
    r = analyze_dumps({0: d0, 1: d1, 2: d2})
    assert r["suspects"] == [2]
    assert r["waits_for"] == {"0": [1], "1": [2]}


def test_deadlock_cycle_blames_the_cycle():
    d0 = _dump({"1": ("A", [0, 1], 3, 3), "2": ("B", [0, 1, 2], 7, 8)})
    d1 = _dump({"1": ("A", [0, 1], 3, 4), "2": ("B", [0, 1, 2], 7, 7)})
    d2 = _dump({"2": ("B", [0, 1, 2], 7, 8)})
    r = analyze_dumps({0: d0, 1: d1, 2: d2})
    assert r["suspects"] == [0, 1]


def test_p2p_waits_only_on_the_named_peer():
    # rank 0 receives from group rank 2 (global 5) in a 3-rank group; 4 has nothing to do with it
    grp = [3, 4, 5]
    d3 = _dump({"7": ("PP", grp, 2, 3)}, p2p={"7": "nccl:recv 0<-2"})
    d4 = _dump({"7": ("PP", grp, 1, 1)})
    d5 = _dump({"7": ("PP", grp, 2, 2)})
    r = analyze_dumps({3: d3, 4: d4, 5: d5}, expected_ranks=[3, 4, 5])
    assert r["waits_for"] == {"3": [5]}
    assert r["suspects"] == [5] and "never posted the send matching PP #3 nccl:recv" in r["summary"]


def test_progress_from_entries_when_pg_status_is_absent():
    g = lambda c, e: {"0": ("default_pg", [0, 1, 2], c, e)}
    r = analyze_dumps({0: _dump(g(4, 6), with_status=False), 1: _dump(g(4, 6), with_status=False),
                       2: _dump(g(4, 4), with_status=False)})
    assert r["suspects"] == [2]


def test_missing_rank_in_a_waiting_group_is_a_suspect():
    g = {"0": ("default_pg", [0, 1, 2], 4, 5)}
    r = analyze_dumps({0: _dump(g), 1: _dump(g)})
    assert r["missing"] == [2] and r["suspects"] == [2]
    assert r["waits_for"] == {"0": [2], "1": [2]}


# ----------------------------------------------------------------- robustness
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_scalar = st.one_of(st.none(), st.booleans(), st.integers(-3, 20), st.text(max_size=8), st.floats(),
                    st.sampled_from(["[0, 1]", "nccl:send 0->1", "nccl:recv 1<-0", "completed"]))
_entry = st.fixed_dictionaries({}, optional={
    k: _scalar for k in ("pg_id", "collective_seq_id", "p2p_seq_id", "is_p2p", "state",
                         "profiling_name")} | {"process_group": st.one_of(
                             _scalar, st.tuples(st.sampled_from(["0", "1"]), st.text(max_size=4)))})
_dump_st = st.fixed_dictionaries({}, optional={
    "entries": st.one_of(_scalar, st.lists(st.one_of(_entry, _scalar), max_size=4)),
    "pg_config": st.one_of(_scalar, st.dictionaries(st.sampled_from(["0", "1", "x"]), st.one_of(
        _scalar, st.fixed_dictionaries({}, optional={"desc": _scalar, "ranks": _scalar})))),
    "pg_status": st.one_of(_scalar, st.dictionaries(st.sampled_from(["0", "1", "2"]), st.one_of(
        _scalar, st.fixed_dictionaries({}, optional={"last_completed_collective": _scalar,
                                                     "last_enqueued_collective": _scalar})))),
})


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.integers(0, 5), _dump_st, max_size=4))
def test_odd_dumps_never_crash(per_rank):
    check_contract(analyze_dumps(per_rank))
