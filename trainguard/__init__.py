"""trainguard: watch every rank of a distributed training job, find what goes wrong, recover.

The training-side surface is SPEC §5: ``tg = trainguard.init(job=...)``.
"""
__version__ = "0.1.0"


def init(job: str, **kwargs):
    """Start the collector of this rank; never raises and never blocks on the network."""
    from .collectors.api import init as _init

    return _init(job=job, **kwargs)
