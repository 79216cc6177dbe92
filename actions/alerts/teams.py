"""Microsoft Teams through a Workflows (Power Automate) webhook, as an Adaptive Card 1.4.

The flow "Post to a channel when a webhook request is received" takes a ``message`` whose
attachments are Adaptive Cards. Its URL carries a ``sig`` query parameter, a secret.

>>> from trainguard.actions.alerts.message import AlertMessage
>>> m = AlertMessage(incident="i-1", job="j1", kind="gpu_fault", severity="critical",
...                  summary="Xid 79 on GPU 3", ranks=[24, 25], nodes=["n4"])
>>> p = TeamsSink(url="https://prod.westus.logic.azure.com/workflows/x?sig=abc123").payload(m)
>>> att = p["attachments"][0]
>>> p["type"], att["contentType"], att["content"]["type"], att["content"]["version"]
('message', 'application/vnd.microsoft.card.adaptive', 'AdaptiveCard', '1.4')
>>> [f["title"] for f in att["content"]["body"][1]["facts"]]
['What', 'Where', 'Done']
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .base import HttpRequest, Sink, dumps
from .message import AlertMessage

__all__ = ["TeamsSink"]

COLORS = {"critical": "Attention", "warning": "Warning", "info": "Accent", "resolved": "Good"}


@dataclass(kw_only=True, repr=False, eq=False)
class TeamsSink(Sink):
    """``url``: the workflow's HTTP trigger URL (secret: its ``sig`` authorizes posting)."""

    KIND: ClassVar[str] = "teams"
    SECRETS: ClassVar[tuple[str, ...]] = ("url",)

    url: str

    def card(self, message: AlertMessage) -> dict:
        color = COLORS["resolved" if message.state == "resolved" else message.severity]
        facts = [{"title": "What", "value": message.what()},
                 {"title": "Where", "value": message.where()}]
        if message.state == "firing":
            facts.append({"title": "Done", "value": message.done()})
        body: list[dict] = [
            {"type": "TextBlock", "text": message.title, "weight": "Bolder", "size": "Medium",
             "color": color, "wrap": True},
            {"type": "FactSet", "facts": facts},
        ]
        stack = message.stack_lines() if message.state == "firing" else []
        if stack:
            body += [{"type": "TextBlock", "text": "Stacks", "weight": "Bolder",
                      "spacing": "Medium"},
                     {"type": "TextBlock", "text": "\n\n".join(stack), "fontType": "Monospace",
                      "size": "Small", "wrap": True, "spacing": "None"}]
        body.append({"type": "TextBlock", "text": f"incident {message.incident} · job "
                                                  f"{message.job}",
                     "isSubtle": True, "size": "Small", "wrap": True})
        return {"$schema": "http://adaptivecards.io/schemas/adaptive-card.json",
                "type": "AdaptiveCard", "version": "1.4", "body": body,
                "msteams": {"width": "Full"}}

    def payload(self, message: AlertMessage) -> dict:
        return {"type": "message",
                "attachments": [{"contentType": "application/vnd.microsoft.card.adaptive",
                                 "contentUrl": None, "content": self.card(message)}]}

    def request(self, message: AlertMessage) -> HttpRequest:
        return HttpRequest(url=self.url, body=dumps(self.payload(message)))
