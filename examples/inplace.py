"""Restart in place, for examples/train.py: the standby launcher, now part of trainguard.

    python examples/inplace.py --nproc 4 --standby 1 -- examples/train.py --snapshot-every 1 ...

is ``python -m trainguard.launcher.inplace`` (and ``trainguard run --nproc 4 --standby 1 --
examples/train.py ...`` under the supervisor); the rank side is
:class:`trainguard.checkpoint.inplace.InPlace`. See docs/RECOVERY.md.
"""
import sys

from trainguard.checkpoint.inplace import InPlace  # noqa: F401  (the rank side, as before)
from trainguard.launcher.inplace import main

if __name__ == "__main__":
    sys.exit(main())
