"""Recovery drivers for real clusters: Slurm (command line) and Kubernetes (official client).

Both have the one interface, ``restart(job_ref, exclude_nodes)`` and ``evict(nodes)``, returning
the :class:`DriverCall` list made (or planned, in dry-run). See docs/DRIVERS.md, which also
says which drivers have been run against a real system.

>>> d = build_driver({"type": "slurm", "dry_run": True})
>>> [c.describe() for c in d.restart("77", exclude_nodes=["n9"])][1]
'scontrol update JobId=77 ExcNodeList=n9 StartTime=now'
>>> isinstance(d, RecoveryDriver)
True
"""
from __future__ import annotations

from typing import Any, Mapping

from trainguard.errors import UserError

from .base import CALL_STATUSES, DriverCall, InvalidTarget, RecoveryDriver, calls_ok
from .kubernetes import KubernetesDriver, load_core_api
from .slurm import SlurmDriver

__all__ = ["DriverCall", "RecoveryDriver", "InvalidTarget", "calls_ok", "CALL_STATUSES",
           "SlurmDriver", "KubernetesDriver", "load_core_api", "build_driver", "DRIVER_TYPES"]

DRIVER_TYPES = {"slurm": SlurmDriver, "kubernetes": KubernetesDriver, "k8s": KubernetesDriver}


def build_driver(config: Mapping[str, Any], **inject: Any) -> SlurmDriver | KubernetesDriver:
    """A driver from ``{"type": "slurm" | "kubernetes", <its settings>}``; ``inject`` passes
    objects a config file cannot hold (``runner=``, ``core_api=``)."""
    settings = dict(config)
    kind = settings.pop("type", None)
    if kind not in DRIVER_TYPES:
        raise UserError(f"driver type {kind!r} is unknown; set type to one of "
                        f"{', '.join(sorted(DRIVER_TYPES))}")
    cls = DRIVER_TYPES[kind]
    try:
        if "sbatch_args" in settings:
            settings["sbatch_args"] = tuple(settings["sbatch_args"])
        return cls(**settings, **inject)
    except (TypeError, ValueError) as exc:
        raise UserError(f"driver {kind}: {exc}") from None
