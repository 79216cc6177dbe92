"""``trainguard``: the command line of SPEC §4. Thin: each command parses its flags and
calls into the room that owns the work, imported only when that command runs."""
from __future__ import annotations

import argparse
import json
import sys

from . import __version__
from .errors import UserError
from .kafka_args import add_kafka_flags as _add_kafka_flags, config_from

EXIT_USER_ERROR = 2


def cmd_broker(args) -> int:
    from .broker import local_broker, recorded_port

    if args.port is None:                # the port the data folder's broker was given
        args.port = recorded_port(args.data) or 9092
    cluster = _broker_cluster(args)
    broker = cluster if cluster is not None else local_broker(port=args.port, data=args.data)
    if args.action == "start":
        print(broker.start(log=lambda m: print(m, file=sys.stderr)))
        return 0
    if args.action == "stop":
        print(broker.stop())
        return 0
    if cluster is not None:
        lines = cluster.status()
        print("\n".join(lines))
        return 0 if all(": running" in line for line in lines) else 1
    if broker.running():
        print(f"broker on {broker.bootstrap} is running (pid {broker.pid()}, data {broker.data})")
        return 0
    print(f"no broker answers on {broker.bootstrap}")
    return 1


def _broker_cluster(args):
    """The :class:`~trainguard.broker.LocalCluster` the flags name (``--brokers N`` > 1, or
    a data folder that holds a cluster), else None (the single broker). Without ``--data``
    and ``--brokers``, ``stop`` and ``status`` take a cluster started on ``--port`` with its
    default data folder when one of its nodes runs."""
    import json
    from pathlib import Path

    from .broker import MAX_BROKERS, is_cluster_dir, local_cluster, trainguard_home

    brokers = args.brokers
    if args.data:
        if is_cluster_dir(args.data):
            size = json.loads((Path(args.data) / "cluster.json").read_text())["brokers"]
            return local_cluster(port=args.port, brokers=brokers or size, data=args.data)
        return local_cluster(port=args.port, brokers=brokers, data=args.data) \
            if brokers is not None and brokers != 1 else None
    if brokers is not None:
        return local_cluster(port=args.port, brokers=brokers) if brokers != 1 else None
    if args.action != "start":
        for count in range(2, MAX_BROKERS + 1):
            data = trainguard_home() / "brokers" / f"{args.port}-x{count}"
            if is_cluster_dir(data):
                cluster = local_cluster(port=args.port, brokers=count)
                if any(node.pid() is not None for node in cluster.nodes):
                    return cluster
    return None


def cmd_topics(args) -> int:
    from .topics import TopicPlan, create_topics

    config = config_from(args)
    plan = TopicPlan(telemetry_partitions=args.telemetry_partitions,
                     other_partitions=args.partitions)
    for name, state in sorted(create_topics(config, plan).items()):
        print(f"{name}\t{state}")
    return 0


def check_output_file(path, flag: str) -> None:
    """Refuse, before any work, an output path that is a folder or in no folder that exists."""
    from pathlib import Path

    if Path(path).is_dir():
        raise UserError(f"{flag} {path} is a folder; give a file name")


def _workers(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--workers wants a number of processes >= 1, "
                                         f"not {text!r}")
    return value


def cmd_analyze(args) -> int:
    from .detectors.parallel import analyze_file_parallel

    if args.report:
        check_output_file(args.report, "--report")
    overrides = None
    if getattr(args, "overrides", None):
        from .overrides import read_overrides_file

        overrides = read_overrides_file(args.overrides, getattr(args, "detector_config", None))
    from .progress import reading, wanted

    if getattr(args, "detector_module", None):
        from .detectors.registry import load_detector_modules

        try:
            load_detector_modules(args.detector_module)
        except (ImportError, ValueError, SyntaxError) as exc:
            raise UserError(f"--detector-module: {exc}; give an importable module or a .py "
                            f"file that registers a detector (docs/DETECTORS.md)") from None
    with reading(args.file, "analyze", enabled=wanted(args.json)) as on_read:
        result = analyze_file_parallel(args.file, getattr(args, "detector_config", None),
                                       overrides, on_read=on_read,
                                       workers=getattr(args, "workers", 1))
    if args.report:
        write_analysis_report(args.file, result, args.report)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['events']} events, {result['invalid']} invalid, "
              f"{len(result['incidents'])} incidents")
        for incident in result["incidents"]:
            print(f"  [{incident['severity']}] {incident['kind']} ranks={incident['ranks']} "
                  f"nodes={incident['nodes']} step={incident['step']}: {incident['summary']}")
    return 0


def write_analysis_report(recording, result: dict, path) -> None:
    """The HTML report of a recording: its events, actions and stack captures, and the incidents."""
    from trainguard.diagnosis.stacks import analyze_threads
    from .events import to_dict
    from .recording import read_events
    from trainguard.apps.report import write_report

    events = list(read_events(recording))
    per_capture: dict = {}
    for event in events:
        if event.type == "stack" and event.rank is not None:
            per_capture.setdefault(event.capture_id, {})[event.rank] = event.threads
    captures = [{**analyze_threads(ranks), "capture_id": capture_id}
                for capture_id, ranks in per_capture.items()]
    actions = [to_dict(e) for e in events if e.type == "action"]
    write_report(path, result, events=events, actions=actions, captures=captures)


def _print_localization(result: dict, as_json: bool) -> int:
    if as_json:
        print(json.dumps(result))
    else:
        print(result["summary"])
        for cls in result["classes"]:
            print(f"  ranks {cls['ranks']}: {cls['signature']}")
        print(f"suspects: {result['suspects']}  missing: {result['missing']}")
    return 0


def cmd_stacks(args) -> int:
    from trainguard.diagnosis.stacks import analyze_dir

    return _print_localization(analyze_dir(args.dir), args.json)


def cmd_fr(args) -> int:
    from trainguard.diagnosis.flight_recorder import analyze_dir

    return _print_localization(analyze_dir(args.dir), args.json)


def _delegate(module: str, function: str = "main", needs: tuple = ()):
    """A command whose whole work lives in one room's module: ``module.main(args, config)``;
    ``needs``: server-install modules it will not run without, though it imports them lazily."""

    def run(args) -> int:
        import importlib

        from .extras import require_server

        require_server(needs)
        try:
            room = importlib.import_module(module, __package__)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith(f"{__package__}{module}"):
                raise UserError(f"`{args.command}` is not part of this build") from None
            raise
        return getattr(room, function)(args, config_from(args))

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainguard", description="Watch every rank of a training job, find what goes "
        "wrong, show who is to blame, and get training going again.")
    parser.add_argument("--version", action="version", version=f"trainguard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    broker = sub.add_parser("broker", help="the local Apache Kafka (KRaft): one broker, or "
                                           "a cluster with --brokers N")
    broker.add_argument("action", choices=("start", "stop", "status"))
    broker.add_argument("--port", type=int, default=None,
                        help="listener port (default: the one --data's broker was started "
                             "with, else 9092); a cluster's brokers listen on PORT, PORT+1, ...")
    broker.add_argument("--brokers", type=int, metavar="N",
                        help="run N brokers (combined broker+controller nodes, an N-voter "
                             "quorum; replication factor 3 and min.insync.replicas 2 from 3 "
                             "brokers); stop/status find a cluster by its data folder")
    broker.add_argument("--data", metavar="DIR",
                        help="data folder (default: $TRAINGUARD_HOME/brokers/PORT, or "
                             "PORT-xN for N brokers)")
    broker.set_defaults(func=cmd_broker)

    topics = sub.add_parser("topics", help="create the trainguard topics (idempotent)")
    topics.add_argument("action", choices=("create",))
    topics.add_argument("--telemetry-partitions", type=int, default=24,
                        help="partitions of the telemetry topic (default 24)")
    topics.add_argument("--partitions", type=int, default=4,
                        help="partitions of the other topics (default 4)")
    _add_kafka_flags(topics)
    topics.set_defaults(func=cmd_topics)

    from .commands import add_service_commands

    add_service_commands(sub, _add_kafka_flags, _delegate)

    analyze = sub.add_parser("analyze", help="run the detectors offline on a recording")
    analyze.add_argument("file", help="recording: .jsonl, .jsonl.gz or .jsonl.zst")
    analyze.add_argument("--json", action="store_true", help="print SPEC JSON")
    analyze.add_argument("--report", metavar="OUT.html", help="also write an HTML report")
    analyze.add_argument("--overrides", metavar="FILE", default=None,
                         help="per-job overrides, as `trainguard config set` makes them "
                              "(TOML [jobs.J.detectors.hang] tables, or JSON)")
    analyze.add_argument("--detector-module", metavar="MODULE", action="append", default=[],
                         help="also run the detectors a plug-in module registers: a module "
                              "name or a .py file; repeatable (docs/DETECTORS.md)")
    analyze.add_argument("--workers", metavar="N", type=_workers, default=None,
                         help="processes: one for the job side, the others for the rank "
                              "side (default: the cores, at most 8; under 4 MiB: 1); the "
                              "same result whatever N (docs/WORKER.md)")
    analyze.set_defaults(func=cmd_analyze)

    stacks = sub.add_parser("stacks", help="aggregate stack dumps of all ranks")
    stacks.add_argument("action", choices=("analyze",))
    stacks.add_argument("dir", help="folder of py-spy dump --json files or recordings")
    stacks.add_argument("--json", action="store_true", help="print SPEC JSON")
    stacks.set_defaults(func=cmd_stacks)

    fr = sub.add_parser("fr", help="analyze PyTorch Flight Recorder dumps of all ranks")
    fr.add_argument("action", choices=("analyze",))
    fr.add_argument("dir", help="folder of Flight Recorder dumps, one per rank")
    fr.add_argument("--json", action="store_true", help="print SPEC JSON")
    fr.set_defaults(func=cmd_fr)

    from .configcli import add_config_command, add_config_flag

    add_config_command(sub, _add_kafka_flags)
    from .feedbackcli import add_feedback_command

    add_feedback_command(sub, _add_kafka_flags)
    for name, command in sub.choices.items():
        if name != "config":          # `config show` has its own; `config check` takes FILE
            add_config_flag(command)
    _add_log_flags(sub)
    return parser


def _add_log_flags(sub) -> None:
    """``--log-level`` and ``--log-format`` on every command (on each action of a command
    that has actions of its own, such as ``config show``)."""
    from .logs import SERVICES, add_log_flags

    for name, command in sub.choices.items():
        nested = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
        if nested:
            for action in nested:
                _add_log_flags(action)
        else:
            add_log_flags(command, "info" if name in SERVICES else "warning")


def _start_logging(args, argv: list[str]):
    """The command's log handler (trainguard.logs); flags typed here reach the services
    that ``up`` and ``demo`` start, through the environment."""
    import os

    from . import logs

    typed = argv[:argv.index("--")] if "--" in argv else argv
    for flag, env, dest in (("--log-level", logs.LEVEL_ENV, "log_level"),
                            ("--loglevel", logs.LEVEL_ENV, "loglevel"),
                            ("--log-format", logs.FORMAT_ENV, "log_format")):
        if any(t == flag or t.startswith(flag + "=") for t in typed) and getattr(args, dest,
                                                                               None):
            os.environ[env] = {"warn": "warning", "crit": "error"}.get(getattr(args, dest),
                                                                       getattr(args, dest))
    fields = {"job": getattr(args, "job", None)} if args.command in ("run", "agent") else {}
    return logs.setup_from_args(args, args.command, fields=fields)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    try:
        from .configcli import apply_config

        apply_config(parser, argv, args)
        handler = _start_logging(args, argv)
        try:
            return args.func(args) or 0
        finally:
            from .logs import teardown

            teardown(handler)
    except UserError as exc:
        print(f"trainguard {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        print(f"trainguard {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"trainguard {args.command}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        from .extras import missing_server_install, needs_server

        if not needs_server(exc):
            raise
        print(f"trainguard {args.command}: error: {missing_server_install(exc.name)}",
              file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
