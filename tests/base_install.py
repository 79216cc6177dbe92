"""The base install (``pip install trainguard``, no extras) in a fresh virtual environment:
for the packaging test and the import-cost benchmark.

The package is built as a wheel from a copy of the checkout (the working tree stays as it is)
and installed with pip's ordinary dependency resolution, so the environment holds exactly what
the base install pulls in. pip's own cache keeps later builds quick."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: the files besides the package folders that the wheel is built from
PROJECT_FILES = ("pyproject.toml", "README.md", "LICENSE")

#: distributions of the server extra, none of which a rank's environment may get
SERVER_DISTRIBUTIONS = ("faust-streaming", "aiokafka", "mode-streaming", "river", "numpy",
                        "nvidia-ml-py", "py-spy", "zstandard", "rich")

PIP_QUIET = ("-q", "--disable-pip-version-check", "--no-input")


def package_folders() -> list[str]:
    """The folders of pyproject's ``package-dir`` (each room of ``trainguard.*``)."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return sorted({folder.split("/")[0] for folder in setuptools["package-dir"].values()})


def copy_sources(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    dest.mkdir(parents=True)
    for name in (*PROJECT_FILES, *package_folders()):
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore)
        else:
            shutil.copy2(source, dest / name)
    return dest


def _can_build_here() -> bool:
    """Whether this interpreter's setuptools builds the package without an isolated build
    environment (SPDX ``license`` needs setuptools 77)."""
    try:
        from importlib.metadata import version

        return int(version("setuptools").split(".")[0]) >= 77
    except Exception:
        return False


def build_wheel(workdir: Path) -> Path:
    source = copy_sources(workdir / "src")
    isolation = ("--no-build-isolation",) if _can_build_here() else ()
    subprocess.run([sys.executable, "-m", "pip", "wheel", *PIP_QUIET, "--no-deps", *isolation,
                    ".", "-w", str(workdir / "wheels")], cwd=source, check=True,
                   capture_output=True, text=True)
    return next((workdir / "wheels").glob("trainguard-*.whl"))


def create_base_venv(workdir: Path, extras: str = "") -> Path:
    """A fresh virtual environment under ``workdir`` with the base install (plus ``extras``,
    such as ``"server"``); its python."""
    wheel = build_wheel(workdir)
    venv = workdir / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    python = venv / "bin" / "python"
    requirement = f"trainguard[{extras}] @ {wheel.as_uri()}" if extras else str(wheel)
    subprocess.run([str(python), "-m", "pip", "install", *PIP_QUIET, requirement], check=True,
                   capture_output=True, text=True)
    return python


def installed(python: Path) -> dict[str, str]:
    """Distributions of ``python``'s environment: normalized name -> version."""
    out = subprocess.run([str(python), "-m", "pip", "list", "--format=json",
                          "--disable-pip-version-check"], check=True, capture_output=True,
                         text=True).stdout
    return {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(out)}


#: what ``python -m venv`` puts into site-packages before anything is installed
VENV_TOOLS = ("pip", "setuptools", "pkg_resources", "_distutils_hack", "distutils-precedence")


def site_packages_bytes(python: Path) -> int:
    """Bytes under ``python``'s site-packages, the environment's own pip and setuptools left
    out."""
    out = subprocess.run([str(python), "-c", "import sysconfig; "
                          "print(sysconfig.get_paths()['purelib'])"], check=True,
                         capture_output=True, text=True).stdout.strip()
    entries = [e for e in Path(out).iterdir()
               if not e.name.replace("-", "_").startswith(
                   tuple(t.replace("-", "_") for t in VENV_TOOLS))]
    return sum(f.stat().st_size for e in entries
               for f in ([e] if e.is_file() else e.rglob("*")) if f.is_file())
