"""``trainguard up``: a whole local deployment on this machine.

A broker when none is configured (``--bootstrap``/``TRAINGUARD_BOOTSTRAP`` unset, or set to a
local address where nothing answers), the topics, then the stream worker, the action service
and this machine's node agent, each a process of its own with a log under
``$TRAINGUARD_HOME/up/``. Runs until Ctrl-C or SIGTERM and stops everything it started.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path

from .broker import broker_answers, local_broker, trainguard_home
from .config import Config
from .errors import UserError
from .services import ServiceSet, tail
from .topics import create_topics

LOCAL_HOSTS = ("127.0.0.1", "localhost")


def ensure_broker(config: Config, log=print) -> bool:
    """Start the local broker if the configured one is local and silent; True if started."""
    if broker_answers(config.bootstrap, timeout=3):
        return False
    host, _, port = config.bootstrap.split(",")[0].rpartition(":")
    if host not in LOCAL_HOSTS:
        raise UserError(f"no Kafka broker answers at {config.bootstrap}; check --bootstrap")
    log(local_broker(port=int(port)).start(log=log))
    return True


def kafka_args(config: Config) -> list[str]:
    return ["--bootstrap", config.bootstrap, "--prefix", config.topics.prefix]


def start_pipeline(services: ServiceSet, config: Config, *, dry_run: bool = False,
                   agent_args: list[str] | None = None, actions_args: list[str] | None = None,
                   worker_args: list[str] | None = None, env: dict | None = None) -> None:
    common = kafka_args(config)
    services.start_trainguard("worker", ["worker", *common, *(worker_args or [])], env=env)
    services.start_trainguard("actions", ["actions", *common, *(["--dry-run"] if dry_run else []),
                                          *(actions_args or [])], env=env)
    services.start_trainguard("agent", ["agent", *common, *(agent_args or [])], env=env)


def main(args, config: Config) -> int:
    started_broker = ensure_broker(config)
    for name, state in sorted(create_topics(config).items()):
        print(f"{name}\t{state}")
    stop = {"now": False}

    def request_stop(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, request_stop)
    log_dir = trainguard_home() / "up"
    with ServiceSet(log_dir=Path(log_dir)) as services:
        agent_args = ["--job", args.job] if args.job else []
        start_pipeline(services, config, dry_run=args.dry_run, agent_args=agent_args)
        print(f"trainguard is up on {config.bootstrap} (logs in {log_dir}); Ctrl-C stops it")
        try:
            while not stop["now"]:
                for child in services.dead():
                    raise UserError(f"{child.name} exited with code {child.proc.returncode}: "
                                    f"{tail(child.log)}")
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    if started_broker:
        print(local_broker(port=int(config.bootstrap.rpartition(':')[2])).stop())
    return 0

