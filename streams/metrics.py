"""The worker's Prometheus metrics, exposed with ``prometheus_client`` (:meth:`Metrics.collect`).

Counters (``_total``): ``trainguard_events_in_total`` telemetry messages consumed,
``trainguard_invalid_total`` of them dead-lettered, ``trainguard_anomalies_out_total``
anomalies produced, ``trainguard_partitions_unreadable_total`` times a telemetry partition lost
the broker it is fetched from, ``trainguard_summaries_out_total`` /
``trainguard_summaries_in_total`` messages on the internal summaries topic,
``trainguard_items_applied_total`` summary items given to job stages,
``trainguard_replayed_total`` messages skipped because a restored state had already seen them,
``trainguard_snapshots_total``, ``trainguard_gc_collections_total`` and
``trainguard_gc_seconds_total`` (the worker's scheduled garbage collections).
Gauges: ``trainguard_consumer_lag_messages{topic}`` messages not yet read (high watermark
minus position, summed over this worker's partitions), ``trainguard_assigned_partitions{topic}``,
``trainguard_rank_stages``, ``trainguard_unreadable_partitions``,
``trainguard_job_stages``, ``trainguard_late_step_records``,
``trainguard_held_records``, ``trainguard_released_early_records``,
``trainguard_superseded_records``,
``trainguard_behind_partitions``, ``trainguard_unread_partitions``,
``trainguard_unseen_ranks``.
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

from trainguard.metrics import add_histogram, exposition, histogram_family, parse_exposition
from trainguard.service_metrics import (WORKER_COUNTERS as COUNTERS, WORKER_GAUGES as GAUGES,
                                        WORKER_LABELS, WORKER_LAG_BUCKETS as LAG_BUCKETS,
                                        WORKER_LAG_HELP as LAG_HELP, worker_declared as declared)

__all__ = ["Metrics", "COUNTERS", "GAUGES", "LAG_BUCKETS", "declared", "parse_exposition"]


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
            labels = WORKER_LABELS.get(name, ())
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
