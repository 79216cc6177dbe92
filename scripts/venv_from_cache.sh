#!/usr/bin/env bash
# Make .venv for `make test` from a venv of the same dependencies kept in $TRAINGUARD_HOME/venvs.
#
# The packages of the test install weigh 6 GB (torch and its CUDA libraries) and take about
# 80 s to install from pip's cache, in every fresh clone. Here they are installed once per
# pyproject.toml and Python version into $TRAINGUARD_HOME/venvs/<key>; a clone's .venv is a
# copy made of hard links (a few seconds, no space), with the scripts' first lines pointed at
# it; scripts/test.sh then installs trainguard itself (editable, from the clone). Nothing
# writes into the shared files: pip replaces a file rather than changing it.
#
# Usage: scripts/venv_from_cache.sh PYTHON EXTRAS. Where hard links cannot be made (another
# file system), or the cache cannot be built, .venv is made the plain way.
set -euo pipefail
PY=$1 EXTRAS=$2
key=$( { cat pyproject.toml; "$PY" -VV; readlink -f "$(command -v "$PY")"; uname -m
         echo "$EXTRAS"; } | sha256sum | cut -c1-16)
cache=$TRAINGUARD_HOME/venvs/$key

build() {  # in a subshell of a condition, where set -e does not hold: each step is checked
  echo "building the test packages' venv once for this pyproject.toml: $cache"
  mkdir -p "$TRAINGUARD_HOME/venvs" || return 1
  # builds killed half-way leave their folders: gone after two hours
  find "$TRAINGUARD_HOME/venvs" -maxdepth 1 -name '*.building.*' -mmin +120 \
    -exec rm -rf {} + 2>/dev/null
  local building=$cache.building.$$
  if ! { "$PY" -m venv --prompt .venv "$building" &&
         "$building/bin/python" -m pip install -q --upgrade pip &&
         # trainguard pulls in its dependencies; then it goes: each clone installs its own
         "$building/bin/python" -m pip install -q -e ".[$EXTRAS]" &&
         "$building/bin/python" -m pip uninstall -q -y trainguard; }; then
    rm -rf "$building"
    return 1
  fi
  [ -x "$cache/bin/python" ] || rm -rf "$cache"          # a broken one goes, a good one stays
  mv -T "$building" "$cache" 2>/dev/null || rm -rf "$building"  # another build won the race
}

if [ ! -x "$cache/bin/python" ] && ! (build); then
  echo "warning: the shared venv could not be built; installing into .venv directly" >&2
  "$PY" -m venv .venv
  exit 0  # scripts/test.sh installs everything
fi

here=$(pwd)/.venv
if ! cp -al "$cache" "$here" 2>/dev/null; then
  rm -rf "$here"
  "$PY" -m venv "$here"
  exit 0  # scripts/test.sh installs everything
fi
# the scripts name the interpreter by its path; sed -i writes a new file (the link is broken)
# (the cache's own path, or the one it was built under)
built="$cache\(\.building\.[0-9]*\)\{0,1\}"
grep -lIs "^#!$built/bin/" "$here"/bin/* | while read -r script; do
  sed -i "1s|^#!$built/bin/|#!$here/bin/|" "$script"
done
for f in "$here"/bin/activate*; do
  if [ -f "$f" ]; then sed -i "s|$built|$here|g" "$f"; fi
done
echo "made .venv from $cache (hard links)"
