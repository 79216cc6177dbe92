"""Issue 20 point 3: ``trainguard run --standby``, a restart without a relaunch.

The supervisor runs the standby launcher (trainguard.launcher.inplace) over examples/train.py:
a crashed rank's generation is taken over by warm standbys that restore from the in-memory
snapshots, the supervisor records it (code ``restarted_in_place``) and does not relaunch, and
the action service's restart order for the same crash is answered ``already_satisfied``
(``restarted_in_place``), not with a second restart. When the launcher runs out of
standbys, the supervisor relaunches: the fallback, recorded as such. A rollback order stops
every rank and the standbys restore at or before its step, without a relaunch. No broker: the
supervisor's Kafka ends are lists, the collectors point at a closed port."""
from __future__ import annotations

import json
import sys
import time

import pytest

from snapshot_cluster import REPO, base_env, restored_lines
from actions_harness import wait_for
from test_supervisor import Orders, Running, acks, planned, records
from trainguard.launcher.supervisor import Supervisor

pytest.importorskip("torch")


def standby_supervisor(tmp_path, shm, chaos: str, standby: int, steps: int = 12,
                       extra=("--checkpoint-every", "1000")):
    status = tmp_path / "inplace.jsonl"
    log = tmp_path / "run.log"
    env = {**base_env(tmp_path), "TRAINGUARD_SNAPSHOT_DIR": str(shm),
           "TRAINGUARD_CHAOS": chaos, "TRAINGUARD_CHAOS_LOG": str(tmp_path / "chaos.jsonl")}
    script = [str(REPO / "examples" / "train.py"), "--job", "j1", "--steps", str(steps),
              *extra, "--snapshot-every", "2", "--checkpoint-dir",
              str(tmp_path / "ckpt"), "--timeout", "60"]
    cmd = [sys.executable, "-m", "trainguard.launcher.inplace", "--nproc", "2", "--standby",
           str(standby), "--status", str(status), "--", *script]
    published, lines = [], []
    sup = Supervisor(job="j1", cmd=cmd, max_restarts=2, grace_s=2.0, environ=env,
                     node="hostA", publish=published.append, orders=Orders(),
                     log=lines.append, poll_s=0.05, world_size=2,
                     inplace_status=str(status))
    return sup, published, lines, log


def obeyed_in_place(sup, published, lines, capfd, when, order) -> str:
    """Run the supervisor; once ``when()``, give it ``order()``; the order must be acked
    ``done`` / ``restarted_in_place``, the job finish, and nothing be relaunched. The output."""
    with Running(sup) as run:
        wait_for(when, what="the moment of the order", timeout=120)
        sent = order()
        sup.orders.put(sent)
        wait_for(lambda: acks(published, incident=sent.incident), what="the ack", timeout=30)
        run.join(240)
    out = capfd.readouterr().out
    ack = acks(published, incident=sent.incident)[0]
    assert (ack.status, ack.code) == ("done", "restarted_in_place"), ack.reason
    assert run.code == 0, out[-4000:] + "\n".join(lines)
    assert sup.incarnation == 0 and sup.restarts == 0      # never relaunched
    return out


@pytest.mark.slow
def test_a_crash_is_taken_over_in_place_and_its_restart_order_is_already_satisfied(
        tmp_path, shm, capfd):
    sup, published, lines, _ = standby_supervisor(tmp_path, shm, "crash@step=7,rank=1",
                                                  standby=2)
    started = time.time()
    with Running(sup) as run:
        run.join(240)
    out = capfd.readouterr().out
    assert run.code == 0, out[-4000:] + "\n".join(lines)
    assert sup.incarnation == 0 and sup.restarts == 0      # never relaunched
    assert "[inplace] standby 0 takes rank" in out and "fallback" not in out
    found = restored_lines(out)
    common = min(newest for newest, _, _ in found.values())
    assert sorted(found) == [0, 1] and common in (6, 8), out[-4000:]
    assert all(source == "memory" for _, _, source in found.values())
    [record] = records(published, status="done")
    assert record.extra["code"] == "restarted_in_place" and record.extra["trigger"] == "inplace"
    assert "generation 1" in record.reason

    # the action service's restart order for that crash, which began before the takeover
    crash = next(r for r in map(json.loads, (tmp_path / "inplace.jsonl").read_text()
                                .splitlines()) if r["event"] == "generation")
    order = planned(incident="crash-inc", onset=crash["ts"] - 1.0)
    assert sup.obey(order, {"exclude_nodes": [], "onset_ts": order.targets["onset_ts"]}) \
        == "already_satisfied"
    ack = acks(published, incident="crash-inc")[0]
    assert ack.code == "restarted_in_place" and sup.restarts == 0
    assert started < crash["failed_ts"] < crash["ts"]


@pytest.mark.slow
def test_without_enough_standbys_the_supervisor_relaunches_and_says_why(tmp_path, shm, capfd):
    sup, published, lines, _ = standby_supervisor(tmp_path, shm, "crash@step=5,rank=1",
                                                  standby=1, steps=8)
    with Running(sup) as run:
        run.join(240)
    out = capfd.readouterr().out
    assert run.code == 0, out[-4000:] + "\n".join(lines)
    assert sup.restarts == 1                                # the fallback
    done = records(published, status="done")
    assert [r.extra["code"] for r in done] == ["relaunched"], done
    assert "no restart in place: no standby left for rank" in done[0].reason


@pytest.mark.slow
def test_a_restart_order_naming_a_hung_rank_replaces_only_its_process(tmp_path, shm, capfd):
    sup, published, lines, _ = standby_supervisor(tmp_path, shm, "hang@step=5,rank=1",
                                                  standby=2, steps=10)
    chaos = tmp_path / "chaos.jsonl"
    out = obeyed_in_place(sup, published, lines, capfd, when=lambda: chaos.exists() and
                          chaos.read_text().strip(),
                          order=lambda: planned(incident="hang-inc", onset=time.time() - 1.0,
                                                ranks=[1]))
    assert "[inplace] rank 1 exited with status -9" in out and "fallback" not in out
    found = restored_lines(out)
    assert sorted(found) == [0, 1] and all(src == "memory" for _, _, src in found.values())
    assert [r.extra["code"] for r in records(published, status="done")] == \
        ["restarted_in_place"]


@pytest.mark.slow
def test_a_rollback_order_is_carried_out_in_place_from_the_newest_copy_at_or_before_it(
        tmp_path, shm, capfd):
    sup, published, lines, _ = standby_supervisor(
        tmp_path, shm, "", standby=2, steps=16,
        extra=("--checkpoint-every", "4", "--step-sleep", "0.3", "--step-log",
               str(tmp_path / "steps.jsonl")))
    steps = tmp_path / "steps.jsonl"

    def done_steps():
        return [json.loads(line)["step"] for line in steps.read_text().splitlines()] \
            if steps.exists() else []

    out = obeyed_in_place(sup, published, lines, capfd,
                          when=lambda: max(done_steps(), default=-1) >= 9,
                          order=lambda: planned(op="rollback", incident="nan-inc",
                                                onset=time.time() - 1.0, rollback_step=5))
    assert "[inplace] rollback to step 5" in out and "fallback" not in out
    # memory holds only the two newest snapshots: the disk copy at step 4 is the newest <= 5
    assert "ckpt_00000004.pt at step 4" in out, out[-4000:]
    done = done_steps()
    again = done.index(4, done.index(9))                   # step 4 ran again after the order
    assert done[again:] == list(range(4, 16)), done
    [record] = records(published, status="done")
    assert record.extra["code"] == "restarted_in_place" and "rollback to step 5" in record.reason


@pytest.mark.parametrize("rolled_back", [False, True])
def test_a_standby_keeps_a_resume_step_only_when_its_generation_was_rolled_back(rolled_back):
    """The launch's TRAINGUARD_RESUME_STEP belongs to its first generation: a standby that
    takes a rank over after a crash resumes the newest, unless the launcher wrote a rollback
    step for the generation it joins."""
    import datetime

    import torch.distributed as dist

    from trainguard.broker import free_port
    from trainguard.checkpoint.inplace import InPlace

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True,
                          timeout=datetime.timedelta(seconds=10))
    store.set("standby/0", "0 1 0")                # rank 0 of generation 1
    if rolled_back:
        store.set("resume_step/1", "12")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "1",
           "TRAINGUARD_INPLACE": "1", "TRAINGUARD_STANDBY": "0",
           "TRAINGUARD_RESUME_STEP": "40", "TRAINGUARD_ROLLBACK_STEP": "40"}
    inplace = InPlace.from_env(timeout_s=10, environ=env)
    inplace.join()
    try:
        assert (inplace.rank, inplace.generation) == (0, 1)
        expected = "12" if rolled_back else None
        assert env.get("TRAINGUARD_RESUME_STEP") == env.get("TRAINGUARD_ROLLBACK_STEP") \
            == expected
        # a rollback of each generation is its own, even to the same step
        assert env.get("TRAINGUARD_ROLLBACK_ID") == ("inplace-1" if rolled_back else None)
    finally:
        dist.destroy_process_group()
