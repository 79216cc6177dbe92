"""One benchmark on this tree and on an earlier commit, interleaved in one run:
``python bench/compare.py NAME --against REV [--rounds N] [--json]``.

The earlier commit is checked out in a temporary ``git worktree``; its packages are made
importable from a folder of links laid out by that commit's own ``package-dir`` (so that
``import trainguard`` finds its code, not this tree's), and each round runs
``bench_<NAME>.run()`` of each tree in a fresh process, alternating (``--set NAME=VALUE``
sets a constant of both benches alike, to shorten a long one), so that a noisy spell of
the shared machine hits both alike. Reported: each tree's numeric results (the best round of
each for rates, ``*_per_s``, the median otherwise) and the ratio this/earlier of each rate.

Benchmarks that start processes of their own (``stream_throughput`` runs ``trainguard
worker`` through the installed entry point) pass the same ``PYTHONPATH`` on to them, so those
import the earlier commit's code too. That is checked, not assumed: a ``sitecustomize`` put
first on each side's ``PYTHONPATH`` logs where every ``trainguard`` module of every Python
process of the bench was found, and a module found outside its side's tree fails the
comparison (``imports_checked`` in the result says how many processes and modules were seen).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RUN = ("import json, sys; sys.path.insert(0, {bench!r}); sys.path.insert(0, {tests!r}); "
       "import bench_{name} as b; settings = {settings!r}\n"
       "for k, v in settings.items():\n"
       "    if not hasattr(b, k): raise SystemExit(f'bench_{name} has no setting {{k}}')\n"
       "    setattr(b, k, v)\n"
       "print('RESULT ' + json.dumps(b.run()))")


_NOT_LITERAL = object()


def _link_packages(tree: Path, site: Path) -> None:
    """``site/trainguard/...``: links to ``tree``'s modules as its ``package-dir`` maps them."""
    tool = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = tool.get("package-dir", {})
    for package, folder in sorted(mapping.items(), key=lambda kv: kv[0].count(".")):
        target = site.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for entry in (tree / folder).iterdir():
            link = target / entry.name
            if not link.exists() and (entry.suffix == ".py" or entry.is_dir()):
                link.symlink_to(entry)


#: Logs, for every Python process started with it first on PYTHONPATH, where each
#: ``trainguard`` module was found (the spec the other finders give, unchanged), then runs
#: the ``sitecustomize`` it shadows, if there is one.
PROBE = r"""
import os, sys
from importlib.machinery import PathFinder

_LOG = os.environ.get("TG_COMPARE_IMPORT_LOG")
_HERE = os.path.dirname(os.path.abspath(__file__))


class _WhereFrom:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if not _LOG or not (name == "trainguard" or name.startswith("trainguard.")):
            return None
        for finder in sys.meta_path:
            if finder is cls or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                origin = os.path.realpath(spec.origin) if spec.has_location else "-"
                with open(_LOG, "a") as log:
                    log.write(f"{os.getpid()}\t{name}\t{origin}\t{' '.join(sys.argv[:2])}\n")
                return spec
        return None


sys.meta_path.insert(0, _WhereFrom)
_spec = PathFinder.find_spec("sitecustomize",
                             [p for p in sys.path if os.path.abspath(p or ".") != _HERE])
if _spec is not None:
    _spec.loader.exec_module(type(sys)("sitecustomize"))
"""


def _checked_imports(log: Path, tree: Path) -> dict:
    """``{"processes", "modules", "commands"}`` of an import log; every module must have been
    found in ``tree``."""
    root = os.path.realpath(tree) + os.sep
    pids, modules, commands, outside = set(), 0, set(), []
    for line in log.read_text().splitlines() if log.exists() else ():
        pid, module, origin, command = (line.split("\t") + [""] * 4)[:4]
        pids.add(pid)
        modules += 1
        commands.add(os.path.basename(command.split(" ")[0]) + " " + " ".join(
            command.split(" ")[1:2]))
        if origin != "-" and not origin.startswith(root):
            outside.append(f"{module} from {origin} (pid {pid}: {command})")
    if outside:
        raise SystemExit(f"compare: the bench of {tree} imported code from elsewhere:\n  "
                         + "\n  ".join(outside[:10]))
    return {"processes": len(pids), "modules": modules, "commands": sorted(commands)}


def _one(tree: Path, name: str, site: Path | None, probe: Path | None = None,
         log: Path | None = None, settings: dict | None = None) -> dict:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = str(site) + os.pathsep + env.get("PYTHONPATH", "")
    if probe is not None:
        env["PYTHONPATH"] = str(probe) + os.pathsep + env.get("PYTHONPATH", "")
        env["TG_COMPARE_IMPORT_LOG"] = str(log)
    code = RUN.format(bench=str(tree / "bench"), tests=str(tree / "tests"), name=name,
                      settings=settings or {})
    # not from inside a tree: its own trainguard/ would shadow the links (the current
    # directory comes first on sys.path)
    cwd = site.parent if site is not None else tree
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=3600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"bench {name} failed in {tree}:\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def _numbers(result: dict) -> dict:
    return {k: v for k, v in result.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _summary(rounds: list[dict]) -> dict:
    keys = set.intersection(*(set(_numbers(r)) for r in rounds))
    out = {}
    for k in sorted(keys):
        values = [r[k] for r in rounds]
        out[k] = max(values) if k.endswith("_per_s") else statistics.median(values)
    return out


def _ratios(now: dict, before: dict) -> dict:
    """this/earlier of each rate: ``*_per_s`` (wall clock) and ``*_per_worker_cpu_s*`` (per
    CPU second of the workers, which moves far less on the shared machine)."""
    return {k: round(now[k] / before[k], 3) for k in now
            if (k.endswith("_per_s") or "_per_worker_cpu_s" in k) and before.get(k)}


def compare(name: str, against: str, rounds: int = 3, settings: dict | None = None) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", against], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old), commit],
                       cwd=REPO, check=True)
        try:
            site = Path(tmp) / "site"
            _link_packages(old, site)
            probe = Path(tmp) / "probe"
            probe.mkdir()
            (probe / "sitecustomize.py").write_text(PROBE)
            logs = {"this": Path(tmp) / "this.log", "earlier": Path(tmp) / "earlier.log"}
            mine, theirs = [], []
            for _ in range(rounds):
                theirs.append(_one(old, name, site, probe, logs["earlier"], settings))
                mine.append(_one(REPO, name, None, probe, logs["this"], settings))
            checked = {"this": _checked_imports(logs["this"], REPO),
                       "earlier": _checked_imports(logs["earlier"], old)}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=REPO)
    now, before = _summary(mine), _summary(theirs)
    ratios = _ratios(now, before)
    return {"bench": name, "against": commit, "rounds": rounds, "this": now,
            "earlier": before, "ratio_this_to_earlier": ratios, "imports_checked": checked,
            "settings": settings or {}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("--against", required=True, metavar="REV")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a module constant of the bench, for both trees alike (a Python "
                             "literal; one read when run() runs, not a default argument), e.g. "
                             "--set RANKS=2048 to shorten stream_throughput")
    args = parser.parse_args()
    settings = {}
    for item in args.set:
        key, _, value = item.partition("=")
        try:
            settings[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            settings[key] = _NOT_LITERAL
        if not key.isidentifier() or not key.isupper() or settings[key] is _NOT_LITERAL:
            print(f"compare: --set {item!r}: give NAME=VALUE, an upper-case constant of the "
                  "bench and a Python literal", file=sys.stderr)
            return 2
    if not re.fullmatch(r"[A-Za-z0-9_]+", args.name) or \
            not (HERE / f"bench_{args.name}.py").exists():
        print(f"compare: no benchmark named {args.name!r}", file=sys.stderr)
        return 2
    result = compare(args.name, args.against, args.rounds, settings)
    import datetime
    import platform

    from run import _cpu_count, _memory_gib

    stamped = {"bench": f"compare_{args.name}",
               "date": datetime.datetime.now().isoformat(timespec="seconds"),
               "machine": f"{platform.node()} {platform.machine()} {_cpu_count()} cores "
                          f"{_memory_gib():.0f} GiB", "result": result}
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / f"compare_{args.name}.json").write_text(json.dumps(stamped, indent=2)
                                                                + "\n")
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
