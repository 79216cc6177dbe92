"""The kernel-log Xid parser on every real line of ../shared/data/kmsg/, and the follower."""
from __future__ import annotations

import doctest
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from trainguard.collectors import kmsg
from trainguard.collectors.kmsg import KmsgFollower, normalize_bus_id, parse_xid_line

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "kmsg"
XID119 = "components__accelerator__nvidia__xid__testdata__dmesg-with-xid-119.log"
MEMORY = "components__memory__testdata__dmesg.decode.iso.log"
FILES = {
    "components__accelerator__nvidia__fabric-manager__testdata__fabricmanager.log",
    "components__accelerator__nvidia__nccl__testdata__dmesg.decode.iso.log",
    XID119, MEMORY, "pkg__kmsg__testdata__kmsg.1.log", "pkg__kmsg__testdata__kmsg.2.peermem.log",
}
GSP = "Timeout after 6s of waiting for RPC response from GPU4 GSP! Expected function "
UNKNOWN = ("pid='<unknown>', name=<unknown>, ", None, None)
# (file, 1-based line number) -> (bus id, xid, pid/name prefix, pid, name, detail);
# written by reading the files. Every other line of every file must give None.
EXPECTED = {
    (XID119, 3): ("0000:9b:00", 119, "pid=2024380, name=nvidia-smi, ", 2024380, "nvidia-smi",
                  GSP + "103 (GSP_RM_ALLOC) (0x2081 0x4)."),
    (XID119, 38): ("0000:9b:00", 119, "pid=2024380, name=nvidia-smi, ", 2024380, "nvidia-smi",
                   GSP + "10 (FREE) (0xa55a0210 0x0)."),
    (XID119, 40): ("0000:9b:00", 119, "pid=2024380, name=nvidia-smi, ", 2024380, "nvidia-smi",
                   GSP + "10 (FREE) (0xa55a0090 0x0)."),
    (XID119, 42): ("0000:9b:00", 119, "pid=1263500, name=cache_mgr_main, ", 1263500,
                   "cache_mgr_main", GSP + "76 (GSP_RM_CONTROL) (0x20801813 0x4c)."),
    (XID119, 43): ("0000:9b:00", 119, "pid=1240590, name=gpud, ", 1240590, "gpud",
                   GSP + "76 (GSP_RM_CONTROL) (0x20803032 0x58c)."),
    (MEMORY, 17): ("0000:38:00", 43, "pid=2924364, name=pt_main_thread, ", 2924364,
                   "pt_main_thread", "Ch 00000008"),
}
for _n, _detail in enumerate([
        "Graphics SM Global Exception on (GPC 8, TPC 5, SM 1): Multiple Warp Errors",
        "Graphics Exception: ESR 0x546fb0=0x11f000e 0x546fb4=0x24 0x546fa8=0xf81eb60 0x546fac=0x1174",
        "Graphics SM Warp Exception on (GPC 9, TPC 1, SM 1): Out Of Range Address",
        "Graphics SM Global Exception on (GPC 9, TPC 1, SM 1): Multiple Warp Errors",
        "Graphics Exception: ESR 0x54cfb0=0x11f000e 0x54cfb4=0x24 0x54cfa8=0xf81eb60 0x54cfac=0x1174",
        "Graphics SM Warp Exception on (GPC 9, TPC 2, SM 0): Out Of Range Address",
        "Graphics Exception: ESR 0x54d730=0x11c000e 0x54d734=0x20 0x54d728=0xf81eb60 0x54d72c=0x1174",
        "Graphics SM Warp Exception on (GPC 9, TPC 5, SM 0): Out Of Range Address",
        "Graphics SM Global Exception on (GPC 9, TPC 5, SM 0): Multiple Warp Errors",
        "Graphics Exception: ESR 0x54ef30=0x117000e 0x54ef34=0x24 0x54ef28=0xf81eb60 0x54ef2c=0x1174",
        "Graphics SM Warp Exception on (GPC 10, TPC 1, SM 1): Out Of Range Address",
        "Graphics SM Global Exception on (GPC 10, TPC 1, SM 1): Multiple Warp Errors",
        "Graphics Exception: ESR 0x554fb0=0x119000e 0x554fb4=0x24 0x554fa8=0xf81eb60 0x554fac=0x1174",
        "Graphics SM Warp Exception on (GPC 10, TPC 4, SM 0): Out Of Range Address",
        "Graphics SM Global Exception on (GPC 10, TPC 4, SM 0): Multiple Warp Errors",
        "Graphics Exception: ESR 0x556730=0x117000e 0x556734=0x24 0x556728=0xf81eb60 0x55672c=0x1174",
], start=1):
    EXPECTED[(MEMORY, _n)] = ("0000:38:00", 13, *UNKNOWN, _detail)

XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."


def _lines(name: str) -> list:
    return (DATA / name).read_text(encoding="utf-8", errors="replace").split("\n")


needs_data = pytest.mark.skipif(not DATA.is_dir(), reason=f"{DATA} not present")


def test_doctests():
    assert doctest.testmod(kmsg).failed == 0


@needs_data
def test_the_data_folder_holds_the_files_this_test_knows():
    assert {p.name for p in DATA.glob("*.log")} == FILES


@needs_data
@pytest.mark.parametrize("name", sorted(FILES))
def test_every_real_line(name):
    lines = _lines(name)
    found = {}
    for number, line in enumerate(lines, start=1):
        rec = parse_xid_line(line)
        if rec is not None:
            found[number] = rec
    assert set(found) == {n for (f, n) in EXPECTED if f == name}
    for number, rec in found.items():
        bus, xid, prefix, pid, pname, detail = EXPECTED[(name, number)]
        assert (rec.bus_id, rec.xid, rec.pid, rec.name, rec.detail) == (bus, xid, pid, pname,
                                                                        detail)
        assert rec.message == prefix + detail
        assert rec.raw == lines[number - 1][lines[number - 1].index("NVRM: Xid"):]
        assert rec.to_payload() == {"gpu": None, "xid": xid, "source": "kmsg",
                                    "message": prefix + detail}
        assert parse_xid_line(lines[number - 1].encode()) == rec  # bytes too


@needs_data
def test_non_xid_lines_that_mention_nvidia_give_nothing():
    nvidia = [line for name in FILES for line in _lines(name)
              if ("NVRM" in line or "nvidia" in line.lower() or "nccl" in line.lower()
                  or "NVSwitch" in line) and "NVRM: Xid" not in line]
    assert len(nvidia) > 40
    assert all(parse_xid_line(line) is None for line in nvidia)


@pytest.mark.parametrize("line", [
    "6,1234,5678,-;" + XID79,                                        # /dev/kmsg record
    "[  123.456789] " + XID79,                                       # dmesg
    "[Sun Feb 23 16:24:18 2025] " + XID79,                            # dmesg -T
    "2024-05-01T10:11:12,123456+00:00 " + XID79,                     # dmesg --time-format iso
    "kern  :err   : 2024-05-01T10:11:12,123456+00:00 " + XID79,      # dmesg --decode
    "May  1 10:11:12 node17 kernel: [ 8812.1] " + XID79,             # syslog
    "2024-05-01T10:11:12.123+00:00 node17 kernel: " + XID79,         # journalctl -o short-iso
    "<3>" + XID79,                                                   # dmesg -r
    XID79 + "\n",
])
def test_line_formats(line):
    rec = parse_xid_line(line)
    assert (rec.bus_id, rec.xid, rec.pid, rec.name) == ("0000:3b:00", 79, 4242, "python")
    assert rec.detail == "GPU has fallen off the bus."
    assert rec.raw == XID79


def test_older_and_shorter_xid_forms():
    old = parse_xid_line("NVRM: Xid (0000:03:00): 31, Ch 00000010, engmask 00000101")
    assert (old.bus_id, old.xid, old.pid, old.detail) == ("0000:03:00", 31, None,
                                                         "Ch 00000010, engmask 00000101")
    bare = parse_xid_line("NVRM: Xid (PCI:0001:4e:00): 48")
    assert (bare.bus_id, bare.xid, bare.message) == ("0001:4e:00", 48, "")


@pytest.mark.parametrize("line", [
    "", "NVRM: GPU at PCI:0000:9b:00: GPU-509665ad-b600-ac93-3616-d754b23d636d",
    "NVRM: Xid", "NVRM: Xid (PCI:0000:9b:00): abc, pid=1", "NVRM: Xid (PCI:zz:9b:00): 79, x",
    "NVRM: Rate limiting GSP RPC error prints for GPU at PCI:0000:9b:00 (printing 1 of every 30)",
    "nvidia-peermem nv_get_p2p_free_callback:127 ERROR detected invalid context",
    "NVRM_Xid (PCI:0000:9b:00): 79, x",
])
def test_lines_that_are_not_xids(line):
    assert parse_xid_line(line) is None


def test_normalize_bus_id():
    for raw in ("00000000:9B:00.0", "0000:9b:00.0", "PCI:0000:9b:00", "9b:00.0", b"0000:9B:00"):
        assert normalize_bus_id(raw) == "0000:9b:00"
    assert normalize_bus_id("00010000:01:00.0") == "10000:01:00"
    assert normalize_bus_id("0000:9b") is None


# -- follower --------------------------------------------------------------------------------
def _wait(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def _append(path: Path, text: str) -> None:
    with open(path, "a") as fh:
        fh.write(text)


def test_extra_source_yields_appended_xid_79(tmp_path):
    log = tmp_path / "chaos.log"
    log.write_text("[1.0] NVRM: Xid (PCI:0000:3b:00): 13, old line, not replayed\n")
    f = KmsgFollower(kmsg_path=None, dmesg_argv=[], extra_source=str(log),
                     bus_id_map={"00000000:3B:00.0": 2}, poll_interval=0.05).start()
    try:
        assert not f.available and "no source configured" in f.reason
        time.sleep(0.2)
        _append(log, "unrelated line\n" + XID79)  # the last line still without its newline
        time.sleep(0.2)
        assert f.get(timeout=0.1) is None  # a partial line waits for its end
        _append(log, "\n")
        rec = f.get(timeout=5)
        assert (rec.xid, rec.bus_id, rec.gpu) == (79, "0000:3b:00", 2)
        assert rec.to_payload() == {"gpu": 2, "xid": 79, "source": "kmsg",
                                    "message": "pid=4242, name=python, GPU has fallen off the bus."}
        assert f.get(timeout=0.3) is None
    finally:
        f.stop()


def test_extra_source_replay_created_later_and_truncated(tmp_path):
    log = tmp_path / "late.log"
    got = []
    f = KmsgFollower(got.append, kmsg_path=None, dmesg_argv=[], extra_source=str(log),
                     poll_interval=0.05).start()
    try:
        time.sleep(0.15)
        log.write_text(XID79 + "\n")  # created after start: read from its start
        assert _wait(lambda: len(got) == 1)
        log.write_text(XID79.replace(": 79, pid=4242", ": 94, pid=1") + "\n")  # truncated
        assert _wait(lambda: len(got) == 2)
        assert [r.xid for r in got] == [79, 94] and got[0].gpu is None
    finally:
        f.stop()
    log.write_text(XID79 + "\n")
    with KmsgFollower(kmsg_path=None, dmesg_argv=[], extra_source=str(log), replay=True,
                      poll_interval=0.05) as f2:
        assert f2.get(timeout=5).xid == 79


def test_callback_errors_do_not_stop_the_follower(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("")
    seen = []

    def callback(rec):
        seen.append(rec.xid)
        if len(seen) == 1:
            raise RuntimeError("broken consumer")

    with KmsgFollower(callback, kmsg_path=None, dmesg_argv=[], extra_source=str(log),
                      poll_interval=0.05):
        time.sleep(0.15)
        _append(log, XID79 + "\n")
        assert _wait(lambda: len(seen) == 1)
        _append(log, XID79 + "\n")
        assert _wait(lambda: len(seen) == 2)


def test_iterator_ends_on_stop(tmp_path):
    log = tmp_path / "it.log"
    log.write_text("")
    f = KmsgFollower(kmsg_path=None, dmesg_argv=[], extra_source=str(log),
                     poll_interval=0.05).start()
    out = []
    t = threading.Thread(target=lambda: out.extend(r.xid for r in f))
    t.start()
    time.sleep(0.15)
    _append(log, XID79 + "\n" + XID79.replace(": 79,", ": 48,") + "\n")
    assert _wait(lambda: len(out) == 2)
    f.stop()
    t.join(5)
    assert not t.is_alive() and out == [79, 48]


def test_kmsg_records_through_a_pipe_and_no_busy_spin(tmp_path):
    fifo = tmp_path / "kmsg"
    os.mkfifo(fifo)
    f = KmsgFollower(kmsg_path=str(fifo), bus_id_map={"0000:3b:00": 5},
                     poll_interval=0.05).start()
    try:
        assert f.kernel_source == "kmsg" and f.available
        w = os.open(fifo, os.O_WRONLY)
        os.write(w, b"6,3964,206764307,-;nvidia-nvswitch2: open (major=510)\n")
        os.write(w, ("3,4011,57631398999,-;" + XID79 + "\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n").encode())
        rec = f.get(timeout=5)
        assert (rec.xid, rec.gpu, rec.pid) == (79, 5, 4242)
        os.close(w)  # writer gone: poll reports hang-up forever; the follower must not spin
        c0 = time.process_time()
        time.sleep(1.0)
        assert time.process_time() - c0 < 0.3
        assert f.get(timeout=0.1) is None
    finally:
        f.stop()


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="/dev/kmsg not readable")
def test_real_dev_kmsg_is_followed_from_its_end_or_replayed(monkeypatch):
    lines = []
    f = KmsgFollower(poll_interval=0.05)
    monkeypatch.setattr(f, "_line", lines.append)
    f.start()
    try:
        assert f.kernel_source == "kmsg"
        time.sleep(0.3)
        quiet = len(lines)
    finally:
        f.stop()
    replay = KmsgFollower(replay=True, poll_interval=0.05)
    monkeypatch.setattr(replay, "_line", lines.append)
    replay.start()
    try:
        assert _wait(lambda: len(lines) > quiet + 20)  # the kernel's existing records
    finally:
        replay.stop()
    # from the end: not the old records (a test beside this one that makes network
    # namespaces adds a few new ones)
    assert quiet < 20 < len(lines) - quiet
    assert all(";" in line for line in lines)  # raw "prefix;message" records


FAKE_DMESG = r'''
import sys, time
args = sys.argv[1:]
if "--help" in args:
    print(" -w, --follow   wait for new messages")
    if sys.argv[0].endswith("new.py"):
        print(" -W, --follow-new   wait and print only new messages")
    sys.exit(0)
if "--fail" in args:
    sys.stderr.write("dmesg: read kernel buffer failed: Operation not permitted\n")
    sys.exit(1)
print("[    1.000000] " + sys.argv[-2] + " old", flush=True)
print("[%14.6f] %s" % (time.clock_gettime(time.CLOCK_MONOTONIC) + 5, sys.argv[-2]), flush=True)
print("args: " + " ".join(a for a in args if a.startswith("-")), flush=True)
time.sleep(60)
'''


def _fake_dmesg(tmp_path: Path, name: str) -> list:
    script = tmp_path / name
    script.write_text(FAKE_DMESG)
    return ["timeout", "-s", "KILL", "60", sys.executable, str(script), XID79]


@pytest.mark.parametrize("name, expected_flag, old_seen", [
    ("dmesg_new.py", "--follow-new", True),   # --follow-new: dmesg itself skips the old buffer
    ("dmesg_old.py", "--follow", False),      # --follow: lines older than the start skipped
])
def test_dmesg_fallback(tmp_path, name, expected_flag, old_seen):
    got = []
    f = KmsgFollower(got.append, kmsg_path=str(tmp_path / "missing"),
                     dmesg_argv=_fake_dmesg(tmp_path, name), poll_interval=0.05).start()
    try:
        assert f.kernel_source == "dmesg"
        assert _wait(lambda: len(got) >= (2 if old_seen else 1))
        time.sleep(0.2)
        assert len(got) == (2 if old_seen else 1)
        assert f._proc.args[-1] == expected_flag
    finally:
        f.stop()
    assert f._proc.poll() is not None


def test_unavailable_kernel_log_says_why(tmp_path):
    f = KmsgFollower(kmsg_path=str(tmp_path / "missing"), dmesg_argv=["/nonexistent/dmesg"])
    f.start()
    f.stop()
    assert not f.available
    assert "missing is not readable" in f.reason and "cannot run /nonexistent/dmesg" in f.reason
    g = KmsgFollower(kmsg_path=str(tmp_path / "missing"),
                     dmesg_argv=_fake_dmesg(tmp_path, "dmesg_new.py") + ["--fail"]).start()
    try:  # on a loaded machine the failing dmesg can outlast start()'s wait
        assert _wait(lambda: not g.available)
    finally:
        g.stop()
    assert "Operation not permitted" in g.reason


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="dmesg needs /dev/kmsg")
def test_real_dmesg_follow(tmp_path):
    f = KmsgFollower(kmsg_path=str(tmp_path / "missing")).start()
    try:
        assert f.kernel_source == "dmesg", f.reason
    finally:
        f.stop()
    assert f._proc.poll() is not None
