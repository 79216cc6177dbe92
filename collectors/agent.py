"""``trainguard agent``: the node agent of one machine.

One per machine. Its duties, each in a thread of its own:

- **GPU samples**: every ``--interval`` seconds a SPEC ``gpu`` event (``rank`` null, ``node``
  this machine) from :func:`~trainguard.collectors.nvml.gpu_event_payload`, to the telemetry
  topic, with the machine's CPU and network counters from /proc as its ``host`` object
  (:class:`~trainguard.collectors.host.HostCounters`). PCIe throughput, which NVML measures
  for 20 ms a call, is read on a thread of its own every ``max(5 s, --interval)``
  (:meth:`~trainguard.collectors.nvml.PynvmlSource.start_pcie_reader`) once NVML answers.
- **Xid events**: from NVML's event set (a thread blocked in ``wait_event``) and from the
  kernel log (:class:`~trainguard.collectors.kmsg.KmsgFollower` on ``/dev/kmsg`` or ``dmesg``,
  plus one per ``--kmsg-extra`` file; PCI bus ids mapped to GPU indices through NVML), each
  published at once as a SPEC ``xid`` event to the telemetry topic.
- **Stack capture**: ``capture_stacks`` commands on the commands topic, answered with one
  ``stack`` event per local rank on the stacks topic (:mod:`.agent_commands`). With a
  signing key (``TRAINGUARD_SIGNING_KEY``) only commands signed with it are obeyed; refused
  ones go to the dead-letter topic. Captures are rate-limited per job and machine
  (``capture_limits``).

Choices:

- *Which job an event names.* ``--job J``: every ``gpu`` and ``xid`` event names J. Without
  it, one event per job that has a live rank in the local registry (``--runtime-dir``) at that
  moment; while none has, the events name the job ``node`` (:data:`IDLE_JOB`), so a machine's
  health is on the bus between jobs too (a GPU that falls off the bus before the next job
  starts is still seen). Stack capture always goes by the registry, whatever ``--job`` says.
- *No GPU* (NVML missing): one ``gpu`` event with ``status: "unavailable"`` and the reason for
  each job, then one again every 60 s (``unavailable_interval``), when NVML initialization is
  also retried; a job that appears in between gets its own at once. When NVML comes up, samples
  go every ``--interval`` and the NVML Xid thread starts waiting on the event set.
- *Kafka*: one confluent-kafka producer (the agent is not the training process, so it may
  wait a little): :data:`PRODUCER_SETTINGS`. Every event is validated against the contract
  before it is sent; an invalid one is logged and dropped. Messages are keyed ``<job>/<node>``
  (``gpu``, ``xid``) and ``<job>/<rank>`` (``stack``). An unreachable broker is not fatal: the
  agent logs it (once per 5 minutes), keeps sampling and sends when Kafka is back.
- *Shutdown*: SIGTERM or SIGINT stops the threads, shuts NVML down and flushes the producer
  for at most 5 s; exit status 0. A second signal exits at once (status 1).

Errors go to stderr as one concise line each; a bad message or a failing source never stops
the agent.
"""
from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from trainguard import events as ev
from trainguard.errors import UserError
from trainguard.signing import Freshness, Verifier

from .agent_commands import (MAX_COMMAND_AGE, CaptureRunner, CommandHandler, CommandListener,
                             KafkaLog, QuietLog)
from .capture_limits import CaptureLimiter, CaptureLimits
from .host import HostCounters
from .kmsg import KmsgFollower
from .nodename import node_name
from .nvml import NvmlUnavailable, PynvmlSource, gpu_event_payload
from .registry import Registry, default_runtime_dir

__all__ = ["main", "Agent", "GpuSampler", "Publisher", "event_jobs", "xid_events",
           "IDLE_JOB", "PRODUCER_SETTINGS"]

log = logging.getLogger(__name__)

IDLE_JOB = "node"
_JOB_RE = re.compile(ev.JOB_PATTERN)
PRODUCER_SETTINGS: dict = {
    "linger.ms": 20,                      # gpu/xid/stack volumes are small: latency first
    "compression.type": "lz4",
    "acks": "all",
    "enable.idempotence": True,           # a broker's death neither loses nor doubles one
    "message.timeout.ms": 30000,          # a sample older than 30 s is not worth sending
    "message.max.bytes": 1000000,
    "queue.buffering.max.messages": 100000,
    "socket.connection.setup.timeout.ms": 3000,
    "reconnect.backoff.ms": 100,
    "reconnect.backoff.max.ms": 2000,
    "partitioner": "murmur2_random",      # the Java client's: same key, same partition
}


def event_jobs(job: Optional[str], entries: Iterable[dict]) -> list:
    """The jobs a node event is published for (see the module docstring).

    >>> event_jobs(None, [{"job": "b"}, {"job": "a"}, {"job": "a"}, {"job": "bad job!"}])
    ['a', 'b']
    >>> event_jobs(None, []), event_jobs("j1", [{"job": "a"}])
    (['node'], ['j1'])
    """
    if job is not None:
        return [job]
    jobs = sorted({e.get("job") for e in entries
                   if isinstance(e.get("job"), str) and _JOB_RE.fullmatch(e["job"])})
    return jobs or [IDLE_JOB]


def xid_events(payload: dict, jobs: Iterable[str], node: str, ts: float) -> list:
    """SPEC ``xid`` events, one per job, from an Xid payload (``gpu``, ``xid``, ``source``,
    ``message``).

    >>> [e.to_dict()["xid"] for e in xid_events(
    ...     {"gpu": 3, "xid": 79, "source": "kmsg", "message": "fell off"}, ["j1"], "n1", 5.0)]
    [79]
    """
    return [ev.Xid(job=j, ts=ts, node=node, rank=None, gpu=payload.get("gpu"),
                   xid=int(payload["xid"]), source=payload["source"],
                   message=str(payload.get("message") or "")) for j in jobs]


class GpuSampler:
    """Turns NVML samples into SPEC ``gpu`` events for the jobs of the moment.

    ``tick(jobs, now)`` returns the events to send now. While NVML is unavailable, each job
    gets the ``unavailable`` event once, and every job again each ``unavailable_interval``
    seconds, when NVML is asked again. ``on_available()`` is called when NVML first answers.
    ``host()`` (optional; e.g. :meth:`HostCounters.sample`) is called once per sample and its
    dict is every event's ``host`` object (not on ``unavailable`` events).

    >>> class NoGpu:
    ...     def sample(self): raise NvmlUnavailable("NVML is unavailable: no driver.")
    >>> s = GpuSampler(NoGpu(), node="n1", unavailable_interval=60.0)
    >>> [(e.job, e.status) for e in s.tick(["j1"], now=100.0)]
    [('j1', 'unavailable')]
    >>> s.tick(["j1"], now=101.0), [e.job for e in s.tick(["j1", "j2"], now=102.0)]
    ([], ['j2'])
    >>> [e.job for e in s.tick(["j1", "j2"], now=160.0)]
    ['j1', 'j2']
    """

    def __init__(self, source: Any, *, node: str, unavailable_interval: float = 60.0,
                 on_available: Optional[Callable[[], None]] = None,
                 on_error: Optional[Callable[[], None]] = None,
                 host: Optional[Callable[[], Optional[dict]]] = None):
        self.source = source
        self.host = host
        self._host_failed = False
        self.on_error = on_error
        self.node = node
        self.unavailable_interval = unavailable_interval
        self.on_available = on_available
        self.available = False
        self._down: Optional[dict] = None
        self._retry_at = 0.0
        self._told: set = set()

    def _payload(self) -> dict:
        try:
            return gpu_event_payload(self.source)
        except Exception as exc:  # a bug or an odd driver: report it, keep going
            return {"gpus": [], "status": "unavailable",
                    "reason": f"NVML sampling failed: {type(exc).__name__}: {exc}"}

    def _event(self, job: str, now: float, payload: dict) -> ev.Gpu:
        return ev.Gpu(job=job, ts=now, node=self.node, rank=None, gpus=payload["gpus"],
                      status=payload.get("status"), reason=payload.get("reason"),
                      host=payload.get("host"))

    def _host(self) -> Optional[dict]:
        try:
            return self.host() if self.host is not None else None
        except Exception as exc:  # a bug: say so once, send the GPU sample without it
            if not self._host_failed:
                self._host_failed = True
                log.warning("host counters failed: %s: %s", type(exc).__name__, exc)
            return None

    def tick(self, jobs: list, now: float) -> list:
        if self._down is None or now >= self._retry_at:
            payload = self._payload()
            if payload.get("status") == "unavailable" and self.on_error is not None:
                self.on_error()
            if payload.get("status") != "unavailable":
                if not self.available:
                    if self._down is not None:
                        log.warning("NVML answers again: GPU samples resume")
                    self.available = True
                    if self.on_available is not None:
                        self.on_available()
                self._down = None
                host = self._host()
                if host:
                    payload = {**payload, "host": host}
                return [self._event(j, now, payload) for j in jobs]
            if self._down is None or payload.get("reason") != self._down.get("reason"):
                log.warning("GPU samples unavailable: %s (retrying every %gs)",
                            payload.get("reason"), self.unavailable_interval)
            self.available = False
            self._down, self._retry_at, self._told = payload, now + self.unavailable_interval, set()
        due = [j for j in jobs if j not in self._told]
        self._told.update(due)
        return [self._event(j, now, self._down) for j in due]


class Publisher:
    """One confluent-kafka producer shared by the agent's threads, with a poll thread.
    ``send`` validates the event against the contract, then queues it; never raises."""

    def __init__(self, settings: dict, *, poll_interval: float = 0.2,
                 producer_factory: Optional[Callable] = None):
        self.settings = settings
        self.poll_interval = poll_interval
        self.producer_factory = producer_factory
        self.sent = 0
        self.failed = 0
        self._client = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._quiet = QuietLog(log)

    def start(self) -> "Publisher":
        settings = {**PRODUCER_SETTINGS, **self.settings, "error_cb": self._on_error,
                    "on_delivery": self._on_delivery, "logger": KafkaLog()}
        if self.producer_factory is not None:
            self._client = self.producer_factory(settings)
        else:
            from confluent_kafka import Producer

            self._client = Producer(settings)
        self._thread = threading.Thread(target=self._poll, name="trainguard-agent-poll",
                                        daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                self._client.poll(self.poll_interval)
            except Exception as exc:
                self._quiet.warn("poll", "Kafka producer: %s", exc)
                self._stop.wait(self.poll_interval)

    def _on_error(self, err) -> None:
        self._quiet.warn("kafka", "Kafka at %s: %s (events wait, and are dropped after 30 s)",
                         self.settings.get("bootstrap.servers"), err.str())

    def _on_delivery(self, err, msg) -> None:
        if err is not None:
            self.failed += 1
            self._quiet.warn(("delivery", err.code()), "event to %s not delivered: %s",
                             msg.topic(), err.str())

    def send(self, topic: str, event: ev.Event, key: bytes) -> bool:
        try:
            raw = ev.encode(event)
            ev.decode(raw)
        except (ev.InvalidEvent, ValueError, TypeError) as exc:
            log.error("not sending an invalid %s event: %s", event.type, str(exc)[:200])
            return False
        for attempt in range(2):
            try:
                self._client.produce(topic, raw, key)
                self.sent += 1
                return True
            except BufferError:
                if attempt == 0:
                    self._client.poll(0.5)
            except Exception as exc:
                self._quiet.warn(("produce", type(exc).__name__), "cannot send to %s: %s",
                                 topic, exc)
                return False
        self._quiet.warn("full", "Kafka producer queue full: dropping %s events", event.type)
        return False

    def send_record(self, topic: str, value: bytes, key: Optional[bytes]) -> bool:
        """A value that is not an event (a dead-letter record)."""
        try:
            self._client.produce(topic, value, key)
            return True
        except Exception as exc:
            self._quiet.warn(("produce", type(exc).__name__), "cannot send to %s: %s", topic, exc)
            return False

    def close(self, timeout: float = 5.0) -> int:
        """Stop polling and flush for at most ``timeout`` s; returns how many were left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.poll_interval + 1.0)
        if self._client is None:
            return 0
        try:
            left = self._client.flush(timeout)
        except Exception as exc:
            log.warning("Kafka flush failed: %s", exc)
            return -1
        if left:
            log.warning("%d events not delivered at shutdown", left)
        return left


class _NoKernelSource(logging.Filter):
    """Hides the 'no source configured' warning of the followers that tail only a file."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "no source configured" not in record.getMessage()


class Agent:
    """The node agent; configuration in the constructor, all effects in :meth:`run`.

    ``source`` is an :class:`~trainguard.collectors.nvml.NvmlSource`; ``kmsg_path`` and
    ``dmesg_argv`` are the kernel-log sources of the first follower (None/[] for none);
    ``proc_root`` the folder whose ``proc/`` the host counters are read from.
    """

    def __init__(self, *, config, node: str, job: Optional[str] = None, interval: float = 1.0,
                 runtime_dir: os.PathLike, kmsg_extra: Iterable[str] = (), native: bool = False,
                 source: Any = None, kmsg_path: Optional[str] = "/dev/kmsg",
                 dmesg_argv: Optional[list] = None, unavailable_interval: float = 60.0,
                 capture_timeout: float = 10.0, flush_timeout: float = 5.0,
                 clock: Callable[[], float] = time.time, keys=None,
                 capture_limits: CaptureLimits = CaptureLimits(),
                 proc_root: "str | os.PathLike" = "/", snapshots=None):
        self.config = config
        self.snapshots = snapshots  # a snapshot_store.SnapshotStore (--snapshot-dir) or None
        self.node = node
        self.job = job
        self.interval = interval
        self.runtime_dir = Path(runtime_dir)
        self.kmsg_extra = list(kmsg_extra)
        self.native = native
        self.source = source if source is not None else PynvmlSource()
        self.kmsg_path = kmsg_path
        self.dmesg_argv = dmesg_argv
        self.unavailable_interval = unavailable_interval
        self.capture_timeout = capture_timeout
        self.flush_timeout = flush_timeout
        self.clock = clock
        self.keys = keys
        self.capture_limits = capture_limits
        self.host = HostCounters(proc_root)
        self.registry = Registry(self.runtime_dir)
        self.topics = config.topics
        self.publisher: Optional[Publisher] = None
        self._runner: Optional[CaptureRunner] = None
        self._followers: list = []
        self._nvml_ready = threading.Event()
        from trainguard.service_metrics import AgentMetrics

        self.metrics = AgentMetrics()

    # -- helpers ---------------------------------------------------------------------------
    def entries(self) -> list:
        try:
            return self.registry.entries()
        except OSError as exc:
            log.warning("cannot read the rank registry in %s: %s", self.runtime_dir, exc)
            return []

    def jobs(self) -> list:
        return event_jobs(self.job, self.entries() if self.job is None else ())

    def publish_xid(self, payload: dict) -> None:
        self.metrics.xid(payload)
        for event in xid_events(payload, self.jobs(), self.node, self.clock()):
            log.info("Xid %d on GPU %s (%s): %s", event.xid, event.gpu, event.source,
                     event.message[:120])
            self.publisher.send(self.topics.telemetry, event, f"{event.job}/{self.node}".encode())

    def deadletter(self, value, reason: str, msg=None) -> None:
        from trainguard.deadletter import deadletter_record

        key = msg.key() if msg is not None else None
        record = deadletter_record(
            reason=reason, topic=msg.topic() if msg is not None else self.topics.commands,
            partition=msg.partition() if msg is not None else -1,
            offset=msg.offset() if msg is not None else -1, key=key, raw=value,
            ts=self.clock())
        self.publisher.send_record(self.topics.deadletter, record, key)

    def publish_stack(self, event: ev.Stack) -> None:
        self.metrics.stack(event)
        self.publisher.send(self.topics.stacks, event, f"{event.job}/{event.rank}".encode())

    def _nvml_up(self) -> None:
        try:
            bus_map = self.source.bus_id_map()
        except Exception as exc:
            log.warning("no PCI bus id map from NVML (%s): kernel-log Xids carry no GPU index",
                        exc)
            bus_map = {}
        for follower in self._followers:
            follower.set_bus_id_map(bus_map)
        start_pcie = getattr(self.source, "start_pcie_reader", None)
        if start_pcie is not None:
            try:
                start_pcie(max(5.0, self.interval))
            except Exception as exc:
                log.warning("PCIe throughput reader not started (%s): read with each sample",
                            exc)
        self._nvml_ready.set()

    # -- threads ---------------------------------------------------------------------------
    def _nvml_events(self, stop: threading.Event) -> None:
        quiet = QuietLog(log)
        while not stop.is_set():
            if not self._nvml_ready.wait(0.5):
                continue
            try:
                payload = self.source.wait_event(1000)
            except NvmlUnavailable:
                self.metrics.nvml_error("wait_event")
                self._nvml_ready.clear()  # the sampler sets it again when NVML is back
                continue
            except Exception as exc:
                self.metrics.nvml_error("wait_event")
                quiet.warn(type(exc).__name__, "NVML event wait failed: %s", exc)
                stop.wait(1.0)
                continue
            if payload is not None and not stop.is_set():
                self.publish_xid(payload)

    def _start_followers(self) -> None:
        def on_record(record) -> None:
            self.publish_xid(record.to_payload())

        extras = self.kmsg_extra or [None]
        first = KmsgFollower(on_record, kmsg_path=self.kmsg_path, dmesg_argv=self.dmesg_argv,
                             extra_source=extras[0])
        first.start()
        if first.available:
            log.info("following the kernel log (%s)", first.kernel_source)
        self._followers.append(first)
        kmsg_log = logging.getLogger("trainguard.collectors.kmsg")
        quiet = _NoKernelSource()
        kmsg_log.addFilter(quiet)
        try:
            for path in extras[1:]:
                self._followers.append(KmsgFollower(on_record, kmsg_path=None, dmesg_argv=[],
                                                    extra_source=path).start())
        finally:
            kmsg_log.removeFilter(quiet)
        if self.kmsg_extra:
            log.info("following %s", ", ".join(self.kmsg_extra))

    def _command_listener(self) -> CommandListener:
        runner = CaptureRunner(self.publish_stack, node=self.node, runtime_dir=self.runtime_dir,
                               native=self.native, timeout=self.capture_timeout,
                               clock=self.clock).start()
        self._runner = runner
        handler = CommandHandler(
            node=self.node, entries=self.entries, runner=runner, clock=self.clock,
            verifier=Verifier(self.keys, freshness=Freshness(max_age_s=MAX_COMMAND_AGE),
                              clock=self.clock),
            limiter=CaptureLimiter(self.capture_limits), deadletter=self.deadletter)
        settings = self.config.kafka(**{
            "group.id": f"trainguard-agent-{self.topics.prefix}-{self.node}",
            "client.id": f"trainguard-agent-{self.node}"})
        return CommandListener(settings=settings, topic=self.topics.commands, handler=handler)

    def _spawn(self, target, name: str, *args) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        return thread

    # -- main loop -------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> int:
        """Run until ``stop`` is set; returns the exit status."""
        try:
            self.publisher = Publisher(self.config.kafka(
                **{"client.id": f"trainguard-agent-{self.node}"})).start()
            self.metrics.publisher = self.publisher
        except Exception as exc:  # e.g. a bad setting in --kafka-config
            raise UserError(f"cannot create a Kafka producer for {self.config.bootstrap}: "
                            f"{exc}; check --bootstrap and --kafka-config") from None
        threads: list = []
        try:
            if self.snapshots is not None:
                self.snapshots.start()
            sampler = GpuSampler(self.source, node=self.node,
                                 unavailable_interval=self.unavailable_interval,
                                 on_available=self._nvml_up,
                                 on_error=lambda: self.metrics.nvml_error("sample"),
                                 host=self.host.sample)
            self._start_followers()
            listener = self._command_listener()
            threads = [self._spawn(self._nvml_events, "trainguard-nvml-events", stop),
                       self._spawn(listener.run, "trainguard-commands", stop)]
            log.info("node %s: GPU samples every %gs to %s; stacks to %s; registry %s",
                     self.node, self.interval, self.topics.telemetry, self.topics.stacks,
                     self.runtime_dir)
            self._sample_loop(sampler, stop)
        finally:
            stop.set()
            self._shutdown(threads)
        return 0

    def _sample_loop(self, sampler: GpuSampler, stop: threading.Event) -> None:
        next_at = time.monotonic()
        while not stop.is_set():
            try:
                events = sampler.tick(self.jobs(), self.clock())
                self.metrics.gpu_events(events)
                for event in events:
                    self.publisher.send(self.topics.telemetry, event,
                                        f"{event.job}/{self.node}".encode())
            except Exception:
                log.exception("GPU sample failed")
            next_at += self.interval
            wait = next_at - time.monotonic()
            if wait < 0:  # fell behind (a slow NVML call): skip the missed ticks
                next_at, wait = time.monotonic() + self.interval, self.interval
            stop.wait(wait)

    def _shutdown(self, threads: list) -> None:
        log.info("stopping")
        for follower in self._followers:
            follower.stop(timeout=1.0)
        if threads:
            threads[0].join(2.0)
        try:
            self.source.shutdown()
        except Exception as exc:
            log.debug("NVML shutdown: %s", exc)
        if self._runner is not None:
            self._runner.stop(timeout=1.0)
        if len(threads) > 1:
            threads[1].join(3.0)
        if self.snapshots is not None:
            self.snapshots.stop()
        self.publisher.close(self.flush_timeout)
        log.info("stopped")


def _setup_logging(args, node: str):
    """The agent's log (trainguard.logs), where the command line has not set it up: the
    handler installed, to take down on return, or None."""
    from trainguard import logs

    if logs.configured():
        logs.add_fields(node=node)
        return None
    return logs.setup_from_args(args, "agent", fields={"job": getattr(args, "job", None),
                                                       "node": node})


def _check_args(args, node: str) -> None:
    if not node or len(node) > 255:
        raise UserError(f"--node {node!r} must be 1-255 characters (default: SLURMD_NODENAME, "
                        "NODE_NAME or the host name)")
    if args.job is not None and not _JOB_RE.fullmatch(args.job):
        raise UserError(f"--job {args.job!r} must be 1-128 characters of [A-Za-z0-9._-]")
    if not (args.interval > 0):
        raise UserError(f"--interval {args.interval} must be a positive number of seconds")
    for path in args.kmsg_extra:
        parent = Path(path).expanduser().resolve().parent
        if not parent.is_dir():
            raise UserError(f"--kmsg-extra {path}: folder {parent} does not exist")


def main(args, config, keys=None) -> int:
    """``trainguard agent``: runs until SIGTERM or SIGINT. ``keys`` (default: from the
    environment, :func:`~trainguard.signing.signing_key_from_env`) check the commands."""
    from trainguard.signing import signing_key_from_env, warn_if_unsigned

    node = args.node or node_name()
    _check_args(args, node)
    keys = keys if keys is not None else signing_key_from_env()
    warn_if_unsigned(keys, "agent", f"capture_stacks commands on {config.topics.commands}")
    runtime_dir = (Path(args.runtime_dir).expanduser() if args.runtime_dir
                   else default_runtime_dir(os.environ))
    log_handler = _setup_logging(args, node)
    stop = threading.Event()

    def on_signal(signum, frame) -> None:
        if stop.is_set():
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(1)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    from trainguard.service_metrics import serve_agent_metrics

    metrics_server = serve_agent_metrics(lambda: agent, args, log=log.info)
    try:
        agent = Agent(config=config, node=node, job=args.job, interval=args.interval,
                      runtime_dir=runtime_dir, kmsg_extra=args.kmsg_extra,
                      native=bool(args.native), keys=keys)
        from .snapshot_store import store_from_args

        agent.snapshots = store_from_args(args, node, keys)
        return agent.run(stop)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if metrics_server is not None:
            metrics_server.close()
        from trainguard.logs import teardown

        teardown(log_handler)
