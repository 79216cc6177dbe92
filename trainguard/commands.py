"""Flags of the long-running commands (SPEC §4); each runs ``main(args, config)`` of its room."""
from __future__ import annotations

import argparse

from trainguard.logs import add_log_flags
from trainguard.service_metrics import add_metrics_flags


def add_service_commands(sub, add_kafka_flags, delegate) -> None:
    up = sub.add_parser("up", help="a whole local deployment: broker, topics, worker, "
                                   "action service, node agent")
    up.add_argument("--job", default=None, help="only watch this job id")
    up.add_argument("--dry-run", action="store_true", help="the action service only records")
    add_kafka_flags(up)
    up.set_defaults(func=delegate(".up", needs=("faust", "river", "pynvml")))

    worker = sub.add_parser("worker", help="the Faust stream processors")
    add_metrics_flags(worker, "worker")   # --metrics-port/--metrics-bind (--web-port/-bind)
    worker.add_argument("--data-dir", default=None,
                        help="Faust data folder (default: $TRAINGUARD_HOME/worker)")
    worker.add_argument("--id", default="trainguard-worker",
                        help="Faust app id; workers with one id share the work")
    add_log_flags(worker, "warn", aliases=("--loglevel",), dest="loglevel",
                  choices=("debug", "info", "warning", "warn", "error", "crit"))
    worker.add_argument("--evict-idle-s", type=float, default=1800.0,
                        help="stages idle this long leave memory for their snapshot (1800)")
    worker.add_argument("--max-live-jobs", type=int, default=2000,
                        help="job stages kept in memory at most, ~40 KB each (2000)")
    worker.add_argument("--max-live-ranks", type=int, default=200_000,
                        help="rank and node stages kept in memory at most (200000)")
    add_kafka_flags(worker)
    worker.set_defaults(func=delegate(".streams.worker"))

    actions = sub.add_parser("actions", help="the action service")
    actions.add_argument("--policy", metavar="FILE", help="policy file (JSON); see docs")
    actions.add_argument("--dry-run", action="store_true",
                         help="decide and record everything, carry nothing out")
    actions.add_argument("--state", metavar="FILE",
                         help="where decisions are kept across restarts")
    add_kafka_flags(actions)
    add_metrics_flags(actions, "actions")
    actions.set_defaults(func=delegate(".actions.service"))

    agent = sub.add_parser("agent", help="the node agent of this machine")
    agent.add_argument("--node", default=None, help="this machine's name (default: SLURMD_NODENAME, NODE_NAME, else "
                       "the host name)")
    agent.add_argument("--job", default=None,
                       help="job id for GPU and Xid events (default: every job seen locally)")
    agent.add_argument("--interval", type=float, default=1.0, help="GPU sample period, seconds")
    agent.add_argument("--kmsg-extra", metavar="FILE", action="append", default=[],
                       help="also tail FILE as a kernel log (repeatable; used for chaos)")
    agent.add_argument("--runtime-dir", metavar="DIR", default=None,
                       help="local registry of rank processes (default: $TRAINGUARD_HOME/run)")
    agent.add_argument("--native", action="store_true", help="py-spy --native stacks")
    agent.add_argument("--snapshot-dir", metavar="DIR", default=None,
                       help="hold the ranks' in-memory snapshots here (under /dev/shm; "
                            "docs/RECOVERY.md)")
    agent.add_argument("--snapshot-listen", metavar="HOST:PORT", default=None,
                       help="where the other agents reach this one for snapshot replicas")
    agent.add_argument("--snapshot-peers", metavar="NODE=HOST:PORT,...", default="",
                       help="the other agents (a snapshot's buddy is chosen among them)")
    agent.add_argument("--snapshot-domains", metavar="NODE=DOMAIN,...", default="",
                       help="eviction domains: machines evicted together (a snapshot's "
                            "replica is never in its machine's domain)")
    add_kafka_flags(agent)
    add_metrics_flags(agent, "agent")
    agent.set_defaults(func=delegate(".collectors.agent", needs=("pynvml",)))

    run = sub.add_parser("run", help="launch and supervise a training command",
                         usage="trainguard run [options] -- CMD...")
    run.add_argument("--job", required=True, help="job id (also given to the training script)")
    run.add_argument("--max-restarts", type=int, default=3)
    run.add_argument("--checkpoint-dir", metavar="DIR", default=None)
    run.add_argument("--grace", type=float, default=10.0,
                     help="seconds between SIGTERM and SIGKILL on restart")
    run.add_argument("--instrument", action="store_true",
                     help="watch an unmodified PyTorch script through PyTorch's hooks "
                          "(also TRAINGUARD_INSTRUMENT=1, or collector.instrument = true "
                          "in --config)")
    run.add_argument("--standby", type=int, default=None, metavar="K",
                     help="restart in place: the command is a Python training script run as "
                          "--nproc ranks with K warm standby processes, which take the ranks "
                          "of a crashed generation over without a relaunch (docs/RECOVERY.md)")
    run.add_argument("--nproc", type=int, default=None, metavar="N",
                     help="ranks of the script with --standby (default 1)")
    run.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the training command")
    add_kafka_flags(run)
    add_metrics_flags(run, "run")
    run.set_defaults(func=delegate(".launcher.supervisor"))

    resume = sub.add_parser("resume-step", help="print the step this (requeued Slurm) job "
                            "resumes from after a rollback, or nothing")
    resume.set_defaults(func=_resume_step)

    record = sub.add_parser("record", help="Kafka topics to a recording")
    record.add_argument("--out", required=True, metavar="FILE",
                        help=".jsonl, .jsonl.gz or .jsonl.zst")
    record.add_argument("--job", default=None, help="keep only this job's events")
    record.add_argument("--seconds", type=float, default=None, help="stop after S seconds")
    record.add_argument("--from-beginning", action="store_true",
                        help="start at the oldest retained message instead of now")
    add_kafka_flags(record)
    record.set_defaults(func=delegate(".streams.recorder", "record_main"))

    replay = sub.add_parser("replay", help="a recording back onto Kafka")
    replay.add_argument("file")
    replay.add_argument("--speed", type=float, default=1.0,
                        help="time factor: 2 is twice as fast, 0 as fast as possible")
    replay.add_argument("--job", default=None, help="rewrite the job id of every event")
    replay.add_argument("--retime", action="store_true",
                        help="shift timestamps so the recording starts now")
    add_kafka_flags(replay)
    replay.set_defaults(func=delegate(".streams.recorder", "replay_main"))

    demo = sub.add_parser("demo", help="the main job: a real training run with chaos, "
                                       "trainguard against plain torchrun")
    demo.add_argument("--minutes", type=float, default=6.0)
    demo.add_argument("--json", action="store_true")
    demo.add_argument("--no-baseline", action="store_true",
                      help="skip the plain torchrun baseline")
    demo.add_argument("--out", metavar="DIR", default=None, help="where the report goes")
    add_kafka_flags(demo)
    demo.set_defaults(func=delegate(".apps.demo", needs=("faust", "river", "pynvml")))


def _resume_step(args) -> int:
    from trainguard.launcher.slurm_resume import resume_step_main

    return resume_step_main(args)
