"""Node names under a scheduler (SPEC §6): one function, used by the collector, the node
agent, ``trainguard run`` and chaos."""
from __future__ import annotations

import socket
import subprocess
import sys

from trainguard.launcher.supervisor import Supervisor
from trainguard.collectors.nodename import node_name


def test_scheduler_names_win_over_the_host_name():
    assert node_name({"SLURMD_NODENAME": "tg2"}) == "tg2"
    assert node_name({"NODE_NAME": "gke-pool-1-abc"}) == "gke-pool-1-abc"
    assert node_name({"SLURMD_NODENAME": "tg2", "NODE_NAME": "k"}) == "tg2"
    assert node_name({}) == socket.gethostname()
    assert node_name({"NODE_NAME": ""}) == socket.gethostname()


def test_the_collector_and_trainguard_run_report_the_slurm_name(tmp_path):
    code = ("import trainguard, json; tg = trainguard.init(job='n1', handle_signals=False, "
            "stack_signal=None, runtime_dir=%r); print(tg.settings.node); tg.close()"
            % str(tmp_path))
    env = {"PATH": "/usr/bin:/bin", "SLURMD_NODENAME": "tg3", "TRAINGUARD_BOOTSTRAP":
           "127.0.0.1:1", "RANK": "0", "WORLD_SIZE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "tg3", out.stderr[-500:]
    sup = Supervisor(job="j", cmd=["true"], environ={"NODE_NAME": "k8s-node-4"})
    assert sup.node == "k8s-node-4"

