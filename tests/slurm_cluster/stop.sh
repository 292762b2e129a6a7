#!/usr/bin/env bash
# Stops the test cluster that boot.sh started: cancels every job, then stops each process
# named by a pid file in /run/rlslurm-ci (RLSLURM_CI_RUN), and only if /proc/PID still is
# what we started (pids get reused). Never kills by name. A zombie counts as stopped (PID 1
# here reaps orphans only after a few seconds). Idempotent: with nothing running it is a no-op.
# Usage: stop.sh [--quiet]
set -uo pipefail

RUN="${RLSLURM_CI_RUN:-/run/rlslurm-ci}"     # boot.sh's RLSLURM_CI_RUN
JOB_WAIT="${RLSLURM_CI_STOP_JOB_WAIT:-20}"   # seconds for cancelled jobs to leave the queue
quiet=0
[ "${1:-}" = "--quiet" ] && quiet=1
log() { [ "$quiet" = 1 ] || printf '[slurm-stop] %s %s\n' "$(date +%H:%M:%S)" "$*"; }
warn() { printf '[slurm-stop] WARNING: %s\n' "$*" >&2; }
export PATH="$PATH:/usr/sbin:/sbin"

pid_of() { [ -s "$1" ] && tr -dc '0-9' <"$1" || true; }
state_of() { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -d' ' -f1; }
# Is PID alive and still the process we started? $2 = expected comm, or "cmd:<substring>"
# for a script (whose comm is just "bash").
ours_alive() {
  local pid="$1" want="$2" st
  [ -n "$pid" ] && [ -d "/proc/$pid" ] || return 1
  st="$(state_of "$pid")"
  [ -n "$st" ] && [ "$st" != Z ] || return 1
  if [[ "$want" == cmd:* ]]; then
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "${want#cmd:}"
  else
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$want" ]
  fi
}

stop_pidfile() { # pidfile expected-comm
  local f="$1" want="$2" pid
  [ -e "$f" ] || return 0
  pid="$(pid_of "$f")"
  if ours_alive "$pid" "$want"; then
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 100); do ours_alive "$pid" "$want" || break; sleep 0.1; done
    if ours_alive "$pid" "$want"; then
      warn "$want pid $pid ignored SIGTERM for 10s; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null
      for _ in $(seq 50); do ours_alive "$pid" "$want" || break; sleep 0.1; done
    fi
    if ours_alive "$pid" "$want"; then
      warn "could not stop $want pid $pid"
      return 1
    fi
    log "stopped ${want#cmd:} (pid $pid)"
  fi
  rm -f "$f"
}

[ -d "$RUN" ] || { log "nothing to stop"; exit 0; }
# squeue/scancel below must reach the slurmctld of the cluster boot.sh started with this RUN.
if [ -s "$RUN/slurm_conf" ]; then SLURM_CONF="$(cat "$RUN/slurm_conf")"; export SLURM_CONF; fi

# Leave a cluster that a live pytest session owns alone (boot.sh records it), unless told.
owner_id() { [ -n "$1" ] && [ -r "/proc/$1/stat" ] && echo "$1 $(sed 's/.*) //' "/proc/$1/stat" | cut -d' ' -f20)"; }
if [ -s "$RUN/owner" ] && [ "${RLSLURM_CI_FORCE:-0}" != 1 ]; then
  other="$(cat "$RUN/owner")"
  me="$(owner_id "${RLSLURM_CI_OWNER_PID:-}" || true)"
  if [ "$other" != "$me" ] && [ "$(owner_id "${other%% *}" || true)" = "$other" ]; then
    warn "the cluster is in use by live pid ${other%% *}; not stopping it (RLSLURM_CI_FORCE=1 overrides)"
    exit 1
  fi
fi

# Cancel jobs first, while slurmctld and slurmd can still kill their steps; otherwise
# slurmstepd and the job's processes outlive the daemons.
ctld="$(pid_of "$RUN/slurmctld.pid")"
if ours_alive "$ctld" slurmctld; then
  users="$(timeout 10 squeue -h -o %u 2>/dev/null | sort -u)"
  if [ -n "$users" ]; then
    for u in $users; do timeout 10 scancel -u "$u" 2>/dev/null; done
    log "cancelled jobs of: $(echo $users)"
    deadline=$(( $(date +%s) + JOB_WAIT ))
    while [ -n "$(timeout 10 squeue -h -o %i 2>/dev/null)" ]; do
      if [ "$(date +%s)" -ge "$deadline" ]; then
        warn "jobs still listed ${JOB_WAIT}s after scancel: $(timeout 10 squeue -h -o '%i %T' | tr '\n' ' ')"
        break
      fi
      sleep 0.3
    done
  fi
fi

rc=0
stop_pidfile "$RUN/het-kick.pid" "cmd:het_kick.sh" || rc=1
for f in "$RUN"/slurmd-*.pid; do
  [ -e "$f" ] && { stop_pidfile "$f" slurmd || rc=1; }
done
stop_pidfile "$RUN/slurmctld.pid" slurmctld || rc=1
# Only a munged that boot.sh started has a pid file here; someone else's is left alone.
stop_pidfile "$RUN/munged.pid" munged || rc=1
# Steps of jobs that outlived the cancel are not ours to kill by name; say so loudly.
left=""
for d in /proc/[0-9]*; do
  [ "$(cat "$d/comm" 2>/dev/null)" = slurmstepd ] && [ "$(state_of "${d#/proc/}")" != Z ] && left="$left ${d#/proc/}"
done
[ -z "$left" ] || warn "slurmstepd processes still running (job steps that ignored the cancel?):$left"
[ "$rc" = 0 ] && rm -f "$RUN/owner" "$RUN/slurm_conf"
log "stopped"
exit "$rc"
