"""Scores a detector's incidents against a scenario's truth (tests/scenarios.py).

An incident *matches* a truth when its kind is the truth's (``loss_spike`` and ``grad_spike``
both match ``spike``) and it was detected no earlier than 5 s before the truth's onset; the
earliest such incident is taken, each incident matching at most one truth. Incidents that
match nothing are false incidents. Localization is *exact* when the incident's ranks are the
truth's and, where the truth names machines, its machines too.

>>> from types import SimpleNamespace as T
>>> truth = [T(kind="crash", ranks=[3], nodes=[], onset_ts=10.0, limit_s=2.0, limit_steps=None)]
>>> s = score([{"kind": "crash", "ranks": [3], "nodes": [], "detected_ts": 11.0}], truth, [])
>>> s["found"], s["false"], s["exact"], s["results"][0]["latency_s"], s["results"][0]["ok"]
(1, 0, 1, 1.0, True)
"""
from __future__ import annotations

import bisect

GROUP = {"loss_spike": "spike", "grad_spike": "spike"}
EARLY_S = 5.0


def group(kind: str) -> str:
    return GROUP.get(kind, kind)


def score(incidents: list, truth: list, step_ends: list) -> dict:
    """``{"found", "false", "exact", "results": [per truth], "false_incidents": [...]}``."""
    free = sorted(incidents, key=lambda i: i["detected_ts"])
    used = set()
    results = []
    for t in truth:
        match = None
        for n, inc in enumerate(free):
            if n in used or group(inc["kind"]) != t.kind:
                continue
            if inc["detected_ts"] >= t.onset_ts - EARLY_S:
                match = n
                break
        if match is None:
            results.append({"kind": t.kind, "label": getattr(t, "label", ""), "found": False,
                            "exact": False, "latency_s": None, "latency_steps": None,
                            "ok": False})
            continue
        used.add(match)
        inc = free[match]
        latency = max(0.0, inc["detected_ts"] - t.onset_ts)
        steps = (bisect.bisect_right(step_ends, inc["detected_ts"])
                 - bisect.bisect_right(step_ends, t.onset_ts))
        exact = sorted(inc["ranks"]) == sorted(t.ranks) and (
            not t.nodes or sorted(inc["nodes"]) == sorted(t.nodes))
        ok = (latency <= t.limit_s) if t.limit_steps is None else (steps <= t.limit_steps)
        results.append({"kind": t.kind, "label": getattr(t, "label", ""), "found": True,
                        "exact": exact, "latency_s": round(latency, 3),
                        "latency_steps": steps, "ok": ok,
                        "got": {"kind": inc["kind"], "ranks": inc["ranks"],
                                "nodes": inc["nodes"]},
                        "want": {"ranks": t.ranks, "nodes": t.nodes}})
    false = [{k: inc.get(k) for k in ("kind", "ranks", "nodes", "severity", "summary")}
             for n, inc in enumerate(free) if n not in used]
    return {"found": sum(r["found"] for r in results), "false": len(false),
            "exact": sum(r["exact"] for r in results), "results": results,
            "false_incidents": false}
