"""What an alert says: one incident, what was done about it and what the stacks showed.

An :class:`AlertMessage` is built from a SPEC ``anomaly`` (or an incident of the same shape),
the SPEC ``action`` records of what the service did, and optionally the text tree of the
aggregated stacks. Every sink renders the same few lines:

>>> anomaly = {"v": 1, "type": "anomaly", "job": "llama-70b", "ts": 1764680042.5, "node": None,
...            "rank": None, "id": "inc-7", "kind": "hang", "severity": "critical",
...            "ranks": [2], "nodes": ["gpu-node-03"], "step": 181,
...            "onset_ts": 1764680000.0, "detected_ts": 1764680042.5, "detector": "hang",
...            "summary": "no rank finished a step for 42 s", "evidence": {"stalled_s": 42.5}}
>>> actions = [{"incident": "inc-7", "action": "capture_stacks", "targets": {"ranks": "all"},
...             "status": "done", "reason": "hang"},
...            {"incident": "inc-7", "action": "restart", "targets": {"nodes": ["gpu-node-03"]},
...             "status": "dry_run", "reason": "dry-run mode"}]
>>> stacks = "[0-3] train (train.py) > step (train.py)\\n  [0-1,3] all_reduce (distributed.py)"
>>> m = AlertMessage.from_anomaly(anomaly, actions, stacks, ts=1764680050.0)
>>> print(m.text())
[CRITICAL] hang in job llama-70b
What: no rank finished a step for 42 s (step 181, began 2025-12-02 12:53:20Z, detected 42 s later)
Where: rank 2 on gpu-node-03
Done: capture_stacks ranks=all: done (hang); restart gpu-node-03: dry_run (dry-run mode)
Stacks:
[0-3] train (train.py) > step (train.py)
  [0-1,3] all_reduce (distributed.py)
>>> r = m.resolved(ts=1764680200.0, note="training resumed at step 182")
>>> r.state, r.title, r.dedup_key
('resolved', '[RESOLVED] hang in job llama-70b', ('inc-7', 'resolved'))
>>> r.lines()[1]
'What: training resumed at step 182'
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import math
from dataclasses import dataclass, field
from typing import Any, Iterable
from trainguard.rank_sets import format_ranks

__all__ = ["AlertMessage", "format_ranks", "json_safe", "as_dict", "STATES"]

STATES = ("firing", "resolved")
SEVERITIES = ("info", "warning", "critical")
MAX_STACK_LINES = 12
MAX_STACK_CHARS = 1500


def json_safe(value: Any) -> Any:
    """A copy that plain JSON can carry: non-finite floats become SPEC strings.

    >>> json_safe({"loss": float("nan"), "xs": [1.0, float("-inf")]})
    {'loss': 'NaN', 'xs': [1.0, '-Infinity']}
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def as_dict(obj: Any) -> dict:
    """A SPEC event object (``trainguard.events``), another dataclass, or a mapping, as a dict."""
    if isinstance(obj, dict):
        return dict(obj)
    to_dict = getattr(obj, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    raise TypeError(f"expected a dict or an event object, got {type(obj).__name__}")


def _utc(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


def _duration(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _targets_text(targets: Any) -> str:
    if not isinstance(targets, dict):
        return ""
    parts = []
    for key, value in targets.items():
        if key == "nodes" and isinstance(value, list):
            parts.append(",".join(str(n) for n in value))
        elif key == "ranks" and isinstance(value, list) and all(isinstance(r, int) for r in value):
            parts.append(f"ranks {format_ranks(value)}")
        elif isinstance(value, (str, int, float, bool)) and not isinstance(value, dict):
            parts.append(f"{key}={value}")
    return " ".join(p for p in parts if p)


@dataclass(kw_only=True)
class AlertMessage:
    """One alert about one incident; ``state`` is ``firing`` or ``resolved``.

    ``anomaly`` and ``actions`` keep the SPEC JSON (non-finite numbers as strings) for sinks
    that carry it whole; ``ts`` is when the message was made (for a resolved one, the end).
    """

    incident: str
    job: str
    kind: str
    severity: str
    summary: str
    state: str = "firing"
    ranks: list = field(default_factory=list)
    nodes: list = field(default_factory=list)
    step: int | None = None
    onset_ts: float | None = None
    detected_ts: float | None = None
    ts: float | None = None
    detector: str | None = None
    actions: list = field(default_factory=list)
    stacks: str | None = None
    anomaly: dict | None = None
    note: str | None = None

    def __post_init__(self):
        for name in ("incident", "job", "kind"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"AlertMessage.{name} must be a non-empty string")
        if self.state not in STATES:
            raise ValueError(f"AlertMessage.state must be one of {STATES}, got {self.state!r}")
        if self.severity not in SEVERITIES:
            raise ValueError(f"AlertMessage.severity must be one of {SEVERITIES}, "
                             f"got {self.severity!r}")
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in self.ranks):
            raise ValueError("AlertMessage.ranks must be a list of int")
        if not all(isinstance(n, str) for n in self.nodes):
            raise ValueError("AlertMessage.nodes must be a list of str")
        self.ranks = sorted(set(self.ranks))
        self.nodes = sorted(set(self.nodes))

    @classmethod
    def from_anomaly(cls, anomaly: Any, actions: Iterable[Any] = (), stacks: str | None = None,
                     *, ts: float | None = None, incident: str | None = None) -> "AlertMessage":
        """From a SPEC anomaly (``ev.Anomaly`` or its dict) or an ``analyze --json`` incident.

        ``incident`` overrides the id (default: the dict's ``incident``, else its ``id``).
        """
        a = json_safe(as_dict(anomaly))
        acts = [json_safe(as_dict(x)) for x in actions]
        incident_id = incident or a.get("incident") or a.get("id")
        if not incident_id:
            raise ValueError("the anomaly has no id; pass incident=")
        return cls(incident=str(incident_id), job=str(a.get("job") or "unknown"),
                   kind=str(a.get("kind") or "unknown"),
                   severity=str(a.get("severity") or "warning"),
                   summary=str(a.get("summary") or ""), ranks=list(a.get("ranks") or []),
                   nodes=list(a.get("nodes") or []), step=a.get("step"),
                   onset_ts=_num(a.get("onset_ts")), detected_ts=_num(a.get("detected_ts")),
                   ts=ts, detector=a.get("detector"), actions=acts, stacks=stacks,
                   anomaly=a)

    def resolved(self, *, ts: float | None = None, note: str | None = None) -> "AlertMessage":
        """The same alert (same incident, ranks and nodes), now over."""
        return dataclasses.replace(self, state="resolved", ts=ts, note=note)

    @property
    def dedup_key(self) -> tuple[str, str]:
        return (self.incident, self.state)

    @property
    def title(self) -> str:
        tag = "RESOLVED" if self.state == "resolved" else self.severity.upper()
        return f"[{tag}] {self.kind} in job {self.job}"

    def what(self) -> str:
        if self.state == "resolved":
            return self.note or f"incident {self.incident} is over"
        facts = []
        if self.step is not None:
            facts.append(f"step {self.step}")
        if self.onset_ts is not None:
            facts.append(f"began {_utc(self.onset_ts)}")
            if self.detected_ts is not None:
                facts.append(f"detected {_duration(self.detected_ts - self.onset_ts)} later")
        text = self.summary or self.kind
        return f"{text} ({', '.join(facts)})" if facts else text

    def where(self) -> str:
        if self.ranks:
            who = f"rank{'s' if len(self.ranks) > 1 else ''} {format_ranks(self.ranks)}"
        else:
            who = "whole job"
        return f"{who} on {', '.join(self.nodes)}" if self.nodes else who

    def done(self) -> str:
        parts = []
        for a in self.actions:
            kind = a.get("action")
            if kind == "alert":
                continue
            targets = _targets_text(a.get("targets"))
            head = f"{kind} {targets}".strip() if kind != "none" else "no action"
            reason = a.get("reason")
            parts.append(f"{head}: {a.get('status')}" + (f" ({reason})" if reason else ""))
        return "; ".join(parts) if parts else "nothing yet (alert only)"

    def stack_lines(self, max_lines: int = MAX_STACK_LINES,
                    max_chars: int = MAX_STACK_CHARS) -> list[str]:
        """The stack tree, cut to a chat-sized piece."""
        if not self.stacks or not self.stacks.strip():
            return []
        lines = self.stacks.strip("\n").splitlines()
        kept, size = [], 0
        for line in lines:
            if len(kept) >= max_lines or size + len(line) + 1 > max_chars:
                break
            kept.append(line)
            size += len(line) + 1
        if len(kept) < len(lines):
            kept.append(f"... ({len(lines) - len(kept)} more lines)")
        return kept

    def lines(self) -> list[str]:
        """Title, then What / Where / Done, then the stacks; resolved: title, What, Where."""
        out = [self.title, f"What: {self.what()}", f"Where: {self.where()}"]
        if self.state == "resolved":
            return out
        out.append(f"Done: {self.done()}")
        stack = self.stack_lines()
        if stack:
            out += ["Stacks:", *stack]
        return out

    def text(self) -> str:
        return "\n".join(self.lines())


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
