"""trainguard.apps.report: the HTML incident report, as text and rendered by headless Chromium."""
from __future__ import annotations

import math
import os
import random
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from trainguard import events as ev
from trainguard.apps.report import render_report, write_report

T0 = 1764680000.0
STACKS = Path(__file__).parent / "data" / "stacks" / "pyspy_hang"
CHROMIUM = "/usr/bin/chromium"
SECTIONS = ("summary", "heatmap", "loss", "timeline", "stacks")


def sample():
    """A 4-rank run with a NaN, a straggler, a hang with restart and a crash."""
    rng, events, t = random.Random(1), [], T0

    def run(first, last):
        nonlocal t
        for s in range(first, last):
            slow = 40 <= s <= 80
            for r in range(4):
                compute = 0.06 + rng.random() * 0.01 + (0.05 if slow and r == 2 else 0)
                loss = float("nan") if (s, r) == (30, 1) else 4 * math.exp(-s / 40) + 2
                events.append(ev.Step(job="demo", ts=t, node="n1", rank=r, step=s,
                                      step_time=0.11, compute_time=None if r == 3 else compute,
                                      loss=loss, grad_norm=1.0, tokens=512))
            t += 0.11
    run(0, 120)
    t += 25
    run(100, 160)
    t += 8
    run(150, 220)
    anomalies = [
        ev.Anomaly(job="demo", ts=T0 + 3.5, id="a1", kind="nan", severity="critical", ranks=[1],
                   nodes=["n1"], step=30, onset_ts=T0 + 3.3, detected_ts=T0 + 3.5,
                   detector="nan", summary="rank 1 reported a NaN loss <at> step 30"),
        ev.Anomaly(job="demo", ts=T0 + 9, id="a2", kind="straggler", severity="warning",
                   ranks=[2], nodes=["n1"], step=52, onset_ts=T0 + 5, detected_ts=T0 + 9,
                   detector="straggler", summary="rank 2 is 1.8x slower than its peers"),
        ev.Anomaly(job="demo", ts=T0 + 24, id="a3", kind="hang", severity="critical", ranks=[2],
                   nodes=["n1"], step=120, onset_ts=T0 + 16, detected_ts=T0 + 24,
                   detector="hang", summary="no progress for 8 s"),
    ]
    actions = [ev.to_dict(ev.Action(job="demo", ts=T0 + 25, incident="a3", action=a,
                                    targets={"ranks": [2]}, status="done", reason="hang"))
               for a in ("capture_stacks", "restart")]
    from trainguard.diagnosis.stacks import analyze_dir

    capture = dict(analyze_dir(STACKS), capture_id="cap-a3", ts=T0 + 25)
    faults = [{"kind": "hang", "ranks": [2], "injected_ts": T0 + 13.2, "detected_ts": T0 + 24,
               "recovered_ts": T0 + 40, "actions": ["capture_stacks", "restart"]},
              {"kind": "crash", "ranks": [3], "injected_ts": T0 + 49.4, "detected_ts": None,
               "recovered_ts": None, "actions": []}]
    analysis = {"events": len(events) + 3, "invalid": 2, "ettr": 0.83, "baseline": {"ettr": 0.41},
                "incidents": [dict(ev.to_dict(a), job="demo") for a in anomalies]}
    return analysis, events + anomalies, actions, [capture], faults


def section(page: str, name: str) -> str:
    m = re.search(rf'<section id="{name}">(.*?)</section>', page, re.S)
    assert m, name
    return m.group(1)


# ----------------------------------------------------------------------------- HTML content
def test_sections_and_content():
    page = render_report(*sample())
    for name in SECTIONS:
        assert page.count(f'id="{name}"') == 1
    summary = section(page, "summary")
    assert "<th>ettr</th><td>0.83</td>" in summary and "<th>baseline.ettr</th><td>0.41</td>" in summary
    assert "Incidents (3)" in summary and "capture_stacks (done); restart (done)" in summary
    assert "rank 1 reported a NaN loss &lt;at&gt; step 30" in summary  # escaped
    assert "<td>10.8</td><td>26.8</td>" in summary  # hang: detected and recovered after (s)
    heat = section(page, "heatmap")
    assert heat.count('class="cell"') == 4 * 220
    assert "rank 3, step 5 (step_time): 0.11 s" in heat  # no compute_time: step_time stands in
    assert ">3*</text>" in heat and ">2</text>" in heat
    assert re.search(r"rank 2, step 50: 0\.11\d* s", heat)  # the straggler's compute time
    loss = section(page, "loss")
    assert "step 30: non-finite loss on rank(s) 1" in loss
    assert all(f'class="marklabel">{k}</text>' in loss for k in ("nan", "straggler", "hang"))
    timeline = section(page, "timeline")
    assert timeline.count("<polyline") == 3  # progress broken at the hang and the restart
    assert "fault hang on rank(s) 2, injected t+13.2s, detected t+24.0s" in timeline
    assert ">capture_stacks</text>" in timeline and ">restart</text>" in timeline
    stacks = section(page, "stacks")
    assert 'class="suspect"' in stacks and "load_batch (fake_train.py)" in stacks
    assert re.search(r'<li class="suspect">.*?\[3\]', stacks)


def test_self_contained():
    page = render_report(*sample())
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', page)
    assert "@import" not in page and "<link" not in page
    assert "<script>" in page and "<style>" in page and "<svg" in page


def test_empty_inputs_still_give_every_section(tmp_path):
    path = write_report(tmp_path / "sub" / "r.html", {})
    page = path.read_text()
    for name in SECTIONS:
        assert f'id="{name}"' in page
    assert "No step events with timings." in page and "No incidents." in page
    assert not list(path.parent.glob(".*.tmp"))


def test_dict_events_and_streamed_anomalies_stand_in_for_incidents():
    events = [{"type": "step", "job": "j", "ts": T0 + s, "rank": 0, "step": s, "step_time": 0.2,
               "loss": "NaN" if s == 3 else 2.0} for s in range(6)]
    events.append(ev.to_dict(ev.Anomaly(
        job="j", ts=T0 + 4, id="x1", kind="nan", severity="critical", ranks=[0], nodes=[],
        step=3, onset_ts=T0 + 3, detected_ts=T0 + 4, detector="nan", summary="NaN")))
    page = render_report({"incidents": []}, events)
    assert "Incidents (1)" in page and "step 3: non-finite loss on rank(s) 0" in page


def test_redone_steps_show_their_latest_run():
    events = [ev.Step(job="j", ts=T0, rank=0, step=0, step_time=1.0),
              ev.Step(job="j", ts=T0 + 9, rank=0, step=0, step_time=2.0),
              ev.Step(job="j", ts=T0 + 5, rank=0, step=1, step_time=1.0)]
    heat = section(render_report({}, events), "heatmap")
    assert "rank 0, step 0 (step_time): 2 s" in heat


def test_long_runs_are_binned():
    events = [ev.Step(job="j", ts=T0 + s, rank=r, step=s, step_time=0.1, compute_time=0.1)
              for s in range(1000) for r in range(2)]
    heat = section(render_report({}, events), "heatmap")
    assert heat.count('class="cell"') == 2 * 334 and "rank 1, steps 996-998" in heat


def test_tree_with_label_keys_and_capture_without_tree():
    tree = {"label": "<root>", "ranks": [0, 1, 2], "children": [
        {"label": "main (t.py)", "ranks": [0, 1, 2], "children": [
            {"label": "all_reduce (c10d.py)", "ranks": [0, 1], "children": []},
            {"label": "read (io.py)", "ranks": [2], "children": []}]}]}
    captures = [{"ranks": 3, "suspects": [2], "missing": [], "summary": "rank 2 reads", "tree": tree},
                {"ranks": 2, "suspects": [1], "missing": [1], "summary": "no dump",
                 "classes": [{"ranks": [0], "signature": "a > b"},
                             {"ranks": [1], "signature": "(no stack)"}]}]
    stacks = section(render_report({}, captures=captures), "stacks")
    assert re.search(r'<li class="suspect">\s*<span class="ranks">\[2\]</span> <span class="frames"'
                     r' title="read \(io.py\)">read \(io.py\)', stacks)
    assert "<tr class=suspect><td>1</td>" in stacks and "No stack from rank(s) 1." in stacks


# ----------------------------------------------------------------------------- headless Chromium
def read_png(data: bytes):
    """(width, height, rows of RGB(A) bytes) of an 8-bit truecolour PNG, without extra packages."""
    import numpy as np

    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    while pos < len(data):
        size, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + size]
        pos += 12 + size
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6), (depth, colour)
        elif kind == b"IDAT":
            idat += body
    bpp = 3 if colour == 2 else 4
    stride, raw = width * bpp, zlib.decompress(idat)
    prev, rows = np.zeros(stride, dtype=np.int64), []
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int64)
        if kind == 1:
            line = np.cumsum(line.reshape(-1, bpp), axis=0).reshape(-1) % 256
        elif kind == 2:
            line = (line + prev) % 256
        elif kind in (3, 4):
            out, p = line.tolist(), prev.tolist()
            for x in range(stride):
                a = out[x - bpp] if x >= bpp else 0
                b, c = p[x], (p[x - bpp] if x >= bpp else 0)
                if kind == 3:
                    pred = (a + b) // 2
                else:
                    pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                out[x] = (out[x] + pred) % 256
            line = np.array(out, dtype=np.int64)
        prev = line
        rows.append(line.astype(np.uint8).tobytes())
    return width, height, bpp, rows


def chromium(*args, tmp_path):
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(CHROMIUM),
                    reason=f"{CHROMIUM} is absent: install Debian's chromium package "
                           "(apt-get install -y chromium) to render the report")
def test_report_renders_in_headless_chromium(tmp_path):
    path = write_report(tmp_path / "report.html", *sample())
    url = path.resolve().as_uri()
    dom = chromium("--dump-dom", url, tmp_path=tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for name in SECTIONS:
        assert f'id="{name}"' in dom.stdout
    assert 'data-ready="1"' in dom.stdout  # the inline script ran
    assert "interactive: 880 heatmap cells" in dom.stdout

    png = tmp_path / "shot.png"
    shot = chromium(f"--screenshot={png}", "--window-size=1280,2000", url, tmp_path=tmp_path)
    assert shot.returncode == 0 and png.exists(), shot.stderr[-2000:]
    width, height, bpp, rows = read_png(png.read_bytes())
    assert (width, height) == (1280, 2000)
    pixels = [rows[y][x:x + 3] for y in range(0, height, 4) for x in range(0, width * bpp, 4 * bpp)]
    colours = set(pixels)
    white = sum(p == b"\xff\xff\xff" for p in pixels) / len(pixels)
    assert len(colours) > 200, f"only {len(colours)} colours: blank page?"
    assert white < 0.9, f"{white:.0%} white"
    # the header band is the report's dark blue, not the browser's blank page
    assert rows[20][40 * bpp:40 * bpp + 3] == bytes.fromhex("18324f")
    shutil.copy(png, Path(os.environ.get("TG_REPORT_SCREENSHOT", tmp_path / "keep.png")))
