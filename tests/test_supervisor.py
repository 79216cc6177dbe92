"""``trainguard run``'s supervisor with a real child process; orders injected, no Kafka."""
import os
import queue
import signal
import sys
import threading
import time
import uuid

import pytest

from actions_harness import alive, read_log, wait_for, write_child
from trainguard import events as ev
from trainguard.launcher.order_feed import Delivery
from trainguard.launcher.supervisor import Supervisor, descendants
from trainguard.signing import SigningKeys, Verifier, sign

KEYS = SigningKeys.parse("supervisor-test-key-0123456789")


class Orders:
    def __init__(self):
        self.q = queue.Queue()

    def put(self, order):
        self.q.put(Delivery.of(order))

    def poll(self, timeout):
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            return None


def planned(op="restart", incident="inc1", onset=None, order_id=None, **targets):
    if onset is not None:
        targets["onset_ts"] = onset
    return ev.Order(job="j1", ts=time.time(), order_id=order_id or f"o-{uuid.uuid4().hex}",
                    op=op, targets=targets, incident=incident)


@pytest.fixture
def child(tmp_path):
    script = write_child(tmp_path)
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "child.jsonl"

    def make(mode="", steps=30, max_restarts=3, grace_s=2.0, step_s=0.02, keys=None,
             dead=None, launcher=()):
        published = []
        env = {**os.environ, "CHILD_LOG": str(log), "CHILD_MODE": mode,
               "CHILD_STEPS": str(steps), "CHILD_STEP_S": str(step_s)}
        env.pop("TRAINGUARD_RESUME", None)
        orders = Orders()
        sup = Supervisor(job="j1", cmd=[*launcher, sys.executable, str(script)],
                         max_restarts=max_restarts,
                         checkpoint_dir=str(ckpt), grace_s=grace_s, environ=env, node="hostA",
                         publish=published.append, orders=orders, log=lambda m: None,
                         poll_s=0.02, verifier=Verifier(keys),
                         deadletter=None if dead is None else
                         (lambda delivery, reason: dead.append((delivery, reason))))
        return sup, orders, published

    make.log = log
    return make


class Running:
    """The supervisor's loop in a thread; stopped (and its child killed) at the end."""

    def __init__(self, sup):
        self.sup = sup
        self.code = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        self.code = self.sup.run()

    def __enter__(self):
        self.thread.start()
        return self

    def join(self, timeout=30):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "supervisor did not finish"
        return self.code

    def __exit__(self, *exc):
        if self.thread.is_alive():
            self.sup.request_stop(signal.SIGTERM)
            self.sup.request_stop(signal.SIGTERM)
            self.thread.join(10)


def events_of(log, kind):
    return [e for e in read_log(log) if e["event"] == kind]


def records(published, **match):
    return [e for e in published if isinstance(e, ev.Action)
            and all(getattr(e, k) == v for k, v in match.items())]


def acks(published, **match):
    return [e for e in published if isinstance(e, ev.Ack)
            and all(getattr(e, k) == v for k, v in match.items())]


def test_crash_is_restarted_and_resumes_from_checkpoint(child):
    sup, _, published = child(mode="crash@5", steps=10)
    with Running(sup) as run:
        assert run.join() == 0
    starts = events_of(child.log, "start")
    assert [(s["step"], s["resume"]) for s in starts] == [(0, None), (5, "1")]
    assert starts[0]["job"] == "j1" and starts[1]["restarts"] == "1"
    assert [e["step"] for e in events_of(child.log, "step")] == list(range(10))
    restart = records(published, action="restart")[0]
    assert restart.status == "done" and restart.reason.startswith("exit: the command exited "
                                                                  "with code 3")
    assert restart.extra["source"] == "supervisor" and restart.extra["trigger"] == "exit"
    life = [(e.event, e.exit_code) for e in published if isinstance(e, ev.Lifecycle)]
    assert life == [("start", None), ("exit", 3), ("start", None), ("exit", 0)]
    assert all(e.rank is None and e.node == "hostA" for e in published)
    assert all(ev.decode(ev.encode(e)) == e for e in published)


def test_crash_loop_stops_after_the_restart_budget(child):
    sup, _, published = child(mode="crash_always@1", max_restarts=2)
    with Running(sup) as run:
        assert run.join() == 3
    assert len(events_of(child.log, "start")) == 3
    statuses = [r.status for r in records(published, action="restart")]
    assert statuses == ["done", "done", "rate_limited"]
    assert records(published, action="restart")[-1].extra["code"] == "budget_exhausted"


def test_restart_order_restarts_a_hung_child_once(child):
    sup, orders, published = child(mode="hang@4", steps=30, step_s=0.05)
    with Running(sup) as run:
        wait_for(lambda: events_of(child.log, "hang"), what="the hang")
        first = planned(onset=sup.clock())
        orders.put(first)
        wait_for(lambda: len(events_of(child.log, "start")) == 2, what="the relaunch")
        orders.put(first)                                               # delivered twice
        orders.put(planned(onset=sup.clock(), order_id="other-id"))     # same incident
        wait_for(lambda: len(acks(published)) == 3, what="the acks")
        assert not events_of(child.log, "end")  # they were read while the child ran
        assert run.join() == 0
    starts = events_of(child.log, "start")
    assert len(starts) == 2 and starts[1]["step"] == 4 and starts[1]["resume"] == "1"
    answers = [(a.order_id, a.status, a.code) for a in acks(published)]
    assert answers == [(first.order_id, "done", "relaunched"),
                       (first.order_id, "rejected", "replayed"),
                       ("other-id", "already_satisfied", "incident_restarted")]
    assert all(a.incident == "inc1" and a.op == "restart" and a.node == "hostA"
               for a in acks(published))
    assert not records(published, action="restart")  # orders are acked, not audited here
    # the tear-down is announced before it happens, so no detector takes it for a crash
    life = [(e.event, e.exit_code, e.signal, e.extra.get("restart")) for e in published
            if isinstance(e, ev.Lifecycle)]
    assert life[:3] == [("start", None, None, None), ("exit", None, None, True),
                        ("exit", None, "SIGTERM", True)] and life[3][0] == "start"


def test_on_one_machine_an_eviction_is_not_applicable_never_done(child):
    sup, orders, published = child(mode="hang@3", steps=6)
    with Running(sup) as run:
        wait_for(lambda: events_of(child.log, "hang"), what="the hang")
        orders.put(planned("evict", nodes=["n3"], exclude_nodes=["n3"]))
        orders.put(planned("restart", onset=sup.clock() - 1, exclude_nodes=["n3"]))
        assert run.join() == 0
    starts = events_of(child.log, "start")
    assert [s["exclude"] for s in starts] == [None, "n3"]  # told, for its information
    [evict, restart] = acks(published)
    assert (evict.op, evict.status, evict.code) == ("evict", "not_applicable", "cannot_exclude")
    assert evict.reason.startswith("trainguard run starts python")
    assert "cannot keep the job off n3; nothing was excluded" in evict.reason
    assert (restart.op, restart.status) == ("restart", "done")  # that one relaunched


def test_an_srun_command_is_relaunched_off_the_evicted_machines(child, tmp_path):
    """Inside a Slurm allocation the command is an srun: relaunches get --exclude (the
    allocation's other nodes are the spares). A stand-in srun records its argv."""
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/srun.argv\n"
                    "while [ \"${1#-}\" != \"$1\" ]; do shift; done\nexec \"$@\"\n")
    srun.chmod(0o755)
    sup, orders, published = child(mode="hang@3", steps=6, launcher=[str(srun), "-N2"])
    with Running(sup) as run:
        wait_for(lambda: events_of(child.log, "hang"), what="the hang")
        orders.put(planned("evict", nodes=["tg2"], exclude_nodes=["tg2"]))
        orders.put(planned("restart", onset=sup.clock() - 1, exclude_nodes=["tg2"]))
        assert run.join() == 0
    [evict] = acks(published, op="evict")
    assert (evict.status, evict.code) == ("done", "excluded")
    assert "srun --exclude=tg2" in evict.reason
    launches = (tmp_path / "srun.argv").read_text().splitlines()
    assert [line.split()[0] for line in launches] == ["-N2", "--exclude=tg2"]


def test_rollback_passes_the_step(child):
    sup, orders, _ = child(mode="hang@3", steps=6)
    with Running(sup) as run:
        wait_for(lambda: events_of(child.log, "hang"), what="the hang")
        orders.put(planned("rollback", rollback_step=1, onset=sup.clock()))
        assert run.join() == 0
    start = events_of(child.log, "start")[1]
    assert start["rollback"] == "1" and start["resume_step"] == "1"


def test_restart_for_an_incident_older_than_the_launch_is_already_satisfied(child):
    sup, orders, published = child(mode="crash@3", steps=40, step_s=0.05)
    with Running(sup) as run:
        wait_for(lambda: len(events_of(child.log, "start")) == 2, what="the crash restart")
        crash_onset = events_of(child.log, "crash")[0]["t"]
        orders.put(planned(incident="crash-inc", onset=crash_onset))
        wait_for(lambda: acks(published, incident="crash-inc"), what="the ack")
        assert run.join() == 0
    assert len(events_of(child.log, "start")) == 2  # no second restart
    ack = acks(published, incident="crash-inc")[0]
    assert (ack.status, ack.code) == ("already_satisfied", "relaunched_since_onset")


def test_restart_order_beyond_the_budget_fails(child):
    sup, orders, published = child(mode="hang@2", steps=5, max_restarts=0)
    with Running(sup):
        wait_for(lambda: events_of(child.log, "hang"), what="the hang")
        orders.put(planned(onset=sup.clock()))
        wait_for(lambda: acks(published), what="the ack")
        assert (acks(published)[0].status, acks(published)[0].code) == ("failed",
                                                                         "budget_exhausted")
        assert len(events_of(child.log, "start")) == 1


def test_orders_of_other_jobs_and_other_events_are_ignored(child):
    sup, _, published = child()
    assert sup.take(Delivery.of(planned().replace(job="j2"))) is None
    action = ev.Action(job="j1", ts=time.time(), incident="i", action="restart", targets={},
                       status="planned", reason="the old channel")
    assert sup.take(Delivery.of(action)) is None
    assert not published


def test_a_signed_supervisor_refuses_forged_stale_replayed_and_bad_targets(child):
    """With a key: unsigned, badly signed, stale, future, replayed orders and orders with
    hostile targets are dead-lettered and acked ``rejected``; nothing is carried out and the
    restart budget is untouched. A correctly signed order is obeyed."""
    dead = []
    sup, orders, published = child(mode="hang@2", steps=6, keys=KEYS, dead=dead)
    other = SigningKeys.parse("a-key-that-is-not-the-right-one")
    with Running(sup) as run:
        wait_for(lambda: events_of(child.log, "hang"), what="the hang")
        now = sup.clock()
        good = sign(planned(onset=now, order_id="o-good"), KEYS)
        tampered = ev.encode(good).replace(b'"o-good"', b'"o-evil"')
        forged = [
            Delivery.of(planned(onset=now, order_id="o-unsigned")),
            Delivery.of(sign(planned(onset=now, order_id="o-other-key"), other)),
            Delivery(event=ev.decode(tampered), raw=tampered),
            Delivery.of(sign(planned(onset=now).replace(ts=now - 3600), KEYS)),
            Delivery.of(sign(planned(onset=now).replace(ts=now + 3600), KEYS)),
            Delivery.of(sign(planned("evict", nodes=["$(touch /tmp/x)", "--help"]), KEYS)),
            Delivery.of(sign(planned("rollback", rollback_step=2**62), KEYS)),
        ]
        for delivery in forged:
            orders.q.put(delivery)
        wait_for(lambda: len(acks(published)) == len(forged), what="the rejections")
        assert len(events_of(child.log, "start")) == 1 and sup.restarts == 0
        assert not sup.excluded
        orders.put(good)
        wait_for(lambda: len(events_of(child.log, "start")) == 2, what="the relaunch")
        orders.put(good)  # replayed
        wait_for(lambda: len(acks(published)) == len(forged) + 2, what="the replay's ack")
        assert run.join() == 0
    codes = [(a.order_id, a.status, a.code) for a in acks(published)]
    assert [c[1:] for c in codes[:len(forged)]] == [
        ("rejected", "unsigned"), ("rejected", "unknown_key"), ("rejected", "bad_signature"),
        ("rejected", "stale"), ("rejected", "future"), ("rejected", "invalid_target"),
        ("rejected", "invalid_target")]
    assert codes[-2:] == [("o-good", "done", "relaunched"), ("o-good", "rejected", "replayed")]
    assert len(dead) == len(forged) + 1
    assert all(reason.startswith("order refused: ") for _, reason in dead)
    assert "bad_signature" in dead[2][1] and "nodes[0]" in dead[5][1]
    assert len(events_of(child.log, "start")) == 2 and sup.restarts == 1
    assert events_of(child.log, "start")[1]["exclude"] is None


def test_stop_order_stops_the_command(child):
    sup, orders, published = child(mode="hang@1", steps=5)
    with Running(sup) as run:
        wait_for(lambda: events_of(child.log, "hang"), what="the hang")
        orders.put(planned("stop"))
        assert run.join() == 128 + signal.SIGTERM
    assert [(a.op, a.status, a.code) for a in acks(published)] == [("stop", "done", "stopping")]


def test_sigterm_ignoring_child_and_its_detached_grandchild_are_killed(child):
    sup, orders, _ = child(mode="ignore_term@2", steps=4, grace_s=0.5)
    with Running(sup) as run:
        wait_for(lambda: events_of(child.log, "hang"), what="the hang")
        grandchild = events_of(child.log, "grandchild")[0]["pid"]
        assert alive(grandchild)
        orders.put(planned(onset=sup.clock()))
        wait_for(lambda: len(events_of(child.log, "start")) == 2, what="the relaunch")
        wait_for(lambda: not alive(grandchild), timeout=5, what="the grandchild's death")
        second = events_of(child.log, "grandchild")[-1]["pid"]
        assert run.join() == 0
    os.kill(second, signal.SIGKILL)


def test_stop_request_is_passed_on_and_exit_code_returned(child):
    sup, _, published = child(mode="hang@1", steps=5)
    with Running(sup) as run:
        wait_for(lambda: events_of(child.log, "hang"), what="the hang")
        pid = events_of(child.log, "start")[0]["pid"]
        sup.request_stop(signal.SIGTERM)
        assert run.join() == 128 + signal.SIGTERM
    assert not alive(pid)
    exits = [e for e in published if isinstance(e, ev.Lifecycle) and e.event == "exit"]
    assert exits[-1].signal == "SIGTERM" and exits[-1].exit_code is None


def test_descendants_lists_the_tree():
    assert os.getpid() in descendants(os.getppid()) or os.getppid() == 1


@pytest.mark.parametrize("argv, words", [
    (["run", "--job", "j1"], "no command to run"),
    (["run", "--job", "j1", "--max-restarts", "-1", "--", "true"], "--max-restarts"),
    (["run", "--job", "bad job", "--", "true"], "--job"),
    (["run", "--job", "j1", "--bootstrap", "127.0.0.1:1", "--", "/nonexistent/cmd"],
     "cannot run"),
])
def test_command_line_mistakes(argv, words, capsys):
    from trainguard.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_command_line_runs_and_returns_the_exit_code(tmp_path, capsys):
    from trainguard.cli import main

    code = main(["run", "--job", "j1", "--bootstrap", "127.0.0.1:1", "--max-restarts", "0",
                 "--", sys.executable, "-c", "import os, sys; sys.exit(int("
                 "os.environ['TRAINGUARD_RESTART_COUNT']) + 5)"])
    assert code == 5


def test_a_requeued_slurm_jobs_rollback_step_reaches_the_first_launch():
    """The Slurm driver leaves a rollback's step in the requeued job's comment, tied to the
    run (SLURM_RESTART_COUNT) it is for; trainguard run hands it to its first launch."""
    import subprocess

    from trainguard.launcher.slurm_resume import slurm_rollback_step

    asked, said = [], []

    def squeue(argv, **kw):
        asked.append(argv)
        return subprocess.CompletedProcess(argv, 0, "run b trainguard-resume-step=40@2\n", "")

    env = {"SLURM_JOB_ID": "17", "SLURM_RESTART_COUNT": "2"}
    assert slurm_rollback_step(env, runner=squeue, log=said.append) == 40
    assert asked == [["squeue", "-h", "-j", "17", "-o", "%k"]]
    assert slurm_rollback_step({**env, "SLURM_RESTART_COUNT": "3"}, runner=squeue,
                               log=said.append) is None  # a later run: the token is stale
    assert slurm_rollback_step({"SLURM_JOB_ID": "17"}, runner=squeue) is None  # first run
    assert len(asked) == 2

    def broken(argv, **kw):
        raise subprocess.TimeoutExpired(argv, 20)

    assert slurm_rollback_step(env, runner=broken, log=said.append) is None
    assert "resuming as usual" in said[-1]
    sup = Supervisor(job="j1", cmd=["python", "t.py"], environ={}, node="n", resume_step=40)
    assert sup._env(resume=False)["TRAINGUARD_RESUME_STEP"] == "40"
    assert "TRAINGUARD_RESUME_STEP" not in Supervisor(job="j1", cmd=["t"], environ={},
                                                      node="n")._env(resume=False)
    sup = Supervisor(job="j1", cmd=[sys.executable, "-c", "pass"], environ={}, node="n",
                     resume_step=40)
    sup._launch(resume=False)            # the launch after a rollback resumes at or before it;
    sup.proc.wait()                      # the ones after it resume the newest (a rollback
    assert "TRAINGUARD_RESUME_STEP" not in sup._env(resume=True)    # drops what it undid)
    assert sup.rollback_step == 40



def test_a_resume_step_in_the_runs_own_environment_reaches_the_first_launch_only():
    """A resubmitted Slurm job's environment carries the rollback's step for the whole job:
    handed to every launch, each restart inside the job would roll the progress since back
    to it again (and drop what it undid)."""
    environ = {"TRAINGUARD_RESUME_STEP": "40", "TRAINGUARD_ROLLBACK_STEP": "40", "X": "1"}
    sup = Supervisor(job="j1", cmd=[sys.executable, "-c", "pass"], environ=environ, node="n")
    first = sup._env(resume=False)
    assert (first["TRAINGUARD_RESUME_STEP"], first["TRAINGUARD_ROLLBACK_STEP"]) == ("40", "40")
    sup._launch(resume=False)
    sup.proc.wait()
    later = sup._env(resume=True)
    assert "TRAINGUARD_RESUME_STEP" not in later and "TRAINGUARD_ROLLBACK_STEP" not in later
    assert later["X"] == "1" and sup.rollback_step == 40
    # the step given by the Slurm comment wins over the environment's
    assert Supervisor(job="j1", cmd=["t"], environ=environ, node="n",
                      resume_step=30)._env(resume=False)["TRAINGUARD_RESUME_STEP"] == "30"
    # a malformed one is ignored (with a warning), as the training side would
    assert "TRAINGUARD_RESUME_STEP" not in Supervisor(
        job="j1", cmd=["t"], environ={"TRAINGUARD_RESUME_STEP": "x"}, node="n")._env(False)

def test_the_standby_link_reads_answers_and_keeps_takeovers_seen_while_it_waits(tmp_path):
    import json
    import threading

    from trainguard.launcher.inplace_status import StandbyLink, control_path

    status = tmp_path / "inplace.jsonl"
    link = StandbyLink(str(status))

    def launcher(answer):          # what the standby launcher writes when it sees the request
        control = tmp_path / "control.jsonl"
        for _ in range(200):
            if control.exists() and control.read_text().strip():
                break
            time.sleep(0.01)
        request = json.loads(control.read_text().splitlines()[-1])
        with open(status, "a") as out:
            out.write(json.dumps({"event": "generation", "generation": 1, "ts": 7.0}) + "\n")
            out.write(json.dumps({**answer, "id": request["id"]}) + "\n")

    assert control_path(str(status)) == str(tmp_path / "control.jsonl")
    worker = threading.Thread(target=launcher, args=({"event": "rollback", "step": 4},))
    worker.start()
    answer = link.rollback(4, "order-1", wait_s=5.0)
    worker.join()
    assert answer["event"] == "rollback" and answer["step"] == 4
    assert [r["generation"] for r in link.news()] == [1] and link.inplace_ts == 7.0
    assert link.news() == []
    (tmp_path / "control.jsonl").unlink()
    worker = threading.Thread(target=launcher, args=(
        {"event": "rollback_refused", "reason": "1 standby(s) for 2 ranks"},))
    worker.start()
    assert link.rollback(4, "order-2", wait_s=5.0)["event"] == "rollback_refused"
    worker.join()
    assert link.rollback(4, "order-3", wait_s=0.1) is None         # no launcher answers
    assert link.pids_of([0], tree={123}) == []                      # no pid known for rank 0


def test_a_restart_order_during_a_takeover_in_place_waits_for_it_and_relaunches_nothing(
        tmp_path):
    """The action service's restart order for a crash can come while the standby launcher is
    still handing the ranks to standbys: it is judged once the takeover is done
    (``already_satisfied`` / ``restarted_in_place``), not carried out as a relaunch."""
    from trainguard.launcher.inplace_status import append_record

    status = str(tmp_path / "inplace.jsonl")
    published = []
    sup = Supervisor(job="j1", cmd=[sys.executable, "-c", "import time; time.sleep(60)"],
                     grace_s=1.0, environ=dict(os.environ), node="hostA",
                     publish=published.append, orders=Orders(), log=lambda m: None,
                     poll_s=0.02, world_size=2, inplace_status=status)
    with Running(sup):
        wait_for(lambda: sup.proc is not None, what="the launch")
        time.sleep(0.5)
        failed = time.time()
        append_record(status, {"event": "failure", "generation": 1, "rank": 1, "status": -9,
                               "failed_ts": failed, "ts": failed})
        done = {"event": "generation", "generation": 1, "rank": 1, "status": -9,
                "failed_ts": failed}
        threading.Timer(0.5, lambda: append_record(status, {**done, "ts": time.time()})).start()
        sup.orders.put(planned(incident="crash-inc", onset=failed - 0.2, ranks=[1]))
        wait_for(lambda: acks(published, incident="crash-inc"), what="the ack", timeout=15)
    ack = acks(published, incident="crash-inc")[0]
    assert (ack.status, ack.code) == ("already_satisfied", "restarted_in_place"), ack.reason
    assert sup.restarts == 0 and sup.incarnation == 0
    assert [r.extra["code"] for r in records(published, status="done")] == \
        ["restarted_in_place"]
