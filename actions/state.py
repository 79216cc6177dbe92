"""What the action service remembers across its own restarts, so that it never acts twice.

The ledger holds the incidents handled (with every action recorded for each), the anomaly
ids seen, the restarts and evictions with their times (for the safety caps), the machines'
failures (for "evict when the same machine fails again"), and when a human was last paged.
It is kept in a small JSON file, written atomically (temporary file, fsync, rename) after
every decision, and it can be rebuilt from the ``action`` records of the actions topic
(:meth:`ServiceState.absorb`), which the service reads back at start-up.

>>> state = ServiceState()
>>> from trainguard.actions.model import Decision, Incident
>>> inc = Incident(id="i1", job="j1", kind="crash", severity="critical", ranks=[1],
...                nodes=["n1"], onset_ts=100.0, detected_ts=101.0, summary="rank 1 exited 1")
>>> state.note_incident(inc, ts=101.0)
>>> state.note(Decision(action="restart", reason="crash", targets={"job": "j1"}), inc, ts=102.0)
>>> state.history(inc).done, len(state.restarts_since("j1", since=0.0))
({'restart': 'planned'}, 1)
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from trainguard.actions.model import RELAUNCHES, Decision, History, Incident
from trainguard.files import write_atomic
from trainguard.logs import service_logger

__all__ = ["ServiceState", "FORMAT", "COUNTED"]

FORMAT = 1
COUNTED = ("planned", "done", "dry_run")  # statuses that count as "this was decided"
_RANK = {"failed": 0, "rate_limited": 1, "dry_run": 2, "planned": 3, "done": 4}
FAILURE_KINDS = ("crash", "gpu_fault")
DEFAULT_HORIZON_S = 2 * 86400.0


class ServiceState:
    """The ledger; ``path=None`` keeps it in memory only."""

    def __init__(self, path: str | Path | None = None, horizon_s: float = DEFAULT_HORIZON_S,
                 save_every_s: float = 0.0):
        self.path = Path(path) if path else None
        self.horizon_s = horizon_s
        self.save_every_s = save_every_s
        self._saved_at = None
        self._unsaved = False
        self.incidents: dict[str, dict] = {}
        self.seen: dict[str, float] = {}
        self.restarts: list[dict] = []
        self.evictions: list[dict] = []
        self.failures: list[dict] = []
        self.pages: dict[str, float] = {}
        self.excluded: dict[str, list] = {}

    # ------------------------------------------------------------------ file
    @classmethod
    def load(cls, path: str | Path | None, horizon_s: float = DEFAULT_HORIZON_S,
             log=None, save_every_s: float = 0.0) -> "ServiceState":
        """The ledger of ``path``; empty when the file is missing. A file that cannot be read
        back is moved aside (``<name>.corrupt-<time>``) and the ledger starts empty."""
        state = cls(path, horizon_s, save_every_s)
        if not path or not Path(path).exists():
            return state
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
            state.incidents = dict(data["incidents"])
            state.seen = dict(data["seen"])
            state.restarts = list(data["restarts"])
            state.evictions = list(data["evictions"])
            state.failures = list(data["failures"])
            state.pages = dict(data["pages"])
            state.excluded = dict(data["excluded"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            aside = Path(f"{path}.corrupt-{int(time.time())}")
            os.replace(path, aside)
            (log or _stderr)(f"state file {path} unreadable ({exc}); moved to {aside}, "
                             "starting empty (the actions topic is read back)")
            return cls(path, horizon_s, save_every_s)
        return state

    def to_dict(self) -> dict:
        return {"format": FORMAT, "incidents": self.incidents, "seen": self.seen,
                "restarts": self.restarts, "evictions": self.evictions,
                "failures": self.failures, "pages": self.pages, "excluded": self.excluded}

    def save(self, now: float | None = None) -> None:
        """Prune what is older than the horizon, then write atomically; with
        ``save_every_s``, at most that often (:meth:`save_pending` writes what is left):
        under a burst of anomalies the ledger is not rewritten for each one (the records on
        the actions topic, read back at start-up, cover the gap)."""
        if self.save_every_s and self._saved_at is not None \
                and time.monotonic() - self._saved_at < self.save_every_s:
            self._unsaved = True
            return
        if now is not None:
            self.prune(now)
        self._unsaved = False
        self._saved_at = time.monotonic()
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps(self.to_dict(), separators=(",", ":")),
                     durable=True)

    def save_pending(self, now: float | None = None) -> None:
        """Write what :meth:`save` held back, if anything."""
        if self._unsaved:
            self._saved_at = None
            self.save(now)

    def prune(self, now: float) -> None:
        cut = now - self.horizon_s
        self.incidents = {k: v for k, v in self.incidents.items() if v["last_ts"] >= cut}
        self.seen = {k: v for k, v in self.seen.items() if v >= cut}
        self.restarts = [r for r in self.restarts if r["ts"] >= cut]
        self.evictions = [e for e in self.evictions if e["ts"] >= cut]
        self.failures = [f for f in self.failures if f["ts"] >= cut]
        self.pages = {k: v for k, v in self.pages.items() if v >= cut}

    # ------------------------------------------------------------------ queries
    def seen_anomaly(self, anomaly_id: str) -> bool:
        return anomaly_id in self.seen

    def known_incident(self, incident_id: str) -> bool:
        return incident_id in self.incidents

    def history(self, incident: Incident) -> History:
        entry = self.incidents.get(incident.id, {})
        failures: dict[str, list] = {}
        for f in self.failures:  # earlier episodes only: failures whose restart came before
            restarted = self.restart_ts(f["incident"])
            if f["job"] == incident.job and f["incident"] != incident.id \
                    and restarted is not None and restarted <= incident.onset_ts:
                failures.setdefault(f["node"], []).append(f["ts"])
        same_kind = [e["first_ts"] for k, e in self.incidents.items()
                     if k != incident.id and e.get("job") == incident.job
                     and e.get("kind") == incident.kind and "first_ts" in e]
        return History(done=dict(entry.get("actions", {})), node_failures=failures,
                       excluded_nodes=list(self.excluded.get(incident.job, [])),
                       first_seen_ts=entry.get("first_ts"), same_kind_ts=same_kind)

    def restart_ts(self, incident_id: str) -> float | None:
        """When a restart or rollback was first decided for the incident."""
        times = [r["ts"] for r in self.restarts if r["incident"] == incident_id]
        return min(times) if times else None

    def settled_ts(self, incident_id: str) -> float | None:
        """When the restart that dealt with the incident was ordered: its own, or the one
        that covered it (``targets.settled_by_ts`` of its rate-limited restart)."""
        return self.incidents.get(incident_id, {}).get("settled_ts")

    def incident_kind(self, incident_id: str) -> str | None:
        return self.incidents.get(incident_id, {}).get("kind")

    def restarts_since(self, job: str, since: float) -> list[dict]:
        return [r for r in self.restarts if r["job"] == job and r["ts"] >= since]

    def evictions_since(self, since: float) -> list[dict]:
        return [e for e in self.evictions if e["ts"] >= since]

    def incident_evictions(self, incident_id: str) -> list[dict]:
        return [e for e in self.evictions if e["incident"] == incident_id]

    def last_page(self, job: str) -> float | None:
        return self.pages.get(job)

    # ------------------------------------------------------------------ updates
    def note_incident(self, incident: Incident, ts: float) -> None:
        """An incident passed de-duplication: remember it, its anomalies and its failures."""
        entry = self.incidents.setdefault(incident.id, {
            "job": incident.job, "kind": incident.kind, "first_ts": ts, "actions": {}})
        entry["last_ts"] = ts
        entry["kind"] = incident.kind
        for anomaly_id in incident.anomalies:
            self.seen[anomaly_id] = ts
        if incident.kind in FAILURE_KINDS:
            known = {(f["node"], f["incident"]) for f in self.failures}
            for node in incident.nodes:
                if (node, incident.id) not in known:
                    self.failures.append({"job": incident.job, "node": node,
                                          "ts": incident.detected_ts, "incident": incident.id})

    def note(self, decision: Decision, incident: Incident, ts: float) -> None:
        """A decision was recorded."""
        self._note(incident.id, incident.job, incident.kind, decision.action, decision.status,
                   decision.targets, ts, page=decision.action == "alert"
                   and bool(decision.targets.get("page")))

    def note_page(self, job: str, ts: float) -> None:
        self.pages[job] = ts

    def _note(self, incident_id, job, kind, action, status, targets, ts, page=False):
        entry = self.incidents.setdefault(incident_id, {
            "job": job, "kind": kind, "first_ts": ts, "actions": {}})
        entry["last_ts"] = max(ts, entry.get("last_ts", ts))
        old = entry["actions"].get(action)
        if old is None or _RANK.get(status, 0) >= _RANK.get(old, 0):
            entry["actions"][action] = status
        if action in RELAUNCHES and "settled_ts" not in entry:
            if status in COUNTED:
                entry["settled_ts"] = ts
            elif isinstance(targets.get("settled_by_ts"), (int, float)):
                entry["settled_ts"] = targets["settled_by_ts"]
        if old in COUNTED:
            return  # the ledgers below already count this action of this incident
        if status in COUNTED and action in RELAUNCHES:
            self.restarts.append({"job": job, "ts": ts, "incident": incident_id,
                                  "status": status})
        if status in COUNTED and action == "evict":
            for node in targets.get("nodes", []):
                self.evictions.append({"job": job, "node": node, "ts": ts,
                                       "incident": incident_id, "status": status})
            if status != "dry_run":
                merged = set(self.excluded.get(job, [])) | set(targets.get("nodes", []))
                self.excluded[job] = sorted(merged)
        if page:
            self.pages[job] = ts

    def absorb(self, action) -> None:
        """Rebuild from one ``action`` record of the actions topic (the service's own, and the
        supervisor's ``done``/``failed`` replies to them)."""
        extra = action.extra or {}
        if extra.get("source") == "worker":
            return  # the worker's audit of a per-job override: no incident of ours
        if extra.get("source") == "supervisor" and action.incident not in self.incidents:
            return  # the supervisor's own crash restarts are its budget, not the service's
        targets = action.targets or {}
        for anomaly_id in extra.get("anomalies") or []:
            self.seen[anomaly_id] = max(self.seen.get(anomaly_id, 0.0), action.ts)
        kind = extra.get("kind", "")
        if kind in FAILURE_KINDS and action.incident not in self.incidents:
            for node in extra.get("nodes") or []:
                self.failures.append({"job": action.job, "node": node,
                                      "ts": extra.get("detected_ts", action.ts),
                                      "incident": action.incident})
        page = action.action == "alert" and bool(targets.get("page"))
        self._note(action.incident, action.job, kind, action.action, action.status, targets,
                   action.ts, page=page)


_stderr = service_logger("trainguard.actions.state", "trainguard actions", logging.WARNING,
                         stamp=False)

