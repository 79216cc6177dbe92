"""Alerts to chat and to Alertmanager: one message, five sinks, one ``send`` each.

>>> from trainguard.actions.alerts import AlertMessage, build_sinks, send_all
>>> m = AlertMessage(incident="i-1", job="j1", kind="nan", severity="warning",
...                  summary="loss became NaN at step 12", ranks=[0, 1, 2, 3], step=12)
>>> m.where()
'ranks 0-3'
>>> send_all(build_sinks({}), m)
[]

See docs/ALERTS.md for the configuration and what each sink sends.
"""
from .alertmanager import AlertmanagerSink
from .base import Delivery, Deduper, HttpRequest, SendResult, Sink, TokenBucket, mask_url
from .config import SINK_TYPES, AlertConfigError, build_sinks, send_all
from .lark import LarkSink, lark_sign
from .message import AlertMessage
from .slack import SlackSink
from .teams import TeamsSink
from .webhook import WebhookSink, webhook_signature

__all__ = ["AlertMessage", "Sink", "SendResult", "Delivery", "TokenBucket", "Deduper",
           "HttpRequest", "mask_url", "SlackSink", "LarkSink", "TeamsSink",
           "AlertmanagerSink", "WebhookSink", "build_sinks", "send_all", "SINK_TYPES",
           "AlertConfigError", "lark_sign", "webhook_signature"]
