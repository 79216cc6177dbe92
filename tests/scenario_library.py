"""The scenario library: the healthy and fault recordings of tests/scenarios.py.

>>> len(HEALTHY) >= 100, len(FAULTS) >= 50
(True, True)
"""
from __future__ import annotations

from scenarios import Fault, Scenario


def _steps_for(step_time):
    """Enough steps for the detectors' learning, few enough for a fast suite."""
    if step_time <= 1.0:
        return 220
    if step_time <= 30.0:
        return 80
    return 16


def _healthy():
    out = []
    times = (0.05, 0.2, 0.5, 2.0, 6.0, 30.0, 120.0, 600.0)
    for i, st in enumerate(times):
        base = dict(step_time=st, steps=_steps_for(st), checkpoint_every=0)
        if st >= 120:                  # long steps: fewer ranks keep the suite fast
            base.update(dp=4, per_node=2)
        out += [
            Scenario(name=f"plain-{st}s", seed=i, **base),
            Scenario(name=f"first-step-30min-{st}s", first_step_s=1780.0, seed=i, **base),
            Scenario(name=f"checkpoints-{st}s",
                     **{**base, "checkpoint_every": 5 if st > 30 else 25},
                     checkpoint_s=min(1750.0, max(45.0, 40 * st)), seed=i),
            Scenario(name=f"ckpt-rank0-{st}s", **{**base, "checkpoint_every": 5 if st > 30 else 20},
                     checkpoint_s=45.0, checkpoint_rank0_only=True, seed=i),
            Scenario(name=f"evals-30min-{st}s", eval_every=12, eval_s=1750.0, seed=i,
                     **{**base, "steps": min(base["steps"], 30)}),
            Scenario(name=f"user-phase-{st}s", user_phase="reshard", user_phase_every=12,
                     user_phase_s=300.0, seed=i, **{**base, "steps": min(base["steps"], 60)}),
            Scenario(name=f"gc-steps-{st}s", slow_every=5 if st > 30 else 10, slow_factor=3.0,
                     seed=i, **base),
            Scenario(name=f"loader-stalls-{st}s", stall_every=6 if st > 30 else 25,
                     stall_steps=2 if st > 30 else 3,
                     stall_factor=2.0, seed=i, **base),
            Scenario(name=f"pp4-last-stage-slower-{st}s",
                     **{**base, "tp": 2, "pp": 4, "dp": 1 if st >= 120 else 2, "per_node": 4},
                     stage_factors=(1.0, 1.0, 1.0, 1.45), seed=i),
            Scenario(name=f"moe-noise-{st}s", moe_noise=0.15, rank_noise=0.05, seed=i, **base),
            Scenario(name=f"resume-{st}s", resume_at=((base["steps"] // 2, 300.0, False),),
                     seed=i, **{**base, "checkpoint_every": 4 if st > 30 else 10}),
            Scenario(name=f"own-restart-{st}s", resume_at=((base["steps"] // 2, 20.0, True),),
                     seed=i, **{**base, "checkpoint_every": 4 if st > 30 else 10}),
            Scenario(name=f"steady-rank-differences-{st}s", seed=i,
                     rank_factors={0: 0.82, 3: 1.15, 2: 1.12, 1: 0.9}, **base),
        ]
    # a shared CPU (a real 4-rank torchrun job on one machine): heavy per-step noise, two
    # ranks steadily ~12% slower than the others; noise, not stragglers
    for i, st in enumerate((0.05, 0.5, 2.0)):
        out.append(Scenario(name=f"shared-cpu-noise-{st}s", dp=4, per_node=4, step_time=st,
                            steps=_steps_for(st), checkpoint_every=0, rank_noise=0.12,
                            moe_noise=0.1, rank_factors={0: 1.12, 3: 1.12}, seed=50 + i))
    # ... and some combinations
    for seed in range(8):
        st = (0.1, 0.5, 1.5, 6.0)[seed % 4]
        out.append(Scenario(
            name=f"mixed-{seed}", step_time=st, steps=_steps_for(st), seed=100 + seed,
            tp=2, pp=2, dp=2, per_node=4, stage_factors=(1.0, 1.3), checkpoint_every=30,
            checkpoint_s=120.0, slow_every=15, moe_noise=0.08, stall_every=40,
            resume_at=((_steps_for(st) - 40, 60.0, seed % 2 == 0),)))
    return out


def _faults():
    out = []
    kinds = []
    for i, st in enumerate((0.1, 0.5, 2.0, 6.0)):
        base = dict(step_time=st, steps=_steps_for(st), checkpoint_every=40,
                    checkpoint_s=45.0)
        n = base["steps"]
        kinds += [(name, {**base, **kw}) for name, kw in [
            (f"straggler-{st}s", dict(faults=(Fault(kind="straggler", step=n // 2,
                                                    ranks=(5,), factor=1.6),))),
            (f"straggler-intermittent-{st}s", dict(faults=(Fault(
                kind="straggler", step=n // 2, ranks=(2,), factor=1.8, fraction=0.7),))),
            (f"straggler-gradual-{st}s", dict(faults=(Fault(
                kind="straggler", step=n // 3, ranks=(6,), factor=2.0, ramp=10),))),
            (f"straggler-in-pp-stage-{st}s", dict(
                tp=2, pp=4, dp=2, per_node=8, stage_factors=(1.0, 1.0, 1.0, 1.45),
                faults=(Fault(kind="straggler", step=n // 2, ranks=(9,), factor=1.5),))),
            (f"machine-straggler-{st}s", dict(faults=(Fault(
                kind="straggler", step=n // 2, ranks=(4, 5, 6, 7), factor=1.7),))),
            (f"hang-{st}s", dict(faults=(Fault(kind="hang", step=n - 20, ranks=(3,)),))),
            (f"crash-{st}s", dict(faults=(Fault(kind="crash", step=n - 20, ranks=(6,),
                                                exit_code=None, signal="SIGSEGV"),))),
            (f"kill-{st}s", dict(faults=(Fault(kind="kill", step=n - 20, ranks=(1,)),))),
            (f"silent-rank-{st}s", dict(faults=(Fault(kind="silent", step=n - 20,
                                                      ranks=(7,)),))),
            (f"machine-down-{st}s", dict(faults=(Fault(kind="machine", step=n - 20,
                                                       node="n2"),))),
            (f"xid79-{st}s", dict(faults=(Fault(kind="xid79", step=n - 20, node="n1",
                                                gpu=2),))),
            (f"dbe-{st}s", dict(faults=(Fault(kind="dbe", step=n // 2, node="n2", gpu=1),))),
            (f"nan-{st}s", dict(faults=(Fault(kind="nan", step=n // 2, ranks=(4,)),))),
            (f"grad-led-spike-{st}s", dict(faults=(Fault(kind="grad_led_spike", step=60,
                                                         factor=2.0),))),
            (f"loss-spike-{st}s", dict(faults=(Fault(kind="spike", step=n // 2,
                                                     factor=3.0),))),
        ]]
    # faults during checkpoints (a crash, a machine down, a stuck rank), the job's own
    # restart in between, several faults in one recording
    kinds += [
        ("crash-in-checkpoint", dict(step_time=0.5, steps=220, checkpoint_every=50,
                                     checkpoint_s=200.0, faults=(Fault(
                                         kind="crash", step=101, ranks=(2,)),))),
        ("hang-in-checkpoint", dict(step_time=0.5, steps=220, checkpoint_every=50,
                                    checkpoint_s=60.0, hb_s=5.0, gpu_s=10.0, faults=(Fault(
                                        kind="hang_in_checkpoint", step=101, ranks=(4,)),))),
        ("spike-after-resume", dict(step_time=2.0, steps=120, checkpoint_every=10,
                                    resume_at=((50, 30.0, True),), faults=(Fault(
                                        kind="grad_led_spike", step=75, factor=2.0),))),
        ("three-faults", dict(step_time=0.5, steps=220, checkpoint_every=30, faults=(
            Fault(kind="nan_grad", step=40),
            Fault(kind="straggler", step=80, ranks=(3,), factor=1.7, end=140),
            Fault(kind="hang", step=180, ranks=(5,), restart_after_s=60.0),
            Fault(kind="crash", step=200, ranks=(0,), exit_code=139)))),
        ("hang-restart-hang", dict(step_time=1.0, steps=150, checkpoint_every=20, faults=(
            Fault(kind="hang", step=70, ranks=(2,), restart_after_s=45.0),
            Fault(kind="hang", step=110, ranks=(6,))))),
        ("network-drop", dict(step_time=0.2, steps=400, checkpoint_every=0, faults=(
            Fault(kind="network", step=250, factor=2.5),))),
        ("throttle", dict(step_time=0.5, steps=300, checkpoint_every=0, gpu_s=2.0, faults=(
            Fault(kind="throttle", step=100, node="n1", gpu=3),))),
        ("pp-straggler-slow-stage", dict(step_time=1.0, steps=150, tp=1, pp=2, dp=4,
                                         stage_factors=(1.0, 1.3), faults=(Fault(
                                             kind="straggler", step=60, ranks=(1,),
                                             factor=1.4, fraction=0.8),))),
    ]
    # slow from the first step (never a normal baseline of its own), and slow among the
    # noise of a shared CPU
    cpu = dict(dp=4, per_node=4, checkpoint_every=0, rank_noise=0.12, moe_noise=0.1,
               rank_factors={0: 1.12, 3: 1.12})
    for st in (0.5, 2.0):
        kinds += [
            (f"straggler-from-step-0-{st}s", dict(step_time=st, steps=_steps_for(st),
                                                  checkpoint_every=0, faults=(Fault(
                                                      kind="straggler", step=0, ranks=(5,),
                                                      factor=1.6),))),
            (f"straggler-shared-cpu-{st}s", dict(step_time=st, steps=_steps_for(st), **cpu,
                                                 faults=(Fault(kind="straggler", step=12,
                                                               ranks=(1,), factor=1.6),))),
            (f"straggler-from-step-0-shared-cpu-{st}s", dict(
                step_time=st, steps=_steps_for(st), **cpu,
                faults=(Fault(kind="straggler", step=0, ranks=(1,), factor=2.0),))),
        ]
    for name, kw in kinds:
        kw = dict(kw)
        kw.setdefault("seed", 300 + len(out))
        out.append(Scenario(name=name, **kw))
    return out


def large_job(dp: int = 512) -> Scenario:
    """Issue 21's four faults in one job of TP 8 x PP 4 x ``dp`` (16,384 ranks by default, on
    2,048 machines): a slow rank, then a rank hung in its data loader (trainguard restarts
    the job), a lost machine (restarted onto a spare), and a rank whose loss goes NaN."""
    world = 8 * 4 * dp
    return Scenario(name=f"large-{world}", tp=8, pp=4, dp=dp, per_node=8, steps=32,
                    step_time=1.0, first_step_s=5.0, checkpoint_every=22, checkpoint_s=5.0,
                    gpu_s=10.0, seed=4242, faults=(
                        Fault(kind="straggler", step=11, ranks=(world // 3 + 5,), factor=1.6,
                              end=23),
                        Fault(kind="hang", step=23, ranks=(world // 5 + 3,),
                              restart_after_s=30.0),
                        Fault(kind="machine", step=27, node=f"n{world // 8 - 10}",
                              restart_after_s=25.0),
                        Fault(kind="nan", step=30, ranks=(world // 2 + 7,))))


HEALTHY = _healthy()
FAULTS = _faults()
