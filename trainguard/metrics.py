"""Prometheus metrics of any trainguard service: declared up front, exposed and served with
``prometheus_client``.

Each service declares its metrics as :class:`Metric` tuples (name, kind, help, label names,
histogram buckets), so that docs, the Grafana dashboard and tests can read them without
running the service. A :class:`Registry` holds the values of one process (thread-safe) and
is a ``prometheus_client`` collector (:meth:`Registry.collect`); :func:`serve` answers
``GET /metrics`` from a daemon thread with ``prometheus_client``'s exposition (the text
format, or OpenMetrics when the scraper asks for it; gzip when accepted), beside the
standard ``process_*`` and ``python_*`` collectors of the process.

Names carry their unit: a counter ``x`` is exposed as ``trainguard_x_total``, a gauge or
histogram ``x`` as ``trainguard_x``, and a gauge's or histogram's name ends in its unit
(``_seconds``, ``_bytes``, ``_ratio``) or in the plural of what it counts (``_messages``,
``_partitions``, ``_stages``, ``_records``, ``_restarts``): :data:`UNITS`, checked by
:func:`check_name` when a metric is declared.

>>> r = Registry([Metric("orders_sent", "counter", "Orders sent.", labels=("op",)),
...               Metric("ack_seconds", "histogram", "Order to ack.", buckets=(1.0, 5.0))])
>>> r.inc("orders_sent", op="restart")
>>> r.observe("ack_seconds", 2.5)
>>> print(r.exposition())
# HELP trainguard_orders_sent_total Orders sent.
# TYPE trainguard_orders_sent_total counter
trainguard_orders_sent_total{op="restart"} 1.0
# HELP trainguard_ack_seconds Order to ack.
# TYPE trainguard_ack_seconds histogram
trainguard_ack_seconds_bucket{le="1.0"} 0.0
trainguard_ack_seconds_bucket{le="5.0"} 1.0
trainguard_ack_seconds_bucket{le="+Inf"} 1.0
trainguard_ack_seconds_count 1.0
trainguard_ack_seconds_sum 2.5
<BLANKLINE>
>>> r.value("orders_sent", op="restart"), r.value("orders_sent", op="evict")
(1, 0)
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import Callable, Iterable

__all__ = ["Metric", "Registry", "MetricsServer", "serve", "parse_exposition",
           "series_names", "PREFIX", "SECONDS_BUCKETS", "CONTENT_TYPE", "UNITS", "check_name",
           "process_registry", "histogram_family"]

PREFIX = "trainguard_"
CONTENT_TYPE = "text/plain"      # the text format (version 0.0.4 or 1.0.0, by client version)
#: default buckets for durations from a second to an hour
SECONDS_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
                   3600.0)
KINDS = ("counter", "gauge", "histogram")
#: what a gauge's or histogram's name ends in: a base unit, or the plural of what it counts
UNITS = ("seconds", "bytes", "ratio", "messages", "partitions", "stages", "records",
         "restarts", "ranks")


def check_name(full_name: str, kind: str) -> None:
    """Refuse a name without its unit: ``_total`` ends a counter (after its unit, if any); a
    gauge or histogram ends in one of :data:`UNITS`.

    >>> check_name("trainguard_consumer_lag", "gauge")
    Traceback (most recent call last):
    ...
    ValueError: metric trainguard_consumer_lag: a gauge's name ends in its unit (_seconds, _bytes, _ratio, _messages, _partitions, _stages, _records, _restarts, _ranks)
    """
    if not full_name.startswith(PREFIX):
        raise ValueError(f"metric {full_name}: must start with {PREFIX}")
    if kind == "counter":
        if not full_name.endswith("_total"):
            raise ValueError(f"metric {full_name}: a counter's name ends in _total")
        return
    if not full_name.endswith(tuple("_" + u for u in UNITS)):
        raise ValueError(f"metric {full_name}: a {kind}'s name ends in its unit ("
                         + ", ".join("_" + u for u in UNITS) + ")")


@dataclass(frozen=True)
class Metric:
    """One declared metric; ``name`` without the ``trainguard_`` prefix or ``_total``."""

    name: str
    kind: str
    help: str
    labels: tuple = ()
    buckets: tuple = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"metric {self.name}: kind must be one of {KINDS}")
        if self.kind == "histogram" and not self.buckets:
            object.__setattr__(self, "buckets", SECONDS_BUCKETS)
        check_name(self.full_name, self.kind)

    @property
    def full_name(self) -> str:
        return PREFIX + self.name + ("_total" if self.kind == "counter" else "")


def series_names(metrics: Iterable[Metric]) -> set:
    """Every name a scrape can show for ``metrics`` (a histogram's three series included).

    >>> sorted(series_names([Metric("lag_seconds", "histogram", "x", buckets=(1.0,))]))
    ['trainguard_lag_seconds', 'trainguard_lag_seconds_bucket', 'trainguard_lag_seconds_count', 'trainguard_lag_seconds_sum']
    """
    out = set()
    for m in metrics:
        out.add(m.full_name)
        if m.kind == "histogram":
            out |= {m.full_name + s for s in ("_bucket", "_sum", "_count")}
    return out


def _bound(value: float) -> str:
    from prometheus_client.utils import floatToGoString

    return floatToGoString(value)


def histogram_family(full: str, help_text: str, buckets, labels: tuple = ()):
    """An empty ``prometheus_client`` histogram family; :func:`add_histogram` fills it."""
    from prometheus_client.core import HistogramMetricFamily

    return HistogramMetricFamily(full, help_text, labels=list(labels))


def add_histogram(family, buckets, counts, total: float, label_values=()) -> None:
    """One series of ``family``: ``counts`` per bucket, one more above the last bound."""
    running, cumulative = 0, []
    for bound, count in zip(buckets, counts):
        running += count
        cumulative.append((_bound(bound), running))
    cumulative.append(("+Inf", running + counts[-1]))
    family.add_metric(list(label_values), cumulative, round(total, 6))


class Registry:
    """The values of declared metrics in one process. ``inc``, ``set`` and ``observe`` take the
    declared labels as keywords (all of them, no others); callbacks given to :meth:`on_collect`
    run before each scrape, to copy counters that other objects keep. A
    ``prometheus_client`` collector: :meth:`collect` yields its metric families."""

    def __init__(self, metrics: Iterable[Metric]):
        self.metrics = {m.name: m for m in metrics}
        self._values: dict = {name: {} for name in self.metrics}
        self._lock = threading.Lock()
        self._collectors: list = []

    def _key(self, name: str, labels: dict) -> tuple:
        metric = self.metrics[name]
        if set(labels) != set(metric.labels):
            raise ValueError(f"metric {name} takes labels {metric.labels}, got {tuple(labels)}")
        return tuple(str(labels[k]) for k in metric.labels)

    def inc(self, name: str, amount: float = 1, **labels) -> None:
        key = self._key(name, labels)
        with self._lock:
            series = self._values[name]
            series[key] = series.get(key, 0) + amount

    def set(self, name: str, value: float, **labels) -> None:
        key = self._key(name, labels)
        with self._lock:
            self._values[name][key] = value

    def observe(self, name: str, value: float, **labels) -> None:
        metric = self.metrics[name]
        key = self._key(name, labels)
        with self._lock:
            series = self._values[name]
            if key not in series:
                series[key] = [[0] * (len(metric.buckets) + 1), 0.0]
            counts_sum = series[key]
            counts_sum[0][bisect.bisect_left(metric.buckets, value)] += 1
            counts_sum[1] += value

    def value(self, name: str, **labels):
        """A counter's or gauge's value (0 when never set); a histogram's count."""
        got = self._values[name].get(self._key(name, labels), 0)
        return sum(got[0]) if isinstance(got, list) else got

    def on_collect(self, callback: Callable[["Registry"], None]) -> None:
        """Run ``callback(registry)`` before each scrape."""
        self._collectors.append(callback)

    def collect(self, callback: Callable[["Registry"], None] | None = None):
        """The metric families (``prometheus_client``'s collector protocol). Called with a
        callback, registers it instead (as :meth:`on_collect`; the older spelling)."""
        if callback is not None:
            self.on_collect(callback)
            return None
        return self._families()

    def _families(self) -> list:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for callback in self._collectors:
            callback(self)
        out = []
        with self._lock:
            for name, metric in self.metrics.items():
                full, labels = PREFIX + name, list(metric.labels)
                series = self._values[name]
                if metric.kind == "histogram":
                    family = histogram_family(full, metric.help, metric.buckets, metric.labels)
                    if not series and not labels:   # an unlabelled one shows from start
                        add_histogram(family, metric.buckets, [0] * (len(metric.buckets) + 1),
                                      0.0)
                    for key in sorted(series):
                        counts, total = series[key]
                        add_histogram(family, metric.buckets, counts, total, key)
                else:
                    kind = CounterMetricFamily if metric.kind == "counter" else GaugeMetricFamily
                    family = kind(full, metric.help, labels=labels)
                    if not series and not labels:
                        family.add_metric([], 0)
                    for key in sorted(series):
                        family.add_metric(list(key), series[key])
                out.append(family)
        return out

    def exposition(self) -> str:
        """This registry's metrics alone, in the text format (tests, docs)."""
        return exposition(self)


class _Families:
    """A collector of a function that gives metric families (or None: nothing yet)."""

    def __init__(self, families: Callable[[], Iterable]):
        self.families = families

    def collect(self):
        return list(self.families() or ())


def _collector(source):
    if callable(getattr(source, "collect", None)) and not isinstance(source, type):
        return source
    if callable(source):
        return _Families(source)
    raise TypeError(f"not a metrics source: {source!r}")


def exposition(*sources) -> str:
    """The text format of ``sources`` (collectors, or functions giving families)."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    for source in sources:
        registry.register(_collector(source))
    return generate_latest(registry).decode()


def process_registry(*sources):
    """A ``prometheus_client`` registry of ``sources`` with the standard collectors of this
    process: ``process_*`` (CPU seconds, resident and virtual memory bytes, open file
    descriptors, start time), ``python_info`` and ``python_gc_*``."""
    from prometheus_client import (CollectorRegistry, GCCollector, PlatformCollector,
                                   ProcessCollector)

    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    for source in sources:
        registry.register(_collector(source))
    return registry


def _app(registry):
    """``prometheus_client``'s WSGI app on ``/metrics``; 404 elsewhere."""
    from prometheus_client import make_wsgi_app

    metrics = make_wsgi_app(registry)

    def app(environ, start_response):
        if environ.get("PATH_INFO", "/").rstrip("/") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"only /metrics is here\n"]
        try:
            return metrics(environ, start_response)
        except Exception as exc:          # never let a scrape take the service down
            start_response("500 Internal Server Error",
                           [("Content-Type", "text/plain; charset=utf-8")])
            return [f"{type(exc).__name__}\n".encode()]
    return app


class MetricsServer:
    """``GET /metrics`` of ``source`` (a :class:`Registry`, any ``prometheus_client``
    collector, or a function giving metric families) and of the process's standard
    collectors, from a daemon thread; :meth:`close` stops it."""

    def __init__(self, source, port: int, bind: str = "127.0.0.1"):
        import socket
        import socketserver
        from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

        class Quiet(WSGIRequestHandler):
            def log_message(self, format, *args):  # scrapes every 15 s would flood stderr
                pass

        class Server(socketserver.ThreadingMixIn, WSGIServer):
            daemon_threads = True
            address_family = socket.AF_INET6 if ":" in bind else socket.AF_INET

        self.registry = process_registry(source)
        self.httpd = make_server(bind, port, _app(self.registry), Server, handler_class=Quiet)
        self.bind = bind
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={
            "poll_interval": 0.5}, name=f"trainguard-metrics-{self.port}", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.bind}]" if ":" in self.bind else self.bind
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def check_port(port, flag: str = "--metrics-port") -> int:
    """The port of a ``--metrics-port`` flag; raises ``UserError`` outside 0-65535."""
    from trainguard.errors import UserError

    if type(port) is not int or not 0 <= port <= 65535:
        raise UserError(f"{flag} {port!r} must be a port number 0-65535 (0: no metrics)")
    return port


def serve(source, port: int, bind: str = "127.0.0.1",
          flag: str = "--metrics-port") -> MetricsServer | None:
    """Serve ``source`` on ``bind:port`` (None for port 0: metrics off). A port that cannot
    be bound raises ``UserError`` naming the flag."""
    from trainguard.errors import UserError

    if check_port(port, flag) == 0:
        return None
    try:
        return MetricsServer(source, port, bind)
    except OSError as exc:
        raise UserError(f"{flag} {port}: cannot serve metrics on {bind}:{port}: "
                        f"{exc.strerror or exc}") from None


def parse_exposition(text: str) -> dict:
    """``{"name{labels}": value}`` from exposition text (for tests and benchmarks).

    >>> parse_exposition('# HELP x y\\nx_total 4\\nlag{topic="t"} 2.5\\n')
    {'x_total': 4.0, 'lag{topic="t"}': 2.5}
    """
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
