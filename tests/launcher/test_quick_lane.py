"""`bash tools/test.sh --quick` (issue 33 item 8): the tests that need no SLURM cluster and start no
engine or megatron run, for a contributor's loop; CI (.ci/run) keeps running the whole suite."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_lane_leaves_out_slurm_engines_and_slow_tests() -> None:
    p = subprocess.run(["bash", "tools/test.sh", "--quick", "--collect-only", "-q", "-p", "no:cacheprovider"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ids = [line for line in p.stdout.splitlines() if "::" in line]
    files = {i.split("::")[0] for i in ids}
    assert "tests/launcher/test_quick_lane.py" in files and "tests/buffer/test_commit_read.py" in files
    for heavy in ("tests/e2e/", "tests/slurm/test_slurm_job.py",
                  "tests/trainer/test_trainer_step.py"):  # SLURM jobs and engines; a megatron step
        assert not [f for f in files if f.startswith(heavy)], heavy
    # a module's unmarked tests stay, its marked ones go
    assert "tests/test_slurm_cluster.py::test_parse_kv_line_keeps_values_with_spaces_and_odd_keys" in ids
    assert "tests/test_slurm_cluster.py::test_plain_job_runs_with_srun_tasks_and_is_logged" not in ids
    assert "tests/engines/test_engines.py::test_spec_argv_has_every_flag_and_never_the_key" in ids
    assert "tests/engines/test_engines.py::test_bad_passthrough_flag_fails_start_with_the_flag_in_the_error" not in ids
    assert "deselected" in p.stdout
    assert "[test] lint (ruff check .): exit 0" in p.stdout  # the lint runs first, and the tree passes it


def test_ci_runs_the_whole_suite() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash tools/test.sh\n" in ci and "--quick" not in ci
