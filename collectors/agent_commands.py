"""The node agent's stack capture: which ``capture_stacks`` commands it obeys, and its answers.

The agent reads ``<prefix>.commands`` and answers on ``<prefix>.stacks`` with one SPEC
``stack`` event per local rank process. What it obeys (:func:`address`):

- only a message that :func:`trainguard.events.decode` accepts as a ``command`` event; the
  contract admits only ``command == "capture_stacks"``. Nothing from a message reaches a
  shell: the pid comes from the local registry and py-spy is run with an argv list;
- ranks of ``command.job`` registered in the local registry (the registry is local to this
  machine, so any rank found there runs here); commands for jobs with no local rank are
  ignored;
- ``command.node`` null, this agent's ``--node``, or the node name one of those local ranks
  registered under (agent and collectors may name the machine differently);
- ``ranks``: ``"all"`` is every local rank of the job, a list those of its ranks that run here.

A command for a local job then passes :class:`~trainguard.signing.Verifier`
(:class:`CommandHandler`): with a signing key it must be signed by it; always, it must not be
older than ``MAX_COMMAND_AGE`` seconds (after a restart the agent's consumer group resumes at
its committed offset, and stacks of a past moment would mislead) nor stamped in the future
beyond the clock skew allowed. A refused command goes to ``<prefix>.deadletter`` with the
reason; a ``capture_id`` already obeyed is skipped (a redelivery after a rebalance). Last,
captures are rate-limited per job and per machine
(:class:`~trainguard.collectors.capture_limits.CaptureLimiter`), and one pid is never
captured by two py-spy at once (:class:`CaptureRunner`).

Stale registry entries are skipped, with no ``stack`` event: the registry leaves out dead pids,
and :func:`address` leaves out a pid that another process took over (the process started
well after the rank registered). The gatherer then counts that rank as missing.

A ``stack`` event's ``node`` is the node the rank registered under (the name its own telemetry
carries), else the agent's. Stacks too large for one Kafka message keep the innermost frames
of each thread and say ``"truncated": true`` (an extra field).

>>> ranks = [{"job": "j1", "rank": r, "pid": 100 + r, "node": "n1"} for r in range(4)]
>>> cmd = ev.Command(job="j1", ts=1000.0, command="capture_stacks", capture_id="c1",
...                  ranks=[2, 3, 9])
>>> targets, why = address(cmd, "n1", ranks)
>>> [e["rank"] for e in targets], why
([2, 3], None)
>>> address(cmd.replace(node="n2"), "n1", ranks)
([], 'addressed to node n2')
>>> address(cmd.replace(job="j2"), "n1", ranks)
([], 'no local rank of job j2')
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

from trainguard import events as ev
from trainguard.signing import Freshness, Verifier

from .capture_limits import CaptureLimiter
from .stack_capture import DEFAULT_SIGNAL, capture_pid

__all__ = ["address", "stack_event", "CaptureRunner", "CommandHandler", "CommandListener",
           "QuietLog", "KafkaLog", "MAX_STACK_BYTES", "MAX_COMMAND_AGE"]

log = logging.getLogger(__name__)

MAX_COMMAND_AGE = 120.0
#: a stack event larger than this is cut to fit a Kafka message (broker default 1 MiB)
MAX_STACK_BYTES = 900_000
#: a registered pid whose process started this long after the rank registered is not the rank
PID_REUSE_SLACK = 300.0
_FRAME_LIMITS = (200, 50, 10, 1, 0)


def _started_at(pid: int) -> Optional[float]:
    """Unix time process ``pid`` started (from /proc; seconds resolution), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return int(line.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        pass
    return None


def _is_rank_process(entry: dict, started_at: Callable[[int], Optional[float]]) -> bool:
    registered = entry.get("start_time")
    if not isinstance(registered, (int, float)):
        return True
    started = started_at(entry["pid"])
    return started is None or started <= registered + PID_REUSE_SLACK


def _valid_entry(entry) -> bool:
    return (isinstance(entry, dict) and type(entry.get("rank")) is int and entry["rank"] >= 0
            and type(entry.get("pid")) is int and entry["pid"] > 0)


def address(command: ev.Event, node: str, entries: Iterable[dict],
            started_at: Callable[[int], Optional[float]] = _started_at) -> tuple[list, Optional[str]]:
    """``(registry entries to capture, None)``, or ``([], why the command is not for us)``.

    ``entries`` are the local registry's live entries (any job); see the module docstring.
    """
    if not isinstance(command, ev.Command) or command.command != "capture_stacks":
        return [], f"not a capture_stacks command ({getattr(command, 'type', '?')})"
    local = [e for e in entries if _valid_entry(e) and e.get("job") == command.job]
    if not local:
        return [], f"no local rank of job {command.job}"
    names = {node} | {e["node"] for e in local if isinstance(e.get("node"), str)}
    if command.node is not None and command.node not in names:
        return [], f"addressed to node {command.node}"
    if command.ranks != "all":
        wanted = set(command.ranks)
        local = [e for e in local if e["rank"] in wanted]
        if not local:
            return [], f"none of ranks {sorted(wanted)[:8]} runs here"
    local = [e for e in local if _is_rank_process(e, started_at)]
    if not local:
        return [], "the registered pids belong to other processes now"
    return sorted(local, key=lambda e: e["rank"]), None


def _cut(threads: list, limit: int) -> list:
    return [{**t, "frames": t.get("frames", [])[:limit]} for t in threads]


def stack_event(command: ev.Command, entry: dict, result: dict, node: str, ts: float,
                max_bytes: int = MAX_STACK_BYTES) -> ev.Stack:
    """The SPEC ``stack`` answer for one rank from :func:`capture_pid`'s result.

    >>> cmd = ev.Command(job="j1", ts=5.0, command="capture_stacks", capture_id="c1")
    >>> frames = [{"function": "load_batch", "file": "train.py", "line": 7}]
    >>> res = {"pid": 42, "method": "py-spy", "error": None,
    ...        "threads": [{"name": "MainThread", "id": 1, "active": True, "frames": frames}]}
    >>> e = stack_event(cmd, {"rank": 2, "pid": 42, "node": "n1"}, res, "agent-node", ts=6.0)
    >>> (e.rank, e.node, e.pid, e.method, e.error, e.threads[0]["frames"][0]["function"])
    (2, 'n1', 42, 'py-spy', None, 'load_batch')
    """
    rank_node = entry.get("node")
    extra = {}
    if result.get("fallback_reason"):
        extra["fallback_reason"] = str(result["fallback_reason"])
    if type(entry.get("local_rank")) is int:
        extra["local_rank"] = entry["local_rank"]
    threads = result.get("threads") or []
    event = ev.Stack(job=command.job, ts=ts, rank=entry["rank"],
                     node=rank_node if isinstance(rank_node, str) and rank_node else node,
                     capture_id=command.capture_id, pid=int(result.get("pid") or entry["pid"]),
                     method=result.get("method") or "py-spy", threads=threads,
                     error=result.get("error"), extra=extra)
    if len(ev.encode(event)) <= max_bytes:
        return event
    for limit in _FRAME_LIMITS:
        event = event.replace(threads=_cut(threads, limit), extra={**extra, "truncated": True})
        if len(ev.encode(event)) <= max_bytes:
            return event
    kept = event.threads
    while len(kept) > 1 and len(ev.encode(event)) > max_bytes:  # thousands of threads
        kept = kept[:len(kept) // 2]
        event = event.replace(threads=kept)
    return event


class CaptureRunner:
    """Runs captures in background threads; each rank's ``stack`` event goes to ``publish``
    as soon as its capture ends (all ranks of a command are captured in parallel).

    ``capture`` is :func:`capture_pid` (tests inject a fake). At most ``max_pending``
    commands wait; more are refused (``submit`` returns False).
    """

    def __init__(self, publish: Callable[[ev.Stack], None], *, node: str,
                 runtime_dir: Optional[os.PathLike], native: bool = False,
                 capture: Callable[..., dict] = capture_pid, timeout: float = 10.0,
                 workers: int = 2, max_pending: int = 8, clock: Callable[[], float] = time.time):
        self.publish = publish
        self.node = node
        self.runtime_dir = runtime_dir
        self.native = native
        self.capture = capture
        self.timeout = timeout
        self.workers = workers
        self.max_pending = max_pending
        self.clock = clock
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._stop = threading.Event()
        self._threads: list = []
        self._busy: set = set()  # pids under capture now: one py-spy per pid at a time
        self._busy_lock = threading.Lock()

    def start(self) -> "CaptureRunner":
        for i in range(self.workers):
            t = threading.Thread(target=self._work, name=f"trainguard-capture-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def submit(self, command: ev.Command, entries: list) -> bool:
        try:
            self._queue.put_nowait((command, list(entries)))
            return True
        except queue.Full:
            return False

    def stop(self, timeout: float = 2.0) -> None:
        """Stop taking work; waits up to ``timeout`` for captures under way."""
        self._stop.set()
        for _ in self._threads:
            try:
                self._queue.put_nowait(None)
            except queue.Full:
                pass
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def run(self, command: ev.Command, entries: list) -> list:
        """Capture every entry now, in parallel; returns the published events."""
        native = self.native or bool(command.native)
        out: list = []
        lock = threading.Lock()

        def one(entry: dict) -> None:
            signum = entry.get("stack_signal")
            pid = entry["pid"]
            with self._busy_lock:
                busy = pid in self._busy
                self._busy.add(pid)
            try:
                result = {"pid": pid, "method": "py-spy", "threads": [],
                          "error": f"busy: a capture of pid {pid} is already under way"} \
                    if busy else self.capture(pid, native=native, timeout=self.timeout,
                                              runtime_dir=self.runtime_dir,
                                              signum=signum if type(signum) is int
                                              else DEFAULT_SIGNAL)
            except Exception as exc:  # capture_pid never raises; a replacement might
                result = {"pid": pid, "method": "py-spy", "threads": [],
                          "error": f"stack capture failed: {type(exc).__name__}: {exc}"}
            finally:
                if not busy:
                    with self._busy_lock:
                        self._busy.discard(pid)
            event = stack_event(command, entry, result, self.node, self.clock())
            log.info("capture %s: rank %d pid %d: %s", command.capture_id, event.rank,
                     event.pid, f"{event.method}, {len(event.threads)} threads"
                     if event.error is None else event.error)
            try:
                self.publish(event)
            except Exception:
                log.exception("publishing the stacks of rank %d failed", event.rank)
            with lock:
                out.append(event)

        threads = [threading.Thread(target=one, args=(e,), daemon=True,
                                    name=f"trainguard-capture-pid{e['pid']}") for e in entries]
        for t in threads:
            t.start()
        for t in threads:  # capture_pid bounds each of its two steps by its timeout
            t.join(2 * self.timeout + 5)
        return out

    def _work(self) -> None:
        while not self._stop.is_set():
            item = self._queue.get()
            if item is None:
                return
            try:
                self.run(*item)
            except Exception:
                log.exception("capture %s failed", item[0].capture_id)


class CommandHandler:
    """Decodes one commands-topic message, decides with :func:`address`, checks what is ours
    with ``verifier`` and ``limiter`` and hands it to ``runner.submit``; returns a word for
    what it did. Refused commands go to ``deadletter(value, reason, msg)``. Never raises."""

    def __init__(self, *, node: str, entries: Callable[[], list], runner: CaptureRunner,
                 clock: Callable[[], float] = time.time, verifier: Optional[Verifier] = None,
                 limiter: Optional[CaptureLimiter] = None,
                 deadletter: Optional[Callable[..., None]] = None):
        self.node = node
        self.entries = entries
        self.runner = runner
        self.clock = clock
        self.verifier = verifier or Verifier(freshness=Freshness(max_age_s=MAX_COMMAND_AGE),
                                             clock=clock)
        self.limiter = limiter or CaptureLimiter()
        self.deadletter = deadletter
        self._quiet = QuietLog(every=60.0)

    def handle(self, value, msg=None) -> str:
        if value is None:
            log.warning("ignoring an empty message on the commands topic")
            return "invalid"
        try:
            command = ev.decode(value)
        except ev.InvalidEvent as exc:
            log.warning("ignoring an invalid command: %s", str(exc)[:200])
            return "invalid"
        if not isinstance(command, ev.Command):
            log.warning("ignoring a %r event on the commands topic", command.type)
            return "invalid"
        try:
            entries = self.entries()
        except Exception as exc:
            log.warning("cannot read the rank registry: %s", exc)
            entries = []
        targets, why = address(command, self.node, entries)
        if why is not None:
            log.debug("capture %s for job %s ignored: %s", command.capture_id, command.job, why)
            return "ignored"
        refusal = self.verifier.check(value, f"{command.job}/{command.capture_id}")
        if refusal is not None and refusal.code == "replayed":
            log.debug("capture %s: already answered", command.capture_id)
            return "duplicate"
        if refusal is not None:
            self._quiet.warn(("refused", command.job), "capture_stacks for job %s refused: %s",
                             command.job, refusal)
            if self.deadletter is not None:
                try:
                    self.deadletter(value, f"command refused: {refusal}", msg)
                except Exception as exc:
                    log.warning("cannot dead-letter a refused command: %s", exc)
            return "refused"
        if not self.limiter.allow(command.job, self.clock()):
            self._quiet.warn(("limited", command.job), "capture %s for job %s skipped: more "
                             "than %d captures of the job or %d in all within %gs",
                             command.capture_id, command.job, self.limiter.limits.per_job,
                             self.limiter.limits.per_machine, self.limiter.limits.window_s)
            return "rate_limited"
        if not self.runner.submit(command, targets):
            log.warning("capture %s dropped: %d captures already waiting", command.capture_id,
                        self.runner.max_pending)
            return "dropped"
        log.info("capture %s for job %s: ranks %s", command.capture_id, command.job,
                 [e["rank"] for e in targets])
        return "accepted"


class QuietLog:
    """Warns about a kind of trouble once, then at most every ``every`` seconds (an
    unreachable broker would otherwise fill the log)."""

    def __init__(self, logger: logging.Logger = log, every: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.every = every
        self.clock = clock
        self._last: dict = {}

    def warn(self, key, msg: str, *args) -> None:
        now = self.clock()
        last = self._last.get(key)
        if last is None or now - last >= self.every:
            self._last[key] = now
            self.logger.warning(msg, *args)

    def clear(self, key) -> None:
        self._last.pop(key, None)


class KafkaLog:
    """librdkafka's own log lines (connection refused, ...), all at DEBUG on
    ``trainguard.collectors.kafka``: the ``error_cb`` warnings say what matters."""

    logger = logging.getLogger("trainguard.collectors.kafka")

    def log(self, level, msg, *args, **kwargs) -> None:
        self.logger.debug(msg, *args)


class CommandListener:
    """Consumes the commands topic in its own consumer group and hands each message to
    ``handler``. A new group starts at the end of the topic: on assignment, partitions with no
    committed offset are set to their current end explicitly, so every command sent after
    :attr:`ready` is set is seen. ``consumer_factory(settings)`` makes the client."""

    def __init__(self, *, settings: dict, topic: str, handler: CommandHandler,
                 poll_timeout: float = 0.5, consumer_factory: Optional[Callable] = None):
        self.settings = settings
        self.topic = topic
        self.handler = handler
        self.poll_timeout = poll_timeout
        self.consumer_factory = consumer_factory
        self.ready = threading.Event()
        self._quiet = QuietLog()

    def _client(self):
        settings = {"auto.offset.reset": "latest", "enable.auto.commit": True,
                    "session.timeout.ms": 10000, "socket.connection.setup.timeout.ms": 3000,
                    "reconnect.backoff.max.ms": 2000, **self.settings,
                    "error_cb": self._on_error, "logger": KafkaLog()}
        if self.consumer_factory is not None:
            return self.consumer_factory(settings)
        from confluent_kafka import Consumer

        return Consumer(settings)

    def _on_error(self, err) -> None:
        self._quiet.warn("kafka", "commands consumer: Kafka at %s: %s",
                         self.settings.get("bootstrap.servers"), err.str())

    def _on_assign(self, consumer, partitions) -> None:
        try:
            positions = consumer.committed(partitions, timeout=5)
            for tp in positions:
                if tp.offset < 0:
                    tp.offset = consumer.get_watermark_offsets(tp, timeout=5, cached=False)[1]
            consumer.assign(positions)
        except Exception as exc:  # the broker went away: let auto.offset.reset decide
            log.debug("explicit command offsets failed (%s); using auto.offset.reset", exc)
            consumer.assign(partitions)
        if partitions and not self.ready.is_set():
            log.info("listening for commands on %s (%d partitions)", self.topic, len(partitions))
        self.ready.set()

    def run(self, stop: threading.Event) -> None:
        """Consume until ``stop`` is set; never raises."""
        try:
            consumer = self._client()
            consumer.subscribe([self.topic], on_assign=self._on_assign)
        except Exception as exc:
            log.error("stack capture disabled: cannot consume %s: %s", self.topic, exc)
            return
        try:
            while not stop.is_set():
                try:
                    msg = consumer.poll(self.poll_timeout)
                except Exception as exc:
                    self._quiet.warn("poll", "commands consumer: %s", exc)
                    stop.wait(1.0)
                    continue
                if msg is None:
                    continue
                if msg.error():
                    self._quiet.warn(("msg", msg.error().code()), "commands topic %s: %s",
                                     self.topic, msg.error())
                    continue
                self.handler.handle(msg.value(), msg)
        finally:
            try:
                consumer.close()
            except Exception as exc:
                log.debug("closing the commands consumer: %s", exc)
