"""Relative paths: resolved once at submit (flags against the submitting cwd, `--config` values
against the YAML file's directory), so the job, which runs in the run directory, sees the same files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlslurm.errors import ConfigError
from rlslurm.resolve import resolve
from rlslurm.settings.runfile import dump_run_config
from tests.helpers.config_errors import one_line_naming
from tests.helpers.hf_shape import hf_shaped_dir
from tests.helpers.prompt_files import prompt_lines

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A user's project dir: prompts, an HF dir, a setup script, a reward plugin file."""
    d = tmp_path / "proj"
    (d / "data").mkdir(parents=True)
    hf_shaped_dir(d / "ckpt", "tiny-qwen3")
    line = prompt_lines()
    (d / "data/p.jsonl").write_text(line)
    (d / "data/eval.jsonl").write_text(line)
    (d / "env.sh").write_text("true\n")
    (d / "reward.py").write_text("def rm(item):\n    return 1.0\n")
    return d


def _paths(cfg) -> dict[str, str]:
    return {
        "prompt_data": str(cfg.data.prompt_data), "hf_checkpoint": str(cfg.model.hf_checkpoint),
        "setup_script": str(cfg.slurm.setup_script), "eval": cfg.data.eval_prompt_data[1],
        "reward": cfg.rollout.custom_rm_path.rpartition(":")[0], "run_dir": str(cfg.run.run_dir),
    }


def test_relative_flags_resolve_against_the_submitting_cwd(project: Path, monkeypatch) -> None:
    monkeypatch.chdir(project)
    res = resolve(["--model", "tiny-qwen3", "--prompt-data", "data/p.jsonl", "--hf-checkpoint", "./ckpt",
                   "--setup-script", "env.sh", "--eval-prompt-data", "ev", "data/eval.jsonl",
                   "--custom-rm-path", "reward.py:rm", "--run-dir", "runs/x", "--python", "bin/../py3"])
    monkeypatch.chdir("/")  # the job runs elsewhere: what it reads must still name the same files
    cfg = yaml.safe_load(dump_run_config(res.cfg))
    got = _paths(res.cfg)
    for name, p in got.items():
        assert os.path.isabs(p), (name, p)
        assert name == "run_dir" or Path(p).exists(), (name, p)
    assert got["run_dir"] == str(project / "runs/x")
    assert cfg["data"]["prompt_data"] == str(project / "data/p.jsonl")
    assert cfg["rollout"]["custom_rm_path"] == f"{project / 'reward.py'}:rm"
    assert cfg["slurm"]["python"] == str(project / "py3")


def test_save_hf_pattern_resolves_and_takes_only_rollout_id(project: Path, monkeypatch) -> None:
    """--save-hf (slime's pattern): relative to the submitting directory, braces kept for the trainer;
    a field other than {rollout_id} is one line naming the flag, before anything is submitted."""
    monkeypatch.chdir(project)
    base = ["--model", "tiny-qwen3", "--prompt-data", "data/p.jsonl"]
    res = resolve(base + ["--save-hf", "exports/iter-{rollout_id}"])
    assert res.cfg.train.save_hf == f"{project}/exports/iter-{{rollout_id}}"
    for bad, why in (("out/{step}", "not {step}"), ("out/{rollout_id", "not a pattern")):
        one_line_naming(base + ["--save-hf", bad], "--save-hf", why)


def test_default_run_dir_and_module_plugins(project: Path, monkeypatch) -> None:
    monkeypatch.chdir(project)
    res = resolve(["--model", "tiny-qwen3", "--prompt-data", "data/p.jsonl", "--run-name", "r1",
                   "--custom-rm-path", "rlslurm.demo_task:reward", "--python", "python3"])
    assert res.cfg.run.run_dir == project / "runs/r1"
    assert res.cfg.rollout.custom_rm_path == "rlslurm.demo_task:reward"  # a module, not a file
    assert res.cfg.slurm.python == "python3"  # a command looked up on the node's PATH


def test_config_file_paths_are_relative_to_the_yaml(project: Path, tmp_path: Path, monkeypatch) -> None:
    (project / "conf").mkdir()
    y = project / "conf/run.yaml"
    y.write_text("data:\n  prompt_data: ../data/p.jsonl\n  eval_prompt_data: [ev, ../data/eval.jsonl]\n"
                 "hf_checkpoint: ../ckpt\nsetup_script: ../env.sh\ncustom_rm_path: ../reward.py:rm\n"
                 "run_dir: ../runs/y\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    got = _paths(resolve(["--model", "tiny-qwen3"], y).cfg)
    assert got["prompt_data"] == str(project / "data/p.jsonl") and got["eval"] == str(project / "data/eval.jsonl")
    assert got["hf_checkpoint"] == str(project / "ckpt") and got["run_dir"] == str(project / "runs/y")
    assert got["reward"] == str(project / "reward.py")
    # a flag given beside the YAML is still relative to the cwd
    (elsewhere / "q.jsonl").write_text((project / "data/p.jsonl").read_text())
    got = _paths(resolve(["--model", "tiny-qwen3", "--prompt-data", "q.jsonl"], y).cfg)
    assert got["prompt_data"] == str(elsewhere / "q.jsonl")


def test_missing_plugin_file_is_refused_before_submit(project: Path, monkeypatch) -> None:
    monkeypatch.chdir(project)
    with pytest.raises(ConfigError, match=r"--custom-generate-function-path .*gen\.py:generate: .* is not a file"):
        resolve(["--model", "tiny-qwen3", "--prompt-data", "data/p.jsonl",
                 "--custom-generate-function-path", "gen.py:generate"])
    with pytest.raises(ConfigError, match="--load-debug-rollout-data .*old-run is not a directory"):
        resolve(["--model", "tiny-qwen3", "--prompt-data", "data/p.jsonl", "--load-debug-rollout-data", "old-run"])


def test_render_resolved_from_another_cwd_prints_absolute_paths(project: Path) -> None:
    """The CLI path (what `submit` writes to run.yaml): a relative --prompt-data comes out absolute."""
    p = subprocess.run([sys.executable, "-m", "rlslurm.cli", "render", "--resolved", "--model", "tiny-qwen3",
                        "--prompt-data", "data/p.jsonl", "--run-dir", "runs/z"],
                       cwd=project, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    cfg = yaml.safe_load(p.stdout)
    assert cfg["data"]["prompt_data"] == str(project / "data/p.jsonl")
    assert cfg["run"]["run_dir"] == str(project / "runs/z")
