"""The ``kafka`` section of the configuration tree: where the brokers are and how to reach
them. :func:`trainguard.configsections.kafka_config` makes the client's
:class:`~trainguard.config.Config` of it (with ``topics.prefix``).

>>> from trainguard.setting import validate
>>> validate(KafkaSettings(bootstrap=""), "kafka.")
Traceback (most recent call last):
...
trainguard.config.ConfigError: kafka.bootstrap must be a text of at least 1 characters, got ''
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import DEFAULT_BOOTSTRAP
from .setting import setting, table

__all__ = ["KafkaSettings"]


@dataclass(kw_only=True)
class KafkaSettings:
    bootstrap: str = setting(DEFAULT_BOOTSTRAP, "bootstrap servers, host:port[,host:port]",
                             env="TRAINGUARD_BOOTSTRAP", min_length=1)
    client_config: str | None = setting(None, "file of librdkafka key=value settings (SASL, "
                                              "SSL); ${VAR} is expanded",
                                        env="TRAINGUARD_KAFKA_CONFIG", kind=str, min_length=1)
    client: dict = table("librdkafka settings as a table, over those of client_config")
