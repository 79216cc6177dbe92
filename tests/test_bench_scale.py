"""bench/run.py scale at a small size: the bench runs, and its figures hang together."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_scale  # noqa: E402


def test_a_small_job_goes_through_both_sides():
    result = bench_scale.one_size(512)
    assert result["rank_stages"] == 512 + 512 // bench_scale.PER_NODE   # ranks and machines
    assert result["events_timed"] == 2 * 512 * bench_scale.MEASURE
    assert 0 < result["rank_side_over_orjson"] < 1
    assert result["job_side_keeps_up"]
    assert result["gpu_sample_us"] > 0          # a machine's GPU sample a second, timed apart
    assert result["cores_rank_side_at_contract_rate"] >= result["cores_rank_side_ranks_events"]
    assert result["cores_for_the_job"] >= result["cores_rank_side_at_contract_rate"]


def test_the_four_faults_of_a_small_large_job_are_found_and_reported():
    result = bench_scale.faults(256)
    assert [f["kind"] for f in result["faults"]] == ["straggler", "hang", "silent", "nan"]
    assert result["all_found_exactly"] and result["false_incidents"] == []
    assert result["events"] > 0 and result["events_per_cpu_s"] > 0
