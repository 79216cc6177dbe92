"""``compute_time``: the seconds a rank worked in a step, without the time it waited for peers.

In synchronous data-parallel training every rank's ``step_time`` is about equal: a fast rank
finishes its backward pass early and then waits inside the gradient all-reduce until the slowest
rank has caught up. The step time therefore cannot tell a straggler apart; the time each rank
spent *before* it had to wait can. The collector reports

    compute_time = step_time - blocked

where ``blocked`` is the time this rank's training thread was waiting on collectives in the
step, measured in one (or both) of two ways:

* **DDP communication hook** (``tg.watch_ddp(model)``, :class:`DDPWaitTimer`). DDP calls its
  comm hook on the autograd thread as soon as a gradient bucket is ready and launches the
  all-reduce asynchronously; local backward compute goes on, and only at the end of backward
  does DDP block until every bucket's future has completed. When the hook for the *last*
  bucket (``bucket.is_last()``) returns, this rank has computed all its gradients: from then
  on it only waits. The timer wraps the real hook (the default all-reduce, or the user's own)
  and chains a callback on each future; a *sync round* is complete when the last bucket has
  been launched and every future of the round has completed, and it adds

      blocked += max(future completion times) - (time the last bucket's hook returned)

  The slow rank reaches its last bucket late and waits only for the transfer itself; a fast
  rank reaches it early and waits for the slow one, so its ``compute_time`` is smaller.
  Gradient accumulation under ``no_sync()`` runs no hooks and therefore adds nothing.
* **Marked collectives**: time inside ``tg.phase("collective")`` counts as blocked. Use it for
  explicit ``all_reduce``/``barrier`` calls; do not wrap a DDP ``backward()`` in it when the
  model is watched, or the wait would be counted twice (the result is clamped at 0).

When neither is in use and the job has more than one rank, ``compute_time`` is null: the
collector does not know how much of the step was waiting. In a one-rank job it equals
``step_time``.

Limits: the hook measures what the *host* sees. With gloo on CPU that is the real wait. With
NCCL on GPUs the futures complete when the kernels are enqueued, not when the data has
arrived, so the host-side wait is near zero; there, CUDA events around the all-reduce are the
right method and are not implemented yet. DDP's forward-time buffer broadcast
(``broadcast_buffers=True`` with buffers such as BatchNorm statistics) is a blocking
collective the hook does not see.

>>> compute_time(0.5, 0.2)
0.3
>>> compute_time(0.5, 0.7)   # double-counted waits are clamped
0.0
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

__all__ = ["compute_time", "DDPWaitTimer"]


def compute_time(step_time: float, blocked: float) -> float:
    """Seconds worked in a step of ``step_time`` seconds of which ``blocked`` were waiting."""
    return round(max(0.0, step_time - blocked), 9)


class DDPWaitTimer:
    """A DDP communication hook that measures the time blocked on gradient synchronization.

    ``hook``/``state`` are the hook to wrap and its state (default: the averaging all-reduce
    DDP does without a hook, on ``state`` as process group, else the default group).
    ``blocked`` only grows; the collector reads it at the start and end of each step.
    Thread-safe: futures complete on the process group's threads.

    A fake bucket and an already completed future show the bookkeeping:

    >>> import torch
    >>> class Bucket:
    ...     def is_last(self): return True
    >>> ticks = iter([10.0, 10.5])   # the last bucket's hook returns at 10.0, done at 10.5
    >>> def done_hook(state, bucket):
    ...     fut = torch.futures.Future(); fut.set_result(torch.zeros(1)); return fut
    >>> timer = DDPWaitTimer(hook=done_hook, clock=lambda: next(ticks))
    >>> _ = timer(None, Bucket()).wait()
    >>> timer.blocked, timer.rounds
    (0.5, 1)
    """

    def __init__(self, hook: Callable | None = None, state: Any = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.hook = hook
        self.state = state
        self.clock = clock
        self.blocked = 0.0
        self.rounds = 0
        self._lock = threading.Lock()
        self._outstanding = 0
        self._last_ready: float | None = None
        self._last_done = 0.0
        self._sizes: dict = {}
        self._world = None

    def attach(self, model) -> "DDPWaitTimer":
        """Register on a ``DistributedDataParallel`` model (DDP accepts one hook per model)."""
        model.register_comm_hook(self.state, self.__call__)
        return self

    def __call__(self, state, bucket):
        hook = self.hook
        if hook is None:  # DDP's own all-reduce (average), with one callback instead of two
            group = state if state is not None else (self._world or self._load_world())
            size = self._sizes.get(group)
            if size is None:
                size = self._sizes[group] = group.size()
            tensor = bucket.buffer()
            tensor.div_(size)
            fut = group.allreduce([tensor]).get_future()
        else:
            fut = hook(state, bucket)
        now = self.clock()
        with self._lock:
            self._outstanding += 1
            if bucket.is_last():
                self._last_ready = now
        return fut.then(self._done)

    def _load_world(self):
        import torch.distributed as dist

        self._world = dist.group.WORLD
        return self._world

    def _done(self, fut):
        now = self.clock()
        with self._lock:
            self._outstanding -= 1
            if now > self._last_done:
                self._last_done = now
            if self._outstanding == 0 and self._last_ready is not None:
                self.blocked += max(0.0, self._last_done - self._last_ready)
                self.rounds += 1
                self._last_ready = None
                self._last_done = 0.0
        value = fut.value()
        return value[0] if type(value) is list else value
