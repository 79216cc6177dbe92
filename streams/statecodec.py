"""A data-only encoding of the worker's stage state: JSON of plain values, never code.

The worker's snapshots travel through Kafka topics that other clients may be able to write,
so reading one back must never run code, as ``pickle.loads`` would. :func:`encode` walks an
object graph reflectively and writes it as JSON (orjson) in which every value is a plain
JSON value:

- ``None``, booleans, strings, 64-bit integers and finite floats are themselves;
- a dict with string keys is a JSON object (its values encoded);
- everything else is a JSON array whose first element is a tag: ``["l", ...]`` list,
  ``["t", ...]`` tuple, ``["s", ...]`` set, ``["fs", ...]`` frozenset, ``["d", k, v, ...]``
  dict with other keys, ``["q", maxlen, ...]`` deque, ``["f", "nan"]`` a non-finite float,
  ``["i", "123..."]`` a larger integer, ``["b", base64]`` bytes, ``["np", dtype, shape,
  base64]`` a numeric numpy array, ``["o", class, name, value, ...]`` an object of an
  allowed class with its attributes, ``["rq", q, window, values]`` a ``river`` rolling
  quantile, ``["x", name]`` an object of the process given by name (see :func:`encode`),
  ``["@", n]`` the ``n``-th list, dict, set, deque or object already decoded (so
  shared references and cycles survive, e.g. a JobStage's detector lists that name the
  detectors of its ``detectors`` dict).

:func:`decode` rebuilds objects only of the classes of the :class:`Allowlist` its caller
gives (the worker's is :func:`trainguard.streams.snapshots.state_allowlist`: the detectors and
stages, the worker's slots, the event classes and ``river.stats``), with ``cls.__new__`` and
attribute assignment: no constructor, ``__setstate__`` or ``__reduce__`` runs, and any other
class is refused. What a decoded object holds is data an attacker may have chosen, but only
data. The codec itself knows no trainguard class: it imports nothing of trainguard.

>>> from collections import deque
>>> plain = Allowlist()
>>> state = {"window": deque([1.5, float("nan")], maxlen=4), (1, "a"): {3}, "big": 2**70}
>>> back = decode(encode(state, plain), plain)
>>> back["window"], back[(1, "a")], back["big"] == 2**70
(deque([1.5, nan], maxlen=4), {3}, True)
>>> decode(b'["o","os:system"]', plain)
Traceback (most recent call last):
...
trainguard.streams.statecodec.StateError: class 'os:system' is not allowed in a snapshot
"""
from __future__ import annotations

import base64
import inspect
import math
from collections import deque
from itertools import chain

import orjson

__all__ = ["encode", "decode", "StateError", "Allowlist", "class_tag"]

#: the rolling quantile of ``river.stats``; its window lives in native (Rust) state, which
#: is encoded as its values in insertion order and replayed into a fresh one
_ROLLING_MAX_WINDOW = 1_000_000
_INT_MIN, _INT_MAX = -(2 ** 63), 2 ** 64 - 1


class StateError(ValueError):
    """A snapshot that cannot be encoded or decoded."""


def class_tag(cls) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


class Allowlist:
    """The classes a snapshot may contain, by :func:`class_tag`."""

    def __init__(self, classes=()):
        self.classes: dict = {}
        self._layouts: dict = {}    # class -> (tag, slot attribute names), once checked
        for cls in classes:
            self.add(cls)

    @classmethod
    def of_modules(cls, modules, classes=()) -> "Allowlist":
        """The classes defined in each of ``modules`` (not those they import, nor
        exceptions), and ``classes``."""
        found = [obj for module in modules for obj in vars(module).values()
                 if inspect.isclass(obj) and obj.__module__ == module.__name__
                 and not issubclass(obj, BaseException)]
        return cls([*found, *classes])

    def add(self, cls) -> None:
        self.classes[class_tag(cls)] = cls
        self._layouts.clear()

    def __contains__(self, cls) -> bool:
        return self.classes.get(class_tag(cls)) is cls

    def layout(self, cls) -> tuple | None:
        """``(tag, slot names)`` of an allowed class, None for any other."""
        known = self._layouts.get(cls)
        if known is None and cls in self:
            slots = tuple(name for klass in cls.__mro__
                          for name in getattr(klass, "__slots__", ())
                          if name not in ("__dict__", "__weakref__"))
            known = self._layouts[cls] = (class_tag(cls), slots)
        return known

    def get(self, tag: str):
        cls = self.classes.get(tag) if type(tag) is str else None
        if cls is None:
            raise StateError(f"class {str(tag)[:100]!r} is not allowed in a snapshot")
        return cls


# -- encoding ----------------------------------------------------------------------------

def encode(obj, allowlist: Allowlist, shared: dict | None = None) -> bytes:
    """JSON bytes of ``obj``; raises :class:`StateError` for a value it cannot encode (an
    object of a class not in ``allowlist``, a function, native state it does not know).

    ``shared`` names objects that are not part of the state but of the process (the
    worker's detector configuration, which every JobStage holds): they are written as ``["x",
    name]`` and :func:`decode` puts in its own object of that name."""
    enc = _Encoder(allowlist)
    if shared:
        enc.memo.update({id(o): name for name, o in shared.items()})
        enc.keep.extend(shared.values())
    try:
        return orjson.dumps(enc.value(obj))
    except RecursionError:
        raise StateError("state nested too deeply") from None


class _Encoder:
    def __init__(self, allowlist: Allowlist):
        self.allowlist = allowlist
        self.memo: dict = {}        # id(obj) -> index, for lists, dicts, sets, deques, objects
        self.count = 0
        self.keep: list = []        # keeps memoized objects alive while ids are in use

    def _seen(self, obj):
        index = self.memo.get(id(obj))
        if index is not None:
            return ["@", index] if type(index) is int else ["x", index]
        self.memo[id(obj)] = self.count
        self.count += 1
        self.keep.append(obj)
        return None

    def value(self, obj):
        t = type(obj)
        if t is str or t is bool or obj is None:
            return obj
        if t is float:
            if obj - obj == 0:
                return obj
            return ["f", "nan" if obj != obj else ("inf" if obj > 0 else "-inf")]
        if t is int:
            return obj if _INT_MIN <= obj <= _INT_MAX else ["i", str(obj)]
        if t is dict:
            ref = self._seen(obj)
            if ref is not None:
                return ref
            if all(type(k) is str for k in obj):
                return dict(zip(obj, self._extend([], obj.values())))
            return self._extend(["d"], [x for kv in obj.items() for x in kv])
        if t is list:
            ref = self._seen(obj)
            if ref is not None:
                return ref
            return self._extend(["l"], obj)
        if t is tuple:
            return self._extend(["t"], obj)
        if t is set or t is deque:
            ref = self._seen(obj)
            if ref is not None:
                return ref
            if t is set:
                return self._extend(["s"], obj)
            return self._extend(["q", obj.maxlen], obj)
        if t is frozenset:
            return ["fs", *[self.value(v) for v in obj]]
        if t is bytes:
            return ["b", base64.b64encode(obj).decode("ascii")]
        return self._other(obj, t)

    def _extend(self, out: list, items) -> list:
        """``out`` with the encoding of each of ``items`` appended: the plain values that
        are themselves (most of a stage's state) without a call of :meth:`value` each."""
        value = self.value
        append = out.append
        for v in items:
            t = type(v)
            if t is float:
                append(v if v - v == 0 else value(v))
            elif t is str or t is bool or v is None or (
                    t is int and _INT_MIN <= v <= _INT_MAX):
                append(v)
            elif t is tuple:           # e.g. the rows of a detector's window
                append(self._extend(["t"], v))
            else:
                append(value(v))
        return out

    def _other(self, obj, t):
        if t.__module__ == "numpy":
            return self._numpy(obj)
        if t.__name__ == "RollingQuantile" and t.__module__.startswith("river."):
            return self._rolling_quantile(obj)
        ref = self._seen(obj)
        if ref is not None:
            return ref
        layout = self.allowlist.layout(t)
        if layout is None:
            raise StateError(f"cannot encode a {t.__module__}.{t.__qualname__} (not a plain "
                             "value, and its class is not allowed in a snapshot)")
        tag, slots = layout
        out = ["o", tag]
        d = getattr(obj, "__dict__", None)
        if d is not None:        # the attributes in the order of _attributes(), names first
            self._extend(out, chain.from_iterable(d.items()))
        if slots:
            self._extend(out, [x for name in slots if hasattr(obj, name)
                               for x in (name, getattr(obj, name))])
        return out

    def _numpy(self, obj):
        import numpy as np

        if isinstance(obj, np.ndarray) and obj.dtype.kind in "biuf":
            data = np.ascontiguousarray(obj).tobytes()
            return ["np", obj.dtype.str, list(obj.shape), base64.b64encode(data).decode()]
        if isinstance(obj, np.generic) and obj.dtype.kind in "biuf":
            return self.value(obj.item())
        raise StateError(f"cannot encode a numpy {type(obj).__name__} of dtype "
                         f"{getattr(obj, 'dtype', '?')}")

    def _rolling_quantile(self, rq):
        values = _rolling_values(rq._rolling_quantile.__getstate__())
        if len(values) > rq.window_size_value:
            raise StateError("unexpected RollingQuantile state layout")
        return ["rq", float(rq.q), rq.window_size_value, [self.value(v) for v in values]]


def _attributes(obj):
    d = getattr(obj, "__dict__", None)
    if d is not None:
        yield from d.items()
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                yield name, getattr(obj, name)


def _rolling_values(state: bytes) -> list:
    """The window of a ``river`` ``RsRollingQuantile`` in insertion order, from its bincode
    state (river 0.26: the sorted window, then the window in order, then the settings)."""
    import struct

    try:
        (n,) = struct.unpack_from("<Q", state, 0)
        pos = 8 + 8 * n
        (m,) = struct.unpack_from("<Q", state, pos)
        if m != n:
            raise StateError("unexpected RollingQuantile state layout")
        return list(struct.unpack_from(f"<{m}d", state, pos + 8))
    except struct.error:
        raise StateError("unexpected RollingQuantile state layout") from None


# -- decoding ----------------------------------------------------------------------------

def decode(data, allowlist: Allowlist, shared: dict | None = None):
    """The object of :func:`encode`, with objects of the classes of ``allowlist`` only;
    raises :class:`StateError` for anything else."""
    try:
        tree = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise StateError(f"not JSON: {str(exc)[:100]}") from None
    dec = _Decoder(allowlist, shared or {})
    try:
        return dec.value(tree)
    except StateError:
        raise
    except RecursionError:
        raise StateError("state nested too deeply") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as exc:
        raise StateError(f"malformed state: {type(exc).__name__}: {str(exc)[:100]}") from None


_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class _Decoder:
    def __init__(self, allowlist: Allowlist, shared: dict):
        self.allowlist = allowlist
        self.shared = shared
        self.memo: list = []

    def value(self, node):
        t = type(node)
        if t is list:
            return self._tagged(node)
        if t is dict:
            out: dict = {}
            self.memo.append(out)
            value = self.value
            for k, v in node.items():
                out[k] = value(v)
            return out
        return node          # str, int, float, bool, None

    def _tagged(self, node):
        tag = node[0]
        value = self.value
        if tag == "l":
            out: list = []
            self.memo.append(out)
            out.extend(value(v) for v in node[1:])
            return out
        if tag == "t":
            return tuple(value(v) for v in node[1:])
        if tag == "s":
            s: set = set()
            self.memo.append(s)
            s.update(value(v) for v in node[1:])
            return s
        if tag == "d":
            d: dict = {}
            self.memo.append(d)
            items = node[1:]
            if len(items) % 2:
                raise StateError("a dict with a key and no value")
            for i in range(0, len(items), 2):
                d[value(items[i])] = value(items[i + 1])
            return d
        if tag == "q":
            maxlen = node[1]
            if maxlen is not None and (type(maxlen) is not int or maxlen < 0):
                raise StateError("bad deque maxlen")
            q: deque = deque(maxlen=maxlen)
            self.memo.append(q)
            q.extend(value(v) for v in node[2:])
            return q
        if tag == "@":
            index = node[1]
            if type(index) is not int or not 0 <= index < len(self.memo):
                raise StateError("a reference to nothing")
            return self.memo[index]
        if tag == "o":
            return self._object(node)
        if tag == "x":
            if node[1] not in self.shared:
                raise StateError(f"no shared object {str(node[1])[:50]!r} here")
            return self.shared[node[1]]
        if tag == "f":
            return _FLOATS[node[1]]
        if tag == "i":
            if type(node[1]) is not str or len(node[1]) > 200:
                raise StateError("bad integer")
            return int(node[1])
        if tag == "fs":
            return frozenset(value(v) for v in node[1:])
        if tag == "b":
            return base64.b64decode(node[1], validate=True)
        if tag == "np":
            return _numpy_array(node)
        if tag == "rq":
            return _rolling_quantile(node)
        raise StateError(f"unknown tag {str(tag)[:20]!r}")

    def _object(self, node):
        cls = self.allowlist.get(node[1])
        obj = cls.__new__(cls)
        self.memo.append(obj)
        items = node[2:]
        if len(items) % 2:
            raise StateError("an attribute without a value")
        has_dict = hasattr(obj, "__dict__")
        for i in range(0, len(items), 2):
            name = items[i]
            if type(name) is not str or not name.isidentifier() or name.startswith("__"):
                raise StateError("bad attribute name")
            attr = self.value(items[i + 1])
            if has_dict:
                obj.__dict__[name] = attr
            else:
                object.__setattr__(obj, name, attr)
        return obj


def _numpy_array(node):
    import numpy as np

    _, dtype, shape, data = node
    dt = np.dtype(dtype)
    if dt.kind not in "biuf" or type(shape) is not list or not all(
            type(n) is int and n >= 0 for n in shape):
        raise StateError("bad numpy array")
    raw = base64.b64decode(data, validate=True)
    if len(raw) != dt.itemsize * math.prod(shape):
        raise StateError("numpy array of the wrong size")
    return np.frombuffer(raw, dtype=dt).reshape(shape).copy()


def _rolling_quantile(node):
    from river import stats

    _, q, window, values = node
    if type(q) is int:
        q = float(q)
    if type(values) is not list:
        raise StateError("bad RollingQuantile values")
    values = [_FLOATS[v[1]] if type(v) is list else v for v in values]
    if type(q) is not float or not 0.0 <= q <= 1.0:
        raise StateError("bad RollingQuantile q")
    if type(window) is not int or not 1 <= window <= _ROLLING_MAX_WINDOW:
        raise StateError("bad RollingQuantile window")
    if len(values) > window or not all(
            type(v) is float for v in values):
        raise StateError("bad RollingQuantile values")
    rq = stats.RollingQuantile(q=q, window_size=window)
    for v in values:
        rq.update(v)
    return rq
