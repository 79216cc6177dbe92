"""A compiled fast path for ``events.decode``: one straight-line function per event type.

``events.from_dict`` validates through the checker objects of ``fields.py``, one method call
per field, and spends most of its time in those calls. From the very same declarations this
module writes one Python function per event type that checks and converts every field inline,
in place on the freshly parsed dict, and returns ``None`` at the first value it does not
accept. ``decode`` then parses the raw bytes again and runs the checkers, which give the
reason. So the fast path never decides *why* an event is invalid, and it accepts only what
the checkers accept (``tests/test_events_fastpath.py`` holds it to that over mutated events
of every type).

>>> from trainguard import events as ev
>>> fast = compile_type(ev.Step, ev.ENVELOPE, ev.ENVELOPE_NULLABLE)
>>> e = fast({"v": 1, "type": "step", "job": "j", "ts": 5, "step": 2, "step_time": 1,
...           "loss": "NaN", "mine": 1})
>>> e.ts, e.node, e.step_time, e.loss, e.extra
(5.0, None, 1.0, nan, {'mine': 1})
>>> fast({"v": 1, "type": "step", "job": "j", "ts": 5, "step": -2, "step_time": 1}) is None
True
"""
from __future__ import annotations

import dataclasses
import math

from .fields import AnyObject, Bool, Int, ListOf, Nullable, NONFINITE_STRINGS, Num, Object, Str

__all__ = ["compile_type", "compile_all"]

_CACHE_LIMIT = 4096  # distinct pattern-checked strings (job ids, host names) remembered per field


class _Writer:
    """Collects the lines of one generated module and the constants they refer to."""

    def __init__(self):
        self.lines: list[str] = []
        self.functions: list[list[str]] = []  # nested objects' functions, defined first
        self.namespace: dict = {"INF": math.inf, "NONFINITE": NONFINITE_STRINGS,
                                "MISSING": object(), "CACHE_LIMIT": _CACHE_LIMIT}
        self._count = 0

    def const(self, value, stem: str) -> str:
        self._count += 1
        name = f"{stem}_{self._count}"
        self.namespace[name] = value
        return name

    def emit(self, indent: int, text: str) -> None:
        self.lines.append("    " * indent + text)


def _check(w: _Writer, checker, var: str, store: str, indent: int) -> None:
    """Emit lines that return None unless ``var`` passes ``checker``; a converted value
    (int -> float, "NaN" -> nan) is written to ``store``."""
    fail = "return None"
    nullable = isinstance(checker, Nullable)
    if nullable:
        checker = checker.inner
    if isinstance(checker, Num) and checker.finite:
        # A float in range is by far the most common value: one test accepts it.
        low = "-INF <" if checker.minimum is None else f"{float(checker.minimum)!r} <="
        guard = f"type({var}) is not float or not ({low} {var} < INF)"
        w.emit(indent, f"if ({guard}){f' and {var} is not None' if nullable else ''}:")
        cond = [f"type({var}) is not int"]
        if checker.minimum is not None:
            cond.append(f"{var} < {checker.minimum!r}")
        w.emit(indent + 1, f"if {' or '.join(cond)}: {fail}")
        w.emit(indent + 1, f"{store} = float({var})")
    elif isinstance(checker, Num) and checker.minimum is None:
        w.emit(indent, f"if type({var}) is not float"
                       f"{f' and {var} is not None' if nullable else ''}:")
        w.emit(indent + 1, f"if type({var}) is int: {store} = float({var})")
        w.emit(indent + 1, f"elif type({var}) is str and {var} in NONFINITE: "
                           f"{store} = NONFINITE[{var}]")
        w.emit(indent + 1, f"else: {fail}")
    elif nullable:
        w.emit(indent, f"if {var} is not None:")
        _check(w, checker, var, store, indent + 1)
    elif isinstance(checker, Int):
        cond = [f"type({var}) is not int"]
        if checker.minimum is not None:
            cond.append(f"{var} < {checker.minimum!r}")
        if checker.maximum is not None:
            cond.append(f"{var} > {checker.maximum!r}")
        w.emit(indent, f"if {' or '.join(cond)}: {fail}")
    elif isinstance(checker, Str):
        _check_str(w, checker, var, indent)
    elif isinstance(checker, Bool):
        w.emit(indent, f"if type({var}) is not bool: {fail}")
    elif isinstance(checker, AnyObject):
        w.emit(indent, f"if type({var}) is not dict: {fail}")
    elif isinstance(checker, ListOf) and isinstance(checker.item, (Int, Str, Bool, Object)):
        w.emit(indent, f"if type({var}) is not list: {fail}")
        if checker.max_items is not None:
            w.emit(indent, f"if len({var}) > {checker.max_items}: {fail}")
        item = f"{var}_"
        w.emit(indent, f"for {item} in {var}:")
        _check(w, checker.item, item, "_unused", indent + 1)
    elif isinstance(checker, Object):  # checked and converted in place
        w.emit(indent, f"if {_compile_object(w, checker)}({var}) is None: {fail}")
    else:  # anything else goes through its own checker; InvalidEvent is caught by the caller
        w.emit(indent, f"{store} = {w.const(checker.check, 'CHECK')}({var}, '')")


def _check_str(w: _Writer, checker: Str, var: str, indent: int) -> None:
    fail = "return None"
    cond = [f"type({var}) is not str"]
    if checker.min_length:
        cond.append(f"len({var}) < {checker.min_length}")
    if checker.max_length is not None:
        cond.append(f"len({var}) > {checker.max_length}")
    if checker.enum is not None:
        cond.append(f"{var} not in {w.const(frozenset(checker.enum), 'ENUM')}")
    if checker._regex is None:
        w.emit(indent, f"if {' or '.join(cond)}: {fail}")
        return
    # Job ids and host names repeat; remember the ones that passed the regex.
    seen = w.const(set(), "SEEN")
    cond.append(f"{w.const(checker._regex.fullmatch, 'MATCH')}({var}) is None")
    w.emit(indent, f"if {var} not in {seen}:")
    w.emit(indent + 1, f"if {' or '.join(cond)}: {fail}")
    w.emit(indent + 1, f"if len({seen}) < CACHE_LIMIT: {seen}.add({var})")


def _fields(w: _Writer, required: dict, optional: dict, target: str, indent: int,
            defaults: dict | None = None) -> None:
    """Check every declared field; with ``defaults``, fill in the optional ones that are
    missing, so that afterwards the dict holds every declared field."""
    for name, checker in required.items():
        w.emit(indent, f"x = {target}.get({name!r}, MISSING)")
        if isinstance(checker, Nullable):
            w.emit(indent, "if x is MISSING: return None")
        _check(w, checker, "x", f"{target}[{name!r}]", indent)
    for name, checker in optional.items():
        w.emit(indent, f"x = {target}.get({name!r}, MISSING)")
        if defaults is None:
            w.emit(indent, "if x is not MISSING:")
        else:
            w.emit(indent, f"if x is MISSING: {target}[{name!r}] = {defaults[name]}")
            w.emit(indent, "else:")
        _check(w, checker, "x", f"{target}[{name!r}]", indent + 1)


def _compile_object(w: _Writer, checker: Object) -> str:
    """A nested object becomes its own function, checked and converted in place."""
    name = w.const(None, "object")
    outer, w.lines = w.lines, []
    w.emit(0, f"def {name}(d):")
    w.emit(1, "if type(d) is not dict: return None")
    _fields(w, checker.required, checker.optional, "d", 1)
    w.emit(1, "return d")
    w.functions.append(w.lines)
    w.lines = outer
    return name


def compile_type(cls, envelope: dict, envelope_nullable: dict):
    """The fast ``dict -> event or None`` of one event class (a dataclass with ``TYPE``,
    ``REQUIRED`` and ``OPTIONAL``), whose envelope fields are ``envelope`` (required) and
    ``envelope_nullable``; a class with ``START_REQUIRED`` needs those fields not null
    when ``event`` is ``"start"``.

    The dict is consumed: checked, converted and completed in place, it becomes the event's
    ``__dict__``. Unknown keys move to ``extra``, as ``from_dict`` does.
    """
    w = _Writer()
    known = frozenset(("v", "type", *envelope, *envelope_nullable, *cls.REQUIRED,
                       *cls.OPTIONAL))
    w.namespace.update(NEW=cls.__new__, CLS=cls, KNOWN=known)
    fields = dataclasses.fields(cls)
    defaults = {f.name: w.const(f.default, "DEFAULT") for f in fields
                if f.default is not dataclasses.MISSING}
    defaults.update({f.name: f"{w.const(f.default_factory, 'FACTORY')}()" for f in fields
                     if f.default_factory is not dataclasses.MISSING})
    w.emit(0, "def fast(obj):")
    _fields(w, {**envelope, **cls.REQUIRED}, {**envelope_nullable, **cls.OPTIONAL},
            "obj", 1, defaults)
    start_required = getattr(cls, "START_REQUIRED", ())
    if start_required:
        missing = " or ".join(f"obj[{name!r}] is None" for name in start_required)
        w.emit(1, f"if obj['event'] == 'start' and ({missing}): return None")
    # Every known key is now present, so any further key is an unknown one.
    w.emit(1, f"if len(obj) == {len(known)}:")
    w.emit(2, "del obj['v'], obj['type']")
    w.emit(2, "obj['extra'] = {}")
    w.emit(1, "else:")
    w.emit(2, "del obj['v'], obj['type']")
    w.emit(2, "obj['extra'] = {k: obj.pop(k) for k in [k for k in obj if k not in KNOWN]}")
    w.emit(1, "event = NEW(CLS)")
    w.emit(1, "event.__dict__ = obj")
    w.emit(1, "return event")
    source = "\n".join(line for function in (*w.functions, w.lines) for line in function)
    exec(compile(source, f"<trainguard fast decode: {cls.TYPE}>", "exec"), w.namespace)
    return w.namespace["fast"]


def compile_all(event_types: dict, envelope: dict, envelope_nullable: dict) -> dict:
    return {name: compile_type(cls, envelope, envelope_nullable)
            for name, cls in event_types.items()}
