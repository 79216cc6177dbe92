#!/bin/bash
# Slurm Epilog: stop the trainguard node agent when the last job on this node has ended.
#
# The pair of prolog.sh: removes this job from $TRAINGUARD_SLURM_DIR/jobs and, when no job
# is left there, stops trainguard-agent.service, unless the unit is enabled (then the site
# runs the agent always, and a GPU that fails between jobs is still reported). Runs as root
# with SLURM_JOB_ID set; always exits 0 (a failing epilog drains the node).
set -u

dir=${TRAINGUARD_SLURM_DIR:-/run/trainguard/slurm}
unit=${TRAINGUARD_AGENT_UNIT:-trainguard-agent.service}
job=${SLURM_JOB_ID:-}

log() { logger -t trainguard-epilog -- "$*" 2>/dev/null || printf 'trainguard-epilog: %s\n' "$*" >&2; }

case $job in
  '' | *[!0-9_]*) log "no usable SLURM_JOB_ID ('$job'); the agent is left as it is"; exit 0 ;;
esac
[ -d "$dir/jobs" ] || exit 0

(
  if ! flock -w 30 9; then
    log "job $job: lock $dir/lock busy for 30 s; the agent is left running"
    exit 0
  fi
  rm -f -- "$dir/jobs/$job"
  if [ -n "$(ls -A -- "$dir/jobs" 2>/dev/null)" ]; then
    exit 0  # another job on this node still has it
  fi
  if systemctl is-enabled --quiet "$unit" 2>/dev/null; then
    exit 0  # enabled: the site runs it always
  fi
  if ! timeout 60 systemctl stop "$unit"; then
    log "job $job: systemctl stop $unit failed"
  fi
) 9>"$dir/lock"
exit 0
