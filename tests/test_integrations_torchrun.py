"""Real 3-rank torchrun (gloo, CPU) jobs watched three ways, through the real broker:

- ``examples/plain_ddp.py`` (imports nothing of trainguard) under ``--instrument``'s
  environment (``TRAINGUARD_INSTRUMENT=1``, the site folder on ``PYTHONPATH``), its batches
  read straight from the dataset (no ``DataLoader``: a loader no hook sees);
- ``examples/hf_trainer.py``: a 2-layer GPT-2 from a config, ``TrainguardCallback``;
- ``examples/lightning_job.py``: a small LightningModule, ``TrainguardCallback``.

Each way runs two jobs at once. In ``one``, rank 1's data loader sleeps for every batch from
the first: its peers wait for it in the all-reduce. In ``all``, every rank's loader sleeps as
long. Every rank's steps arrive with step time, compute time, phases and loss; the loader's
time is the rank's work (``compute_time`` is the step's time less the time blocked waiting
for peers) and, where a ``DataLoader`` runs it, its heartbeats show ``data``. ``trainguard analyze`` on a recording of the
topic names rank 1 of ``one`` a straggler, and nobody in ``all``.
"""
from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest

from collector_harness import by_type, watched_run, with_framework, write_recording

pytestmark = [pytest.mark.slow, pytest.mark.broker]

NPROC = 3
SLOW_RANK = 1
# long beside a step's compute on a loaded machine, so that 5 heartbeats a second catch it
LOADER_SLEEP = 0.2
# the straggler detector learns each rank's usual share over 10 steps, then wants 6 of 10
STEPS = 22
JOBS = {
    "plain": (["examples/plain_ddp.py", "--loader", "python"], True),
    "hf": (["examples/hf_trainer.py", "--save-steps", "100"], False),
    "lightning": (["examples/lightning_job.py", "--save-steps", "100"], False),
}
SLOW_LOADERS = {"one": str(SLOW_RANK), "all": "*"}


def run_job(name, slow, bootstrap, tmp):
    script, instrument = JOBS[name]
    # heartbeats 5 a second: enough samples of a few seconds' job to tell where time went
    config = tmp / "collector.toml"
    config.write_text("[collector]\nheartbeat_interval = 0.2\n")
    return watched_run(bootstrap, tmp, f"it-{name}-{slow}", [*script, "--steps", str(STEPS)],
                       NPROC, instrument=instrument, timeout=240, extra_env={
                           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                           "TOKENIZERS_PARALLELISM": "false", "TRAINGUARD_CONFIG": str(config),
                           "FAULT_SLOW_DATA": f"{SLOW_LOADERS[slow]}:{LOADER_SLEEP}"})


@pytest.fixture(scope="module", params=[with_framework(n) for n in sorted(JOBS)])
def watched_jobs(request, tmp_path_factory, kafka_bootstrap):
    """``{"one": (name, events, recording), "all": ...}``: the two jobs, run together."""
    name = request.param
    with ThreadPoolExecutor(len(SLOW_LOADERS)) as pool:
        runs = {slow: pool.submit(run_job, name, slow, kafka_bootstrap,
                                  tmp_path_factory.mktemp(f"{name}-{slow}"))
                for slow in SLOW_LOADERS}
    jobs = {}
    for slow, run in runs.items():
        code, out, events = run.result()
        assert code == 0, (slow, out[-4000:])
        path = tmp_path_factory.mktemp(f"{name}-{slow}-rec") / "recording.jsonl"
        jobs[slow] = name, events, write_recording(events, path)
    return jobs


def test_every_rank_sends_steps_with_times_phases_and_loss(watched_jobs):
    name, events, _ = watched_jobs["one"]
    assert not [e for e in events if isinstance(e, Exception)], "invalid events on the topic"
    steps = by_type(events, "step")
    per_rank = defaultdict(list)
    for e in steps:
        assert e.job == f"it-{name}-one"
        per_rank[e.rank].append(e)
    assert set(per_rank) == set(range(NPROC)), sorted(per_rank)
    for rank, got in per_rank.items():
        numbers = [e.step for e in got]
        assert sorted(numbers) == list(range(STEPS)), (rank, numbers)
        for e in got:
            assert e.step_time > 0 and e.compute_time is not None
            assert 0 <= e.compute_time <= e.step_time
            assert e.loss is not None and e.lr is not None
        assert sum(e.grad_norm is not None for e in got) >= len(got) - 2
    if name == "hf":
        # the first step finds the top-level modules through hooks that see no kwargs
        assert {e.tokens for e in steps if e.step >= 1} == {4 * 16}
    phases = defaultdict(Counter)
    for beat in by_type(events, "heartbeat"):
        phases[beat.rank][beat.phase] += 1
    assert set(phases) == set(range(NPROC))
    seen = set().union(*phases.values())
    assert seen & {"forward", "backward", "optimizer", "collective"}, seen
    # where the slow rank's time went once it trained: its loader (between steps, where no
    # hook sees it, for plain)
    loading = "idle" if name == "plain" else "data"
    for counts in phases.values():
        counts.pop("init", None)

    def share(rank):
        return phases[rank][loading] / max(1, sum(phases[rank].values()))

    # seen, and a larger share of the slow rank's heartbeats than of any peer's (not "the most
    # common phase": on a loaded machine backward can truly outweigh a 0.2 s loader)
    assert phases[SLOW_RANK][loading] >= 2, phases
    assert share(SLOW_RANK) > max(share(r) for r in phases if r != SLOW_RANK), phases
    life = by_type(events, "lifecycle")
    assert {e.rank for e in life if e.event == "start"} == set(range(NPROC))
    assert {e.rank for e in life if e.event == "exit"} == set(range(NPROC))


def compute_medians(events) -> dict:
    compute = defaultdict(list)
    for e in by_type(events, "step"):
        if e.step >= 1:  # the first step holds each rank's own start-up
            compute[e.rank].append(e.compute_time)
    return {r: statistics.median(v) for r, v in compute.items()}


def stragglers(recording) -> list:
    from trainguard.detectors.offline import analyze_file

    return [i for i in analyze_file(str(recording))["incidents"] if i["kind"] == "straggler"]


def test_the_rank_with_a_slow_data_loader_is_named_a_straggler(watched_jobs):
    name, events, recording = watched_jobs["one"]
    medians = compute_medians(events)
    others = max(v for r, v in medians.items() if r != SLOW_RANK)
    print(name, "compute_time medians", medians, "ratio", round(medians[SLOW_RANK] / others, 2))
    assert medians[SLOW_RANK] > others + 0.6 * LOADER_SLEEP, medians
    found = stragglers(recording)
    assert {tuple(i["ranks"]) for i in found} == {(SLOW_RANK,)}, json.dumps(found)[:2000]


def test_nothing_is_named_when_every_loader_is_equally_slow(watched_jobs):
    name, events, recording = watched_jobs["all"]
    medians = compute_medians(events)
    print(name, "compute_time medians, every loader slow", medians)
    assert min(medians.values()) > 0.8 * LOADER_SLEEP, medians   # the loader is work
    assert not stragglers(recording)
