"""`trainguard analyze`: SPEC §4 output over recordings, in the recording's own time."""
import json
import subprocess
import sys

import pytest

from trainguard import events as ev
from trainguard.detectors.offline import analyze_file
from trainguard.recording import RecordingWriter

from detector_traces import JobSim

SPEC_KEYS = {"id", "kind", "job", "ranks", "nodes", "step", "onset_ts", "detected_ts",
             "severity", "summary"}


def write(path, events, junk=()):
    with RecordingWriter(path) as out:
        for e in events:
            out.write_raw(ev.encode(e))
        for line in junk:
            out.write_raw(line)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_analyze_counts_and_finds(tmp_path, suffix):
    events = JobSim(steps=200).crash(3, 150, signal="SIGKILL", exit_code=None).events()
    junk = [b"not json", b'{"v":1,"type":"step","job":"j1","ts":1}', b"[1,2]",
            b'{"v":2,"type":"step"}']
    result = analyze_file(write(tmp_path / f"r{suffix}", events, junk))
    assert set(result) == {"events", "invalid", "incidents"}
    assert result["events"] == len(events) and result["invalid"] == 4
    [incident] = result["incidents"]
    assert set(incident) == SPEC_KEYS | {"anomalies"}
    assert incident["kind"] == "crash" and incident["ranks"] == [3] and incident["job"] == "j1"
    json.dumps(result, allow_nan=False)


def test_hang_at_the_end_of_a_recording_is_found_from_its_own_timestamps(tmp_path):
    sim = JobSim(steps=200, tail_s=40.0).hang(6, 180, phase="data")
    result = analyze_file(write(tmp_path / "hang.jsonl", sim.events()))
    [incident] = result["incidents"]
    assert incident["kind"] == "hang" and incident["ranks"] == [6] and incident["step"] == 179
    assert sim.stop_ts < incident["detected_ts"] <= sim.stop_ts + 30


def test_no_hang_when_the_recording_just_ends(tmp_path):
    events = JobSim(steps=150, finish=False).events()
    assert analyze_file(write(tmp_path / "cut.jsonl", events))["incidents"] == []


def test_empty_and_all_invalid_recordings(tmp_path):
    assert analyze_file(write(tmp_path / "e.jsonl", [])) == {"events": 0, "invalid": 0,
                                                             "incidents": []}
    assert analyze_file(write(tmp_path / "i.jsonl", [], [b"x"] * 5))["invalid"] == 5


def test_several_jobs_in_one_recording(tmp_path):
    a = JobSim(job="a", steps=150).crash(1, 100).events()
    b = JobSim(job="b", steps=150, t0=JobSim().t0 + 3.0).nan_loss(2, 120).events()
    merged = sorted(a + b, key=lambda e: e.ts)
    result = analyze_file(write(tmp_path / "two.jsonl", merged))
    assert sorted((i["job"], i["kind"]) for i in result["incidents"]) == [("a", "crash"),
                                                                           ("b", "nan")]


def test_cli_analyze_writes_the_html_report(tmp_path):
    path = write(tmp_path / "r.jsonl", JobSim(steps=60).events())
    report = tmp_path / "out" / "r.html"
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", "analyze", str(path), "--json",
                          "--report", str(report)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    html = report.read_text()
    assert 'id="heatmap"' in html and 'id="summary"' in html
    assert json.loads(out.stdout)["invalid"] == 0


def test_cli_analyze_json(tmp_path):
    path = write(tmp_path / "r.jsonl.gz", JobSim(steps=200).xid("n2", 0, 79, 150).events(),
                 [b"{broken"])
    out = subprocess.run([sys.executable, "-m", "trainguard.cli", "analyze", str(path), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["invalid"] == 1
    assert [(i["kind"], i["nodes"], i["ranks"]) for i in result["incidents"]] == [
        ("gpu_fault", ["n2"], [4])]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.zst"])
def test_lines_across_read_chunks_blank_lines_and_crlf(tmp_path, monkeypatch, suffix):
    from trainguard import recording

    monkeypatch.setattr(recording, "_CHUNK", 7)        # every line crosses a chunk boundary
    good = [ev.encode(ev.Heartbeat(job="j", ts=float(t), node="n", rank=0, pid=1,
                                   phase="data", phase_since=0.0)) for t in range(5)]
    body = (good[0] + b"\r\n\n   \n" + good[1] + b"\n\t\n" + good[2] + b"\r\nnot json\n"
            + good[3] + b"\n" + good[4])                # no line end after the last line
    path = tmp_path / f"r{suffix}"
    with recording._open_binary(path, "wb") as out:
        out.write(body)
    stats = recording.ReadStats()
    assert [e.ts for e in recording.read_events(path, stats)] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert (stats.events, stats.invalid) == (5, 1)
