"""What the demo watches while it runs: a tap on every topic of one job (kept in memory and
written to a recording) and a live terminal view of it (rich)."""
from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

from trainguard import events as ev
from trainguard.config import Config
from trainguard.recording import RecordingWriter


class EventTap:
    """Consumes the job's topics from the beginning in a thread; records every valid event."""

    def __init__(self, config: Config, path: Path, job: str):
        self.config = config
        self.path = Path(path)
        self.job = job
        self.count = 0
        self.invalid = 0
        self._events: list = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainguard-demo-tap", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, drain_s: float = 3.0) -> None:
        time.sleep(drain_s)
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        from confluent_kafka import Consumer

        topics = self.config.topics
        consumer = Consumer(self.config.kafka(**{
            "group.id": f"trainguard-demo-tap-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest", "enable.auto.commit": False}))
        consumer.subscribe([topics.telemetry, topics.stacks, topics.anomalies, topics.actions,
                            topics.commands])
        with RecordingWriter(self.path) as out:
            while not self._stop.is_set():
                for message in consumer.consume(500, 0.2):
                    if message.error():
                        continue
                    try:
                        event = ev.decode(message.value())
                    except ev.InvalidEvent:
                        self.invalid += 1
                        continue
                    if event.job != self.job:
                        continue
                    out.write_raw(message.value())
                    with self._lock:
                        self._events.append(event)
                        self.count += 1
        consumer.close()

    def events(self) -> list:
        with self._lock:
            return list(self._events)

    def of_type(self, kind: str) -> list:
        return [e for e in self.events() if e.type == kind]

    def anomalies(self) -> list[dict]:
        return [ev.to_dict(e) for e in self.of_type("anomaly")]

    def actions(self) -> list[dict]:
        return [ev.to_dict(e) for e in self.of_type("action")]

    def incidents(self) -> list[dict]:
        """The worker's incident events (the latest of each id); from a worker that
        publishes none, the anomalies correlated here."""
        published: dict = {}
        for incident in self.of_type("incident"):
            d = {k: v for k, v in ev.to_dict(incident).items()
                 if k not in ("v", "type", "ts", "node", "rank")}
            d.setdefault("step", None)
            published[incident.id] = d
        if published:
            return sorted(published.values(), key=lambda i: (i["onset_ts"], i["id"]))
        from trainguard.detectors.correlate import Correlator

        correlator = Correlator()
        for anomaly in self.of_type("anomaly"):
            correlator.add(anomaly)
        return correlator.incidents()

    def captures(self) -> list[dict]:
        """The stack analysis of every capture the action service made."""
        from trainguard.diagnosis.stacks import analyze_threads

        by_capture: dict[str, dict[int, list]] = {}
        for stack in self.of_type("stack"):
            if stack.rank is not None:
                by_capture.setdefault(stack.capture_id, {})[stack.rank] = stack.threads
        results = []
        for capture_id, per_rank in by_capture.items():
            result = analyze_threads(per_rank)
            result["capture_id"] = capture_id
            results.append(result)
        return results

    def latest_steps(self) -> dict[int, ev.Step]:
        latest = {}
        for event in self.of_type("step"):
            latest[event.rank] = event
        return latest


class LiveView:
    """A rich live table of ranks, anomalies and actions; silent when disabled (--json, no tty)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.notes: list[str] = []
        self._live = None
        self._baseline_steps = None
        self._tap = None

    def __enter__(self):
        if self.enabled:
            from rich.live import Live

            self._live = Live(self._render(None), refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc):
        if self._live is not None:
            self._live.__exit__(*exc)
            self._live = None

    def note(self, text: str) -> None:
        self.notes.append(f"{time.strftime('%H:%M:%S')} {text}")
        if self._live is not None:
            self._live.update(self._render(self._tap))
        if not self.enabled:
            import sys

            print(f"[demo] {text}", file=sys.stderr, flush=True)

    def status(self, text: str) -> None:
        """A note for the live view alone (set-up progress): nothing without a terminal."""
        if self._live is not None:
            self.note(text)

    def update(self, tap: EventTap, steps) -> None:
        self._tap = tap
        if self._live is not None:
            self._live.update(self._render(tap))

    def baseline(self, steps) -> None:
        self._baseline_steps = steps
        self._tap = None
        if self._live is not None:
            self._live.update(self._render(None))

    def _render(self, tap: EventTap | None):
        from rich.console import Group
        from rich.table import Table

        ranks = Table(title="ranks (trainguard run)", expand=True)
        for column in ("rank", "step", "step time", "compute time", "loss"):
            ranks.add_column(column)
        anomalies = Table(title="anomalies", expand=True)
        for column in ("time", "kind", "ranks", "summary"):
            anomalies.add_column(column)
        actions = Table(title="actions", expand=True)
        for column in ("time", "action", "status", "reason"):
            actions.add_column(column)
        if tap is not None:
            for rank, step in sorted(tap.latest_steps().items()):
                ranks.add_row(str(rank), str(step.step), f"{step.step_time:.3f}s",
                              f"{step.compute_time:.3f}s" if step.compute_time else "-",
                              f"{step.loss:.4f}" if step.loss is not None else "-")
            for a in tap.anomalies()[-6:]:
                anomalies.add_row(time.strftime("%H:%M:%S", time.localtime(a["ts"])), a["kind"],
                                  str(a["ranks"]), a["summary"][:90])
            for a in tap.actions()[-6:]:
                actions.add_row(time.strftime("%H:%M:%S", time.localtime(a["ts"])), a["action"],
                                a["status"], a["reason"][:80])
        parts = [ranks, anomalies, actions]
        if self._baseline_steps is not None:
            last = self._baseline_steps[-1][0] if self._baseline_steps else "-"
            parts.append(f"baseline (plain torchrun): last step {last}")
        parts.extend(self.notes[-4:])
        return Group(*parts)

    def print_summary(self, result: dict) -> None:
        from rich.console import Console
        from rich.table import Table

        console = Console()
        table = Table(title="faults")
        for column in ("kind", "ranks", "injected", "detected after", "actions", "resumed after"):
            table.add_column(column)
        for f in result["faults"]:
            detected = (f"{f['detected_ts'] - f['injected_ts']:.1f}s"
                        if f["detected_ts"] else "not detected")
            recovered = (f"{f['recovered_ts'] - f['injected_ts']:.1f}s"
                         if f["recovered_ts"] else "-")
            table.add_row(f["kind"], str(f["ranks"]),
                          time.strftime("%H:%M:%S", time.localtime(f["injected_ts"])),
                          detected, ", ".join(f["actions"]) or "-", recovered)
        console.print(table)
        console.print(f"ETTR with trainguard: {result['ettr']:.3f}")
        if result.get("baseline"):
            console.print(f"ETTR under plain torchrun --max-restarts=3: "
                          f"{result['baseline']['ettr']:.3f}")
        if result.get("projection"):
            p = result["projection"]
            console.print(f"projected ({p['formula']}):")
            for row in p["rows"]:
                console.print(f"  {row['gpus']:>7} GPUs, {row['recovery']:<9}: ETTR "
                              f"{row['ettr']:.4f} ({row['failures_per_day']:.1f} faults/day, "
                              f"restart {row['restart_s']:.0f}s, redone {row['redone_s']:.0f}s)")
        console.print(f"report: {result['report']}")
