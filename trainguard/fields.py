"""Field checkers for the SPEC §1 envelope and payloads.

A checker is a small object with ``check(value, path) -> value`` (raising
:class:`InvalidEvent` with a readable reason) and ``schema() -> dict`` (its JSON
Schema). ``events.py`` declares every event type with these, so validation and the
shipped JSON Schemas come from one declaration.
"""
from __future__ import annotations

import math
import re

NONFINITE_STRINGS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


class InvalidEvent(ValueError):
    """The one exception ``decode`` raises; its message says what is wrong."""


def _describe(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class Int:
    def __init__(self, minimum=None, maximum=None):
        self.minimum = minimum
        self.maximum = maximum

    def check(self, value, path):
        if type(value) is not int:
            raise InvalidEvent(f"{path}: expected an integer, got {_describe(value)}")
        if self.minimum is not None and value < self.minimum:
            raise InvalidEvent(f"{path}: {value} is below the minimum {self.minimum}")
        if self.maximum is not None and value > self.maximum:
            raise InvalidEvent(f"{path}: {value} is above the maximum {self.maximum}")
        return value

    def schema(self):
        out = {"type": "integer"}
        if self.minimum is not None:
            out["minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        return out


class Num:
    """A JSON number; ``finite=False`` also admits NaN/±Infinity (written as strings)."""

    def __init__(self, minimum=None, finite=True):
        self.minimum = minimum
        self.finite = finite

    def check(self, value, path):
        kind = type(value)
        if kind is float:
            pass
        elif kind is int:
            value = float(value)
        elif kind is str and value in NONFINITE_STRINGS:
            value = NONFINITE_STRINGS[value]
        else:
            raise InvalidEvent(f"{path}: expected a number, got {_describe(value)}")
        if value != value or value in (math.inf, -math.inf):
            if self.finite:
                raise InvalidEvent(f"{path}: must be a finite number, got {value}")
            return value
        if self.minimum is not None and value < self.minimum:
            raise InvalidEvent(f"{path}: {value} is below the minimum {self.minimum}")
        return value

    def schema(self):
        number = {"type": "number"}
        if self.minimum is not None:
            number["minimum"] = self.minimum
        if self.finite:
            return number
        return {"anyOf": [number, {"enum": list(NONFINITE_STRINGS)}]}


class Str:
    def __init__(self, pattern=None, enum=None, min_length=0, max_length=None):
        self.pattern = pattern
        self.enum = tuple(enum) if enum else None
        self.min_length = min_length
        self.max_length = max_length
        self._regex = re.compile(pattern) if pattern else None

    def check(self, value, path):
        if type(value) is not str:
            raise InvalidEvent(f"{path}: expected a string, got {_describe(value)}")
        if self.enum is not None and value not in self.enum:
            raise InvalidEvent(f"{path}: {_describe(value)} is not one of {', '.join(self.enum)}")
        if len(value) < self.min_length:
            raise InvalidEvent(f"{path}: must not be empty")
        if self.max_length is not None and len(value) > self.max_length:
            raise InvalidEvent(f"{path}: longer than {self.max_length} characters")
        if self._regex is not None and not self._regex.fullmatch(value):
            raise InvalidEvent(f"{path}: {_describe(value)} does not match {self.pattern}")
        return value

    def schema(self):
        out = {"type": "string"}
        if self.enum is not None:
            out["enum"] = list(self.enum)
        if self.min_length:
            out["minLength"] = self.min_length
        if self.max_length is not None:
            out["maxLength"] = self.max_length
        if self.pattern:
            out["pattern"] = f"^{self.pattern}$"
        return out


class Bool:
    def check(self, value, path):
        if type(value) is not bool:
            raise InvalidEvent(f"{path}: expected true or false, got {_describe(value)}")
        return value

    def schema(self):
        return {"type": "boolean"}


class Nullable:
    def __init__(self, inner):
        self.inner = inner

    def check(self, value, path):
        return None if value is None else self.inner.check(value, path)

    def schema(self):
        return {"anyOf": [self.inner.schema(), {"type": "null"}]}


class ListOf:
    def __init__(self, item, max_items=None):
        self.item = item
        self.max_items = max_items

    def check(self, value, path):
        if type(value) is not list:
            raise InvalidEvent(f"{path}: expected a list, got {_describe(value)}")
        if self.max_items is not None and len(value) > self.max_items:
            raise InvalidEvent(f"{path}: more than {self.max_items} items")
        check = self.item.check
        return [check(item, f"{path}[{i}]") for i, item in enumerate(value)]

    def schema(self):
        out = {"type": "array", "items": self.item.schema()}
        if self.max_items is not None:
            out["maxItems"] = self.max_items
        return out


class AnyObject:
    """A JSON object whose content the contract leaves open (``evidence``, ``targets``)."""

    def check(self, value, path):
        if type(value) is not dict:
            raise InvalidEvent(f"{path}: expected an object, got {_describe(value)}")
        return value

    def schema(self):
        return {"type": "object"}


class Object:
    """A JSON object with declared fields; undeclared keys are kept as they are."""

    def __init__(self, required: dict, optional: dict | None = None):
        self.required = required
        self.optional = optional or {}

    def check(self, value, path):
        if type(value) is not dict:
            raise InvalidEvent(f"{path}: expected an object, got {_describe(value)}")
        out = dict(value)
        for name, checker in self.required.items():
            if name not in value:
                raise InvalidEvent(f"{path}: missing required field {name!r}")
            out[name] = checker.check(value[name], f"{path}.{name}")
        for name, checker in self.optional.items():
            if name in value:
                out[name] = checker.check(value[name], f"{path}.{name}")
        return out

    def schema(self):
        props = {n: c.schema() for n, c in {**self.required, **self.optional}.items()}
        return {"type": "object", "required": list(self.required), "properties": props}


class OneOf:
    """The first alternative that accepts the value wins (e.g. a rank list or ``"all"``)."""

    def __init__(self, *alternatives):
        self.alternatives = alternatives

    def check(self, value, path):
        reasons = []
        for alternative in self.alternatives:
            try:
                return alternative.check(value, path)
            except InvalidEvent as exc:
                reasons.append(str(exc))
        raise InvalidEvent(" or ".join(reasons))

    def schema(self):
        return {"anyOf": [a.schema() for a in self.alternatives]}
