"""The ``detectors`` section of the configuration tree: each detector's own ``Config``,
the stages' and the correlation's.

Nothing is declared twice here: ``detectors.hang`` is :class:`HangDetector.Config`, whose
fields (with their defaults, meanings, ranges and whether they may change while a job runs)
are written beside the detector's code. The sections are made from the detectors'
registrations (:mod:`~trainguard.detectors.registry`): a new detector's settings appear here
without a line written. :meth:`DetectorsConfig.params_for` gives a detector class its settings.

>>> from trainguard.setting import with_values
>>> config = with_values(DetectorsConfig(), {"hang.floor_s": 30.0})
>>> config.hang.floor_s, config.straggler.k, config.straggler.n
(30.0, 6, 10)
>>> with_values(DetectorsConfig(), {"straggler.k": 12})
Traceback (most recent call last):
...
trainguard.config.ConfigError: detectors.straggler.k (12) must be between 1 and detectors.straggler.n (10)
>>> with_values(DetectorsConfig(), {"stages.heartbeat_summary_s": 20.0})
Traceback (most recent call last):
...
trainguard.config.ConfigError: detectors.stages.heartbeat_summary_s (20) must be below detectors.silent.timeout_s (15)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from trainguard.config import ConfigError
from trainguard.setting import setting, validate

from .correlate import Correlator
from .registry import detector_classes

__all__ = ["DetectorsConfig", "DetectorConfig", "StagesConfig", "DETECTORS"]

#: Every built-in detector class, in the order they run (their registrations,
#: :mod:`~trainguard.detectors.registry`).
DETECTORS = detector_classes(builtin_only=True)


@dataclass(kw_only=True)
class StagesConfig:
    """How the stages feed the detectors (:mod:`trainguard.detectors.stages`)."""

    heartbeat_summary_s: float = setting(5.0, "RankStage forwards an unchanged heartbeat "
                                              "this often (0: every one); below "
                                              "detectors.silent.timeout_s", maximum=3600.0)
    step_window: int = setting(32, "a rank's record counts toward its step while the job is "
                                   "fewer than this many steps further (steps by number: a "
                                   "rank that lags or a clock that is off still counts)",
                               minimum=1)
    step_window_s: float = setting(5.0, "... and at most this many seconds of the job's clock "
                                        "after the step's first record")
    advance_grid_s: float = setting(0.5, "a job's detectors advance (time-driven checks) at "
                                         "most once per this many seconds of the job's event "
                                         "time")
    emitted_ids_kept: int = setting(10000, "anomaly ids remembered for de-duplication")


class _Sections:
    """The methods of :class:`DetectorsConfig`, whose fields are made from the registrations."""

    def __post_init__(self):
        validate(self, "detectors.")
        silent = getattr(self, "silent", None)
        every = self.stages.heartbeat_summary_s
        if silent is not None and every >= silent.timeout_s:
            # a rank in a long phase is heard on the job side only this often
            raise ConfigError(f"detectors.stages.heartbeat_summary_s ({every:g}) must be "
                              f"below detectors.silent.timeout_s ({silent.timeout_s:g})")

    def params_for(self, cls) -> dict:
        """Constructor arguments of detector class ``cls``: its section's values (none for a
        detector without a section: its own defaults)."""
        section = getattr(self, cls.PREFIX, None)
        if not dataclasses.is_dataclass(section):
            return {}
        return dict(vars(section))


def _sections(classes) -> list:
    """``detectors.<PREFIX>``: the ``Config`` of each detector that has settings, then the
    stages' and the correlation's."""
    own = [(cls.PREFIX, cls.Config, field(default_factory=cls.Config)) for cls in classes
           if dataclasses.fields(cls.Config)]
    return [*own, ("stages", StagesConfig, field(default_factory=StagesConfig)),
            ("correlate", Correlator.Config, field(default_factory=Correlator.Config))]


DetectorsConfig = dataclasses.make_dataclass(
    "DetectorsConfig", _sections(detector_classes()), bases=(_Sections,), kw_only=True)
DetectorsConfig.__module__ = __name__
DetectorsConfig.__doc__ = """The ``detectors`` section: ``detectors.<PREFIX>`` is the ``Config``
of that detector (built-in or loaded as a plug-in before this module), then ``stages`` and
``correlate``."""

#: the name of earlier versions
DetectorConfig = DetectorsConfig
