"""Recovery from in-memory snapshots, for real: torchrun jobs of examples/train.py on gloo,
node agents holding the snapshots (tests/snapshot_cluster.py), a crashed rank and a lost
machine. No broker: the collectors point at a closed port."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")

from snapshot_cluster import (Machine, Network, base_env, copied_elsewhere,  # noqa: E402
                              free_port, kill, restored_lines, standby_launcher, tear_down,
                              torchrun)


def wait(proc, timeout):
    try:
        return proc.wait(timeout)
    finally:
        kill(proc)


@pytest.mark.slow
def test_crash_resumes_from_the_agent_held_snapshot_at_the_newest_common_step(tmp_path, shm):
    env = base_env(tmp_path)
    node = Machine("m1", shm, free_port())
    node.start_agent([node], env, tmp_path / "agent.log")
    try:
        env.update(NODE_NAME="m1", TRAINGUARD_SNAPSHOT_DIR=str(node.dir),
                   TRAINGUARD_CHAOS="crash@step=7,rank=1")
        args = ["--job", "crash-job", "--steps", "12", "--checkpoint-every", "1000",
                "--snapshot-every", "2", "--checkpoint-dir", str(tmp_path / "ckpt")]
        log = tmp_path / "train.log"
        rc = wait(torchrun(args, env, nproc=4, max_restarts=1, log=log), 240)
        out = log.read_text()
        assert rc == 0, out[-4000:]
        found = restored_lines(out)
        assert sorted(found) == [0, 1, 2, 3], out[-4000:]
        common = min(newest for newest, _, _ in found.values())
        # rank 1 died after step 7 (8 done) while its snapshot of 8 may have been copying
        assert common in (6, 8)
        assert all(step == common and source == "memory" for _, step, source in found.values())
        assert f"[train] restored step {common} from in-memory snapshots" in out
        assert "resuming from" not in out                # no torch.save checkpoint was read
        assert f"[train] done: steps {common}..11" in out
        # the snapshots are in the agent's folder, rank 1's included
        assert node.steps("crash-job", 1, "own")[-1] == 12
    finally:
        node.stop_agent()


@pytest.mark.slow
def test_lost_machine_resumes_on_a_spare_from_the_buddies_copies(tmp_path, shm):
    """Three machines, each a network namespace (where they can be made): the job runs on m1
    and m2; m1 is lost (ranks killed, memory dropped, off the network) and the job comes back
    on the spare m3 with m1's ranks restored from their copies on m2, not from disk."""
    env = base_env(tmp_path)
    network, machines, procs = Network.create(), [], []
    try:
        machines = [Machine(n, shm, free_port(), network) for n in ("m1", "m2", "m3")]
        for m in machines:
            m.start_agent(machines, env, tmp_path / f"agent-{m.name}.log")
        m1, m2, m3 = machines
        job = "lost-machine"
        args = ["--job", job, "--steps", "400", "--checkpoint-every", "100000",
                "--snapshot-every", "2", "--step-sleep", "0.05", "--checkpoint-dir",
                str(tmp_path / "ckpt")]
        port = free_port()
        for rank, m in ((0, m1), (1, m2)):
            procs.append(torchrun(args, env, nproc=2, nnodes=2, node_rank=rank, port=port,
                                  log=tmp_path / f"first-{m.name}.log", on=m, master=m1.ip))
        # m1's buddy is m2 (placement over m1, m2, m3): wait for its replicas there
        deadline = time.monotonic() + 180
        while min(max(m2.steps(job, r, "replica"), default=0) for r in (0, 1)) < 6:
            assert time.monotonic() < deadline, (tmp_path / "first-m1.log").read_text()[-3000:]
            assert all(p.poll() is None for p in procs)
            time.sleep(0.2)
        kill(procs[0])
        m1.lose()                           # its ranks killed, its memory dropped, unplugged
        kill(procs[1])                      # the job is relaunched, on the spare m3
        held = {r: m2.steps(job, r, "replica") for r in (0, 1)}
        held.update({r: m2.steps(job, r, "own") for r in (2, 3)})
        common = max(set.intersection(*(set(s) for s in held.values())))

        port, total = free_port(), common + 4
        args[args.index("--steps") + 1] = str(total)
        logs = {m.name: tmp_path / f"second-{m.name}.log" for m in (m3, m2)}
        procs = [torchrun(args, env, nproc=2, nnodes=2, node_rank=rank, port=port,
                          log=logs[m.name], on=m, master=m3.ip)
                 for rank, m in ((0, m3), (1, m2))]
        rcs = [wait(p, 240) for p in procs]
        out = "".join(path.read_text() for path in logs.values())
        assert rcs == [0, 0], out[-5000:]
        found = restored_lines(out)
        assert {r: found[r][1:] for r in found} == {
            0: (common, "buddy:m2"), 1: (common, "buddy:m2"),
            2: (common, "memory"), 3: (common, "memory")}, out[-5000:]
        assert f"[train] done: steps {common}..{total - 1}" in out
        assert not (tmp_path / "ckpt" / "dcp").exists()        # nothing came from disk
    finally:
        tear_down(procs, machines, network)


@pytest.mark.slow
def test_warm_standbys_take_over_without_a_relaunch(tmp_path, shm):
    import subprocess
    import sys

    from snapshot_cluster import REPO

    env = {**base_env(tmp_path), "TRAINGUARD_SNAPSHOT_DIR": str(shm / "m1"),
           "TRAINGUARD_CHAOS": "crash@step=7,rank=1"}
    cmd = [sys.executable, str(REPO / "examples" / "inplace.py"), "--nproc", "4", "--",
           str(REPO / "examples" / "train.py"), "--job", "standby-job", "--steps", "12",
           "--checkpoint-every", "1000", "--snapshot-every", "2", "--checkpoint-dir",
           str(tmp_path / "ckpt"), "--timeout", "60"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "[inplace] rank 1 exited with status -9" in out and "generation 1" in out
    assert "fallback" not in out
    found = restored_lines(out)
    assert sorted(found) == [0, 1, 2, 3], out[-4000:]
    common = min(newest for newest, _, _ in found.values())
    assert common in (6, 8)
    assert all(step == common and source == "memory" for _, step, source in found.values())
    assert f"[train] done: steps {common}..11" in out


@pytest.mark.slow
def test_a_lost_machines_ranks_go_to_a_spares_warm_standbys_without_a_relaunch(tmp_path, shm):
    """Issue 20, warm standby machines: one standby launcher per machine (m1 hosts the store,
    m2, and the spare m3 with standbys only), each machine a network namespace. m2 is lost
    (everything on it killed, its memory dropped, off the network): m1's launcher finds it
    silent, gives ranks 2 and 3 to m3's standbys, m1's own standbys take ranks 0 and 1, and
    the job finishes from the newest common step with nothing relaunched and nothing read
    from disk."""
    env = base_env(tmp_path)
    network, machines, procs = Network.create(), [], {}
    job, port = "warm-spare", free_port()
    args = ["--job", job, "--steps", "120", "--checkpoint-every", "100000",
            "--snapshot-every", "2", "--step-sleep", "0.05", "--timeout", "60",
            "--checkpoint-dir", str(tmp_path / "ckpt")]
    logs = {name: tmp_path / f"launcher-{name}.log" for name in ("m1", "m2", "m3")}
    try:
        machines = [Machine(n, shm, free_port(), network) for n in ("m1", "m2", "m3")]
        m1, m2, m3 = machines
        roles = {m1: ["--node-rank", "0"], m2: ["--node-rank", "1"], m3: ["--spare"]}
        for m in machines:
            m.start_agent(machines, env, tmp_path / f"agent-{m.name}.log")
        for m, role in roles.items():
            procs[m.name] = standby_launcher(m, role, master=f"{m1.ip}:{port}", args=args,
                                             env=env, log=logs[m.name])
        # m2's ranks have copies on another machine (their buddy): then m2 is lost
        deadline = time.monotonic() + 180
        while copied_elsewhere((m1, m3), job, (2, 3)) < 6:
            assert time.monotonic() < deadline, logs["m2"].read_text()[-3000:]
            assert all(p.poll() is None for p in procs.values()), \
                "".join(log.read_text()[-2000:] for log in logs.values())
            time.sleep(0.2)
        kill(procs.pop("m2"))
        m2.lose()
        rcs = {name: wait(p, 240) for name, p in procs.items()}
        out = "".join(logs[name].read_text() for name in ("m1", "m3"))
        assert rcs == {"m1": 0, "m3": 0}, out[-5000:]
        assert "machine 1 lost: its ranks [2, 3] go to spare m3" in out, out[-5000:]
        assert "fallback" not in out
        found = restored_lines(out)
        assert sorted(found) == [0, 1, 2, 3], out[-5000:]
        common = {step for _, step, _ in found.values()}
        assert len(common) == 1, found
        assert {r: found[r][2] for r in (0, 1)} == {0: "memory", 1: "memory"}, found
        assert all(found[r][2] in ("memory", "buddy:m1", "buddy:m3") for r in (2, 3)), found
        assert f"[train] done: steps {common.pop()}..119" in out
        assert not (tmp_path / "ckpt" / "dcp").exists()        # nothing came from disk
    finally:
        tear_down(procs.values(), machines, network)
