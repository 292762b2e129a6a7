"""A recorded batch script (as submitit keeps `_sbatch_test_record.txt`): any change to what a job
runs shows up here as a diff to review. After a deliberate change, regenerate with
    RLSLURM_UPDATE_GOLDEN=1 python -m pytest tests/slurm/test_golden_sbatch.py
and read the diff before committing it."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from rlslurm.resolve import resolve
from rlslurm.slurm.render import render
from tests.helpers.hf_shape import hf_shaped_dir
from tests.helpers.prompt_files import prompt_lines

GOLDEN_DIR = Path(__file__).parent / "golden"
RUN_DIR = Path("/gpfs/runs/golden")


# the het job, and the one-node job (one group, both steps --overlap, docs/single-node.md)
@pytest.mark.parametrize("golden,layout", [("hetjob-qwen3-4B-4nodes.sbatch", ["--nodes", "4"]),
                                           ("onenode-qwen3-4B.sbatch",
                                            ["--nodes", "1", "--gpus-per-node", "4", "--trainer-gpus", "2"])])
def test_rendered_batch_script_matches_the_recorded_one(tmp_path: Path, monkeypatch, golden: str,
                                                       layout: list[str]) -> None:
    GOLDEN = GOLDEN_DIR / golden
    monkeypatch.setenv("HF_TOKEN", "hf_not_in_the_script")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(prompt_lines({"prompt": "1+1=", "label": "2"}))
    argv = ["--model", "qwen3-4B", *layout, "--prompt-data", str(prompts),
            "--hf-checkpoint", str(hf_shaped_dir(tmp_path / "hf", "qwen3-4B")), "--run-dir", str(RUN_DIR),
            "--run-name", "golden run", "--python", "/opt/venv/bin/python", "--partition", "gpu", "--account", "proj",
            "--time", "1-00:00:00", "--setup-script", "/gpfs/env.sh", "--env", "NCCL_DEBUG=WARN",
            "--secret-env", "HF_TOKEN", "--max-failures", "2", "--signal-grace-s", "600",
            "--sbatch-extra=--constraint=h100", "--rollout-sbatch-extra=--exclude=gpu-17",
            "--sbatch-extra=--mail-type=FAIL"]
    script = render(resolve(argv, strict_inputs=False).cfg, RUN_DIR)
    assert "hf_not_in_the_script" not in script
    if os.environ.get("RLSLURM_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(script)
    recorded = GOLDEN.read_text()
    diff = "".join(difflib.unified_diff(recorded.splitlines(True), script.splitlines(True), str(GOLDEN), "rendered"))
    assert script == recorded, \
        f"the batch script changed (regenerate only if deliberate, see this file's docstring):\n{diff}"
