"""``trainguard up``: a whole local deployment on this machine.

A broker when none is configured (``--bootstrap``/``TRAINGUARD_BOOTSTRAP`` unset, or set to a
local address where nothing answers), the topics, then the stream worker, the action service
and this machine's node agent, each a process of its own with a log under
``$TRAINGUARD_HOME/up/``. Runs until Ctrl-C or SIGTERM and stops everything it started.

The services get a signing key for their orders and commands: ``TRAINGUARD_SIGNING_KEY`` when
set, else a fresh one, written to ``$TRAINGUARD_HOME/up/signing.key`` (mode 0600) so that
``trainguard run`` can be given the same.
"""
from __future__ import annotations

import os
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


def own_signing_key(folder: Path) -> tuple[dict, Path | None]:
    """``(environment for the services, key file or None)``: nothing when the user set a key
    (the services inherit it), else a fresh key, also written to ``folder/signing.key``."""
    from .signing import KEY_ENV, generate_key, signing_key_from_env

    if signing_key_from_env() is not None:
        return {}, None
    key = generate_key()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "signing.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(key + "\n")
    return {KEY_ENV: key}, path


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
    key_env, key_file = own_signing_key(Path(log_dir))
    with ServiceSet(log_dir=Path(log_dir)) as services:
        agent_args = ["--job", args.job] if args.job else []
        start_pipeline(services, config, dry_run=args.dry_run, agent_args=agent_args,
                       env=key_env)
        print(f"trainguard is up on {config.bootstrap} (logs in {log_dir}); Ctrl-C stops it")
        if key_file:
            print(f"orders are signed: run jobs with TRAINGUARD_SIGNING_KEY=$(cat {key_file}) "
                  "trainguard run ...")
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

