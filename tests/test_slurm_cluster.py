"""The Slurm driver against a real Slurm cluster (tests/slurm_harness.py: Debian's slurmctld
and three slurmd on loopback): drain with a reason, requeue off a node, resubmit, and how
soon the requeued job runs again."""
from __future__ import annotations

import time

import pytest
from slurm_harness import skip_reason, sleeper, slurm  # noqa: F401  (the fixture)

from trainguard.actions.drivers import SlurmDriver, calls_ok

pytestmark = [pytest.mark.slow, pytest.mark.skipif(skip_reason() is not None,
                                                   reason=skip_reason() or "")]


def driver(cluster, **kw) -> SlurmDriver:
    return SlurmDriver(runner=lambda argv, **k: __import__("subprocess").run(
        argv, env=cluster.env, **k), **kw)


def expand(nodelist: str) -> set:
    """``tg[2-3]`` -> {"tg2", "tg3"} (the test cluster's names only)."""
    if "[" not in nodelist:
        return {n for n in nodelist.split(",") if n}
    prefix, ranges = nodelist.rstrip("]").split("[")
    out = set()
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        out |= {f"{prefix}{i}" for i in range(int(lo), int(hi or lo) + 1)}
    return out


def lines_within(path, count: int, seconds: float = 30.0) -> list:
    """The lines of ``path`` once it has ``count`` of them, or what it has after ``seconds``
    (Slurm shows RUNNING before the batch script has run its first line)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = path.read_text().splitlines() if path.exists() else []
        if len(found) >= count:
            return found
        time.sleep(0.2)
    return path.read_text().splitlines() if path.exists() else []


def test_cluster_is_up_and_runs_a_two_node_job(slurm, tmp_path):
    job = slurm.sbatch(sleeper(tmp_path), "-N", "2", "--requeue", "-o", "/dev/null")
    info = slurm.wait_job(job, "RUNNING", 30)
    assert len(expand(info["NodeList"])) == 2 and info["Requeue"] == "1"
    slurm.run("scancel", job)
    slurm.wait_idle()


def test_evict_drains_with_the_incident_and_requeue_excludes_the_node_at_once(slurm, tmp_path):
    job = slurm.sbatch(sleeper(tmp_path), "-N", "2", "--requeue", "-o", "/dev/null")
    first = slurm.wait_job(job, "RUNNING", 30)
    bad = sorted(expand(first["NodeList"]))[0]
    d = driver(slurm)
    try:
        drained = d.evict([bad], reason="trainguard incident inc-7: Xid 79 on tg GPU 0")
        assert calls_ok(drained)
        node = slurm.run("scontrol", "show", "node", bad)
        assert "DRAIN" in slurm.node(bad)["State"]
        assert "Reason=trainguard incident inc-7: Xid 79 on tg GPU 0" in node
        started = time.monotonic()
        calls = d.restart(job, exclude_nodes=[bad])
        assert calls_ok(calls), [c.to_dict() for c in calls]
        assert [c.op for c in calls] == ["requeuehold", "wait", "update", "release"]
        again = slurm.wait_job(job, "RUNNING", 40)
        back_s = time.monotonic() - started
        assert bad not in expand(again["NodeList"]) and again["Restarts"] == "1"
        assert bad in again["ExcNodeList"]
        # Slurm's own path would keep it pending for cred_expire + 1 s after the old run
        # ended and until the next scheduling pass; the driver's StartTime=now + release
        # does not wait for either. (Seconds are measured by bench/bench_recovery.py.)
        assert "BeginTime" not in again.get("Reason", "")
        # A second, unrelated restart: the evicted node stays excluded.
        calls = d.restart(job)
        assert calls_ok(calls) and f"ExcNodeList={bad}" in calls[2].argv
        third = slurm.wait_job(job, "RUNNING", 40)
        assert bad not in expand(third["NodeList"]) and third["Restarts"] == "2"
        print(f"requeue with exclusion: running again {back_s:.1f} s after the restart began")
    finally:
        slurm.run("scancel", job, check=False)
        slurm.resume_nodes([bad])
        slurm.wait_idle()


def test_resubmit_cancels_and_submits_off_the_evicted_node(slurm, tmp_path):
    script = sleeper(tmp_path)
    job = slurm.sbatch(script, "-N", "2", "-o", "/dev/null")
    first = slurm.wait_job(job, "RUNNING", 30)
    bad = sorted(expand(first["NodeList"]))[-1]
    d = driver(slurm, mode="resubmit", script=str(script),
               sbatch_args=("-N", "2", "-o", "/dev/null"))
    try:
        assert calls_ok(d.evict([bad], reason="trainguard incident inc-8: hang on rank 1"))
        calls = d.restart(job)  # the eviction alone puts the node on the exclusion list
        assert calls_ok(calls) and calls[1].argv[2] == f"--exclude={bad}"
        new = calls[1].output
        assert new != job and d.current(job) == new
        assert slurm.wait_job(job, ("CANCELLED", "COMPLETED"), 20)
        info = slurm.wait_job(new, "RUNNING", 40)
        assert bad not in expand(info["NodeList"]) and bad in info["ExcNodeList"]
        calls = d.restart(job)  # acts on the resubmitted job, still excluding the node
        assert calls[0].argv[-1] == new and calls_ok(calls)
        newest = calls[1].output
        info = slurm.wait_job(newest, "RUNNING", 40)
        assert bad not in expand(info["NodeList"])
    finally:
        slurm.cancel_all()
        slurm.resume_nodes([bad])
        slurm.wait_idle()


def test_a_rollback_resubmits_with_the_step_to_resume_from(slurm, tmp_path):
    """Issue 12 point 4 on the real cluster: a rollback's step reaches the resubmitted job as
    TRAINGUARD_RESUME_STEP (with the restart count), where trainguard.resume_step reads it."""
    resume = tmp_path / "resume.txt"
    script = sleeper(tmp_path, "rollback.sh", first=(
        f'echo "${{TRAINGUARD_RESUME_STEP:-none}} ${{TRAINGUARD_RESTART_COUNT:-none}}" '
        f'>> {resume}'))

    job = slurm.sbatch(script, "-N", "1", "-o", "/dev/null")
    slurm.wait_job(job, "RUNNING", 30)
    assert len(lines_within(resume, 1, 20)) == 1
    d = driver(slurm, mode="resubmit", script=str(script), sbatch_args=("-N", "1",
                                                                         "-o", "/dev/null"))
    try:
        calls = d.restart(job, resume_step=40)
        assert calls_ok(calls), [c.to_dict() for c in calls]
        slurm.wait_job(calls[1].output, "RUNNING", 40)
        first, second = lines_within(resume, 2, 20)[:2]
        assert first == "none none" and second == "40 1"
    finally:
        slurm.cancel_all()
        slurm.wait_idle()


def test_a_rollback_requeues_with_the_step_in_the_jobs_comment(slurm, tmp_path):
    """Under mode="requeue" the requeued job keeps its environment: the driver writes the step
    into the job's comment while it is held, tied to the run it is for; the batch script
    (trainguard resume-step) and trainguard run read it back; the next restart does not roll
    back again; the owner's own comment is kept."""
    from slurm_jobs import PYTHON

    seen = tmp_path / "resume.txt"
    script = sleeper(tmp_path, "requeue-rollback.sh", first=f"""\
step=$({PYTHON} -m trainguard.cli resume-step)
echo "script ${{step:-none}} ${{SLURM_RESTART_COUNT:-0}}" >> {seen}
{PYTHON} -m trainguard.cli run --job rb --max-restarts 0 -- \
    bash -c 'echo "run ${{TRAINGUARD_RESUME_STEP:-none}}" >> {seen}'""")

    job = slurm.sbatch(script, "-N", "1", "--requeue", "-o", str(tmp_path / "out.txt"),
                       "--comment=ablation b")
    d = driver(slurm)
    try:
        assert lines_within(seen, 2) == ["script none 0", "run none"]
        calls = d.restart(job, resume_step=40)
        assert calls_ok(calls), [c.to_dict() for c in calls]
        assert [c.op for c in calls] == ["requeuehold", "wait", "read_comment", "update",
                                         "release"]
        assert lines_within(seen, 4)[2:] == ["script 40 1", "run 40"]
        assert calls_ok(d.restart(job))  # a plain restart later: no rollback again
        assert lines_within(seen, 6)[4:] == ["script none 2", "run none"]
        comment = slurm.run("squeue", "-h", "-j", job, "-o", "%k").strip()
        assert comment == "ablation b trainguard-resume-step=40@1"
    finally:
        slurm.cancel_all()
        slurm.wait_idle()
