"""Alert sinks against local HTTP receivers: payloads, signing, retries, dedup, rate limits,
secrets kept out of repr, errors and logs."""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import socket
import threading

import pytest
from http_receiver import HttpReceiver

from trainguard import events as ev
from trainguard.actions.alerts import (AlertConfigError, AlertmanagerSink, AlertMessage,
                                       Delivery, LarkSink, SlackSink, TeamsSink, WebhookSink,
                                       build_sinks, send_all)
from trainguard.errors import UserError

TS = 1764680000.0
SECRET = "s3cr3t-XYZ-0123456789"


class Sleeps(list):
    def __call__(self, seconds):
        self.append(seconds)


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def anomaly(**over):
    fields = dict(job="llama", ts=TS + 42, id="inc-1", kind="hang", severity="critical",
                  ranks=[2], nodes=["n1"], step=181, onset_ts=TS, detected_ts=TS + 42,
                  detector="hang", summary="no step finished for 42 s",
                  evidence={"stalled_s": 42.0, "loss": float("nan")})
    fields.update(over)
    return ev.Anomaly(**fields)


def actions(incident="inc-1"):
    return [ev.Action(job="llama", ts=TS + 43, incident=incident, action="capture_stacks",
                      targets={"ranks": "all"}, status="done", reason="hang"),
            ev.Action(job="llama", ts=TS + 44, incident=incident, action="restart",
                      targets={"nodes": ["n1"]}, status="done", reason="suspect rank 2")]


STACKS = ("[0-3] <module> (train.py) > train (train.py)\n"
          "  [0-1,3] all_reduce (distributed_c10d.py)\n"
          "  [2] next_batch (data.py)  <== suspect")


def message(incident="inc-1", **over):
    return AlertMessage.from_anomaly(anomaly(id=incident, **over), actions(incident), STACKS,
                                     ts=TS + 45)


def fast(**over):
    return Delivery(**{"timeout": 2.0, "retries": 2, "backoff": 0.5, **over})


@pytest.fixture
def rx():
    with HttpReceiver() as receiver:
        yield receiver


# ---------------------------------------------------------------- the message
def test_message_says_what_where_done_and_stacks():
    m = message()
    lines = m.lines()
    assert lines[0] == "[CRITICAL] hang in job llama"
    assert lines[1].startswith("What: no step finished for 42 s (step 181, began ")
    assert lines[2] == "Where: rank 2 on n1"
    assert lines[3] == ("Done: capture_stacks ranks=all: done (hang); "
                        "restart n1: done (suspect rank 2)")
    assert lines[4] == "Stacks:" and lines[-1].endswith("<== suspect")
    assert m.anomaly["evidence"]["loss"] == "NaN"  # JSON-safe SPEC dict
    json.dumps(m.anomaly, allow_nan=False)


def test_message_from_an_analyze_incident_and_long_stacks_are_cut():
    incident = {"id": "i-9", "kind": "straggler", "job": "j1", "ranks": [6, 7, 5],
                "nodes": ["n2", "n1"], "step": 3, "onset_ts": TS, "detected_ts": TS + 200,
                "severity": "warning", "summary": "ranks 5-7 are 1.5x slower"}
    m = AlertMessage.from_anomaly(incident, stacks="\n".join(f"frame {i}" for i in range(40)))
    assert m.where() == "ranks 5-7 on n1, n2"
    assert m.done() == "nothing yet (alert only)"
    assert "detected 3 min later" in m.what()
    assert m.stack_lines()[-1] == "... (28 more lines)"
    with pytest.raises(ValueError):
        AlertMessage(incident="x", job="j", kind="k", severity="fatal", summary="")


# ---------------------------------------------------------------- each sink's payload
def test_slack_blocks_reach_the_receiver(rx):
    sink = SlackSink(url=rx.url("/services/T0/B0/" + SECRET), delivery=fast())
    result = sink.send(message())
    assert result.ok and result.status == "sent" and result.attempts == 1
    [req] = rx.requests
    assert req.path == "/services/T0/B0/" + SECRET
    assert req.headers["Content-Type"].startswith("application/json")
    body = req.json()
    assert body["text"].startswith("[CRITICAL] hang in job llama")
    assert [b["type"] for b in body["blocks"]] == ["header", "section", "section", "context"]
    assert "*Where:* rank 2 on n1" in body["blocks"][1]["text"]["text"]
    assert "&lt;== suspect" in body["blocks"][2]["text"]["text"]


def test_lark_card_is_signed_as_feishu_checks_it(rx):
    rx.content_type = "application/json"
    rx.default = (200, b'{"code":0,"msg":"success","data":{}}')
    now = Clock(1764680100.7)
    sink = LarkSink(url=rx.url("/open-apis/bot/v2/hook/" + SECRET), secret=SECRET,
                    wall_clock=now, delivery=fast())
    assert sink.send(message()).ok
    body = rx.requests[0].json()
    assert body["timestamp"] == "1764680100" and body["msg_type"] == "interactive"
    key = f"{body['timestamp']}\n{SECRET}".encode()
    expected = base64.b64encode(hmac.new(key, b"", hashlib.sha256).digest()).decode()
    assert body["sign"] == expected
    assert body["card"]["header"]["template"] == "red"
    contents = json.dumps(body["card"]["elements"])
    assert "rank 2 on n1" in contents and "next_batch" in contents
    unsigned = LarkSink(url=rx.url("/hook"), delivery=fast()).payload(message())
    assert "sign" not in unsigned and "timestamp" not in unsigned


def test_lark_error_codes_fail_and_only_its_rate_limit_is_retried(rx):
    rx.script([(200, b'{"code":19021,"msg":"sign match fail"}')])
    sleeps = Sleeps()
    sink = LarkSink(url=rx.url("/h"), secret=SECRET, delivery=fast(), sleep=sleeps)
    result = sink.send(message())
    assert result.status == "failed" and result.attempts == 1 and "19021" in result.error
    rx.script([(200, b'{"code":9499,"msg":"too many request"}'), (200, b'{"code":0}')])
    assert sink.send(message()).attempts == 2 and sleeps == [0.5]


def test_teams_adaptive_card(rx):
    rx.default = (202, b"")
    sink = TeamsSink(url=rx.url("/workflows/abc/triggers/manual/paths/invoke?sig=" + SECRET),
                     delivery=fast())
    result = sink.send(message())
    assert result.ok and result.http_status == 202
    body = rx.requests[0].json()
    assert body["type"] == "message"
    [att] = body["attachments"]
    assert att["contentType"] == "application/vnd.microsoft.card.adaptive"
    card = att["content"]
    assert card["type"] == "AdaptiveCard" and card["version"] == "1.4"
    facts = {f["title"]: f["value"] for f in card["body"][1]["facts"]}
    assert facts["Where"] == "rank 2 on n1" and facts["Done"].startswith("capture_stacks")
    assert any(b.get("fontType") == "Monospace" for b in card["body"])


def test_alertmanager_firing_then_resolved(rx):
    sink = AlertmanagerSink(url=rx.url(), extra_labels={"cluster": "c1"}, delivery=fast(),
                            bearer_token=SECRET)
    m = message()
    assert sink.send(m).ok and sink.send(m.resolved(ts=TS + 300)).ok
    fire, resolve = rx.requests
    assert fire.path == resolve.path == "/api/v2/alerts"
    assert fire.headers["Authorization"] == f"Bearer {SECRET}"
    [a], [b] = fire.json(), resolve.json()
    assert a["labels"] == {"alertname": "TrainguardHang", "training_job": "llama",
                           "kind": "hang", "severity": "critical", "ranks": "2", "nodes": "n1",
                           "incident": "inc-1", "cluster": "c1"}
    assert a["labels"] == b["labels"]
    assert a["annotations"]["summary"].startswith("[CRITICAL] hang in job llama: ")
    assert "next_batch" in a["annotations"]["description"]
    assert a["startsAt"] == "2025-12-02T12:53:20.000Z"
    assert a["endsAt"] == "2025-12-02T13:54:05.000Z" and b["endsAt"] == "2025-12-02T12:58:20.000Z"


def test_user_info_in_a_url_becomes_basic_auth(rx):
    url = rx.url().replace("127.0.0.1", "admin:pa%3Ass@127.0.0.1")
    sink = AlertmanagerSink(url=url, delivery=fast())
    assert sink.send(message()).ok
    auth = rx.requests[0].headers["Authorization"]
    assert base64.b64decode(auth.split()[1]) == b"admin:pa:ss"
    assert "pa%3Ass" not in repr(sink) and "admin" not in repr(sink)


def test_webhook_carries_spec_json_and_a_verifiable_signature(rx):
    sink = WebhookSink(url=rx.url("/tg"), secret=SECRET, wall_clock=Clock(TS), delivery=fast())
    assert sink.send(message()).ok
    req = rx.requests[0]
    body = req.json()
    assert body["version"] == 1 and body["state"] == "firing" and body["incident"] == "inc-1"
    decoded = ev.from_dict(body["anomaly"])
    assert decoded.type == "anomaly" and decoded.ranks == [2]
    assert [ev.from_dict(a).action for a in body["actions"]] == ["capture_stacks", "restart"]
    assert req.headers["X-Trainguard-Timestamp"] == str(int(TS))
    mac = hmac.new(SECRET.encode(), f"{int(TS)}.".encode() + req.body, hashlib.sha256)
    assert req.headers["X-Trainguard-Signature"] == "sha256=" + mac.hexdigest()


# ---------------------------------------------------------------- delivery behaviour
def test_retries_with_exponential_backoff_then_success(rx):
    rx.script([(500, b"boom"), (503, b"busy"), (200, b"ok")])
    sleeps = Sleeps()
    sink = SlackSink(url=rx.url("/x"), delivery=fast(retries=3), sleep=sleeps)
    result = sink.send(message())
    assert result.ok and result.attempts == 3 and sleeps == [0.5, 1.0]
    assert len(rx.requests) == 3


def test_retry_after_is_honoured_but_capped_and_4xx_is_not_retried(rx):
    rx.script([(429, b"slow down", {"Retry-After": "30"}), (200, b"ok")])
    sleeps = Sleeps()
    sink = SlackSink(url=rx.url("/x"), delivery=fast(backoff_max=4.0), sleep=sleeps)
    assert sink.send(message()).ok and sleeps == [4.0]
    rx.script([(400, b"invalid_payload")])
    result = sink.send(message("inc-2"))
    assert result.status == "failed" and result.attempts == 1 and result.http_status == 400
    assert "invalid_payload" in result.error and sleeps == [4.0]


def test_gives_up_after_the_last_retry(rx):
    rx.default = (502, b"bad gateway")
    sleeps = Sleeps()
    result = SlackSink(url=rx.url("/x"), delivery=fast(retries=2), sleep=sleeps).send(message())
    assert result.status == "failed" and result.attempts == 3 and sleeps == [0.5, 1.0]
    assert result.action_status == "failed"


def test_redirects_are_not_followed(rx):
    rx.script([(302, b"", {"Location": "http://127.0.0.1:1/elsewhere"})])
    result = SlackSink(url=rx.url("/x"), delivery=fast()).send(message())
    assert result.status == "failed" and "redirects are not followed" in result.error


def test_timeout_is_retried_and_reported():
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never answers
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/hook/{SECRET}"
        sink = WebhookSink(url=url, delivery=fast(timeout=0.2, retries=1), sleep=Sleeps())
        result = sink.send(message())
        assert result.status == "failed" and result.attempts == 2
        assert "timed out" in result.error.lower()
    finally:
        silent.close()


def test_same_incident_and_state_is_sent_once_within_the_window(rx):
    clock = Clock()
    sink = SlackSink(url=rx.url("/x"), delivery=fast(dedup_window=300), clock=clock)
    m = message()
    assert sink.send(m).status == "sent"
    assert sink.send(m).status == "deduplicated"
    assert sink.send(m).action_status is None
    assert sink.send(m.resolved(ts=TS + 60)).status == "sent"
    assert sink.send(m.resolved(ts=TS + 61)).status == "deduplicated"
    assert sink.send(m).status == "sent"  # fired again after it was resolved
    clock.t += 301
    assert sink.send(m.resolved(ts=TS + 90)).status == "sent"
    assert len(rx.requests) == 4


def test_a_failed_send_is_not_remembered_as_sent(rx):
    rx.script([(500, b"x")])
    sink = SlackSink(url=rx.url("/x"), delivery=fast(retries=0))
    assert sink.send(message()).status == "failed"
    assert sink.send(message()).status == "sent"


def test_per_sink_token_bucket(rx):
    clock = Clock()
    sink = SlackSink(url=rx.url("/x"), delivery=fast(rate_per_minute=1, burst=2), clock=clock)
    other = TeamsSink(url=rx.url("/y"), delivery=fast(rate_per_minute=1, burst=2), clock=clock)
    got = [sink.send(message(f"inc-{i}")).status for i in range(3)]
    assert got == ["sent", "sent", "rate_limited"]
    assert other.send(message("inc-9")).status == "sent"  # its own bucket
    r = sink.send(message("inc-3"))
    assert r.status == "rate_limited" and r.action_status == "rate_limited"
    clock.t += 60
    assert sink.send(message("inc-2")).status == "sent"  # not marked sent when limited


# ---------------------------------------------------------------- secrets
def test_secrets_stay_out_of_repr_results_and_logs(rx, caplog):
    caplog.set_level(logging.DEBUG, logger="trainguard")
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()  # nothing listens there: connection refused
    sinks = [SlackSink(url=rx.url(f"/services/{SECRET}"), sleep=Sleeps()),
             LarkSink(url=rx.url(f"/hook/{SECRET}"), secret=SECRET),
             TeamsSink(url=rx.url(f"/wf?sig={SECRET}")),
             AlertmanagerSink(url=f"http://u:{SECRET}@127.0.0.1:{rx.port}",
                              bearer_token=SECRET),
             WebhookSink(url=rx.url(f"/{SECRET}"), secret=SECRET, bearer_token=SECRET),
             WebhookSink(url=f"http://127.0.0.1:{dead_port}/{SECRET}", delivery=fast(),
                         sleep=Sleeps()),
             WebhookSink(url=f"nope://127.0.0.1/{SECRET}", delivery=fast())]
    rx.script([(500, SECRET.encode())])  # a receiver echoing the secret back
    results = []
    for s in sinks:
        results += [s.send(message()), s.send(message())]
        assert SECRET not in repr(s) and SECRET not in str(s)
    assert SECRET not in caplog.text
    assert "alert sink webhook: attempt 1 of 3 failed" in caplog.text
    for r in results:
        assert SECRET not in repr(r)
    assert [r.status for r in results[-4:]] == ["failed"] * 4
    assert "Connection refused" in results[-4].error or "refused" in results[-4].error.lower()


# ---------------------------------------------------------------- configuration
def test_build_sinks_from_env_file_and_config(tmp_path, rx):
    secret_file = tmp_path / "lark.secret"
    secret_file.write_text(SECRET + "\n")
    sleeps, clock = Sleeps(), Clock()
    sinks = build_sinks({
        "slack": {"url_env": "SLACK_WEBHOOK_URL", "retries": 1, "rate_per_minute": 6},
        "lark": {"url": rx.url("/lark"), "secret_file": str(secret_file)},
        "teams": {"url_env": "TEAMS_URL", "enabled": False},
        "alertmanager": {"url": rx.url()},
        "hooks": [{"type": "webhook", "url": rx.url("/a")},
                  {"type": "webhook", "url": rx.url("/b"), "secret_env": "HOOK_SECRET"}],
    }, {"SLACK_WEBHOOK_URL": rx.url("/slack/" + SECRET), "HOOK_SECRET": SECRET},
        sleep=sleeps, clock=clock, wall_clock=Clock(TS))
    assert [type(s).__name__ for s in sinks] == ["SlackSink", "LarkSink", "AlertmanagerSink",
                                                 "WebhookSink", "WebhookSink"]
    assert [s.label for s in sinks] == ["slack", "lark", "alertmanager", "hooks", "hooks"]
    slack, lark = sinks[0], sinks[1]
    assert slack.delivery.retries == 1 and slack.delivery.rate_per_minute == 6
    assert slack.sleep is sleeps and slack.clock is clock and lark.secret == SECRET
    results = send_all(sinks, message())
    assert [r.status for r in results] == ["sent"] * 5
    assert sorted(r.path for r in rx.requests) == ["/a", "/api/v2/alerts", "/b", "/lark",
                                                   f"/slack/{SECRET}"]
    assert SECRET not in repr(sinks)


@pytest.mark.parametrize("section, env, needle", [
    ({"slack": {"url_env": "MISSING"}}, {}, "url_env names MISSING, which is not set"),
    ({"slack": {}}, {}, "url is missing; give url, url_env or url_file"),
    ({"slack": {"url": "u", "url_env": "X"}}, {"X": "zz-secret-zz"},
     "give only one of url, url_env"),
    ({"pager": {"url": "u"}}, {}, "unknown sink type 'pager'"),
    ({"slack": {"url": "u", "colour": "red"}}, {}, "unknown setting colour"),
    ({"slack": {"url": "u", "retries": -1}}, {}, "retries must be an int"),
    ({"alertmanager": {"url": "u", "extra_labels": {"job": "x"}}}, {}, "extra label 'job'"),
    ({"lark": {"url": "u", "secret_file": "/nonexistent/x"}}, {}, "secret_file /nonexistent/x"),
    ({"slack": "https://x"}, {}, "alerts.slack: must be a mapping"),
])
def test_config_mistakes_are_user_errors_that_keep_secrets(section, env, needle):
    with pytest.raises(AlertConfigError) as info:
        build_sinks(section, env)
    assert isinstance(info.value, UserError)
    assert needle in str(info.value)
    for value in env.values():
        assert value not in str(info.value)


def test_send_all_survives_a_broken_sink(rx):
    class Broken(SlackSink):
        def request(self, message):
            raise RuntimeError(SECRET)

    good = SlackSink(url=rx.url("/ok"))
    results = send_all([Broken(url=rx.url("/x")), good], message())
    assert [r.status for r in results] == ["failed", "sent"]
    assert SECRET not in results[0].error


def test_sends_from_several_threads_are_deduplicated(rx):
    sink = SlackSink(url=rx.url("/x"))
    out = []
    threads = [threading.Thread(target=lambda: out.append(sink.send(message())))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.status for r in out) == ["deduplicated"] * 7 + ["sent"]
    assert len(rx.requests) == 1
