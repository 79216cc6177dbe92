"""Per-job overrides at runtime, without Kafka: validation, the record's checks, applying it
to live job stages in place (trainguard/overrides.py, streams/processors.py)."""
import json

import pytest

from trainguard import events as ev
from trainguard.config import ConfigError
from trainguard.detectors import DetectorConfig, Engine, JobStage
from trainguard.setting import with_values
from trainguard.overrides import (live_keys, Accepted, OverrideBook, audit_action,
                                  check_record, check_values, make_record, parse_assignments,
                                  read_overrides_file)
from trainguard.signing import SigningKeys, Verifier

KEYS = SigningKeys.parse("0123456789abcdef0123456789abcdef")
NOW = 1764680000.0


# -- validation --------------------------------------------------------------------------

def test_assignments_are_typed_and_checked():
    assert parse_assignments(["detectors.hang.checkpoint_s=600",
                              "detectors.straggler.k=3"]) == {
        "detectors.hang.checkpoint_s": 600.0, "detectors.straggler.k": 3}


@pytest.mark.parametrize("text, words", [
    ("detectors.hang.window=10", "cannot be changed while the worker runs"),
    ("detectors.hang.nope=1", "not a setting that can be changed per job"),
    ("worker.web_port=1", "not a setting that can be changed per job"),
    ("detectors.hang.checkpoint_s=-5", "detectors.hang.checkpoint_s = -5: must be a number "
                                       "from 0.1 to 2592000"),
    ("detectors.hang.checkpoint_s=abc", "detectors.hang.checkpoint_s = abc: must be a number"),
    ("detectors.hang.checkpoint_s=inf", "must be a number from 0.1"),
    ("detectors.straggler.k=2.5", "must be an integer from 1"),
    ("detectors.straggler.k=11", "detectors.straggler.k (11) must be between 1 and "
                                 "detectors.straggler.n (10)"),
    ("detectors.straggler.ratio=0.5", "must be a number from 1.001 to 100"),
    ("no-equals-sign", "expected KEY=VALUE"),
])
def test_a_bad_setting_is_one_line_naming_key_value_and_what_is_allowed(text, words):
    with pytest.raises(ConfigError) as info:
        parse_assignments([text])
    assert words in str(info.value) and "\n" not in str(info.value)


def test_cross_checks_use_the_workers_own_configuration():
    check_values({"detectors.straggler.k": 12}, with_values(DetectorConfig(), {"straggler.n": 20}))
    with pytest.raises(ConfigError, match="detectors.straggler.k"):
        check_values({"detectors.straggler.k": 12}, DetectorConfig())
    # a silence shorter than the rank side's heartbeat summaries would page healthy ranks
    with pytest.raises(ConfigError, match="heartbeat_summary_s"):
        check_values({"detectors.silent.timeout_s": 4.0}, DetectorConfig())
    check_values({"detectors.silent.timeout_s": 4.0},
                 with_values(DetectorConfig(), {"stages.heartbeat_summary_s": 2.0}))


def test_every_live_key_is_a_detector_attribute_of_a_job_stage():
    stage = JobStage()
    for path in live_keys():
        _, name, arg = path.split(".")
        assert hasattr(stage.detectors[name], arg), path


# -- the record's checks -------------------------------------------------------------------

def record(values=None, job="j1", ts=NOW, keys=KEYS, **changes):
    obj = make_record(job=job, values=values if values is not None else
                      {"detectors.hang.checkpoint_s": 60.0}, ts=ts, override_id="o-1",
                      by="alice@login1", keys=keys)
    obj.update(changes)
    return json.dumps(obj).encode()


def check(value, key=b"j1", keys=KEYS, **kw):
    return check_record(key, value, verifier=Verifier(keys), now=NOW, **kw)


def test_a_signed_record_is_accepted():
    accepted = check(record())
    assert accepted == Accepted(job="j1", values={"detectors.hang.checkpoint_s": 60.0},
                                ts=NOW, override_id="o-1", by="alice@login1")


def test_without_a_key_an_unsigned_record_is_accepted():
    assert isinstance(check(record(keys=None), keys=None), Accepted)


@pytest.mark.parametrize("value, key, code", [
    (record(keys=None), b"j1", "unsigned"),
    (record().replace(b"60.0", b"1.0"), b"j1", "bad_signature"),
    (record(keys=SigningKeys.parse("another-key-of-16-chars")), b"j1", "unknown_key"),
    (b"{not json", b"j1", "malformed"),
    (b"[]", b"j1", "malformed"),
    (record(), b"j2", "malformed"),                       # key is not the record's job
    (record(), b"bad job id!", "malformed"),
    (record(), None, "malformed"),
    (b"x" * 20000, b"j1", "malformed"),
    (record({"detectors.hang.window": 3}), b"j1", "malformed"),
    (record({"detectors.hang.checkpoint_s": 1e12}), b"j1", "malformed"),
    (record({"detectors.hang.checkpoint_s": "60"}), b"j1", "malformed"),
    (record(ts=NOW + 3600), b"j1", "future"),
    (record(type="order"), b"j1", "bad_signature"),      # changed after signing
    (None, b"j1", "unsigned"),                            # a tombstone with a key configured
])
def test_untrusted_records_are_refused_with_a_reason(value, key, code):
    refusal = check(value, key=key)
    assert not isinstance(refusal, Accepted) and refusal.code == code, refusal
    assert refusal.reason


def test_without_a_key_the_shape_is_still_checked():
    assert check(record(keys=None, type="order"), keys=None).code == "malformed"
    assert check(record(keys=None, values={"x": 1}), keys=None).code == "malformed"


def test_a_record_older_than_the_applied_one_is_a_replay():
    assert check(record(ts=NOW - 10), latest_ts=NOW - 5).code == "replayed"
    assert isinstance(check(record(ts=NOW - 1), latest_ts=NOW - 5), Accepted)


def test_a_tombstone_reverts_when_no_key_is_configured():
    assert check(None, keys=None) == Accepted(job="j1", values={})


# -- applying -----------------------------------------------------------------------------

BASE = with_values(DetectorConfig(), {"hang.floor_s": 2.0, "hang.checkpoint_s": 3.0,
                                      "stages.advance_grid_s": 0.5})


def checkpoint_job(engine, job="j1", checkpoint_s=10.0):
    """Two ranks step every 0.5 s for 20 steps, then checkpoint for ``checkpoint_s`` while
    their heartbeats go on, then step again; returns the anomalies found."""
    found = []
    t = NOW
    for step in range(20):
        t = NOW + 0.5 * step
        for rank in (0, 1):
            found += engine.update(ev.Step(job=job, ts=t, node="n1", rank=rank, step=step,
                                           step_time=0.5))
            found += engine.update(ev.Heartbeat(job=job, ts=t, node="n1", rank=rank, pid=1,
                                                step=step, phase="forward", phase_since=t))
        found += engine.advance(t)
    start = t + 0.1
    for i in range(int(checkpoint_s) + 1):
        now = start + i
        for rank in (0, 1):
            found += engine.update(ev.Heartbeat(job=job, ts=now, node="n1", rank=rank, pid=1,
                                                step=19, phase="checkpoint",
                                                phase_since=start))
        found += engine.advance(now)
    return found


def test_a_long_checkpoint_is_a_hang_under_the_file_allowance():
    assert [a.kind for a in checkpoint_job(Engine(BASE))] == ["hang"]


def test_an_override_widens_the_allowance_of_one_live_job_without_losing_what_it_learned():
    engine = Engine(BASE)
    book = OverrideBook(base=BASE)
    checkpoint_job(engine, job="j1", checkpoint_s=0)   # both jobs learn their step pace
    checkpoint_job(engine, job="j2", checkpoint_s=0)
    hang = engine.job_stage("j1").detectors["hang"]
    learned = (hang._n_intervals, hang._progress_ts, hang.timeout())
    changes = book.set(Accepted(job="j1", values={"detectors.hang.checkpoint_s": 60.0},
                                ts=NOW, override_id="o-1", by="alice"))
    assert changes == {"detectors.hang.checkpoint_s": (3.0, 60.0)}
    assert book.tune("j1", engine.job_stage("j1")) == changes
    assert book.tune("j2", engine.job_stage("j2")) == {}
    assert (hang._n_intervals, hang._progress_ts, hang.timeout()) == learned
    assert hang.allowance("checkpoint") == 60.0
    assert engine.job_stage("j2").detectors["hang"].allowance("checkpoint") == 3.0
    # reverting (values {}) brings the file's value back
    back = book.set(Accepted(job="j1", values={}, ts=NOW + 1, override_id="o-2"))
    assert back == {"detectors.hang.checkpoint_s": (60.0, 3.0)}
    assert book.tune("j1", engine.job_stage("j1")) == back


def test_a_new_stage_of_the_job_is_built_with_its_override():
    from trainguard.streams.processors import JobProcessor

    book = OverrideBook(base=BASE)
    book.set(Accepted(job="j1", values={"detectors.hang.checkpoint_s": 60.0}, ts=NOW,
                      override_id="o-1"))
    jobs = JobProcessor(lambda: JobStage(BASE), tune_stage=book.tune)
    from trainguard.streams.logic import encode_summaries

    item = {"k": "step", "job": "j1", "rank": 0, "node": "n1", "ts": NOW, "step": 1,
            "step_time": 0.5, "compute_time": None, "loss": None, "grad_norm": None,
            "loss_scale": None}
    [value] = encode_summaries("j1", [(0, 1, 0, item)])
    [again] = encode_summaries("j1", [(0, 2, 0, {**item, "step": 2, "ts": NOW + 1})])
    jobs.apply(value, 0, NOW)
    stage = jobs.state.slots[b"j1"].stage
    assert stage.detectors["hang"].checkpoint_s == 60.0
    # evicted to a snapshot and loaded again: still the override, after an unset the file's
    jobs.state._evict(b"j1")
    book.set(Accepted(job="j1", values={}, ts=NOW + 1, override_id="o-2"))
    jobs.apply(again, 0, NOW + 1)
    assert jobs.state.slots[b"j1"].stage.detectors["hang"].checkpoint_s == 3.0


def test_a_live_checkpoint_longer_than_the_file_allows_is_no_hang_after_the_override():
    engine = Engine(BASE)
    book = OverrideBook(base=BASE)
    book.set(Accepted(job="j1", values={"detectors.hang.checkpoint_s": 60.0}, ts=NOW,
                      override_id="o-1"))
    book.tune("j1", engine.job_stage("j1"))
    assert checkpoint_job(engine, job="j1") == []


def test_derived_thresholds_follow_a_retuned_ratio():
    import math

    stage = JobStage()
    book = OverrideBook(base=DetectorConfig())
    book.set(Accepted(job="j", values={"detectors.straggler.ratio": 1.5,
                                       "detectors.loss_spike.min_ratio": 2.0}, ts=1.0,
                      override_id="o"))
    book.tune("j", stage)
    assert stage.detectors["straggler"].ratio == 1.5      # judged from it at every step
    assert stage.detectors["loss_spike"]._log_min_ratio == math.log(2.0)


def test_the_audit_record_is_a_valid_signed_action_with_old_and_new_values():
    from trainguard.signing import sign

    accepted = Accepted(job="j1", values={"detectors.hang.checkpoint_s": 60.0}, ts=NOW,
                        override_id="o-1", by="alice@login1")
    action = sign(audit_action(accepted=accepted, changes={
        "detectors.hang.checkpoint_s": (3.0, 60.0)}, worker="w1", live_stages=1,
        now=NOW + 1), KEYS)
    back = ev.decode(ev.encode(action))
    assert back.action == "none" and back.status == "done"
    assert back.extra["code"] == "config_override"
    assert back.targets["changes"] == {"detectors.hang.checkpoint_s": {"old": 3.0,
                                                                        "new": 60.0}}
    assert back.targets["by"] == "alice@login1" and "3.0 -> 60.0" in back.reason
    assert Verifier(KEYS).check_signature(ev.encode(action)) is None


def test_an_overrides_file_for_analyze(tmp_path):
    path = tmp_path / "o.toml"
    path.write_text('[jobs.j1.detectors.hang]\ncheckpoint_s = 60.0\n')
    assert read_overrides_file(path) == {"j1": {"detectors.hang.checkpoint_s": 60.0}}
    path.write_text('[jobs.j1.detectors.hang]\nwindow = 6\n')
    with pytest.raises(ConfigError, match="cannot be changed"):
        read_overrides_file(path)


def test_records_and_files_are_checked_against_the_configuration_in_use(tmp_path):
    """A deployment whose file lowers the heartbeat summaries may shorten the silence: its
    record is read back (``config set`` of another key keeps it), and analyze takes it,
    with that file; with the defaults it is refused."""
    base = with_values(DetectorConfig(), {"stages.heartbeat_summary_s": 2.0})
    value = record({"detectors.silent.timeout_s": 4.0})
    assert isinstance(check(value, base=base), Accepted)
    assert check(value).code == "malformed"
    path = tmp_path / "o.toml"
    path.write_text('[jobs.j1.detectors.silent]\ntimeout_s = 4.0\n')
    assert read_overrides_file(path, base) == {"j1": {"detectors.silent.timeout_s": 4.0}}
    with pytest.raises(ConfigError, match="heartbeat_summary_s"):
        read_overrides_file(path)


# -- the command line, before it reaches Kafka -----------------------------------------------

def test_config_set_refuses_a_bad_value_with_one_line(capsys):
    from trainguard.cli import main

    code = main(["config", "set", "--job", "j1", "--bootstrap", "127.0.0.1:1",
                 "detectors.hang.window=5"])
    err = capsys.readouterr().err
    assert code != 0 and err.count("\n") == 1
    assert "detectors.hang.window: cannot be changed while the worker runs" in err


def test_analyze_takes_the_same_overrides(tmp_path, capsys, monkeypatch):
    from trainguard.cli import main

    monkeypatch.setenv("TRAINGUARD_CONFIG", "")     # restored after: main() sets it

    events = []

    class Recorder:
        def update(self, event):
            events.append(event)
            return []

        def advance(self, now, force=False):
            return []

    checkpoint_job(Recorder())
    recording = tmp_path / "run.jsonl"
    recording.write_text("".join(ev.encode(e).decode() + "\n" for e in events))
    config = tmp_path / "tg.toml"
    config.write_text("[detectors.hang]\nfloor_s = 2.0\ncheckpoint_s = 3.0\n")
    overrides = tmp_path / "o.json"
    overrides.write_text(json.dumps({"j1": {"detectors.hang.checkpoint_s": 60}}))
    assert main(["analyze", str(recording), "--json", "--config", str(config)]) == 0
    assert [i["kind"] for i in json.loads(capsys.readouterr().out)["incidents"]] == ["hang"]
    assert main(["analyze", str(recording), "--json", "--config", str(config),
                 "--overrides", str(overrides)]) == 0
    assert json.loads(capsys.readouterr().out)["incidents"] == []
    overrides.write_text(json.dumps({"j1": {"detectors.hang.window": 6}}))
    assert main(["analyze", str(recording), "--overrides", str(overrides)]) != 0
    assert "detectors.hang.window: cannot be changed" in capsys.readouterr().err


def test_the_action_service_does_not_take_an_override_audit_record_for_an_incident():
    from trainguard.actions.state import ServiceState

    state = ServiceState()
    state.absorb(audit_action(accepted=Accepted(job="j1", values={}, ts=NOW, override_id="o"),
                              changes={"detectors.hang.checkpoint_s": (60.0, 3.0)},
                              worker="w1", live_stages=1, now=NOW))
    assert state.incidents == {}


def test_no_bytes_on_the_topic_make_the_check_raise():
    from hypothesis import given, settings, strategies as st

    values = st.one_of(st.none(), st.binary(max_size=300), st.builds(
        lambda v, ts: json.dumps(make_record(job="j1", values={}, ts=NOW, override_id="o",
                                             by="x", keys=None) | {"values": v, "ts": ts}
                                 ).encode(),
        st.dictionaries(st.text(max_size=40), st.one_of(st.floats(), st.integers(),
                                                        st.text(max_size=5), st.none()),
                        max_size=5),
        st.one_of(st.floats(), st.integers(), st.text(max_size=5))))

    @settings(max_examples=200, deadline=None)
    @given(key=st.one_of(st.none(), st.binary(max_size=140)), value=values,
           signed=st.booleans())
    def never_raises(key, value, signed):
        result = check_record(key, value, verifier=Verifier(KEYS if signed else None),
                              now=NOW, latest_ts=NOW - 100)
        assert isinstance(result, Accepted) or (result.code and result.reason)
        if isinstance(result, Accepted):
            assert set(result.values) <= set(live_keys())

    never_raises()
