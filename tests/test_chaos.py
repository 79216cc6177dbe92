"""trainguard.apps.chaos: the schedule parser, the hooks, and once-per-job-run semantics."""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import traceback

import pytest

from trainguard.apps import chaos
from trainguard.apps.chaos import Chaos, ChaosError, ChaosInjectedError, parse
from trainguard.errors import UserError

DEMO = ("nan@step=30,rank=1;straggler@step=40-80,rank=2,factor=1.5;hang@step=120,rank=2;"
        "crash@step=160,rank=3;xid@step=200,node=n1,xid=79")


def make(spec, rank=0, tmp_path=None, **kw):
    kw.setdefault("node", "n1")
    kw.setdefault("quiet", True)
    if tmp_path is not None:
        kw.setdefault("state_dir", tmp_path / "state")
        kw.setdefault("log_path", tmp_path / "chaos.jsonl")
    return Chaos(parse(spec), rank=rank, **kw)


def log_lines(tmp_path):
    path = tmp_path / "chaos.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


# ----------------------------------------------------------------------------- parsing
def test_parse_demo_schedule():
    faults = parse(DEMO)
    assert [(f.id, f.kind, f.first, f.last, f.ranks) for f in faults] == [
        ("1-nan", "nan", 30, None, (1,)), ("2-straggler", "straggler", 40, 80, (2,)),
        ("3-hang", "hang", 120, None, (2,)), ("4-crash", "crash", 160, None, (3,)),
        ("5-xid", "xid", 200, None, ())]
    assert faults[1].factor == 1.5 and faults[4].node == "n1" and faults[4].xid == 79
    assert ";".join(f.spec for f in faults) == DEMO


@pytest.mark.parametrize("text,ranks", [("1", (1,)), ("0-3", (0, 1, 2, 3)), ("3+1+1", (1, 3)),
                                        ("0-1+5", (0, 1, 5)), ("all", None)])
def test_rank_forms(text, ranks):
    assert parse(f"crash@step=1,rank={text}")[0].ranks == ranks


def test_whitespace_newlines_and_empty_parts():
    faults = parse("  nan@step=3, rank=1 ;\n\n hang@ step = 9 , rank = 0 ;; ")
    assert [f.spec for f in faults] == ["nan@step=3,rank=1", "hang@step=9,rank=0"]
    assert parse("") == []


def test_json_forms_equal_compact():
    listed = parse('[{"kind": "straggler", "step": [40, 80], "rank": [2, 3], "delay": 0.5},'
                   ' {"kind": "crash", "step": 9, "rank": 1, "signal": "SIGSEGV"}]')
    wrapped = parse('{"faults": [{"kind": "straggler", "step": "40-80", "rank": "2+3",'
                    ' "delay": 0.5}, {"kind": "crash", "step": 9, "ranks": [1], "signal": "segv"}]}')
    compact = parse("straggler@step=40-80,rank=2+3,delay=0.5;crash@step=9,rank=1,signal=SEGV")
    assert listed == wrapped == compact
    one = parse('{"kind": "xid", "step": 5, "msg": "Ch 0001, a, b", "kmsg": "/tmp/k"}')
    assert one[0].msg == "Ch 0001, a, b"


@pytest.mark.parametrize("spec,needle", [
    ("boom@step=1,rank=0", "unknown fault kind 'boom'"),
    ("nan@rank=1", "say when, e.g. step=120"),
    ("nan@step=x,rank=1", "step must be N or A-B"),
    ("nan@step=-3,rank=1", "step must be N or A-B"),
    ("crash@step=5-9,rank=1", "crash fires once: give one step"),
    ("straggler@step=9-5,rank=1", "A <= B"),
    ("hang@step=5", "say which rank(s)"),
    ("hang@step=5,rank=two", "rank must be N, A-B, A+B or all"),
    ("hang@step=5,rank=1,factor=2", "hang takes no 'factor'"),
    ("straggler@step=1-5,rank=1,factor=fast", "factor must be a number"),
    ("straggler@step=1-5,rank=1,factor=0.5", "factor must be >= 1"),
    ("straggler@step=1-5,rank=1,delay=inf", "finite number"),
    ("crash@step=1,rank=1,signal=HUP", "signal must be one of"),
    ("xid@step=1,rank=all", "give one rank=N or node=NAME"),
    ("nan@step=1,rank=1,oops", "expected key=value"),
    ("[{\"kind\": \"nan\"", "not valid JSON"),
    ("[1, 2]", "list of fault objects"),
])
def test_parse_errors_are_one_line_user_errors(spec, needle):
    with pytest.raises(ChaosError) as info:
        parse(spec)
    message = str(info.value)
    assert needle in message, message
    assert "\n" not in message and isinstance(info.value, UserError)


def test_error_names_the_fault():
    with pytest.raises(ChaosError, match=r"chaos fault 2 'crash@step=x,rank=3'"):
        parse("nan@step=1,rank=1;crash@step=x,rank=3")


def test_cli_checks_a_schedule(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "trainguard.apps.chaos", DEMO], capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0 and "3-hang" in ok.stdout and "hang@step=120,rank=2" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "trainguard.apps.chaos", "hang@step=1"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and bad.stderr.startswith("error: chaos fault 1")


# ----------------------------------------------------------------------------- from_env
def test_from_env_reads_variables(tmp_path):
    file = tmp_path / "faults.json"
    file.write_text(json.dumps([{"kind": "xid", "step": 3, "rank": 1}]))
    c = chaos.from_env(environ={"TRAINGUARD_CHAOS_FILE": str(file), "RANK": "1", "LOCAL_RANK": "1",
                                "TRAINGUARD_CHAOS_KMSG": str(tmp_path / "kmsg"),
                                "TRAINGUARD_CHAOS_LOG": str(tmp_path / "log"),
                                "TRAINGUARD_CHAOS_STATE": str(tmp_path / "st"),
                                "TRAINGUARD_NODE": "gpu7"})
    assert (c.rank, c.local_rank, c.node) == (1, 1, "gpu7")
    assert [f.kind for f in c.mine] == ["xid"]
    assert (c.state_dir, c.log_path, c.kmsg_path) == (str(tmp_path / "st"), str(tmp_path / "log"),
                                                      str(tmp_path / "kmsg"))


def test_from_env_state_dir_precedence(tmp_path):
    env = {"TRAINGUARD_CHAOS": "nan@step=1,rank=0", "TORCHELASTIC_RUN_ID": "abc"}
    assert chaos.from_env(environ=env).state_dir.endswith("trainguard-chaos-abc")
    assert chaos.from_env(environ=env, default_state_dir=tmp_path).state_dir == tmp_path
    env["TRAINGUARD_CHAOS_STATE"] = "/x/state"
    assert chaos.from_env(environ=env, default_state_dir=tmp_path).state_dir == "/x/state"
    assert chaos.from_env(environ={"TRAINGUARD_CHAOS": "nan@step=1,rank=0"}).state_dir is None


@pytest.mark.parametrize("env,needle", [
    ({"TRAINGUARD_CHAOS": "nan@step=1,rank=0", "TRAINGUARD_CHAOS_FILE": "/f"}, "not both"),
    ({"TRAINGUARD_CHAOS": "xid@step=1"}, "kmsg=PATH or set TRAINGUARD_CHAOS_KMSG"),
    ({"TRAINGUARD_CHAOS_FILE": "/no/such/file.json"}, "cannot read chaos file"),
])
def test_from_env_errors(env, needle):
    with pytest.raises(ChaosError, match=needle):
        chaos.from_env(environ=env)


# ----------------------------------------------------------------------------- hooks
def test_no_schedule_is_a_no_op():
    c = Chaos([], rank=0, node="n1")
    assert not c
    c.in_data(1)
    c.before_forward(1)
    c.after_step(1)
    assert c.loss(1, 2.5) == 2.5 and c.fired == []


def test_faults_of_other_ranks_do_nothing(tmp_path):
    c = make("nan@step=1,rank=1;crash@step=1,rank=2", rank=0, tmp_path=tmp_path,
             kill=lambda *a: pytest.fail("killed"))
    assert not c
    assert c.loss(1, 2.0) == 2.0
    c.after_step(1)
    assert log_lines(tmp_path) == []


def test_nan_and_loss_spike_on_floats_and_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    c = make("nan@step=2,rank=0;loss_spike@step=3,rank=0,factor=4", tmp_path=tmp_path)
    assert c.loss(1, 1.5) == 1.5
    w = torch.ones(2, requires_grad=True)
    loss = c.loss(2, (w * 3).sum())
    loss.backward()
    assert math.isnan(loss.item()) and all(math.isnan(g) for g in w.grad.tolist())
    assert c.loss(3, 2.0) == 8.0
    assert c.loss(4, 2.0) == 2.0
    assert [r["kind"] for r in log_lines(tmp_path)] == ["nan", "loss_spike"]


def test_point_fault_fires_at_first_step_at_or_after_its_step(tmp_path):
    c = make("nan@step=10,rank=0", tmp_path=tmp_path)
    assert c.loss(9, 1.0) == 1.0
    assert math.isnan(c.loss(12, 1.0))  # resumed past step 10: still fires, once
    assert c.loss(13, 1.0) == 1.0


def test_once_per_job_run_across_restarts(tmp_path):
    first = make("nan@step=5,rank=1", rank=1, tmp_path=tmp_path)
    assert math.isnan(first.loss(5, 1.0))
    restarted = make("nan@step=5,rank=1", rank=1, tmp_path=tmp_path)
    assert restarted.loss(5, 1.0) == 1.0 and restarted.loss(6, 1.0) == 1.0
    other_run = make("nan@step=5,rank=1", rank=1, state_dir=tmp_path / "fresh")
    assert math.isnan(other_run.loss(5, 1.0))
    changed = make("nan@step=6,rank=1", rank=1, tmp_path=tmp_path)  # a different schedule
    assert math.isnan(changed.loss(6, 1.0))
    assert len(log_lines(tmp_path)) == 2


def test_without_state_dir_once_per_process():
    c = make("nan@step=5,rank=0")
    assert math.isnan(c.loss(5, 1.0)) and c.loss(5, 1.0) == 1.0
    assert math.isnan(make("nan@step=5,rank=0").loss(5, 1.0))


def test_multi_rank_fault_fires_once_on_each_rank(tmp_path):
    for rank in (0, 1, 2):
        c = make("crash@step=3,rank=0+2", rank=rank, tmp_path=tmp_path, kill=lambda *a: None)
        c.after_step(3)
    again = make("crash@step=3,rank=0+2", rank=2, tmp_path=tmp_path,
                 kill=lambda *a: pytest.fail("fired twice"))
    again.after_step(3)
    lines = log_lines(tmp_path)
    assert [(r["id"], r["ranks"]) for r in lines] == [("1-crash", [0]), ("1-crash", [2])]


def test_straggler_delay_over_its_window(tmp_path):
    slept = []
    c = make("straggler@step=3-5,rank=0,delay=0.25", tmp_path=tmp_path, sleep=slept.append)
    for step in range(8):
        c.before_forward(step)
    assert slept == [0.25, 0.25, 0.25]
    assert [r["step"] for r in log_lines(tmp_path)] == [3]
    restarted = make("straggler@step=3-5,rank=0,delay=0.25", tmp_path=tmp_path,
                     sleep=slept.append)
    restarted.before_forward(4)
    assert slept == [0.25] * 3


def test_straggler_factor_scales_the_ranks_own_step_time():
    ticks, slept = iter([0.0, 0.1, 0.2, 0.3, 0.5, 0.7]), []
    c = make("straggler@step=3-9,rank=0,factor=2", sleep=slept.append,
             monotonic=lambda: next(ticks))
    for step in range(6):
        c.before_forward(step)
    # steps take 0.1 s; from step 3 it sleeps (2 - 1) x 0.1 s, not counting its own sleeps
    assert slept == pytest.approx([0.1, 0.1, 0.1])


def test_hang_blocks_in_a_named_function(tmp_path):
    where = []

    def sleep(_):
        where.append([f.name for f in traceback.extract_stack()])
        raise KeyboardInterrupt  # stand-in for the process being killed

    c = make("hang@step=4,rank=0", tmp_path=tmp_path, sleep=sleep)
    c.in_data(3)
    with pytest.raises(KeyboardInterrupt):
        c.in_data(4)
    assert where[0][-3:] == ["in_data", "_chaos_hang_in_data_loading", "sleep"]
    assert log_lines(tmp_path)[0]["kind"] == "hang"  # logged before it blocks
    make("hang@step=4,rank=0", tmp_path=tmp_path, sleep=sleep).in_data(4)  # not again


def test_finite_hang_returns(tmp_path):
    c = make("hang@step=1,rank=0,seconds=0", tmp_path=tmp_path)
    c.in_data(1)
    assert c.fired[0]["kind"] == "hang"


def test_crash_kills_itself_after_recording(tmp_path):
    kills = []
    c = make("crash@step=2,rank=0;crash@step=3,rank=0,signal=SEGV", tmp_path=tmp_path,
             kill=lambda pid, sig: kills.append((pid, sig)))
    for step in range(5):
        c.after_step(step)
    import os
    assert kills == [(os.getpid(), signal.SIGKILL), (os.getpid(), signal.SIGSEGV)]
    assert [r["signal"] for r in log_lines(tmp_path)] == ["KILL", "SEGV"]


def test_error_raises(tmp_path):
    c = make("error@step=2,rank=0", tmp_path=tmp_path)
    with pytest.raises(ChaosInjectedError, match="injected error at step 2 on rank 0"):
        c.after_step(2)
    c.after_step(3)


def test_xid_line_reaches_the_kernel_log_and_parses(tmp_path):
    from trainguard.collectors.kmsg import parse_xid_line

    kmsg = tmp_path / "logs" / "kmsg.log"
    c = make("xid@step=7,rank=1,bus=0000:9b:00", rank=1, tmp_path=tmp_path, kmsg_path=kmsg,
             clock=lambda: 1764680000.0)
    c.after_step(7)
    c.after_step(8)
    lines = kmsg.read_text().splitlines()
    assert len(lines) == 1
    rec = parse_xid_line(lines[0])
    assert (rec.xid, rec.bus_id, rec.detail) == (79, "0000:9b:00", "GPU has fallen off the bus.")
    log = log_lines(tmp_path)[0]
    assert log["kind"] == "xid" and log["ranks"] == [] and log["node"] == "n1"
    assert log["injected_ts"] == 1764680000.0 and log["step"] == 7 and log["kmsg"] == str(kmsg)


def test_xid_targets(tmp_path):
    f = parse("xid@step=1,node=n2")[0]
    assert f.targets(rank=5, node="n2", local_rank=0)
    assert not f.targets(rank=6, node="n2", local_rank=1)
    assert not f.targets(rank=0, node="n1", local_rank=0)
    default = parse("xid@step=1")[0]
    assert default.targets(rank=0, node="x", local_rank=0) and not default.targets(1, "x", 1)
    assert parse("xid@step=1,rank=3")[0].targets(3, "x", 3)


def test_xid_message_and_code():
    line = chaos.xid_line(48, "0000:3b:00", 7, uptime=1.0)
    assert ": 48, pid=7, name=python, An uncorrectable double bit error" in line
    assert chaos.xid_line(13, "0000:3b:00", 7, message="custom").endswith(", custom")


def test_injection_log_record(tmp_path):
    c = make("crash@step=2,rank=3", rank=3, tmp_path=tmp_path, kill=lambda *a: None,
             clock=lambda: 1764680001.5)
    c.after_step(2)
    (rec,) = log_lines(tmp_path)
    assert {k: rec[k] for k in ("id", "kind", "spec", "ranks", "rank", "node", "step",
                                "injected_ts")} == {
        "id": "1-crash", "kind": "crash", "spec": "crash@step=2,rank=3", "ranks": [3],
        "rank": 3, "node": "n1", "step": 2, "injected_ts": 1764680001.5}
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [
        f"{c._state_name(c.mine[0])}.json"]
