"""The training-side API of SPEC §5: ``tg = trainguard.init(job=...)``, ``tg.step``,
``tg.phase``, ``tg.close``.

::

    tg = trainguard.init(job="llama-70b-run3", topology={"tp": 8, "pp": 4, "dp": 16})
    tg.watch_ddp(model)                      # optional: compute_time for DDP, see timing.py
    for step in range(start, total):
        with tg.step(step) as s:
            with tg.phase("data"):
                batch = next(loader)
            with tg.phase("forward"):
                loss = model(batch)
            ...
            s.report(loss=loss, grad_norm=gn, tokens=n, lr=lr)
    tg.close()

What it sends to ``config.topics.telemetry``, keyed ``<job>/<rank>``: a lifecycle ``start``
(pid, world size, local rank, topology, argv) at init; one ``step`` event per step with its
``step_time``, ``compute_time`` (:mod:`trainguard.collectors.timing`) and the reported values;
a ``heartbeat`` about every ``heartbeat_interval`` seconds from a daemon thread, also while the
loop is stuck (current phase, ``phase_since``, last completed step, ``dropped``); and a
lifecycle ``exit`` from :meth:`Collector.close`, at interpreter exit or on SIGTERM
(:mod:`trainguard.collectors.shutdown`).

Phases: ``init`` until the first step, ``step`` inside a step outside any ``tg.phase``,
``idle`` between steps, else the innermost ``tg.phase(name)`` (SPEC names or your own; a phase
around steps, e.g. ``eval``, shows between them).
Phases and steps belong to the training thread.

**Reported values** may be floats, ints or 0-d tensors. A tensor is read with ``.item()``,
which for a CUDA tensor copies it to the host and so waits for all GPU work queued before it
(a device synchronization that stops the CPU from running ahead; typically the length of the
queued kernels, often milliseconds). With ``report_every=N`` values are read and sent only on
steps divisible by N (``s.report`` returns at once on other steps, reading nothing but a
``tokens`` count given as a plain ``int``); the step timings are still sent every step, as
they need no synchronization. Pass values you have
already synchronized (``loss.item()`` you print anyway) to add no cost at all.

The hot path (``step``, ``phase``, ``report``) does no I/O and no encoding: it appends a tuple
to the producer's bounded queue; the background thread encodes and sends
(:mod:`trainguard.collectors.producer`).

Errors: ``init`` never raises or blocks because Kafka is unreachable or its settings (bootstrap,
prefix, client config file) are unusable: it logs a warning and drops events. Wrong arguments
about the job are programming errors and raise :class:`CollectorError` (a ``ValueError``): a
job id that is not 1-128 characters of ``[A-Za-z0-9._-]``, a rank outside the world size, a bad
topology, a negative step, an empty phase name.

A collector on a stand-in producer (``init`` builds the real one and starts the threads):

>>> from trainguard import events as ev
>>> class Sink:
...     dropped = 0
...     def __init__(self): self.records = []
...     def produce(self, record, key=None): self.records.append(record)
>>> tg = Collector(CollectorSettings(job="j1", rank=3, world_size=4, node="n1"), Sink())
>>> with tg.step(7) as s:
...     with tg.phase("collective"):
...         pass
...     s.report(loss=2.5, tokens=4096)
>>> event = ev.decode(tg.encode(tg.producer.records[-1]))
>>> event.type, event.rank, event.step, event.loss, event.tokens
('step', 3, 7, 2.5, 4096)
>>> 0 <= event.compute_time <= event.step_time   # time in "collective" is not compute
True
"""
from __future__ import annotations

import logging
import os
import signal as _signal
import sys
import threading
import time
from operator import index as _index
from typing import Callable

from trainguard import events as ev
from trainguard.config import Config, ConfigError, Topics

from .nodename import node_name
from .producer import BackgroundProducer
from .registry import Registry, default_runtime_dir
from .settings import CollectorConfig, CollectorError, CollectorSettings, env_int
from .shutdown import ExitHooks
from .timing import DDPWaitTimer
from .wire import RecordEncoder

__all__ = ["init", "Collector", "CollectorSettings", "CollectorError", "StepContext"]

log = logging.getLogger(__name__)

_STEP, _HEARTBEAT = 1, 2
_ACTIVE: "Collector | None" = None


def _scalar(value):
    """A reported value as a Python number; tensors via ``.item()`` (syncs a CUDA tensor)."""
    if value is None or type(value) is float or type(value) is int:
        return value
    item = getattr(value, "item", None)
    try:
        return item() if item is not None else float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


class StepContext:
    """``with tg.step(n) as s:`` — times the step; ``s.report(...)`` attaches values."""

    __slots__ = ("_collector", "step", "_report", "_values", "_t0", "_blocked0", "_marked0",
                 "_outer")

    def __init__(self, collector: "Collector", step: int):
        if type(step) is not int:
            step = _index(step)
        if step < 0:
            raise CollectorError(f"step must be >= 0, got {step}")
        self._collector = collector
        self.step = step
        self._report = step % collector._report_every == 0
        self._values = None

    def __enter__(self) -> "StepContext":
        c = self._collector
        c.explicit = True  # an integration watching the same process stands down
        outer = c._phase_state  # a user phase around the step comes back after it
        self._outer = None if outer[0] in ("init", "idle") else outer
        c._phase_state = ("step", c.clock())
        blocked = c._collective_time
        for timer in c._ddp_timers:
            blocked += timer.blocked
        self._blocked0 = blocked
        self._marked0 = c._collectives
        self._t0 = c.perf_clock()
        return self

    def report(self, loss=None, grad_norm=None, tokens=None, loss_scale=None, lr=None,
               **extra) -> None:
        """Values of this step (floats, ints, 0-d tensors; extra names become extra fields).

        Only read on report steps (``step % report_every == 0``); later calls in the same step
        update earlier ones. On the other steps only ``tokens`` given as a plain ``int`` is
        kept (it costs no device read): the job's throughput is judged per token on every
        step, not only on report steps.
        """
        if not self._report:
            if type(tokens) is int:
                values = (None, None, tokens, None, None, None)
                self._values = values if self._values is None else _merge(self._values, values)
            return
        _f, _i = float, int
        if loss is not None and type(loss) is not _f:
            loss = _scalar(loss)
        if grad_norm is not None and type(grad_norm) is not _f:
            grad_norm = _scalar(grad_norm)
        if tokens is not None and type(tokens) is not _i:
            tokens = _scalar(tokens)
        if loss_scale is not None and type(loss_scale) is not _f:
            loss_scale = _scalar(loss_scale)
        if lr is not None and type(lr) is not _f:
            lr = _scalar(lr)
        if extra:
            extra = {k: v if isinstance(v, (str, list, dict)) else _scalar(v)
                     for k, v in extra.items()}
        values = (loss, grad_norm, tokens, loss_scale, lr, extra or None)
        if self._values is not None:  # a second report in the step: keep what it lacks
            values = _merge(self._values, values)
        self._values = values

    def __exit__(self, exc_type, exc, tb) -> bool:
        c = self._collector
        t1 = c.perf_clock()
        now = c.clock()
        c._phase_state = self._outer or ("idle", now)
        if exc_type is not None:
            return False
        step_time = t1 - self._t0
        compute = None
        if c._ddp_timers or c._collectives != self._marked0 or c._single:
            compute = step_time - (c._blocked() - self._blocked0)
            compute = compute if compute > 0.0 else 0.0
            if c._uncomputed and c._uncomputed < _SAY_UNCOMPUTED_AFTER:
                c._uncomputed = 0         # steps in a row
        elif c._uncomputed < _SAY_UNCOMPUTED_AFTER:
            c._uncomputed += 1
            if c._uncomputed == _SAY_UNCOMPUTED_AFTER and c.settings.rank == 0:
                log.warning(_UNCOMPUTED, c.settings.job, _SAY_UNCOMPUTED_AFTER)
        c.last_step = self.step
        c.producer.produce((_STEP, now, self.step, step_time, compute, self._values), c._key)
        return False


#: steps without a compute time before rank 0 says what that blinds (watch_ddp may come
#: after the first step)
_SAY_UNCOMPUTED_AFTER = 3
_UNCOMPUTED = ("trainguard: job %s: %d steps without a compute time (time in collectives is "
               "measured by tg.watch_ddp(model), or by tg.phase(\"collective\") around them): "
               "a slow rank cannot be told from its peers, whose steps wait for it in the "
               "all-reduce, so stragglers go unnamed")


class PhaseContext:
    """``with tg.phase(name):`` — the heartbeat shows ``name`` (and since when) meanwhile."""

    __slots__ = ("_collector", "name", "_prev", "_t0")

    def __init__(self, collector: "Collector", name: str):
        if type(name) is not str or not 0 < len(name) <= 64:
            raise CollectorError(f"phase name must be a string of 1-64 characters, got {name!r}")
        self._collector = collector
        self.name = name

    def __enter__(self) -> "PhaseContext":
        c = self._collector
        self._prev = c._phase_state
        c._phase_state = (self.name, c.clock())
        if self.name == "collective":
            self._t0 = c.perf_clock()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        c = self._collector
        if self.name == "collective":
            c._collective_time += c.perf_clock() - self._t0
            c._collectives += 1
        c._phase_state = self._prev
        return False


class Collector:
    """One rank's collector. Build it with :func:`init`; the constructor only configures."""

    def __init__(self, settings: CollectorSettings, producer: BackgroundProducer, *,
                 registry: Registry | None = None, clock: Callable[[], float] = time.time,
                 perf_clock: Callable[[], float] = time.perf_counter,
                 handle_signals: bool = True, stack_signal: int | None = None,
                 flush_timeout: float = 3.0):
        self.settings = settings
        self.producer = producer
        self.registry = registry
        self.clock = clock
        self.perf_clock = perf_clock
        self.handle_signals = handle_signals
        self.stack_signal = stack_signal
        self.flush_timeout = flush_timeout
        self.last_step: int | None = None
        self.closed = False
        self.pid = os.getpid()
        self._key = f"{settings.job}/{settings.rank}".encode()
        self._report_every = settings.report_every
        self._single = settings.world_size == 1
        self._phase_state = ("init", clock())
        self._ddp_timers: tuple = ()
        self._collective_time = 0.0
        self._collectives = 0
        self._stop = threading.Event()
        self._close_lock = threading.RLock()
        self._hooks: ExitHooks | None = None
        self._heartbeat_thread: threading.Thread | None = None
        self._dumper = None
        self._encoder = RecordEncoder(job=settings.job, node=settings.node, rank=settings.rank)
        self.explicit = False  # the script called tg.step itself
        self.implicit = False  # started by trainguard.integrations, not by the script
        self.before_close: list[Callable[[], None]] = []
        self._said_back = False   # step numbers went back (_went_back)
        self._uncomputed = 0      # steps without a compute time, up to _SAY_UNCOMPUTED_AFTER

    # -- the training loop ------------------------------------------------------------------
    def step(self, step: int) -> StepContext:
        """Context manager around one training step; yields the object with ``report``."""
        context = StepContext(self, step)
        last = self.last_step
        if last is not None and context.step < last and not self._said_back \
                and self.settings.rank == 0:
            self._went_back(last, context.step)
        return context

    def _went_back(self, last: int, step: int) -> None:
        """Said once, by rank 0 (its peers count alike): step numbers given to ``tg.step``
        that start again from a lower one (a loop over ``enumerate(loader)`` per epoch) leave
        most of the job's checks blind."""
        self._said_back = True
        s = self.settings
        log.warning("trainguard: rank %s of job %s: the step number went back from %d to %d "
                    "in the same process. trainguard matches the ranks' steps by number and "
                    "takes a step it has seen already as a late record, so stragglers, loss "
                    "spikes and slowdowns go unseen until the numbers pass %d again: give "
                    "tg.step a number that counts up across epochs (the global step)",
                    s.rank, s.job, last, step, last)

    def phase(self, name: str) -> PhaseContext:
        """Context manager marking what the loop is doing (shown by heartbeats)."""
        return PhaseContext(self, name)

    def watch_ddp(self, model, hook: Callable | None = None, state=None) -> DDPWaitTimer:
        """Measure the gradient all-reduce wait of a ``DistributedDataParallel`` model.

        Registers a comm hook wrapping ``hook`` (default: the averaging all-reduce DDP does
        without a hook) with its ``state``; DDP allows one hook per model, so pass
        your own hook here instead of registering it yourself. A later collector in the same
        process (after ``close``) reuses the hook already on the model.
        """
        timer = getattr(model, "_trainguard_wait_timer", None)
        if timer is None:  # DDP takes one hook per model: a later collector reuses it
            timer = DDPWaitTimer(hook=hook, state=state, clock=self.perf_clock).attach(model)
            model._trainguard_wait_timer = timer
        if timer not in self._ddp_timers:
            self._ddp_timers = (*self._ddp_timers, timer)
        return timer

    def set_phase(self, name: str, since: float | None = None) -> tuple[str, float]:
        """Show ``name`` in heartbeats from now (integrations); returns the previous phase."""
        previous = self._phase_state
        self._phase_state = (name, self.clock() if since is None else since)
        return previous

    def restore_phase(self, previous: tuple[str, float]) -> None:
        self._phase_state = previous

    def emit_step(self, step: int, step_time: float, compute_time: float | None,
                  loss=None, grad_norm=None, tokens=None, loss_scale=None, lr=None,
                  ts: float | None = None) -> None:
        """Queue one ``step`` event measured by an integration (plain numbers or None)."""
        if loss is None and grad_norm is None and tokens is None and loss_scale is None \
                and lr is None:
            values = None
        else:
            values = (loss, grad_norm, tokens, loss_scale, lr, None)
        self.last_step = step
        self.producer.produce((_STEP, self.clock() if ts is None else ts, step, step_time,
                               compute_time, values), self._key)

    @property
    def dropped(self) -> int:
        return self.producer.dropped

    @property
    def phase_now(self) -> tuple[str, float]:
        """(current phase, Unix time it began)."""
        return self._phase_state

    def background_thread_ids(self) -> list[int]:
        """Native ids of the collector's own threads (heartbeat, producer), for accounting."""
        threads = (self._heartbeat_thread, self.producer._thread)
        return [t.native_id for t in threads
                if isinstance(t, threading.Thread) and t.native_id is not None]

    def _blocked(self) -> float:
        blocked = self._collective_time
        for timer in self._ddp_timers:
            blocked += timer.blocked
        return blocked

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> "Collector":
        """Register the rank, send lifecycle ``start``, start the heartbeat and exit hooks."""
        s = self.settings
        self.pid = os.getpid()
        if getattr(self.producer, "encode", None) is None:
            self.producer.encode = self.encode
        main = threading.current_thread() is threading.main_thread()
        if self.stack_signal is not None and main and self.registry is not None:
            self._dumper = _install_stack_handler(self.registry.runtime_dir, self.stack_signal)
        if self.registry is not None:
            try:
                self.registry.register({
                    "job": s.job, "rank": s.rank, "local_rank": s.local_rank, "pid": self.pid,
                    "world_size": s.world_size, "node": s.node, "start_time": self.clock(),
                    "argv": s.argv, "stack_signal": self.stack_signal if self._dumper else None})
            except OSError as exc:
                log.warning("trainguard: cannot write the rank registry in %s: %s",
                            self.registry.runtime_dir, exc)
        self.producer.produce(ev.encode(ev.Lifecycle(
            job=s.job, ts=self.clock(), node=s.node, rank=s.rank, event="start", pid=self.pid,
            world_size=s.world_size, local_rank=s.local_rank, topology=s.topology,
            argv=s.argv)), self._key)
        self._heartbeat_thread = threading.Thread(
            target=self._heartbeat_loop, name="trainguard-heartbeat", daemon=True)
        self._heartbeat_thread.start()
        self._hooks = ExitHooks(self._on_exit, hold_limit=self.flush_timeout + 2.0,
                                handle_signals=self.handle_signals).install()
        return self

    def close(self, exit_code: int | None = 0, signal: str | None = None,
              timeout: float | None = None) -> None:
        """Send lifecycle ``exit`` and flush for at most ``timeout`` s (default 3); idempotent."""
        if not self._close_lock.acquire(timeout=(timeout or self.flush_timeout) + 2.0):
            return
        try:
            if self.closed or os.getpid() != self.pid:
                return
            if self._hooks is not None:        # a SIGTERM meanwhile waits for the flush
                with self._hooks.holding():
                    self._close(exit_code, signal, timeout)
            else:
                self._close(exit_code, signal, timeout)
        finally:
            self._close_lock.release()
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None

    def _close(self, exit_code, signal, timeout) -> None:
        self.closed = True
        for flush in self.before_close:
            try:
                flush()
            except Exception as exc:  # an integration's last step must not stop the exit
                log.warning("trainguard: flushing before close failed: %s", exc)
        self._stop.set()
        s = self.settings
        self.producer.produce(ev.encode(ev.Lifecycle(
            job=s.job, ts=self.clock(), node=s.node, rank=s.rank, event="exit",
            exit_code=exit_code, signal=signal)), self._key)
        timeout = self.flush_timeout if timeout is None else timeout
        lost = self.producer.close(timeout)
        if lost:                              # no later heartbeat will count them
            log.warning("trainguard: rank %s of job %s: %d telemetry events were not "
                        "delivered in the %g s flush at exit; they are lost", s.rank, s.job,
                        lost, timeout)
        if self.registry is not None:
            self.registry.unregister(s.job, s.rank, self.pid)
        if threading.current_thread() is threading.main_thread():
            if self._hooks is not None:
                self._hooks.uninstall()
            if self._dumper is not None:
                self._dumper.uninstall()

    def _on_exit(self, exit_code, signal_name, timeout) -> None:
        self.close(exit_code=exit_code, signal=signal_name, timeout=timeout)

    def _heartbeat_loop(self) -> None:
        interval = self.settings.heartbeat_interval
        while not self._stop.is_set() and os.getpid() == self.pid:
            phase, since = self._phase_state
            self.producer.produce((_HEARTBEAT, self.clock(), self.last_step, phase, since,
                                   self.producer.dropped), self._key)
            self._stop.wait(interval)

    def encode(self, record) -> bytes:
        """A queued record as SPEC JSON (runs in the producer's thread)."""
        if type(record) is bytes:
            return record
        if record[0] == _STEP:
            return self._encoder.step(*record[1:])
        return self._encoder.heartbeat(record[1], self.pid, *record[2:])


def running() -> Collector | None:
    """This process's open collector, if any (started by ``init`` or an integration)."""
    c = _ACTIVE
    return c if c is not None and not c.closed and c.pid == os.getpid() else None


def _merge(old: tuple, new: tuple) -> tuple:
    merged = [n if n is not None else o for o, n in zip(old[:5], new[:5])]
    extra = {**(old[5] or {}), **(new[5] or {})}
    return (*merged, extra or None)


def _install_stack_handler(runtime_dir, signum):
    try:
        from .stack_capture import install_inproc_handler
    except ImportError:
        return None
    try:
        return install_inproc_handler(runtime_dir, signum=signum)
    except Exception as exc:  # a missing handler must not stop training
        log.warning("trainguard: in-process stack handler not installed: %s", exc)
        return None


class _Disabled:
    """The producer factory when the environment's Kafka settings are unusable."""

    def __init__(self, reason: str):
        self.reason = reason

    def __call__(self, settings):
        raise ConfigError(self.reason)


#: the defaults of the collector's settings (the ``collector`` section of the configuration)
_DEFAULTS = CollectorConfig()


def init(job: str, rank: int | None = None, local_rank: int | None = None,
         world_size: int | None = None, node: str | None = None, topology: dict | None = None,
         bootstrap: str | None = None, config: Config | None = None,
         heartbeat_interval: float = _DEFAULTS.heartbeat_interval,
         report_every: int = _DEFAULTS.report_every,
         runtime_dir: str | os.PathLike | None = None, handle_signals: bool = True,
         stack_signal: int | None = int(_signal.SIGUSR2),
         flush_timeout: float = _DEFAULTS.flush_timeout,
         max_queue_events: int = _DEFAULTS.max_queue_events,
         max_queue_bytes: int = _DEFAULTS.max_queue_bytes,
         environ=None) -> Collector:
    """Start this rank's collector (see the module docstring); returns it.

    Rank, local rank and world size come from ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``
    (torchrun) unless given; ``node`` is the scheduler's name for the machine
    (``SLURMD_NODENAME``, ``NODE_NAME``), else the host name; Kafka from ``config``, else
    ``bootstrap``/``TRAINGUARD_BOOTSTRAP``, ``TRAINGUARD_TOPIC_PREFIX`` and
    ``TRAINGUARD_KAFKA_CONFIG``. ``stack_signal`` is the signal of the in-process stack dump
    handler (None: not installed); ``handle_signals=False`` installs no SIGTERM handler.
    Calling ``init`` again in a process returns the running collector.
    """
    global _ACTIVE
    if _ACTIVE is not None and not _ACTIVE.closed and _ACTIVE.pid == os.getpid():
        if not _ACTIVE.implicit:
            log.warning("trainguard.init called twice; returning the running collector")
            return _ACTIVE
        if _ACTIVE.settings.job == job:  # the script takes over what --instrument started
            _ACTIVE.implicit = False
            return _ACTIVE
        _ACTIVE.close()  # the script's own job id wins
    environ = os.environ if environ is None else environ
    (heartbeat_interval, report_every, flush_timeout, max_queue_events,
     max_queue_bytes) = _configured(environ, heartbeat_interval=heartbeat_interval,
                                    report_every=report_every, flush_timeout=flush_timeout,
                                    max_queue_events=max_queue_events,
                                    max_queue_bytes=max_queue_bytes).values()
    env_rank = env_int(environ, "RANK")
    env_world = env_int(environ, "WORLD_SIZE")
    env_local = env_int(environ, "LOCAL_RANK")
    rank = rank if rank is not None else (env_rank if env_rank is not None else 0)
    world_size = world_size if world_size is not None else (env_world or max(1, rank + 1))
    local_rank = local_rank if local_rank is not None else env_local
    settings = CollectorSettings(
        job=job, rank=rank, local_rank=local_rank, world_size=world_size,
        node=node if node is not None else node_name(environ), topology=topology,
        heartbeat_interval=heartbeat_interval, report_every=report_every, argv=list(sys.argv))
    config, factory = _kafka_config(config, bootstrap, environ)
    producer = BackgroundProducer(
        settings=config.kafka(**{"client.id": f"trainguard-{job}-{rank}"}),
        topic=config.topics.telemetry, max_events=max_queue_events, max_bytes=max_queue_bytes,
        flush_timeout=flush_timeout,
        name=f"trainguard-producer-{rank}", producer_factory=factory)
    registry = Registry(runtime_dir if runtime_dir is not None
                        else default_runtime_dir(environ))
    collector = Collector(settings, producer, registry=registry, handle_signals=handle_signals,
                          stack_signal=stack_signal, flush_timeout=flush_timeout)
    _ACTIVE = collector.start()
    return collector


def _configured(environ, **given) -> dict:
    """``given``, where the caller left an argument at its default, from the ``collector``
    section of ``TRAINGUARD_CONFIG``; a bad file is logged, never raised."""
    path = environ.get("TRAINGUARD_CONFIG")
    if not path:
        return given
    import inspect

    from trainguard.configsections import load
    from trainguard.errors import UserError

    try:
        tree = load(path, environ, sections=("collector",))
    except UserError as exc:
        log.warning("trainguard: ignoring the collector section of %s: %s", path, exc)
        return given
    defaults = inspect.signature(init).parameters
    return {name: tree.value(f"collector.{name}") if value == defaults[name].default
            else value for name, value in given.items()}


def _kafka_config(config: Config | None, bootstrap: str | None, environ):
    """(config, producer factory); an unusable Kafka setting disables sending, never raises."""
    try:
        if config is None:
            return Config.from_env(bootstrap=bootstrap, environ=environ), None
        if bootstrap is not None:
            config = Config(bootstrap=bootstrap, topics=config.topics,
                            client_settings=config.client_settings)
        return config, None
    except ConfigError as exc:
        log.warning("trainguard: telemetry disabled: %s", exc)
        prefix = environ.get("TRAINGUARD_TOPIC_PREFIX") or "tg"
        try:
            topics = config.topics if config is not None else Topics(prefix=prefix)
        except ConfigError:
            topics = Topics()
        return Config(topics=topics), _Disabled(str(exc))
