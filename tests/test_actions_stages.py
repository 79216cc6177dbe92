"""Stages over interfaces (issue 22): every stage declares what it reads and writes and keeps
to it; the incident has one in-process type; orders carry typed targets per operation with
the wire JSON of before; the list of actions exists once."""
import inspect
import json

import pytest

import test_actions_confirm
import test_actions_incidents
import test_actions_pipeline
from trainguard import events as ev
from trainguard.actions import interfaces, model, orders, policy
from trainguard.actions.capture import JobDirectory
from trainguard.actions.confirm import JobProgress
from trainguard.actions.incidents import IncidentBook
from trainguard.actions.interfaces import (LEDGER_INTERFACES, WORK_INTERFACES, Stage, Work,
                                           WorkView, members)
from trainguard.actions.model import ACTIONS, JOB_ACTIONS, Decision, Incident
from trainguard.actions.order_desk import OrderDesk
from trainguard.actions.orders import (EvictTargets, InvalidTarget, RestartTargets,
                                       RollbackTargets, StopTargets, check_targets, order_of,
                                       targets_of)
from trainguard.actions.pipeline import Pipeline, build_pipeline
from trainguard.actions.policy import Policy
from trainguard.actions.state import ServiceState
from trainguard.detectors.correlate import Correlator, summarize

from actions_harness import ListRecorder

T0 = 1_764_680_000.0


def full_pipeline():
    desk = OrderDesk(send=lambda order: None, recorder=ListRecorder(), clock=lambda: T0)
    return build_pipeline(policy=Policy(), state=ServiceState(), recorder=ListRecorder(),
                          capturer=object(), directory=JobDirectory(), notify=lambda m: [],
                          correlator=Correlator(), orders=desk, progress=JobProgress(),
                          book=IncidentBook(), clock=lambda: T0)


# ---------------------------------------------------------------------------- declarations
def test_every_stage_is_a_stage_and_declares_what_it_reads_and_writes():
    chain = full_pipeline().stages
    assert [s.name for s in chain] == ["await_incident", "correlate", "dedup", "confirm",
                                       "investigate", "confirm", "decide", "limit", "act",
                                       "record", "dispatch", "notify"]
    known = set(WORK_INTERFACES) | set(LEDGER_INTERFACES)
    for stage in chain:
        assert isinstance(stage, Stage), stage.name
        for declared in ("reads", "writes", "exclusive", "name"):
            assert declared in vars(type(stage)), f"{stage.name} does not declare {declared}"
        assert type(stage.reads) is tuple and type(stage.writes) is tuple
        assert set(stage.reads) | set(stage.writes) <= known, stage.name
        assert not set(stage.reads) & set(stage.writes), f"{stage.name}: a write reads too"
    # what flows: the incident is set by correlate alone, before anyone reads it
    setters = [s.name for s in chain if interfaces.IncidentSlot in s.writes]
    assert setters == ["correlate"]
    described = full_pipeline().describe().splitlines()
    assert described[2] == ("dedup            reads AnomalyIn, IncidentSlot, SeenAnomalies, "
                            "IncidentHistory; writes Verdict, LedgerWrites")
    assert [line.split()[0] for line in described] == [
        s.name + ("" if s.exclusive else "*") for s in chain]


def test_the_ledger_and_the_work_implement_every_interface():
    work = Work(anomaly=test_actions_pipeline.anomaly(), now=T0)
    for interface in WORK_INTERFACES:
        assert isinstance(work, interface), interface.__name__
    for interface in LEDGER_INTERFACES:
        assert isinstance(ServiceState(), interface), interface.__name__


def test_a_stage_sees_only_the_ledger_it_declared():
    for stage in full_pipeline().stages:
        view = getattr(stage, "state", None)
        if view is None:
            continue
        declared = [i for i in (*stage.reads, *stage.writes) if i in LEDGER_INTERFACES]
        allowed = {name for i in declared for name in members(i)}
        for interface in LEDGER_INTERFACES:
            for name in members(interface):
                assert hasattr(view, name) == (name in allowed), (stage.name, name)
    dedup = full_pipeline().stages[2]
    with pytest.raises(AttributeError, match="stage 'dedup' declares no ledger interface "
                                             "with 'restarts_since'"):
        dedup.state.restarts_since("j1", 0.0)


class Checked:
    """A stage handed the work only as it declared it (:class:`WorkView`)."""

    def __init__(self, stage):
        self.stage = stage
        self.name, self.exclusive = stage.name, stage.exclusive
        self.reads, self.writes = stage.reads, stage.writes

    def __call__(self, work):
        return self.stage(WorkView(work, self.stage))


def test_a_work_view_refuses_what_was_not_declared():
    class Sneaky:
        name, exclusive, reads, writes = "sneaky", True, (interfaces.IncidentSlot,), ()

        def __call__(self, work):
            work.decisions.append("x")

    work = Work(anomaly=test_actions_pipeline.anomaly(), now=T0)
    with pytest.raises(AttributeError, match="reads 'decisions' of the work without"):
        Checked(Sneaky())(work)
    Sneaky.reads = (interfaces.DecisionList,)
    with pytest.raises(AttributeError, match="'tuple' object has no attribute 'append'"):
        Checked(Sneaky())(work)
    assert work.decisions == []


def _plain_tests(*modules):
    return list(_each_plain_test(modules))


def _each_plain_test(modules):
    for module in modules:
        for name, fn in sorted(vars(module).items()):
            if name.startswith("test_") and inspect.isfunction(fn) \
                    and set(inspect.signature(fn).parameters) <= {"tmp_path"} \
                    and not hasattr(fn, "pytestmark"):
                yield pytest.param(fn, id=f"{module.__name__}.{name}")


@pytest.mark.parametrize("case", _plain_tests(test_actions_pipeline, test_actions_confirm,
                                              test_actions_incidents))
def test_the_pipeline_tests_pass_with_every_stage_held_to_its_declarations(
        case, tmp_path, monkeypatch):
    built = Pipeline.__init__

    def checked(self, chain, on_drop=None):
        built(self, [Checked(s) for s in chain], on_drop)

    monkeypatch.setattr(Pipeline, "__init__", checked)
    case(**({"tmp_path": tmp_path} if "tmp_path" in inspect.signature(case).parameters
            else {}))


# ---------------------------------------------------------------------------- incidents
def test_an_incident_has_one_in_process_type():
    assert policy.Incident is model.Incident is Incident
    a = test_actions_pipeline.anomaly(kind="hang", id="h1", ranks=[2], nodes=["n3"])
    c = test_actions_pipeline.anomaly(kind="crash", id="c1", ranks=[1], nodes=["n1"],
                                      onset=T0 - 1)
    found = summarize("inc-c1", [c, a])
    incident = Incident.of_dict(found, a, {"c1": "crash"})
    assert incident.as_dict() == found                                # SPEC §4, unchanged
    assert incident.to_event() == ev.Incident.of(found)               # SPEC §6, unchanged
    assert ev.encode(incident.to_event(ts=T0 + 5)) == ev.encode(ev.Incident.of(found).replace(
        ts=T0 + 5))
    back = Incident.of_event(ev.decode(ev.encode(incident.to_event())))
    assert back.as_dict() == found
    assert Incident.of_anomaly(a).as_dict()["anomalies"] == ["h1"]


# ---------------------------------------------------------------------------- the actions
def test_the_list_of_actions_exists_once():
    assert ACTIONS is ev.ACTIONS
    assert JOB_ACTIONS == ("restart", "evict", "rollback")
    assert orders.JOB_OPS is JOB_ACTIONS and policy.JOB_ACTIONS is JOB_ACTIONS
    assert not hasattr(policy, "ACTIONS") or policy.ACTIONS is ev.ACTIONS
    assert set(orders.TARGETS) == set(ev.ORDER_OPS)
    with pytest.raises(ValueError, match="unknown action 'reboot'"):
        Decision(action="reboot", reason="")


# ---------------------------------------------------------------------------- typed targets
CASES = [
    ("restart", {"job": "j1", "onset_ts": 90.0, "exclude_nodes": []}),
    ("restart", {"job": "j1", "onset_ts": 1764680000.5, "exclude_nodes": ["n2", "n1", "n2"], "settled_by_ts": 5.0}),
    ("restart", {}),
    ("restart", {"onset_ts": 7, "nodes": ["zz"]}),
    ("rollback", {"rollback_step": 120, "onset_ts": 1764680000.5}),
    ("rollback", {"job": "j1", "onset_ts": 100, "exclude_nodes": ["n1"], "rollback_step": None}),
    ("rollback", {"rollback_step": 0, "onset_ts": 0}),
    ("evict", {"nodes": ["gpu-node-07", "n1.rack2"], "job": "j1"}),
    ("evict", {"job": "j1", "onset_ts": 100.0, "nodes": ["n2"], "exclude_nodes": ["n1", "n2"]}),
    ("evict", {"nodes": ["a", "a", "b"], "rollback_step": 3, "exclude_nodes": ["c"]}),
    ("evict", {}),
    ("stop", {"nodes": ["a"]}),
    ("stop", {}),
    ("restart", {"exclude_nodes": ["$(touch /tmp/x)", "--help"]}),
    ("rollback", {"rollback_step": 2**62}),
    ("rollback", {"rollback_step": True}),
    ("rollback", {"rollback_step": -1}),
    ("evict", {"nodes": "n1"}),
    ("evict", {"nodes": [1]}),
    ("evict", {"nodes": ["ok"], "exclude_nodes": ["-bad"]}),
    ("restart", {"onset_ts": -1}),
    ("restart", {"onset_ts": float("inf")}),
    ("stop", {"exclude_nodes": "x"}),
    ("restart", ["not", "a", "dict"]),
]

#: what check_targets and order_of gave for CASES before the targets were typed
EXPECTED = ['{"exclude_nodes": [], "onset_ts": 90.0}',
 '{"exclude_nodes": ["n2", "n1"], "onset_ts": 1764680000.5}',
 '{"exclude_nodes": []}',
 '{"exclude_nodes": [], "onset_ts": 7.0}',
 '{"exclude_nodes": [], "onset_ts": 1764680000.5, "rollback_step": 120}',
 '{"exclude_nodes": ["n1"], "onset_ts": 100.0, "rollback_step": null}',
 '{"exclude_nodes": [], "onset_ts": 0.0, "rollback_step": 0}',
 '{"nodes": ["gpu-node-07", "n1.rack2"], "exclude_nodes": ["gpu-node-07", "n1.rack2"]}',
 '{"nodes": ["n2"], "exclude_nodes": ["n1", "n2"]}',
 '{"nodes": ["a", "b"], "exclude_nodes": ["c", "a", "b"]}',
 '{"nodes": [], "exclude_nodes": []}',
 '{}',
 '{}',
 "InvalidTarget: exclude_nodes[0]: '$(touch /tmp/x)' is not a node name (1-253 of letters, "
 "digits, '-', '_', '.', starting with a letter or digit)",
 'InvalidTarget: rollback_step: 4611686018427387904 is above the maximum 1000000000000',
 'InvalidTarget: rollback_step: expected an integer, got True',
 'InvalidTarget: rollback_step: -1 is below the minimum 0',
 'InvalidTarget: nodes: expected a list of node names, got str',
 "InvalidTarget: nodes[0]: 1 is not a node name (1-253 of letters, digits, '-', '_', '.', "
 'starting with a letter or digit)',
 "InvalidTarget: exclude_nodes[0]: '-bad' is not a node name (1-253 of letters, digits, '-', "
 "'_', '.', starting with a letter or digit)",
 'InvalidTarget: onset_ts: -1 is not a Unix time',
 'InvalidTarget: onset_ts: inf is not a Unix time',
 'InvalidTarget: exclude_nodes: expected a list of node names, got str',
 'InvalidTarget: targets: expected an object']
ORDERS = ['{"v":1,"type":"order","job":"j1","ts":1764680001.25,"node":null,"rank":null,"order_id":"o-0123","op":"restart","targets":{"exclude_nodes":[],"onset_ts":90.0},"incident":"inc-a1"}',
 '{"v":1,"type":"order","job":"j1","ts":1764680001.25,"node":null,"rank":null,"order_id":"o-0123","op":"restart","targets":{"exclude_nodes":["n2","n1"],"onset_ts":1764680000.5},"incident":"inc-a1"}',
 '{"v":1,"type":"order","job":"j1","ts":1764680001.25,"node":null,"rank":null,"order_id":"o-0123","op":"restart","targets":{"exclude_nodes":[]},"incident":"inc-a1"}',
 '{"v":1,"type":"order","job":"j1","ts":1764680001.25,"node":null,"rank":null,"order_id":"o-0123","op":"restart","targets":{"exclude_nodes":[],"onset_ts":7.0},"incident":"inc-a1"}',
 '{"v":1,"type":"order","job":"j1","ts":1764680001.25,"node":null,"rank":null,"order_id":"o-0123","op":"rollback","targets":{"exclude_nodes":[],"onset_ts":1764680000.5,"rollback_step":120},"incident":"inc-a1"}',
 '{"v":1,"type":"order","job":"j1","ts":1764680001.25,"node":null,"rank":null,"order_id":"o-0123","op":"rollback","targets":{"exclude_nodes":["n1"],"onset_ts":100.0,"rollback_step":null},"incident":"inc-a1"}',
 '{"v":1,"type":"order","job":"j1","ts":1764680001.25,"node":null,"rank":null,"order_id":"o-0123","op":"rollback","targets":{"exclude_nodes":[],"onset_ts":0.0,"rollback_step":0},"incident":"inc-a1"}',
 '{"v":1,"type":"order","job":"j1","ts":1764680001.25,"node":null,"rank":null,"order_id":"o-0123","op":"evict","targets":{"nodes":["gpu-node-07","n1.rack2"],"exclude_nodes":["gpu-node-07","n1.rack2"]},"incident":"inc-a1"}',
 '{"v":1,"type":"order","job":"j1","ts":1764680001.25,"node":null,"rank":null,"order_id":"o-0123","op":"evict","targets":{"nodes":["n2"],"exclude_nodes":["n1","n2"]},"incident":"inc-a1"}',
 '{"v":1,"type":"order","job":"j1","ts":1764680001.25,"node":null,"rank":null,"order_id":"o-0123","op":"evict","targets":{"nodes":["a","b"],"exclude_nodes":["c","a","b"]},"incident":"inc-a1"}',
 '{"v":1,"type":"order","job":"j1","ts":1764680001.25,"node":null,"rank":null,"order_id":"o-0123","op":"evict","targets":{"nodes":[],"exclude_nodes":[]},"incident":"inc-a1"}']


@pytest.mark.parametrize("i", range(len(CASES)))
def test_typed_targets_give_the_wire_json_of_before(i):
    op, raw = CASES[i]
    try:
        typed = targets_of(op, raw)
    except InvalidTarget as exc:
        assert EXPECTED[i] == f"InvalidTarget: {exc}"
        return
    assert type(typed) is orders.TARGETS[op]
    assert json.dumps(typed.to_wire()) == EXPECTED[i] == json.dumps(check_targets(op, raw))
    assert targets_of(op, json.loads(json.dumps(typed.to_wire()))) == typed   # round trip


@pytest.mark.parametrize("i", range(len(ORDERS)))
def test_orders_encode_as_before(i):
    op, raw = CASES[i]
    incident = Incident(id="inc-a1", job="j1", kind="crash", severity="critical", ranks=[],
                        nodes=[], onset_ts=0.0, detected_ts=0.0, summary="")
    order = order_of(Decision(action=op, reason="r", targets=raw), incident,
                     ts=1764680001.25, order_id="o-0123")
    assert ev.encode(order).decode() == ORDERS[i]
    assert orders.order_targets(ev.decode(ev.encode(order))) == targets_of(op, raw)


def test_targets_are_typed_per_operation():
    assert targets_of("restart", {"exclude_nodes": ["n1"], "onset_ts": 5}) == RestartTargets(
        exclude_nodes=("n1",), onset_ts=5.0)
    assert targets_of("rollback", {"rollback_step": 3}) == RollbackTargets(rollback_step=3)
    assert targets_of("evict", {"nodes": ["n2"]}) == EvictTargets(nodes=("n2",),
                                                                  exclude_nodes=("n2",))
    assert targets_of("stop", {"nodes": ["n2"]}) == StopTargets()
