"""Real 3-rank torchrun (gloo, CPU) jobs watched three ways, through the real broker:

- ``examples/plain_ddp.py`` (imports nothing of trainguard) under ``--instrument``'s
  environment (``TRAINGUARD_INSTRUMENT=1``, the site folder on ``PYTHONPATH``);
- ``examples/hf_trainer.py``: a 2-layer GPT-2 from a config, ``TrainguardCallback``;
- ``examples/lightning_job.py``: a small LightningModule, ``TrainguardCallback``.

Rank 1 sleeps in every forward pass from step 12: every rank's steps arrive with step time,
compute time, phases and loss, and ``trainguard analyze`` on a recording of the topic names rank 1 a
straggler by ``compute_time``.
"""
from __future__ import annotations

import json
import statistics
from collections import defaultdict

import pytest

from collector_harness import by_type, watched_run, with_framework, write_recording

pytestmark = [pytest.mark.slow, pytest.mark.broker]

NPROC = 3
SLOW_RANK = 1
# rank 1 slows down at step 12, after the straggler detector learned each rank's usual share
# of the step (a rank slow from its first step is found too: tests/test_straggler_rules.py)
SLOW_FROM = 12
JOBS = {
    "plain": (["examples/plain_ddp.py", "--steps", "40", "--step-sleep", "0.02"], True),
    "hf": (["examples/hf_trainer.py", "--steps", "30", "--save-steps", "100"], False),
    "lightning": (["examples/lightning_job.py", "--steps", "40", "--save-steps", "100"], False),
}
STEPS = {"plain": 40, "hf": 30, "lightning": 40}


def run_job(name, bootstrap, tmp, extra_env=None, timeout=240):
    script, instrument = JOBS[name]
    return watched_run(bootstrap, tmp, f"it-{name}", script, NPROC, instrument=instrument,
                       timeout=timeout, extra_env={
                           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                           "TOKENIZERS_PARALLELISM": "false",
                           "FAULT_SLOW": f"{SLOW_RANK}:0.06:{SLOW_FROM}", **(extra_env or {})})


@pytest.fixture(scope="module", params=[with_framework(n) for n in sorted(JOBS)])
def watched_job(request, tmp_path_factory, kafka_bootstrap):
    name = request.param
    tmp = tmp_path_factory.mktemp(name)
    code, out, events = run_job(name, kafka_bootstrap, tmp)
    assert code == 0, out[-4000:]
    recording = write_recording(events, tmp / "recording.jsonl")
    return name, events, recording


def test_every_rank_sends_steps_with_times_phases_and_loss(watched_job):
    name, events, _ = watched_job
    assert not [e for e in events if isinstance(e, Exception)], "invalid events on the topic"
    steps = by_type(events, "step")
    per_rank = defaultdict(list)
    for e in steps:
        assert e.job == f"it-{name}"
        per_rank[e.rank].append(e)
    assert set(per_rank) == set(range(NPROC)), sorted(per_rank)
    for rank, got in per_rank.items():
        numbers = [e.step for e in got]
        assert sorted(numbers) == list(range(STEPS[name])), (rank, numbers)
        for e in got:
            assert e.step_time > 0 and e.compute_time is not None
            assert 0 <= e.compute_time <= e.step_time
            assert e.loss is not None and e.lr is not None
        assert sum(e.grad_norm is not None for e in got) >= len(got) - 2
    if name == "hf":
        # the first step finds the top-level modules through hooks that see no kwargs
        assert {e.tokens for e in steps if e.step >= 1} == {4 * 16}
    phases = defaultdict(set)
    for beat in by_type(events, "heartbeat"):
        phases[beat.rank].add(beat.phase)
    assert set(phases) == set(range(NPROC))
    seen = set().union(*phases.values())
    assert seen & {"forward", "backward", "optimizer", "data", "collective"}, seen
    life = by_type(events, "lifecycle")
    assert {e.rank for e in life if e.event == "start"} == set(range(NPROC))
    assert {e.rank for e in life if e.event == "exit"} == set(range(NPROC))


def test_the_rank_sleeping_in_its_forward_is_named_by_compute_time(watched_job):
    from trainguard.detectors.offline import analyze_file

    name, events, recording = watched_job
    compute = defaultdict(list)
    for e in by_type(events, "step"):
        if e.step > SLOW_FROM:
            compute[e.rank].append(e.compute_time)
    medians = {r: statistics.median(v) for r, v in compute.items()}
    print(name, "compute_time medians", medians)
    others = max(v for r, v in medians.items() if r != SLOW_RANK)
    assert medians[SLOW_RANK] > 1.3 * others, medians
    result = analyze_file(str(recording))
    stragglers = [i for i in result["incidents"] if i["kind"] == "straggler"]
    assert stragglers, json.dumps(result["incidents"])[:2000]
    assert {tuple(i["ranks"]) for i in stragglers} == {(SLOW_RANK,)}, stragglers
