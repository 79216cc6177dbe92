"""One benchmark on this tree and on an earlier commit, interleaved in one run:
``python bench/compare.py NAME --against REV [--rounds N] [--json]``.

The earlier commit is checked out in a temporary ``git worktree``; its packages are made
importable from a folder of links laid out by that commit's own ``package-dir`` (so that
``import trainguard`` finds its code, not this tree's), and each round runs
``bench_<NAME>.run()`` of each tree in a fresh process, alternating, so that a noisy spell of
the shared machine hits both alike. Reported: each tree's numeric results (the best round of
each for rates, ``*_per_s``, the median otherwise) and the ratio this/earlier of each rate.
"""
from __future__ import annotations

import argparse
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
       "import bench_{name} as b; print('RESULT ' + json.dumps(b.run()))")


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


def _one(tree: Path, name: str, site: Path | None) -> dict:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = str(site) + os.pathsep + env.get("PYTHONPATH", "")
    code = RUN.format(bench=str(tree / "bench"), tests=str(tree / "tests"), name=name)
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


def compare(name: str, against: str, rounds: int = 3) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", against], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old), commit],
                       cwd=REPO, check=True)
        try:
            site = Path(tmp) / "site"
            _link_packages(old, site)
            mine, theirs = [], []
            for _ in range(rounds):
                theirs.append(_one(old, name, site))
                mine.append(_one(REPO, name, None))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=REPO)
    now, before = _summary(mine), _summary(theirs)
    ratios = {k: round(now[k] / before[k], 3) for k in now
              if k.endswith("_per_s") and before.get(k)}
    return {"bench": name, "against": commit, "rounds": rounds, "this": now,
            "earlier": before, "ratio_this_to_earlier": ratios}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("--against", required=True, metavar="REV")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not re.fullmatch(r"[A-Za-z0-9_]+", args.name) or \
            not (HERE / f"bench_{args.name}.py").exists():
        print(f"compare: no benchmark named {args.name!r}", file=sys.stderr)
        return 2
    result = compare(args.name, args.against, args.rounds)
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
