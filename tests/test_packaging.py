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
