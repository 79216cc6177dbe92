"""The control channel's pure parts: signatures, freshness and replay checks, target checks,
the order desk of the action service (orders out, acks in), without Kafka."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainguard import events as ev
from trainguard.actions.order_desk import OrderDesk
from trainguard.actions.orders import InvalidTarget, ack_of, check_targets, outcome_status
from trainguard.actions.pipeline import build_pipeline
from trainguard.actions.policy import Decision, Incident, Policy
from trainguard.actions.state import ServiceState
from trainguard.config import Topics
from trainguard.signing import (Freshness, SigningError, SigningKeys, Verifier, canonical,
                                sign, signing_key_from_env)

from actions_harness import ListRecorder

T0 = 1_764_680_000.0
KEYS = SigningKeys.parse("orders-unit-test-key-0123456789")


def order(**changes):
    fields = dict(job="j1", ts=T0, order_id="o-1", op="restart", incident="inc-1",
                  targets={"exclude_nodes": ["n1"], "onset_ts": T0 - 5})
    fields.update(changes)
    return ev.Order(**fields)


def incident(**changes):
    fields = dict(id="inc-a1", job="j1", kind="gpu_fault", severity="critical", ranks=[1],
                  nodes=["gpu-07"], onset_ts=T0 - 5, detected_ts=T0 - 4, summary="Xid 79")
    fields.update(changes)
    return Incident(**fields)


def test_the_orders_topic_is_in_the_topic_plan():
    assert "tg.orders" in Topics().all() and Topics(prefix="p").orders == "p.orders"


# -- keys and signatures -------------------------------------------------------------------
def test_the_key_is_read_from_one_variable_and_may_hold_previous_keys():
    assert signing_key_from_env({}) is None and signing_key_from_env({
        "TRAINGUARD_SIGNING_KEY": " "}) is None
    keys = signing_key_from_env({"TRAINGUARD_SIGNING_KEY": "new-key-0123456789,old-key-0123456789"})
    assert len(keys.keys) == 2 and "new-key" not in repr(keys)
    with pytest.raises(SigningError, match="at least 16 characters"):
        SigningKeys.parse("short")


def test_an_order_signed_with_the_previous_key_still_verifies():
    old = SigningKeys.parse("old-key-0123456789abcdef")
    rotated = SigningKeys.parse("new-key-0123456789abcdef,old-key-0123456789abcdef")
    assert Verifier(rotated, clock=lambda: T0).check(ev.encode(sign(order(), old)), "o") is None
    assert Verifier(old, clock=lambda: T0).check(
        ev.encode(sign(order(), rotated)), "o").code == "unknown_key"


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8),
                       st.one_of(st.integers(), st.floats(allow_nan=True), st.text(),
                                 st.lists(st.text(max_size=5), max_size=3)), max_size=5),
       st.floats(min_value=0, max_value=4e9, allow_nan=False))
def test_a_signature_survives_the_wire_and_any_change_breaks_it(targets, ts):
    signed = sign(order(targets=targets, ts=ts, extra={"custom": "é"}), KEYS)
    wire = ev.encode(signed)
    assert Verifier(KEYS, clock=lambda: ts).check(wire, "o") is None
    obj = json.loads(wire)
    obj["targets"] = {**obj["targets"], "exclude_nodes": ["evil"]}
    assert Verifier(KEYS, clock=lambda: ts).check(json.dumps(obj), "o2").code == "bad_signature"


def test_canonical_form_ignores_key_order_and_spacing():
    a = json.loads('{"b": 1, "a": {"y": 2.5, "x": "NaN"}, "sig": "00"}')
    b = json.loads('{"a":{"x":"NaN","y":2.5},"b":1}')
    assert canonical(a) == canonical(b) == b'{"a":{"x":"NaN","y":2.5},"b":1}'


def test_freshness_and_replay():
    now = {"t": T0}
    v = Verifier(None, freshness=Freshness(max_age_s=60, max_skew_s=10), clock=lambda: now["t"])
    assert v.check(ev.encode(order(ts=T0 - 61)), "a").code == "stale"
    assert v.check(ev.encode(order(ts=T0 + 11)), "b").code == "future"
    assert v.check(ev.encode(order(ts=T0 + 9)), "c") is None
    assert v.check(ev.encode(order(ts=T0)), "c").code == "replayed"
    assert v.check(b"\xff", "d").code == "malformed" and v.check(b"[1]", "d").code == "malformed"
    assert v.check(ev.encode(order(ts=T0)), "a") is None  # refused ids are not remembered
    now["t"] = T0 + 1000  # ids older than the window are forgotten: they would be stale
    v.check(ev.encode(order(ts=now["t"])), "e")
    assert list(v._seen) == ["e"]


def test_replay_memory_is_bounded():
    v = Verifier(None, remember=100, clock=lambda: T0)
    for i in range(1000):
        assert v.check(ev.encode(order(ts=T0)), f"id-{i}") is None
    assert len(v._seen) == 100


def test_with_a_key_unsigned_and_half_signed_messages_are_refused():
    v = Verifier(KEYS, clock=lambda: T0)
    assert v.check(ev.encode(order()), "a").code == "unsigned"
    half = ev.to_dict(sign(order(), KEYS))
    del half["key_id"]
    assert v.check(json.dumps(half), "b").code == "malformed"


# -- targets -------------------------------------------------------------------------------
@pytest.mark.parametrize("op, targets, words", [
    ("evict", {"nodes": ["n1;reboot"]}, "nodes[0]"),
    ("evict", {"nodes": "n1"}, "expected a list"),
    ("restart", {"exclude_nodes": ["-n1"]}, "exclude_nodes[0]"),
    ("restart", {"exclude_nodes": ["x" * 254]}, "exclude_nodes[0]"),
    ("restart", {"exclude_nodes": [f"n{i}" for i in range(513)]}, "more than 512"),
    ("restart", {"onset_ts": "yesterday"}, "onset_ts"),
    ("rollback", {"rollback_step": -1}, "below the minimum 0"),
    ("rollback", {"rollback_step": True}, "expected an integer"),
    ("restart", [], "expected an object"),
])
def test_hostile_targets_are_refused(op, targets, words):
    with pytest.raises(InvalidTarget) as info:
        check_targets(op, targets)
    assert words in str(info.value)


def test_targets_keep_only_what_the_op_uses():
    assert check_targets("evict", {"nodes": ["a", "a", "b"], "rollback_step": 3,
                                   "cmd": "rm -rf /"}) == {"nodes": ["a", "b"],
                                                           "exclude_nodes": ["a", "b"]}
    assert check_targets("stop", {"nodes": ["a"]}) == {}


# -- the order desk ------------------------------------------------------------------------
def desk_with(now=T0, **kw):
    sent, audit = [], ListRecorder()
    clock = {"t": now}
    desk = OrderDesk(send=sent.append, recorder=audit, clock=lambda: clock["t"], **kw)
    return desk, sent, audit, clock


def test_the_pipeline_sends_signed_orders_after_recording_their_decisions():
    recorder, sent = ListRecorder(), []

    def send(order):  # the planned record is on the audit log before its order leaves
        assert [r for r in recorder.events if r.extra.get("order_id") == order.order_id]
        sent.append(order)

    desk = OrderDesk(send=send, recorder=ListRecorder(), keys=KEYS, clock=lambda: T0)
    pipe = build_pipeline(policy=Policy(), state=ServiceState(), recorder=recorder, orders=desk)
    anomaly = ev.Anomaly(job="j1", ts=T0, id="x1", kind="gpu_fault", severity="critical",
                         ranks=[1], nodes=["gpu-07"], onset_ts=T0 - 5, detected_ts=T0 - 4,
                         detector="gpu", summary="Xid 79 on gpu-07")
    pipe.process(anomaly, now=T0)
    assert [(o.op, o.targets.get("nodes")) for o in sent] == [("evict", ["gpu-07"]),
                                                              ("restart", None)]
    assert all(Verifier(KEYS, clock=lambda: T0).check(ev.encode(o), o.order_id) is None
               for o in sent)
    planned = {r.action: r for r in recorder.events if r.status == "planned"}
    assert planned["evict"].extra["order_id"] == sent[0].order_id
    assert planned["restart"].extra["order_id"] == sent[1].order_id
    assert planned["evict"].extra["code"] == "evict"


def test_an_order_with_an_invalid_target_is_not_sent():
    desk, sent, _, _ = desk_with()
    d = desk.prepare(Decision(action="evict", reason="x", targets={"nodes": ["$(reboot)"]}),
                     incident())
    assert desk.dispatch([d]) == 0
    assert (d.status, d.code, sent) == ("failed", "invalid_target", [])


def test_unanswered_orders_are_recorded_failed_once():
    desk, sent, audit, clock = desk_with(ack_timeout_s=60)
    desk.dispatch([desk.prepare(Decision(action="restart", reason="x", targets={}),
                                incident())])
    clock["t"] += 30
    assert desk.expire() == 0
    clock["t"] += 31
    assert desk.expire() == 1 and desk.expire() == 0
    [record] = audit.events
    assert (record.status, record.extra["code"], record.extra["order_id"]) == (
        "failed", "no_ack", sent[0].order_id)
    late = ack_of(sent[0], "done", "relaunched", "late", ts=clock["t"])
    assert desk.receive(late, ev.encode(late)) == ("duplicate", None)


def test_acks_of_unknown_orders_and_forged_acks_are_not_filed():
    desk, sent, audit, _ = desk_with(keys=KEYS)
    desk.dispatch([desk.prepare(Decision(action="restart", reason="x", targets={}),
                                incident())])
    stranger = ack_of(order(order_id="o-unknown"), "done", "relaunched", "?", ts=T0)
    assert desk.receive(stranger, ev.encode(stranger)) == ("unknown", None)
    forged = ack_of(sent[0], "already_satisfied", "relaunched_since_onset", "!", ts=T0)
    outcome, refusal = desk.receive(forged, ev.encode(forged))
    assert outcome == "refused" and refusal.code == "unsigned" and not audit.events
    good = sign(ack_of(sent[0], "failed", "launch_failed", "exec failed", ts=T0), KEYS)
    assert desk.receive(good, ev.encode(good)) == ("filed", None)
    assert [(a.status, a.extra["ack_status"]) for a in audit.events] == [("failed", "failed")]


def test_an_earlier_runs_orders_are_filed_once_after_a_restart_of_the_service():
    desk, sent, audit, _ = desk_with()
    planned = ev.Action(job="j1", ts=T0, incident="inc-a1", action="restart", targets={},
                        status="planned", reason="x",
                        extra={"source": "actions", "order_id": "o-old"})
    answered = planned.replace(status="done", extra={"source": "actions",
                                                     "order_id": "o-answered",
                                                     "ack_status": "done"})
    for record in (planned, answered.replace(status="planned", extra={
            "source": "actions", "order_id": "o-answered"}), answered):
        desk.seed(record)
    ack = ack_of(order(order_id="o-old", incident="inc-a1"), "done", "relaunched", "ok", ts=T0)
    assert desk.receive(ack, ev.encode(ack)) == ("filed", None)
    again = ack.replace(order_id="o-answered")
    assert desk.receive(again, ev.encode(again)) == ("duplicate", None)


@pytest.mark.parametrize("status, code, recorded", [
    ("done", "relaunched", "done"), ("already_satisfied", "already_excluded", "done"),
    ("failed", "budget_exhausted", "rate_limited"), ("failed", "launch_failed", "failed"),
    ("rejected", "bad_signature", "failed"), ("not_applicable", "unsupported_op", "failed")])
def test_outcome_statuses(status, code, recorded):
    assert outcome_status(ack_of(order(), status, code, "r", ts=T0)) == recorded


def test_up_generates_a_key_for_its_services_unless_one_is_set(tmp_path, monkeypatch):
    import os
    import stat

    from trainguard.up import own_signing_key

    monkeypatch.delenv("TRAINGUARD_SIGNING_KEY", raising=False)
    env, path = own_signing_key(tmp_path / "up")
    assert path.read_text().strip() == env["TRAINGUARD_SIGNING_KEY"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert SigningKeys.parse(env["TRAINGUARD_SIGNING_KEY"])  # long enough
    monkeypatch.setenv("TRAINGUARD_SIGNING_KEY", "the-operators-own-key-0123")
    assert own_signing_key(tmp_path / "other") == ({}, None)


def test_audit_records_are_signed_in_their_extra_fields():
    record = ev.Action(job="j1", ts=T0, incident="inc-1", action="restart", targets={"job": "j1"},
                       status="planned", reason="crash", extra={"order_id": "o-1"})
    signed = sign(record, KEYS)
    assert signed.extra["key_id"] == KEYS.key_id and len(signed.extra["sig"]) == 64
    v = Verifier(KEYS)
    assert v.check_signature(ev.encode(signed)) is None
    assert v.check_signature(ev.encode(record)).code == "unsigned"
    assert v.check_signature(ev.encode(signed.replace(status="done"))).code == "bad_signature"
    assert sign(signed, KEYS) == signed  # signing again gives the same record


def test_every_event_type_has_a_topic_to_be_replayed_to():
    from trainguard.streams.recorder import topic_for

    from events_factory import examples

    topics = Topics(prefix="tg")
    assert {topic_for(e, topics) for e in examples() if e.type in ("order", "ack")} == {
        "tg.orders"}
    assert all(topic_for(e, topics) for e in examples())
