#!/usr/bin/env bash
# The validators of tests/test_deploy_files.py, cached under $TRAINGUARD_HOME/bin (run by
# scripts/test.sh; safe to run again, it installs only what is missing or of another
# version):
#   kubeconform   built from the Go module proxy with the Go toolchain of this machine
#   kubernetes-validate's wheel, from PyPI: the Kubernetes JSON schemas kubeconform checks
#                 against (never installed into .venv; the test reads the wheel)
# The Debian packages shellcheck and systemd (systemd-analyze): scripts/test.sh installs them.
# It never fails the test run: what it cannot install, the tests that need it skip, saying so.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 0
KUBECONFORM_VERSION=v0.8.0
SCHEMAS_VERSION=1.37.0
home=${TRAINGUARD_HOME:-$HOME/.cache/trainguard}
bin=$home/bin
mkdir -p "$bin"
bin=$(cd "$bin" && pwd)

if [ ! -x "$bin/kubeconform" ] || [ "$(cat "$bin/kubeconform.version" 2>/dev/null)" != "$KUBECONFORM_VERSION" ]; then
  go=$(command -v go || true)
  if [ -z "$go" ] && [ -x /usr/local/go/bin/go ]; then go=/usr/local/go/bin/go; fi
  if [ -z "$go" ]; then
    echo "warning: no Go toolchain (go on PATH or /usr/local/go/bin/go); kubeconform is not installed and the manifest validation will skip" >&2
  else
    echo "installing kubeconform $KUBECONFORM_VERSION into $bin (go install, Go module proxy)"
    # GOTOOLCHAIN=auto: a Go older than kubeconform's go line fetches the newer toolchain
    if GOBIN="$bin" GOTOOLCHAIN=auto "$go" install "github.com/yannh/kubeconform/cmd/kubeconform@$KUBECONFORM_VERSION"; then
      echo "$KUBECONFORM_VERSION" >"$bin/kubeconform.version"
    else
      echo "warning: go install of kubeconform $KUBECONFORM_VERSION failed; the manifest validation will skip" >&2
    fi
  fi
fi

wheel="$bin/kubernetes_validate-$SCHEMAS_VERSION-py3-none-any.whl"
if [ ! -s "$wheel" ]; then
  echo "fetching kubernetes-validate $SCHEMAS_VERSION (Kubernetes JSON schemas) into $bin"
  "${PYTHON_BIN:-.venv/bin/python}" -m pip download -q --no-deps --only-binary=:all: \
      -d "$bin" "kubernetes-validate==$SCHEMAS_VERSION" \
    || echo "warning: could not fetch kubernetes-validate $SCHEMAS_VERSION; the manifest validation will skip" >&2
fi
exit 0
