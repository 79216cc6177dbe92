"""trainguard: watch every rank of a distributed training job, find what goes wrong, recover.

The training-side surface is SPEC §5: ``tg = trainguard.init(job=...)``.
"""
__version__ = "0.1.0"

from .extras import install_server_hint as _install_server_hint

_install_server_hint()


def init(job: str, **kwargs):
    """Start the collector of this rank. It never blocks on the network and never raises because
    Kafka is unreachable; a malformed job id or rank is a programming error (``ValueError``)."""
    from .collectors.api import init as _init

    return _init(job=job, **kwargs)


def __getattr__(name):
    if name == "chaos":  # `import trainguard` then `trainguard.apps.chaos.from_env(...)` for game days
        import importlib

        return importlib.import_module(".apps.chaos", __name__)
    raise AttributeError(f"module 'trainguard' has no attribute {name!r}")


def resume_step(available_steps, environ=None):
    """The checkpoint step a (re)started script should load (SPEC §6): the newest of
    ``available_steps`` at or before ``TRAINGUARD_RESUME_STEP`` when set, else the newest."""
    from .collectors.resume import resume_step as _resume_step

    return _resume_step(available_steps, environ=environ)
