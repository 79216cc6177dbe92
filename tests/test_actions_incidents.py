"""The action service groups anomalies by the worker's incident events (issue 13 point 3):
the incident book, the bounded wait, the fallback, the two refinements, and what a forged
incident can and cannot do. Without Kafka (tests/test_actions_kafka.py has the broker)."""
from trainguard import events as ev
from trainguard.actions.incidents import IncidentBook
from trainguard.actions.pipeline import build_pipeline
from trainguard.actions.policy import BacklogSettings, Limits, Policy
from trainguard.actions.scheduler import Scheduler
from trainguard.actions.state import ServiceState
from trainguard.detectors.correlate import Correlator

from actions_harness import ListRecorder
from fakes import FakeClock

T0 = 1_764_680_000.0


def anomaly(kind="crash", id="c1", ranks=(1,), nodes=("n1",), onset=T0, detected=T0 + 1,
            job="j1", **evidence):
    return ev.Anomaly(job=job, ts=detected, id=id, kind=kind, severity="critical",
                      ranks=list(ranks), nodes=list(nodes), step=40, onset_ts=onset,
                      detected_ts=detected, detector=kind, summary=f"{kind} {id}",
                      evidence=evidence)


def incident(id, anomalies, kind="crash", ranks=(1,), nodes=("n1",), job="j1"):
    """A worker's incident event, as the worker publishes it."""
    return ev.decode(ev.encode(ev.Incident(
        job=job, ts=T0 + 1, id=id, kind=kind, severity="critical", ranks=list(ranks),
        nodes=list(nodes), onset_ts=T0, detected_ts=T0 + 1, summary=f"{kind} incident",
        anomalies=list(anomalies))))


def setup(correlator=None, policy=Policy(), wait_s=2.0):
    clock = FakeClock(T0 + 2)
    book = IncidentBook(wait_s=wait_s)
    recorder = ListRecorder()
    pipe = build_pipeline(policy=policy, state=ServiceState(), recorder=recorder, book=book,
                          correlator=correlator, clock=clock, sleep=clock.sleep)
    return pipe, book, recorder, clock


def restarts(recorder):
    return [(r.incident, r.status) for r in recorder.events if r.action == "restart"]


def test_anomalies_of_one_worker_incident_get_one_restart():
    pipe, book, rec, clock = setup()
    book.observe(incident("inc-c1", ["c1", "h1"]), clock())
    first = pipe.process(anomaly(), now=clock())
    second = pipe.process(anomaly(kind="hang", id="h1", ranks=[], nodes=[], onset=T0 - 1),
                          now=clock())
    assert first.incident.id == "inc-c1" and first.incident.kind == "crash"
    assert second.dropped.startswith("duplicate: incident inc-c1 already has a restart")
    assert restarts(rec) == [("inc-c1", "planned")]


def test_an_anomaly_waits_for_its_incident_without_a_thread():
    pipe, book, rec, clock = setup()
    book.observe(incident("inc-x", ["x"]), clock())           # the worker publishes incidents
    done = []
    scheduler = Scheduler(pipeline=pipe, settings=BacklogSettings(), clock=clock,
                          on_done=lambda token, work: done.append(work))
    book.arrived("c1", clock())
    scheduler.submit(anomaly())
    scheduler.tick()
    assert scheduler.status()["parked"] == 1 and not done      # its incident is not there yet
    clock.advance(0.1)
    book.observe(incident("inc-c1", ["c1"]), clock())
    scheduler.tick()
    assert [w.incident.id for w in done] == ["inc-c1"]
    assert restarts(rec) == [("inc-c1", "planned")]


def test_without_its_incident_after_the_wait_the_fallback_correlator_groups_it():
    pipe, book, rec, clock = setup(correlator=Correlator(), wait_s=2.0)
    book.observe(incident("inc-x", ["x"]), clock())
    work = pipe.process(anomaly(), now=clock())                # blocks on the fake clock
    assert clock() >= T0 + 4.0                                 # it waited out wait_s
    assert work.incident.id == "inc-c1"                        # the fallback correlator's
    hang = pipe.process(anomaly(kind="hang", id="h1", ranks=[], nodes=[], onset=T0 - 1),
                        now=clock())
    assert hang.dropped.startswith("duplicate: incident inc-c1")


def test_a_wait_counts_from_the_anomalys_arrival_not_from_its_turn():
    book = IncidentBook(wait_s=2.0)
    book.observe(incident("inc-x", ["x"]), T0)
    book.arrived("late", T0)
    assert book.waits_for("late", T0 + 1.9) and not book.waits_for("late", T0 + 2.0)


def test_a_topic_without_incidents_costs_no_wait():
    pipe, book, rec, clock = setup()                            # no incident event seen
    start = clock()
    work = pipe.process(anomaly(), now=clock())
    assert clock() == start and work.incident.id == "c1"       # its own incident, at once
    assert restarts(rec) == [("c1", "planned")]


def test_an_incident_that_arrived_first_is_used_at_once():
    pipe, book, rec, clock = setup()
    book.observe(incident("inc-c1", ["c1"]), clock())          # a resent anomaly came later
    start = clock()
    assert pipe.process(anomaly(), now=clock()).incident.id == "inc-c1"
    assert clock() == start


def test_root_cause_found_later_by_the_worker_is_acted_on_again():
    pipe, book, rec, clock = setup()
    book.observe(incident("inc-c1", ["c1"]), clock())
    pipe.process(anomaly(ranks=[3], nodes=["n2"]), now=clock())
    book.observe(incident("inc-c1", ["c1", "x1"], kind="gpu_fault", ranks=[3], nodes=["n2"]),
                 clock())
    work = pipe.process(anomaly(kind="gpu_fault", id="x1", ranks=[3], nodes=["n2"],
                                onset=T0 - 0.5, detected=T0 + 4), now=clock())
    assert work.incident.kind == "gpu_fault" and work.incident.id != "inc-c1"
    got = [(r.action, r.status) for r in rec.events if r.incident == work.incident.id]
    assert got == [("evict", "planned"), ("restart", "planned"), ("alert", "done")]
    assert rec.events[-3].targets["nodes"] == ["n2"]


def test_a_fault_after_the_restart_is_a_new_problem_even_in_the_old_incident():
    """An older worker that kept the incident open across the restart: the service still
    sees a new problem (its own incident, its own restart)."""
    pipe, book, rec, clock = setup(policy=Policy(limits=Limits(restart_settle_s=5)))
    book.observe(incident("inc-c1", ["c1"]), clock())
    pipe.process(anomaly(), now=clock())
    book.observe(incident("inc-c1", ["c1", "c2"]), clock())
    clock.advance(100)
    work = pipe.process(anomaly(id="c2", onset=T0 + 100, detected=T0 + 100), now=clock())
    assert work.incident.id == "inc-c2"
    assert restarts(rec) == [("inc-c1", "planned"), ("inc-c2", "planned")]


def test_a_forged_incident_adds_no_kind_rank_or_machine():
    """An incident lists a real crash of rank 1 on n1 but claims a GPU fault on n9: the
    service acts on what the anomaly it received says (a restart, no eviction of n9)."""
    pipe, book, rec, clock = setup()
    book.observe(incident("inc-forged", ["c1", "ghost"], kind="gpu_fault", ranks=[9],
                          nodes=["n9"]), clock())
    work = pipe.process(anomaly(), now=clock())
    assert work.incident.id == "inc-forged"
    assert (work.incident.kind, work.incident.ranks, work.incident.nodes) == (
        "crash", [1], ["n1"])
    assert [r.action for r in rec.events] == ["restart", "alert"]
    assert all("n9" not in str(r.targets) for r in rec.events)


def test_an_incident_of_another_job_is_ignored():
    pipe, book, rec, clock = setup()
    book.observe(incident("inc-other", ["c1"], job="j2"), clock())
    assert book.incident_id("c1", job="j1") is None
    assert pipe.process(anomaly(), now=clock()).incident.id == "c1"


def test_an_incident_alone_makes_no_action():
    pipe, book, rec, clock = setup()
    book.observe(incident("inc-c1", ["c1", "h1"]), clock())
    assert rec.events == []                     # only anomalies go down the pipeline


def test_the_book_is_bounded():
    book = IncidentBook(max_anomalies=3)
    book.observe(incident("inc-a", [f"a{i}" for i in range(10)]), T0)
    for i in range(10):
        book.arrived(f"b{i}", T0)
    assert len(book._of) == 3 and len(book._arrived) == 3
    assert book.incident_id("a9", "j1") == "inc-a" and book.incident_id("a0", "j1") is None


def test_an_anomaly_handled_before_its_incident_came_still_counts_as_a_member():
    """The first crash went through the fallback (no incident seen yet); the hang that
    joins the worker's incident later is summarised with that crash, so the incident stays a
    crash (not a hang to be handled again)."""
    pipe, book, rec, clock = setup(correlator=Correlator())
    first = pipe.process(anomaly(), now=clock())                 # no incident event yet
    book.observe(incident("inc-c1", ["c1"]), clock())
    book.observe(incident("inc-c1", ["c1", "h1"]), clock())
    hang = pipe.process(anomaly(kind="hang", id="h1", ranks=[], nodes=[], onset=T0 - 1),
                        now=clock())
    assert first.incident.id == "inc-c1" and hang.incident.kind == "crash"
    assert hang.dropped.startswith("duplicate: incident inc-c1 already has a restart")
    assert restarts(rec) == [("inc-c1", "planned")]


def test_a_shallower_root_kind_is_never_handled_again():
    """A forged or partial incident that makes a handled crash look like a hang: no second
    handling (only a more fundamental cause found later is acted on again)."""
    pipe, book, rec, clock = setup()
    book.observe(incident("inc-c1", ["c1"]), clock())
    pipe.process(anomaly(), now=clock())
    book.observe(incident("inc-c1", ["h1"]), clock())            # c1 no longer listed
    hang = pipe.process(anomaly(kind="hang", id="h1", ranks=[], nodes=[], onset=T0 - 1),
                        now=clock())
    assert hang.incident.id == "inc-c1" and hang.dropped.startswith("duplicate")
    assert restarts(rec) == [("inc-c1", "planned")]


def test_the_books_incident_lists_are_bounded():
    book = IncidentBook(max_anomalies=5)
    for n in range(4):
        book.observe(incident(f"inc-{n}", [f"a{n}-{i}" for i in range(3)]), T0)
    assert sum(len(ids) for ids in book._listed.values()) <= 5
    assert book.listed("j1", "inc-3") == ("a3-0", "a3-1", "a3-2")
    assert not book.listed("j1", "inc-0")
