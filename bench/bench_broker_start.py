"""Seconds to a broker that answers: cold (first fetch into an empty cache, and an empty
Maven repository so the jars come from Maven Central), warm (cached jars, new data folder)
and restart (cached jars, existing data). The JVM's own start (`java -version`) in the same
run is the baseline the ratios refer to."""
import os
import subprocess
import tempfile
import time
from pathlib import Path

from trainguard.broker import free_port, local_broker


def _timed_start(home: Path, data: Path, environ: dict) -> float:
    saved = dict(os.environ)
    os.environ.update(environ)
    try:
        broker = local_broker(port=free_port(), data=data, environ={"TRAINGUARD_HOME": str(home)})
        began = time.perf_counter()
        broker.start(log=lambda m: None)
        elapsed = time.perf_counter() - began
        broker.stop()
        return elapsed
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        began = time.perf_counter()
        subprocess.run(["java", "-version"], capture_output=True, check=True)
        jvm = time.perf_counter() - began
        cold_env = {"MAVEN_OPTS": f"-Dmaven.repo.local={tmp / 'm2'}"}
        cold = _timed_start(tmp / "home", tmp / "data-cold", cold_env)
        warm = _timed_start(tmp / "home", tmp / "data-warm", {})
        restart = _timed_start(tmp / "home", tmp / "data-warm", {})
    return {"cold_start_s": round(cold, 2), "warm_start_s": round(warm, 2),
            "restart_s": round(restart, 2), "jvm_start_s": round(jvm, 3),
            "warm_over_cold": round(warm / cold, 3), "warm_over_jvm": round(warm / jvm, 1)}
