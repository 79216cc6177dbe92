"""Logs of every trainguard command: the standard :mod:`logging` module, one handler on
stderr, two formats.

Every subcommand takes ``--log-level debug|info|warning|error`` and ``--log-format
text|json`` (defaults: ``$TRAINGUARD_LOG_LEVEL``, ``$TRAINGUARD_LOG_FORMAT``, else ``info``
for the services and ``warning`` for the one-shot tools, and ``text``); the worker keeps
``--loglevel`` as an alias. :func:`setup` installs the handler on the root logger (so the
lines of Kafka and Faust libraries come out in the same format); the training-rank library
(:mod:`trainguard.collectors.api`) never calls it: a rank's logging is its own.

``text`` is one line a record, as the services always wrote them::

    14:02:07 trainguard actions: anomaly a1 (hang, critical, job llama) -> restart

(a library's record has its logger's name before the message). ``json`` is one JSON object a
line with ``ts`` (RFC 3339, UTC), ``level``, ``service``, ``logger``, ``message``, and the
fields ``job``, ``rank`` and ``incident`` (null when the line is about none), plus
``exc`` when an exception is logged. A line gets its fields from ``extra=``
(``log.info("...", extra={"job": j})``), or from :func:`context` for everything logged in a
block (a thread's or task's own: :mod:`contextvars`), or from :func:`setup`'s ``fields`` for
the whole process (``trainguard run --job J``).

>>> import io
>>> out = io.StringIO()
>>> handler = setup("actions", "info", "json", stream=out)
>>> with context(job="j1", incident="inc-7"):
...     logging.getLogger("trainguard.actions").warning("restart ordered", extra={"rank": 3})
>>> line = json.loads(out.getvalue())
>>> line["service"], line["level"], line["message"], line["job"], line["rank"], line["incident"]
('actions', 'warning', 'restart ordered', 'j1', 3, 'inc-7')
>>> teardown(handler)
"""
from __future__ import annotations

import contextlib
import contextvars
import datetime as _dt
import json
import logging
import os
import sys
import time

__all__ = ["LEVELS", "FORMATS", "FIELDS", "add_log_flags", "setup", "setup_from_args",
           "teardown", "context", "TextFormatter", "JsonFormatter", "level_number",
           "service_logger", "banner", "configured", "add_fields"]

#: the ``--log-level`` choices; ``warn`` and ``crit`` (the worker's old names) also read
LEVELS = ("debug", "info", "warning", "error")
_NUMBERS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
            "warn": logging.WARNING, "error": logging.ERROR, "crit": logging.CRITICAL,
            "critical": logging.CRITICAL}
FORMATS = ("text", "json")
#: fields of every JSON line (null when unknown)
FIELDS = ("job", "rank", "incident")
LEVEL_ENV, FORMAT_ENV = "TRAINGUARD_LOG_LEVEL", "TRAINGUARD_LOG_FORMAT"
#: commands that run until stopped: ``info`` by default (the worker: ``warning``)
SERVICES = ("worker", "actions", "agent", "run", "up", "demo")

_context: contextvars.ContextVar = contextvars.ContextVar("trainguard_log_fields", default={})


def level_number(name: str) -> int:
    """``logging``'s number of a level name (``warn``/``crit`` too).

    >>> level_number("warn") == logging.WARNING, level_number("debug")
    (True, 10)
    """
    try:
        return _NUMBERS[str(name).lower()]
    except KeyError:
        raise ValueError(f"log level {name!r} must be one of {', '.join(LEVELS)}") from None


def _env_choice(name: str, choices, fallback: str) -> str:
    value = os.environ.get(name, "").strip().lower()
    return value if value in choices else fallback


def add_log_flags(parser, default_level: str = "info", aliases: tuple = (),
                  dest: str = "log_level", choices: tuple = LEVELS) -> None:
    """``--log-level`` (and ``aliases``, e.g. the worker's ``--loglevel``) and
    ``--log-format`` of one command; no-op where the command has them already."""
    if any("--log-format" in a.option_strings for a in parser._actions):
        return
    group = parser.add_argument_group("logging")
    level = _env_choice(LEVEL_ENV, choices, default_level)
    group.add_argument("--log-level", *aliases, dest=dest, default=level, choices=choices,
                       metavar="LEVEL", help=f"{'|'.join(LEVELS)} (default {level}; "
                       f"${LEVEL_ENV})")
    fmt = _env_choice(FORMAT_ENV, FORMATS, "text")
    group.add_argument("--log-format", default=fmt, choices=FORMATS,
                       help=f"text: one line a record; json: one JSON object a line with "
                            f"job, rank and incident fields (default {fmt}; ${FORMAT_ENV})")


@contextlib.contextmanager
def context(**fields):
    """Fields (``job``, ``rank``, ``incident``, ...) of every record logged in the block by
    this thread or task; ``None`` values are left out."""
    token = _context.set({**_context.get(), **{k: v for k, v in fields.items()
                                               if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


class _Fields(logging.Filter):
    """Puts the process's and the block's fields on each record that lacks them."""

    def __init__(self, service: str, fields: dict):
        super().__init__()
        self.service = service
        self.fields = {k: v for k, v in fields.items() if v is not None}

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        for source in (_context.get(), self.fields):
            for key, value in source.items():
                if getattr(record, key, None) is None:
                    setattr(record, key, value)
        return True


class TextFormatter(logging.Formatter):
    """``HH:MM:SS trainguard <service>: message``; a library's record (a logger outside
    ``trainguard``) has its logger's name before the message."""

    def __init__(self, service: str):
        super().__init__("%(asctime)s %(message)s", "%H:%M:%S")
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        stamp, _, message = text.partition(" ")
        name = record.name
        own = name == "trainguard" or name.startswith("trainguard.") or name == "root"
        if own and message.startswith(f"trainguard {self.service} "):
            return f"{stamp} {message}"         # a line that names its service already
        if own and name.endswith(".kafka"):     # librdkafka's own lines, as before
            message = f"kafka: {message}"
        return f"{stamp} trainguard {self.service}: " + (message if own else
                                                          f"{name}: {message}")


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts, level, service, logger, message, job, rank, incident
    (null when unknown), the other fields given, and exc."""

    RESERVED = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "service"}

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        ts = _dt.datetime.fromtimestamp(record.created, _dt.timezone.utc)
        out = {"ts": ts.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ts.microsecond // 1000:03d}Z",
               "level": record.levelname.lower(), "service": self.service,
               "logger": record.name, "message": record.getMessage()}
        for key in FIELDS:
            out[key] = getattr(record, key, None)
        for key, value in vars(record).items():
            if key not in self.RESERVED and key not in out and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        return json.dumps(out, default=str, ensure_ascii=False)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record comes (a test's capture too)."""

    def __init__(self, stream=None):
        super().__init__(stream or sys.stderr)
        self._fixed = stream is not None

    @property
    def stream(self):
        return self._stream if self._fixed else sys.stderr

    @stream.setter
    def stream(self, value):
        self._stream = value

    def flush(self) -> None:
        try:
            super().flush()
        except ValueError:       # a closed capture stream
            pass


def setup(service: str, level: str = "info", fmt: str = "text", *, stream=None,
          fields: dict | None = None) -> logging.Handler:
    """The one handler of this process, on the root logger, at ``level``; replaces the one a
    previous call installed. ``fields``: of every record (``{"job": "j1"}``)."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r} must be one of {', '.join(FORMATS)}")
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_trainguard", False)]:
        teardown(old)
    handler = _StderrHandler(stream)
    handler._trainguard = True
    handler._previous_level = root.level
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter(service))
    handler.addFilter(_Fields(service, fields or {}))
    root.addHandler(handler)
    root.setLevel(level_number(level))
    return handler


def setup_from_args(args, service: str, default_level: str = "info",
                    fields: dict | None = None) -> logging.Handler:
    """:func:`setup` with ``args.log_level`` (or the worker's ``args.loglevel``) and
    ``args.log_format``; the ones a command was called without take the defaults."""
    level = (getattr(args, "log_level", None) or getattr(args, "loglevel", None)
             or _env_choice(LEVEL_ENV, LEVELS, default_level))
    fmt = getattr(args, "log_format", None) or _env_choice(FORMAT_ENV, FORMATS, "text")
    return setup(service, level, fmt, fields=fields)


def add_fields(**fields) -> None:
    """More fields of every record of this process (the agent's ``node``, once known)."""
    for handler in logging.getLogger().handlers:
        if getattr(handler, "_trainguard", False):
            for f in handler.filters:
                if isinstance(f, _Fields):
                    f.fields.update({k: v for k, v in fields.items() if v is not None})


def own_handler() -> logging.Handler | None:
    """The handler :func:`setup` installed in this process, or None."""
    for handler in logging.getLogger().handlers:
        if getattr(handler, "_trainguard", False):
            return handler
    return None


def configured() -> bool:
    """Whether :func:`setup` installed its handler in this process."""
    return own_handler() is not None


def teardown(handler: logging.Handler | None) -> None:
    """Remove a handler :func:`setup` installed (and put the root level back)."""
    if handler is None:
        return
    root = logging.getLogger()
    if handler in root.handlers:
        root.removeHandler(handler)
        root.setLevel(getattr(handler, "_previous_level", logging.WARNING))
    handler.close()


def banner(service: str) -> logging.Logger:
    """The logger of a service's start and stop lines: at ``info``, shown whatever
    ``--log-level`` says (an operator always sees that a service is up, and where)."""
    logger = logging.getLogger(f"trainguard.{service}.banner")
    logger.setLevel(logging.INFO)
    return logger


def service_logger(name: str, prefix: str, level: int = logging.INFO, stamp: bool = True):
    """A ``log(message)`` callable (the shape the services pass around) that writes one
    record of logger ``name`` at ``level``, with keyword fields (``incident=...``). Before
    :func:`setup` has run (a module used on its own, in a test) the line goes to stderr as
    it always did: ``[HH:MM:SS ]<prefix>: message``."""
    logger = logging.getLogger(name)

    def log(message: str, **fields) -> None:
        if not configured():
            when = f"{time.strftime('%H:%M:%S')} " if stamp else ""
            print(f"{when}{prefix}: {message}", file=sys.stderr, flush=True)
            return
        logger.log(level, message, extra=fields or None)

    log.logger = logger
    return log
