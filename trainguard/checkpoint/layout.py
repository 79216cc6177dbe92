"""The bytes of one snapshot: a tree of tensors and plain data, without pickle.

A snapshot file is ``MAGIC``, the length of the meta (8 bytes, little-endian), the meta (JSON:
the tree with each tensor replaced by ``{"T": i}``, and each tensor's dtype, shape, offset and
size), then the tensors' bytes, each at a 64-byte boundary. Loading runs no code: JSON and raw
tensor bytes only; a type that is neither is refused when the snapshot is taken.

Its *manifest* (a small JSON file beside it, written after the data) names the job, rank and
step and holds a checksum (CRC-32) of the file's first ``nbytes`` bytes: a snapshot without a
manifest, or whose bytes do not match it, is torn and never restored.

>>> tree = {"step": 7, "opt": {"state": {0: {"lr": 0.1}}, "groups": [(1, 2.5), None]},
...         "bad": float("nan")}
>>> skeleton, tensors = flatten(tree)
>>> back = unflatten(skeleton, tensors)
>>> back.pop("bad"), back == {"step": 7, "opt": tree["opt"]}
(nan, True)
>>> flatten({"f": open})
Traceback (most recent call last):
...
TypeError: cannot snapshot f (a builtin_function_or_method): tensors and plain data only
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, Optional

from trainguard.files import write_atomic

__all__ = ["MAGIC", "FORMAT", "ALIGN", "flatten", "unflatten", "plan", "Plan", "write_header",
           "zero_gaps",
           "read_snapshot", "manifest_path", "write_manifest", "read_manifest", "digest",
           "sha256", "local_tensors", "data_start",
           "TornSnapshot"]

MAGIC = b"TGSNAP01"
FORMAT = 1
ALIGN = 64
_SCALARS = (str, int, bool, type(None))


class TornSnapshot(ValueError):
    """A snapshot that is incomplete, or whose bytes do not match its manifest."""


def _encode_scalar(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else {"F": repr(value)}
    return value


def flatten(tree: Any) -> tuple:
    """``(skeleton, tensors)``: the JSON-able tree and its tensors in order (not copied)."""
    tensors: list = []
    append = tensors.append

    def walk(node):
        kind = type(node)
        if kind is float:
            return node if math.isfinite(node) else {"F": repr(node)}
        if kind in _PLAIN:
            return node
        if kind is dict or kind is OrderedDict or isinstance(node, dict):
            return {"D": [[k if type(k) in _PLAIN else _key(k), walk(v)]
                          for k, v in node.items()]}
        if kind is list:
            return {"L": [walk(v) for v in node]}
        if kind is tuple:
            return {"U": [walk(v) for v in node]}
        if _is_tensor(node):
            append(node)
            return {"T": len(tensors) - 1}
        return _other(node)

    try:
        return walk(tree), tensors
    except TypeError:
        _where(tree, "")                 # the same walk, slowly, to name the culprit
        raise


_PLAIN = (str, int, bool, type(None))


def _key(k):
    if isinstance(k, float):
        return k if math.isfinite(k) else repr(k)
    if isinstance(k, _SCALARS):
        return k
    return str(k)


def _other(node):
    name = type(node).__name__
    if name == "ndarray":                           # numpy's RNG state: small, kept exact
        return {"N": [str(node.dtype), node.tolist()]}
    if name == "dtype" and type(node).__module__ == "torch":
        return {"Y": str(node)}
    raise TypeError(f"a {name}")


def _where(node, where: str) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            _where(v, f"{where}.{k}")
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _where(v, f"{where}[{i}]")
    elif not (isinstance(node, (float, *_SCALARS)) or _is_tensor(node)):
        try:
            _other(node)
        except TypeError:
            raise TypeError(f"cannot snapshot {where.lstrip('.') or 'the state'} (a "
                            f"{type(node).__name__}): tensors and plain data only") from None


def _is_tensor(node) -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(node, torch.Tensor)


def unflatten(skeleton: Any, tensors: list) -> Any:
    """The tree of ``skeleton`` with ``{"T": i}`` replaced by ``tensors[i]``."""
    if not isinstance(skeleton, dict):
        return skeleton
    if "T" in skeleton:
        return tensors[skeleton["T"]]
    if "D" in skeleton:
        return {k: unflatten(v, tensors) for k, v in skeleton["D"]}
    if "L" in skeleton:
        return [unflatten(v, tensors) for v in skeleton["L"]]
    if "U" in skeleton:
        return tuple(unflatten(v, tensors) for v in skeleton["U"])
    if "F" in skeleton:
        return float(skeleton["F"])
    if "N" in skeleton:
        import numpy

        return numpy.array(skeleton["N"][1], dtype=skeleton["N"][0])
    if "Y" in skeleton:
        import torch

        return getattr(torch, skeleton["Y"].split(".")[-1])
    raise TornSnapshot(f"unknown node in a snapshot's meta: {sorted(skeleton)[:3]}")


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Plan:
    """Where each tensor goes in the file; ``nbytes`` is the file's used length; ``groups``
    are ``(dtype, offset, nbytes, [tensor index, ...])``: the tensors of one dtype lie back
    to back, so each group is copied with one ``torch.cat`` (no Python per tensor)."""

    def __init__(self, meta: bytes, entries: list, nbytes: int, groups: list):
        self.meta, self.entries, self.nbytes, self.groups = meta, entries, nbytes, groups


def local_tensors(tensors: list) -> tuple:
    """``(locals, dtensor infos)``: the tensors whose bytes are stored (a DTensor's local
    shard, with the shape, stride and placements that rebuild it)."""
    locals_, infos = [], []
    for t in tensors:
        t = t.detach()
        if type(t).__name__ == "DTensor":
            placements = []
            for pl in t.placements:
                name = type(pl).__name__
                placements.append(["S", pl.dim] if name == "Shard" else [name[0]])
            infos.append({"shape": list(t.shape), "stride": list(t.stride()),
                          "placements": placements})
            t = t.to_local()
        else:
            infos.append(None)
        locals_.append(t)
    return locals_, infos


_ENTRIES_CACHE: dict = {}


def plan(skeleton: Any, locals_: list, infos: list, extra: Optional[dict] = None) -> Plan:
    """The layout of a snapshot of ``locals_`` (from :func:`local_tensors`). Tensor offsets in
    the meta count from the end of the header (:func:`data_start`), so the same shapes give
    the same entries every step (cached)."""
    signature = tuple((t.dtype, tuple(t.shape)) for t in locals_)
    cached = _ENTRIES_CACHE.get(signature) if not any(infos) else None
    if cached is None:
        cached = _entries(locals_, infos)
        if not any(infos):
            _ENTRIES_CACHE.clear()
            _ENTRIES_CACHE[signature] = cached
    entries, groups, body, entries_json = cached
    head_obj = json.dumps(skeleton, separators=(",", ":"))
    meta = ('{"tree":' + head_obj + ',"tensors":' + entries_json
            + (("," + json.dumps(extra, separators=(",", ":"))[1:-1]) if extra else "")
            + "}").encode()
    head = data_start(len(meta))
    return Plan(meta, [{**e, "offset": e["offset"] + head} for e in entries], head + body,
                [[d, o + head, n, m] for d, o, n, m in groups])


def _entries(locals_: list, infos: list) -> tuple:
    by_dtype: dict = {}
    for i, t in enumerate(locals_):
        by_dtype.setdefault(str(t.dtype).split(".")[-1], []).append(i)
    entries: list = [None] * len(locals_)
    groups, offset = [], 0
    for dtype, members in by_dtype.items():
        start = offset
        for i in members:
            t = locals_[i]
            n = t.numel() * t.element_size()
            entries[i] = {"dtype": dtype, "shape": list(t.shape), "offset": offset, "nbytes": n}
            if infos[i] is not None:
                entries[i]["dtensor"] = infos[i]
            offset += n
        groups.append((dtype, start, offset - start, members))
        offset = _align(offset)
    return entries, groups, offset, json.dumps(entries, separators=(",", ":"))


def data_start(meta_len: int) -> int:
    """Where the tensors begin in a file whose meta is ``meta_len`` bytes long."""
    return _align(len(MAGIC) + 8 + meta_len)


def write_header(buf, p: Plan) -> None:
    buf[:len(MAGIC)] = MAGIC
    buf[len(MAGIC):len(MAGIC) + 8] = struct.pack("<Q", len(p.meta))
    buf[len(MAGIC) + 8:len(MAGIC) + 8 + len(p.meta)] = p.meta


def zero_gaps(buf, p: Plan) -> None:
    """Zero the padding after the meta and between tensors (a reused buffer's old bytes would
    otherwise make the same snapshot hash differently)."""
    at = len(MAGIC) + 8 + len(p.meta)
    for e in p.entries:
        if e["offset"] > at:
            buf[at:e["offset"]] = bytes(e["offset"] - at)
        at = max(at, e["offset"] + e["nbytes"])
    if p.nbytes > at:
        buf[at:p.nbytes] = bytes(p.nbytes - at)


def digest(buf, nbytes: int) -> str:
    """The manifest's checksum of the first ``nbytes``: CRC-32 (3 GB/s here, off the training
    thread; it finds torn and corrupted bytes; what travels between machines is bound to its
    signature by SHA-256 instead, :func:`sha256`)."""
    return f"crc32:{zlib.crc32(memoryview(buf)[:nbytes]):08x}"


def sha256(buf, nbytes: int) -> str:
    return hashlib.sha256(memoryview(buf)[:nbytes]).hexdigest()


def read_snapshot(buf, nbytes: Optional[int] = None, checksum: Optional[str] = None) -> Any:
    """The tree stored in ``buf`` (bytes, bytearray or mmap), its tensors views of ``buf``
    (copy them before ``buf`` goes). With ``checksum``, bytes that do not match are refused."""
    import torch

    view = memoryview(buf)
    if checksum is not None and digest(view, nbytes or len(view)) != checksum:
        raise TornSnapshot("its bytes do not match the manifest's checksum")
    if bytes(view[:len(MAGIC)]) != MAGIC:
        raise TornSnapshot("no snapshot header")
    (length,) = struct.unpack("<Q", view[len(MAGIC):len(MAGIC) + 8])
    try:
        meta = json.loads(bytes(view[len(MAGIC) + 8:len(MAGIC) + 8 + length]))
    except ValueError as exc:
        raise TornSnapshot(f"unreadable meta: {exc}") from None
    head = data_start(length)
    tensors = []
    for e in meta["tensors"]:
        dtype = getattr(torch, e["dtype"])
        count = math.prod(e["shape"])
        if count == 0:
            t = torch.empty(e["shape"], dtype=dtype)
        else:
            t = torch.frombuffer(view, dtype=torch.uint8, count=e["nbytes"],
                                 offset=head + e["offset"]).view(dtype).reshape(e["shape"])
        tensors.append(_Stored(t, e.get("dtensor")) if e.get("dtensor") else t)
    return unflatten(meta["tree"], tensors)


class _Stored:
    """A DTensor's local shard read back, with the shape, stride and placements to rebuild it
    on the restoring rank's mesh (:func:`trainguard.checkpoint.state.rebuild`)."""

    def __init__(self, local, info: dict):
        self.local, self.info = local, info


def manifest_path(data_path: "str | os.PathLike") -> Path:
    return Path(data_path).with_suffix(".json")


def write_manifest(data_path: "str | os.PathLike", manifest: dict) -> None:
    """Write the manifest atomically (a temporary file, then a rename): present means done."""
    write_atomic(manifest_path(data_path), json.dumps({"format": FORMAT, **manifest},
                                                      sort_keys=True))


def read_manifest(data_path: "str | os.PathLike") -> Optional[dict]:
    """The manifest of a snapshot file, or None when it has none (not done, or torn)."""
    try:
        obj = json.loads(manifest_path(data_path).read_text())
    except (OSError, ValueError):
        return None
    ok = (isinstance(obj, dict) and obj.get("format") == FORMAT
          and isinstance(obj.get("step"), int) and isinstance(obj.get("nbytes"), int)
          and isinstance(obj.get("checksum"), str))
    return obj if ok else None
