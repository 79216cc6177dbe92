"""Aggregated stack analysis of all ranks, in the manner of LLNL STAT.

Every rank contributes the stack of its *main thread* (the thread named
``MainThread``, else the first thread), read outermost frame first.  The
stacks of all ranks are merged into a prefix tree; ranks whose paths are
identical form an equivalence class.  Walking the tree from the root along the
dominant branch, the ranks that leave it at a divergence point are the
suspects.

Frame identity: a frame's key is ``"function (file basename)"``; line numbers
are ignored on purpose, so ranks sitting at different lines of the same
function (a polling loop, different sleep calls) are alike.

Collective waits: once the dominant path enters a frame that looks like a
collective (``all_reduce``, ``barrier``, ``wait``, ...), the walk stops, since
differences below it are just where each rank happens to poll.  At a
divergence where some branches wait in a collective and others do not, and the
waiting ranks are at least as many as the rest, the ranks *not* in a
collective are the suspects: they are what the others wait for.  Otherwise
the largest branch is dominant (ties go to a waiting branch, then the lowest
rank) and the ranks of every other branch are suspects.  Ranks with no stack
(missing dump, unreadable file, capture ``error``, no frames) are suspects too.

Input: SPEC ``stack`` event threads (``{"name","id","active","frames"}``,
frames innermost first with ``function/file/line``), ``py-spy dump --json``
output (a list of threads with ``thread_name/thread_id/frames`` and frames with
``name/filename/line``), or recordings (``.jsonl``, ``.jsonl.gz``,
``.jsonl.zst``) holding SPEC ``stack`` events.

>>> t = lambda *fns: [{"name": "MainThread", "id": 1, "active": False,
...     "frames": [{"function": f, "file": "/x/train.py", "line": 1} for f in fns]}]
>>> r = analyze_threads({0: t("all_reduce", "step", "<module>"),
...                      1: t("all_reduce", "step", "<module>"),
...                      2: t("load_batch", "step", "<module>")})
>>> r["suspects"], r["missing"], [c["ranks"] for c in r["classes"]]
([2], [], [[0, 1], [2]])
>>> print(render_tree_text(r))
[0-2] <module> (train.py) > step (train.py)
  [0-1] all_reduce (train.py)
  [2] load_batch (train.py)  <== suspect
"""
from __future__ import annotations

import gzip
import io
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable
from trainguard.rank_sets import format_ranks

__all__ = ["analyze_threads", "analyze_dir", "render_tree_text", "map_suspects",
           "normalize_threads", "load_stack_file", "format_ranks", "rank_from_name",
           "frame_key", "is_collective_frame"]

_COLLECTIVE_SUB = re.compile(
    r"all_?reduce|all_?gather|reduce_?scatter|broadcast|barrier|all_?to_?all|"
    r"batch_isend_irecv|collective", re.I)
_COLLECTIVE_EXACT = {"wait", "synchronize", "send", "recv", "isend", "irecv", "reduce",
                     "gather", "scatter", "wait_all", "_wait"}
_STACK_SUFFIXES = (".json", ".jsonl", ".jsonl.gz", ".jsonl.zst")


def rank_from_name(name: str) -> int | None:
    """The rank of a dump file: the last integer in its name.

    >>> rank_from_name("rank12.json"), rank_from_name("dump_3.json"), rank_from_name("x.json")
    (12, 3, None)
    """
    found = re.findall(r"\d+", name)
    return int(found[-1]) if found else None


def frame_key(frame: dict) -> str:
    """``"function (basename)"``; the line is deliberately ignored.

    >>> frame_key({"function": "wait", "file": "/a/b/dist.py", "line": 3})
    'wait (dist.py)'
    """
    fn = frame.get("function") or "?"
    base = os.path.basename(str(frame.get("file") or "")) or "?"
    return f"{fn} ({base})"


def is_collective_frame(label: str) -> bool:
    """Does a frame label look like a collective / wait call?

    >>> is_collective_frame("all_reduce (distributed_c10d.py)"), is_collective_frame("load_batch (d.py)")
    (True, False)
    """
    fn = label.split(" (", 1)[0]
    short = fn.rsplit(".", 1)[-1]
    return short.lower() in _COLLECTIVE_EXACT or bool(_COLLECTIVE_SUB.search(short))


# ----------------------------------------------------------------- normalizing
def _norm_frame(f: Any) -> dict:
    if not isinstance(f, dict):
        raise ValueError(f"frame is not an object: {f!r:.60}")
    fn = f.get("function", f.get("name"))
    file = f.get("file", f.get("filename", f.get("short_filename")))
    line = f.get("line")
    return {"function": str(fn) if fn is not None else "?",
            "file": str(file) if file is not None else "?",
            "line": line if isinstance(line, int) and not isinstance(line, bool) else None}


def _norm_thread(t: dict) -> dict:
    frames = t.get("frames")
    if not isinstance(frames, list):
        raise ValueError("thread has no frames list")
    name = t.get("name", t.get("thread_name"))
    tid = t.get("id", t.get("thread_id", t.get("os_thread_id")))
    return {"name": str(name) if name is not None else "", "id": tid,
            "active": bool(t.get("active", False)),
            "frames": [_norm_frame(f) for f in frames]}


def normalize_threads(data: Any) -> list[dict]:
    """SPEC thread list from py-spy ``dump --json`` output or a SPEC stack event.

    Accepts a list of threads (py-spy 0.4 prints one, ``--subprocesses``
    concatenates the threads of all processes), a list of process objects each
    with ``threads``, a single such object, or a ``stack`` event.  Raises
    ``ValueError`` on anything else.

    >>> normalize_threads([{"thread_name": "MainThread", "thread_id": 7, "active": True,
    ...     "frames": [{"name": "f", "filename": "/a.py", "line": 2}]}])
    [{'name': 'MainThread', 'id': 7, 'active': True, 'frames': [{'function': 'f', 'file': '/a.py', 'line': 2}]}]
    """
    if isinstance(data, dict):
        if isinstance(data.get("threads"), list):
            return normalize_threads(data["threads"])
        if "frames" in data:
            return [_norm_thread(data)]
        raise ValueError("object has neither 'threads' nor 'frames'")
    if not isinstance(data, list):
        raise ValueError(f"expected a list of threads, got {type(data).__name__}")
    out: list[dict] = []
    for item in data:
        if not isinstance(item, dict):
            raise ValueError("thread entry is not an object")
        if "frames" in item:
            out.append(_norm_thread(item))
        elif isinstance(item.get("threads"), list):
            out.extend(normalize_threads(item["threads"]))
        else:
            raise ValueError("thread entry has no 'frames'")
    return out


def main_path(threads: list[dict]) -> list[str]:
    """Frame labels of the main thread, outermost first."""
    if not threads:
        return []
    main = next((t for t in threads if t.get("name") == "MainThread"), threads[0])
    return [frame_key(f) for f in reversed(main.get("frames") or [])]


# ----------------------------------------------------------------- loading
def _open_text(path: Path) -> io.TextIOBase:
    name = path.name
    if name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if name.endswith(".zst"):
        try:
            import zstandard  # optional
        except ImportError as e:
            raise ValueError("reading .zst needs the 'zstandard' module") from e
        raw = open(path, "rb")
        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True),
                                encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def _read_recording(path: Path) -> tuple[dict[int, dict], int]:
    """Latest capture's stack events of a recording: ``({rank: event}, invalid)``."""
    captures: dict[Any, dict[int, dict]] = {}
    last_ts: dict[Any, float] = {}
    invalid = 0
    with _open_text(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                ev = json.loads(line)
            except ValueError:
                invalid += 1
                continue
            if not isinstance(ev, dict) or ev.get("type") != "stack":
                continue
            rank = ev.get("rank")
            if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
                invalid += 1
                continue
            cid = ev.get("capture_id")
            captures.setdefault(cid, {})[rank] = ev
            ts = ev.get("ts")
            last_ts[cid] = max(last_ts.get(cid, float("-inf")),
                               ts if isinstance(ts, (int, float)) else float("-inf"))
    if not captures:
        return {}, invalid
    latest = max(captures, key=lambda c: last_ts[c])
    return captures[latest], invalid


def load_stack_file(path: str | os.PathLike) -> dict[int, list[dict] | str]:
    """``{rank: threads}`` from one file, or ``{rank: "error text"}`` for a failed capture.

    ``.json`` files are py-spy dumps or single stack events (rank from the
    file name, else from the event); recordings give every rank of their
    latest capture, skipping invalid lines.  Raises on unreadable input.
    """
    return _load(Path(path))[0]


def _load(p: Path) -> tuple[dict[int, list[dict] | str], int]:
    """:func:`load_stack_file` plus the count of invalid recording lines."""
    if p.name.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst")):
        events, invalid = _read_recording(p)
        out: dict[int, list[dict] | str] = {}
        for rank, ev in events.items():
            if ev.get("error"):
                out[rank] = str(ev["error"])
            else:
                try:
                    out[rank] = normalize_threads(ev.get("threads") or [])
                except ValueError as e:
                    out[rank] = f"bad threads: {e}"
        return out, invalid
    with open(p, "r", encoding="utf-8") as fh:
        data = json.load(fh)
    rank = rank_from_name(p.name)
    if rank is None and isinstance(data, dict) and isinstance(data.get("rank"), int):
        rank = data["rank"]
    if rank is None:
        raise ValueError("no rank in file name")
    if isinstance(data, dict) and data.get("error"):
        return {rank: str(data["error"])}, 0
    return {rank: normalize_threads(data)}, 0


# ----------------------------------------------------------------- the tree
class _Node:
    __slots__ = ("label", "ranks", "ends", "children")

    def __init__(self, label: str):
        self.label, self.ranks, self.ends, self.children = label, set(), set(), {}

    def add(self, rank: int, path: list[str]) -> None:
        node = self
        node.ranks.add(rank)
        for label in path:
            node = node.children.setdefault(label, _Node(label))
            node.ranks.add(rank)
        node.ends.add(rank)

    def waiting_ranks(self) -> set[int]:
        """Ranks whose path passes through a collective frame at or below this node."""
        if self.label and is_collective_frame(self.label):
            return set(self.ranks)
        out: set[int] = set()
        for c in self.children.values():
            out |= c.waiting_ranks()
        return out

    def to_dict(self) -> dict:
        kids = sorted(self.children.values(), key=lambda n: (-len(n.ranks), min(n.ranks)))
        return {"frame": self.label, "ranks": sorted(self.ranks), "count": len(self.ranks),
                "ends": sorted(self.ends), "children": [k.to_dict() for k in kids]}


def _branches(node: _Node) -> list[tuple[set[int], _Node | None]]:
    out: list[tuple[set[int], _Node | None]] = [(c.ranks, c) for c in node.children.values()]
    if node.ends and node.label:
        out.append((node.ends, None))  # ranks whose stack ends exactly here
    return out


def _walk(root: _Node) -> tuple[_Node, set[int], list[dict]]:
    """Follow the dominant branch; return (stop node, suspects, divergences)."""
    node, suspects, divergences = root, set(), []
    while True:
        branches = _branches(node)
        if not branches:
            return node, suspects, divergences
        if len(branches) > 1:
            waits = [(rs, c) for rs, c in branches if c is not None and c.waiting_ranks() == rs]
            rest = [(rs, c) for rs, c in branches if (rs, c) not in waits]
            n_wait, n_rest = sum(len(r) for r, _ in waits), sum(len(r) for r, _ in rest)
            if waits and rest and n_wait >= n_rest:
                dom = max(waits, key=lambda b: (len(b[0]), -min(b[0])))
                losers = rest
            else:
                dom = max(branches, key=lambda b: (len(b[0]), b in waits, -min(b[0])))
                losers = [b for b in branches if b is not dom]
            for rs, c in losers:
                suspects |= rs
                divergences.append({"at": node.label or "<root>", "ranks": sorted(rs),
                                    "branch": c.label if c else "(stack ends here)",
                                    "dominant": dom[1].label if dom[1] else "(stack ends here)",
                                    "dominant_ranks": sorted(dom[0])})
            nxt = dom[1]
        else:
            nxt = branches[0][1]
        if nxt is None:
            return node, suspects, divergences
        node = nxt
        if is_collective_frame(node.label):
            return node, suspects, divergences


def _common_path(root: _Node) -> list[str]:
    path, node = [], root
    while len(node.children) == 1 and not (node.ends and node.label):
        node = next(iter(node.children.values()))
        path.append(node.label)
    return path


# ----------------------------------------------------------------- analysis
def analyze_threads(per_rank: dict[int, list[dict] | str | None],
                    expected_ranks: Iterable[int] | None = None,
                    errors: list[dict] | None = None) -> dict:
    """SPEC §4 result from ``{rank: threads}``.

    A value that is a string is a failed capture (its ``error``); ``None`` or
    an empty list is a rank with no stack.  ``expected_ranks`` defaults to
    ``0..max(rank)``; expected ranks absent from ``per_rank`` are ``missing``.
    ``errors`` (``[{"rank", "file", "error"}]``) is passed through.
    """
    errors = list(errors or [])
    seen = set(per_rank)
    expected = set(expected_ranks) if expected_ranks is not None else (
        set(range(max(seen) + 1)) if seen else set())
    missing = sorted(expected - seen)
    root, paths, no_stack = _Node(""), {}, set()
    for rank in sorted(per_rank):
        threads = per_rank[rank]
        if isinstance(threads, str):
            no_stack.add(rank)
            errors.append({"rank": rank, "error": f"capture failed: {threads}"})
            continue
        try:
            path = main_path(normalize_threads(threads or []))
        except ValueError as e:
            no_stack.add(rank)
            errors.append({"rank": rank, "error": f"bad stack: {e}"})
            continue
        if not path:
            no_stack.add(rank)
            errors.append({"rank": rank, "error": "no frames in the stack"})
            continue
        paths[rank] = path
        root.add(rank, path)

    by_path: dict[tuple, list[int]] = {}
    for rank, path in paths.items():
        by_path.setdefault(tuple(path), []).append(rank)
    classes = [{"ranks": sorted(rs), "signature": " > ".join(p)} for p, rs in by_path.items()]
    classes.sort(key=lambda c: (-len(c["ranks"]), c["ranks"][0]))
    if no_stack:
        classes.append({"ranks": sorted(no_stack), "signature": "(no stack)"})

    stop, tree_suspects, divergences = _walk(root) if paths else (root, set(), [])
    suspects = sorted(tree_suspects | no_stack | set(missing))
    common = _common_path(root)
    collective = stop.label if stop.label and is_collective_frame(stop.label) else None
    # all alike: the innermost common frame; else where the dominant ranks stopped
    waiting_on = (common[-1] if common else None) if not tree_suspects else (stop.label or None)

    n = len(expected | seen)
    if not paths:
        summary = f"no stacks from any of {n} ranks"
    elif not tree_suspects:
        summary = f"all {len(paths)} ranks with stacks are alike: they all wait in {waiting_on}"
        if collective and collective != waiting_on:
            summary += f", inside {collective}"
        if len(by_path) > 1:
            summary += " (their stacks differ only below that)"
    else:
        d = divergences[0]
        summary = (f"rank(s) {format_ranks(tree_suspects)} diverge from the others "
                   f"at {d['at']}: in {d['branch']} while rank(s) "
                   f"{format_ranks(d['dominant_ranks'])} are in "
                   f"{waiting_on}")
    extra = []
    if missing:
        extra.append(f"no dump from rank(s) {format_ranks(missing)}")
    if no_stack:
        extra.append(f"no stack from rank(s) {format_ranks(no_stack)}")
    if extra:
        summary += "; " + "; ".join(extra)

    result = {"ranks": n, "classes": classes, "suspects": suspects, "missing": missing,
              "summary": summary, "waiting_on": waiting_on, "divergences": divergences,
              "tree": root.to_dict()}
    if errors:
        result["errors"] = errors
    return result


def analyze_dir(path: str | os.PathLike, expected_ranks: Iterable[int] | None = None) -> dict:
    """Analyze every stack dump in a directory (see :func:`load_stack_file`).

    Files that cannot be read are listed under ``errors``; their rank (from the
    file name) then counts as missing.  Raises ``FileNotFoundError`` when the
    directory does not exist.
    """
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"stack dump directory not found: {d} "
                                "(give the folder holding rankN.json or recording files)")
    per_rank: dict[int, list[dict] | str] = {}
    errors: list[dict] = []
    failed: set[int] = set()
    for f in sorted(d.iterdir(), key=lambda p: p.name):
        if not f.is_file() or not f.name.endswith(_STACK_SUFFIXES):
            continue
        try:
            got, invalid = _load(f)
            per_rank.update(got)
            if invalid:
                errors.append({"file": f.name, "rank": None,
                               "error": f"{invalid} invalid line(s) skipped"})
        except Exception as e:  # noqa: BLE001 -- JSON, gzip, zstd, OS errors: never fatal
            rank = rank_from_name(f.name) if f.name.endswith(".json") else None
            errors.append({"file": f.name, "rank": rank, "error": f"{type(e).__name__}: {e}"})
            if rank is not None:
                failed.add(rank)
    failed -= set(per_rank)
    if expected_ranks is None:
        top = max(set(per_rank) | failed, default=-1)
        expected_ranks = range(top + 1)
    return analyze_threads(per_rank, expected_ranks=set(expected_ranks) | failed, errors=errors)


# ----------------------------------------------------------------- rendering
def render_tree_text(result_or_tree: dict, suspects: Iterable[int] | None = None,
                     collapse: bool = True) -> str:
    """Compact text tree for alerts; chains of frames shared by the same ranks
    are joined on one line (long chains elided), suspect branches are marked."""
    tree = result_or_tree.get("tree", result_or_tree)
    if suspects is None:
        suspects = result_or_tree.get("suspects", [])
    sus = set(suspects)
    lines: list[str] = []

    def chain(node: dict) -> tuple[list[str], dict]:
        labels = [node["frame"]]
        while (collapse and len(node["children"]) == 1 and not node["ends"]
               and node["children"][0]["ranks"] == node["ranks"]):
            node = node["children"][0]
            labels.append(node["frame"])
        return labels, node

    def emit(node: dict, depth: int, parent_sus: bool) -> None:
        labels, last = chain(node)
        text = " > ".join(labels) if len(labels) <= 4 else (
            f"{labels[0]} > {labels[1]} > ... ({len(labels) - 3} more) > {labels[-1]}")
        mine = set(node["ranks"])
        mark = "  <== suspect" if (mine and mine <= sus and not parent_sus) else ""
        lines.append(f"{'  ' * depth}[{format_ranks(mine)}] {text}{mark}")
        for c in last["children"]:
            emit(c, depth + 1, parent_sus or bool(mark))

    if tree.get("frame"):
        emit(tree, 0, False)
    else:
        for c in tree.get("children", []):
            emit(c, 0, False)
    return "\n".join(lines)


# ----------------------------------------------------------------- mapping
def _coords(rank: int, order: list[str], sizes: dict[str, int]) -> dict[str, int]:
    out, r = {}, rank
    for dim in order:
        out[dim], r = r % sizes[dim], r // sizes[dim]
    return out


def map_suspects(suspects: Iterable[int], rank_to_node: dict[int, str] | None = None,
                 topology: dict | None = None, world_size: int | None = None) -> dict:
    """Machines and TP/DP/PP groups of the suspect ranks (``unmapped``: ranks with no node).

    Layout is TP fastest, then DP, then PP (Megatron-LM), unless
    ``topology["layout"]`` names another order, fastest first (``"tp-pp-dp"``).

    >>> m = map_suspects([5], {5: "n1"}, {"tp": 2, "dp": 2, "pp": 2})
    >>> m["nodes"], m["groups"]
    (['n1'], {'tp': [[4, 5]], 'dp': [[5, 7]], 'pp': [[1, 5]]})
    """
    sus = sorted(set(suspects))
    r2n = {int(k): v for k, v in (rank_to_node or {}).items()}
    nodes = sorted({r2n[r] for r in sus if r in r2n})
    groups: dict[str, list[list[int]]] = {"tp": [], "dp": [], "pp": []}
    result = {"nodes": nodes, "groups": groups, "unmapped": [r for r in sus if r not in r2n]}
    if not topology:
        return result
    sizes = {k: max(1, int(topology.get(k) or 1)) for k in ("tp", "dp", "pp")}
    layout = topology.get("layout") or "tp-dp-pp"
    order = re.findall(r"[a-z]+", layout.lower()) if isinstance(layout, str) else list(layout)
    if sorted(order) != ["dp", "pp", "tp"]:
        order = ["tp", "dp", "pp"]
    world = world_size or sizes["tp"] * sizes["dp"] * sizes["pp"]
    coords = {r: _coords(r, order, sizes) for r in range(world)}
    for dim in ("tp", "dp", "pp"):  # a group: all ranks sharing the other coordinates
        others = [o for o in order if o != dim]
        wanted = {tuple(coords[r][o] for o in others) for r in sus if r in coords}
        members: dict[tuple[int, ...], list[int]] = {}
        for s in range(world):
            key = tuple(coords[s][o] for o in others)
            if key in wanted:
                members.setdefault(key, []).append(s)
        groups[dim] = sorted(members.values())
    return result
