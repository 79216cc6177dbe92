"""Issue 22 point 1: one nested configuration tree, each component's own ``Config``.

``tests/data/config_show_issue22_before.txt`` is ``trainguard config show`` as it was before
the tree was rebuilt; the same keys, with the same defaults, must come out now (under their
new names where a name meant two things)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from trainguard import configsections as cs
from trainguard.cli import main
from trainguard.configlegacy import RENAMED

BEFORE = Path(__file__).parent / "data" / "config_show_issue22_before.txt"

#: the keys that could change while a job ran before the tree was rebuilt (LIVE_KEYS)
LIVE_BEFORE = {
    "detectors.hang.floor_s", "detectors.hang.factor", "detectors.hang.max_margin",
    "detectors.hang.min_intervals", "detectors.hang.checkpoint_s", "detectors.hang.eval_s",
    "detectors.hang.phase_s", "detectors.hang.first_step_s", "detectors.hang.phase_factor",
    "detectors.hang.stale_s", "detectors.hang.early_margin", "detectors.hang.peer_factor",
    "detectors.silent.timeout_s", "detectors.crash.grace_s", "detectors.crash.vanish_s",
    "detectors.straggler.ratio", "detectors.straggler.min_excess_s", "detectors.straggler.k",
    "detectors.straggler.settle", "detectors.throughput.ratio",
    "detectors.throughput.standout_ratio", "detectors.loss_spike.tail_factor",
    "detectors.loss_spike.min_ratio", "detectors.loss_spike.early_min_ratio",
    "detectors.grad_spike.tail_factor", "detectors.grad_spike.min_ratio",
    "detectors.grad_spike.early_min_ratio", "detectors.nan.scaler_patience"}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for var in list(os.environ):
        if var.startswith("TRAINGUARD_") and var != "TRAINGUARD_HOME":
            monkeypatch.delenv(var)
    monkeypatch.setenv("TRAINGUARD_CONFIG", "")


def shown(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        body, _, source = line.rpartition("  # ")
        path, _, value = body.partition(" = ")
        out[path.strip()] = (json.loads(value.strip()), source.strip())
    return out


#: keys added since, and defaults changed on purpose since (issue 21 point 2: steps by
#: number within a window, where a step used to close once a rank was 2 steps on; a
#: partition that no worker says it reads holds a job's judged time back, for as long as a
#: killed worker's partitions take to move and be restored)
ADDED_SINCE = {"worker.source_idle_s": (10.0, "default"),
               "worker.unread_partition_s": (180.0, "default"),
               # Xids that leave a GPU in service alert once an hour per GPU and code
               "detectors.gpu_degraded.xid_repeat_s": (3600.0, "default")}
CHANGED_SINCE = {"detectors.stages.step_window": (32, "default")}


def test_show_lists_the_same_keys_with_the_same_defaults(capsys):
    before = shown(BEFORE.read_text())
    assert main(["config", "show"]) == 0
    now = shown(capsys.readouterr().out)
    expected = {RENAMED.get(path, path): value for path, value in before.items()}
    expected.update(CHANGED_SINCE)
    for path, value in ADDED_SINCE.items():
        assert now.pop(path) == value
    assert list(now) == list(expected)
    assert now == expected


def test_live_keys_come_from_the_detectors_configs():
    from trainguard.overrides import live_keys

    assert set(live_keys()) == LIVE_BEFORE


def test_each_detector_owns_its_section():
    from trainguard.detectors import DETECTORS, DetectorsConfig

    config = DetectorsConfig()
    for cls in DETECTORS:
        if dataclasses.fields(cls.Config):
            assert type(getattr(config, cls.PREFIX)) is cls.Config, cls
            with pytest.raises(TypeError):           # kw_only
                cls.Config(1)
            assert all(f.metadata["help"] for f in dataclasses.fields(cls.Config))


def write(tmp_path, text):
    path = tmp_path / "old.toml"
    path.write_text(text)
    return str(path)


def test_an_old_flat_file_loads_with_one_deprecation_line(tmp_path, capsys):
    old = write(tmp_path, "[detectors]\nhang_floor_s = 45.0\nstraggler_k = 3\n"
                          "advance_interval_s = 1.0\n[worker]\nadvance_interval_s = 2.0\n")
    tree = cs.load(old)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "deprecated" in err[0], err
    assert "detectors.hang_floor_s -> detectors.hang.floor_s" in err[0]
    assert "worker.advance_interval_s -> worker.advance_timer_s" in err[0]
    config = cs.detector_config(tree)
    assert (config.hang.floor_s, config.straggler.k, config.stages.advance_grid_s) == \
        (45.0, 3, 1.0)
    assert cs.worker_settings(tree).advance_timer_s == 2.0
    new = tmp_path / "new.toml"
    new.write_text("[detectors.hang]\nfloor_s = 45.0\n")
    cs.load(str(new))
    assert capsys.readouterr().err == ""


def test_a_json_policy_file_loads_with_one_deprecation_line(tmp_path, capsys):
    policy = tmp_path / "policy.json"
    policy.write_text(json.dumps({"limits": {"max_restarts": 7}}))
    config, _, _ = cs.service_config(cs.load(), str(policy))
    err = capsys.readouterr().err.strip().splitlines()
    assert config.limits.max_restarts == 7
    assert len(err) == 1 and "deprecated" in err[0] and "[policy]" in err[0], err
