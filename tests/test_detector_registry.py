"""Issue 22 point 2: a detector is one file. Its registration (detectors/registry.py) is the
one list of detectors, kinds, default ladders and root-cause priorities; the configuration
section, the contract's kinds, the schemas, the snapshot allowlist and docs/CONFIG.md follow
from it. A toy detector written into a temporary module comes out of ``trainguard analyze``
with no file of the project touched: loaded with ``--detector-module``, or installed as a
plug-in of the entry-point group ``trainguard.detectors``."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard import events as ev
from trainguard.detectors import registry

REPO = Path(__file__).resolve().parents[1]

#: what was listed by hand before the registrations (issue 22)
DETECTORS_BEFORE = ("NanDetector", "LossSpikeDetector", "GradSpikeDetector",
                    "StragglerDetector", "ThroughputDetector", "HangDetector", "SilentDetector",
                    "CrashDetector", "GpuFaultDetector", "GpuDegradedDetector",
                    "DataPositionDetector", "MachineOutlierDetector")
PRIORITY_BEFORE = ("gpu_fault", "nan", "crash", "silent", "gpu_degraded", "straggler", "hang",
                   "loss_spike", "grad_spike", "throughput_drop", "machine_outlier")
LADDER_BEFORE = {
    "gpu_fault": ("evict", "restart", "alert"),
    "crash": ("evict_if_repeated", "restart", "alert"),
    "hang": ("capture", "evict_suspects", "restart", "alert"),
    "straggler": ("capture", "evict_if_persistent", "alert"),
    "nan": ("rollback_if_repeated", "alert"),
    "loss_spike": ("rollback_if_repeated", "alert"),
    "grad_spike": ("rollback_if_repeated", "alert"),
    "throughput_drop": ("alert",),
    "gpu_degraded": ("alert",),
    "silent": ("alert",),
    "data_position": ("alert",),
    "machine_outlier": ("alert",),
}

ANY, SHARED, SAME_RANK = "any", "shared", "same_rank"
CONSEQUENCES_BEFORE = {
    "gpu_fault": {"hang": ANY, "throughput_drop": ANY, "silent": SHARED, "crash": SHARED,
                  "nan": SHARED, "straggler": SHARED, "gpu_degraded": SHARED,
                  "gpu_fault": SHARED, "loss_spike": ANY, "grad_spike": ANY,
                  "machine_outlier": SHARED},
    "nan": {"nan": ANY, "loss_spike": ANY, "grad_spike": ANY, "crash": SAME_RANK,
            "hang": SAME_RANK},
    "crash": {"crash": ANY, "hang": ANY, "silent": ANY, "machine_outlier": SHARED},
    "silent": {"silent": ANY, "hang": ANY, "machine_outlier": SHARED},
    "gpu_degraded": {"gpu_degraded": SHARED, "straggler": SHARED, "throughput_drop": ANY,
                     "machine_outlier": SHARED},
    "straggler": {"straggler": SHARED, "hang": SHARED, "machine_outlier": SHARED},
    "hang": {"hang": ANY, "machine_outlier": SHARED},
    "loss_spike": {"loss_spike": ANY, "grad_spike": ANY},
    "grad_spike": {"grad_spike": ANY, "loss_spike": ANY},
    "throughput_drop": {"throughput_drop": ANY, "machine_outlier": ANY},
    "machine_outlier": {"machine_outlier": SHARED, "straggler": SHARED, "hang": SHARED,
                        "throughput_drop": ANY, "gpu_degraded": SHARED},
}


def test_the_lists_derived_from_the_registrations_are_those_written_before():
    from trainguard.actions.policy import DEFAULT_LADDER
    from trainguard.detectors import DETECTORS, JOB_DETECTORS, NODE_DETECTORS, PRIORITY
    from trainguard.detectors.correlate import CONSEQUENCES

    assert tuple(c.__name__ for c in DETECTORS) == DETECTORS_BEFORE
    assert tuple(c.__name__ for c in NODE_DETECTORS) == ("GpuFaultDetector",
                                                         "GpuDegradedDetector")
    assert JOB_DETECTORS == tuple(c for c in DETECTORS if c not in NODE_DETECTORS)
    assert PRIORITY == PRIORITY_BEFORE
    assert CONSEQUENCES == CONSEQUENCES_BEFORE
    assert registry.priority_ranks() == {k: i for i, k in enumerate(PRIORITY_BEFORE)}
    assert DEFAULT_LADDER == LADDER_BEFORE


def test_the_builtin_kinds_are_the_contracts():
    """A built-in detector's new kind is a change of the contract: add it to
    ``ANOMALY_KINDS`` (trainguard/events.py), document it in docs/CONTRACT.md and run
    ``python -m trainguard.schemas``."""
    kinds = registry.anomaly_kinds(builtin_only=True)
    assert len(set(kinds)) == len(kinds)
    assert set(kinds) == set(ev.ANOMALY_KINDS), \
        "the built-in detectors' kinds differ from trainguard.events.ANOMALY_KINDS"


def test_each_registration_declares_what_it_consumes_and_its_settings():
    from trainguard.detectors import DetectorsConfig
    from trainguard.detectors.base import INPUTS
    from trainguard.streams.snapshots import state_allowlist

    config = DetectorsConfig()
    allowed = state_allowlist()
    for r in registry.registrations(builtin_only=True):
        assert r.consumes and set(r.consumes) <= set(INPUTS), r
        assert r.cls.REGISTRATION is r
        assert r.cls in allowed and r.config in allowed
        if dataclasses.fields(r.config):
            assert type(getattr(config, r.prefix)) is r.config


def test_a_wrong_registration_is_refused_with_what_to_mend():
    from trainguard.detectors.base import Detector

    with pytest.raises(ValueError, match="give the ladder"):
        registry.register_detector(kinds=("a_kind", "b_kind"), ladder={"a_kind": ("alert",)})(
            type("Half", (Detector,), {"PREFIX": "half"}))
    with pytest.raises(ValueError, match="hang is already HangDetector's"):
        registry.register_detector(kinds="hang", ladder=("alert",))(
            type("Copy", (Detector,), {"PREFIX": "copy"}))
    with pytest.raises(ValueError, match="set PREFIX"):
        registry.register_detector(kinds="x_kind", ladder=("alert",))(
            type("Nameless", (Detector,), {}))


# -- a toy detector, in a module of its own ----------------------------------------------------

TOY = '''
"""A toy plug-in detector: a step slower than a fixed limit."""
from dataclasses import dataclass

from trainguard.detectors.registry import Detector, Finding, register_detector
from trainguard.setting import setting


@register_detector(kinds="toy_slow_step", ladder=("alert",),
                   causes={"toy_slow_step": "same_rank"})
class SlowStepDetector(Detector):
    """A rank's step that took longer than ``limit_s``."""

    PREFIX = "toy_slow_step"
    CONSUMES = ("step",)

    @dataclass(kw_only=True)
    class Config:
        limit_s: float = setting(5.0, "a step longer than this many seconds is reported",
                                 above=0)

    def update(self, item):
        if item["step_time"] <= self.limit_s:
            return []
        return [Finding(kind="toy_slow_step", severity="warning", ranks=[item["rank"]],
                        nodes=[item["node"]], step=item["step"],
                        onset_ts=item["ts"] - item["step_time"], detected_ts=item["ts"],
                        detector=self.PREFIX,
                        summary=f"rank {item['rank']} took {item['step_time']:g} s",
                        evidence={"step_time": item["step_time"]})]
'''


def recording(path: Path) -> Path:
    """Two ranks, 30 healthy one-second steps; rank 1's steps 20 and 21 take 9 s."""
    lines = []
    for step in range(30):
        for rank in range(2):
            slow = rank == 1 and step in (20, 21)
            lines.append({"v": 1, "type": "step", "job": "toy", "ts": 1000.0 + step,
                          "node": "n1", "rank": rank, "step": step,
                          "step_time": 9.0 if slow else 1.0})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def trainguard(args, cwd, pythonpath=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(TRAINGUARD_CONFIG="", TRAINGUARD_HOME=str(cwd / "home"))
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "trainguard.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_toy_detector_module_comes_out_of_analyze(tmp_path):
    module = tmp_path / "toy_detector.py"
    module.write_text(TOY)
    rec = recording(tmp_path / "run.jsonl")
    plain = trainguard(["analyze", str(rec), "--json"], tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout)["incidents"] == []
    run = trainguard(["analyze", str(rec), "--json", "--detector-module", str(module)],
                     tmp_path)
    assert run.returncode == 0, run.stderr
    incidents = json.loads(run.stdout)["incidents"]
    # one incident: the second slow step joins the first's (``causes``)
    assert [(i["kind"], i["ranks"], i["step"], len(i["anomalies"])) for i in incidents] == \
        [("toy_slow_step", [1], 20, 2)]
    assert incidents[0]["summary"].startswith("rank 1 took 9 s")


def test_a_missing_detector_module_is_one_clear_line(tmp_path):
    rec = recording(tmp_path / "run.jsonl")
    run = trainguard(["analyze", str(rec), "--detector-module", str(tmp_path / "none.py")],
                     tmp_path)
    assert run.returncode != 0
    assert run.stderr.strip().count("\n") == 0 and "--detector-module" in run.stderr


def test_an_installed_plugin_runs_and_has_its_configuration_section(tmp_path):
    """A distribution that declares ``[project.entry-points."trainguard.detectors"]``: here its
    installed metadata, written by hand in a folder on PYTHONPATH."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "toy_detector.py").write_text(TOY)
    info = site / "toy_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[trainguard.detectors]\ntoy = toy_detector\n")
    rec = recording(tmp_path / "run.jsonl")
    run = trainguard(["analyze", str(rec), "--json"], tmp_path, pythonpath=site)
    assert run.returncode == 0, run.stderr
    assert [i["kind"] for i in json.loads(run.stdout)["incidents"]] == ["toy_slow_step"]
    shown = trainguard(["config", "show"], tmp_path, pythonpath=site)
    assert shown.returncode == 0, shown.stderr
    assert "detectors.toy_slow_step.limit_s = 5.0" in shown.stdout
    config = tmp_path / "trainguard.toml"
    config.write_text("[detectors.toy_slow_step]\nlimit_s = 10.0\n")
    quiet = trainguard(["analyze", str(rec), "--json", "--config", str(config)], tmp_path,
                       pythonpath=site)
    assert quiet.returncode == 0, quiet.stderr
    assert json.loads(quiet.stdout)["incidents"] == []


def test_a_plugin_kind_is_accepted_by_the_process_that_loaded_it(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        from trainguard import events as ev
        sys.path.insert(0, {str(tmp_path)!r})
        raw = ev.encode(ev.Anomaly(job="j", ts=1.0, id="a", kind="toy_slow_step",
                                   severity="warning", ranks=[1], nodes=[], onset_ts=1.0,
                                   detected_ts=1.0, detector="toy_slow_step", summary="s"))
        try:
            ev.decode(raw)
            print("accepted before")
        except ev.InvalidEvent:
            print("refused before")
        from trainguard.detectors.registry import load_detector_modules
        load_detector_modules(["toy_detector"])
        print(ev.decode(raw).kind, "toy_slow_step" in str(ev.json_schema("anomaly")))
    """)
    (tmp_path / "toy_detector.py").write_text(TOY)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["refused before", "toy_slow_step True"]
    # the shipped schemas hold the contract's kinds only (tests/test_events.py)
    shipped = json.loads((REPO / "trainguard" / "schemas" / "anomaly.json").read_text())
    assert shipped["properties"]["kind"]["enum"] == list(ev.ANOMALY_KINDS)
