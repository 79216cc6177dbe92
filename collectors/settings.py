"""Who a rank is and how its collector reports: :class:`CollectorSettings`, validated.

Nothing here reads the environment; :func:`trainguard.collectors.api.init` does, once.

>>> CollectorSettings(job="llama-70b-run3", rank=5, world_size=16,
...                   topology={"tp": 4, "pp": 2}).topology
{'tp': 4, 'pp': 2, 'dp': 2}
>>> try:
...     CollectorSettings(job="bad job")
... except CollectorError as exc:
...     print(exc)
job id 'bad job' must be 1-128 characters of [A-Za-z0-9._-], e.g. 'llama-70b-run3'
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from trainguard.errors import UserError
from trainguard.setting import setting

__all__ = ["CollectorError", "CollectorSettings", "CollectorConfig", "AgentConfig", "env_int"]

_NAME = r"[A-Za-z0-9._-]{1,100}"


#: the longest heartbeat interval a collector takes: the silent detector takes a rank
#: unheard for its ``timeout_s`` (15 s) for gone; with heartbeats 20 s apart 69 of the 115
#: healthy shapes of the scenario library raised false silents and hangs, none at 15 s
MAX_HEARTBEAT_INTERVAL_S = 10.0


@dataclass(kw_only=True)
class CollectorConfig:
    """The ``collector`` section of the configuration tree: how a rank's collector reports
    (the defaults of :func:`trainguard.init`'s arguments of the same names)."""

    heartbeat_interval: float = setting(1.0, "seconds between a rank's heartbeats (at most "
                                             "10: the job side takes a rank unheard for 15 s, "
                                             "silent.timeout_s, for gone)",
                                        minimum=0.01, maximum=MAX_HEARTBEAT_INTERVAL_S)
    report_every: int = setting(1, "read and send the reported values (loss, grad norm, ...) "
                                   "every n-th step; timings and plain-int token counts on "
                                   "every step", minimum=1)
    flush_timeout: float = setting(3.0, "seconds to flush at exit")
    max_queue_events: int = setting(10000, "events queued while Kafka is away; then the "
                                           "oldest are dropped")
    max_queue_bytes: int = setting(8 << 20, "bytes queued while Kafka is away")
    instrument: bool = setting(False, "`trainguard run` watches an unmodified PyTorch script "
                                      "through PyTorch's hooks (`--instrument`, "
                                      "docs/INTEGRATIONS.md)", env="TRAINGUARD_INSTRUMENT")


@dataclass(kw_only=True)
class AgentConfig:
    """The ``agent`` section of the configuration tree: the node agent of one machine
    (:class:`trainguard.collectors.agent.Agent`, ``trainguard agent``)."""

    node: str | None = setting(None, "this machine's name (default: host name)", kind=str,
                               min_length=1)
    job: str | None = setting(None, "job id of GPU and Xid events (default: every job seen "
                                    "locally)", kind=str, pattern=_NAME)
    runtime_dir: str | None = setting(None, "local registry of rank processes (default: "
                                            "$TRAINGUARD_HOME/run)", kind=str, min_length=1)
    interval: float = setting(1.0, "GPU sample period, seconds", minimum=0.01)
    kmsg_extra: list = setting([], "files also tailed as kernel logs (chaos tests)")
    native: bool = setting(False, "py-spy --native stacks")

log = logging.getLogger(__name__)

_JOB_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")


class CollectorError(UserError, ValueError):
    """A wrong argument to the collector API (a programming error in the training script)."""


@dataclass(kw_only=True)
class CollectorSettings:
    """Who this rank is and how often to report; validated, never read from the environment."""

    job: str
    rank: int = 0
    local_rank: int | None = None
    world_size: int = 1
    node: str | None = None
    topology: dict | None = None
    heartbeat_interval: float = CollectorConfig.heartbeat_interval
    report_every: int = CollectorConfig.report_every
    argv: list | None = None

    def __post_init__(self):
        if type(self.job) is not str or not _JOB_RE.fullmatch(self.job):
            raise CollectorError(f"job id {self.job!r} must be 1-128 characters of "
                                 "[A-Za-z0-9._-], e.g. 'llama-70b-run3'")
        for name in ("rank", "world_size", "report_every"):
            if type(getattr(self, name)) is not int:
                raise CollectorError(f"{name} must be an int, got {getattr(self, name)!r}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise CollectorError(f"rank {self.rank} must be in [0, world_size={self.world_size})")
        if self.local_rank is not None and (type(self.local_rank) is not int
                                            or self.local_rank < 0):
            raise CollectorError(f"local_rank must be an int >= 0, got {self.local_rank!r}")
        if self.report_every < 1:
            raise CollectorError(f"report_every must be >= 1, got {self.report_every}")
        if not 0 < self.heartbeat_interval <= MAX_HEARTBEAT_INTERVAL_S:
            raise CollectorError(
                f"heartbeat_interval must be in (0, {MAX_HEARTBEAT_INTERVAL_S:g}] seconds, got "
                f"{self.heartbeat_interval!r}: the job side takes a rank unheard for 15 s "
                f"(silent.timeout_s) for gone")
        if self.node is not None and not 0 < len(self.node) <= 255:
            raise CollectorError(f"node {self.node!r} must be 1-255 characters")
        if self.topology is not None:
            self.topology = _topology(self.topology, self.world_size)


def _topology(topology: dict, world_size: int) -> dict:
    """Check ``{"tp", "pp", "dp"}``; a missing ``dp`` is ``world_size // (tp * pp)``."""
    if not isinstance(topology, dict):
        raise CollectorError(f"topology must be a dict like {{'tp': 8, 'pp': 4, 'dp': 16}}, "
                             f"got {topology!r}")
    out = dict(topology)
    tp, pp = out.setdefault("tp", 1), out.setdefault("pp", 1)
    if type(tp) is int and type(pp) is int and tp >= 1 and pp >= 1:
        out.setdefault("dp", max(1, world_size // (tp * pp)))
    for name in ("tp", "pp", "dp"):
        if type(out[name]) is not int or out[name] < 1:
            raise CollectorError(f"topology {name} must be an int >= 1, got {out[name]!r}")
    if "layout" in out and type(out["layout"]) is not str:
        raise CollectorError("topology layout must be a string")
    if out["tp"] * out["pp"] * out["dp"] != world_size:
        log.warning("topology tp*pp*dp = %d differs from world_size %d",
                    out["tp"] * out["pp"] * out["dp"], world_size)
    return out


def env_int(environ, name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        log.warning("trainguard: ignoring %s=%r (not an integer)", name, raw)
        return None
