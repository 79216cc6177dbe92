"""The Kafka flags every networked command takes, and the :class:`~trainguard.config.Config`
they give. Its own module so that the command modules (``cli``, ``configcli``,
``feedbackcli``) share it without importing each other."""
from __future__ import annotations

import argparse

__all__ = ["add_kafka_flags", "config_from"]


def add_kafka_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Kafka")
    group.add_argument("--bootstrap", metavar="HOST:PORT[,...]",
                       help="bootstrap servers (default: $TRAINGUARD_BOOTSTRAP or 127.0.0.1:9092)")
    group.add_argument("--prefix", metavar="PREFIX",
                       help="topic prefix (default: $TRAINGUARD_TOPIC_PREFIX or tg)")
    group.add_argument("--kafka-config", metavar="FILE",
                       help="librdkafka key=value settings (SASL/SSL) for real clusters "
                            "(default: $TRAINGUARD_KAFKA_CONFIG)")


def config_from(args):
    """The Kafka configuration of a parsed command line: the configuration tree's when the
    command loaded one that sets ``kafka.bootstrap``, else the flags over the environment."""
    from .config import Config

    if getattr(args, "tree", None) is not None and "kafka.bootstrap" in args.tree.keys:
        from .configsections import kafka_config

        return kafka_config(args.tree)
    return Config.from_env(bootstrap=getattr(args, "bootstrap", None),
                           prefix=getattr(args, "prefix", None),
                           kafka_config=getattr(args, "kafka_config", None))
