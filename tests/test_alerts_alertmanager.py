"""The Alertmanager sink against a real Alertmanager (Debian's ``prometheus-alertmanager``),
on loopback, forwarding to a local webhook receiver: firing, then resolved with ``endsAt``."""
from __future__ import annotations

import time

import pytest
from alertmanager_harness import BINARY, MISSING, alertmanager
from alertmanager_harness import active as _am_active
from alertmanager_harness import alerts_in as _alerts_in
from http_receiver import HttpReceiver

from trainguard.actions.alerts import AlertMessage, AlertmanagerSink, Delivery

pytestmark = [pytest.mark.slow, pytest.mark.skipif(BINARY is None, reason=MISSING)]


def _active(base: str, incident: str) -> list[dict]:
    return _am_active(base, incident=incident)


def test_real_alertmanager_receives_forwards_and_resolves(tmp_path):
    with HttpReceiver() as rx, alertmanager(tmp_path, rx.url("/am")) as base:
        sink = AlertmanagerSink(url=base, delivery=Delivery(timeout=3, retries=1),
                                extra_labels={"cluster": "test"})
        now = time.time()
        message = AlertMessage(
            incident="inc-am-1", job="llama", kind="hang", severity="critical",
            summary="no step finished for 42 s", ranks=[2], nodes=["n1"], step=181,
            onset_ts=now - 42, detected_ts=now, ts=now,
            actions=[{"incident": "inc-am-1", "action": "restart",
                      "targets": {"nodes": ["n1"]}, "status": "done", "reason": "hang"}],
            stacks="[0-3] train > step\n  [2] next_batch  <== suspect")

        assert sink.send(message).ok
        [alert] = _active(base, "inc-am-1")
        assert alert["labels"] == {"alertname": "TrainguardHang", "training_job": "llama",
                                   "kind": "hang", "severity": "critical", "ranks": "2",
                                   "nodes": "n1", "incident": "inc-am-1",
                                   "cluster": "test"}
        assert alert["status"]["state"] == "active"
        assert "next_batch" in alert["annotations"]["description"]

        requests = rx.wait_for(lambda reqs: _alerts_in(reqs, "firing"), timeout=10)
        [forwarded] = _alerts_in(requests, "firing")
        assert forwarded["labels"]["incident"] == "inc-am-1"
        assert forwarded["annotations"]["summary"].startswith("[CRITICAL] hang in job llama")

        assert sink.send(message.resolved(ts=time.time(), note="resumed at step 182")).ok
        requests = rx.wait_for(lambda reqs: _alerts_in(reqs, "resolved"), timeout=10)
        [resolved] = _alerts_in(requests, "resolved")
        assert resolved["labels"]["incident"] == "inc-am-1"
        deadline = time.monotonic() + 5
        while _active(base, "inc-am-1") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _active(base, "inc-am-1") == []
