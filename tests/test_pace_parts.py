"""Issue 21 point 1 (step 4 of docs/WORKER.md's plan): the straggler's rules applied with each
partition's ranks in a book of their own and only sketches between (detectors/pace_parts.py)
name the ranks that one book names: on the whole scenario library and on random jobs."""
from __future__ import annotations

import copy

import pytest

from trainguard.detectors import straggler
from trainguard.detectors.offline import analyze_events
from trainguard.detectors.pace_parts import PaceParts
from trainguard.detectors.straggler import StragglerDetector

from scenario_library import FAULTS, HEALTHY
from scenarios import generate
from test_straggler_books import _job


def _split(monkeypatch, partitions: int, exact_upto):
    original = StragglerDetector._start

    def _start(self):
        original(self)
        self._paces = PaceParts(partitions, exact_upto=exact_upto)

    monkeypatch.setattr(StragglerDetector, "_start", _start)


def _incidents(events):
    engine, _ = analyze_events(events)
    return [(i["kind"], i["ranks"], i["nodes"], i["onset_ts"], i["detected_ts"])
            for i in engine.incidents()]


LIBRARY = [*HEALTHY, *FAULTS]


@pytest.mark.parametrize("sc", LIBRARY, ids=[sc.name for sc in LIBRARY])
def test_the_straggler_split_by_partition_gives_the_library_its_incidents(sc, monkeypatch):
    """Three partitions, each sketching its scaled times even when it has few (exact_upto=0):
    the same incidents, ranks, machines and times as one book."""
    events, _ = generate(sc)
    want = _incidents(events)
    with monkeypatch.context() as m:
        _split(m, 3, exact_upto=0)
        assert _incidents(events) == want


def _named(settings, items, paces=None):
    d = StragglerDetector(**settings)
    if paces is not None:
        d._paces = paces
    out = []
    for item in copy.deepcopy(items):
        out += [(f.ranks, f.step, f.detected_ts) for f in d.update(item)]
    return out


@pytest.mark.parametrize("seed", range(60))
def test_random_jobs_name_the_same_ranks_split_and_whole(seed, monkeypatch):
    """test_straggler_books' random jobs (slow, noisy, missing and unusable times, pipeline
    stages): split over 4 partitions with every value kept, the findings of the numpy book
    (value comparisons at the median's ties, as the split makes), step for step."""
    settings, items = _job(seed)
    monkeypatch.setattr(straggler, "ARRAYS_FROM", 0)
    whole = _named(settings, items)
    assert _named(settings, items, PaceParts(4, exact_upto=None)) == whole


@pytest.mark.parametrize("seed", range(60))
def test_random_jobs_name_the_same_ranks_split_over_arrays(seed, monkeypatch):
    """The same, each partition's book in arrays (a large partition's)."""
    settings, items = _job(seed)
    monkeypatch.setattr(straggler, "ARRAYS_FROM", 0)
    whole = _named(settings, items)
    assert _named(settings, items, PaceParts(4, exact_upto=None, arrays=True,
                                             n=settings["n"])) == whole
