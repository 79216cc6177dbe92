#!/usr/bin/env bash
# The main job (`make demo`): set-up from a fresh machine, then `trainguard demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c 'import trainguard, torch' 2>/dev/null || [ pyproject.toml -nt .venv/.installed ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[server,dev,torch]"
  touch .venv/.installed
fi
exec .venv/bin/trainguard demo "$@"
