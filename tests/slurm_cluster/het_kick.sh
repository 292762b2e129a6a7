#!/usr/bin/env bash
# Nudges pending heterogeneous jobs that SLURM would otherwise leave pending.
# Why: het jobs are started only by the backfill scheduler, and backfill skips every pass in
# which no job, node or partition changed. A requeued het job whose BeginTime has passed
# therefore sits "PENDING (None)" until something unrelated happens (measured: >20 s, once
# 94 s). `scontrol update jobid=<leader> StartTime=now` is such a change and starts it ~1 s
# later. Only leaders (HetJobOffset 0) with reason None are touched: a job waiting for
# Resources/BeginTime/Dependency is waiting for a real reason.
# Exits by itself when the slurmctld that boot.sh started is gone.
set -uo pipefail
RUN="${RLSLURM_CI_RUN:-/run/rlslurm-ci}"   # boot.sh exports it, and SLURM_CONF
INTERVAL="${RLSLURM_CI_HET_KICK_INTERVAL:-2}"
export PATH="$PATH:/usr/sbin:/sbin"

ctld_alive() {
  local pid
  pid="$(tr -dc '0-9' <"$RUN/slurmctld.pid" 2>/dev/null)"
  [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = slurmctld ]
}

# slurmctld may not have written its pid file yet when we start.
for _ in $(seq 50); do ctld_alive && break; sleep 0.2; done

while ctld_alive; do
  # %i is "<leader>+<offset>" for het components; %r the pending reason.
  timeout 10 squeue -h -t PD -o '%i %r' 2>/dev/null | while read -r id reason; do
    [[ "$id" == *+0 && "$reason" == None ]] || continue
    leader="${id%+0}"
    if timeout 10 scontrol update jobid="$leader" StartTime=now 2>&1; then
      printf '%s kicked het job %s\n' "$(date +%H:%M:%S)" "$leader"
    fi
  done
  sleep "$INTERVAL"
done
printf '%s slurmctld gone; het_kick exits\n' "$(date +%H:%M:%S)"
