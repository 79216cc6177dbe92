"""The worker's Prometheus metrics, exposed with ``prometheus_client`` (:meth:`Metrics.collect`).

Counters (``_total``): ``trainguard_events_in_total`` telemetry messages consumed,
``trainguard_invalid_total`` of them dead-lettered, ``trainguard_anomalies_out_total``
anomalies produced, ``trainguard_summaries_out_total`` / ``trainguard_summaries_in_total``
messages on the internal summaries topic, ``trainguard_items_applied_total`` summary items
given to job stages, ``trainguard_replayed_total`` messages skipped because a restored
state had already seen them, ``trainguard_snapshots_total``, ``trainguard_gc_collections_total``
and ``trainguard_gc_seconds_total`` (the worker's scheduled garbage collections).
Gauges: ``trainguard_consumer_lag_messages{topic}`` messages not yet read (high watermark
minus position, summed over this worker's partitions), ``trainguard_assigned_partitions{topic}``,
``trainguard_rank_stages``, ``trainguard_job_stages``, ``trainguard_late_step_records``.
Histogram: ``trainguard_event_lag_seconds``, wall time at which a job stage got an item
minus the event's own ``ts`` (end-to-end delay of the pipeline, sender clocks permitting).

>>> m = Metrics()
>>> m.inc("events_in", 3)
>>> m.observe_lag(0.2)
>>> m.set_gauge("consumer_lag_messages", 7, topic="tg.telemetry")
>>> text = m.exposition()
>>> "trainguard_events_in_total 3.0" in text
True
>>> 'trainguard_consumer_lag_messages{topic="tg.telemetry"} 7.0' in text
True
>>> 'trainguard_event_lag_seconds_bucket{le="0.3"} 1.0' in text
True
"""
from __future__ import annotations

import bisect

from trainguard.metrics import Metric, add_histogram, exposition, histogram_family, \
    parse_exposition

__all__ = ["Metrics", "COUNTERS", "GAUGES", "LAG_BUCKETS", "declared", "parse_exposition"]

COUNTERS = {
    "events_in": "Telemetry messages consumed.",
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
                         "(each is produced again; offsets wait).",
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
GAUGES = {
    "consumer_lag_messages": "Messages not yet read on this worker's partitions.",
    "assigned_partitions": "Partitions assigned to this worker.",
    "rank_stages": "Rank stages held in memory.",
    "job_stages": "Job stages held in memory.",
    "evicted_stages": "Snapshots of evicted (idle) stages held until their key speaks again "
                      "or idle_ttl_s passes.",
    "late_step_records": "Step records that reached their job stage after the step was closed "
                         "(a lagging rank worker); checked for a non-finite loss only.",
}
LAG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0,
               60.0, 300.0)
LAG_HELP = "Wall time of a job stage's update minus the event's ts."
_LABELS = {"consumer_lag_messages": ("topic",), "assigned_partitions": ("topic",)}


def declared() -> list:
    """The worker's metrics as :class:`~trainguard.metrics.Metric` declarations (docs,
    dashboard checks)."""
    return ([Metric(n, "counter", h) for n, h in COUNTERS.items()]
            + [Metric(n, "gauge", h, labels=_LABELS.get(n, ())) for n, h in GAUGES.items()]
            + [Metric("event_lag_seconds", "histogram", LAG_HELP, buckets=LAG_BUCKETS)])


class Metrics:
    """Plain counters for one process; the event loop is single-threaded, so no locks."""

    def __init__(self):
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.gauges: dict = {}
        self.lag_counts = [0] * (len(LAG_BUCKETS) + 1)
        self.lag_sum = 0.0

    def inc(self, name: str, amount: int = 1) -> None:
        self.counters[name] += amount

    def set_gauge(self, name: str, value: float, **labels) -> None:
        self.gauges[(name, tuple(sorted(labels.items())))] = value

    def observe_lag(self, seconds: float) -> None:
        self.lag_counts[bisect.bisect_left(LAG_BUCKETS, seconds)] += 1
        self.lag_sum += seconds

    def lag_quantile(self, q: float, counts: list | None = None) -> float | None:
        """Upper bucket bound below which a fraction ``q`` of the observed lags fall."""
        counts = counts if counts is not None else self.lag_counts
        total = sum(counts)
        if not total:
            return None
        running = 0
        for bound, count in zip((*LAG_BUCKETS, float("inf")), counts):
            running += count
            if running >= q * total:
                return bound
        return float("inf")

    def collect(self) -> list:
        """The metric families (``prometheus_client``'s collector protocol). Read from the
        metrics server's thread: copies of the event loop's dicts, no locks needed."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        counters, gauges = dict(self.counters), dict(self.gauges)
        out = []
        for name, help_text in COUNTERS.items():
            family = CounterMetricFamily(f"trainguard_{name}", help_text)
            family.add_metric([], counters[name])
            out.append(family)
        for name, help_text in GAUGES.items():
            labels = _LABELS.get(name, ())
            family = GaugeMetricFamily(f"trainguard_{name}", help_text, labels=list(labels))
            for (gname, pairs), value in sorted(gauges.items()):
                if gname == name:
                    given = dict(pairs)
                    family.add_metric([str(given.get(k, "")) for k in labels], value)
            out.append(family)
        family = histogram_family("trainguard_event_lag_seconds", LAG_HELP, LAG_BUCKETS)
        add_histogram(family, LAG_BUCKETS, list(self.lag_counts), self.lag_sum)
        out.append(family)
        return out

    def exposition(self) -> str:
        return exposition(self)
