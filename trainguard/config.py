"""Where trainguard finds Kafka, and what it calls its topics.

Bootstrap servers come from ``--bootstrap`` or ``TRAINGUARD_BOOTSTRAP``; the default is
the local broker, ``127.0.0.1:9092``. For real clusters, Kafka client settings (SASL,
SSL, ...) are passed through from a config file (``--kafka-config FILE`` or
``TRAINGUARD_KAFKA_CONFIG``) of ``key=value`` lines in librdkafka's names, e.g.::

    security.protocol=SASL_SSL
    sasl.mechanism=SCRAM-SHA-512
    sasl.username=trainguard
    sasl.password=${KAFKA_PASSWORD}

``${VAR}`` is replaced from the environment, so secrets need not sit in the file.
Environment is read only by :func:`Config.from_env`, never in a constructor.
"""
from __future__ import annotations

from .errors import UserError

import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_PREFIX = "tg"
TOPIC_SUFFIXES = ("telemetry", "commands", "stacks", "anomalies", "actions", "deadletter",
                  "orders", "config")
_PREFIX_RE = re.compile(r"[A-Za-z0-9._-]{1,100}")
_VAR_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class ConfigError(UserError):
    """A setting is wrong; the message says which and how to mend it."""


@dataclass(kw_only=True, frozen=True)
class Topics:
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self):
        if not _PREFIX_RE.fullmatch(self.prefix):
            raise ConfigError(f"topic prefix {self.prefix!r} must be 1-100 of [A-Za-z0-9._-]")

    @property
    def telemetry(self) -> str:
        return f"{self.prefix}.telemetry"

    @property
    def commands(self) -> str:
        return f"{self.prefix}.commands"

    @property
    def stacks(self) -> str:
        return f"{self.prefix}.stacks"

    @property
    def anomalies(self) -> str:
        return f"{self.prefix}.anomalies"

    @property
    def actions(self) -> str:
        return f"{self.prefix}.actions"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}.deadletter"

    @property
    def orders(self) -> str:
        """SPEC §6: orders to ``trainguard run`` and drivers, and their acks."""
        return f"{self.prefix}.orders"

    @property
    def config(self) -> str:
        """Per-job overrides of detector settings at runtime (compacted, keyed by job;
        :mod:`trainguard.overrides`)."""
        return f"{self.prefix}.config"

    def all(self) -> list[str]:
        return [f"{self.prefix}.{suffix}" for suffix in TOPIC_SUFFIXES]


def load_client_settings(path: str | Path, environ=None) -> dict[str, str]:
    """Read a ``key=value`` librdkafka settings file (``#`` comments, ``${VAR}`` expansion)."""
    environ = os.environ if environ is None else environ
    settings = {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read Kafka config file {path}: {exc.strerror}") from None
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{path}:{number}: expected key=value, got {line[:60]!r}")

        def expand(match):
            name = match.group(1)
            if name not in environ:
                raise ConfigError(f"{path}:{number}: environment variable {name} is not set")
            return environ[name]

        settings[key.strip()] = _VAR_RE.sub(expand, value.strip())
    return settings


def check_client_settings(settings: dict, source) -> None:
    """Let librdkafka judge the settings now (unknown key, bad value), not deep in a command.

    A client without ``bootstrap.servers`` connects nowhere; it is dropped at once."""
    from confluent_kafka import KafkaException, Producer

    try:
        Producer({**settings, "log_level": 0})
    except KafkaException as exc:
        raise ConfigError(f"Kafka config {source}: {exc.args[0].str()}") from None


@dataclass(kw_only=True, frozen=True)
class Config:
    """Kafka connection and topic naming shared by every trainguard process."""

    bootstrap: str = DEFAULT_BOOTSTRAP
    topics: Topics = field(default_factory=Topics)
    client_settings: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.bootstrap or any(" " in part for part in self.bootstrap.split(",")):
            raise ConfigError(f"bootstrap servers {self.bootstrap!r} must be host:port[,host:port]")
        for server in self.bootstrap.split(","):
            host, _, port = server.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"bootstrap server {server!r} must be host:port")
            if not 0 < int(port) < 65536:
                raise ConfigError(f"bootstrap server {server!r}: port {port} is not 1-65535")

    @classmethod
    def from_env(cls, bootstrap: str | None = None, prefix: str | None = None,
                 kafka_config: str | None = None, environ=None) -> "Config":
        """Flags first, then ``TRAINGUARD_BOOTSTRAP`` / ``TRAINGUARD_TOPIC_PREFIX`` /
        ``TRAINGUARD_KAFKA_CONFIG``, then the defaults."""
        environ = os.environ if environ is None else environ
        bootstrap = bootstrap or environ.get("TRAINGUARD_BOOTSTRAP") or DEFAULT_BOOTSTRAP
        prefix = prefix or environ.get("TRAINGUARD_TOPIC_PREFIX") or DEFAULT_PREFIX
        kafka_config = kafka_config or environ.get("TRAINGUARD_KAFKA_CONFIG")
        settings = load_client_settings(kafka_config, environ) if kafka_config else {}
        if settings:
            check_client_settings(settings, kafka_config)
        return cls(bootstrap=bootstrap, topics=Topics(prefix=prefix), client_settings=settings)

    def kafka(self, **overrides) -> dict:
        """confluent-kafka / librdkafka settings: bootstrap, pass-through settings, overrides;
        librdkafka's own log lines go to :func:`kafka_logger` unless ``logger`` is given."""
        return {"bootstrap.servers": self.bootstrap, "logger": kafka_logger(),
                **self.client_settings, **overrides}

    def faust_broker(self) -> str:
        return ";".join(f"kafka://{server}" for server in self.bootstrap.split(","))


_DIGITS_RE = re.compile(r"\d+")


class _OncePerText(logging.Filter):
    """Passes a warning or error once per ``every`` seconds per text (digits ignored).

    With the broker unreachable, librdkafka logs each failed connection attempt of each of
    its threads: hundreds of lines before the command's own one-line error.
    """

    def __init__(self, every: float = 600.0, clock=time.monotonic):
        super().__init__()
        self.every = every
        self.clock = clock
        self.last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return False
        key = _DIGITS_RE.sub("#", record.getMessage())
        now = self.clock()
        if now - self.last.get(key, -self.every) < self.every:
            return False
        if len(self.last) > 1000:
            self.last.clear()
        self.last[key] = now
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (tests swap it); in a command whose
    log is set up (:mod:`trainguard.logs`: a service, never a training rank), hands the
    record to that log instead, so that it has the command's format."""

    def emit(self, record) -> None:
        from trainguard.logs import own_handler

        handler = own_handler()
        if handler is not None:
            handler.handle(record)
            return
        super().emit(record)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def kafka_logger() -> logging.Logger:
    """The Python logger librdkafka's lines go to: ``trainguard.kafka``, warnings and errors
    only, each distinct line once per 10 minutes, on stderr."""
    logger = logging.getLogger("trainguard.kafka")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.addFilter(_OncePerText())
        handler.setFormatter(logging.Formatter("trainguard: kafka: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    return logger
