"""``trainguard run --instrument`` / ``TRAINGUARD_INSTRUMENT=1``: watch an unmodified script.

``trainguard run --instrument`` puts :data:`SITE_DIR` first on ``PYTHONPATH`` and sets
``TRAINGUARD_INSTRUMENT=1``; the ``sitecustomize`` module there calls :func:`activate` in every
Python process of the command. A launcher that trainguard does not start does the same with::

    export TRAINGUARD_INSTRUMENT=1
    export PYTHONPATH="$(python -m trainguard.integrations.instrument):$PYTHONPATH"

:func:`activate` costs nothing until the process imports ``torch``; then it installs
:class:`~.torch_hooks.TorchHooks`. A torchrun worker (``RANK`` in the environment) starts its
collector at once, so heartbeats show ``init`` while the job sets up; any other process (the
torchrun agent, a plain ``python train.py``) only when it first trains (a forward pass with
gradients, a backward pass, an optimizer step). Children of a watched rank (DataLoader workers
started by spawn) are left alone.

The job id is ``TRAINGUARD_JOB`` (set by ``trainguard run``), else ``TRAINGUARD_JOB_ID``, else
the script's name. The job's parallel layout cannot be seen before its first step, when the
rank's ``lifecycle`` start is long sent: ``TRAINGUARD_TOPOLOGY=pp=2,dp=2`` (``tp``, ``pp``,
``dp``; a missing ``dp`` is what the world size leaves) gives it (:func:`topology_from_env`),
so that the straggler detector compares the ranks of a pipeline stage among themselves.
If the script calls ``trainguard.init`` itself, it takes the collector over
(same job id) or replaces it (another one), and once it calls ``tg.step`` the hooks stand down.
"""
from __future__ import annotations

import logging
import os
import sys

from .import_hooks import AfterImport

__all__ = ["SITE_DIR", "activate", "start", "instrument_env", "topology_from_env"]

log = logging.getLogger(__name__)

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "site")
_MARK = "TRAINGUARD_INSTRUMENTED_PID"
_STATE: dict = {}


def instrument_env(environ) -> dict:
    """The variables that make a command's Python processes load the hooks."""
    path = environ.get("PYTHONPATH", "")
    parts = [p for p in path.split(os.pathsep) if p and p != SITE_DIR]
    return {"TRAINGUARD_INSTRUMENT": "1", "PYTHONPATH": os.pathsep.join([SITE_DIR, *parts])}


def enabled(environ=None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get("TRAINGUARD_INSTRUMENT", "").strip().lower() in ("1", "true", "yes", "on")


def activate(environ=None) -> bool:
    """Install the hooks now if ``torch`` is imported, else as soon as it is; returns whether
    this process will be watched. Never raises."""
    environ = os.environ if environ is None else environ
    try:
        if not enabled(environ) or _STATE:
            return False
        owner = environ.get(_MARK)
        if owner and owner != str(os.getpid()) and _alive(owner):
            return False  # a child of a watched rank
        _STATE["pending"] = True
        if "torch" in sys.modules:
            start(environ)
        else:
            sys.meta_path.insert(0, AfterImport("torch", lambda: start(environ)))
        return True
    except Exception as exc:
        log.warning("trainguard --instrument: not watching this process: %s", exc)
        return False


def start(environ=None):
    """Install the hooks and the watcher (``torch`` is imported); returns the hooks."""
    environ = os.environ if environ is None else environ
    if _STATE.get("hooks") is not None:
        return _STATE["hooks"]
    try:
        from .torch_hooks import TorchHooks, installed
        from .watcher import StepWatcher

        if installed() is not None:  # a framework callback got there first
            return installed()
        watcher = StepWatcher(lambda: _start_collector(environ))
        hooks = _STATE["hooks"] = TorchHooks(watcher, end_steps_on_optimizer=True).install()
        if environ.get("RANK") not in (None, ""):
            watcher.live()
        return hooks
    except Exception as exc:
        log.warning("trainguard --instrument: not watching this process: %s", exc)
        return None


def topology_from_env(environ) -> dict | None:
    """SPEC's ``topology`` from ``TRAINGUARD_TOPOLOGY`` (``tp=..,pp=..,dp=..``, each an int
    >= 1); None when it is unset, or unreadable (then with one warning: the job runs on).

    >>> topology_from_env({"TRAINGUARD_TOPOLOGY": "pp=2, dp=2"})
    {'pp': 2, 'dp': 2}
    >>> topology_from_env({"TRAINGUARD_TOPOLOGY": "pp=two"}) is None
    True
    """
    raw = environ.get("TRAINGUARD_TOPOLOGY", "").strip()
    if not raw:
        return None
    out = {}
    for part in raw.split(","):
        name, _, value = part.partition("=")
        name, value = name.strip(), value.strip()
        if name not in ("tp", "pp", "dp") or not value.isdigit() or int(value) < 1:
            log.warning("trainguard --instrument: TRAINGUARD_TOPOLOGY=%r ignored: want "
                        "tp=N,pp=N,dp=N with each N >= 1", raw)
            return None
        out[name] = int(value)
    return out


def _start_collector(environ):
    from trainguard.collectors.api import init, running

    from .watcher import job_id

    collector = running()
    if collector is not None:  # the script's own trainguard.init came first
        return collector
    collector = init(job=job_id(environ), topology=topology_from_env(environ), environ=environ)
    collector.implicit = True
    os.environ[_MARK] = str(os.getpid())
    return collector


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
        return True
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True


if __name__ == "__main__":  # `python -m trainguard.integrations.instrument`: the PYTHONPATH entry
    print(SITE_DIR)
