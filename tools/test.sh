#!/usr/bin/env bash
# The README's test command: install everything (apt: slurm + munge; pip: torch CPU first,
# then the package with test extras and SGLang's CPU path), then run the whole suite.
# The suite boots a real SLURM cluster on this host (tests/slurm_cluster) and stops it by pid.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
export RLSLURM_REQUIRE_SLURM=1
set +e
python3 -m pytest tests --durations=30 "$@"  # the slowest tests, to keep the suite under 60 min
rc=$?
set -e
# pytest exit 5 = no tests collected: that is a failure here, never a silent pass.
exit "$rc"
