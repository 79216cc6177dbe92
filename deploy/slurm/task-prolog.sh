#!/bin/bash
# Slurm TaskProlog (slurm.conf: TaskProlog=/etc/slurm/trainguard-task-prolog.sh): every task
# of every job gets TRAINGUARD_HOME=/run/trainguard, so that its ranks register where the
# node agent looks (/run/trainguard/run; docs/DEPLOY.md). A job that sets TRAINGUARD_HOME
# itself keeps its own. Lines "export NAME=value" on stdout set the task's environment.
if [ -z "${TRAINGUARD_HOME:-}" ]; then
  echo "export TRAINGUARD_HOME=/run/trainguard"
fi
exit 0
