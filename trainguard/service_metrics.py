"""The metrics of every long-running service, declared in one place, and what counts them.

``SERVICES`` maps each service to its declarations (:class:`~trainguard.metrics.Metric`):
the stream worker (``trainguard worker``, counted by :mod:`trainguard.streams.metrics`), the action
service (``trainguard actions``), the node agent (``trainguard agent``) and the launcher
(``trainguard run``). docs/METRICS.md is generated from them (:func:`markdown`), and the
Grafana dashboard in ``deploy/grafana`` may only query what they declare (tests check both).

The counting reads the events each service writes anyway, so that a service needs one call
where its events pass: :meth:`ActionMetrics.record` for each audit record (orders, their
outcomes), :meth:`RunMetrics.event` for each event ``trainguard run`` emits (launches,
exits, its own records and acks). :func:`serve_action_metrics` puts the action service's
counting around its pipeline (the recorders of its stages and of the order desk, the alert
sender) and :func:`serve_run_metrics` hands ``trainguard run`` its own; both serve
``/metrics`` on the command's ``--metrics-port``.

>>> m = ActionMetrics()
>>> from trainguard import events as ev
>>> order = ev.Action(job="j1", ts=110.0, incident="i1", action="restart", targets={},
...                   status="planned", reason="crash", extra={"detected_ts": 100.0,
...                   "order_id": "o1"})
>>> ack = ev.Action(job="j1", ts=113.0, incident="i1", action="restart", targets={},
...                 status="done", reason="relaunched", extra={"order_id": "o1",
...                 "ack_status": "done"})
>>> m.record(order); m.record(ack)
>>> text = m.registry.exposition()
>>> 'trainguard_orders_sent_total{op="restart"} 1' in text
True
>>> 'trainguard_order_answers_total{op="restart",status="done"} 1' in text
True
>>> 'trainguard_order_ack_seconds_bucket{le="5.0"} 1' in text
True
"""
from __future__ import annotations

import threading
from collections import OrderedDict

from trainguard import events as ev
from trainguard.metrics import Metric, Registry, check_port, serve

__all__ = ["WORKER_COUNTERS", "WORKER_GAUGES", "worker_declared", "ACTIONS", "AGENT", "RUN",
           "SERVICES", "ActionMetrics", "AgentMetrics",
           "RunMetrics", "markdown", "start_metrics", "METRICS_PORTS", "add_metrics_flags",
           "MeteredRecorder", "serve_action_metrics", "serve_run_metrics", "serve_agent_metrics"]

#: the actions sent as orders (restart, evict, rollback): derived from the one list of actions
ORDER_OPS = tuple(a for a in ev.ACTIONS if a in ev.ORDER_OPS)
#: from detection to order: seconds (a capture before a restart can take a minute)
DETECTION_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: from order to acknowledgement: a restart's tear-down takes up to ``--grace`` seconds
ACK_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)

#: the stream worker's metrics (``trainguard worker``, counted by
#: :class:`trainguard.streams.metrics.Metrics`)
WORKER_COUNTERS = {
    "events_in": "Telemetry messages consumed.",
    "partitions_unreadable": "Times a telemetry partition of this worker lost the broker it "
                             "is fetched from (see unreadable_partitions).",
    "invalid": "Telemetry messages sent to the dead-letter topic.",
    "ignored": "Valid rank events without a rank, ignored.",
    "anomalies_out": "Anomalies delivered to the anomalies topic (confirmed by the broker).",
    "false_alarms_learned": "The action service's false alarms (a hang whose job moved on) "
                            "that widened a live job stage's hang allowance.",
    "false_alarms_refused": "False-alarm records refused (unsigned, forged, stale, replayed or "
                            "malformed) and dead-lettered.",
    "incidents_out": "Incident events (SPEC §6) delivered to the anomalies topic.",
    "anomalies_failed": "Anomaly deliveries that failed (each is sent again; offsets wait).",
    "deliveries_failed": "Rank-side deliveries (summaries, dead letters, state) that failed "
                         "(each is produced again and offsets wait, but for a word of what "
                         "the worker reads, which its next replaces).",
    "deadletters_out": "Dead-letter records delivered to the dead-letter topic.",
    "time_rejected": "Telemetry events dead-lettered for an implausible ts or step.",
    "evictions": "Stages evicted from memory to their snapshot (idle, or beyond the cap).",
    "summaries_out": "Messages produced to the internal summaries topic.",
    "summaries_in": "Messages consumed from the internal summaries topic.",
    "summaries_invalid": "Unreadable summaries messages skipped.",
    "items_applied": "Summary items and node events given to job stages.",
    "replayed": "Messages or items skipped because restored state already had them.",
    "stage_errors": "Inputs on which a rank or job stage raised (logged, skipped).",
    "snapshots": "State snapshots written (rank and job side).",
    "snapshot_failures": "State snapshots whose flush failed (offsets not committed).",
    "snapshot_cpu_seconds": "CPU seconds spent encoding state snapshots (rank and job side); "
                            "each side spaces its snapshots so that this stays within "
                            "snapshot_cpu_share of a core.",
    "restore_failures": "Snapshots that could not be loaded (state started afresh).",
    "gc_collections": "Scheduled garbage collections (one every gc_interval_s, 30 s).",
    "config_overrides_applied": "Per-job overrides read from the config topic and applied.",
    "config_overrides_refused": "Config topic records refused (unsigned, forged, malformed, "
                                "out of range, replayed) and dead-lettered.",
    "feedback_learned": "People's verdicts on incidents (trainguard feedback: false alarm, "
                        "confirmed, reset) that a live job stage learned from.",
    "feedback_refused": "Feedback records refused (unsigned, forged, stale, replayed, "
                        "malformed, or for an incident the job does not know) and "
                        "dead-lettered.",
    "gc_seconds": "Seconds spent in scheduled garbage collections.",
    "rank_side_cpu_seconds": "CPU seconds of the rank side: decoding, aligning, the rank and "
                             "node stages, producing summaries.",
    "job_side_cpu_seconds": "CPU seconds of the job side: the job stages (apply and advance). "
                            "One job's job side runs on one worker: its share of the CPU "
                            "bounds what more workers gain for that job.",
}
WORKER_GAUGES = {
    "consumer_lag_messages": "Messages not yet read on this worker's partitions.",
    "assigned_partitions": "Partitions assigned to this worker.",
    "rank_stages": "Rank stages held in memory.",
    "unreadable_partitions": "Telemetry partitions of this worker whose broker is unknown "
                             "or not connected (a broker died; librdkafka's statistics): "
                             "not said to be read, so their jobs wait for them (30 s at "
                             "most).",
    "job_stages": "Job stages held in memory.",
    "evicted_stages": "Snapshots of evicted (idle) stages held until their key speaks again "
                      "or idle_ttl_s passes.",
    "late_step_records": "Step records that reached their job stage after the step was closed "
                         "(a lagging rank worker); checked for a non-finite loss only.",
    "held_records": "Summary items held until the slowest telemetry partition of their job "
                  "reaches their time (a rank worker read behind another).",
    "released_early_records": "Held items applied before the slowest partition reached them: "
                            "more than max_held were held for one job, or one waited "
                            "source_idle_s (unread_partition_s for a partition said to be "
                            "behind or that nobody reads).",
    "superseded_records": "Heartbeats of a rank let go from the hold after a later "
                          "heartbeat or start of the rank (its machine's clock offset was "
                          "learned meanwhile): what they tell is over; not applied.",
    "unread_partitions": "Telemetry partitions silent for more than source_idle_s that no "
                         "rank worker says it reads (killed, stalled, moving in a "
                         "rebalance): their jobs wait for them (judged, and the other "
                         "partitions' items applied, up to their last records), for "
                         "unread_partition_s at most, then go on without them.",
    "unseen_ranks": "Ranks whose telemetry partition nobody has read for more than "
                    "unread_partition_s: their jobs go on without them, and their silence, "
                    "a tear-down and a hang are not judged until they are read again.",
    "behind_partitions": "Telemetry partitions whose rank worker last said (within "
                         "source_idle_s) that it has not read them to the end; the job side "
                         "waits for them while they send nothing.",
}
WORKER_LAG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                      10.0, 30.0, 60.0, 300.0)
WORKER_LAG_HELP = "Wall time of a job stage's update minus the event's ts."
WORKER_LABELS = {"consumer_lag_messages": ("topic",), "assigned_partitions": ("topic",)}


def worker_declared() -> list:
    """The worker's metrics as :class:`~trainguard.metrics.Metric` declarations (docs,
    dashboard checks)."""
    return ([Metric(n, "counter", h) for n, h in WORKER_COUNTERS.items()]
            + [Metric(n, "gauge", h, labels=WORKER_LABELS.get(n, ()))
               for n, h in WORKER_GAUGES.items()]
            + [Metric("event_lag_seconds", "histogram", WORKER_LAG_HELP,
                      buckets=WORKER_LAG_BUCKETS)])


ACTIONS = (
    Metric("anomalies", "counter", "Anomalies taken up by the action service, by outcome "
           "(handled: through the pipeline; false_alarm: a hang whose job moved on, closed "
           "without a restart; dropped: a duplicate, stale, or beyond the backlog's bound; "
           "error: an internal error).",
           labels=("outcome",)),
    Metric("actions", "counter", "Records written to the actions topic (the audit log), by "
           "action and status.", labels=("action", "status")),
    Metric("orders_sent", "counter", "Orders sent to `trainguard run` or a driver (restart, "
           "evict, rollback), by op.", labels=("op",)),
    Metric("order_answers", "counter", "Answers to orders, by op and acknowledgement status "
           "(done, failed, already_satisfied, not_applicable, rejected; no_ack when none came "
           "in time).", labels=("op", "status")),
    Metric("detection_to_order_seconds", "histogram", "Seconds from an incident's detection "
           "(detected_ts) to its order.", buckets=DETECTION_BUCKETS),
    Metric("order_ack_seconds", "histogram", "Seconds from an order to its acknowledgement.",
           buckets=ACK_BUCKETS),
    Metric("alerts", "counter", "Alert messages by sink and the sink's answer (sent, failed, "
           "rate_limited, duplicate).", labels=("sink", "status")),
)
AGENT = (
    Metric("gpu_samples", "counter", "GPU events published (one per job per sample), by status "
           "(ok, unavailable).", labels=("status",)),
    Metric("xid_lines", "counter", "Xid errors seen, by source (kmsg, dmesg, nvml, file).",
           labels=("source",)),
    Metric("stack_captures", "counter", "Stack events published in answer to capture commands, "
           "by status (ok, error).", labels=("status",)),
    Metric("nvml_errors", "counter", "NVML calls that failed, by call (sample, wait_event).",
           labels=("call",)),
    Metric("events_sent", "counter", "Events handed to the Kafka producer."),
    Metric("delivery_failures", "counter", "Events the broker did not take (lost)."),
)
RUN = (
    Metric("launches", "counter", "Launches of the training command, by kind (first, "
           "relaunch).", labels=("kind",)),
    Metric("restarts", "counter", "Relaunches of the training command (after an exit or on "
           "an order)."),
    Metric("exits", "counter", "Exits of the training command, by exit code or signal name.",
           labels=("code",)),
    Metric("run_actions", "counter", "Records `trainguard run` wrote to the actions topic, by "
           "action and status.", labels=("action", "status")),
    Metric("run_acks", "counter", "Acknowledgements `trainguard run` sent, by op and status.",
           labels=("op", "status")),
    Metric("remaining_restarts", "gauge", "Restarts left of --max-restarts."),
)


def _worker() -> tuple:
    return tuple(worker_declared())


#: service -> (command, default metrics port, declarations)
SERVICES = {
    "worker": ("trainguard worker", 6066, _worker),
    "actions": ("trainguard actions", 6067, lambda: ACTIONS),
    "agent": ("trainguard agent", 6068, lambda: AGENT),
    "run": ("trainguard run", 0, lambda: RUN),
}
METRICS_PORTS = {name: port for name, (_, port, _) in SERVICES.items()}


def add_metrics_flags(parser, service: str) -> None:
    """``--metrics-port`` and ``--metrics-bind`` of a service's command (the worker's old
    ``--web-port`` and ``--web-bind`` stay as aliases; its destinations keep those names,
    the keys ``worker.web_port`` and ``worker.web_bind`` of the configuration tree)."""
    port = METRICS_PORTS[service]
    old = service == "worker"
    lowest = 1 if old else 0
    parser.add_argument("--metrics-port", *(["--web-port"] if old else []), type=int,
                        default=port, metavar="PORT", dest="web_port" if old else "metrics_port",
                        help=f"port of the Prometheus /metrics endpoint (default {port}; "
                             + ("1-65535" if lowest else "0: none") + ")")
    parser.add_argument("--metrics-bind", *(["--web-bind"] if old else []), metavar="ADDR",
                        default=None if old else "127.0.0.1",
                        dest="web_bind" if old else "metrics_bind",
                        help="address of the /metrics endpoint (default 127.0.0.1; 0.0.0.0 "
                             "for a Prometheus on another machine)")


TAKEN = "running without /metrics"


def start_metrics(source, args, service: str, log=None, port: int | None = None,
                  bind: str | None = None):
    """The /metrics server of ``args.metrics_port`` / ``args.metrics_bind`` (or ``port`` and
    ``bind``), or None: when off (port 0), or when the port cannot be had. A taken port is
    one warning line (through ``log``, else the ``trainguard.metrics`` logger) and the
    service, and the job it watches, run on without /metrics: losing the metrics must not
    lose detection or recovery. A port outside 0-65535 raises ``UserError``."""
    import logging

    from trainguard.errors import UserError

    logger = logging.getLogger("trainguard.metrics")
    port = check_port(port if port is not None else
                      getattr(args, "metrics_port", METRICS_PORTS[service]))
    bind = bind or getattr(args, "metrics_bind", None) or "127.0.0.1"
    try:
        server = serve(source, port, bind)
    except UserError as exc:
        (log or logger.warning)(f"{exc}; {TAKEN}")
        return None
    if server is not None:
        (log or logger.info)(f"metrics on {server.url}")
    return server


class ActionMetrics:
    """The action service's metrics, counted from its audit records and alert results."""

    def __init__(self, remember: int = 10_000):
        self.registry = Registry(ACTIONS)
        self.server = None
        self._sent: OrderedDict = OrderedDict()  # order key -> ts sent
        self._lock = threading.Lock()
        self.remember = remember

    def outcome(self, outcome: str) -> None:
        """One anomaly's outcome (``handled``, ``false_alarm``, ``dropped``, ``error``)."""
        self.registry.inc("anomalies", outcome=outcome)

    def handled(self, dropped: str | None) -> None:
        self.outcome("dropped" if dropped else "handled")

    def order_sent(self, op: str, key: str | None, ts: float,
                   detected_ts: float | None = None) -> None:
        self.registry.inc("orders_sent", op=op)
        if isinstance(detected_ts, (int, float)) and ts >= detected_ts:
            self.registry.observe("detection_to_order_seconds", ts - detected_ts)
        if key:
            with self._lock:
                self._sent[key] = ts
                while len(self._sent) > self.remember:
                    self._sent.popitem(last=False)

    def order_answered(self, op: str, status: str, key: str | None = None,
                       ts: float | None = None, seconds: float | None = None) -> None:
        """One answer; its delay is ``seconds``, or ``ts`` minus when order ``key`` went."""
        self.registry.inc("order_answers", op=op, status=status)
        if seconds is None and key and ts is not None:
            with self._lock:
                sent = self._sent.pop(key, None)
            seconds = None if sent is None else ts - sent
        if seconds is not None and seconds >= 0:
            self.registry.observe("order_ack_seconds", seconds)

    def alert(self, sink: str, status: str) -> None:
        self.registry.inc("alerts", sink=sink, status=status)

    def record(self, event) -> None:
        """One audit record (``ev.Action``) written by the service."""
        if getattr(event, "type", None) != "action":
            return
        self.registry.inc("actions", action=event.action, status=event.status)
        if event.action not in ORDER_OPS:
            return
        extra = event.extra or {}
        key = extra.get("order_id") or extra.get("action_id")
        if "ack_status" in extra or extra.get("code") == "no_ack":
            self.order_answered(event.action, str(extra.get("ack_status") or "no_ack"),
                                key=key, ts=event.ts)
        elif event.status == "planned":
            self.order_sent(event.action, key, event.ts, extra.get("detected_ts"))


class MeteredRecorder:
    """A recorder (``write``/``flush``) that counts what passes through it."""

    def __init__(self, recorder, metrics: ActionMetrics):
        self.recorder = recorder
        self.metrics = metrics

    def write(self, event) -> None:
        self.recorder.write(event)
        self.metrics.record(event)

    def flush(self) -> None:
        self.recorder.flush()

    def __getattr__(self, name):
        return getattr(self.recorder, name)


def _counted_alerts(notify, metrics: ActionMetrics):
    def send(message):
        results = notify(message)
        for result in results or ():
            metrics.alert(result.sink, result.status)
        return results
    return send


def _counted_process(process, metrics: ActionMetrics):
    def run(anomaly, now):
        work = process(anomaly, now=now)
        metrics.handled(work.dropped)
        return work
    return run


def _is_recorder(obj) -> bool:
    return callable(getattr(obj, "write", None)) and callable(getattr(obj, "flush", None))


def instrument_action_service(service, metrics: ActionMetrics) -> None:
    """Count what ``service`` does: every recorder its pipeline's stages write the audit
    log with (and the recorder of any object a stage holds, such as the order desk, whose
    acks are audit records too) goes through a :class:`MeteredRecorder`, the ``notify`` of
    the alerting stage counts the sinks' answers, and the anomalies taken up are counted by
    the service itself where it tells their outcomes (its ``metrics`` attribute, see
    :class:`~trainguard.actions.service.ActionService`), else around ``pipeline.process``."""
    pipeline = service.pipeline
    for stage in getattr(pipeline, "stages", ()):
        for holder in (stage, *vars(stage).values()):
            if isinstance(holder, MeteredRecorder):
                continue  # wrapped already (a stage shared by others): not its inside
            recorder = getattr(holder, "recorder", None)
            if _is_recorder(recorder) and not isinstance(recorder, MeteredRecorder):
                holder.recorder = MeteredRecorder(recorder, metrics)
        if callable(getattr(stage, "notify", None)):
            stage.notify = _counted_alerts(stage.notify, metrics)
    if hasattr(service, "metrics"):
        service.metrics = metrics
    else:
        pipeline.process = _counted_process(pipeline.process, metrics)


def serve_action_metrics(service, args, log=None) -> ActionMetrics:
    """Count ``service`` (:func:`instrument_action_service`) and serve its /metrics on
    ``args.metrics_port`` (see :func:`start_metrics`)."""
    metrics = ActionMetrics()
    metrics.server = start_metrics(metrics.registry, args, "actions", log)
    instrument_action_service(service, metrics)
    return metrics


class AgentMetrics:
    """The node agent's metrics; the producer's own counts are read at each scrape."""

    def __init__(self):
        self.registry = Registry(AGENT)
        self.publisher = None

        def from_publisher(registry: Registry) -> None:
            if self.publisher is not None:
                registry.set("events_sent", getattr(self.publisher, "sent", 0))
                registry.set("delivery_failures", getattr(self.publisher, "failed", 0))
        self.registry.on_collect(from_publisher)

    def gpu_events(self, events) -> None:
        for event in events:
            self.registry.inc("gpu_samples", status=event.status or "ok")

    def xid(self, payload: dict) -> None:
        self.registry.inc("xid_lines", source=str(payload.get("source") or "unknown"))

    def stack(self, event) -> None:
        self.registry.inc("stack_captures", status="error" if getattr(event, "error", None)
                          else "ok")

    def nvml_error(self, call: str) -> None:
        self.registry.inc("nvml_errors", call=call)


def serve_agent_metrics(get_agent, args, log=None):
    """Serve ``get_agent().metrics`` (the node agent's :class:`AgentMetrics`) on
    ``args.metrics_port`` (see :func:`start_metrics`); an empty page until ``get_agent``
    has an agent. Returns the server or None."""
    def families():
        try:
            agent = get_agent()
        except NameError:  # the agent is not made yet
            return ()
        return agent.metrics.registry.collect()

    return start_metrics(families, args, "agent", log)


class RunMetrics:
    """``trainguard run``'s metrics, counted from the events it emits."""

    def __init__(self):
        self.registry = Registry(RUN)
        self.supervisor = None
        self.server = None

        def budget(registry: Registry) -> None:
            s = self.supervisor
            if s is not None:
                registry.set("remaining_restarts", max(0, s.max_restarts - s.restarts))
        self.registry.on_collect(budget)

    def event(self, event) -> None:
        kind = getattr(event, "type", None)
        extra = getattr(event, "extra", None) or {}
        if kind == "lifecycle" and extra.get("source") == "supervisor":
            if event.event == "start":
                first = not extra.get("incarnation")
                self.registry.inc("launches", kind="first" if first else "relaunch")
                if not first:
                    self.registry.inc("restarts")
            elif event.event == "exit" and (event.exit_code is not None or event.signal):
                self.registry.inc("exits", code=event.signal or event.exit_code)
        elif kind == "action":
            self.registry.inc("run_actions", action=event.action, status=event.status)
        elif kind == "ack":
            self.registry.inc("run_acks", op=getattr(event, "op", None) or "unknown",
                              status=event.status)


    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


def serve_run_metrics(supervisor, args, log=None) -> RunMetrics:
    """Give ``supervisor`` (``trainguard run``) its metrics and serve them on
    ``args.metrics_port`` (off by default; see :func:`start_metrics`)."""
    metrics = RunMetrics()
    metrics.server = start_metrics(metrics.registry, args, "run", log)
    metrics.supervisor = supervisor
    supervisor.metrics = metrics
    return metrics


def markdown() -> str:
    """docs/METRICS.md: every service's metrics, from the declarations."""
    out = ["# Metrics", "",
           "Every long-running trainguard service answers `GET /metrics` with",
           "`prometheus_client` (the Prometheus text format, or OpenMetrics when the scraper",
           "asks for it). One flag everywhere: `--metrics-port` (0 turns the endpoint off; the",
           "worker's old `--web-port` still works, and its port cannot be 0) and",
           "`--metrics-bind` (127.0.0.1 by default; the worker's old `--web-bind` still",
           "works). The metrics below are generated from their declarations",
           "(`trainguard/service_metrics.py`) by",
           "`python -m trainguard.service_metrics > docs/METRICS.md`. `deploy/prometheus/` has a",
           "scrape configuration and `deploy/grafana/trainguard.json` a dashboard of them.",
           "",
           "Beside them every service exposes the standard collectors of its process:",
           "`process_cpu_seconds_total`, `process_resident_memory_bytes`,",
           "`process_virtual_memory_bytes`, `process_open_fds`, `process_max_fds`,",
           "`process_start_time_seconds`, `python_info` and `python_gc_*`.",
           "",
           "Names carry their unit: a counter ends in `_total` (after its unit, as in",
           "`trainguard_gc_seconds_total`), a gauge or histogram in its unit (`_seconds`,",
           "`_bytes`, `_ratio`) or in the plural of what it counts (`_messages`, `_partitions`,",
           "`_stages`, `_records`, `_restarts`); a declaration without one is refused. No",
           "metric has a `job` label: that is Prometheus's own (the scrape job); alerts name",
           "the training job `training_job` (docs/ALERTS.md).",
           "",
           "**A port that is already taken** (or an address that cannot be bound) is one",
           "warning line, `--metrics-port N: cannot serve metrics on ADDR:N: Address already",
           "in use; running without /metrics`, and the service runs on without /metrics:",
           "the same for every service. Detection and recovery matter more than their",
           "metrics; the line and the scrape target's `up == 0` say what to fix. A port",
           "outside 0-65535 is a usage error (exit 2) before the service starts.",
           ""]
    for name, (command, port, declarations) in SERVICES.items():
        where = f"port {port}" if port else "off by default (one per job: give each its own port)"
        out += [f"## {name}: `{command}` ({where})", "", "| metric | type | labels | meaning |",
                "|---|---|---|---|"]
        for m in declarations():
            labels = ", ".join(m.labels) or "-"
            out.append(f"| `{m.full_name}` | {m.kind} | {labels} | {m.help} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown(), end="")
