"""Every docstring example in the package runs, as river's do."""
import doctest
import importlib
import pkgutil

import pytest

import trainguard

SKIP = {"trainguard.schemas.__main__", "trainguard.cli"}


def _modules():
    names = []
    for info in pkgutil.walk_packages(trainguard.__path__, "trainguard."):
        if info.name not in SKIP:
            names.append(info.name)
    # The rooms are mapped by package-dir and walk_packages sees them through trainguard.__path__
    # only when editable; list them explicitly as well.
    for room in ("collectors", "detectors", "streams", "actions", "launcher", "diagnosis", "apps",
                 "deploy"):
        package = importlib.import_module(f"trainguard.{room}")
        for info in pkgutil.walk_packages(package.__path__, f"trainguard.{room}."):
            names.append(info.name)
    return sorted(set(names))


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
    try:
        module = importlib.import_module(name)
    except ImportError as exc:  # an optional extra (e.g. kubernetes) is not installed
        pytest.skip(f"{name}: {exc}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"
