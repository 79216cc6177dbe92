"""Real 4-rank torchrun gloo jobs instrumented with ``trainguard.init``.

One job (rank 2's forward pass 1.5x slower) is run once and checked for the event stream and
the compute-time proof; another runs with the bootstrap on a closed port.
"""
from __future__ import annotations

import statistics
import uuid
from collections import Counter, defaultdict

import pytest

from collector_harness import by_type, closed_port, consume, job_env, rank_results, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.broker]

NPROC = 4
STEPS = 40
SLOW_RANK = 2


@pytest.fixture(scope="module")
def slow_rank_job(tmp_path_factory, kafka_bootstrap):
    """The instrumented job with a slow rank 2, its per-rank results and its events."""
    from trainguard.config import Config, Topics
    from trainguard.topics import TopicPlan, create_topics

    tmp = tmp_path_factory.mktemp("slowjob")
    prefix = f"tcoll{uuid.uuid4().hex[:10]}"
    config = Config(bootstrap=kafka_bootstrap, topics=Topics(prefix=prefix))
    create_topics(config, TopicPlan(telemetry_partitions=4, other_partitions=1))
    code, out = torchrun(NPROC, ["--job", "tg-slow", "--steps", str(STEPS), "--slow-rank",
                                 str(SLOW_RANK), "--slow-factor", "1.5", "--heartbeat", "0.2",
                                 "--out", str(tmp / "out")],
                         job_env(kafka_bootstrap, prefix, tmp / "home"))
    assert code == 0, out[-3000:]
    results = rank_results(tmp / "out", NPROC)
    expected_steps = NPROC * STEPS

    def complete(events):
        exits = [e for e in by_type(events, "lifecycle") if e.event == "exit"]
        return len(by_type(events, "step")) >= expected_steps and len(exits) >= NPROC

    events = consume(kafka_bootstrap, config.topics.telemetry, done=complete, timeout=30)
    return results, events, tmp


def test_every_step_event_arrives_contract_valid(slow_rank_job):
    results, events, _ = slow_rank_job
    assert not [e for e in events if isinstance(e, Exception)], "invalid events on the topic"
    steps = by_type(events, "step")
    seen = Counter((e.rank, e.step) for e in steps)
    assert set(seen) == {(r, s) for r in range(NPROC) for s in range(STEPS)}
    assert set(seen.values()) == {1}
    for e in steps:
        assert e.job == "tg-slow" and e.node
        assert e.step_time > 0 and 0 <= e.compute_time <= e.step_time
        assert e.loss is not None and e.grad_norm is not None and e.tokens == 16
        assert e.lr == pytest.approx(0.01)
        assert e.extra["_key"] == f"tg-slow/{e.rank}".encode()
    for rank, result in results.items():
        assert result["steps"] == STEPS and result["dropped"] == 0


def test_heartbeats_show_the_phases(slow_rank_job):
    _, events, _ = slow_rank_job
    beats = by_type(events, "heartbeat")
    phases = defaultdict(set)
    for beat in beats:
        phases[beat.rank].add(beat.phase)
        assert beat.dropped == 0 and beat.pid > 0 and beat.phase_since <= beat.ts
    assert set(phases) == set(range(NPROC))
    every_phase = set().union(*phases.values())
    assert "init" in every_phase
    assert every_phase & {"forward", "backward", "optimizer", "data"}, every_phase
    assert all(phases[r] & {"forward", "backward", "optimizer", "data", "step", "idle"}
               for r in range(NPROC)), phases


def test_lifecycle_start_and_exit(slow_rank_job):
    results, events, _ = slow_rank_job
    life = by_type(events, "lifecycle")
    starts = {e.rank: e for e in life if e.event == "start"}
    exits = {e.rank: e for e in life if e.event == "exit"}
    assert set(starts) == set(exits) == set(range(NPROC))
    for rank, start in starts.items():
        assert start.pid == results[rank]["pid"]
        assert start.world_size == NPROC and start.local_rank == rank
        assert start.topology == {"tp": 1, "pp": 1, "dp": NPROC}
        assert start.argv and start.argv[0].endswith("instrumented_job.py")
        assert exits[rank].exit_code == 0 and exits[rank].signal is None


def test_compute_time_finds_the_rank_with_the_slow_forward_pass(slow_rank_job):
    _, events, _ = slow_rank_job
    compute, wall = defaultdict(list), defaultdict(list)
    for e in by_type(events, "step"):
        if e.step >= 3:  # the first steps include DDP's bucket rebuild
            compute[e.rank].append(e.compute_time)
            wall[e.rank].append(e.step_time)
    median_compute = {r: statistics.median(v) for r, v in compute.items()}
    median_wall = {r: statistics.median(v) for r, v in wall.items()}
    others = statistics.median(v for r, v in median_compute.items() if r != SLOW_RANK)
    ratio = median_compute[SLOW_RANK] / others
    print(f"compute_time medians {median_compute}, step_time medians {median_wall}, "
          f"ratio {ratio:.2f}")
    assert ratio >= 1.3, median_compute
    assert max(median_wall.values()) <= 1.10 * min(median_wall.values()), median_wall


def test_closed_port_job_finishes_and_drops(tmp_path):
    home = tmp_path / "home"
    code, out = torchrun(NPROC, ["--job", "tg-closed", "--steps", "30", "--baseline-steps", "30",
                                 "--heartbeat", "0.2", "--out", str(tmp_path / "out")],
                         job_env(f"127.0.0.1:{closed_port()}", "tclosed", home))
    assert code == 0, out[-3000:]
    results = rank_results(tmp_path / "out", NPROC)
    for rank, result in results.items():
        base = statistics.median(result["baseline_step_times"])
        inst = statistics.median(result["step_times"])
        print(f"rank {rank}: uninstrumented {base * 1e3:.2f} ms, instrumented "
              f"{inst * 1e3:.2f} ms per step ({(inst / base - 1) * 100:+.1f}%), close "
              f"{result['close_seconds']:.2f} s, dropped {result['dropped']}")
        assert result["steps"] == 30
        assert result["close_seconds"] < 10
        assert result["dropped"] > result["dropped_before_close"] >= 0
        assert result["dropped"] >= 30
    assert not list((home / "run" / "ranks" / "tg-closed").glob("*.json"))
