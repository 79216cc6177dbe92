"""The import rules of docs/ARCHITECTURE.md, checked with import-linter: what each room may
import, what no room imports, and no import cycles anywhere in the package.

The package maps its rooms with setuptools ``package-dir`` (``trainguard.detectors`` is
``detectors/``), which grimp cannot see from the source tree; so the check lays the package
out as it is installed, as symbolic links in a temporary folder (as ``bench/compare.py``
does), and runs ``lint-imports`` there in a process of its own. A broken rule fails with
import-linter's report: which module imports which, and the chain of imports.

To change a rule, change :data:`MAY_IMPORT` and the table in docs/ARCHITECTURE.md together
(a test holds them equal).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARCHITECTURE = REPO / "docs" / "ARCHITECTURE.md"

#: room -> the rooms it may import (besides the standard library and its dependencies). The
#: core is every module of ``trainguard/`` but the entry points, ``integrations/`` and
#: ``checkpoint/``.
MAY_IMPORT = {
    "core": (),
    "checkpoint": ("core",),
    "collectors": ("core", "checkpoint"),
    "detectors": ("core",),
    "diagnosis": ("core",),
    "integrations": ("core", "checkpoint", "collectors"),
    "streams": ("core", "detectors"),
    "actions": ("core", "detectors", "diagnosis"),
    "launcher": ("core", "checkpoint", "collectors", "integrations", "actions"),
    "apps": ("core", "collectors", "detectors", "diagnosis", "streams", "actions"),
    "deploy": (),
    "entry points": ("core", "checkpoint", "collectors", "detectors", "diagnosis",
                     "integrations", "streams", "actions", "launcher", "apps"),
}
#: the rooms that are packages of their own (``trainguard.<name>``)
PACKAGES = ("checkpoint", "collectors", "detectors", "diagnosis", "integrations", "streams",
            "actions", "launcher", "apps", "deploy")
#: the modules of ``trainguard/`` that wire the rooms together (``trainguard/__init__.py``, the
#: ``trainguard.init`` of a training script, is one too; it is the package itself)
ENTRY_POINTS = ("trainguard.cli", "trainguard.commands")
#: Known exceptions: core modules that still import rooms. ``configsections`` builds the
#: root of the configuration tree (``TrainguardConfig``, the one place that nests every
#: room's Config, importing each room only when its section is wanted); it belongs with the
#: entry points. Until then its imports of rooms are not checked, here nor in the search for
#: cycles.
CORE_EXCEPTIONS = ("trainguard.configsections",)
#: third-party packages of the server install (pyproject's ``server`` extra) that what runs in
#: a training process never imports itself
SERVER_ONLY = ("faust", "aiokafka", "mode", "river", "numpy", "rich", "zstandard")
TRAINING_SIDE = ("collectors", "integrations", "launcher")
#: detectors run offline and in unit tests unchanged: no Kafka, no Faust, and no pickle
DETECTORS_NEVER = ("confluent_kafka", "faust", "aiokafka", "mode", "pickle")
#: test support lives in tests/, not in the package
TEST_ONLY = ("unittest", "pytest", "hypothesis")


def core_modules() -> list[str]:
    """Every core module: ``trainguard/*.py`` and ``trainguard/schemas`` but the package's
    ``__init__``, the entry points and the exceptions."""
    names = [f"trainguard.{p.stem}" for p in sorted((REPO / "trainguard").glob("*.py"))
             if p.stem != "__init__"]
    names += [f"trainguard.{p.name}" for p in sorted((REPO / "trainguard").iterdir())
              if (p / "__init__.py").is_file() and p.name not in PACKAGES]
    return [n for n in names if n not in ENTRY_POINTS and n not in CORE_EXCEPTIONS]


def folder_of(room: str) -> Path:
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    return REPO / mapping.get(f"trainguard.{room}", f"trainguard/{room}")


def modules_of(room: str) -> list[str]:
    if room == "core":
        return core_modules()
    if room == "entry points":
        return list(ENTRY_POINTS)
    return [f"trainguard.{room}"] if (folder_of(room) / "__init__.py").is_file() else []


def exception_imports() -> list[str]:
    return [f"{module} -> trainguard.{room}{tail}" for module in CORE_EXCEPTIONS
            for room in PACKAGES if modules_of(room) for tail in ("", ".**")]


def _list(values) -> str:
    return "[" + ", ".join(f'"{v}"' for v in values) + "]"


def contracts() -> str:
    """The import-linter configuration (TOML) of the rules."""
    out = ["[tool.importlinter]", 'root_packages = ["trainguard"]',
           "include_external_packages = true", ""]

    def contract(cid, name, kind, **fields):
        out.extend(["[[tool.importlinter.contracts]]", f'id = "{cid}"', f'name = "{name}"',
                    f'type = "{kind}"'])
        for key, value in fields.items():
            out.append(f"{key} = {_list(value) if isinstance(value, list) else value}")
        out.append("")

    ignored = dict(ignore_imports=exception_imports(),
                   unmatched_ignore_imports_alerting='"none"')
    for room, allowed in MAY_IMPORT.items():
        if room == "entry points" or not modules_of(room):
            continue
        forbidden = [m for other in MAY_IMPORT if other != room and other not in allowed
                     for m in modules_of(other)]
        says = f"only {', '.join(allowed)}" if allowed else "no other room"
        contract(f"room-{room.replace(' ', '-')}", f"{room}: imports {says}", "forbidden",
                 source_modules=modules_of(room), forbidden_modules=forbidden,
                 allow_indirect_imports="true", **ignored)
    contract("no-cycles", "no import cycles, at any depth of the package", "acyclic_siblings",
             ancestors=["trainguard"], **ignored)
    contract("detectors-offline", "detectors import no Kafka, Faust or pickle", "forbidden",
             source_modules=["trainguard.detectors"], forbidden_modules=list(DETECTORS_NEVER),
             allow_indirect_imports="true")
    contract("training-side-light", "the training side imports no server package", "forbidden",
             source_modules=[f"trainguard.{r}" for r in TRAINING_SIDE],
             forbidden_modules=list(SERVER_ONLY), allow_indirect_imports="true")
    contract("no-test-support", "the package imports no test framework", "forbidden",
             source_modules=["trainguard"], forbidden_modules=list(TEST_ONLY),
             allow_indirect_imports="true")
    return "\n".join(out)


def link_packages(site: Path) -> None:
    """``site/trainguard/...``: links to the repository's modules as ``package-dir`` maps them
    (the layout of an installed trainguard)."""
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    for package, folder in sorted(tool["package-dir"].items(), key=lambda kv: kv[0].count(".")):
        target = site.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for entry in (REPO / folder).iterdir():
            link = target / entry.name
            if link.exists() or entry.name == "__pycache__":
                continue
            if entry.suffix == ".py" or (entry.is_dir() and (entry / "__init__.py").is_file()):
                link.symlink_to(entry)


def test_the_rooms_keep_their_import_rules(tmp_path):
    pytest.importorskip("importlinter")
    site = tmp_path / "site"
    link_packages(site)
    config = tmp_path / "importlinter.toml"
    config.write_text(contracts())
    lint = Path(sys.executable).with_name("lint-imports")
    command = [str(lint)] if lint.exists() else [
        sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c;"
                              " sys.exit(c())"]
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONSAFEPATH": "1"}
    # In its own process with the linked layout first on the path (this one has imported
    # the editable install's trainguard already), away from the source tree.
    done = subprocess.run([*command, "--no-cache", "--no-logo", str(config)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-12000:] + done.stderr[-4000:]
    assert "BROKEN" not in done.stdout and "KEPT" in done.stdout


def test_every_package_module_has_a_room():
    """Each Python file of the package is in exactly one room (docs/ARCHITECTURE.md)."""
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    rooms = {"trainguard." + name for name in PACKAGES}
    for package in tool["package-dir"]:
        top = ".".join(package.split(".")[:2])
        assert package == "trainguard" or top in rooms, f"{package}: add its room to MAY_IMPORT"
    assert set(PACKAGES) | {"core", "entry points"} == set(MAY_IMPORT)


def documented_rules() -> dict:
    """The table of docs/ARCHITECTURE.md: ``| room | folder | may import |``."""
    text = ARCHITECTURE.read_text()
    section = text.split("## Rooms and what each may import", 1)[1].split("\n## ", 1)[0]
    rules = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("**"):
            continue
        room = cells[0].strip("*")
        allowed = re.findall(r"[a-z][a-z ]*[a-z]", cells[-1].split("(")[0])
        rules[room] = tuple(a for a in allowed if a != "nothing")
    return rules


def test_the_map_says_what_the_rules_check():
    documented = documented_rules()
    assert documented == {room: tuple(allowed) for room, allowed in MAY_IMPORT.items()}
