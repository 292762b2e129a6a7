"""Help a user can read and output a script can use (issue 33): every config field has a description,
`rlslurm flags` shows it with type, default and section and filters by keyword; --version, `python -m
rlslurm`, --help pointing to the flag list, model-name suggestions, `convert --help` naming --submit;
into a pipe `models`, `flags`, `buffer ls` and `status` print whole tab-separated rows (Rich cut
"qwen3-4B" to "qwen3-…" at 80 columns)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

import rlslurm
from rlslurm.buffer.rundir import RunDir
from rlslurm.cli import app
from rlslurm.errors import ConfigError
from rlslurm.settings.config import SECTIONS, RunConfig
from rlslurm.settings.flags import FIELDS, flag_help
from rlslurm.settings.model_config import available_models, model_config_path

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The command as a user runs it, output into a pipe at Rich's 80-column default."""
    return subprocess.run([sys.executable, "-m", "rlslurm", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT)}, cwd=ROOT)


def test_every_config_field_has_a_description() -> None:
    missing = [f"{section}.{name}" for section in SECTIONS
               for name, f in type(getattr(RunConfig(), section)).model_fields.items()
               if not (f.description or "").strip()]
    missing += [name for name, f in RunConfig.model_fields.items() if name not in SECTIONS and not f.description]
    assert not missing, \
        f"config fields without a description (rlslurm/settings/config.py Field(description=...)): {missing}"


def test_flags_lists_every_field_with_type_default_and_description() -> None:
    res = runner.invoke(app, ["flags"])
    assert res.exit_code == 0, res.output
    header, *rows = [line.split("\t") for line in res.stdout.splitlines()]
    assert header == ["flag", "section", "type", "default", "description"]
    assert len(rows) == len(FIELDS) and all(len(r) == 5 and r[4] for r in rows)
    by_flag = {r[0]: r for r in rows}
    assert by_flag["--lr"] == ["--lr", "train", "float", "1e-06", "learning rate of the actor"]
    assert by_flag["--qkv-format"][2:4] == ["bshd|thd", "bshd"]
    assert by_flag["--sbatch-extra"][2:4] == ["str ...", "-"]
    assert by_flag["--exclusive"][3] == "true"


def test_flags_keyword_filters_by_name_section_and_word() -> None:
    names = {h.flag for h in flag_help("lr")}
    assert {"--lr", "--min-lr", "--critic-lr", "--lr-decay-style"} <= names and "--nodes" not in names
    assert {h.flag for h in flag_help("--rollout_top_k")} == {"--rollout-top-k"}
    assert {h.section for h in flag_help("slurm")} >= {"slurm"}
    assert "--container-image" in {h.flag for h in flag_help("pyxis")}  # a word of the description
    res = runner.invoke(app, ["flags", "wandb", "--json"])
    rows = json.loads(res.stdout)
    assert {r["flag"] for r in rows} >= {"--use-wandb", "--wandb-project"}
    assert all(set(r) == {"flag", "field", "section", "type", "default", "description"} for r in rows)
    p = cli("flags", "no-such-thing")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "no flag matches" in p.stderr, p.stderr


def test_models_into_a_pipe_are_whole_rows() -> None:
    p = cli("models")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split("\t")[0] == "name"
    assert [line.split("\t")[0] for line in lines[1:]] == available_models()
    assert [line for line in lines if line.startswith("qwen3-4B\t")], p.stdout  # `rlslurm models | grep qwen3-4B`
    assert "…" not in p.stdout


def test_version_module_entry_and_help_pointers() -> None:
    p = cli("--version")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert p.returncode == 0 and p.stdout.startswith(f"rlslurm {version} (") and rlslurm.__version__ == version
    for command in ("submit", "run", "render"):
        res = runner.invoke(app, [command, "--help"], terminal_width=200)
        assert "rlslurm flags" in res.stdout and "KEYWORD" in res.stdout, (command, res.stdout)
    res = runner.invoke(app, ["--help"], terminal_width=200)
    assert "--install-completion" in res.stdout and "--version" in res.stdout


def test_convert_help_names_submit() -> None:
    pytest.importorskip("torch")
    p = cli("convert", "--help")
    assert p.returncode == 0, p.stderr
    text = " ".join(p.stdout.split())
    assert "--submit" in text and "--partition" in text and "--gpus-per-node" in text and "hf-to-mcore" in text


def test_a_wrong_case_model_name_gets_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"unknown model 'glm4-9b'; did you mean glm4-9B\?"):
        model_config_path("glm4-9b")
    with pytest.raises(ConfigError, match=r"available: deepseek-v3, "):
        model_config_path("no-such-model")


def test_buffer_ls_and_status_into_a_pipe_are_whole_rows(tmp_path: Path) -> None:
    rd = RunDir.create(tmp_path / ("r" * 90))
    reason = "failed: trainer step ended first (trainer rc=1, rollout rc=0); requeue 1/3 " + "x" * 80
    rd.attempt_log_dir(0).mkdir(parents=True)
    rd.ledger.write_text(json.dumps({"attempt": 0, "job_id": "7", "restart_count": 0, "start": 1, "end": 2,
                                     "exit_code": 1, "reason": reason, "trainer_nodes": "n1",
                                     "rollout_nodes": "n2"}) + "\n")
    p = cli("status", str(rd.path))
    assert p.returncode == 0, p.stderr
    head, attempts = p.stdout.split("\n\n")
    assert f"run dir\t{rd.path}" in head.splitlines()
    assert attempts.splitlines()[0] == "attempt\tjob\tstart\tend\texit\treason"
    assert attempts.splitlines()[1].split("\t")[-1] == reason
    p = cli("buffer", "ls", str(rd.path))
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["id\tsamples\treward mean\treward std\ttruncated\ttokens\t"
                                     "weight versions\ttrained"]
