"""Slack incoming webhook, with Block Kit blocks (and ``text`` as the notification fallback).

>>> from trainguard.actions.alerts.message import AlertMessage
>>> m = AlertMessage(incident="i-1", job="j1", kind="crash", severity="critical",
...                  summary="rank 3 exited with signal SIGKILL", ranks=[3], nodes=["n2"])
>>> sink = SlackSink(url="https://hooks.slack.com/services/T0/B0/secret")
>>> sink
SlackSink(url='https://hooks.slack.com/***')
>>> p = sink.payload(m)
>>> [b["type"] for b in p["blocks"]]
['header', 'section', 'context']
>>> p["blocks"][0]["text"]["text"]
'[CRITICAL] crash in job j1'
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import HttpRequest, Sink, dumps
from .message import AlertMessage

__all__ = ["SlackSink", "slack_escape"]

HEADER_MAX = 150
SECTION_MAX = 3000


def slack_escape(text: str) -> str:
    """Slack's three control characters in mrkdwn.

    >>> slack_escape("a<b> & c")
    'a&lt;b&gt; &amp; c'
    """
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(kw_only=True, repr=False, eq=False)
class SlackSink(Sink):
    """``url``: the incoming-webhook URL (a secret: whoever has it can post)."""

    KIND: ClassVar[str] = "slack"
    SECRETS: ClassVar[tuple[str, ...]] = ("url",)

    url: str

    def payload(self, message: AlertMessage) -> dict:
        e = slack_escape
        fields = [f"*What:* {e(message.what())}", f"*Where:* {e(message.where())}"]
        if message.state == "firing":
            fields.append(f"*Done:* {e(message.done())}")
        blocks = [
            {"type": "header",
             "text": {"type": "plain_text", "text": _cut(message.title, HEADER_MAX)}},
            {"type": "section",
             "text": {"type": "mrkdwn", "text": _cut("\n".join(fields), SECTION_MAX)}},
        ]
        stack = message.stack_lines() if message.state == "firing" else []
        if stack:
            body = _cut(e("\n".join(stack)), SECTION_MAX - 20)
            blocks.append({"type": "section",
                           "text": {"type": "mrkdwn", "text": f"*Stacks:*\n```{body}```"}})
        context = f"incident `{e(message.incident)}` · job `{e(message.job)}`"
        if message.detector:
            context += f" · detector `{e(message.detector)}`"
        blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": context}]})
        return {"text": _cut(e(f"{message.title}: {message.what()}"), SECTION_MAX),
                "blocks": blocks}

    def request(self, message: AlertMessage) -> HttpRequest:
        return HttpRequest(url=self.url, body=dumps(self.payload(message)))
