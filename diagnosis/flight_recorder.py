"""Analysis of PyTorch Flight Recorder (NCCL trace) dumps of all ranks.

Loading.  Dumps are pickles.  They are read only with :class:`PlainDataUnpickler`,
whose ``find_class`` refuses every global: plain data (dict, list, tuple, str,
bytes, numbers, bool, None) needs no global, so nothing in a dump can import
or call anything.  A dump that needs a global raises :class:`UnsafePickleError`
and, in :func:`analyze_dir`, its rank is recorded as unreadable and missing.

What a dump holds (version 2.x): ``pg_config`` (group name -> ``desc`` and
member ``ranks``), ``pg_status`` (the rank's *local* group id ->
``last_enqueued_collective`` / ``last_completed_collective``) and ``entries``,
the recent operations with ``pg_id`` (local id), ``process_group``
(``(name, desc)``), ``collective_seq_id``, ``p2p_seq_id``, ``is_p2p``,
``state`` and ``profiling_name``.

Local ids to group names.  Entries pair a local id with a group name.  Ranks
with no entries (often the very ranks that hang) give only ids, so the rest is
mapped by order: group names are global creation counters (every rank calls
``new_group`` for every group, in the same order) and local ids count, in the
same order, the groups this rank created, so sorting both numerically pairs
them.  Where entries exist they agree with this.

Analysis, per group (keyed by its global name): a member ``w`` that has
enqueued more than it completed (``E_w > C_w``) is *waiting* in operation
``C_w + 1``.  Another member ``r`` *holds it up* when it never reached that
operation (``E_r <= C_w``) or never completed one that ``w`` completed
(``C_r < C_w``).  For a point-to-point wait only the peer named in the
operation counts, and only when the peer has not posted the matching
operation.  A member with no dump holds up everyone waiting in its groups.
This gives a *waits-for* graph between ranks, across all groups.

Root causes.  A rank blocked in group B because a peer of B is stuck in group
A is not a root cause: the suspects are the ranks in terminal strongly
connected components of the waits-for graph (ranks others wait on that wait on
no one outside themselves; a cycle there is a deadlock and all of it is
blamed), plus ranks with no readable dump.  On ``lock_gil_1st`` ranks 9 and 14
held the GIL: they never enqueued the next tensor-parallel, data-parallel and
expert collectives; their stage peers wait for them there, and the stage-0
ranks wait on stage 1 in point-to-point receives, so only 9 and 14 are
terminal.

Classes group ranks whose collective progress is alike: the same
``(desc, last completed, last enqueued)`` in each of their groups.
"""
from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path
from typing import Any, Iterable

__all__ = ["PlainDataUnpickler", "UnsafePickleError", "load_dump", "analyze_dumps",
           "analyze_dir"]

_PLAIN = (str, bytes, int, float, bool, type(None))
_SKIP_SUFFIXES = (".log", ".txt", ".md", ".csv", ".py", ".sh")
_P2P_RE = re.compile(r"(send|recv)\s+(\d+)\s*(->|<-)\s*(\d+)")


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle asked for a global (a class or function); it was not loaded."""


class PlainDataUnpickler(pickle.Unpickler):
    """Unpickler that admits plain data only: every global is refused.

    >>> import io, os
    >>> class Evil:
    ...     def __reduce__(self):
    ...         return (os.system, ("true",))
    >>> PlainDataUnpickler(io.BytesIO(pickle.dumps({"a": [1, (2.5, None)]}))).load()
    {'a': [1, (2.5, None)]}
    >>> try:
    ...     PlainDataUnpickler(io.BytesIO(pickle.dumps(Evil()))).load()
    ... except UnsafePickleError as e:
    ...     print(e)
    refused to load global 'posix.system': Flight Recorder dumps must be plain data
    """

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafePickleError(f"refused to load global '{module}.{name}': "
                                "Flight Recorder dumps must be plain data")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("refused a persistent id: Flight Recorder dumps must be plain data")

    def load(self) -> Any:
        """Load, then check that only plain types came out (newer protocols build sets and
        bytearrays without any global; they are harmless, but not what a dump holds) and
        that the data is bounded (see :func:`check_plain_data`)."""
        data = super().load()
        check_plain_data(data)
        return data


#: a real dump (2,000 entries with their stack frames) is well under a million values
MAX_DUMP_BYTES = 256 * 1024 * 1024
MAX_EXPANDED_VALUES = 10_000_000
MAX_NESTING = 64


def check_plain_data(data: Any, max_values: int = MAX_EXPANDED_VALUES,
                     max_nesting: int = MAX_NESTING) -> None:
    """Refuse non-plain values, cycles, nesting deeper than ``max_nesting`` and data that
    *expands* to more than ``max_values`` values.

    A pickle's memo lets a few hundred bytes refer to one list from ten places, level after
    level (a "billion laughs" bomb); anything that walks the result would then walk it 10**9
    times.  Sizes are counted per distinct object, so the check costs what was loaded.

    >>> a = [1]
    >>> for _ in range(9):
    ...     a = [a] * 10
    >>> try:
    ...     check_plain_data({"entries": a})
    ... except UnsafePickleError as e:
    ...     print(e)
    refused: the data expands to more than 10000000 values (a pickle bomb?)
    """
    size: dict[int, int] = {}
    height: dict[int, int] = {}
    active: set[int] = set()
    todo: list = [(data, False)]
    while todo:
        x, done = todo.pop()
        kind = type(x)
        if kind is dict:
            children = [*x.keys(), *x.values()]
        elif kind is list or kind is tuple:
            children = x
        elif kind in _PLAIN:
            continue
        else:
            raise UnsafePickleError(f"refused a value of type {kind.__name__}: "
                                    "Flight Recorder dumps must be plain data")
        key = id(x)
        if done:
            active.discard(key)
            total, deepest = 1, 0
            for c in children:
                total += size.get(id(c), 1)
                deepest = max(deepest, height.get(id(c), 0))
            if total > max_values:
                raise UnsafePickleError(f"refused: the data expands to more than {max_values} "
                                        "values (a pickle bomb?)")
            if deepest + 1 > max_nesting:
                raise UnsafePickleError(f"refused: nested more than {max_nesting} levels deep")
            size[key], height[key] = total, deepest + 1
            continue
        if key in size:
            continue
        if key in active:
            raise UnsafePickleError("refused: the data refers to itself (a cycle)")
        active.add(key)
        todo.append((x, True))
        todo.extend((c, False) for c in children)


def load_dump(path: str | os.PathLike) -> dict:
    """Load one dump with :class:`PlainDataUnpickler` (or as JSON, if it is JSON).

    Raises ``UnsafePickleError`` for a pickle that needs any global, and
    ``ValueError`` when the result is not a dict.
    """
    with open(path, "rb") as fh:
        length = os.fstat(fh.fileno()).st_size
        if length > MAX_DUMP_BYTES:
            raise ValueError(f"refused: {length} bytes, more than a dump's {MAX_DUMP_BYTES}")
        head = fh.read(1)
        fh.seek(0)
        if head in (b"{", b" ", b"\n"):
            data = json.load(fh)
            check_plain_data(data)
        else:
            data = PlainDataUnpickler(fh).load()
    if not isinstance(data, dict):
        raise ValueError(f"not a Flight Recorder dump: top level is {type(data).__name__}")
    return data


# ----------------------------------------------------------------- per-rank view
def _int(x: Any, default: int | None = None) -> int | None:
    try:
        return int(x)
    except (TypeError, ValueError, OverflowError):
        return default


def _parse_ranks(value: Any) -> list[int] | None:
    """Member ranks, given as a list or as its text (``"[0, 1, 2]"``)."""
    if isinstance(value, str) and value.strip().startswith(("[", "(")):
        return [int(x) for x in re.findall(r"-?\d+", value)]
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return list(value)
    return None


def _seq(entry: dict) -> int | None:
    return _int(entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id"))


def _rank_view(rank: int, dump: dict) -> dict[str, dict]:
    """``{group name: {"desc", "ranks", "C", "E", "pending": [entries]}}`` of one rank."""
    config = dump.get("pg_config") if isinstance(dump.get("pg_config"), dict) else {}
    status = dump.get("pg_status") if isinstance(dump.get("pg_status"), dict) else None
    raw = dump.get("entries")
    entries = [e for e in raw if isinstance(e, dict)] if isinstance(raw, (list, tuple)) else []
    id2name: dict[str, str] = {}
    for e in entries:
        pg = e.get("process_group")
        if e.get("pg_id") is not None and isinstance(pg, (list, tuple)) and pg:
            id2name[str(e["pg_id"])] = str(pg[0])
    if status is not None:  # the other ids by creation order, where entries agree (module doc)
        ids = sorted(map(str, status), key=lambda i: _int(i, 1 << 62))
        names = sorted(map(str, config), key=lambda n: _int(n, 1 << 62))
        by_order = dict(zip(ids, names))
        if len(ids) == len(names) and all(by_order.get(i) == n for i, n in id2name.items()):
            id2name = {**by_order, **id2name}
    groups: dict[str, dict] = {}
    for name, cfg in config.items():
        cfg = cfg if isinstance(cfg, dict) else {}
        groups[str(name)] = {"desc": str(cfg.get("desc", name)), "ranks": _parse_ranks(cfg.get("ranks")),
                             "C": None, "E": None, "pending": []}
    for e in entries:
        pg = e.get("process_group")
        name = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else id2name.get(str(e.get("pg_id")))
        if name is None:
            continue
        g = groups.setdefault(name, {"desc": str(pg[1]) if isinstance(pg, (list, tuple)) and len(pg) > 1
                                     else name, "ranks": None, "C": None, "E": None, "pending": []})
        g.setdefault("_entries", []).append(e)
    for pid, st in (status or {}).items():
        name = id2name.get(str(pid))
        if name is not None and isinstance(st, dict):
            g = groups.setdefault(name, {"desc": name, "ranks": None, "C": None, "E": None, "pending": []})
            g["C"] = _int(st.get("last_completed_collective"), 0)
            g["E"] = _int(st.get("last_enqueued_collective"), 0)
    for g in groups.values():
        ents = g.pop("_entries", [])
        if g["C"] is None:  # no pg_status: derive progress from the entries
            seqs = [s for s in map(_seq, ents) if s is not None]
            done = [_seq(e) for e in ents if e.get("state") == "completed" and _seq(e) is not None]
            g["E"] = max(seqs, default=0)
            g["C"] = max(done, default=min(seqs, default=1) - 1)
        g["pending"] = sorted((e for e in ents if e.get("state") != "completed"
                               and (_seq(e) or 0) > g["C"]), key=lambda e: _seq(e) or 0)
    return groups


def _op_name(entry: dict | None) -> str:
    if not entry:
        return "?"
    return _P2P_RE.sub(r"\1", str(entry.get("profiling_name") or "?"))


def _p2p_peer(entry: dict, members: list[int] | None) -> tuple[int, str] | None:
    """Global rank of the peer of a p2p entry (``nccl:send 0->1`` are group ranks)."""
    m = _P2P_RE.search(str(entry.get("profiling_name") or ""))
    if not m or not members:
        return None
    kind, peer = m.group(1), int(m.group(4))  # "send me->peer", "recv me<-peer"
    return (members[peer], kind) if 0 <= peer < len(members) else None


# ----------------------------------------------------------------- analysis
def _terminal_sccs(nodes: set[int], edges: dict[int, set[int]]) -> list[set[int]]:
    """Strongly connected components with no edge leaving them (iterative Tarjan).

    >>> _terminal_sccs({0, 1, 2, 3}, {0: {1}, 1: {2}, 2: {1}, 3: set()})
    [{1, 2}, {3}]
    """
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    stack: list[int] = []
    on_stack: set[int] = set()
    comps: list[set[int]] = []

    def visit(v: int) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)

    for start in sorted(nodes):
        if start in index:
            continue
        visit(start)
        work = [(start, iter(sorted(edges.get(start, ()))))]
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    visit(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp: set[int] = set()
                    while not comp or v not in comp:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                    comps.append(comp)
    terminal = [c for c in comps if all(edges.get(v, set()) <= c for v in c)]
    return sorted(terminal, key=min)


def analyze_dumps(per_rank: dict[int, dict], expected_ranks: Iterable[int] | None = None,
                  errors: list[dict] | None = None) -> dict:
    """SPEC §4 result from ``{rank: loaded dump}`` (see the module doc for the method)."""
    views = {r: _rank_view(r, d) for r, d in per_rank.items()}
    world: set[int] = set(per_rank)
    members: dict[str, list[int]] = {}
    descs: dict[str, str] = {}
    for r, view in views.items():
        for name, g in view.items():
            descs.setdefault(name, g["desc"])
            if g["ranks"]:
                members.setdefault(name, g["ranks"])
                world.update(g["ranks"])
    if expected_ranks is not None:
        world.update(expected_ranks)
    else:  # by default the world is 0..highest rank seen or named in a group
        world.update(range(max(world, default=-1) + 1))
    missing = sorted(world - set(per_rank))

    edges: dict[int, set[int]] = {r: set() for r in world}
    why: dict[tuple[int, int], str] = {}
    groups_out = []
    for name in sorted(members, key=lambda n: _int(n, 1 << 62)):
        mem = members[name]
        st = {r: views[r][name] for r in mem if r in views and name in views[r]}
        waiting = sorted(r for r, g in st.items() if g["E"] > g["C"])
        if not waiting:
            continue
        behind: set[int] = set()
        for w in waiting:
            gw = st[w]
            first = gw["pending"][0] if gw["pending"] else None
            peer = _p2p_peer(first, mem) if first is not None and first.get("is_p2p") else None
            cands = [peer[0]] if peer else [r for r in mem if r != w]
            for r in cands:
                if r == w:
                    continue
                gr = st.get(r)
                if gr is None:
                    reason = ("has no dump, blocking" if r not in views
                              else "has no record of the group, blocking")
                elif peer:
                    posted = any(_p2p_peer(e, mem) and _p2p_peer(e, mem)[0] == w
                                 for e in gr["pending"]) or (gr["E"] > gr["C"] and not gr["pending"])
                    if posted:
                        continue
                    reason = "never posted the " + ("recv" if peer[1] == "send" else "send") + " matching"
                elif gr["E"] <= gw["C"]:
                    reason = "never reached"
                elif gr["C"] < gw["C"]:
                    reason = f"never completed #{gr['C'] + 1}, blocking"
                else:
                    continue
                edges[w].add(r)
                behind.add(r)
                why.setdefault((w, r), (reason, f"{descs[name]} #{gw['C'] + 1} {_op_name(first)}"))
        seqs = sorted({st[w]["C"] + 1 for w in waiting})
        first = st[waiting[0]]["pending"][0] if st[waiting[0]]["pending"] else None
        groups_out.append({"name": name, "desc": descs[name], "ranks": mem, "waiting": waiting,
                           "seq": seqs[0] if len(seqs) == 1 else seqs, "op": _op_name(first),
                           "behind": sorted(behind)})

    terminal = _terminal_sccs(world, edges)
    waited_on = {r for targets in edges.values() for r in targets}
    roots: set[int] = set()
    for comp in terminal:
        if len(comp) > 1 or comp & waited_on:
            roots |= comp
    suspects = sorted(roots | set(missing))

    # classes: alike collective progress
    by_key: dict[tuple, list[int]] = {}
    sig_of: dict[tuple, str] = {}
    for r in sorted(views):
        v = views[r]
        key = tuple(sorted((g["desc"], g["C"] or 0, g["E"] or 0) for g in v.values()))
        by_key.setdefault(key, []).append(r)
        if key not in sig_of:
            pend = [f"{g['desc']} #{g['C'] + 1} {_op_name(g['pending'][0] if g['pending'] else None)}"
                    for g in sorted(v.values(), key=lambda g: g["desc"]) if (g["E"] or 0) > (g["C"] or 0)]
            sig_of[key] = ("waiting in " + "; ".join(pend)) if pend else "nothing pending in any group"
    classes = [{"ranks": rs, "signature": sig_of[k]} for k, rs in by_key.items()]
    classes.sort(key=lambda c: (-len(c["ranks"]), c["ranks"][0]))
    seen_sig: dict[str, int] = {}
    for c in classes:  # keep signatures distinct
        n = seen_sig[c["signature"]] = seen_sig.get(c["signature"], 0) + 1
        if n > 1:
            c["signature"] += f" (variant {n})"

    blocked = sorted(r for r in world if edges.get(r))
    if roots:
        parts = []
        for r in sorted(roots):
            by_reason: dict[str, list[str]] = {}
            for (w, t), (reason, where) in sorted(why.items()):
                if t == r and where not in by_reason.setdefault(reason, []):
                    by_reason[reason].append(where)
            parts.append(f"rank {r} " + ", ".join(
                f"{reason} {', '.join(ws[:2])}" + (f" (+{len(ws) - 2} more)" if len(ws) > 2 else "")
                for reason, ws in sorted(by_reason.items(), key=lambda kv: "posted" in kv[0])))
        summary = (f"rank(s) {_fmt(roots)} hold up the job; " + "; ".join(parts)
                   + f"; {len(set(blocked) - roots)} other rank(s) wait on them directly or in turn")
        idle = sorted(r for r in roots if r in views and not any(
            (g["E"] or 0) > (g["C"] or 0) for g in views[r].values()))
        if idle:
            summary += f"; rank(s) {_fmt(idle)} have no collective pending (stuck outside NCCL)"
    elif groups_out:
        summary = ("no rank lags behind: " + ", ".join(
            f"{g['desc']} waits in #{g['seq']} {g['op']}" for g in groups_out[:3])
                   + " with every member there (suspect the network or NCCL)")
    else:
        summary = "no collective is pending on any rank"
    if missing:
        summary += f"; no readable dump from rank(s) {_fmt(missing)}"

    result = {"ranks": len(world), "classes": classes, "suspects": suspects, "missing": missing,
              "summary": summary, "groups": groups_out,
              "waits_for": {str(w): sorted(t) for w, t in sorted(edges.items()) if t}}
    if errors:
        result["errors"] = list(errors)
    return result


def _fmt(ranks: Iterable[int]) -> str:
    return ",".join(str(r) for r in sorted(ranks))


def analyze_dir(path: str | os.PathLike, expected_ranks: Iterable[int] | None = None) -> dict:
    """Analyze one dump per rank in a directory (rank = last integer in the name).

    Files without an integer in the name, and logs/text files, are ignored.
    A dump that cannot be loaded (refused pickle, corrupt, not a dict) is listed
    under ``errors`` and its rank counts as missing.
    """
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"Flight Recorder dump directory not found: {d} "
                                "(give the folder holding _dump_<rank> files)")
    per_rank: dict[int, dict] = {}
    errors: list[dict] = []
    for f in sorted(d.iterdir(), key=lambda p: p.name):
        nums = re.findall(r"\d+", f.name)
        if not f.is_file() or not nums or f.name.lower().endswith(_SKIP_SUFFIXES):
            continue
        rank = int(nums[-1])
        try:
            per_rank[rank] = load_dump(f)
        except Exception as e:  # noqa: BLE001 -- any failure to load is recorded, never fatal
            errors.append({"file": f.name, "rank": rank, "error": f"{type(e).__name__}: {e}"})
    failed = {e["rank"] for e in errors} - set(per_rank)
    if expected_ranks is None:
        expected_ranks = range(max(set(per_rank) | failed, default=-1) + 1)
    return analyze_dumps(per_rank, expected_ranks=set(expected_ranks) | failed, errors=errors)
