"""Configuration files of earlier versions, read as today's tree with one deprecation line.

Earlier versions wrote detector settings flat (``[detectors] hang_floor_s = 30``, the fields
of the old ``DetectorConfig``), called two different things ``advance_interval_s``, and kept
the action policy in a JSON file (``--policy FILE``). :func:`upgrade` moves the keys of a
file to their place in the tree and says, in one line, what to write instead; the tree's
detector keys (``detectors.hang.floor_s``, ...) are given to it, by
:func:`trainguard.configsections.load`.

>>> from trainguard.configsections import keys_of
>>> detector_keys = lambda: [k.path for k in keys_of(("detectors",))]
>>> data, line = upgrade({"detectors": {"hang_floor_s": 30, "advance_interval_s": 1.0,
...                                     "correlate_window_s": 60.0}}, "old.toml",
...                      detector_keys)
>>> data
{'detectors': {'hang': {'floor_s': 30}, 'stages': {'advance_grid_s': 1.0}, 'correlate': {'window_s': 60.0}}}
>>> print(line)
trainguard: warning: old.toml uses deprecated keys: detectors.hang_floor_s -> detectors.hang.floor_s, detectors.advance_interval_s -> detectors.stages.advance_grid_s, detectors.correlate_window_s -> detectors.correlate.window_s
>>> upgrade({"worker": {"web_port": 7000}}, "new.toml", detector_keys)
({'worker': {'web_port': 7000}}, None)
"""
from __future__ import annotations

__all__ = ["upgrade", "RENAMED"]

#: old dotted key -> new dotted key (one name, one meaning)
RENAMED = {"worker.advance_interval_s": "worker.advance_timer_s",
           "detectors.stages.advance_interval_s": "detectors.stages.advance_grid_s",
           "detectors.stages.step_close_lag": "detectors.stages.step_window",
           "detectors.stages.step_close_s": "detectors.stages.step_window_s"}


def _flat_detector_keys(detector_keys) -> dict:
    """``hang_floor_s`` -> ``hang.floor_s``: the old flat ``DetectorConfig`` field names of
    the keys ``detectors.hang.floor_s``, ..."""
    out = {}
    for key in detector_keys:
        _, section, name = key.split(".")
        path = f"{section}.{name}"
        out[name if section == "stages" else f"{section}_{name}"] = path
    out["advance_interval_s"] = "stages.advance_grid_s"
    out["step_close_lag"] = "stages.step_window"
    out["step_close_s"] = "stages.step_window_s"
    return out


def _set(data: dict, path: str, value) -> None:
    *parents, name = path.split(".")
    table = data
    for parent in parents:
        table = table.setdefault(parent, {})
    table[name] = value


def upgrade(data: dict, where: str, detector_keys) -> tuple[dict, str | None]:
    """``(data with old keys moved, the deprecation line or None)``; ``detector_keys()``:
    the tree's keys under ``detectors`` (called only for a file with flat ones)."""
    moved = []
    detectors = data.get("detectors")
    if isinstance(detectors, dict):
        flat = None
        for name in list(detectors):
            if isinstance(detectors[name], dict):
                continue
            flat = flat or _flat_detector_keys(detector_keys())
            if name in flat:
                _set(detectors, flat[name], detectors.pop(name))
                moved.append((f"detectors.{name}", f"detectors.{flat[name]}"))
    for old, new in RENAMED.items():
        *parents, name = old.split(".")
        table = data
        for parent in parents:
            table = table.get(parent) if isinstance(table, dict) else None
        if isinstance(table, dict) and name in table:
            value = table.pop(name)
            _set(data, new, value)
            moved.append((old, new))
    if not moved:
        return data, None
    text = ", ".join(f"{old} -> {new}" for old, new in moved)
    return data, f"trainguard: warning: {where} uses deprecated keys: {text}"
