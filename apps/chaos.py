"""Fault injection for game days: declare faults, and the training loop injects them.

Faults are declared in ``TRAINGUARD_CHAOS`` (compact form or JSON) or in a JSON file named by
``TRAINGUARD_CHAOS_FILE``; the training loop calls five hooks, which do nothing when no fault
is declared::

    import trainguard.apps.chaos
    chaos = trainguard.apps.chaos.from_env(rank=rank)
    for step in range(start, steps):
        chaos.in_data(step)                 # hang: blocks, as a stuck data loader would
        chaos.before_forward(step)          # straggler: sleeps, as a slow GPU would
        loss = chaos.loss(step, model(x))   # nan / loss_spike: corrupts this rank's loss
        ...
        chaos.after_step(step)              # xid, error, crash

The compact form is ``kind@key=value,...;kind@...``::

    nan@step=30,rank=1;straggler@step=40-80,rank=2,factor=1.5;hang@step=120,rank=2;
    crash@step=160,rank=3;xid@step=200,rank=0,xid=79

Kinds: ``nan``, ``loss_spike`` (``factor``), ``straggler`` (``factor`` or ``delay``, over a
window ``step=A-B``), ``hang`` (``seconds``; default for ever, in
``_chaos_hang_in_data_loading``), ``crash`` (``signal``, default KILL), ``error`` (raises
:class:`ChaosInjectedError`) and the node fault ``xid`` (``node``, ``xid``, ``bus``, ``msg``,
``kmsg``: a driver line appended to the kernel-log file the node agent tails, path from
``kmsg=`` or ``TRAINGUARD_CHAOS_KMSG``). ``step=N`` fires at the first step >= N; ``rank`` is
``N``, ``A-B``, ``A+B`` or ``all``. JSON is a list of objects with the same keys plus ``kind``.

**Once per job run**: a fired fault leaves a file in the state directory
(``TRAINGUARD_CHAOS_STATE``, else ``default_state_dir``, else one per
``TORCHELASTIC_RUN_ID``), and a process that finds it at its start skips the fault, so a job
restarted from a checkpoint gets past it. **Injection log**: each firing appends a JSON line
(``id``, ``kind``, ``spec``, ``ranks``, ``rank``, ``node``, ``step``, ``injected_ts``, ``pid``)
to ``TRAINGUARD_CHAOS_LOG``. The full reference is docs/CHAOS.md.

Check a schedule with ``python -m trainguard.apps.chaos 'SPEC'``.

>>> [f.spec for f in parse("nan@step=30,rank=1; straggler@step=40-80,rank=2+3,factor=1.5")]
['nan@step=30,rank=1', 'straggler@step=40-80,rank=2+3,factor=1.5']
>>> parse("hang@step=x,rank=2")
Traceback (most recent call last):
...
trainguard.apps.chaos.ChaosError: chaos fault 1 'hang@step=x,rank=2': step must be N or A-B (e.g. step=120 or step=40-80), not 'x'
"""
from __future__ import annotations

import hashlib
import json
import os
import signal as _signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Mapping

from trainguard.collectors.nodename import node_name
from trainguard.errors import UserError
from trainguard.files import write_atomic

__all__ = ["ChaosError", "ChaosInjectedError", "Fault", "Chaos", "parse", "load",
           "from_env", "xid_line", "KINDS", "XID_MESSAGES"]

RANK_KINDS = ("nan", "loss_spike", "straggler", "hang", "crash", "error")
KINDS = RANK_KINDS + ("xid",)
SIGNALS = ("KILL", "SEGV", "ABRT", "TERM", "INT")
HANG_PHASES = (None, "data", "checkpoint")
# The driver's text for common Xids (NVIDIA's Xid catalog).
XID_MESSAGES = {
    13: "Graphics Exception: Shader Program Header 0 Error",
    31: "Ch 00000010, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ "
        "0x7f31_20000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer "
        "at partition 0, subpartition 0.",
    63: "Row Remapper: New row marked for remapping, reset gpu to activate.",
    64: "Row Remapper: Failed to mark a row for remapping.",
    74: "NVLink: fatal error detected on link 4(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)",
    79: "GPU has fallen off the bus.",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    119: "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 "
         "(GSP_RM_CONTROL) (0x20800a4c 0x4).",
}
# Keys each kind accepts besides kind/step/rank.
_KEYS = {"nan": (), "loss_spike": ("factor",), "straggler": ("factor", "delay"),
         "hang": ("seconds", "phase"), "crash": ("signal",), "error": (),
         "xid": ("node", "xid", "bus", "msg", "kmsg")}


class ChaosError(UserError):
    """A chaos schedule is malformed; the message names the fault and the fix."""


class ChaosInjectedError(RuntimeError):
    """Raised by an ``error`` fault: an ordinary Python error escaping the training loop."""


@dataclass(kw_only=True, frozen=True)
class Fault:
    """One declared fault. ``last`` is None for a point fault; ``ranks`` None means all ranks.

    >>> Fault(kind="crash", first=160, ranks=(3,)).spec
    'crash@step=160,rank=3'
    >>> Fault(kind="crash", first=5, last=9, ranks=(3,))
    Traceback (most recent call last):
    ...
    trainguard.apps.chaos.ChaosError: crash fires once: give one step (step=N), not a window
    """

    kind: str
    first: int
    last: int | None = None
    ranks: tuple[int, ...] | None = ()
    node: str | None = None
    factor: float | None = None
    delay: float | None = None
    seconds: float | None = None
    signal: str | None = None
    xid: int | None = None
    bus: str | None = None
    msg: str | None = None
    kmsg: str | None = None
    phase: str | None = None           # hang: "data" (None) or "checkpoint"
    launch: int | None = None          # only in this launch (TRAINGUARD_RESTART_COUNT; 0: first)
    id: str = ""

    def __post_init__(self):
        k = self.kind
        if k not in KINDS:
            raise ChaosError(f"unknown fault kind {k!r}; use one of {', '.join(KINDS)}")
        if self.first < 0 or (self.last is not None and self.last < self.first):
            raise ChaosError(f"{k}: steps must be >= 0 and A <= B in step=A-B")
        if self.last is not None and k != "straggler":
            raise ChaosError(f"{k} fires once: give one step (step=N), not a window")
        if k in RANK_KINDS and self.ranks == ():
            raise ChaosError(f"{k}: say which rank(s), e.g. rank=2, rank=1+3, rank=0-3 or rank=all")
        for name in ("factor", "delay", "seconds"):
            value = getattr(self, name)
            if value is not None and not (value >= 0 and value < float("inf")):
                raise ChaosError(f"{k}: {name} must be a finite number >= 0, not {value!r}")
        if self.factor is not None and k == "straggler" and self.factor < 1:
            raise ChaosError(f"straggler: factor must be >= 1 (1.5 = 50% slower), not {self.factor}")
        if self.phase not in HANG_PHASES:
            raise ChaosError(f"hang: phase must be one of {', '.join(HANG_PHASES[1:])}")
        if self.launch is not None and self.launch < 0:
            raise ChaosError(f"{k}: launch must be >= 0 (0 is the first launch)")
        if self.signal is not None and self.signal not in SIGNALS:
            raise ChaosError(f"crash: signal must be one of {', '.join(SIGNALS)}")

    @property
    def spec(self) -> str:
        """The fault in compact form (canonical: keys in a fixed order)."""
        step = f"{self.first}" if self.last is None else f"{self.first}-{self.last}"
        parts = [f"step={step}"]
        if self.ranks is None:
            parts.append("rank=all")
        elif self.ranks:
            parts.append("rank=" + "+".join(map(str, self.ranks)))
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("kind", "first", "last", "ranks", "id") and value is not None:
                parts.append(f"{f.name}={value:g}" if isinstance(value, float) else f"{f.name}={value}")
        return f"{self.kind}@" + ",".join(parts)

    def targets(self, rank: int, node: str, local_rank: int | None) -> bool:
        """Whether the process of ``rank`` (on ``node``) injects this fault."""
        if self.kind == "xid":
            if self.node is not None:
                return self.node == node and (local_rank or 0) == 0
            return rank == (self.ranks[0] if self.ranks else 0)
        return self.ranks is None or rank in self.ranks


# ----------------------------------------------------------------------------- parsing
def _int(text: Any, what: str) -> int:
    if isinstance(text, bool) or not (isinstance(text, int) or str(text).strip().isdigit()):
        raise ValueError(what)
    return int(text)


def _steps(value: Any) -> tuple[int, int | None]:
    what = f"step must be N or A-B (e.g. step=120 or step=40-80), not {value!r}"
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return _int(value[0], what), _int(value[1], what)
    if isinstance(value, str) and "-" in value:
        a, b = value.split("-", 1)
        return _int(a, what), _int(b, what)
    return _int(value, what), None


def _ranks(value: Any) -> tuple[int, ...] | None:
    what = f"rank must be N, A-B, A+B or all, not {value!r}"
    if isinstance(value, str) and value.strip() == "all":
        return None
    if isinstance(value, (list, tuple)):
        items = [_int(v, what) for v in value]
    else:
        items = []
        for part in str(value).split("+"):
            a, _, b = part.partition("-")
            items += list(range(_int(a, what), _int(b, what) + 1)) if b else [_int(a, what)]
    if not items:
        raise ValueError(what)
    return tuple(sorted(set(items)))


def _fault(obj: dict, index: int) -> Fault:
    kind = str(obj.get("kind", "")).strip()
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; use one of {', '.join(KINDS)}")
    allowed = {"kind", "step", "rank", "ranks", "launch"} | set(_KEYS[kind])
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ValueError(f"{kind} takes no {unknown[0]!r}; it takes "
                         f"{', '.join(sorted(allowed - {'kind', 'ranks'}))}")
    if "step" not in obj:
        raise ValueError(f"{kind}: say when, e.g. step=120")
    first, last = _steps(obj["step"])
    rank_value = obj.get("rank", obj.get("ranks"))
    ranks = () if rank_value is None else _ranks(rank_value)
    args: dict[str, Any] = {}
    if "launch" in obj:
        args["launch"] = _int(obj["launch"], f"launch must be an integer, not {obj['launch']!r}")
    for key in _KEYS[kind]:
        if key not in obj:
            continue
        value = obj[key]
        if key in ("factor", "delay", "seconds"):
            try:
                args[key] = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"{key} must be a number, not {value!r}") from None
        elif key == "xid":
            args[key] = _int(value, f"xid must be an integer, not {value!r}")
        elif key == "signal":
            args[key] = str(value).upper().removeprefix("SIG")
        else:
            args[key] = str(value)
    if kind == "xid" and (ranks is None or len(ranks) > 1):
        raise ValueError("xid is written once per job: give one rank=N or node=NAME")
    return Fault(kind=kind, first=first, last=last, ranks=ranks, id=f"{index}-{kind}", **args)


def _compact(text: str) -> list[dict]:
    out = []
    for part in text.replace("\n", ";").split(";"):
        part = part.strip()
        if not part:
            continue
        kind, _, rest = part.partition("@")
        obj: dict[str, Any] = {"kind": kind.strip(), "_text": part}
        for item in filter(None, (i.strip() for i in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                obj["_bad"] = f"expected key=value, not {item!r}"
            obj[key.strip()] = value.strip()
        out.append(obj)
    return out


def parse(text: str, source: str = "chaos") -> list[Fault]:
    """Faults from the compact form or JSON; raises :class:`ChaosError` with a one-line reason."""
    text = text.strip()
    if text.startswith(("[", "{")):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ChaosError(f"{source}: not valid JSON ({exc}); give a list of fault objects "
                             "or {\"faults\": [...]}") from None
        if isinstance(data, dict):
            data = data.get("faults", [data] if "kind" in data else None)
        if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
            raise ChaosError(f"{source}: JSON must be a list of fault objects or {{\"faults\": [...]}}")
        items = [dict(d, _text=json.dumps(d)) for d in data]
    else:
        items = _compact(text)
    faults = []
    for index, obj in enumerate(items, 1):
        shown = obj.pop("_text")
        try:
            if "_bad" in obj:
                raise ValueError(obj["_bad"])
            faults.append(_fault(obj, index))
        except (ValueError, ChaosError) as exc:
            raise ChaosError(f"{source} fault {index} {shown!r}: {exc}") from None
    return faults


def load(path: str | os.PathLike) -> list[Fault]:
    """Faults from a JSON (or compact-form) file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ChaosError(f"cannot read chaos file {path}: {exc.strerror}; "
                         "check TRAINGUARD_CHAOS_FILE") from None
    return parse(text, source=str(path))


def xid_line(xid: int, bus: str, pid: int, name: str = "python", message: str | None = None,
             uptime: float = 0.0) -> str:
    """A kernel-log line as the NVIDIA driver writes it, with dmesg's uptime prefix.

    >>> xid_line(79, "0000:3b:00", 4242, uptime=1234.5)
    '[ 1234.500000] NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus.'
    """
    text = message or XID_MESSAGES.get(xid, "Unknown Error")
    return f"[{uptime:12.6f}] NVRM: Xid (PCI:{bus}): {xid}, pid={pid}, name={name}, {text}"


def _chaos_hang_in_data_loading(seconds: float | None, sleep: Callable[[float], None]) -> None:
    """Chaos: this rank hangs here, as if its data loader were stuck (dead mount, deadlock)."""
    deadline = None if seconds is None else time.monotonic() + seconds
    while deadline is None or time.monotonic() < deadline:
        sleep(1.0 if deadline is None else max(0.0, min(1.0, deadline - time.monotonic())))


# ----------------------------------------------------------------------------- injecting
class Chaos:
    """Injects the ``faults`` that target this process (``rank`` on ``node``).

    ``state_dir`` holds the once-per-job-run records (None: once per process); ``log_path``
    gets one JSON line per injection; ``kmsg_path`` is where ``xid`` lines go unless a fault
    names its own. ``clock`` (Unix time of the records), ``sleep``, ``kill`` and ``monotonic``
    (step periods, for a straggler's ``factor``) are injectable for tests.

    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> c = Chaos(parse("nan@step=3,rank=1"), rank=1, node="n1", state_dir=d,
    ...           clock=lambda: 1764680000.0)
    >>> c.loss(2, 1.5), c.loss(3, 1.5), c.loss(4, 1.5)
    (1.5, nan, 1.5)
    >>> again = Chaos(parse("nan@step=3,rank=1"), rank=1, node="n1", state_dir=d)
    >>> again.loss(3, 1.5)         # a restarted process: already fired in this job run
    1.5
    """

    def __init__(self, faults: list[Fault], *, rank: int, node: str, local_rank: int | None = None,
                 state_dir: str | os.PathLike | None = None, log_path: str | os.PathLike | None = None,
                 kmsg_path: str | os.PathLike | None = None, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] = time.sleep, kill: Callable[[int, int], None] = os.kill,
                 monotonic: Callable[[], float] = time.monotonic, quiet: bool = False,
                 launch: int = 0):
        self.faults = faults
        self.rank = rank
        self.node = node
        self.local_rank = local_rank
        self.state_dir = state_dir
        self.log_path = log_path
        self.kmsg_path = kmsg_path
        self.clock = clock
        self.sleep = sleep
        self.kill = kill
        self.monotonic = monotonic
        self.quiet = quiet
        self.launch = launch
        self.mine = [f for f in faults if f.targets(rank, node, local_rank)
                     and f.launch in (None, launch)]
        self.fired: list[dict] = []          # records of the injections of this process
        self._prior: set[str] | None = None  # state files present when this process began
        self._active: set[str] = set()
        self._last_call: float | None = None
        self._periods: list[float] = []
        self._slept = 0.0

    def __bool__(self) -> bool:
        return bool(self.mine)

    # -- hooks ---------------------------------------------------------------------------
    def in_data(self, step: int) -> None:
        """Hang faults: block here, in data loading."""
        for f in self._due("hang", step):
            if f.phase in (None, "data"):
                self._fire(f, step)
                _chaos_hang_in_data_loading(f.seconds, self.sleep)

    def in_checkpoint(self, step: int) -> None:
        """Hang faults with ``phase=checkpoint``: block here, in the checkpoint after ``step``
        (a stuck write: a dead mount, a lost storage server)."""
        for f in self._due("hang", step):
            if f.phase == "checkpoint":
                self._fire(f, step)
                _chaos_hang_in_data_loading(f.seconds, self.sleep)

    def before_forward(self, step: int) -> None:
        """Straggler faults: sleep so this rank's step takes longer."""
        now = self.monotonic()
        if self._last_call is not None:
            self._periods = (self._periods + [now - self._last_call - self._slept])[-5:]
        self._last_call, self._slept = now, 0.0
        for f in self._due("straggler", step):
            if f.id not in self._active:
                self._fire(f, step, delay=f.delay, factor=f.factor)
                self._active.add(f.id)
            if f.delay is not None:
                delay = f.delay
            else:
                base = statistics.median(self._periods) if self._periods else 0.0
                delay = ((f.factor or 2.0) - 1.0) * base
            if delay > 0:
                self.sleep(delay)
                self._slept += delay

    def loss(self, step: int, loss):
        """NaN and loss-spike faults: returns ``loss`` (float or tensor), corrupted when due."""
        for f in self._due("nan", step):
            self._fire(f, step)
            loss = loss * float("nan")
        for f in self._due("loss_spike", step):
            self._fire(f, step, factor=f.factor or 10.0)
            loss = loss * (f.factor or 10.0)
        return loss

    def after_step(self, step: int) -> None:
        """Node faults (xid), then ``error`` (raises), then ``crash`` (kills this process)."""
        for f in self._due("xid", step):
            self._inject_xid(f, step)
        for f in self._due("error", step):
            self._fire(f, step)
            raise ChaosInjectedError(f"chaos: injected error at step {step} on rank {self.rank}")
        for f in self._due("crash", step):
            self._fire(f, step, signal=f.signal or "KILL")
            sys.stdout.flush()
            sys.stderr.flush()
            self.kill(os.getpid(), getattr(_signal, "SIG" + (f.signal or "KILL")))

    # -- bookkeeping ---------------------------------------------------------------------
    def _due(self, kind: str, step: int):
        for f in self.mine:
            if f.kind != kind or step < f.first:
                continue
            if f.last is not None:
                if step > f.last or (f.id not in self._active and self._done_before(f)):
                    continue
            elif self._done_before(f) or any(r["id"] == f.id for r in self.fired):
                continue
            yield f

    def _state_name(self, f: Fault) -> str:
        digest = hashlib.sha1(f.spec.encode()).hexdigest()[:8]
        return f"{f.id}-{digest}" + ("" if f.kind == "xid" else f".r{self.rank}")

    def _done_before(self, f: Fault) -> bool:
        if self._prior is None:
            try:
                self._prior = set(os.listdir(self.state_dir)) if self.state_dir else set()
            except FileNotFoundError:
                self._prior = set()
        return self._state_name(f) + ".json" in self._prior

    def _fire(self, f: Fault, step: int, **extra) -> dict:
        record = {"id": f.id, "kind": f.kind, "spec": f.spec,
                  "ranks": [] if f.kind == "xid" else [self.rank], "rank": self.rank,
                  "node": self.node, "step": step, "injected_ts": self.clock(), "pid": os.getpid()}
        record.update({k: v for k, v in extra.items() if v is not None})
        self.fired.append(record)
        line = json.dumps(record, sort_keys=True) + "\n"
        if self.state_dir:
            os.makedirs(self.state_dir, exist_ok=True)
            path = Path(self.state_dir) / (self._state_name(f) + ".json")
            write_atomic(path, line)
        if self.log_path:
            _append(self.log_path, line)
        if not self.quiet:
            print(f"[trainguard.apps.chaos] injecting {f.spec} at step {step} on rank {self.rank} "
                  f"({self.node})", file=sys.stderr, flush=True)
        return record

    def _inject_xid(self, f: Fault, step: int) -> None:
        path = f.kmsg or self.kmsg_path
        if not path:
            raise ChaosError(f"{f.spec}: say where the kernel log is: kmsg=PATH or TRAINGUARD_CHAOS_KMSG")
        xid, bus = f.xid if f.xid is not None else 79, f.bus or "0000:3b:00"
        line = xid_line(xid, bus, os.getpid(), _comm(), f.msg, time.monotonic())
        self._fire(f, step, xid=xid, message=line, kmsg=str(path))
        _append(path, line + "\n")


def _append(path: str | os.PathLike, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, text.encode("utf-8"))  # one write: lines of concurrent ranks do not mix
    finally:
        os.close(fd)


def _comm() -> str:
    try:
        return Path("/proc/self/comm").read_text().strip() or "python"
    except OSError:
        return "python"


def from_env(rank: int | None = None, *, node: str | None = None, local_rank: int | None = None,
             default_state_dir: str | os.PathLike | None = None,
             environ: Mapping[str, str] | None = None) -> Chaos:
    """The :class:`Chaos` of this process from the ``TRAINGUARD_CHAOS*`` variables.

    ``rank``/``local_rank`` default to torchrun's ``RANK``/``LOCAL_RANK``; ``node`` to
    ``TRAINGUARD_NODE``, else the host name. Without a schedule every hook is a no-op.

    >>> c = from_env(environ={"TRAINGUARD_CHAOS": "crash@step=9,rank=3", "RANK": "3"})
    >>> bool(c), [f.spec for f in c.mine]
    (True, ['crash@step=9,rank=3'])
    >>> bool(from_env(environ={}))
    False
    >>> later = {"TRAINGUARD_CHAOS": "hang@step=6,rank=1,launch=1", "RANK": "1"}
    >>> bool(from_env(environ=later)), bool(from_env(environ={**later,
    ...                                                     "TRAINGUARD_RESTART_COUNT": "1"}))
    (False, True)
    """
    env = os.environ if environ is None else environ
    text, path = env.get("TRAINGUARD_CHAOS", "").strip(), env.get("TRAINGUARD_CHAOS_FILE", "").strip()
    if text and path:
        raise ChaosError("set TRAINGUARD_CHAOS or TRAINGUARD_CHAOS_FILE, not both")
    faults = parse(text, "TRAINGUARD_CHAOS") if text else load(path) if path else []
    kmsg = env.get("TRAINGUARD_CHAOS_KMSG") or None
    for f in faults:
        if f.kind == "xid" and not (f.kmsg or kmsg):
            raise ChaosError(f"{f.spec}: say where the node agent's kernel log is: add "
                             "kmsg=PATH or set TRAINGUARD_CHAOS_KMSG")
    state = env.get("TRAINGUARD_CHAOS_STATE") or default_state_dir
    if not state and env.get("TORCHELASTIC_RUN_ID"):
        state = os.path.join(tempfile.gettempdir(), f"trainguard-chaos-{env['TORCHELASTIC_RUN_ID']}")
    return Chaos(faults, rank=int(env.get("RANK", 0)) if rank is None else rank,
                 node=node or env.get("TRAINGUARD_NODE") or node_name(env),
                 local_rank=int(env.get("LOCAL_RANK", 0)) if local_rank is None else local_rank,
                 state_dir=state or None, log_path=env.get("TRAINGUARD_CHAOS_LOG") or None,
                 kmsg_path=kmsg, launch=_launch(env))


def _launch(env: Mapping[str, str]) -> int:
    """Which launch of the job this is: ``trainguard run``'s restart count, else torchrun's."""
    for name in ("TRAINGUARD_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        value = env.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 0


def _main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m trainguard.apps.chaos 'SPEC' | FILE   (check a chaos schedule)")
        return 2
    try:
        faults = load(argv[0]) if os.path.isfile(argv[0]) else parse(argv[0])
    except ChaosError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for f in faults:
        print(f"{f.id:<14} {f.spec}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
