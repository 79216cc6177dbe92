"""The data-position check (detectors/data_position.py) through the Engine: a resume that
repeats or skips data is an incident of its own; a resume that is exact is not."""
from __future__ import annotations

from test_detectors_contract import _LostPosition

from trainguard import events as ev
from trainguard.detectors import Engine


def run(events):
    engine = Engine()
    out = []
    for e in events:
        out += engine.update(e)
    out += engine.advance(max(e.ts for e in events) + 1, force=True)
    return [a for a in out if a.kind == "data_position"], engine


def test_a_lost_data_position_after_a_restart_is_an_incident():
    found, engine = run(_LostPosition().events())
    [a] = found
    assert (a.ranks, a.step, a.severity) == ([1], 20, "warning")
    assert a.evidence == {"samples": 8, "expected": 168, "off_by": -160}
    assert "160 samples trained twice" in a.summary
    assert any(i["kind"] == "data_position" for i in engine.incidents())


def test_an_exact_resume_and_a_job_without_samples_raise_nothing():
    def steps(with_samples):
        out, ts = [], 0.0
        for step in list(range(30)) + list(range(20, 30)):  # resumed at its checkpoint 20
            ts += 1.0
            extra = {"samples": (step + 1) * 8} if with_samples else {}
            out.append(ev.Step(job="j1", ts=ts, node="n1", rank=0, step=step, step_time=1.0,
                               loss=2.0, extra=extra))
        return out
    assert run(steps(True))[0] == [] and run(steps(False))[0] == []


def test_a_resume_past_the_last_step_seen_must_follow_on():
    base = [ev.Step(job="j1", ts=float(s), node="n1", rank=0, step=s, step_time=1.0, loss=2.0,
                    extra={"samples": (s + 1) * 8}) for s in range(10)]
    start = ev.Lifecycle(job="j1", ts=20.0, node="n1", rank=0, event="start", pid=2,
                         world_size=1)
    skipped = ev.Step(job="j1", ts=21.0, node="n1", rank=0, step=10, step_time=1.0, loss=2.0,
                      extra={"samples": 200})
    [a] = run([*base, start, skipped])[0]
    assert a.evidence["expected"] == 88 and "112 samples skipped" in a.summary
