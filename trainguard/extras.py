"""The two installs. ``pip install trainguard`` is what a training rank needs (the collector,
``trainguard.init``, ``--instrument``'s hooks, the callbacks, ``trainguard run``);
``pip install 'trainguard[server]'`` adds the worker, the action service, the agent and the
offline tools. When a trainguard module needs a package of the server install that is missing,
the import error says so in one line instead of naming a package the user never asked for."""
from __future__ import annotations

import sys

SERVER_INSTALL = "pip install 'trainguard[server]'"

# Top-level modules that only the server extra brings (and river's own numpy and scipy).
SERVER_MODULES = frozenset({"faust", "aiokafka", "mode", "river", "numpy", "scipy", "pynvml",
                            "zstandard", "rich"})


def needs_server(exc: BaseException) -> bool:
    """Whether ``exc`` is the import of a server-install package that is not there."""
    return (isinstance(exc, ModuleNotFoundError)
            and (exc.name or "").partition(".")[0] in SERVER_MODULES)


def missing_server_install(module: str) -> str:
    """The one line a command says when the server install is missing."""
    return f"this command needs the server install ({module} is missing): {SERVER_INSTALL}"


def _importer_name() -> str:
    """The module whose ``import`` statement is being resolved (importlib's frames skipped)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(("importlib", __name__)):
            return name
        frame = frame.f_back
    return ""


class ServerInstallHint:
    """Last on ``sys.meta_path``, so asked only about modules that no finder has: for a server
    package missing under a trainguard module, raises the one-line error; else stays out."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if path is not None or name not in SERVER_MODULES:
            return None
        importer = _importer_name()
        if not importer.startswith("trainguard."):
            return None
        raise ModuleNotFoundError(f"No module named {name!r}: {importer} is part of the server "
                                  f"install: {SERVER_INSTALL}", name=name)


def install_server_hint() -> None:
    if ServerInstallHint not in sys.meta_path:
        sys.meta_path.append(ServerInstallHint)


def require_server(modules) -> None:
    """Refuse a command in one line when a server-install module it needs is not installed."""
    from importlib.util import find_spec

    from .errors import UserError

    for module in modules:
        try:
            missing = find_spec(module) is None
        except ModuleNotFoundError:     # ServerInstallHint answers for trainguard's callers
            missing = True
        if missing:
            raise UserError(missing_server_install(module))
