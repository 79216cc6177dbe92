"""Issue 21 point 1 (step 2 of docs/WORKER.md's plan, its third item): the silent detector judged
from each partition's summary at a look (its k longest-unheard ranks, detectors/live_ticks.py)
reports what it reports from every rank, asking a partition for its ranks only when more of
them may be going quiet than its summary holds."""
from __future__ import annotations

import pytest

from trainguard.detectors.live_ticks import SilentTicks
from trainguard.detectors.liveness import SilentDetector

from test_live_parts import _findings, _job


@pytest.mark.parametrize("seed", range(40))
def test_the_silent_detector_from_summaries_reports_what_it_does_from_every_rank(seed):
    timeout, items = _job(seed)
    want = _findings(SilentDetector(timeout_s=timeout), items)
    for partitions, k in ((2, 1), (3, 2), (5, 8)):
        assert _findings(SilentTicks(partitions, k, timeout_s=timeout), items) == want


def test_summaries_suffice_unless_a_partition_has_more_quiet_ranks_than_k():
    asked = {}
    for k in (1, 8):
        for seed in range(40):
            timeout, items = _job(seed)
            ticks = SilentTicks(2, k, timeout_s=timeout)
            _findings(ticks, items)
            asked[k] = asked.get(k, 0) + ticks.asked
    assert asked[1] > 0 and asked[8] < asked[1]


def test_a_summary_detector_clones_with_its_partitions_k_and_settings():
    from trainguard.detectors.live_ticks import HangTicks

    twin = SilentTicks(4, 3, timeout_s=7.0).clone()
    assert (type(twin), twin.partitions, twin.k, twin.timeout_s) == (SilentTicks, 4, 3, 7.0)
    twin = HangTicks(4, 3, floor_s=7.0).clone()
    assert (type(twin), twin.partitions, twin.k, twin.floor_s) == (HangTicks, 4, 3, 7.0)


@pytest.mark.parametrize("seed", range(60))
def test_the_hang_detector_from_summaries_reports_what_it_does_from_every_rank(seed):
    from test_rank_books import _findings as findings, _hang_job

    from trainguard.detectors.live_ticks import HangTicks
    from trainguard.detectors.liveness import HangDetector

    settings, items = _hang_job(seed)
    want = findings(HangDetector(**settings), items)
    for partitions, k in ((2, 1), (3, 2), (5, 8)):
        assert findings(HangTicks(partitions, k, **settings), items) == want


def test_a_rank_named_by_text_tied_with_a_number_raises_nothing_in_a_summary():
    """A review found the summaries comparing ranks of equal stamps (a text rank, which
    the detectors take, beside a number raised TypeError)."""
    from trainguard.detectors.live_ticks import HangTicks
    from trainguard.detectors.liveness import HangDetector

    items = [{"k": "step", "rank": 0, "ts": 0.0, "step": 0}] + [
        {"k": "hb", "rank": r, "ts": 5.0, "step": 0, "phase": "checkpoint",
         "phase_since": 4.0} for r in (0, "1")]
    found = []
    for d in (HangDetector(), HangTicks(1, 8), SilentTicks(1, 1, timeout_s=1.0)):
        for item in items:
            d.update(dict(item))
        found.append(d.advance(6.0))
    assert found == [[], [], []]
