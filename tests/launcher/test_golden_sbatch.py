"""A recorded batch script (as submitit keeps `_sbatch_test_record.txt`): any change to what a job
runs shows up here as a diff to review. After a deliberate change, regenerate with
    RLSLURM_UPDATE_GOLDEN=1 python -m pytest tests/launcher/test_golden_sbatch.py
and read the diff before committing it."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

from rlslurm.resolve import resolve
from rlslurm.slurm.render import render
from tests.hf_shape import hf_shaped_dir
from tests.prompt_files import prompt_lines

GOLDEN = Path(__file__).parent / "golden" / "hetjob-qwen3-4B-4nodes.sbatch"
RUN_DIR = Path("/gpfs/runs/golden")


def test_rendered_batch_script_matches_the_recorded_one(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_not_in_the_script")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(prompt_lines({"prompt": "1+1=", "label": "2"}))
    argv = ["--model", "qwen3-4B", "--nodes", "4", "--prompt-data", str(prompts),
            "--hf-checkpoint", str(hf_shaped_dir(tmp_path / "hf", "qwen3-4B")), "--run-dir", str(RUN_DIR),
            "--run-name", "golden run", "--python", "/opt/venv/bin/python", "--partition", "gpu", "--account", "proj",
            "--time", "1-00:00:00", "--setup-script", "/gpfs/env.sh", "--env", "NCCL_DEBUG=WARN",
            "--secret-env", "HF_TOKEN", "--max-failures", "2", "--signal-grace-s", "600"]
    script = render(resolve(argv, strict_inputs=False).cfg, RUN_DIR)
    assert "hf_not_in_the_script" not in script
    if os.environ.get("RLSLURM_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(script)
    recorded = GOLDEN.read_text()
    diff = "".join(difflib.unified_diff(recorded.splitlines(True), script.splitlines(True), str(GOLDEN), "rendered"))
    assert script == recorded, f"the batch script changed (regenerate only if deliberate, see this file's docstring):\n{diff}"
