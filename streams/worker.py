"""``trainguard worker``: the stream processors (SPEC §4).

::

    telemetry (key job/rank) ──▶ rank side: RankStage per (job, rank) ──▶ <app>-summaries
      and (key job/node)         and NodeStage per (job, machine)           (key job)
        │ invalid: <prefix>.deadletter          (batches; ranks.py)           │
        ▼                                                                     │
    <prefix>.anomalies (key job) ◀── job side: JobStage per job (Faust agent, table, timer)

Exits 0 after SIGTERM or SIGINT: the handlers stop the worker (a last snapshot and commit
of both sides), and if it has not stopped ``grace_s`` seconds later the process ends with
``os._exit(0)``.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from dataclasses import dataclass
from functools import partial

from trainguard.config import Config
from trainguard.errors import UserError

from .settings import WorkerSettings

__all__ = ["main", "build", "WorkerTopics"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class WorkerTopics:
    telemetry: str
    anomalies: str
    deadletter: str
    summaries: str
    rank_state: str


def settings_from_args(args, config: Config) -> WorkerSettings:
    from trainguard.broker import trainguard_home

    if getattr(args, "worker_settings", None) is not None:   # from the configuration tree
        return args.worker_settings
    data_dir = args.data_dir or str(trainguard_home() / "worker")
    memory = {name: getattr(args, name) for name in ("evict_idle_s", "max_live_jobs",
                                                     "max_live_ranks")
              if getattr(args, name, None) is not None}
    if getattr(args, "web_bind", None):
        memory["web_bind"] = args.web_bind
    return WorkerSettings(prefix=config.topics.prefix, worker_id=args.id,
                          web_port=args.web_port, data_dir=data_dir, loglevel=args.loglevel,
                          **memory)


def make_data_dir(path: str) -> None:
    from pathlib import Path

    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot make the worker's data folder {path}: {exc.strerror}; "
                        "set --data-dir or TRAINGUARD_HOME") from None


def build(settings: WorkerSettings, config: Config, detector_config=None, keys=None):
    """Create topics and wire the worker: ``(app, rank_service, runtime)``. ``keys``: the
    signing keys that per-job overrides must be signed with (None: unsigned accepted)."""
    from trainguard.detectors import DetectorConfig, JobStage, NodeStage, RankStage

    from .app import JobRuntime, make_app
    from .gc_schedule import ScheduledCollection
    from .metrics import Metrics
    from .processors import JobProcessor, RankProcessor
    from trainguard.streams.rank_side import RankService
    from .settings import ensure_topics, faust_credentials
    from trainguard.overrides import OverrideBook

    counts = ensure_topics(config, settings)
    topics = WorkerTopics(telemetry=config.topics.telemetry, anomalies=config.topics.anomalies,
                          deadletter=config.topics.deadletter,
                          summaries=settings.summaries_topic,
                          rank_state=settings.rank_state_topic)
    detector_config = detector_config or DetectorConfig()
    metrics = Metrics()
    shared = {"detector_config": detector_config}    # not snapshotted: the running one
    ranks = RankProcessor(partial(RankStage, detector_config),
                          make_node_stage=partial(NodeStage, detector_config),
                          telemetry_topic=topics.telemetry, idle_ttl_s=settings.idle_ttl_s,
                          evict_idle_s=settings.evict_idle_s,
                          max_live=settings.max_live_ranks, shared=shared)
    book = OverrideBook(base=detector_config)      # per-job overrides at runtime
    jobs = JobProcessor(partial(JobStage, detector_config), idle_ttl_s=settings.idle_ttl_s,
                        observe_lag=metrics.observe_lag,
                        advance_every_s=detector_config.stages.advance_grid_s,
                        evict_idle_s=settings.evict_idle_s,
                        max_live=settings.max_live_jobs, shared=shared,
                        incidents=settings.publish_incidents,
                        source_idle_s=settings.source_idle_s,
                        unread_s=settings.unread_partition_s, tune_stage=book.tune)
    collection = (ScheduledCollection(settings.gc_interval_s) if settings.gc_interval_s > 0
                  else None)
    runtime = JobRuntime(settings=settings, topics=topics, processor=jobs, metrics=metrics,
                         collection=collection)
    app = make_app(settings=settings, topics=topics, runtime=runtime,
                   faust_broker=config.faust_broker(),
                   credentials=faust_credentials(config.client_settings),
                   partitions=counts["summaries"])
    rank_service = RankService(kafka=config.kafka(), settings=settings, topics=topics,
                               processor=ranks, metrics=metrics,
                               state_partitions=counts["rank_state"], loop=app.loop)
    runtime.rank_service = rank_service
    runtime.config_feed = start_config_feed(config, settings, book, jobs, metrics, keys)
    runtime.false_alarms = start_false_alarm_feed(config, jobs, metrics, keys)
    return app, rank_service, runtime


def start_false_alarm_feed(config: Config, jobs, metrics, keys):
    """The reader of the action service's false alarms on the actions topic, and of
    people's feedback on the orders topic (feedback_feed.py), polled together."""
    from trainguard.signing import Verifier

    from .false_alarms import FalseAlarmFeed

    feed = FalseAlarmFeed(kafka=config.kafka(), topics=config.topics, processor=jobs,
                          verifier=Verifier(keys), metrics=metrics)
    feed.start()
    from .feedback_feed import FeedbackFeed, FeedGroup

    feedback = FeedbackFeed(kafka=config.kafka(), topics=config.topics, processor=jobs,
                            verifier=Verifier(keys), keys=keys, metrics=metrics)
    feedback.start()        # people's verdicts (trainguard feedback), on the orders topic
    return FeedGroup(feed, feedback)


def start_config_feed(config: Config, settings: WorkerSettings, book, jobs, metrics, keys):
    """The reader of the config topic, caught up with it before any job stage is built."""
    from trainguard.signing import Verifier

    from .config_feed import ConfigFeed

    feed = ConfigFeed(kafka=config.kafka(), topics=config.topics, book=book, processor=jobs,
                      verifier=Verifier(keys), worker=settings.app_id, keys=keys,
                      metrics=metrics)
    feed.start()
    read = feed.catch_up()
    log.info("config topic %s: %d records read, %d jobs with overrides", config.topics.config,
             read, len(book.jobs))
    return feed


def _hard_exit_later(grace_s: float, code: int) -> None:
    def run():
        threading.Event().wait(grace_s)
        log.error("not stopped %.0fs after the signal; exiting", grace_s)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(code)

    threading.Thread(target=run, name="hard-exit", daemon=True).start()


def _worker_class():
    import faust

    class Worker(faust.Worker):
        """faust.Worker whose SIGTERM/SIGINT also arm a hard exit after a grace period."""

        grace_s = 20.0
        signalled = False
        before_stop = None               # coroutine function: the job side's last checkpoint

        def _schedule_shutdown(self, signum) -> None:
            if not Worker.signalled:
                Worker.signalled = True
                _hard_exit_later(self.grace_s, 0)
            super()._schedule_shutdown(signum)

        async def _stop_on_signal(self, signum) -> None:
            if Worker.before_stop is not None:
                try:
                    await asyncio.wait_for(Worker.before_stop(), timeout=self.grace_s / 3)
                except Exception as exc:     # stopping matters more than the last snapshot
                    log.warning("last job checkpoint failed: %s", exc)
            await super()._stop_on_signal(signum)

        def on_setup_root_logger(self, logger, level) -> None:
            logging.getLogger("trainguard").setLevel(level)

    return Worker


def _signing_keys(args):
    """The signing keys of per-job overrides: the tree's ``security.signing_key`` (file or
    ``TRAINGUARD_SIGNING_KEY``), else the environment."""
    from trainguard.signing import SigningKeys, signing_key_from_env, warn_if_unsigned

    tree = getattr(args, "tree", None)
    text = tree.value("security.signing_key") if tree is not None and \
        "security.signing_key" in tree.keys else None
    keys = SigningKeys.parse(text) if text else signing_key_from_env()
    warn_if_unsigned(keys, "worker", "per-job overrides on the config topic")
    return keys


def main(args, config: Config) -> int:
    from trainguard.logs import banner, configured, setup
    from trainguard.service_metrics import start_metrics

    settings = settings_from_args(args, config)
    make_data_dir(settings.data_dir)
    if not configured():                 # called without the command line's set-up
        setup("worker", settings.loglevel)
    built: dict = {}                     # /metrics from the start: process_* before Kafka

    def families():
        runtime = built.get("runtime")
        return runtime.metrics.collect() if runtime is not None else ()

    server = start_metrics(families, args, "worker", port=settings.web_port,
                           bind=settings.web_bind)

    def early_exit(signum, frame):       # before the worker installs its own handlers
        raise SystemExit(0)

    for s in (signal.SIGTERM, signal.SIGINT):    # until the Faust worker installs its own
        signal.signal(s, early_exit)
    try:
        app, rank_service, runtime = build(settings, config,
                                           getattr(args, "detector_config", None),
                                           keys=_signing_keys(args))
    except SystemExit:
        return 0
    built["runtime"] = runtime
    if runtime.collection is not None:       # garbage collection on the job side's timer
        runtime.collection.start()
    Worker = _worker_class()
    Worker.grace_s = settings.grace_s
    Worker.before_stop = runtime.final_checkpoint
    worker = Worker(app, rank_service, loglevel=settings.python_loglevel, quiet=True,
                    override_logging=False)
    banner("worker").info("trainguard worker %s: telemetry %s -> anomalies %s; metrics %s",
                          settings.app_id, config.topics.telemetry, config.topics.anomalies,
                          f"on {server.url}" if server is not None else "off")
    try:
        worker.execute_from_commandline()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return code
    finally:
        if server is not None:
            server.close()
    return 0
