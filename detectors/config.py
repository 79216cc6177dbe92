"""Every threshold of the detectors, the stages and the correlation, in one validated config.

Field names are ``<detector prefix>_<constructor argument>``: ``straggler_ratio`` is the
``ratio`` argument of :class:`~trainguard.detectors.timing.StragglerDetector`, whose
``PREFIX`` is ``"straggler"``. :meth:`DetectorConfig.params_for` builds a detector's
constructor arguments from it, so the defaults below are the detectors' defaults.

>>> config = DetectorConfig(hang_floor_s=30.0)
>>> config.hang_floor_s, config.straggler_k, config.straggler_n
(30.0, 6, 10)
>>> DetectorConfig(straggler_k=12, straggler_n=10)
Traceback (most recent call last):
...
ValueError: straggler_k (12) must be between 1 and straggler_n (10)
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass


@dataclass(kw_only=True)
class DetectorConfig:
    # -- nan: non-finite loss or gradient norm -------------------------------------------
    #: with a dynamic loss scaler in use (``loss_scale`` reported), a non-finite gradient norm
    #: alone is the scaler's normal overflow skip; reported only after this many steps in a row
    nan_scaler_patience: int = 8

    # -- loss_spike / grad_spike: robust online baseline of the per-step median across ranks
    loss_spike_window: int = 50            # steps in the rolling median baseline
    loss_spike_tail_window: int = 1000     # steps over which the tail of deviations is learned
    loss_spike_tail_quantile: float = 0.995
    loss_spike_tail_factor: float = 4.0    # spike: log deviation > factor x tail quantile ...
    loss_spike_min_ratio: float = 1.1      # ... and value > min_ratio x baseline
    loss_spike_warmup: int = 20            # steps learned before any report
    loss_spike_cooldown: int = 20          # quiet steps that end a spike episode
    loss_spike_early_steps: int = 250      # young curves are rough: in these first steps ...
    loss_spike_early_min_ratio: float = 1.5  # ... a spike must be at least this x baseline
    grad_spike_window: int = 50
    grad_spike_tail_window: int = 1000
    grad_spike_tail_quantile: float = 0.995
    grad_spike_tail_factor: float = 4.0
    grad_spike_min_ratio: float = 2.5
    grad_spike_warmup: int = 20
    grad_spike_cooldown: int = 20
    grad_spike_early_steps: int = 250
    grad_spike_early_min_ratio: float = 5.0
    grad_spike_rise_ratio: float = 10.0    # a norm this x its level before a rise ...
    grad_spike_rise_steps: int = 4         # ... of 2 to this many steps is a spike (0: off)

    # -- straggler: a rank's compute_time against the median of its peers, per step ---------
    straggler_ratio: float = 1.2           # slow in a step: compute_time >= ratio x usual
    straggler_min_excess_s: float = 0.002  # ... and at least this many seconds more
    straggler_k: int = 6                   # persistent: slow in k ...
    straggler_n: int = 10                  # ... of the last n steps it reported
    straggler_settle: int = 2              # steps to wait for more ranks before naming them
    straggler_min_ranks: int = 3           # ranks needed in a step (and a stage) to compare
    straggler_warmup: int = 10             # steps each rank's own baseline is learned over
    straggler_baseline_step: float = 0.002  # ... then moved this much (log) per step
    straggler_noise_z: float = 3.0         # slow also needs >= z x the rank's own spread

    # -- throughput_drop: Page-Hinkley on the job's log step time, confirmed by a ratio ------
    throughput_warmup: int = 50            # steps before learning starts (compile, warm-up)
    throughput_baseline_window: int = 200  # steps in the protected baseline median
    throughput_window: int = 20            # steps in the recent median compared with it
    throughput_ratio: float = 1.25         # confirmed when recent median >= ratio x baseline
    throughput_clip: float = 4.0           # one step counts at most clip x baseline
    throughput_delta: float = 0.05         # Page-Hinkley delta, in log step time
    throughput_threshold: float = 4.0      # Page-Hinkley threshold, in log step time
    throughput_standout_ratio: float = 1.2  # a rank slower than this vs peers "stands out"

    # -- hang: no progress after the later of the last step and the last allowed phase ------
    hang_floor_s: float = 20.0             # timeout never below this
    hang_factor: float = 2.0               # ... x the p99 of the job's step intervals
    hang_quantile: float = 0.99
    hang_window: int = 500                 # step intervals the quantile is learned over
    hang_max_margin: float = 1.0           # ... and never below this x the longest of them
    hang_min_intervals: int = 5            # before, the first-step budget applies
    hang_checkpoint_s: float = 1800.0      # default allowance of a `checkpoint` phase
    hang_eval_s: float = 1800.0            # ... of `eval`
    hang_phase_s: float = 1800.0           # ... of a user-declared phase
    hang_first_step_s: float = 1800.0      # budget of `init` and the first step after a start
    hang_phase_factor: float = 3.0         # allowance >= this x the longest seen in the job
    hang_stale_s: float = 10.0             # a rank with no heartbeat for this long is a suspect
    hang_early_margin: float = 6.0         # timeout >= (max_margin + factor x this / sqrt(n)) x longest step
    hang_peer_factor: float = 2.0          # ranks left behind: peers waited this x the longest step

    # -- silent: a rank or machine that stops sending while the rest go on -------------------
    silent_timeout_s: float = 15.0

    # -- crash: failed exits, and ranks that vanished while the launcher tore the job down ---
    crash_grace_s: float = 3.0             # wait after a SIGTERM/SIGINT exit for the rest
    crash_vanish_s: float = 10.0           # ranks heard this shortly before it, with no exit,
                                           # vanished (SIGKILL, OOM killer)

    # -- gpu_fault / gpu_degraded ---------------------------------------------------------------
    gpu_fault_missing_samples: int = 2     # samples a GPU must be absent to be "missing"
    gpu_fault_repeat_s: float = 300.0      # the same Xid on the same GPU within this is one
    gpu_degraded_window_s: float = 60.0
    gpu_degraded_throttle_fraction: float = 0.8
    gpu_degraded_min_samples: int = 10
    gpu_degraded_pcie_replays: int = 50    # PCIe replays per window
    gpu_degraded_nvlink_increments: int = 3  # samples in the window in which NVLink errors rose
    gpu_degraded_sbe_increase: int = 10    # single-bit ECC errors per window ...
    gpu_degraded_sbe_increments: int = 2   # ... rising in at least this many samples

    # -- machine_outlier: a machine's counters against its peers', scored per machine online --
    machine_outlier_every_s: float = 5.0   # a round (peers' medians, scores) this often
    machine_outlier_stale_s: float = 15.0  # a machine's sample older than this is not compared
    machine_outlier_min_machines: int = 3  # machines (of a role) needed to compare (0: off)
    machine_outlier_warmup: int = 30       # rounds each machine's usual deviations are learned over
    machine_outlier_threshold: float = 8.0  # flagged: a counter this many of its own std off
    machine_outlier_min_std: float = 0.5   # ... the std (in peer MADs) taken as at least this
    machine_outlier_k: int = 4             # an outlier: flagged in k ...
    machine_outlier_n: int = 6             # ... of the machine's last n rounds
    machine_outlier_top: int = 3           # counters named in a finding
    machine_outlier_forget_s: float = 3600.0  # a machine unheard this long is forgotten

    # -- stages -----------------------------------------------------------------------------------
    heartbeat_summary_s: float = 5.0       # RankStage forwards an unchanged heartbeat this often
    step_close_lag: int = 2                # a step is closed once a rank is this many steps on
    step_close_s: float = 5.0              # ... or this long after its first record
    advance_interval_s: float = 0.5        # Engine.advance does work at most this often
    emitted_ids_kept: int = 10000          # anomaly ids remembered for de-duplication

    # -- correlation ------------------------------------------------------------------------------
    correlate_window_s: float = 180.0      # anomalies this close in time may share a root
    correlate_root_slack_s: float = 2.0    # root-kind anomalies this close are co-suspects

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type == "int":
                if type(value) is not int or value < 0:
                    raise ValueError(f"{f.name} must be a non-negative integer, got {value!r}")
            elif f.type == "float":
                if type(value) not in (int, float) or not value >= 0:
                    raise ValueError(f"{f.name} must be a non-negative number, got {value!r}")
                setattr(self, f.name, float(value))
        if not 1 <= self.machine_outlier_k <= self.machine_outlier_n:
            raise ValueError(f"machine_outlier_k ({self.machine_outlier_k}) must be between 1 "
                             f"and machine_outlier_n ({self.machine_outlier_n})")
        if not 1 <= self.straggler_k <= self.straggler_n:
            raise ValueError(f"straggler_k ({self.straggler_k}) must be between 1 and "
                             f"straggler_n ({self.straggler_n})")
        for name in ("loss_spike_tail_quantile", "grad_spike_tail_quantile", "hang_quantile",
                     "gpu_degraded_throttle_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("loss_spike_min_ratio", "grad_spike_min_ratio", "straggler_ratio",
                     "loss_spike_early_min_ratio", "grad_spike_early_min_ratio",
                     "grad_spike_rise_ratio",
                     "throughput_ratio", "throughput_clip", "throughput_standout_ratio"):
            if getattr(self, name) <= 1:
                raise ValueError(f"{name} must be above 1, got {getattr(self, name)}")
        for name in ("loss_spike_window", "grad_spike_window", "loss_spike_tail_window",
                     "grad_spike_tail_window", "throughput_window", "throughput_baseline_window",
                     "hang_window", "hang_peer_factor", "straggler_min_ranks",
                     "gpu_fault_missing_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.straggler_min_ranks < 2:
            raise ValueError("straggler_min_ranks must be at least 2 (a rank needs peers)")

    def params_for(self, cls) -> dict:
        """Constructor arguments of detector class ``cls`` from the fields ``<PREFIX>_<arg>``."""
        return {name: getattr(self, f"{cls.PREFIX}_{name}") for name in _init_params(cls)}


@functools.lru_cache(maxsize=None)
def _init_params(cls) -> tuple:
    """The constructor's parameter names (``inspect.signature`` made a new job stage cost
    about a millisecond: a worker creates one per new job id)."""
    return tuple(n for n in inspect.signature(cls.__init__).parameters if n != "self")
