"""Healthy jobs of shapes the scenario library does not make (tests/unseen_jobs.py, a timing
model of its own) raise no incident.

``python tests/test_unseen_healthy_shapes.py [SEEDS]`` runs every shape over more seeds (6
by default: about 300 recordings in a minute or two) and prints the incidents, also of the
shapes left out of the assertion: ``BY_DESIGN`` (findings the detectors mean to make) and
``KNOWN`` (healthy shapes that still raise incidents; not fixed)."""
from __future__ import annotations

import sys

import pytest

from trainguard.detectors.offline import analyze_events

from unseen_jobs import T0, Shape, job_events


def ckpt(every, secs, steps):
    """A checkpoint of ``secs`` after every ``every``-th step."""
    return {i: ("checkpoint", secs) for i in range(every, steps, every)}


#: name -> seed -> Shape
SHAPES = {
    # step times drawn per step, shared by every rank
    "lognormal-0.3-fast": lambda k: Shape(name="ln3f", step_s=0.3, sigma=0.3, steps=220, seed=k),
    "lognormal-0.6-fast": lambda k: Shape(name="ln6f", step_s=0.3, sigma=0.6, steps=220, seed=k),
    "lognormal-0.45-2s": lambda k: Shape(name="ln45", step_s=2.0, sigma=0.45, steps=120, seed=k),
    "lognormal-0.6-20s": lambda k: Shape(name="ln6s", step_s=20.0, sigma=0.6, steps=60,
                                         world=8, seed=k),
    "bimodal-packing": lambda k: Shape(name="bimod", step_s=0.8, sigma=0.1,
                                       bimodal=(0.15, 3.0), steps=200, seed=k),
    "bimodal-rare-long": lambda k: Shape(name="bimodr", step_s=0.5, sigma=0.1,
                                         bimodal=(0.03, 6.0), steps=250, seed=k),
    # a collector that shows only `step` and `idle` (no tg.phase)
    "plain-phases-lognormal-5s": lambda k: Shape(name="plain5", step_s=5.0, sigma=0.5,
                                                 phases="plain", steps=80, world=8, seed=k),
    "plain-phases-bimodal-1s": lambda k: Shape(name="plainb", step_s=1.0, sigma=0.2,
                                               bimodal=(0.1, 4.0), phases="plain", steps=200,
                                               seed=k),
    # gradient accumulation
    "grad-accum-32": lambda k: Shape(name="ga32", step_s=4.0, sigma=0.15, micro=32, steps=80,
                                     seed=k),
    "grad-accum-64-30s": lambda k: Shape(name="ga64", step_s=30.0, sigma=0.1, micro=64,
                                         steps=40, world=8, seed=k),
    # slow drift (a context-length curriculum, an lr schedule)
    "drift-2.5x-over-1500-steps": lambda k: Shape(name="drift", world=8, step_s=0.2,
                                                  sigma=0.05, drift=2.5, steps=1500, seed=k),
    "drift-3x-in-400-steps-tokens-alike": lambda k: Shape(name="driftt", step_s=0.4, sigma=0.05,
                                                          drift=3.0, drift_tokens=True,
                                                          steps=400, seed=k),
    # heterogeneous machines, steady from step 0
    "half-machines-1.25x": lambda k: Shape(name="het25", world=32, slow_nodes={1: 1.25, 3: 1.25},
                                           steps=150, step_s=0.5, seed=k),
    "half-machines-1.3x-noisy": lambda k: Shape(name="het30", world=32,
                                                slow_nodes={0: 1.3, 2: 1.3}, rank_sigma=0.08,
                                                sigma=0.3, steps=150, step_s=0.5, seed=k),
    "pp2-one-machine-slower": lambda k: Shape(name="hetpp", world=32, tp=2, pp=2,
                                              slow_nodes={0: 1.25}, steps=150, step_s=0.5,
                                              seed=k),
    # clocks and delivery
    "clock-skew-3s": lambda k: Shape(name="skew3", skew_s=3.0, steps=150, step_s=0.5, seed=k),
    "clock-skew-5s-slow-steps": lambda k: Shape(name="skew5", skew_s=5.0, steps=60,
                                                step_s=8.0, seed=k),
    "bursty-collectors-2s": lambda k: Shape(name="burst2", burst_s=2.0, delay_s=0.5, steps=200,
                                            step_s=0.2, seed=k),
    "bursty-collectors-5s-skew": lambda k: Shape(name="burst5", burst_s=5.0, delay_s=2.0,
                                                 skew_s=2.0, steps=150, step_s=0.5, seed=k),
    "bursty-pp2": lambda k: Shape(name="burstpp", world=32, tp=2, pp=2, burst_s=3.0,
                                  delay_s=1.0, steps=150, step_s=0.3, seed=k),
    "at-least-once-delivery": lambda k: Shape(name="again", again=0.05, amp=True, steps=150,
                                              step_s=0.3, seed=k,
                                              pauses={60: ("checkpoint", 60.0),
                                                      100: ("eval", 40.0)}),
    # large worlds, few steps
    "world-512": lambda k: Shape(name="w512", world=512, steps=25, step_s=2.0, sigma=0.2,
                                 rank_sigma=0.05, seed=k),
    "world-1024-tp8-pp4": lambda k: Shape(name="w1024", world=1024, tp=8, pp=4, steps=20,
                                          step_s=3.0, sigma=0.1, rank_sigma=0.05, seed=k),
    # step numbers and joins
    "resume-at-120000": lambda k: Shape(name="resume", start_step=120000, steps=150,
                                        step_s=0.5, seed=k),
    "steps-logged-every-10": lambda k: Shape(name="stride", start_step=500, stride=10,
                                             steps=150, step_s=0.5, seed=k),
    "late-joiners": lambda k: Shape(name="late", join_late_s=6.0, init_s=3.0, steps=150,
                                    step_s=0.3, seed=k),
    # loss curves
    "plateau-then-drop": lambda k: Shape(name="plateau", loss="plateau_drop", steps=300,
                                         step_s=0.2, seed=k),
    "epoch-bumps-6pct": lambda k: Shape(name="epoch6", loss="epoch_bumps", bump=0.06,
                                        epoch_steps=60, steps=300, step_s=0.2, seed=k),
    "amp-torch-scaler": lambda k: Shape(name="amp", amp=True, steps=300, step_s=0.2, seed=k),
    "amp-megatron-2^32": lambda k: Shape(name="ampmeg", amp=True, amp_init_power=32,
                                         amp_good_power=14, amp_hysteresis=2, steps=300,
                                         step_s=0.2, grad_bad="nan", seed=k),
    # pauses
    "evals-varying": lambda k: Shape(name="evals", steps=120, step_s=1.0, seed=k, pauses={
        20: ("eval", 15.0), 50: ("eval", 240.0), 80: ("eval", 900.0), 100: ("eval", 5.0)}),
    "checkpoints-90s": lambda k: Shape(name="ckpt", steps=150, step_s=0.5, seed=k,
                                       pauses=ckpt(30, 90.0, 150)),
    "rank0-checkpoint-others-blocked-in-forward": lambda k: Shape(
        name="r0ck", steps=80, step_s=0.5, seed=k, pauses={40: ("checkpoint", 150.0, "forward")}),
    "init-20min": lambda k: Shape(name="init20", init_s=1200.0, first_step_s=120.0, steps=60,
                                  step_s=1.0, seed=k),
    "plain-phases-lognormal-0.6-30s": lambda k: Shape(name="plain30", step_s=30.0, sigma=0.6,
                                                      phases="plain", steps=40, world=8, seed=k),
    "checkpoints-skew-5s-bursts-5s": lambda k: Shape(name="ckskb", skew_s=5.0, burst_s=5.0,
                                                     steps=120, step_s=0.5, seed=k,
                                                     pauses=ckpt(30, 120.0, 120)),
    "clock-skew-8s-30s-steps": lambda k: Shape(name="skew8", skew_s=8.0, steps=25, step_s=30.0,
                                               world=8, per_node=2, seed=k),
    "clock-skew-5s-bursts-3s-30s-steps": lambda k: Shape(name="skew5b", skew_s=5.0, burst_s=3.0,
                                                         steps=25, step_s=30.0, world=8,
                                                         per_node=2, seed=k),
    "pp2-slower-stage-skew-5s": lambda k: Shape(name="ppskew", world=32, pp=2, skew_s=5.0,
                                                slow_nodes={2: 1.4, 3: 1.4}, steps=120,
                                                step_s=2.0, seed=k),
    "world-1024-moe-noise": lambda k: Shape(name="w1024n", world=1024, steps=25, step_s=2.0,
                                            rank_sigma=0.15, seed=k),
    "world-512-bursty": lambda k: Shape(name="w512b", world=512, steps=25, step_s=1.0,
                                        burst_s=2.0, delay_s=1.0, skew_s=1.0, seed=k),
    "epoch-bumps-12pct": lambda k: Shape(name="epoch12", loss="epoch_bumps", bump=0.12,
                                         epoch_steps=60, steps=300, step_s=0.2, seed=k),
    "per-rank-sequence-noise-0.2": lambda k: Shape(name="rseq", rank_sigma=0.2, steps=200,
                                                   step_s=0.5, seed=k),
    # ... and together
    "mixed": lambda k: Shape(name="mixed", world=32, tp=2, pp=2, step_s=1.0, sigma=0.35,
                             micro=8, skew_s=2.0, burst_s=1.0, delay_s=1.0, start_step=80000,
                             loss="epoch_bumps", bump=0.04, amp=True, slow_nodes={2: 1.2},
                             pauses={40: ("eval", 120.0), 80: ("checkpoint", 60.0)},
                             steps=150, seed=k),
    # added on the nineteenth stop (each raised nothing when first run)
    "uneven-machines-12-of-8": lambda k: Shape(name="unev", world=12, per_node=8, steps=150,
                                               step_s=0.5, seed=k),
    "one-rank-per-machine": lambda k: Shape(name="r1pm", world=16, per_node=1, steps=150,
                                            step_s=0.5, seed=k),
    "fast-10ms-noisy": lambda k: Shape(name="f10", step_s=0.01, sigma=0.2, rank_sigma=0.1,
                                       steps=3000, seed=k),
    "stride-100-fast": lambda k: Shape(name="s100", stride=100, steps=2000, step_s=0.05,
                                       seed=k),
    "tp8-pp8-512-skew-bursts": lambda k: Shape(name="tp8pp8", world=512, tp=8, pp=8,
                                               skew_s=3.0, burst_s=2.0, steps=25, step_s=2.0,
                                               seed=k),
    "grad-accum-8-bimodal-skew": lambda k: Shape(name="gabs", micro=8, bimodal=(0.1, 2.5),
                                                 skew_s=4.0, steps=150, step_s=1.0, seed=k),
    "pp4-skew-5-grad-accum-16": lambda k: Shape(name="pp4ga", world=32, pp=4, micro=16,
                                                skew_s=5.0, steps=60, step_s=3.0, seed=k),
    "world-64-per-node-4-noisy-skew": lambda k: Shape(name="w64", world=64, per_node=4,
                                                      sigma=0.3, rank_sigma=0.1, skew_s=2.0,
                                                      steps=120, step_s=0.5, seed=k),
    "eval-5min-first": lambda k: Shape(name="ev5", steps=80, step_s=1.0, seed=k,
                                       pauses={10: ("eval", 300.0)}),
    "checkpoint-every-5-steps": lambda k: Shape(name="ck5", steps=150, step_s=0.5, seed=k,
                                                pauses={i: ("checkpoint", 10.0)
                                                        for i in range(5, 150, 5)}),
    "rank0-eval-others-wait": lambda k: Shape(name="r0ev", steps=80, step_s=0.5, seed=k,
                                              pauses={20: ("eval", 60.0, "collective"),
                                                      50: ("eval", 60.0, "collective")}),
    "late-joiners-30s": lambda k: Shape(name="late30", join_late_s=30.0, init_s=40.0,
                                        steps=120, step_s=0.5, seed=k),
    "init-60s-first-step-10min": lambda k: Shape(name="fs10", init_s=60.0, first_step_s=600.0,
                                                 steps=40, step_s=2.0, seed=k),
    "heartbeats-every-10s": lambda k: Shape(name="hb10", hb_s=10.0, steps=150, step_s=0.5,
                                            seed=k),
    "heartbeats-10s-slow-steps": lambda k: Shape(name="hb10s", hb_s=10.0, steps=30,
                                                 step_s=15.0, world=8, seed=k),
    "long-steps-120s": lambda k: Shape(name="l120", step_s=120.0, sigma=0.1, steps=15,
                                       world=8, seed=k),
    "gpu-every-30s": lambda k: Shape(name="gpu30", gpu_s=30.0, steps=150, step_s=0.5,
                                     seed=k),
    "bursty-10s-collectors": lambda k: Shape(name="b10", burst_s=10.0, delay_s=1.0,
                                             steps=150, step_s=0.5, seed=k),
    "amp-grad-nan": lambda k: Shape(name="ampn", amp=True, grad_bad="nan", steps=300,
                                    step_s=0.2, seed=k),
    "drift-down-0.4x": lambda k: Shape(name="ddown", drift=0.4, steps=400, step_s=0.4,
                                       sigma=0.05, seed=k),
    "records-again-15s-late-30s-steps": lambda k: Shape(name="ag30", again=0.3, again_s=15.0,
                                                        steps=15, step_s=30.0, world=8,
                                                        seed=k),
    "records-again-15s-late-checkpoints": lambda k: Shape(
        name="agck", again=0.3, again_s=15.0, steps=120, step_s=0.5, seed=k,
        pauses={i: ("checkpoint", 30.0) for i in (40, 80)}),
    "per-rank-sequence-noise-0.4": lambda k: Shape(name="rseq4", rank_sigma=0.4, steps=200,
                                                   step_s=0.5, seed=k),
}

#: shapes whose findings are by design (see the report): a pause nobody declared (a hang
#: 20 s after the last progress), a 12% loss bump at an epoch boundary after the first 250
#: steps (a loss spike: the detector's min_ratio is 1.1; the next bump is not reported), the
#: step time 2.5x in 400 steps with the same tokens per step (a throughput drop by its
#: definition: 30% slower than 100 steps before)
BY_DESIGN = {
    "drift-2.5x-in-400-steps": lambda k: Shape(name="drift4", step_s=0.4, sigma=0.05, drift=2.5,
                                               steps=400, seed=k),
    "epoch-bumps-12pct-after-250-steps": lambda k: Shape(name="ep12l", world=8,
                                                         loss="epoch_bumps", bump=0.12,
                                                         epoch_steps=300, steps=700,
                                                         step_s=0.1, seed=k),
    "undeclared-pause-60s-optimizer": lambda k: Shape(name="und60", steps=60, step_s=1.0,
                                                      seed=k, pauses={30: ("optimizer", 60.0)}),
    "undeclared-pause-90s-plain": lambda k: Shape(name="und90", steps=60, step_s=1.0,
                                                  phases="plain", seed=k,
                                                  pauses={30: ("step", 90.0)}),
    "undeclared-pause-40s-plain": lambda k: Shape(name="und40", steps=60, step_s=1.0,
                                                  phases="plain", seed=k,
                                                  pauses={30: ("step", 40.0)}),
}

#: healthy shapes that still raise incidents (see the report; not fixed): none now. Records
#: written a second time up to 15 s late in steps of 15 s or more, checkpoints or evals (an
#: old heartbeat of the newest step was taken for a step of its clock back: silent) are told
#: by their stamps since 2026-12-07 and are in SHAPES; very noisy per-rank compute times
#: raise nothing since the straggler judges paces
KNOWN: dict = {}

#: two runs of one job: stopped cleanly, resumed 2 minutes later from step 90 with a fresh
#: loss scaler (its start-up search again)
RESTARTS = {
    "resume-amp-megatron": lambda k: job_events(Shape(name="r1", amp=True, amp_init_power=32,
                                                      amp_good_power=14, amp_hysteresis=2,
                                                      steps=120, step_s=0.3, seed=k))
    + job_events(Shape(name="r2", amp=True, amp_init_power=32, amp_good_power=14,
                       amp_hysteresis=2, steps=120, step_s=0.3, start_step=90,
                       curve_from=90, t0=T0 + 200.0, seed=k)),
    "resume-plain": lambda k: job_events(Shape(name="r3", steps=120, step_s=0.5, seed=k))
    + job_events(Shape(name="r4", steps=120, step_s=0.5, start_step=100, curve_from=100,
                       t0=T0 + 200.0, seed=k, sigma=0.3)),
}

SEEDS = (0, 1)
#: the large worlds take seconds each: one seed in the suite
ONE_SEED = ("world-512", "world-512-bursty", "world-1024-tp8-pp4", "world-1024-moe-noise",
            "fast-10ms-noisy", "stride-100-fast", "tp8-pp8-512-skew-bursts")


def found(events):
    engine, _ = analyze_events(events)
    return [(i["kind"], i["ranks"], i["summary"]) for i in engine.incidents()]


@pytest.mark.parametrize("name,seed", [(n, k) for n in SHAPES
                                       for k in (SEEDS[:1] if n in ONE_SEED else SEEDS)])
def test_unseen_healthy_shape_raises_no_incident(name, seed):
    assert found(job_events(SHAPES[name](seed))) == []


@pytest.mark.parametrize("name,seed", [(n, k) for n in RESTARTS for k in SEEDS])
def test_resumed_job_raises_no_incident(name, seed):
    assert found(RESTARTS[name](seed)) == []


def _sweep(seeds):
    total = 0
    tables = ((SHAPES, ""), (RESTARTS, ""), (BY_DESIGN, " (by design)"),
              (KNOWN, " (known)"))
    for table, label in tables:
        for name, make in table.items():
            for k in seeds:
                made = make(k)
                events = made if type(made) is list else job_events(made)
                engine, _ = analyze_events(events)
                total += 1
                for inc in engine.incidents():
                    print(f"{name}{label} seed {k}: {inc['kind']} ranks {inc['ranks']} step "
                          f"{inc['step']} after {inc['detected_ts'] - inc['onset_ts']:.1f}s: "
                          f"{inc['summary']}", flush=True)
    print(f"{total} recordings")


if __name__ == "__main__":
    _sweep(range(int(sys.argv[1]) if len(sys.argv) > 1 else 6))
