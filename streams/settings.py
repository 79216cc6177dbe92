"""How one ``trainguard worker`` is set up: names of its internal topics, its timings, and
the Kafka client settings in the dialects of aiokafka and Faust.

Internal names derive from the Faust app id ``<prefix>.<id>`` (``--prefix``, ``--id``):
the consumer groups ``<app>`` (job side, Faust) and ``<app>-ranks`` (rank side), the
summaries topic ``<app>-summaries`` (repartition by job), the compacted rank-state topic
``<app>-rank-state`` and the job table's changelog ``<app>-job-state-changelog``. Workers
with one prefix and id share the work; another id is an independent deployment.

>>> s = WorkerSettings(prefix="tg", worker_id="w1")
>>> s.app_id, s.summaries_topic, s.rank_state_topic, s.job_changelog_topic
('tg.w1', 'tg.w1-summaries', 'tg.w1-rank-state', 'tg.w1-job-state-changelog')
>>> WorkerSettings(prefix="tg", worker_id="a b")
Traceback (most recent call last):
...
trainguard.config.ConfigError: worker.worker_id must match [A-Za-z0-9._-]{1,100}, got 'a b'
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from trainguard.config import Config, ConfigError
from trainguard.setting import setting, validate
from trainguard.topics import TopicPlan, create_topics, replication

__all__ = ["WorkerSettings", "aiokafka_security", "faust_credentials", "ensure_topics"]

log = logging.getLogger(__name__)
JOB_TABLE = "job-state"
STATE_MAX_BYTES = 16 * 1024 * 1024
#: compaction settings of the state topics: segments roll every 10 minutes so that old
#: snapshots are compacted away and a restore reads little more than the latest ones
STATE_TOPIC_CONFIG = {"cleanup.policy": "compact", "segment.ms": "600000",
                      "min.cleanable.dirty.ratio": "0.1",
                      "max.message.bytes": str(STATE_MAX_BYTES)}
SUMMARIES_TOPIC_CONFIG = {"retention.ms": str(24 * 3600 * 1000)}
LOGLEVELS = {"crit": "CRITICAL", "error": "ERROR", "warn": "WARNING", "info": "INFO",
             "debug": "DEBUG", "warning": "WARNING"}   # --log-level's names, and the old ones


@dataclass(kw_only=True)
class WorkerSettings:
    """The ``worker`` section of the configuration tree (and ``prefix``, the topics')."""

    prefix: str = "tg"
    worker_id: str = setting("trainguard-worker", "Faust app id; workers with one id share "
                                                  "the work", pattern=r"[A-Za-z0-9._-]{1,100}")
    web_port: int = setting(6066, "port of /metrics (flag --metrics-port, or --web-port)",
                            minimum=1, maximum=65535)
    # Faust's web also serves /router and /table pages
    web_bind: str = setting("127.0.0.1", "address /metrics listens on (flag --metrics-bind); "
                                         "0.0.0.0 for every interface")
    data_dir: str | None = setting(None, "Faust data folder (default: "
                                         "$TRAINGUARD_HOME/worker)", kind=str, min_length=1)
    loglevel: str = setting("warn", "log level (flag --log-level, or --loglevel)",
                            choices=tuple(LOGLEVELS))
    batch_max: int = setting(5000, "telemetry records per batch of the rank side",
                             minimum=1)
    poll_ms: int = setting(100, "longest wait for a batch (at most 1,000: the rank side's "
                                "grace for a partition read as it is written is 1 s more)",
                           minimum=1, maximum=1000)
    snapshot_interval_s: float = setting(2.0, "rank state snapshot, then offset commit",
                                         above=0)
    job_snapshot_interval_s: float = setting(5.0, "job state (large for large jobs), then "
                                                  "commit", above=0)
    snapshot_cpu_share: float = setting(0.02, "snapshots take at most this share of a core (a "
                                              "costly one puts the next off)",
                                        above=0, maximum=1)
    snapshot_max_interval_s: float = setting(10.0, "longest that puts a snapshot off (what a "
                                                   "crash re-reads at most)", above=0)
    advance_timer_s: float = setting(1.0, "the worker's wall-clock timer advances every job "
                                          "(time-driven checks: hang, silent) this often",
                                     above=0)
    session_timeout_s: float = setting(10.0, "consumer group session (a killed worker's "
                                             "partitions move after this long)", above=0)
    align_hold_s: float = setting(3.0, "longest the aligner waits for a stalled partition",
                                  above=0)
    grace_s: float = setting(20.0, "after SIGTERM/SIGINT, hard exit if not stopped by then",
                             above=0)
    source_idle_s: float = setting(10.0, "a telemetry partition that sent nothing for this "
                                         "long no longer holds a job's clock back (a job's "
                                         "now is the lowest newest time of its partitions)",
                                   above=0)
    unread_partition_s: float = setting(180.0, "... unless no rank worker said since that "
                                               "it read it (a killed or stalled worker's "
                                               "partitions, while they move and their state "
                                               "is restored, up to 120 s), or its worker "
                                               "said it is behind (a pause in a backlog): "
                                               "then it holds its jobs (their judged time "
                                               "and the other partitions' items) this long; "
                                               "after that they go on, and its ranks' "
                                               "silence is not judged until it is read",
                                        above=0)
    idle_ttl_s: float = setting(6 * 3600.0, "stages without input this long are dropped",
                                above=0)
    evict_idle_s: float = setting(1800.0, "stages without input this long leave memory for "
                                          "their snapshot, and come back when their key "
                                          "speaks again", above=0)
    max_live_jobs: int = setting(2000, "job stages in memory at most (least recently used "
                                       "go)", minimum=1)
    max_live_ranks: int = setting(200_000, "rank and node stages in memory at most",
                                  minimum=1)
    partitions: int = setting(0, "of the summaries topic; 0: as many as telemetry")
    gc_interval_s: float = setting(30.0, "full garbage collection this often; 0: CPython's "
                                         "own")
    publish_incidents: bool = setting(True, "incident events (SPEC §6) on the anomalies "
                                            "topic beside the anomalies; off for readers of "
                                            "v1 only")
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        validate(self, "worker.")

    @property
    def app_id(self) -> str:
        return f"{self.prefix}.{self.worker_id}"

    @property
    def rank_group(self) -> str:
        return f"{self.app_id}-ranks"

    @property
    def summaries_topic(self) -> str:
        return f"{self.app_id}-summaries"

    @property
    def rank_state_topic(self) -> str:
        return f"{self.app_id}-rank-state"

    @property
    def job_changelog_topic(self) -> str:
        return f"{self.app_id}-{JOB_TABLE}-changelog"

    @property
    def python_loglevel(self) -> str:
        return LOGLEVELS[self.loglevel]


def ensure_topics(config: Config, settings: WorkerSettings, timeout: float = 30.0) -> dict:
    """Create the SPEC topics and this worker's internal ones before anything subscribes;
    returns ``{"telemetry": n, "summaries": n, "rank_state": n}`` partition counts."""
    from confluent_kafka.admin import AdminClient, NewTopic

    create_topics(config, TopicPlan(), timeout=timeout)
    admin = AdminClient(config.kafka())
    metadata = admin.list_topics(timeout=timeout)
    topics = metadata.topics
    factor, replicated = replication(len(metadata.brokers))   # 3 and min ISR 2 from 3 brokers
    telemetry = len(topics[config.topics.telemetry].partitions)
    want = settings.partitions or telemetry
    specs = {settings.summaries_topic: (want, SUMMARIES_TOPIC_CONFIG),
             settings.rank_state_topic: (telemetry, STATE_TOPIC_CONFIG),
             settings.job_changelog_topic: (want, STATE_TOPIC_CONFIG)}
    new = [NewTopic(name, num_partitions=n, replication_factor=factor,
                    config={**replicated, **conf})
           for name, (n, conf) in specs.items() if name not in topics]
    if new:
        for name, future in admin.create_topics(new, request_timeout=timeout).items():
            try:
                future.result()
            except Exception as exc:   # raced with another worker creating it: fine
                if "already exists" not in str(exc).lower():
                    raise ConfigError(f"creating topic {name} failed: {exc}") from None
    counts = {}
    import time

    deadline = time.monotonic() + timeout
    while True:
        topics = admin.list_topics(timeout=timeout).topics
        if all(name in topics and topics[name].partitions for name in specs):
            break
        if time.monotonic() > deadline:
            raise ConfigError(f"topics {sorted(specs)} did not become visible in {timeout:.0f}s")
        time.sleep(0.2)
    counts["telemetry"] = telemetry
    counts["summaries"] = len(topics[settings.summaries_topic].partitions)
    counts["rank_state"] = len(topics[settings.rank_state_topic].partitions)
    changelog = len(topics[settings.job_changelog_topic].partitions)
    if changelog != counts["summaries"]:
        raise ConfigError(f"topic {settings.job_changelog_topic} has {changelog} partitions "
                          f"but {settings.summaries_topic} has {counts['summaries']}; delete "
                          "both (the worker recreates them) or use another --id")
    return counts


# -- Kafka client settings: librdkafka names (SPEC config files) to aiokafka / Faust -------

_HARMLESS = {"client.id", "bootstrap.servers"}


def aiokafka_security(client_settings: dict) -> dict:
    """aiokafka keyword arguments for the security settings of a librdkafka config.

    >>> aiokafka_security({"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN",
    ...                    "sasl.username": "u", "sasl.password": "p"})
    {'security_protocol': 'SASL_PLAINTEXT', 'sasl_mechanism': 'PLAIN', 'sasl_plain_username': 'u', 'sasl_plain_password': 'p'}
    """
    s = dict(client_settings)
    out = {}
    if "security.protocol" in s:
        out["security_protocol"] = s.pop("security.protocol").upper()
    if "sasl.mechanism" in s or "sasl.mechanisms" in s:
        out["sasl_mechanism"] = (s.pop("sasl.mechanism", None) or s.pop("sasl.mechanisms"))
    if "sasl.username" in s:
        out["sasl_plain_username"] = s.pop("sasl.username")
    if "sasl.password" in s:
        out["sasl_plain_password"] = s.pop("sasl.password")
    ssl_keys = {k: s.pop(k) for k in ("ssl.ca.location", "ssl.certificate.location",
                                      "ssl.key.location", "ssl.key.password") if k in s}
    if ssl_keys or out.get("security_protocol", "").endswith("SSL"):
        from aiokafka.helpers import create_ssl_context

        out["ssl_context"] = create_ssl_context(
            cafile=ssl_keys.get("ssl.ca.location"),
            certfile=ssl_keys.get("ssl.certificate.location"),
            keyfile=ssl_keys.get("ssl.key.location"),
            password=ssl_keys.get("ssl.key.password"))
    for key in s:
        if key not in _HARMLESS:
            log.warning("Kafka setting %s is not passed to the worker's aiokafka clients", key)
    return out


def faust_credentials(client_settings: dict):
    """Faust ``broker_credentials`` for the same settings, or None for plaintext."""
    sec = aiokafka_security(client_settings)
    if not sec:
        return None
    import faust

    protocol = sec.get("security_protocol", "PLAINTEXT")
    if protocol.startswith("SASL"):
        return faust.SASLCredentials(username=sec.get("sasl_plain_username"),
                                     password=sec.get("sasl_plain_password"),
                                     mechanism=sec.get("sasl_mechanism", "PLAIN"),
                                     ssl_context=sec.get("ssl_context"))
    if "ssl_context" in sec:
        return faust.SSLCredentials(sec["ssl_context"])
    return None
