"""``--config FILE`` on every command, and ``trainguard config show|check``.

:func:`apply_config` runs before each command: it resolves the tree (file, environment, the
flags the user actually typed), writes the effective values back onto the command's
arguments, and hands the rooms the settings objects they take (``args.tree``,
``args.detector_config``, ``args.worker_settings``, ``args.service_config``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .configsections import COMMAND_FLAGS, KAFKA_FLAGS

#: sections each command reads (the rest of a file is checked by `config check`)
COMMAND_SECTIONS = {
    "worker": ("kafka", "topics", "worker", "detectors"),
    "analyze": ("detectors",),
    "actions": ("kafka", "topics", "policy", "alerts"),
    "up": ("kafka", "topics", "policy"),
    "agent": ("kafka", "topics", "agent"),
    "run": ("kafka", "topics", "collector"),
    "config": None,
}
DEFAULT_SECTIONS = ("kafka", "topics")


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    if any("--config" in a.option_strings for a in parser._actions):
        return
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="configuration file (TOML; default: $TRAINGUARD_CONFIG); see "
                             "`trainguard config show`")


def add_config_command(sub, add_kafka_flags) -> None:
    config = sub.add_parser("config", help="the effective configuration; check a file")
    action = config.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    show = action.add_parser("show", help="every setting, its value and where it came from")
    show.add_argument("--json", action="store_true", help="as JSON")
    show.add_argument("--job", default=None, help="that job's per-job overrides and what it "
                                                  "learned from `trainguard feedback`")
    add_config_flag(show)
    add_kafka_flags(show)
    check = action.add_parser("check", help="validate a configuration file")
    check.add_argument("file", metavar="FILE")
    action.add_parser("docs", help="print the reference of every key (docs/CONFIG.md)")
    from .overridecli import add_override_commands

    add_override_commands(action, add_kafka_flags, add_config_flag)
    config.set_defaults(func=cmd_config)


def _given(parser: argparse.ArgumentParser, argv: list[str], args) -> set[str]:
    """Destinations of the options typed on the command line (not argparse's defaults); a
    training command after ``trainguard run``'s options is not looked at."""
    tokens = argv[:argv.index("--")] if "--" in argv else argv
    rest = getattr(args, "cmd", None)
    if isinstance(rest, list) and rest and tokens[-len(rest):] == rest:
        tokens = tokens[:-len(rest)]
    given = set()
    for action in parser._actions:
        for option in action.option_strings:
            if any(t == option or (option.startswith("--") and t.startswith(option + "="))
                   for t in tokens):
                given.add(action.dest)
    return given


def _command_parser(parser: argparse.ArgumentParser, args) -> argparse.ArgumentParser:
    """The sub-parser that parsed ``args`` (``config show``'s for ``config show``)."""
    for name in [args.command] + ([args.config_action] if args.command == "config" else []):
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def apply_config(parser: argparse.ArgumentParser, argv: list[str], args) -> None:
    from .configsections import (detector_config, load, service_config, worker_settings)

    if args.command == "config" and args.config_action in ("check", "docs"):
        return
    command_parser = _command_parser(parser, args)
    given = _given(command_parser, argv, args)
    mapping = {**(KAFKA_FLAGS if hasattr(args, "bootstrap") else {}),
               **COMMAND_FLAGS.get(args.command, {})}
    flags = {path: (getattr(args, dest), "--" + dest.replace("_", "-"))
             for dest, path in mapping.items() if dest in given}
    config_file = getattr(args, "config", None)
    sections = COMMAND_SECTIONS.get(args.command, DEFAULT_SECTIONS)
    tree = load(config_file, os.environ, flags, sections=sections)
    for dest, path in mapping.items():
        if path in tree.keys:
            setattr(args, dest, tree.value(path))
    args.tree = tree
    if config_file:               # the processes a command starts read the same file
        os.environ["TRAINGUARD_CONFIG"] = os.path.abspath(config_file)
    if args.command in ("worker", "analyze"):
        args.detector_config = detector_config(tree)
    if args.command == "worker":
        args.worker_settings = worker_settings(tree)
    if args.command == "actions":
        args.service_config = service_config(tree, getattr(args, "policy", None))


def cmd_config(args) -> int:
    from .configsections import check_tree, load

    if args.config_action == "docs":
        sys.stdout.write(reference_markdown())
        return 0
    if args.config_action in ("set", "unset", "overrides"):
        from .kafka_args import config_from
        from .overridecli import cmd_overrides

        return cmd_overrides(args, config_from(args))
    if args.config_action == "check":
        tree = load(args.file, {})
        check_tree(tree, os.environ)
        from_file = sum(1 for p in tree.values if tree.source(p) != "default")
        print(f"{args.file}: valid ({from_file} settings set, {len(tree.values) - from_file} "
              "defaults)")
        return 0
    tree = args.tree
    check_tree(tree, os.environ)
    if getattr(args, "job", None):
        from .kafka_args import config_from
        from .feedbackcli import show_job

        return show_job(args, config_from(args))
    if args.json:
        print(json.dumps(tree.to_json(), indent=1))
        return 0
    rows = [(p, json.dumps(_shown(tree, p)), tree.source(p)) for p in tree.values]
    width = min(60, max(len(p) + len(v) + 3 for p, v, _ in rows))
    for path, value, source in rows:
        line = f"{path} = {value}"
        print(f"{line:<{width}}  # {source}")
    return 0


def _shown(tree, path):
    value = tree.shown(path)
    return list(value) if isinstance(value, tuple) else value



_INTRO = """# Configuration

<!-- generated by `trainguard config docs > docs/CONFIG.md` from the components' own
settings; tests/test_config_tree.py fails when this file is not current -->

One TOML file (`--config FILE` on every command, or `TRAINGUARD_CONFIG`), then the
environment, then the command line's flags: a later one wins. Every key can also be set in
the environment as `TRAINGUARD_<KEY>` with dots written as double underscores, e.g.
`TRAINGUARD_DETECTORS__HANG__FLOOR_S=60`; some keys have a variable of their own as well.
`trainguard config show [--json]` prints the effective value of each key and where it came
from (`default`, the file, `env VAR` or `flag --x`); secrets are masked.
`trainguard config check FILE` validates a file: a bad value gets one line naming the key,
the value and what is allowed, and a non-zero exit.

```toml
[kafka]
bootstrap = "broker1:9092,broker2:9092"

[detectors.hang]
checkpoint_s = 1800.0        # long checkpoints: a wider allowance

[policy.limits]
max_restarts = 5

[alerts.slack]
url_env = "SLACK_WEBHOOK_URL"
```

One job's detector settings can also change while it runs, without restarting anything:
`trainguard config set --job JOB detectors.hang.checkpoint_s=3600` (and `config unset`,
`config overrides`); only the settings a detector reads when it decides may change so. See
"Per-job overrides at runtime" in [WORKER.md](WORKER.md).

The defaults are not repeated here by hand: each key is a field of the `Config` dataclass of
the component that uses it (the worker's `WorkerSettings`, each detector's own `Config`,
e.g. `HangDetector.Config`, the action service's `Policy`, ...), declared there with its
meaning, its range and whether it may change while a job runs (`trainguard.setting`).

Renamed keys (earlier files still load, with one deprecation line): the flat
`[detectors] <detector>_<setting>` keys are now `[detectors.<detector>] <setting>`;
`worker.advance_interval_s` is `worker.advance_timer_s` (the worker's wall-clock timer);
`detectors.stages.advance_interval_s` is `detectors.stages.advance_grid_s` (the grid of a
job's event time its detectors advance on). The JSON policy file (`--policy FILE`) is
deprecated: its settings belong in this file's `[policy]`, `[alerts]` and `[driver]`.
"""


def _cell(value) -> str:
    text = json.dumps(list(value) if isinstance(value, tuple) else value)
    if len(text) > 60:
        text = text[:57] + "..."
    return "`" + text.replace("|", "\\|") + "`"


def reference_markdown() -> str:
    """docs/CONFIG.md: every key with its default, variables and meaning, per section."""
    from .configsections import all_keys
    from .configtree import env_name

    lines = [_INTRO]
    section = None
    for key in all_keys():
        parts = key.path.split(".")
        name = ".".join(parts[:2]) if parts[0] == "detectors" else parts[0]
        if name != section:
            section = name
            lines += ["", f"## `{section}`", "", "| key | default | environment | meaning |",
                      "|---|---|---|---|"]
        env = " ".join(f"`{v}`" for v in (key.env, None if key.is_table else
                                              env_name(key.path)) if v) or "-"
        meaning = key.help.replace("|", "\\|") + (" (secret)" if key.secret else "")
        lines.append(f"| `{key.path}` | {_cell(key.default)} | {env} | {meaning} |")
    return "\n".join(lines) + "\n"
