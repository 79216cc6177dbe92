"""The HTML incident report: one self-contained page (inline CSS, SVG and a little JS).

Sections, each under a fixed element id:

``#summary``   the incidents (kind, ranks, when found, what was done) and, from the demo, the
               injected faults with their detection and recovery times;
``#heatmap``   per-rank compute time over steps (``step_time`` where ``compute_time`` is null;
               a redone step shows its latest run; long runs are binned to 400 columns);
``#loss``      the loss over steps (mean over ranks) with non-finite losses and anomalies marked;
``#timeline``  training progress over wall time, with faults, anomalies and actions;
``#stacks``    the stack prefix tree of each capture, suspect branches highlighted.

Inputs: ``analysis`` is ``trainguard analyze --json`` output (``incidents``; numeric top-level
extras such as ``ettr`` are shown too); ``events`` SPEC events (objects or dicts; step,
anomaly and action events are used); ``actions`` SPEC action records as dicts; ``captures``
``stacks analyze`` results (optional ``tree`` of ``{"frame"|"label", "ranks", "children"}``,
optional ``capture_id``/``incident``/``ts``); ``faults`` the demo's fault records.

>>> from trainguard import events as ev
>>> steps = [ev.Step(job="j", ts=100.0 + s, rank=r, step=s, step_time=0.1,
...                  compute_time=0.1 if r else 0.2, loss=3.0 - s / 10) for s in range(5) for r in range(2)]
>>> page = render_report({"incidents": []}, steps)
>>> all(f'id="{i}"' in page for i in ("summary", "heatmap", "loss", "timeline", "stacks"))
True
"""
from __future__ import annotations

import html
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Iterable

from trainguard import events as ev
from trainguard.files import write_atomic
from trainguard.rank_sets import format_ranks

__all__ = ["write_report", "render_report", "format_ranks"]

MAX_COLS = 400
WIDTH = 1100
KIND_COLOURS = {"nan": "#d62728", "loss_spike": "#ff7f0e", "grad_spike": "#e6a700",
                "straggler": "#9467bd", "throughput_drop": "#8c564b", "hang": "#e377c2",
                "gpu_fault": "#17becf", "gpu_degraded": "#7f7f7f", "crash": "#000000",
                "silent": "#bcbd22"}
VIRIDIS = ["#440154", "#3b528b", "#21918c", "#5ec962", "#fde725"]


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _colour(t: float) -> str:
    """Viridis at ``t`` in [0, 1]."""
    t = min(1.0, max(0.0, t)) * (len(VIRIDIS) - 1)
    i = min(int(t), len(VIRIDIS) - 2)
    a, b = VIRIDIS[i], VIRIDIS[i + 1]
    mix = [round(int(a[k:k + 2], 16) * (1 - (t - i)) + int(b[k:k + 2], 16) * (t - i)) for k in (1, 3, 5)]
    return "#%02x%02x%02x" % tuple(mix)


def _nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [first + k * step for k in range(int((hi - first) / step) + 1)]


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "–"
    return f"{x:.{digits}g}" if math.isfinite(x) else str(x)


# ----------------------------------------------------------------------------- gathering
class _Data:
    def __init__(self, events: Iterable[Any] | None):
        self.steps: dict[tuple[int, int], tuple[float, float | None, float | None]] = {}
        self.anomalies: dict[str, dict] = {}
        self.incidents: dict[str, dict] = {}     # the worker's incident events (SPEC §6)
        self.actions: list[dict] = []
        self.jobs: set[str] = set()
        self.progress: list[tuple[float, int]] = []
        self.fallback: set[tuple[int, int]] = set()  # (rank, step) timed by step_time
        for e in events or ():
            d = e if isinstance(e, dict) else ev.to_dict(e)
            kind, ts = d.get("type"), _num(d.get("ts")) or 0.0
            if d.get("job"):
                self.jobs.add(str(d["job"]))
            if kind == "step" and isinstance(d.get("rank"), int) and isinstance(d.get("step"), int):
                key = (d["rank"], d["step"])
                if key not in self.steps or self.steps[key][0] <= ts:
                    value = _num(d.get("compute_time"))
                    if value is None:
                        value = _num(d.get("step_time"))
                        self.fallback.add(key)
                    else:
                        self.fallback.discard(key)
                    loss = d.get("loss")
                    loss = float(loss) if loss in ("NaN", "Infinity", "-Infinity") else _num(loss)
                    self.steps[key] = (ts, value, loss)
                self.progress.append((ts, d["step"]))
            elif kind == "anomaly" and d.get("id"):
                self.anomalies.setdefault(str(d["id"]), d)
            elif kind == "incident" and d.get("id"):
                self.incidents[str(d["id"])] = d        # republished as it grows: the last
            elif kind == "action":
                self.actions.append(d)


# ----------------------------------------------------------------------------- sections
def _heatmap(data: _Data) -> str:
    cells = {k: v[1] for k, v in data.steps.items() if v[1] is not None}
    if not cells:
        return '<p class="empty">No step events with timings.</p>'
    ranks = sorted({r for r, _ in cells})
    lo_step, hi_step = min(s for _, s in cells), max(s for _, s in cells)
    width = max(1, math.ceil((hi_step - lo_step + 1) / MAX_COLS))
    ncols = (hi_step - lo_step) // width + 1
    binned: dict[tuple[int, int], list[float]] = {}
    for (r, s), v in cells.items():
        binned.setdefault((r, (s - lo_step) // width), []).append(v)
    means = {k: sum(v) / len(v) for k, v in binned.items()}
    vals = sorted(means.values())
    vmin, vmax = vals[int(0.02 * (len(vals) - 1))], vals[int(0.98 * (len(vals) - 1))]
    vmax = vmax if vmax > vmin else vmin + 1e-9
    left, top, plot_w = 60, 10, WIDTH - 80
    cw, rh = plot_w / ncols, max(3.0, min(22.0, 400.0 / len(ranks)))
    height = top + rh * len(ranks) + 60
    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {height:.0f}" width="{WIDTH}" '
             f'height="{height:.0f}" role="img" aria-label="compute time heatmap">',
             f'<rect x="{left}" y="{top}" width="{plot_w}" height="{rh * len(ranks):.1f}" fill="#eee"/>']
    for (r, c), v in sorted(means.items()):
        y, x = top + ranks.index(r) * rh, left + c * cw
        first = lo_step + c * width
        label = f"step {first}" if width == 1 else f"steps {first}-{first + width - 1}"
        label += " (step_time)" if width == 1 and (r, first) in data.fallback else ""
        colour = _colour((v - vmin) / (vmax - vmin))
        parts.append(f'<rect class="cell" x="{x:.2f}" y="{y:.2f}" width="{cw + 0.3:.2f}" '
                     f'height="{rh:.2f}" fill="{colour}" data-tip="rank {r}, {label}: {v:.4g} s">'
                     f'<title>rank {r}, {label}: {v:.4g} s</title></rect>')
    every = max(1, math.ceil(len(ranks) / 16))
    fallback = {r for r, _ in data.fallback}
    for i, r in enumerate(ranks):
        if i % every == 0:
            parts.append(f'<text x="{left - 6}" y="{top + (i + 0.5) * rh + 4:.1f}" '
                         f'text-anchor="end">{r}{"*" if r in fallback else ""}</text>')
    base = top + rh * len(ranks)
    for s in _nice_ticks(lo_step, hi_step + 1, 10):
        x = left + (s - lo_step) / width * cw
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{base}" y2="{base + 4}" stroke="#333"/>'
                     f'<text x="{x:.1f}" y="{base + 16}" text-anchor="middle">{s:g}</text>')
    parts.append(f'<text x="{left + plot_w / 2}" y="{base + 32}" text-anchor="middle">step</text>'
                 f'<text x="14" y="{top + rh * len(ranks) / 2}" transform="rotate(-90 14 '
                 f'{top + rh * len(ranks) / 2})" text-anchor="middle">rank</text>')
    lx = left + plot_w - 260
    for k in range(50):
        parts.append(f'<rect x="{lx + k * 4}" y="{base + 38}" width="4.2" height="10" '
                     f'fill="{_colour(k / 49)}"/>')
    parts.append(f'<text x="{lx - 6}" y="{base + 47}" text-anchor="end">{vmin:.3g} s</text>'
                 f'<text x="{lx + 206}" y="{base + 47}">{vmax:.3g} s</text>')
    if fallback:
        parts.append(f'<text x="{left}" y="{base + 47}">* some steps without compute_time: '
                     'step_time shown (it includes waiting for peers)</text>')
    parts.append("</svg>")
    return "".join(parts)


def _loss(data: _Data, marks: list[dict]) -> str:
    per_step: dict[int, list[float]] = {}
    bad: dict[int, list[int]] = {}
    for (r, s), (_, _, loss) in data.steps.items():
        if loss is None:
            continue
        if math.isfinite(loss):
            per_step.setdefault(s, []).append(loss)
        else:
            bad.setdefault(s, []).append(r)
    if not per_step and not bad:
        return '<p class="empty">No losses reported.</p>'
    steps = sorted(set(per_step) | set(bad))
    finite = [v for vs in per_step.values() for v in vs] or [0.0, 1.0]
    lo, hi = min(finite), max(finite)
    lo, hi = (lo - 0.5, hi + 0.5) if hi == lo else (lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
    s0, s1 = steps[0], max(steps[-1], steps[0] + 1)
    left, top, pw, ph = 60, 30, WIDTH - 80, 260
    sx = lambda s: left + (s - s0) / (s1 - s0) * pw
    sy = lambda v: top + ph - (v - lo) / (hi - lo) * ph
    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {ph + 80}" width="{WIDTH}" height="{ph + 80}" '
             f'role="img" aria-label="loss curve"><rect x="{left}" y="{top}" width="{pw}" '
             f'height="{ph}" fill="#fafafa" stroke="#ccc"/>']
    for v in _nice_ticks(lo, hi, 6):
        parts.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(v):.1f}" y2="{sy(v):.1f}" '
                     f'stroke="#e4e4e4"/><text x="{left - 6}" y="{sy(v) + 4:.1f}" '
                     f'text-anchor="end">{v:g}</text>')
    for s in _nice_ticks(s0, s1, 10):
        parts.append(f'<text x="{sx(s):.1f}" y="{top + ph + 16}" text-anchor="middle">{s:g}</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{top + ph + 34}" text-anchor="middle">step</text>')
    for m in marks:
        if not isinstance(m.get("step"), int) or not s0 <= m["step"] <= s1:
            continue
        x, colour = sx(m["step"]), KIND_COLOURS.get(m.get("kind"), "#555")
        tip = f"{m.get('kind')} at step {m['step']}: {m.get('summary', '')}"
        parts.append(f'<g class="mark" data-tip="{_e(tip)}"><title>{_e(tip)}</title>'
                     f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + ph}" stroke="{colour}" '
                     f'stroke-width="1.5" stroke-dasharray="5,3"/><text x="{x + 3:.1f}" y="{top + 12}" '
                     f'fill="{colour}" class="marklabel">{_e(m.get("kind"))}</text></g>')
    pts = " ".join(f"{sx(s):.1f},{sy(sum(v) / len(v)):.1f}" for s, v in sorted(per_step.items()))
    parts.append(f'<polyline points="{pts}" fill="none" stroke="#1f77b4" stroke-width="1.8"/>')
    for s, rs in sorted(bad.items()):
        tip = f"step {s}: non-finite loss on rank(s) {format_ranks(rs)}"
        parts.append(f'<g class="nonfinite" data-tip="{_e(tip)}"><title>{_e(tip)}</title>'
                     f'<circle cx="{sx(s):.1f}" cy="{top + 6}" r="4" fill="#d62728"/></g>')
    if bad:
        parts.append(f'<text x="{left + pw - 4}" y="{top - 8}" text-anchor="end" fill="#d62728">'
                     f'● non-finite loss ({len(bad)} steps)</text>')
    parts.append("</svg>")
    return "".join(parts)


def _timeline(data: _Data, incidents: list[dict], actions: list[dict], faults: list[dict]) -> str:
    times = [t for t, _ in data.progress]
    for d in incidents:
        times += [x for x in (_num(d.get("onset_ts")), _num(d.get("detected_ts"))) if x]
    times += [x for a in actions if (x := _num(a.get("ts")))]
    for f in faults:
        times += [x for k in ("injected_ts", "detected_ts", "recovered_ts") if (x := _num(f.get(k)))]
    if not times:
        return '<p class="empty">Nothing with a time stamp.</p>'
    t0, t1 = min(times), max(times)
    t1 = t1 if t1 > t0 else t0 + 1
    left, pw, lane = 110, WIDTH - 130, 46
    lanes = ["progress", "faults", "anomalies", "actions"]
    top = {"progress": 10, "faults": 140, "anomalies": 140 + lane, "actions": 140 + 2 * lane}
    height = 140 + 3 * lane + 40
    tx = lambda t: left + (t - t0) / (t1 - t0) * pw
    parts = [f'<svg class="chart" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" '
             'role="img" aria-label="timeline">']
    for name in lanes:
        h = 120 if name == "progress" else lane - 6
        parts.append(f'<rect x="{left}" y="{top[name]}" width="{pw}" height="{h}" fill="#f6f6f6"/>'
                     f'<text x="{left - 8}" y="{top[name] + h / 2 + 4}" text-anchor="end">{name}</text>')
    if data.progress:
        best: dict[int, tuple[float, int]] = {}
        for t, s in sorted(data.progress):
            best[int(tx(t))] = (t, s)  # the latest step at each pixel column
        cols = sorted(best.items())
        gaps = [b[1][0] - a[1][0] for a, b in zip(cols, cols[1:])]
        gap = max(3.0, 10 * statistics.median(gaps)) if gaps else 3.0
        smax = max(s for _, (_, s) in cols) or 1
        segments, seg, last_t = [], [], None
        for x, (t, s) in cols:
            if last_t is not None and t - last_t > gap:  # no steps for a while: break the line
                segments.append(seg)
                seg = []
            seg.append(f"{x},{10 + 120 - s / smax * 116:.1f}")
            last_t = t
        segments.append(seg)
        for seg in segments:
            parts.append(f'<polyline points="{" ".join(seg)}" fill="none" stroke="#2ca02c" '
                         f'stroke-width="1.8"/>' if len(seg) > 1 else
                         f'<circle cx="{seg[0].split(",")[0]}" cy="{seg[0].split(",")[1]}" r="1.5" '
                         f'fill="#2ca02c"/>')
        parts.append(f'<text x="{left + 4}" y="24" class="small">step (max {smax})</text>')

    def label(x, y, text, colour, tip, i, shape):
        y += (i % 3) * 12
        return (f'<g class="event" data-tip="{_e(tip)}"><title>{_e(tip)}</title>{shape}'
                f'<text x="{x + 6:.1f}" y="{y + 4}" fill="{colour}" class="small">{_e(text)}</text></g>')
    for i, f in enumerate(faults):
        inj = _num(f.get("injected_ts"))
        if inj is None:
            continue
        x, y = tx(inj), top["faults"] + 8
        end = _num(f.get("recovered_ts"))
        bar = (f'<rect x="{x:.1f}" y="{y - 6}" width="{max(1.0, tx(end) - x):.1f}" height="4" '
               f'fill="#aaa"/>' if end else "")
        tip = (f"fault {f.get('kind')} on rank(s) {format_ranks(f.get('ranks') or [])}, injected "
               f"t+{inj - t0:.1f}s, detected {_rel(f.get('detected_ts'), t0)}, recovered {_rel(end, t0)}")
        shape = bar + f'<path d="M{x:.1f},{y - 6} l5,9 l-10,0 z" fill="#444"/>'
        parts.append(label(x, y + 4, f.get("kind", "?"), "#444", tip, i, shape))
    for i, d in enumerate(incidents):
        det = _num(d.get("detected_ts"))
        if det is None:
            continue
        onset = _num(d.get("onset_ts")) or det
        colour, y = KIND_COLOURS.get(d.get("kind"), "#555"), top["anomalies"] + 8
        tip = (f"{d.get('kind')} ({d.get('severity', '')}) ranks {format_ranks(d.get('ranks') or [])}: "
               f"onset t+{onset - t0:.1f}s, detected t+{det - t0:.1f}s. {d.get('summary', '')}")
        shape = (f'<rect x="{tx(onset):.1f}" y="{y - 4}" width="{max(1.0, tx(det) - tx(onset)):.1f}" '
                 f'height="6" fill="{colour}" opacity="0.35"/><circle cx="{tx(det):.1f}" cy="{y - 1}" '
                 f'r="4" fill="{colour}"/>')
        parts.append(label(tx(det), y + 6, d.get("kind", "?"), colour, tip, i, shape))
    for i, a in enumerate(actions):
        ts = _num(a.get("ts"))
        if ts is None:
            continue
        x, y = tx(ts), top["actions"] + 8
        tip = f"{a.get('action')} ({a.get('status')}) t+{ts - t0:.1f}s: {a.get('reason', '')}"
        shape = f'<path d="M{x:.1f},{y - 6} l5,5 l-5,5 l-5,-5 z" fill="#1f77b4"/>'
        parts.append(label(x, y + 2, f"{a.get('action')}", "#1f77b4", tip, i, shape))
    base = top["actions"] + lane
    for t in _nice_ticks(0, t1 - t0, 10):
        parts.append(f'<line x1="{tx(t0 + t):.1f}" x2="{tx(t0 + t):.1f}" y1="{base - 4}" '
                     f'y2="{base}" stroke="#333"/><text x="{tx(t0 + t):.1f}" y="{base + 14}" '
                     f'text-anchor="middle">{t:g}s</text>')
    parts.append(f'<text x="{left}" y="{base + 30}" class="small">seconds after '
                 f'{_e(_clock(t0))} UTC</text></svg>')
    return "".join(parts)


def _rel(ts: Any, t0: float) -> str:
    ts = _num(ts)
    return "never" if ts is None else f"t+{ts - t0:.1f}s"


def _clock(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))


def _tree_node(node: dict, suspects: set[int], parent_suspect: bool) -> str:
    labels, ranks = [node.get("frame") or node.get("label") or "?"], node.get("ranks") or []
    while (len(node.get("children") or []) == 1 and not node.get("ends")
           and (node["children"][0].get("ranks") or []) == ranks):
        node = node["children"][0]
        labels.append(node.get("frame") or node.get("label") or "?")
    shown = labels if len(labels) <= 4 else labels[:2] + [f"… {len(labels) - 3} frames …"] + labels[-1:]
    mine = set(ranks)
    suspect = bool(mine) and mine <= suspects and not parent_suspect
    cls = ' class="suspect"' if suspect else ""
    head = (f'<span class="ranks">[{_e(format_ranks(mine))}]</span> '
            f'<span class="frames" title="{_e(" › ".join(labels))}">{_e(" › ".join(shown))}</span>'
            + (' <span class="badge">suspect</span>' if suspect else ""))
    kids = node.get("children") or []
    if not kids:
        return f"<li{cls}>{head}</li>"
    inner = "".join(_tree_node(c, suspects, parent_suspect or suspect) for c in kids)
    return f"<li{cls}><details open><summary>{head}</summary><ul>{inner}</ul></details></li>"


def _stacks(captures: list[dict]) -> str:
    if not captures:
        return '<p class="empty">No stack captures.</p>'
    out = []
    for i, c in enumerate(captures, 1):
        suspects = set(c.get("suspects") or [])
        title = c.get("capture_id") or c.get("incident") or f"capture {i}"
        when = f" at {_clock(c['ts'])} UTC" if _num(c.get("ts")) else ""
        out.append(f'<div class="capture"><h3>{_e(title)}{_e(when)}: suspects '
                   f'<span class="sus">{_e(format_ranks(suspects) or "none")}</span></h3>'
                   f'<p>{_e(c.get("summary", ""))}</p>')
        if c.get("missing"):
            out.append(f'<p>No stack from rank(s) {_e(format_ranks(c["missing"]))}.</p>')
        tree = c.get("tree")
        if isinstance(tree, dict):
            roots = [tree] if (tree.get("frame") or tree.get("label")) else tree.get("children") or []
            out.append('<ul class="tree">' + "".join(_tree_node(r, suspects, False) for r in roots)
                       + "</ul>")
        else:
            rows = "".join(f'<tr{" class=suspect" if set(k.get("ranks") or []) <= suspects else ""}>'
                           f'<td>{_e(format_ranks(k.get("ranks") or []))}</td>'
                           f'<td class="sig">{_e(k.get("signature", ""))}</td></tr>'
                           for k in c.get("classes") or [])
            out.append(f"<table><tr><th>ranks</th><th>stack (outermost first)</th></tr>{rows}</table>")
        out.append("</div>")
    return "".join(out)


def _summary(analysis: dict, incidents: list[dict], actions: list[dict], faults: list[dict]) -> str:
    out = []
    headline = {k: v for k, v in analysis.items() if _num(v) is not None}
    for k, v in analysis.items():
        if isinstance(v, dict):
            headline.update({f"{k}.{kk}": vv for kk, vv in v.items() if _num(vv) is not None})
    if headline:
        out.append('<table class="kv">' + "".join(f"<tr><th>{_e(k)}</th><td>{_fmt(_num(v), 4)}</td></tr>"
                                                  for k, v in headline.items()) + "</table>")
    if faults:
        rows = []
        for f in faults:
            inj, det, rec = (_num(f.get(k)) for k in ("injected_ts", "detected_ts", "recovered_ts"))
            rows.append(f"<tr><td>{_e(f.get('kind'))}</td><td>{_e(format_ranks(f.get('ranks') or []))}</td>"
                        f"<td>{_e(_clock(inj)) if inj else '–'}</td>"
                        f"<td>{_fmt(det - inj if det and inj else None)}</td>"
                        f"<td>{_fmt(rec - inj if rec and inj else None)}</td>"
                        f"<td>{_e(', '.join(map(str, f.get('actions') or [])))}</td></tr>")
        out.append("<h3>Injected faults</h3><table><tr><th>fault</th><th>ranks</th><th>injected (UTC)"
                   "</th><th>detected after (s)</th><th>recovered after (s)</th><th>actions</th></tr>"
                   + "".join(rows) + "</table>")
    by_incident: dict[str, list[str]] = {}
    for a in actions:
        by_incident.setdefault(str(a.get("incident")), []).append(f"{a.get('action')} ({a.get('status')})")
    rows = []
    for d in incidents:
        onset, det = _num(d.get("onset_ts")), _num(d.get("detected_ts"))
        colour = KIND_COLOURS.get(d.get("kind"), "#555")
        rows.append(f'<tr><td><span class="dot" style="background:{colour}"></span>{_e(d.get("kind"))}</td>'
                    f"<td>{_e(d.get('severity', ''))}</td><td>{_e(format_ranks(d.get('ranks') or []))}</td>"
                    f"<td>{_e(', '.join(d.get('nodes') or []))}</td><td>{_e(d.get('step', ''))}</td>"
                    f"<td>{_e(_clock(det)) if det else '–'}</td>"
                    f"<td>{_fmt(det - onset if det and onset else None)}</td>"
                    f"<td>{_e('; '.join(by_incident.get(str(d.get('id')), [])))}</td>"
                    f"<td>{_e(d.get('summary', ''))}</td></tr>")
    out.append(f"<h3>Incidents ({len(incidents)})</h3>")
    out.append("<table><tr><th>kind</th><th>severity</th><th>ranks</th><th>nodes</th><th>step</th>"
               "<th>detected (UTC)</th><th>onset→detected (s)</th><th>actions</th><th>summary</th></tr>"
               + "".join(rows) + "</table>" if rows else '<p class="empty">No incidents.</p>')
    return "".join(out)


CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;background:#fff;color:#222}
header{background:#18324f;color:#fff;padding:18px 28px}header h1{margin:0;font-size:22px}
header p{margin:4px 0 0;color:#c8d6e5}main{padding:8px 28px 40px;max-width:1160px}
section{margin:22px 0;border-top:1px solid #ddd}h2{font-size:17px;margin:14px 0 8px}
h3{font-size:15px;margin:14px 0 6px}table{border-collapse:collapse;margin:6px 0;font-size:13px}
th,td{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}th{background:#f2f4f7}
.kv th{width:220px}svg.chart{font-size:11px;max-width:100%;height:auto}.small{font-size:10px}
.empty{color:#888;font-style:italic}.dot{display:inline-block;width:9px;height:9px;border-radius:50%;margin-right:6px}
.tree,.tree ul{list-style:none;padding-left:18px;margin:2px 0}.tree li{margin:2px 0;font-family:ui-monospace,monospace;font-size:12px}
.tree summary{cursor:pointer}.ranks{color:#1f5fa0;font-weight:600}.suspect>details>summary,.tree li.suspect:not(:has(details)){background:#fde2e1;border-radius:3px}
tr.suspect td{background:#fde2e1}.badge{background:#d62728;color:#fff;border-radius:3px;padding:0 5px;font-size:11px}
.sus{color:#d62728}.capture{border:1px solid #e3e3e3;border-radius:6px;padding:4px 14px;margin:10px 0}
td.sig{font-family:ui-monospace,monospace;font-size:11px;word-break:break-all}
#tip{position:fixed;pointer-events:none;background:#222;color:#fff;padding:4px 8px;border-radius:4px;font-size:12px;display:none;max-width:480px;z-index:9}
"""
JS = """
(function(){var tip=document.getElementById('tip');
document.querySelectorAll('[data-tip]').forEach(function(el){
 el.addEventListener('mousemove',function(e){tip.textContent=el.getAttribute('data-tip');
  tip.style.display='block';tip.style.left=(e.clientX+12)+'px';tip.style.top=(e.clientY+12)+'px';});
 el.addEventListener('mouseleave',function(){tip.style.display='none';});});
var n=document.querySelectorAll('.cell').length, m=document.querySelectorAll('#summary tr').length;
var s=document.getElementById('status');s.textContent='interactive: '+n+' heatmap cells, '+m+' table rows';
document.body.setAttribute('data-ready','1');})();
"""


def render_report(analysis: dict, events: Iterable[Any] | None = None, actions: list[dict] | None = None,
                  captures: list[dict] | None = None, faults: list[dict] | None = None,
                  title: str | None = None) -> str:
    """The report page as a string (see the module docstring)."""
    analysis = analysis or {}
    data = _Data(events)
    incidents = list(analysis.get("incidents") or [])
    if not incidents:  # no offline analysis: the worker's incidents, else its anomalies
        incidents = list(data.incidents.values()) or list(data.anomalies.values())
    acts = list(actions or []) + [a for a in data.actions if a not in (actions or [])]
    faults = list(faults or [])
    jobs = sorted(data.jobs | {str(d["job"]) for d in incidents if d.get("job")})
    title = title or f"trainguard report: {', '.join(jobs) or 'recording'}"
    ranks = {r for r, _ in data.steps}
    sub = (f"{len(ranks)} ranks, {len({s for _, s in data.steps})} steps, {len(incidents)} incidents, "
           f"{len(acts)} actions; events {analysis.get('events', '–')}, invalid "
           f"{analysis.get('invalid', '–')}; generated {_clock(time.time())} UTC")
    sections = [("summary", "Summary", _summary(analysis, incidents, acts, faults)),
                ("heatmap", "Compute time per rank and step", _heatmap(data)),
                ("loss", "Loss", _loss(data, incidents)),
                ("timeline", "Timeline", _timeline(data, incidents, acts, faults)),
                ("stacks", "Stack captures", _stacks(list(captures or [])))]
    body = "".join(f'<section id="{i}"><h2>{_e(h)}</h2>{content}</section>' for i, h, content in sections)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f'<meta name="viewport" content="width=device-width,initial-scale=1"><style>{CSS}</style>'
            f'</head><body><header><h1>{_e(title)}</h1><p>{_e(sub)}</p><p id="status" class="small">'
            f'static</p></header><main>{body}</main><div id="tip"></div><script>{JS}</script>'
            f"</body></html>\n")


def write_report(path: str | os.PathLike, analysis: dict, events: Iterable[Any] | None = None,
                 actions: list[dict] | None = None, captures: list[dict] | None = None,
                 faults: list[dict] | None = None, title: str | None = None) -> Path:
    """Write the report to ``path`` (atomically) and return the path."""
    page = render_report(analysis, events, actions, captures, faults, title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, page)
    return out
