#!/bin/bash
# Slurm Prolog: start the trainguard node agent on every node of an allocation.
#
# slurm.conf (docs/DEPLOY.md, Slurm):
#   Prolog=/etc/slurm/trainguard-prolog.sh
#   Epilog=/etc/slurm/trainguard-epilog.sh
#   PrologFlags=Alloc        # run it on every node at allocation, before the first step
#
# Runs as root (SlurmdUser) with SLURM_JOB_ID and SLURMD_NODENAME set. It records the job in
# $TRAINGUARD_SLURM_DIR/jobs, gives the agent this node's Slurm name (the Slurm driver drains
# nodes by it) and starts trainguard-agent.service, which is a no-op while it runs. The
# epilog stops the agent when the node's last job has ended, unless the unit is enabled
# (an agent that runs always).
#
# It never fails the job: a prolog that exits non-zero drains the node and requeues the job,
# so every problem is logged (syslog, tag trainguard-prolog) and it exits 0.
set -u

dir=${TRAINGUARD_SLURM_DIR:-/run/trainguard/slurm}
registry=${TRAINGUARD_REGISTRY_DIR:-/run/trainguard/run}
unit=${TRAINGUARD_AGENT_UNIT:-trainguard-agent.service}
job=${SLURM_JOB_ID:-}
node=${SLURMD_NODENAME:-$(hostname -s)}

log() { logger -t trainguard-prolog -- "$*" 2>/dev/null || printf 'trainguard-prolog: %s\n' "$*" >&2; }

case $job in
  '' | *[!0-9_]*) log "no usable SLURM_JOB_ID ('$job'); the agent is left as it is"; exit 0 ;;
esac
case $node in
  '' | *[!A-Za-z0-9._-]*) log "unusable node name '$node'; the agent is left as it is"; exit 0 ;;
esac

if ! mkdir -p "$dir/jobs" || ! install -d -m 1777 "$registry"; then
  log "cannot create $dir or $registry"
  exit 0
fi

(
  if ! flock -w 30 9; then
    log "job $job: lock $dir/lock busy for 30 s; the agent is not started"
    exit 0
  fi
  : >"$dir/jobs/$job"
  printf 'NODE_NAME=%s\n' "$node" >"$dir/agent.env.tmp" && mv -f "$dir/agent.env.tmp" "$dir/agent.env"
  if ! timeout 60 systemctl start "$unit"; then
    log "job $job: systemctl start $unit failed"
  fi
) 9>"$dir/lock"
exit 0
