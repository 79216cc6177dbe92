"""The Alertmanager sink against a real Alertmanager (Debian's ``prometheus-alertmanager``),
on loopback, forwarding to a local webhook receiver: firing, then resolved with ``endsAt``."""
from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from http_receiver import HttpReceiver

from trainguard.actions.alerts import AlertMessage, AlertmanagerSink, Delivery

BINARY = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(BINARY is None, reason="no Alertmanager binary: apt-get install "
                       "prometheus-alertmanager (scripts/test.sh does it when run as root)"),
]

CONFIG = """\
route:
  receiver: hook
  group_by: [incident]
  group_wait: 1s
  group_interval: 1s
  repeat_interval: 1h
receivers:
  - name: hook
    webhook_configs:
      - url: {url}
        send_resolved: true
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=2) as resp:
        return resp.status, resp.read()


def _wait_ready(proc: subprocess.Popen, base: str, log_path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"alertmanager exited with {proc.returncode}:\n"
                        f"{log_path.read_text()[-2000:]}")
        try:
            if _get(base + "/-/ready")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    pytest.fail(f"alertmanager not ready in {timeout} s:\n{log_path.read_text()[-2000:]}")


def _active(base: str, incident: str) -> list[dict]:
    query = urllib.parse.urlencode({"filter": f'incident="{incident}"'})
    status, body = _get(f"{base}/api/v2/alerts?{query}")
    assert status == 200
    return json.loads(body)


def _alerts_in(requests, status):
    found = []
    for r in requests:
        if r.path == "/am" and r.method == "POST":
            body = r.json()
            found += [a for a in body["alerts"] if a["status"] == status]
    return found


def test_real_alertmanager_receives_forwards_and_resolves(tmp_path):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "alertmanager.log"
    with HttpReceiver() as rx:
        config = tmp_path / "alertmanager.yml"
        config.write_text(CONFIG.format(url=rx.url("/am")))
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [BINARY, f"--config.file={config}", f"--storage.path={tmp_path / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
                 "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            _wait_ready(proc, base, log_path)
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
            assert alert["labels"] == {"alertname": "TrainguardHang", "job": "llama",
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
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
