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

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"
DEFAULT_PREFIX = "tg"
TOPIC_SUFFIXES = ("telemetry", "commands", "stacks", "anomalies", "actions", "deadletter",
                  "orders")
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
        return cls(bootstrap=bootstrap, topics=Topics(prefix=prefix), client_settings=settings)

    def kafka(self, **overrides) -> dict:
        """confluent-kafka / librdkafka settings: bootstrap, pass-through settings, overrides."""
        return {"bootstrap.servers": self.bootstrap, **self.client_settings, **overrides}

    def faust_broker(self) -> str:
        return ";".join(f"kafka://{server}" for server in self.bootstrap.split(","))
