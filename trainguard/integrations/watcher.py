"""From training-loop marks to SPEC events: :class:`StepWatcher`.

The hooks of :mod:`.torch_hooks` and the framework callbacks tell a watcher what the loop does
(``begin`` a step, ``backward_begin``/``backward_end``, ``grad_ready``, ``wait_begin``/
``wait_end`` around collectives, ``phase``, ``end`` of a step); the watcher keeps the
heartbeat's phase on the rank's :class:`~trainguard.collectors.api.Collector` and queues one
``step`` event per step with its ``step_time`` (host wall time), ``compute_time`` (a
:class:`~trainguard.collectors.compute_timer.ComputeTimer`), loss, grad norm, learning rate and
tokens.

Steps are contiguous: a step runs from the end of the one before (the first from its first
mark) to its own end, so what a rank does between two optimizer steps (loading and
preprocessing data, logging, an evaluation) is its work in the next step. ``compute_time`` is
that time less the time blocked waiting for peers (``wait_begin``/``wait_end``, also between
steps): a rank slowed by its data loader makes its peers wait, and stands out.

Nothing here forces a device synchronization: a CUDA loss or grad norm is copied to the host
without blocking and the step's event is sent once the GPU is past the step (usually during the
next step); values on the CPU are read at once. No method raises: the hooks call them inside the
user's training loop, so every entry point is wrapped by the callers in ``try``/``except``.

When the script itself calls ``tg.step`` (the explicit API of SPEC §5), the collector says so
(``collector.explicit``) and the watcher stands down for good: the explicit calls win and no
step is counted twice.

>>> from trainguard.collectors.api import Collector, CollectorSettings
>>> class Sink:
...     dropped = 0
...     def __init__(self): self.records = []
...     def produce(self, record, key=None): self.records.append(record)
>>> c = Collector(CollectorSettings(job="j1", rank=0, world_size=2), Sink())
>>> ticks = iter(range(100))
>>> w = StepWatcher(lambda: c, clock=lambda: float(next(ticks)), cuda=False)
>>> w.begin(); w.backward_begin(2.5); w.grad_ready(); w.backward_end(); w.end(lr=0.1)  # 1 s waits
>>> _, _, step, step_time, compute, values = c.producer.records[-1]
>>> step, step_time, compute, values[0], values[4]
(0, 3.0, 2.0, 2.5, 0.1)
>>> _ = next(ticks); w.forward((), {}, True); w.end()  # 1 s loading data before the forward
>>> c.producer.records[-1][2:5]
(1, 2.0, 2.0)
"""
from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections import deque
from typing import Callable

from trainguard.collectors.compute_timer import make_compute_timer

__all__ = ["StepWatcher", "job_id", "count_tokens"]

log = logging.getLogger(__name__)

_Tensor = None  # torch.Tensor, once a watcher is built (torch is imported by then)
_TOKEN_DTYPES: frozenset = frozenset()  # the integer dtypes of a batch of token ids
_BAD_JOB_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


def job_id(environ=None, run_name: str | None = None) -> str:
    """The job id: ``TRAINGUARD_JOB`` (set by ``trainguard run``), else ``TRAINGUARD_JOB_ID``,
    else the framework's run name, else the script's name; made SPEC-valid.

    >>> job_id({"TRAINGUARD_JOB": "llama-7b"})
    'llama-7b'
    >>> job_id({}, run_name="runs/May 3 12:00")
    'runs-May-3-12-00'
    """
    environ = os.environ if environ is None else environ
    raw = (environ.get("TRAINGUARD_JOB") or environ.get("TRAINGUARD_JOB_ID") or run_name
           or os.path.splitext(os.path.basename(sys.argv[0] if sys.argv and sys.argv[0]
                                                else "python"))[0] or "job")
    return _BAD_JOB_CHARS.sub("-", str(raw)).strip("-")[:128] or "job"


def count_tokens(args: tuple, kwargs: dict | None) -> int | None:
    """Tokens in a model call: the size of ``input_ids``, else of the first integer tensor
    with two or more dimensions (a batch of token ids) among the arguments."""
    if kwargs:
        ids = kwargs.get("input_ids")
        if ids is not None and hasattr(ids, "numel"):
            return int(ids.numel())
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, dict):
            found = count_tokens((), value)
        elif isinstance(value, (list, tuple)) and len(value) <= 8:
            found = count_tokens(tuple(value), None)
        else:
            found = _token_tensor_size(value)
        if found is not None:
            return found
    return None


def _token_tensor_size(value) -> int | None:
    dtype = getattr(value, "dtype", None)
    if dtype is None or dtype.is_floating_point or dtype.is_complex \
            or getattr(value, "dim", None) is None:
        return None
    if value.dim() >= 2 and str(dtype) != "torch.bool":
        return int(value.numel())
    return None


def _host_value(value):
    """A number now, or a deferred host copy of a device tensor, or None."""
    if value is None or type(value) is float or type(value) is int:
        return value
    try:
        if type(value) is not _Tensor and not _local(value):  # a plain tensor is local
            return None
        if value.is_cuda:
            return _Deferred(value.detach().to("cpu", non_blocking=True))
        return float(value.item()) if value.ndim == 0 or value.numel() == 1 else None
    except AttributeError:  # not a tensor: a NumPy scalar, a Decimal...
        pass
    except Exception:
        return None
    try:
        return float(value.item()) if hasattr(value, "item") else float(value)
    except Exception:
        return None


def _local(value) -> bool:
    """Whether reading ``value`` stays on this rank: a DTensor not replicated on every rank
    (a ``Partial`` grad norm) would be reduced across ranks by ``.item()``, a collective that
    ranks whose watcher is off would never join.

    >>> _local(2.0)
    True
    """
    placements = getattr(value, "placements", None)
    if placements is None:
        return True
    try:
        return all(p.is_replicate() for p in placements)
    except Exception:
        return False


class _Deferred:
    """A device-to-host copy queued without blocking; read once the step's reading is ready."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def get(self):
        try:
            return float(self.tensor.item())
        except Exception:
            return None


class StepWatcher:
    """One rank's steps from marks. ``start_collector()`` returns the collector to send to
    (started on first need; None disables the watcher). ``cuda`` picks the compute timer
    (None: decided at the first step, CUDA when ``torch.cuda`` is initialized)."""

    def __init__(self, start_collector: Callable, *, clock: Callable[[], float] = time.perf_counter,
                 cuda: bool | None = None, first_step: int = 0, max_pending: int = 64):
        self.start_collector = start_collector
        self.clock = clock
        self.cuda = cuda
        self.next_step = first_step
        self.max_pending = max_pending
        self.active = True
        self.thread_id = threading.get_ident()
        self.collector = None
        self.timer = None
        self.in_step = False
        self.saw_backward = False
        self.clocked = False  # the current step's clock runs (from its first mark or the last end)
        self._t0 = 0.0
        self._waiting_ready = False
        self._loss = self._grad_norm = self._lr = None
        self._loss_scale = None
        self._scaled = None      # (scaled loss, loss, scale) of a GradScaler (note_scaled)
        self._given = None       # the losses a framework's backward was given this step, summed
        self._tokens: int | None = None
        self._pending: deque = deque()

    # -- the collector -----------------------------------------------------------------------
    def live(self):
        """The collector to send to, or None once the watcher stood down."""
        c = self.collector
        if c is None:
            if not self.active:
                return None
            try:
                c = self.collector = self.start_collector()
            except Exception as exc:
                log.warning("trainguard: watching disabled: %s", exc)
                c = None
            if c is None:
                self.active = False
                return None
            c.before_close.append(self.flush)
        if c.explicit or c.closed:
            self.stand_down()
            return None
        return c

    def _live(self):
        """:meth:`live`, with the common case (a collector already running) inline."""
        c = self.collector
        if c is None or not self.active or c.explicit or c.closed:
            return self.live() if self.active else None
        return c

    def stand_down(self) -> None:
        self.active = False
        self.in_step = False
        self.clocked = False
        self._pending.clear()

    def stop_clock(self) -> None:
        """What comes before the next mark is no step's (a framework starts a new run)."""
        if not self.in_step:
            self.clocked = False

    def phase(self, name: str):
        """Show ``name`` in heartbeats; returns the previous phase (for :meth:`restore`)."""
        c = self._live()
        if c is None:
            return None
        # the collector's set_phase, inline: the hooks call this several times a step
        previous = c._phase_state
        c._phase_state = (name, c.clock())
        return previous

    def restore(self, previous) -> None:
        c = self.collector
        if previous is not None and c is not None and self.active:
            c._phase_state = previous

    # -- the step ----------------------------------------------------------------------------
    def begin(self) -> None:
        """The step's work starts (first data fetch, forward or backward after the last step)."""
        if self.in_step or not self.active or self.live() is None:
            return
        self._start()

    def _start(self) -> None:
        self.in_step = True
        self.saw_backward = False
        self._waiting_ready = False
        self._loss = self._grad_norm = self._loss_scale = None
        self._tokens = None
        if not self.clocked:
            self._start_clock(self.clock())

    def _start_clock(self, now: float) -> None:
        timer = self.timer
        if timer is None:
            _know_torch()
            if self.cuda is None:
                self.cuda = _cuda_in_use()
            timer = self.timer = make_compute_timer(self.cuda, clock=self.clock)
        self._t0 = now
        self.clocked = True
        timer.begin(now)

    def fetch(self):
        """A data fetch starts: a step begins, heartbeats show ``data``; returns the previous
        phase for :meth:`fetched`."""
        c = self.collector
        if c is None or not self.active or c.explicit or c.closed:
            c = self._live()
            if c is None:
                return None
        if not self.in_step:
            self._start()
        previous = c._phase_state
        c._phase_state = ("data", c.clock())
        return previous

    def fetched(self, previous) -> None:
        """The fetch returned a batch: the step goes on (or an eval loop's fetch is over)."""
        c = self.collector
        if previous is not None and c is not None and self.active:
            c._phase_state = ("step", c.clock()) if self.in_step else previous

    def forward(self, args, kwargs, training: bool) -> None:
        """A top-level module is called: with gradients (``training``), the step's forward;
        else an evaluation."""
        c = self.collector
        if c is None or not self.active or c.explicit or c.closed:
            c = self._live()
            if c is None:
                return
        if not training:
            if self.in_step and not self.saw_backward:
                self.in_step = False
            c._phase_state = ("eval", c.clock())
            return
        if not self.in_step:
            self._start()
        if not kwargs and len(args) == 1 and type(args[0]) is _Tensor:  # one tensor: inline
            x = args[0]
            n = x.numel() if x.dtype in _TOKEN_DTYPES and x.dim() >= 2 else None
        else:
            n = count_tokens(args, kwargs)
        if n is not None:
            self._tokens = (self._tokens or 0) + n
        c._phase_state = ("forward", c.clock())

    def abandon(self) -> None:
        """What began was not a training step (an eval loop fetched data): forget it."""
        if self.in_step and not self.saw_backward:
            self.in_step = False

    def add_tokens(self, n: int | None) -> None:
        if n is not None and self.in_step:
            self._tokens = (self._tokens or 0) + n

    def backward_begin(self, loss) -> None:
        """``backward`` is called on ``loss`` (kept as is: read at the step's end, when the
        graph is freed anyway, so no ``detach`` copy here)."""
        c = self.collector
        if c is None or not self.active or c.explicit or c.closed:
            c = self._live()
            if c is None:
                return
        if not self.in_step:
            self._start()
        self.saw_backward = True
        scaled, self._scaled = self._scaled, None
        if scaled is not None and loss is scaled[0]:    # a GradScaler's product
            loss, self._loss_scale = scaled[1], scaled[2]
        if self._given is not None:       # the step's loss so far (note_given_loss)
            loss = self._given
        if loss is not None:
            self._loss = loss
        c._phase_state = ("backward", c.clock())

    def backward_done(self) -> None:
        """``backward`` returned: the wait for peers is over, the step goes on."""
        if self._waiting_ready:
            self._waiting_ready = False
            self.timer.wait_end()
        c = self.collector
        if self.in_step and c is not None and self.active:
            c._phase_state = ("step", c.clock())

    def grad_ready(self) -> None:
        """The last gradient of this backward pass is computed; from here the rank waits."""
        if self.in_step and not self._waiting_ready:
            self._waiting_ready = True
            self.timer.wait_begin()

    def backward_end(self) -> None:
        if self._waiting_ready:
            self._waiting_ready = False
            self.timer.wait_end()

    def wait_begin(self) -> None:
        if self.clocked:
            self.timer.wait_begin()

    def wait_end(self) -> None:
        if self.clocked:
            self.timer.wait_end()

    def note_grad_norm(self, value) -> None:
        if self.in_step:
            self._grad_norm = value

    def note_scaled(self, scaled, loss, scale) -> None:
        """A GradScaler made ``scaled`` = ``loss`` x ``scale`` for backward: the step's loss
        is ``loss`` and its loss scale ``scale`` (read now, as it was when used: the scaler
        updates it in place after the optimizer step)."""
        self._scaled = (scaled, loss, _host_value(scale))

    def note_given_loss(self, loss) -> None:
        """A framework's backward (accelerate's) was given ``loss``, whatever the backward it
        makes is called on. Summed over the step's backward calls: the Hugging Face Trainer
        gives each micro-batch of a gradient accumulation its share of the step's loss."""
        if type(loss) is not _Tensor or threading.get_ident() != self.thread_id:
            return
        loss = loss.detach()              # a device add, no read: the sum keeps no graph
        self._given = loss if self._given is None else self._given + loss

    def note_loss(self, value) -> None:
        if self.in_step and value is not None:
            self._loss = value

    def end(self, step: int | None = None, lr=None, loss=None, grad_norm=None,
            tokens: int | None = None) -> None:
        """The step is over (optimizer stepped, or the framework says so); ``step`` is its
        number (default: one more than the last)."""
        c = self.collector
        if c is None or not self.active or c.explicit or c.closed:
            c = self._live()
            if c is None:
                return
        if not self.in_step:  # no mark seen since the last step: it began when that one ended
            self._start()
        now = self.clock()
        if self._waiting_ready:
            self._waiting_ready = False
            self.timer.wait_end()
        if step is None:
            step = self.next_step
        self.next_step = step + 1
        if loss is None:
            loss = self._loss
        if grad_norm is None:
            grad_norm = self._grad_norm
        wall = c.clock()
        record = (step, wall, now - self._t0, _host_value(loss), _host_value(grad_norm),
                  self._tokens if tokens is None else tokens,
                  lr if type(lr) is float else _host_value(lr), self._loss_scale)
        reading = self.timer.end(now)
        self.in_step = False
        self._start_clock(now)  # the next step's time runs from here
        self._loss = self._grad_norm = self._loss_scale = None
        self._scaled = self._given = None
        pending = self._pending
        if not pending and reading.ready():  # the host timer's case: nothing to queue
            self._emit(c, record, reading)
        else:
            pending.append((record, reading))
            if len(pending) > self.max_pending:  # the device never caught up: drop the oldest
                pending.popleft()
            self.drain(c)
        c._phase_state = ("idle", wall)

    def drain(self, c, block: bool = False) -> None:
        """Send the pending steps whose readings are ready, in order."""
        pending = self._pending
        while pending:
            record, reading = pending[0]
            if not block and not reading.ready():
                return
            pending.popleft()
            self._emit(c, record, reading)

    def _emit(self, c, record, reading) -> None:
        step, ts, step_time, loss, grad_norm, tokens, lr, loss_scale = record
        compute = reading.value()
        if c.settings.world_size == 1:  # nobody to wait for, as in the explicit API
            compute = step_time
        elif compute is not None and compute > step_time:  # the clocks differ by a hair
            compute = step_time
        if type(loss) is _Deferred:
            loss = loss.get()
        if type(grad_norm) is _Deferred:
            grad_norm = grad_norm.get()
        if type(lr) is _Deferred:
            lr = lr.get()
        if type(loss_scale) is _Deferred:
            loss_scale = loss_scale.get()
        c.emit_step(step, step_time, compute, loss=loss, grad_norm=grad_norm, tokens=tokens,
                    loss_scale=loss_scale, lr=lr, ts=ts)

    def flush(self) -> None:
        """Send what is pending, waiting for the device if need be (at close)."""
        c = self.collector
        if c is not None and self.active and not c.explicit:
            self.drain(c, block=True)


def _know_torch() -> None:
    """The torch types :meth:`StepWatcher.forward` checks inline (torch is imported by the first
    step of a watched loop)."""
    global _Tensor, _TOKEN_DTYPES
    torch = sys.modules.get("torch")
    if torch is not None and _Tensor is None:
        _TOKEN_DTYPES = frozenset((torch.int64, torch.int32, torch.int16, torch.int8,
                                   torch.uint8))
        _Tensor = torch.Tensor


def _cuda_in_use() -> bool:
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available()
                    and torch.cuda.is_initialized())
    except Exception:
        return False
