"""examples/train.py for real: 2 CPU ranks under torchrun with gloo, checkpoints and resume.

No broker is needed: the collector is pointed at a closed port and drops its events.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"


def torchrun(args, env, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(TRAIN), *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.slow
def test_trains_checkpoints_and_resumes(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRAINGUARD_", "TORCHELASTIC_", "MASTER_"))}
    env.update(TRAINGUARD_BOOTSTRAP="127.0.0.1:1", TRAINGUARD_HOME=str(tmp_path / "home"),
               TRAINGUARD_CHECKPOINT_DIR=str(tmp_path / "ckpt"), PYTHONUNBUFFERED="1")
    ckpt = tmp_path / "ckpt"
    args = ["--job", "example-test", "--checkpoint-every", "5", "--log-every", "4"]

    rc, out = torchrun([*args, "--steps", "12"], env)
    assert rc == 0, out[-4000:]
    assert "[train] starting at step 0" in out and "[train] done: steps 0..11" in out
    assert sorted(p.name for p in ckpt.glob("ckpt_*.pt")) == [
        "ckpt_00000005.pt", "ckpt_00000010.pt", "ckpt_00000012.pt"]
    state = torch.load(ckpt / "ckpt_00000012.pt", weights_only=True)
    assert state["step"] == 12 and "head.weight" in state["model"] and state["optim"]["state"]

    # The second run resumes at step 12 and goes on to 16; an Xid is injected on the way.
    kmsg = tmp_path / "kmsg.log"
    env.update(TRAINGUARD_RESUME="1", TRAINGUARD_CHAOS="xid@step=13,rank=0",
               TRAINGUARD_CHAOS_KMSG=str(kmsg), TRAINGUARD_CHAOS_LOG=str(tmp_path / "chaos.jsonl"))
    rc, out = torchrun([*args, "--steps", "16"], env)
    assert rc == 0, out[-4000:]
    assert f"[train] resuming from {ckpt}/ckpt_00000012.pt at step 12" in out
    assert "[train] done: steps 12..15" in out
    assert (ckpt / "ckpt_00000016.pt").exists()
    assert ": 79, pid=" in kmsg.read_text() and len(kmsg.read_text().splitlines()) == 1
    assert '"step": 13' in (tmp_path / "chaos.jsonl").read_text()

    # A rollback: trainguard run passes TRAINGUARD_RESUME_STEP; the newest checkpoint at or
    # before it is loaded (12 of 12, 15, 16), not the newest.
    env.pop("TRAINGUARD_CHAOS")
    env.update(TRAINGUARD_RESUME_STEP="14")
    rc, out = torchrun([*args, "--steps", "13"], env)
    assert rc == 0, out[-4000:]
    assert f"[train] resuming from {ckpt}/ckpt_00000012.pt at step 12" in out
    assert "TRAINGUARD_RESUME_STEP=14" in out and "[train] done: steps 12..12" in out
