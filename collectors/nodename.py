"""The machine's name as the scheduler knows it (SPEC §6), so that an eviction names a machine
the scheduler can act on.

>>> node_name({"SLURMD_NODENAME": "gpu-07", "NODE_NAME": "x"}, hostname=lambda: "h1")
'gpu-07'
>>> node_name({"NODE_NAME": "ip-10-0-3-7.ec2.internal"}, hostname=lambda: "pod-abc")
'ip-10-0-3-7.ec2.internal'
>>> node_name({"SLURMD_NODENAME": " "}, hostname=lambda: "h1")
'h1'
"""
from __future__ import annotations

import os
import socket
from typing import Callable, Mapping

__all__ = ["node_name", "SCHEDULER_NODE_VARS"]

#: Where schedulers put the node's name: Slurm sets ``SLURMD_NODENAME`` in every job step
#: (the ``-N`` name of its slurmd, not the host name); Kubernetes pods get ``NODE_NAME``
#: from the downward API (``valueFrom: fieldRef: spec.nodeName``).
SCHEDULER_NODE_VARS = ("SLURMD_NODENAME", "NODE_NAME")


def node_name(environ: Mapping[str, str] | None = None,
              hostname: Callable[[], str] = socket.gethostname) -> str:
    """``SLURMD_NODENAME``, else ``NODE_NAME``, else the host name."""
    environ = os.environ if environ is None else environ
    for var in SCHEDULER_NODE_VARS:
        value = (environ.get(var) or "").strip()
        if value:
            return value
    return hostname()
