"""A tiny local HTTP receiver for tests: records every request, answers from a script.

    with HttpReceiver() as rx:                 # 127.0.0.1, a free port, a daemon thread
        rx.script([(500, b"busy"), (200, b"ok")])   # answers in order, then `default`
        post(rx.url("/hook"), ...)
        rx.wait_for(lambda reqs: len(reqs) >= 2)
        rx.requests[0].json()
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict
    body: bytes
    at: float = field(default_factory=time.monotonic)

    def json(self):
        return json.loads(self.body)


class HttpReceiver:
    def __init__(self, default: tuple[int, bytes] = (200, b"ok"),
                 content_type: str = "text/plain"):
        self.default = default
        self.content_type = content_type
        self.requests: list[Recorded] = []
        self._answers: list[tuple] = []
        self._cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with receiver._cond:
                    receiver.requests.append(Recorded(self.command, self.path,
                                                      dict(self.headers.items()), body))
                    answer = receiver._answers.pop(0) if receiver._answers else receiver.default
                    receiver._cond.notify_all()
                status, payload, *extra = answer
                headers = extra[0] if extra else {}
                self.send_response(status)
                self.send_header("Content-Type", receiver.content_type)
                self.send_header("Content-Length", str(len(payload)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(payload)

            do_POST = do_PUT = do_GET = do_PATCH = do_DELETE = _handle

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True,
                                        name=f"http-receiver-{self.port}")

    def url(self, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def script(self, answers: list[tuple]) -> None:
        """Answers ``(status, body[, headers])`` for the next requests, in order."""
        with self._cond:
            self._answers = list(answers)

    def wait_for(self, predicate: Callable[[list[Recorded]], bool],
                 timeout: float = 10.0) -> list[Recorded]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self.requests):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"receiver: condition not met in {timeout} s; "
                                       f"got {len(self.requests)} requests")
                self._cond.wait(left)
            return list(self.requests)

    def start(self) -> "HttpReceiver":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> "HttpReceiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
