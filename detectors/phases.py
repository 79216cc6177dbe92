"""The phases a rank reports (SPEC §1 ``heartbeat.phase``): those of the step itself, in
their order, and the allowed ones that pause the step clock."""
from __future__ import annotations

__all__ = ["STEP_PHASES", "PHASE_ORDER", "is_allowed_phase"]

#: Phases of the step itself (SPEC names, and the collector's ``step`` and ``idle``): time
#: spent in them is the step's, not an allowance.
STEP_PHASES = frozenset(("data", "forward", "backward", "optimizer", "collective", "idle",
                         "step"))


#: The order of a step's phases, to tell the ranks behind from the ones that went on.
PHASE_ORDER = {"idle": 0, "step": 0, "data": 1, "forward": 2, "backward": 3, "optimizer": 4,
               "collective": 5}


def is_allowed_phase(phase) -> bool:
    """``checkpoint``, ``eval``, ``init`` and user-declared phases pause the step clock.

    >>> [is_allowed_phase(p) for p in ("checkpoint", "compile", "forward", None)]
    [True, True, False, False]
    """
    return type(phase) is str and phase not in STEP_PHASES
