"""The package list in pyproject.toml covers every Python package folder of every room."""
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOMS = {"trainguard": "trainguard", "collectors": "trainguard.collectors",
         "detectors": "trainguard.detectors", "streams": "trainguard.streams",
         "actions": "trainguard.actions", "deploy": "trainguard.deploy"}


def test_every_package_folder_is_listed():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = set()
    for folder, package in ROOMS.items():
        for init in (REPO / folder).rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            relative = init.parent.relative_to(REPO / folder).parts
            found.add(".".join((package, *relative)))
    assert found - listed == set(), "add these to [tool.setuptools] packages"


def test_the_base_install_has_version_ranges_and_no_server_package():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"],
                    *(r for extra in project["optional-dependencies"].values() for r in extra)]
    assert [r for r in requirements if "==" in r] == []
    base = {r.split(">")[0].split("<")[0].split(";")[0].strip().lower()
            for r in project["dependencies"]}
    server = {r.split(">")[0].split("<")[0].strip().lower()
              for r in project["optional-dependencies"]["server"]}
    assert base & server == set()
    assert {"faust-streaming", "aiokafka", "mode-streaming", "river", "py-spy", "rich"} <= server
