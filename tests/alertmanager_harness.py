"""A real Alertmanager (Debian's ``prometheus-alertmanager``) on loopback for tests, forwarding
every alert to a local webhook receiver."""
from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

BINARY = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
MISSING = ("no Alertmanager binary: apt-get install prometheus-alertmanager "
           "(scripts/test.sh does it when run as root)")

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str):
    with urllib.request.urlopen(url, timeout=2) as resp:
        return resp.status, resp.read()


def _wait_ready(proc: subprocess.Popen, base: str, log_path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"alertmanager exited with {proc.returncode}:\n"
                        f"{log_path.read_text()[-2000:]}")
        try:
            if get(base + "/-/ready")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    pytest.fail(f"alertmanager not ready in {timeout} s:\n{log_path.read_text()[-2000:]}")


@contextlib.contextmanager
def alertmanager(tmp_path, receiver_url: str):
    """Yields the base URL of a running Alertmanager whose receiver posts to ``receiver_url``."""
    if BINARY is None:
        pytest.skip(MISSING)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "alertmanager.log"
    config = tmp_path / "alertmanager.yml"
    config.write_text(CONFIG.format(url=receiver_url))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [BINARY, f"--config.file={config}", f"--storage.path={tmp_path / 'am-data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address=",
             "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_ready(proc, base, log_path)
        yield base
    finally:
        proc.kill()
        proc.wait(10)


def active(base: str, **labels) -> list[dict]:
    matchers = [f'{k}="{v}"' for k, v in labels.items()]
    query = urllib.parse.urlencode([("filter", m) for m in matchers])
    status, body = get(f"{base}/api/v2/alerts?{query}")
    assert status == 200
    return json.loads(body)


def alerts_in(requests, status, path="/am"):
    found = []
    for r in requests:
        if r.path == path and r.method == "POST":
            found += [a for a in r.json()["alerts"] if a["status"] == status]
    return found
