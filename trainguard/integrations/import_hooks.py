"""Run something right after a module is imported: :class:`AfterImport`."""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable

__all__ = ["AfterImport"]


class AfterImport(importlib.abc.MetaPathFinder):
    """Put first on ``sys.meta_path``: runs ``then()`` right after module ``name`` has been
    imported, once (the finder then leaves ``sys.meta_path``). What ``then`` raises is
    dropped: the import itself went through."""

    def __init__(self, name: str, then: Callable[[], object]):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original, then = loader.exec_module, self.then

        def exec_module(module):
            original(module)
            try:
                then()
            except Exception:
                pass
        loader.exec_module = exec_module
        return spec
