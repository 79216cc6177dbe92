"""Regression over the recorded incidents in tests/data/incidents/ (real runs of the example
job under `trainguard demo`): the detectors find one incident per injected fault, with the
right suspects, and the injected faults' detection stays within its bounds."""
import json
from pathlib import Path

from trainguard.detectors.offline import analyze_file
from trainguard.recording import read_events

DATA = Path(__file__).parent / "data" / "incidents"
DEMO = DATA / "demo-chaos-4ranks.jsonl.gz"


def injected():
    return [json.loads(line) for line in (DATA / "demo-chaos-4ranks.chaos.jsonl").open()]


def test_one_incident_per_injected_fault():
    result = analyze_file(DEMO)
    assert result["invalid"] == 0 and result["events"] > 1000
    found = [(i["kind"], i["ranks"], i["step"]) for i in result["incidents"]
             if i["severity"] == "critical"]
    # the hang at step 120 began after the job had made progress since the straggler was
    # found (a separate injection, 2-straggler then 3-hang): an incident of its own
    assert found == [("nan", [1], 25), ("hang", [2], 119), ("crash", [3], 159),
                     ("gpu_fault", [], 199)]
    [stop] = [i for i in result["incidents"] if i["severity"] == "warning" and i["kind"] == "crash"]
    assert stop["kind"] == "crash" and stop["ranks"] == []   # our own restart after the hang


def test_detection_latency_of_the_recorded_faults():
    faults = {f["id"]: f for f in injected()}
    incidents = analyze_file(DEMO)["incidents"]
    by_kind = {i["kind"]: i for i in incidents if i["severity"] == "critical"}
    assert by_kind["nan"]["detected_ts"] - faults["1-nan"]["injected_ts"] < 2.0
    assert by_kind["gpu_fault"]["detected_ts"] - faults["5-xid"]["injected_ts"] < 2.0
    # SIGKILL leaves no exit event: the crash is named once its peers' tear-down is over
    assert by_kind["crash"]["detected_ts"] - faults["4-crash"]["injected_ts"] < 15.0


def test_the_online_service_saw_the_same_faults():
    kinds = {e.kind for e in read_events(DEMO) if e.type == "anomaly"}
    assert {"nan", "straggler", "hang", "crash", "gpu_fault"} <= kinds
