#!/usr/bin/env bash
# The test command (`make test`): set-up from a fresh machine, a broker for the tests, pytest.
# Installs what is missing (virtual environment, Python packages, Debian packages for the
# Alertmanager, Slurm and browser tests), fetches the Kafka jars once, starts a broker on a free
# port, runs pytest against it and stops it again, whatever pytest's outcome.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

export TRAINGUARD_HOME=${TRAINGUARD_HOME:-$HOME/.cache/trainguard}
EXTRAS="server,dev,torch,k8s,hf,lightning"
if [ ! -x .venv/bin/python ]; then
  bash scripts/venv_from_cache.sh "$PY" "$EXTRAS"
fi
if ! .venv/bin/python -c 'import trainguard, torch, pytest, hypothesis' 2>/dev/null \
   || [ pyproject.toml -nt .venv/.installed ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$EXTRAS]"
  touch .venv/.installed
fi

need_apt=()
command -v prometheus-alertmanager >/dev/null 2>&1 || need_apt+=(prometheus-alertmanager)
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
for tool in slurmctld slurmd sbatch; do  # the real Slurm cluster of tests/slurm_harness.py
  command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || {
    need_apt+=(slurmctld slurmd slurm-client); break; }
done
# tests/test_deploy_files.py checks the Slurm scripts and systemd units with these two
command -v shellcheck >/dev/null 2>&1 || need_apt+=(shellcheck)
command -v systemd-analyze >/dev/null 2>&1 || need_apt+=(systemd)
if [ ${#need_apt[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing ${need_apt[*]} (Debian packages used by the alerting, Slurm and report tests)"
  apt-get update -qq >/dev/null 2>&1 || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" \
    >/dev/null 2>&1 || echo "warning: could not install ${need_apt[*]}; those tests will skip"
fi

export TRAINGUARD_E2E=${TRAINGUARD_E2E:-1}  # the end-to-end job scenarios of the action service
# kubeconform (Go module proxy) and the Kubernetes schemas (PyPI), cached in $TRAINGUARD_HOME/bin
bash scripts/deploy_tools.sh
port=$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
data=$(mktemp -d /tmp/trainguard-test-broker.XXXXXX)
cleanup() {
  .venv/bin/trainguard broker stop --port "$port" --data "$data" >/dev/null 2>&1 || true
  rm -rf "$data"
}
trap cleanup EXIT
.venv/bin/trainguard broker start --port "$port" --data "$data"
export TRAINGUARD_BOOTSTRAP=127.0.0.1:$port

# Lanes: the tests run side by side in TRAINGUARD_TEST_LANES lanes (pytest-xdist; 1: one after
# the other). Three by default on two cores: the tests that mostly wait on real time share one
# lane, the others compute in two. The grouping and the order are in tests/conftest.py and
# docs/TESTING.md.
lanes=${TRAINGUARD_TEST_LANES:-3}
lane_args=()
if [ "$lanes" -gt 1 ]; then
  lane_args=(-n "$lanes" --dist loadgroup)
fi
# The project's bytecode, written once: the tests start hundreds of Python processes (workers,
# agents, ranks, the CLI) that import it, and with PYTHONDONTWRITEBYTECODE set (as in some CI
# images) each would compile it anew (0.15-0.2 s of CPU a process)
.venv/bin/python -m compileall -q collectors detectors streams actions deploy launcher \
  diagnosis apps trainguard >/dev/null || true
set +e
.venv/bin/python -m pytest "${lane_args[@]}" "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "pytest collected no tests" >&2
fi
exit $rc
