"""The recovery-driver interface and the record of what a driver did (or would do).

Every driver answers two requests and returns the calls it made, in order, or in dry-run
mode the calls it would make:

- ``restart(job_ref, exclude_nodes=())``: bring the job back, keeping it off those machines;
- ``evict(nodes, reason=None)``: take those machines out of service for the job (``reason``,
  one line, says why where the cluster keeps a reason: naming the incident).

A failing call ends the sequence: the list then ends with that call, ``status="failed"``,
and nothing after it was run. A request the driver cannot carry out at all is one call of
``status="not_applicable"`` whose ``error`` says why; nothing was run. Drivers never raise for an API or command failure; they raise
:class:`InvalidTarget` (a ``UserError``) for a job or node name they refuse to pass on.

>>> c = DriverCall(driver="slurm", op="requeue", argv=["scontrol", "requeue", "42"],
...                status="dry_run")
>>> c.describe(), calls_ok([c])
('scontrol requeue 42', True)
>>> DriverCall(driver="kubernetes", op="cordon", api="CoreV1Api.patch_node",
...            args={"name": "n1", "body": {"spec": {"unschedulable": True}}}).describe()
"CoreV1Api.patch_node(name='n1', body={'spec': {'unschedulable': True}})"
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Iterable, Protocol, runtime_checkable

from trainguard.errors import UserError

__all__ = ["DriverCall", "RecoveryDriver", "InvalidTarget", "calls_ok", "check_names",
           "CALL_STATUSES"]

CALL_STATUSES = ("planned", "done", "failed", "dry_run", "not_applicable")
OUTPUT_MAX = 2000


class InvalidTarget(UserError):
    """A job reference or node name that a driver will not pass to the cluster."""


@dataclass(kw_only=True)
class DriverCall:
    """One command (``argv``) or one API call (``api`` with ``args``) of a driver."""

    driver: str
    op: str
    argv: list | None = None
    api: str | None = None
    args: dict = field(default_factory=dict)
    status: str = "planned"
    output: str = ""
    error: str | None = None

    def __post_init__(self):
        if self.status not in CALL_STATUSES:
            raise ValueError(f"status must be one of {CALL_STATUSES}, got {self.status!r}")
        if (self.argv is None) == (self.api is None):
            raise ValueError("a DriverCall has either argv or api")

    def describe(self) -> str:
        if self.argv is not None:
            return " ".join(str(a) for a in self.argv)
        return f"{self.api}({', '.join(f'{k}={v!r}' for k, v in self.args.items())})"

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@runtime_checkable
class RecoveryDriver(Protocol):
    """What the action service calls; the local ``trainguard run`` supervisor fits it too."""

    def restart(self, job_ref: str, exclude_nodes: Iterable[str] = (),
                resume_step: int | None = None) -> list[DriverCall]: ...

    def evict(self, nodes: Iterable[str], reason: str | None = None) -> list[DriverCall]: ...


def calls_ok(calls: Iterable[DriverCall]) -> bool:
    """True when no call failed or could not be made (dry-run calls count as fine)."""
    return all(c.status not in ("failed", "not_applicable") for c in calls)


def check_names(names: Iterable[str], pattern: re.Pattern, what: str, hint: str) -> list[str]:
    """Sorted distinct names, each matching ``pattern`` in full, else :class:`InvalidTarget`.

    >>> check_names(["n2", "n1", "n2"], re.compile(r"[a-z0-9]+"), "node", "a-z, 0-9")
    ['n1', 'n2']
    >>> check_names(["--all"], re.compile(r"[a-z0-9]+"), "node", "a-z, 0-9")
    Traceback (most recent call last):
    ...
    trainguard.actions.drivers.base.InvalidTarget: node '--all' is not valid here (a-z, 0-9); pass the node exactly as the cluster names it
    """
    if isinstance(names, str):
        names = [names]
    out = set()
    for name in names:
        if not isinstance(name, str) or not pattern.fullmatch(name):
            raise InvalidTarget(f"{what} {name!r} is not valid here ({hint}); pass the "
                                f"{what} exactly as the cluster names it")
        out.add(name)
    return sorted(out)


def cut(text: str | bytes | None) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = text.strip()
    return text if len(text) <= OUTPUT_MAX else text[:OUTPUT_MAX] + "..."
