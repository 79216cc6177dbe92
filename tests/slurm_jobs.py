"""Training jobs on the test Slurm cluster (tests/slurm_harness.py), for the end-to-end tests
and bench/bench_recovery.py: a batch script running examples/train.py with ``torchrun``
across Slurm nodes (gloo on CPU), one torchrun agent per node started by ``srun``.

``train_script`` writes the batch script. On a requeue Slurm runs it again with
``SLURM_RESTART_COUNT`` raised; the script passes that on as ``TRAINGUARD_RESTART_COUNT`` (and
``TRAINGUARD_RESUME=1``), and examples/train.py resumes from its newest checkpoint. Each run
uses its own rendezvous port, derived from the job id and restart count (Slurm's, or
``trainguard run``'s).

``launcher="trainguard-run"`` puts ``trainguard run`` inside the allocation instead, its
command an ``srun`` over ``nodes`` of the allocation's nodes: the allocation's other nodes are
warm spares, and ``trainguard run`` relaunches the ``srun`` with ``--exclude`` of the machines
the action service evicted (see actions/supervisor.py).
"""
from __future__ import annotations

import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = str(REPO / ".venv" / "bin" / "python")
TRAIN = str(REPO / "examples" / "train.py")


def train_script(folder: Path, job: str, *, nodes: int = 2, steps: int = 60,
                 checkpoint_every: int = 10, step_sleep: float = 0.1,
                 launcher: str = "sbatch", max_restarts: int = 2) -> Path:
    """The batch script of a 2-node training job ``job`` writing checkpoints and logs in
    ``folder``; ``launcher``: ``"sbatch"`` (Slurm restarts it) or ``"trainguard-run"``."""
    folder = Path(folder)
    ckpt = folder / f"ckpt-{job}"
    train = ("port=$(( 20000 + (SLURM_JOB_ID * 131 + TRAINGUARD_RESTART_COUNT * 17) % 20000 ));"
             f" exec {PYTHON} -m torch.distributed.run --nnodes={nodes} --nproc-per-node=1 "
             f"--node-rank=$SLURM_NODEID --master-addr=127.0.0.1 --master-port=$port "
             f"{TRAIN} --job {job} --steps {steps} --checkpoint-every {checkpoint_every} "
             f"--step-sleep {step_sleep} --timeout 60 --checkpoint-dir {ckpt}")
    step = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
            "--kill-on-bad-exit=1", "bash", "-c", train]
    if launcher == "sbatch":
        run = "exec " + " ".join(shlex.quote(a) for a in step)
    elif launcher == "trainguard-run":
        run = (f"exec {PYTHON} -m trainguard.cli run --job {job} --max-restarts {max_restarts}"
               f" --grace 5 --checkpoint-dir {ckpt} -- " + " ".join(shlex.quote(a) for a in step))
    else:
        raise ValueError(f"launcher must be sbatch or trainguard-run, got {launcher!r}")
    script = folder / f"{job}.sbatch"
    script.write_text(f"""#!/bin/bash
export TRAINGUARD_RESTART_COUNT=${{SLURM_RESTART_COUNT:-0}}
if [ "$TRAINGUARD_RESTART_COUNT" -gt 0 ]; then export TRAINGUARD_RESUME=1; fi
export TRAINGUARD_CHECKPOINT_DIR={ckpt}
echo "launch job=$SLURM_JOB_ID restart=$TRAINGUARD_RESTART_COUNT nodes=$SLURM_JOB_NODELIST \
$(date +%s.%N)" >> {folder}/{job}.launches
{run}
""")
    script.chmod(0o755)
    return script
