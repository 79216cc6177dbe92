"""Safety caps, approval and dry-run over the planned decisions of one incident
(:func:`apply_limits`), and when a restart already deals with an incident
(:func:`covering_restart`, :func:`restart_over`). Pure: the ledger is read through its
:class:`~trainguard.actions.interfaces.SafetyRecord` interface, and time is given."""
from __future__ import annotations

from dataclasses import replace

from trainguard.actions.model import JOB_ACTIONS, Decision, Incident

__all__ = ["apply_limits", "covering_restart", "restart_over", "HARDWARE_KINDS", "DAY_S"]

#: Kinds that no restart of ours explains: their alert goes out even when another
#: incident's restart covers theirs.
HARDWARE_KINDS = ("gpu_fault", "gpu_degraded", "machine_outlier")
DAY_S = 86400.0


def restart_over(ordered_ts: float, launches=(), settle_s: float = 120.0,
                 satisfied: bool = False) -> float:
    """When a restart ordered at ``ordered_ts`` is over: the next launch after it (by
    ``trainguard run``, or the new run's first rank start), at most ``settle_s`` later.
    Until then, ranks exiting "by signal" are our own doing; a problem beginning later is a
    new one. A restart that ``trainguard run`` answered ``already_satisfied`` (it had
    relaunched the job on its own after the incident began) tore nothing down: it was over
    when it was ordered.

    >>> restart_over(100.0, launches=[50.0, 104.5]), restart_over(100.0, settle_s=30)
    (104.5, 130.0)
    >>> restart_over(100.0, launches=[150.0], satisfied=True)
    100.0
    """
    if satisfied:
        return ordered_ts
    after = sorted(t for t in launches if t >= ordered_ts)
    return min(after[0], ordered_ts + settle_s) if after else ordered_ts + settle_s


def covering_restart(state, incident: Incident, launches=(), settle_s: float = 120.0,
                     satisfied=frozenset()):
    """``(restart entry, code, reason)`` of a restart of the job that already deals with this
    incident, or None: one ordered for another incident after this one began (``covered``),
    or one under way when this one began (``expected``; see :func:`restart_over`;
    ``satisfied``: the incidents whose restart ``trainguard run`` acked
    ``already_satisfied``)."""
    for r in state.restarts_since(incident.job, incident.onset_ts):
        if r["incident"] != incident.id:
            return r, "covered", (f"covered: job {incident.job} was already restarted for "
                                  f"incident {r['incident']} after this incident began")
    for r in state.restarts_since(incident.job, incident.onset_ts - settle_s):
        if r["incident"] != incident.id and \
                r["ts"] <= incident.onset_ts <= restart_over(r["ts"], launches, settle_s,
                                                             r["incident"] in satisfied):
            return r, "expected", (f"expected: began while job {incident.job} was being "
                                   f"restarted for incident {r['incident']}")
    return None


def apply_limits(decisions: list, incident: Incident, policy, state,
                 now: float, launches=(), satisfied=frozenset()) -> list:
    """Safety caps, approval and dry-run, in this order, on the planned decisions:

    - restart/rollback: ``covered``/``expected`` (see :func:`covering_restart`; unless
      machines are evicted now, which needs a new launch: rate-limited and no alert),
      ``restart_cap`` (``max_restarts`` in ``restart_window_s``: rate-limited, and a human
      is paged);
    - evict: ``evict_cap`` per incident and per day (rate-limited, paged; the restart goes
      on without excluding those machines);
    - ``approval_required`` (actions in ``require_approval``) and ``dry_run``: recorded as
      ``dry_run``, an alert tells humans what would have been done.

    ``policy`` is the :class:`~trainguard.actions.policy.Policy` (its ``limits``,
    ``require_approval`` and ``dry_run``), ``state`` the ledger as
    :class:`~trainguard.actions.interfaces.SafetyRecord`.
    """
    lim, job = policy.limits, incident.job
    out, pages, blocked = [], [], set()
    evicting = any(d.action == "evict" and d.status == "planned"
                   and d.code != "evict_if_repeated" for d in decisions)
    cover = None if evicting else covering_restart(state, incident, launches,
                                                   lim.restart_settle_s, satisfied)
    for d in decisions:
        if d.status != "planned" or d.action not in JOB_ACTIONS:
            out.append(d)
            continue
        if d.action == "evict" and cover:  # a repeat that our own restart explains
            blocked |= set(d.targets.get("nodes", []))
            out.append(d.with_status("rate_limited", f"{cover[2]} {now - cover[0]['ts']:.0f}s "
                                                     "ago; not a repeated failure", cover[1]))
            continue
        if d.action == "evict":
            nodes = d.targets.get("nodes", [])
            per_incident = len(state.incident_evictions(incident.id)) + len(nodes)
            per_day = len(state.evictions_since(now - DAY_S)) + len(nodes)
            if per_incident > lim.max_evictions_per_incident:
                why = (f"evict_cap: evicting {len(nodes)} more machine(s) would make "
                       f"{per_incident} for incident {incident.id} (limit "
                       f"{lim.max_evictions_per_incident})")
            elif per_day > lim.max_evictions_per_day:
                why = (f"evict_cap: evicting {len(nodes)} more machine(s) would make {per_day} "
                       f"in 24h (limit {lim.max_evictions_per_day})")
            else:
                why = None
            if why:
                blocked |= set(nodes)
                pages.append(why)
                out.append(d.with_status("rate_limited", why, "evict_cap"))
                continue
        else:
            if blocked:
                kept = [n for n in d.targets.get("exclude_nodes", []) if n not in blocked]
                d = replace(d, targets={**d.targets, "exclude_nodes": kept})
            in_window = state.restarts_since(job, now - lim.restart_window_s)
            if cover:
                d = replace(d, targets={**d.targets, "settled_by_ts": cover[0]["ts"]})
                out.append(d.with_status("rate_limited", (
                    f"{cover[2]} {now - cover[0]['ts']:.0f}s ago"), cover[1]))
                continue
            if len(in_window) >= lim.max_restarts:
                why = (f"restart_cap: {len(in_window)} restarts of job {job} in the last "
                       f"{lim.restart_window_s:g}s (limit {lim.max_restarts}); automatic "
                       f"restarts stop, a human must look")
                pages.append(why)
                out.append(d.with_status("rate_limited", why, "restart_cap"))
                continue
        if d.action in policy.require_approval:
            d = d.with_status("dry_run", f"approval_required: {d.action} needs a human's "
                                         f"approval (policy require_approval); {d.reason}",
                              "approval_required")
        elif policy.dry_run:
            d = d.with_status("dry_run", f"dry_run: would {d.action}; {d.reason}", "dry_run")
        out.append(d)
    if cover and incident.kind not in HARDWARE_KINDS and \
            any(d.code in ("covered", "expected") for d in out):
        out = [d for d in out if d.action != "alert"]  # the other incident's alert said it
    last_page = state.last_page(job)
    if pages and (last_page is None or now - last_page >= lim.page_cooldown_s):
        out.append(Decision(action="alert", severity="critical", reason="page: " + "; ".join(
            pages), code="page", targets={"job": job, "ranks": list(incident.ranks),
                                          "nodes": list(incident.nodes), "page": True}))
    needs_human = any(d.code == "approval_required" for d in out)
    if needs_human and not any(d.action == "alert" and d.status == "planned" for d in out):
        out.append(Decision(action="alert", severity="critical", targets={"job": job},
                            code="approval_required",
                            reason=f"approval_required: {incident.kind}: {incident.summary}"))
    return out
