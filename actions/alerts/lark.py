"""Lark / Feishu custom bot, an interactive card, signed when the bot has a secret.

Feishu's signature check ("签名校验"): ``string_to_sign = f"{timestamp}\\n{secret}"`` is the
HMAC-SHA256 *key*, the message is empty, and ``sign`` is the base64 of the digest; the body
carries ``timestamp`` (seconds, as a string) and ``sign``. The bot refuses a timestamp more than
an hour off. Feishu answers HTTP 200 even on failure, with a non-zero ``code``
(``StatusCode`` in older answers); that is treated as a failure, retried only for its rate
limit (code 9499).

>>> lark_sign(1599360473, "demo-secret")
'3/MaVZ8JLIy4TUG+7KSFJqvUkTKd+HWY8g+56DZWq8s='
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from dataclasses import dataclass
from typing import Callable, ClassVar

from .base import HttpRequest, Sink, SinkFailure, dumps
from .message import AlertMessage

__all__ = ["LarkSink", "lark_sign"]

TEMPLATES = {"critical": "red", "warning": "orange", "info": "blue", "resolved": "green"}
RATE_LIMIT_CODE = 9499


def lark_sign(timestamp: int | str, secret: str) -> str:
    """Feishu's bot signature of ``timestamp`` with ``secret``."""
    string_to_sign = f"{timestamp}\n{secret}".encode("utf-8")
    digest = hmac.new(string_to_sign, b"", digestmod=hashlib.sha256).digest()
    return base64.b64encode(digest).decode("ascii")


def _md(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


@dataclass(kw_only=True, repr=False, eq=False)
class LarkSink(Sink):
    """``url``: the bot webhook; ``secret``: its signing secret, if signature check is on."""

    KIND: ClassVar[str] = "lark"
    SECRETS: ClassVar[tuple[str, ...]] = ("url", "secret")

    url: str
    secret: str | None = None
    wall_clock: Callable[[], float] = time.time

    def card(self, message: AlertMessage) -> dict:
        template = TEMPLATES["resolved" if message.state == "resolved" else message.severity]
        fields = [f"**What:** {_md(message.what())}", f"**Where:** {_md(message.where())}"]
        if message.state == "firing":
            fields.append(f"**Done:** {_md(message.done())}")
        elements: list[dict] = [{"tag": "div",
                                 "text": {"tag": "lark_md", "content": "\n".join(fields)}}]
        stack = message.stack_lines() if message.state == "firing" else []
        if stack:
            elements += [{"tag": "hr"},
                         {"tag": "div", "text": {"tag": "plain_text",
                                                 "content": "Stacks:\n" + "\n".join(stack)}}]
        elements.append({"tag": "note", "elements": [
            {"tag": "plain_text", "content": f"incident {message.incident} · job {message.job}"}]})
        return {"config": {"wide_screen_mode": True},
                "header": {"title": {"tag": "plain_text", "content": message.title},
                           "template": template},
                "elements": elements}

    def payload(self, message: AlertMessage) -> dict:
        body: dict = {"msg_type": "interactive", "card": self.card(message)}
        if self.secret:
            timestamp = str(int(self.wall_clock()))
            body = {"timestamp": timestamp, "sign": lark_sign(timestamp, self.secret), **body}
        return body

    def request(self, message: AlertMessage) -> HttpRequest:
        return HttpRequest(url=self.url, body=dumps(self.payload(message)))

    def check(self, status: int, body: bytes) -> None:
        try:
            answer = json.loads(body or b"{}")
        except ValueError:
            return
        if not isinstance(answer, dict):
            return
        code = answer.get("code", answer.get("StatusCode", 0))
        if code not in (0, None):
            msg = answer.get("msg", answer.get("StatusMessage", ""))
            raise SinkFailure(self._scrub(f"Lark answered code {code}: {str(msg)[:200]}"),
                              retryable=code == RATE_LIMIT_CODE, http_status=status)
