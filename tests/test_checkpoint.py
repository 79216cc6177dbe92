"""trainguard.checkpoint: placement, torn and refused snapshots, signed replicas between node
agents' snapshot stores (real TCP and Unix sockets), disk copies, FSDP2 sharded state."""
from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard.checkpoint.placement import PlacementError, buddies, violations

torch = pytest.importorskip("torch")

from trainguard.checkpoint import InMemoryCheckpoint, SnapshotConfig  # noqa: E402
from trainguard.checkpoint import layout  # noqa: E402
from trainguard.checkpoint.restore import Sources  # noqa: E402
from trainguard.collectors.snapshot_store import SnapshotStore, SnapshotStoreConfig  # noqa: E402
from trainguard.checkpoint.wire import request  # noqa: E402
from trainguard.signing import SigningKeys, sign_object  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
KEYS = SigningKeys.parse("snapshot-test-key-0123456789abcdef")
OTHER = SigningKeys.parse("not-the-key-0123456789abcdef-xyz")


# -- placement -------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text("abcdefgh", min_size=1, max_size=3), st.sampled_from("PQRSTU"),
                       min_size=2, max_size=24))
def test_no_machine_and_its_evicted_peers_hold_both_copies(domains):
    nodes = sorted(domains)
    if len(set(domains.values())) < 2:
        with pytest.raises(PlacementError):
            buddies(nodes, domains)
        return
    placed = buddies(nodes, domains)
    assert sorted(placed) == nodes and violations(placed, domains) == []
    for evicted in set(domains.values()):       # one domain evicted: every copy survives
        gone = {n for n in nodes if domains[n] == evicted}
        assert all(placed[n] not in gone for n in gone)
    largest = max(list(domains.values()).count(d) for d in set(domains.values()))
    if 2 * largest <= len(nodes):               # balanced: each machine holds one other's
        assert sorted(placed.values()) == nodes
    assert buddies(list(reversed(nodes)), domains) == placed


def test_machines_alone_get_a_ring():
    placed = buddies([f"n{i}" for i in range(5)])
    assert violations(placed) == [] and sorted(placed.values()) == sorted(placed)


# -- one rank, in one process ----------------------------------------------------------------
# (the ``shm`` fixture: tests/conftest.py)

def train(ck, model, opt, steps, first=0):
    weights = {}
    for step in range(first, steps):
        model(torch.randn(2, 8)).sum().backward()
        ck.before_update()
        opt.step()
        opt.zero_grad()
        ck.after_step(step + 1)
        weights[step + 1] = model.weight.detach().clone()
    ck.snapshotter.before_update()
    return weights


def fresh(config, **kw):
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    ck = InMemoryCheckpoint(config, job="unit", rank=0, world=1, node="n1", **kw)
    return ck.track(model=model, optimizer=opt, extra=lambda done: {"samples": 3 * done}), \
        model, opt


def test_restores_the_newest_complete_snapshot_and_never_a_torn_one(shm):
    config = SnapshotConfig(every=2, dir=str(shm))
    ck, model, opt = fresh(config)
    weights = train(ck, model, opt, 6)
    ck.close()
    ck2, model2, opt2 = fresh(config)
    restored = ck2.restore()
    assert (restored.step, restored.source) == (6, "memory")
    assert torch.equal(model2.weight, weights[6]) and restored.tree["extra"] == {"samples": 18}
    assert int(opt2.state_dict()["state"][0]["step"]) == 6

    slots = {layout.read_manifest(p)["step"]: p for p in shm.glob("own/unit/rank0/slot*.bin")}
    with open(slots[6], "r+b") as f:                    # a checksum that fails
        f.seek(layout.read_manifest(slots[6])["nbytes"] - 1)
        last = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([last[0] ^ 0xFF]))
    ck3, model3, _ = fresh(config)
    assert ck3.restore().step == 4 and torch.equal(model3.weight, weights[4])

    layout.manifest_path(slots[4]).unlink()            # torn mid-copy: no manifest
    ck4, _, _ = fresh(config)
    assert ck4.restore() is None


def test_a_rollback_drops_the_abandoned_branch_so_a_later_restart_cannot_bring_it_back(shm):
    config = SnapshotConfig(every=2, dir=str(shm))
    ck, model, opt = fresh(config)
    train(ck, model, opt, 6)                           # slots: 4 and 6, the branch abandoned
    ck.close()
    ck2, model2, opt2 = fresh(config)
    assert ck2.restore(at_most=5).step == 4            # the rollback
    weights = train(ck2, model2, opt2, 5, first=4)     # one step on, no snapshot yet
    ck2.close()
    ck3, _, _ = fresh(config)
    assert ck3.restore().step == 4                     # a crash now: not 6 again
    ck4, _, _ = fresh(config)
    assert ck4.restore(at_most=3) is None              # nothing at or before 3 here ...
    assert ck4.restore() is None                       # ... and nothing past it kept
    assert 5 in weights



def test_a_restart_inside_the_rolled_back_job_goes_on_from_the_new_branch(shm):
    """A job resubmitted after a rollback keeps TRAINGUARD_RESUME_STEP for every restart
    inside it (a plain torchrun --max-restarts): the first restore rolls back and marks it
    applied; a restart with the same environment resumes the new branch's newest, dropping
    nothing; a new rollback (another identity) rolls back again."""
    config = SnapshotConfig(every=2, dir=str(shm))
    ck, model, opt = fresh(config)
    train(ck, model, opt, 6)                           # slots: 4 and 6, the branch abandoned
    ck.close()
    ck2, model2, opt2 = fresh(config)
    assert ck2.restore(at_most=5, rollback="restart-1").step == 4
    weights = train(ck2, model2, opt2, 8, first=4)     # the new branch: 6 and 8
    ck2.close()
    ck3, model3, _ = fresh(config)
    assert ck3.restore(at_most=5, rollback="restart-1").step == 8      # not 4 again
    assert torch.equal(model3.weight, weights[8])
    ck3.close()
    assert fresh(config)[0].restore(at_most=7, rollback="restart-2").step == 6   # a new one
    assert fresh(config)[0].restore().step == 6                 # ... which dropped 8


def test_the_framework_callbacks_drop_the_abandoned_branch_after_a_rollback_too(shm):
    from trainguard.integrations.callbacks import CallbackSnapshots

    config = SnapshotConfig(every=2, dir=str(shm))
    ck, model, opt = fresh(config)
    train(ck, model, opt, 6)                           # slots: 4 and 6
    ck.close()
    rolled_back = CallbackSnapshots(config=config, environ={"TRAINGUARD_RESUME_STEP": "5"})
    assert rolled_back.find("unit").step == 4
    rolled_back.close()
    again = CallbackSnapshots(config=config, environ={})   # a crash before the next snapshot
    assert again.find("unit").step == 4                # not 6, the branch rolled back
    again.close()

def test_a_snapshot_that_does_not_fit_is_refused_with_one_line(shm, caplog):
    ck, model, opt = fresh(SnapshotConfig(every=1, dir=str(shm), max_bytes=1000))
    with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint.snapshot"):
        train(ck, model, opt, 3)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "refused" in lines[0] and "max_bytes 1000" in lines[0]
    assert ck.stats["refused"] == 3 and ck.stats["committed"] == 0


def test_only_tensors_and_plain_data_are_stored():
    with pytest.raises(TypeError, match="tensors and plain data only"):
        layout.flatten({"model": {"w": torch.zeros(2)}, "hook": lambda: 0})
    with pytest.raises(layout.TornSnapshot):
        layout.read_snapshot(bytearray(b"\x80\x04pickle" * 10))


def test_disk_copy_with_dcp_restores_when_memory_is_gone(shm, tmp_path):
    import shutil

    config = SnapshotConfig(every=2, dir=str(shm), persist_dir=str(tmp_path / "dcp"),
                            persist_every_s=1e-6)
    ck, model, opt = fresh(config)
    weights = train(ck, model, opt, 4)
    ck.close()
    # one copy at a time: a step whose predecessor is still being written is not copied
    persisted = sorted(int(p.parent.parent.name[5:])
                       for p in (tmp_path / "dcp").glob("step_*/rank_0/.metadata"))
    assert persisted and set(persisted) <= {2, 4}
    shutil.rmtree(shm / "own")
    ck2, model2, _ = fresh(config)
    restored = ck2.restore()
    assert (restored.step, restored.source) == (persisted[-1], "disk")
    assert torch.equal(model2.weight, weights[persisted[-1]])


# -- node agents' stores ---------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stores(shm, names, keys, **kw):
    ports = {n: free_port() for n in names}
    peers = {n: f"127.0.0.1:{p}" for n, p in ports.items()}
    return {n: SnapshotStore(SnapshotStoreConfig(dir=str(shm / n), listen=peers[n],
                                                 peers=peers, scan_interval_s=0.05, **kw),
                             node=n, keys=keys).start() for n in names}


def held_soon(store, steps: list) -> None:
    deadline = time.monotonic() + 10
    while sorted(store.held("unit", 0)) != steps:
        assert time.monotonic() < deadline, (sorted(store.held("unit", 0)), steps)
        time.sleep(0.05)


def lose_a_and_restore_on_spare_c(s, shm, weights: dict, step: int) -> None:
    """Machine a is lost (its agent stopped, its memory gone); a rank on the spare c
    restores ``step`` from the buddy b's copy."""
    import shutil

    s["a"].stop()
    shutil.rmtree(shm / "a")
    spare, model, _ = fresh(SnapshotConfig(every=2, dir=str(shm / "c")))
    restored = spare.restore()
    assert (restored.step, restored.source) == (step, "buddy:b")
    assert torch.equal(model.weight, weights[step])


def test_replicas_are_signed_and_a_spare_restores_from_the_buddy(shm):
    s = stores(shm, ("a", "b", "c"), KEYS)
    try:
        assert s["a"].buddy == "b"
        ck, model, opt = (lambda c: c)(fresh(SnapshotConfig(every=2, dir=str(shm / "a"))))
        weights = train(ck, model, opt, 4)
        ck.close()
        held_soon(s["b"], [2, 4])
        lose_a_and_restore_on_spare_c(s, shm, weights, 4)
    finally:
        for store in s.values():
            store.stop()


def test_a_rollback_drops_the_abandoned_branch_on_the_buddy_and_on_disk_too(shm, tmp_path):
    """Rolled back from 6 to 4, then machine a is lost: its spare restores 4 from the buddy,
    not the abandoned 6 that the buddy held; the disk copies past 4 are gone too."""
    s = stores(shm, ("a", "b", "c"), KEYS)
    dcp = tmp_path / "dcp"
    try:
        config = SnapshotConfig(every=2, dir=str(shm / "a"), persist_dir=str(dcp),
                                persist_every_s=1e-6)
        ck, model, opt = fresh(config)
        weights = {}
        for done in range(1, 7):       # each disk copy written before the next is due
            weights.update(train(ck, model, opt, done, first=done - 1))
            if ck.snapshotter._persist_thread is not None:
                ck.snapshotter._persist_thread.join(60)
        ck.close()
        assert (dcp / "step_00000006" / "rank_0").is_dir()
        held_soon(s["b"], [4, 6])
        ck2, _, _ = fresh(config)
        assert ck2.restore(at_most=5).step == 4            # the rollback
        ck2.close()
        assert sorted(s["b"].held("unit", 0)) == [4]
        assert not [p for p in dcp.glob("step_*/rank_0") if int(p.parent.name[5:]) > 4]
        lose_a_and_restore_on_spare_c(s, shm, weights, 4)   # not the abandoned 6
    finally:
        for store in s.values():
            store.stop()



def test_a_drop_the_buddy_missed_is_sent_again_and_keeps_what_came_after(shm, caplog):
    """The buddy's agent is down when the rank rolls back from 6 to 4: the rank says so, and
    the node agent sends the drop again until the buddy answers; the buddy then holds 4, not
    the abandoned 6, and a spare restores 4. A drop that arrives again later keeps the copies
    taken after the rollback."""
    s = stores(shm, ("a", "b", "c"), KEYS, drop_retry_s=0.2)
    try:
        config = SnapshotConfig(every=2, dir=str(shm / "a"))
        ck, model, opt = fresh(config)
        weights = train(ck, model, opt, 6)
        ck.close()
        held_soon(s["b"], [4, 6])
        s["b"].stop()                                   # its memory stays
        ck2, model2, opt2 = fresh(config)
        with caplog.at_level(logging.WARNING, logger="trainguard.checkpoint.memory"):
            assert ck2.restore(at_most=5).step == 4
        assert "peers not reached: b, c" not in caplog.text     # c answered
        assert "peers not reached: b (the node agent sends them the drop again)" in caplog.text
        assert sorted(s["b"].held("unit", 0)) == [4, 6]          # missed it
        s["b"] = SnapshotStore(s["b"].config, node="b", keys=KEYS).start()   # back
        held_soon(s["b"], [4])                          # the drop, sent again
        # ... and answered: a forgets it once b's answer is back, a moment after b applied it
        # (asserted at once, a loaded suite once saw it still pending)
        deadline = time.monotonic() + 10
        while s["a"]._pending_drops:
            assert time.monotonic() < deadline, s["a"]._pending_drops
            time.sleep(0.05)
        weights.update(train(ck2, model2, opt2, 8, first=4))     # the new branch: 6 and 8
        ck2.close()
        held_soon(s["b"], [6, 8])
        rollback_ts = s["a"]._rollbacks[("unit", 0)][1]
        assert s["b"]._drop_newer("unit", 0, 4, before=rollback_ts) == 0   # late: kept
        lose_a_and_restore_on_spare_c(s, shm, weights, 8)
    finally:
        for store in s.values():
            store.stop()

def test_lookups_and_drops_ask_the_machines_that_can_hold_the_copies_not_every_one(shm):
    """Four machines, buddies a->b->c->d->a. A restart on a asks b only; a rollback's drop goes
    to b only. Machine a is lost: the spare c asks every peer once (the rank came from
    elsewhere), remembers b (held copies) and a (did not answer), and from then on asks its
    own buddy d and those two, also after its agent restarts."""
    s = stores(shm, ("a", "b", "c", "d"), KEYS, peer_connect_timeout_s=0.5)
    asked = []

    def counting(store):
        ask = store._ask_peer
        store._ask_peer = lambda address, header: (
            asked.append((store.node, header["op"], address)), ask(address, header))[1]
    for store in s.values():
        counting(store)
    name = {store.config.listen: n for n, store in s.items()}
    peers_asked = lambda op: sorted({name[a] for _, o, a in asked if o == op})
    try:
        assert [s[n].buddy for n in "abcd"] == ["b", "c", "d", "a"]
        config = SnapshotConfig(every=2, dir=str(shm / "a"))
        ck, model, opt = fresh(config)
        weights = train(ck, model, opt, 6)
        ck.close()
        held_soon(s["b"], [4, 6])
        ck2, _, _ = fresh(config)
        assert ck2.restore().step == 6
        assert peers_asked("list") == ["b"]
        asked.clear()
        assert ck2.restore(at_most=5).step == 4           # a rollback
        ck2.close()
        assert peers_asked("list") == ["b"] and peers_asked("drop") == ["b"]
        assert sorted(s["b"].held("unit", 0)) == [4]
        asked.clear()
        lose_a_and_restore_on_spare_c(s, shm, weights, 4)
        assert peers_asked("list") == ["a", "b", "d"]    # once, on every peer
        assert s["c"].holders.targets("unit", 0) == ["a", "b", "d"]
        asked.clear()
        spare, _, _ = fresh(SnapshotConfig(every=2, dir=str(shm / "c")))
        assert spare.restore(at_most=3) is None           # nothing at or before 3: the drop
        spare.close()
        assert peers_asked("list") == ["a", "b", "d"] and peers_asked("drop") == ["a", "b", "d"]
        s["c"].stop()
        s["c"] = SnapshotStore(s["c"].config, node="c", keys=KEYS).start()
        assert s["c"].holders.targets("unit", 0) == ["a", "b", "d"]
    finally:
        for store in s.values():
            store.stop()


def put(address, header, body):
    reply, _ = request(address, header, body, timeout=5)
    return reply


def test_unsigned_forged_and_tampered_replicas_are_refused(shm):
    s = stores(shm, ("a", "b"), KEYS)
    try:
        ck, model, opt = fresh(SnapshotConfig(every=2, dir=str(shm / "x")))
        train(ck, model, opt, 2)
        ck.close()
        path = next((shm / "x").glob("own/unit/rank0/slot*.bin"))
        manifest = layout.read_manifest(path)
        body = path.read_bytes()[:manifest["nbytes"]]
        header = {"op": "put", "ts": time.time(), "node": "evil", "job": "unit", "rank": 0,
                  "step": 2, "nbytes": manifest["nbytes"],
                  "sha256": layout.sha256(body, len(body)),
                  "manifest": manifest, "body": True}
        address = s["b"].config.listen
        assert put(address, {**header, "id": "1"}, body)["code"] == "unsigned"
        assert put(address, sign_object({**header, "id": "2"}, OTHER), body)["code"] == \
            "unknown_key"
        forged = sign_object({**header, "id": "3"}, KEYS)
        forged["step"] = 3
        assert put(address, forged, body)["code"] == "bad_signature"
        tampered = bytearray(body)
        tampered[-1] ^= 0xFF
        assert put(address, sign_object({**header, "id": "4"}, KEYS), tampered)["code"] == \
            "bad_digest"
        stale = sign_object({**header, "id": "5", "ts": time.time() - 3600}, KEYS)
        assert put(address, stale, body)["code"] == "stale"
        assert s["b"].held("unit", 0) == {} and s["b"].stats["refused"] == 5
        good = sign_object({**header, "id": "6"}, KEYS)
        assert put(address, good, body)["ok"] and list(s["b"].held("unit", 0)) == [2]
        assert put(address, good, body)["code"] == "replayed"
        drop = {"op": "drop", "ts": time.time(), "node": "evil", "job": "unit", "rank": 0,
                "step": 0}
        assert request(address, {**drop, "id": "7"}, timeout=5)[0]["code"] == "unsigned"
        assert list(s["b"].held("unit", 0)) == [2]
        assert request(address, sign_object({**drop, "id": "8"}, KEYS), timeout=5)[0][
            "dropped"] == 1
        assert s["b"].held("unit", 0) == {}
        # a replica of the abandoned branch that was on its way when the drop came
        assert put(address, sign_object({**header, "id": "9"}, KEYS), body)["code"] == \
            "abandoned"
        newer = {**manifest, "ts": time.time() + 1}     # the new branch's step 2
        assert put(address, sign_object({**header, "id": "10", "manifest": newer}, KEYS),
                   body)["ok"]
    finally:
        for store in s.values():
            store.stop()


def test_the_ranks_socket_answers_its_machine_only(shm):
    s = stores(shm, ("a", "b"), KEYS)
    try:
        sources = Sources(SnapshotConfig(dir=str(shm / "a")), job="unit", rank=0)
        assert sources.agent() == {}
        reply, _ = request(s["a"].config.listen, {"op": "steps", "job": "unit", "rank": 0,
                                                  "id": "x", "ts": time.time()}, timeout=5)
        assert reply["ok"] is False            # "steps" is not a peer's request
        reply, _ = request(str(shm / "a" / "agent.sock"),
                           {"op": "fetch", "job": "../etc", "rank": 0, "step": 1}, timeout=5)
        assert reply["code"] == "malformed"
    finally:
        for store in s.values():
            store.stop()


@pytest.mark.slow
def test_fsdp2_sharded_state_is_snapshotted_per_shard_and_restored(shm):
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
         str(REPO / "tests" / "sharded_snapshot_job.py"), str(shm)],
        capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: step 3 from memory weights True optimizer True local 106 of 212" \
            in proc.stdout
        manifest = json.loads(next((shm / "own/fsdp" / f"rank{rank}").glob("*.json")).read_text())
        assert manifest["world"] == 2
