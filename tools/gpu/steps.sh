#!/usr/bin/env bash
# On the GPU machine, after staging (tools/gpu/stage.sh): run commands one after the other within one
# device call, each given what is left of BUDGET_S seconds, each one's output in $OUT/NAME.log and a
# line per command in $OUT/steps.txt. Put the command that matters most first.
#   bash tools/gpu/steps.sh BUDGET_S NAME 'COMMAND' [NAME 'COMMAND' ...]
# Exit status: the first failing command's (124: its time ran out).
set -uo pipefail
. tools/gpu/env.sh
out="${OUT:-/tmp/rlslurm-gpu-out}"; mkdir -p "$out"
end=$(( $(date +%s) + ${1:?usage: steps.sh BUDGET_S NAME COMMAND ...} )); shift
rc=0
while [ $# -ge 2 ]; do
  name="$1"; cmd="$2"; shift 2
  left=$(( end - $(date +%s) ))
  if [ "$left" -le 20 ]; then
    echo "$name: not run, the budget is spent" | tee -a "$out/steps.txt"
    continue
  fi
  t0=$(date +%s)
  # STEP_LEFT_S: a step that packs records after its main command (tier.sh) stops that command in time
  STEP_LEFT_S=$(( left - 15 )) timeout "$left" bash -c "$cmd" > "$out/$name.log" 2>&1
  r=$?
  echo "$name: rc=$r in $(( $(date +%s) - t0 )) s" | tee -a "$out/steps.txt"
  if [ "$rc" = 0 ] && [ "$r" != 0 ]; then rc=$r; fi
done
exit "$rc"
