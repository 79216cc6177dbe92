"""The SPEC §2 topics: names from :class:`~trainguard.config.Topics`, created idempotently."""
from __future__ import annotations

from .errors import UserError

from dataclasses import dataclass

from .config import DEFAULT_PREFIX, Config
from .setting import setting

DEFAULT_TELEMETRY_PARTITIONS = 24
#: topics that keep the latest record per key (the config topic: each job's overrides)
COMPACTED_CONFIG = {"cleanup.policy": "compact"}
#: on a cluster of at least this many brokers, topics get 3 replicas, 2 of which must be
#: in sync for a write (``acks=all``) to succeed: one broker may die without losing a
#: record or stopping writes
REPLICATED_BROKERS = 3


def replication(brokers: int) -> tuple[int, dict]:
    """``(replication factor, topic config)`` for a cluster of ``brokers`` brokers; -1 (the
    broker's ``default.replication.factor``) below three brokers.

    >>> replication(1), replication(3)
    ((-1, {}), (3, {'min.insync.replicas': '2'}))
    """
    if brokers >= REPLICATED_BROKERS:
        return 3, {"min.insync.replicas": "2"}
    return -1, {}


class TopicError(UserError, ValueError):
    """Topics could not be created; the message says why."""


@dataclass(kw_only=True, frozen=True)
class TopicPlan:
    """Partition counts per topic. Telemetry is keyed by job and rank, so a large job
    spreads over as many workers as it has partitions."""

    telemetry_partitions: int = setting(DEFAULT_TELEMETRY_PARTITIONS,
                                        "partitions of the telemetry topic", minimum=1)
    other_partitions: int = setting(4, "partitions of the other topics", minimum=1)
    deadletter_partitions: int = setting(1, "partitions of the dead-letter topic", minimum=1)

    def __post_init__(self):
        for name in ("telemetry_partitions", "other_partitions", "deadletter_partitions"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise TopicError(f"{name} must be an integer of at least 1, got {value!r}")

    def partitions(self, config: Config) -> dict[str, int]:
        topics = config.topics
        plan = {name: self.other_partitions for name in topics.all()}
        plan[topics.telemetry] = self.telemetry_partitions
        plan[topics.deadletter] = self.deadletter_partitions
        return plan


@dataclass(kw_only=True, frozen=True)
class TopicNames:
    prefix: str = setting(DEFAULT_PREFIX, "topic prefix: <prefix>.telemetry, ...",
                          env="TRAINGUARD_TOPIC_PREFIX", pattern=r"[A-Za-z0-9._-]{1,100}")


@dataclass(kw_only=True, frozen=True)
class TopicsSettings(TopicPlan, TopicNames):
    """The ``topics`` section of the configuration tree: the names' prefix, then the
    partitions (:class:`TopicPlan`)."""


def create_topics(config: Config, plan: TopicPlan = TopicPlan(), timeout: float = 30.0,
                  extra: dict[str, int] | None = None) -> dict[str, str]:
    """Create what is missing; returns ``{topic: "created" | "exists"}``."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient(config.kafka())
    wanted = {**plan.partitions(config), **(extra or {})}
    hint = "start one with `trainguard broker start` or set --bootstrap"
    if refused_everywhere(config.bootstrap):
        raise TopicError(f"cannot reach Kafka at {config.bootstrap}: every bootstrap address "
                         f"refused the connection; {hint}")
    try:
        metadata = admin.list_topics(timeout=timeout)
    except KafkaException as exc:
        raise TopicError(f"cannot reach Kafka at {config.bootstrap}: {exc.args[0].str()}; "
                         f"{hint}") from None
    existing = metadata.topics
    factor, replicated = replication(len(metadata.brokers))
    result = {name: "exists" for name in wanted if name in existing}
    new = [NewTopic(name, num_partitions=count, replication_factor=factor,
                    config={**replicated,
                            **(COMPACTED_CONFIG if name == config.topics.config else {})})
           for name, count in wanted.items() if name not in existing]
    if new:
        futures = admin.create_topics(new, operation_timeout=timeout, request_timeout=timeout)
        for name, future in futures.items():
            try:
                future.result()
                result[name] = "created"
            except KafkaException as exc:
                error = exc.args[0]
                if error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    result[name] = "exists"
                else:
                    raise TopicError(f"creating topic {name} failed: {error.str()}") from None
    _wait_until_visible(admin, list(wanted), timeout)
    return result


def refused_everywhere(bootstrap: str, probe_s: float = 2.0) -> bool:
    """True when every ``host:port`` of ``bootstrap`` actively refuses a TCP connection
    (nothing listens there), so that a command need not wait out the client's timeout. A
    slow or filtered address is not a refusal: the client's own timeout judges it.

    >>> import socket
    >>> s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    >>> refused_everywhere(f"127.0.0.1:{port}")
    True
    """
    import socket

    addresses = [a.strip() for a in bootstrap.split(",") if a.strip()]
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]") or "localhost", int(port)),
                                          timeout=probe_s):
                return False
        except ConnectionRefusedError:
            continue
        except (OSError, ValueError):
            return False
    return bool(addresses)


def _wait_until_visible(admin, names, timeout):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        topics = admin.list_topics(timeout=timeout).topics
        if all(name in topics and not topics[name].error and topics[name].partitions
               for name in names):
            return
        time.sleep(0.2)
    raise TopicError(f"topics {names} did not become visible within {timeout:.0f}s")
