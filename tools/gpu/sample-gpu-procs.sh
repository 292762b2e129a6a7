#!/usr/bin/env bash
# Samples every GPU process's memory until killed: lines "epoch_s pid MiB" in $1, and each new pid's
# command line (cut to 200 characters) in $1.cmd. For per-process memory over a run (which process
# holds what after a --colocate release, docs/colocate.md); nvidia-smi reports a process's own
# allocations, so memory mapped from another process by CUDA IPC counts once, at its owner.
out="${1:?usage: sample-gpu-procs.sh OUT_FILE [INTERVAL_S]}"; every="${2:-0.5}"
: > "$out"; : > "$out.cmd"
declare -A seen
while true; do
  now=$(date +%s.%N)
  while IFS=', ' read -r pid mib; do
    [ -n "$pid" ] || continue
    echo "${now%????} $pid $mib" >> "$out"
    if [ -z "${seen[$pid]:-}" ]; then
      seen[$pid]=1
      echo "$pid $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | cut -c1-200)" >> "$out.cmd"
    fi
  done < <(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null)
  sleep "$every"
done
