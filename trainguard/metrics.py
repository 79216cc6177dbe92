"""Prometheus metrics of any trainguard service: declared up front, served over plain HTTP.

Each service declares its metrics as :class:`Metric` tuples (name, kind, help, label names,
histogram buckets), so that docs, the Grafana dashboard and tests can read them without
running the service. A :class:`Registry` holds the values of one process (thread-safe) and
writes them in the Prometheus text exposition format (version 0.0.4); :func:`serve` answers
``GET /metrics`` from a daemon thread with the standard library's ``http.server``.

Names: a counter ``x`` is exposed as ``trainguard_x_total``, a gauge or histogram ``x`` as
``trainguard_x`` (a histogram with ``_bucket``, ``_sum`` and ``_count``).

>>> r = Registry([Metric("orders_sent", "counter", "Orders sent.", labels=("op",)),
...               Metric("ack_seconds", "histogram", "Order to ack.", buckets=(1.0, 5.0))])
>>> r.inc("orders_sent", op="restart")
>>> r.observe("ack_seconds", 2.5)
>>> print(r.exposition())
# HELP trainguard_orders_sent_total Orders sent.
# TYPE trainguard_orders_sent_total counter
trainguard_orders_sent_total{op="restart"} 1
# HELP trainguard_ack_seconds Order to ack.
# TYPE trainguard_ack_seconds histogram
trainguard_ack_seconds_bucket{le="1.0"} 0
trainguard_ack_seconds_bucket{le="5.0"} 1
trainguard_ack_seconds_bucket{le="+Inf"} 1
trainguard_ack_seconds_sum 2.5
trainguard_ack_seconds_count 1
<BLANKLINE>
>>> r.value("orders_sent", op="restart"), r.value("orders_sent", op="evict")
(1, 0)
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable

__all__ = ["Metric", "Registry", "MetricsServer", "serve", "parse_exposition",
           "format_histogram", "series_names", "PREFIX", "SECONDS_BUCKETS", "CONTENT_TYPE"]

PREFIX = "trainguard_"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: default buckets for durations from a second to an hour
SECONDS_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
                   3600.0)
KINDS = ("counter", "gauge", "histogram")


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

    @property
    def full_name(self) -> str:
        return PREFIX + self.name + ("_total" if self.kind == "counter" else "")


def series_names(metrics: Iterable[Metric]) -> set:
    """Every name a scrape can show for ``metrics`` (a histogram's three series included).

    >>> sorted(series_names([Metric("lag", "histogram", "x", buckets=(1.0,))]))
    ['trainguard_lag', 'trainguard_lag_bucket', 'trainguard_lag_count', 'trainguard_lag_sum']
    """
    out = set()
    for m in metrics:
        out.add(m.full_name)
        if m.kind == "histogram":
            out |= {m.full_name + s for s in ("_bucket", "_sum", "_count")}
    return out


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _number(value) -> str:
    return str(int(value)) if isinstance(value, int) or float(value).is_integer() and \
        abs(value) < 1e15 else repr(float(value))


def format_histogram(full: str, buckets, counts, total: float, pairs=()) -> list:
    """The ``_bucket``/``_sum``/``_count`` lines of one histogram series; ``counts`` has one
    more entry than ``buckets`` (above the last bound)."""
    lines, running = [], 0
    for bound, count in zip(buckets, counts):
        running += count
        lines.append(f"{full}_bucket{_labels((*pairs, ('le', bound)))} {running}")
    running += counts[-1]
    lines += [f"{full}_bucket{_labels((*pairs, ('le', '+Inf')))} {running}",
              f"{full}_sum{_labels(pairs)} {round(total, 6)}",
              f"{full}_count{_labels(pairs)} {running}"]
    return lines


class Registry:
    """The values of declared metrics in one process. ``inc``, ``set`` and ``observe`` take the
    declared labels as keywords (all of them, no others); callbacks given to :meth:`collect`
    run before each exposition, to copy counters that other objects keep."""

    def __init__(self, metrics: Iterable[Metric]):
        self.metrics = {m.name: m for m in metrics}
        self._values: dict = {name: {} for name in self.metrics}
        self._lock = threading.Lock()
        self._collectors: list = []

    def _key(self, name: str, labels: dict) -> tuple:
        metric = self.metrics[name]
        if set(labels) != set(metric.labels):
            raise ValueError(f"metric {name} takes labels {metric.labels}, got {tuple(labels)}")
        return tuple((k, str(labels[k])) for k in metric.labels)

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

    def collect(self, callback: Callable[["Registry"], None]) -> None:
        self._collectors.append(callback)

    def exposition(self) -> str:
        for callback in self._collectors:
            callback(self)
        lines = []
        with self._lock:
            for name, metric in self.metrics.items():
                full = metric.full_name
                lines += [f"# HELP {full} {_escape(metric.help)}", f"# TYPE {full} {metric.kind}"]
                series = self._values[name]
                if not series and not metric.labels:  # an unlabelled one shows from start
                    lines += format_histogram(full, metric.buckets, [0] * (len(
                        metric.buckets) + 1), 0.0) if metric.kind == "histogram" else [f"{full} 0"]
                for key in sorted(series):
                    if metric.kind == "histogram":
                        counts, total = series[key]
                        lines += format_histogram(full, metric.buckets, counts, total, key)
                    else:
                        lines.append(f"{full}{_labels(key)} {_number(series[key])}")
        return "\n".join(lines) + "\n"


class _Handler(BaseHTTPRequestHandler):
    exposition: Callable[[], str] = None

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path.split("?")[0] != "/metrics":
            self.send_error(404, "only /metrics is here")
            return
        try:
            body = type(self).exposition().encode()
        except Exception as exc:  # never let a scrape take the service down
            self.send_error(500, f"{type(exc).__name__}")
            return
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args):  # scrapes every 15 s would flood stderr
        pass


class MetricsServer:
    """``GET /metrics`` of one registry (or of a function giving exposition text), from a
    daemon thread; :meth:`close` stops it."""

    def __init__(self, registry: Registry | Callable[[], str], port: int,
                 bind: str = "127.0.0.1"):
        text = registry.exposition if isinstance(registry, Registry) else registry
        handler = type("MetricsHandler", (_Handler,), {"exposition": staticmethod(text)})
        self.httpd = ThreadingHTTPServer((bind, port), handler)
        self.httpd.daemon_threads = True
        self.bind = bind
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={
            "poll_interval": 0.5}, name=f"trainguard-metrics-{self.port}", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.bind}:{self.port}/metrics"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def check_port(port, flag: str = "--metrics-port") -> int:
    """The port of a ``--metrics-port`` flag; raises ``UserError`` outside 0-65535."""
    from trainguard.errors import UserError

    if type(port) is not int or not 0 <= port <= 65535:
        raise UserError(f"{flag} {port!r} must be a port number 0-65535 (0: no metrics)")
    return port


def serve(registry: Registry | Callable[[], str], port: int, bind: str = "127.0.0.1",
          flag: str = "--metrics-port") -> MetricsServer | None:
    """Serve ``registry`` on ``bind:port`` (None for port 0: metrics off). A port that cannot
    be bound raises ``UserError`` naming the flag."""
    from trainguard.errors import UserError

    if check_port(port, flag) == 0:
        return None
    try:
        return MetricsServer(registry, port, bind)
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
