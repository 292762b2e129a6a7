"""Secret environment variables (--env HF_TOKEN=..., --secret-env NAME) are passed by a 0600 file
(RUN/control/secret_env), never by run.yaml or the rendered script, and still reach the job:
the file is sourced by real bash and read back by `rlslurm run`'s environment."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from rlslurm.errors import ConfigError
from rlslurm.local import _clean_env
from rlslurm.resolve import resolve
from rlslurm.secret_env import looks_secret, parse_env_file, read_secret_env, render_env_file
from rlslurm.settings.runfile import dump_run_config, load_run_config
from rlslurm.slurm.render import render
from rlslurm.slurm.submit import prepare_run_dir

SECRET = "hf_Sup3rS3cret$(touch pwned)`touch pwned2` it's \"q\"\nline2 $HOME \\"


@pytest.mark.parametrize("name, secret", [
    ("HF_TOKEN", True), ("HUGGING_FACE_HUB_TOKEN", True), ("WANDB_API_KEY", True), ("AWS_SECRET_ACCESS_KEY", True),
    ("DB_PASSWORD", True), ("OPENAI_APIKEY", True),
    ("TOKENIZERS_PARALLELISM", False), ("NCCL_DEBUG", False), ("KEYBOARD_LAYOUT", False), ("PYTHONPATH", False),
])
def test_secret_names(name: str, secret: bool) -> None:
    assert looks_secret(name) is secret


def _resolve(run_dir: Path, *extra: str):
    return resolve(["--model", "tiny-qwen3", "--nodes", "2", "--run-dir", str(run_dir), *extra], strict_inputs=False)


def test_dry_run_script_and_run_yaml_carry_no_secret(tmp_path: Path) -> None:
    # what `rlslurm submit --dry-run` prints, and what run.yaml would hold
    res = _resolve(tmp_path / "run", "--env", f"HF_TOKEN={SECRET}", "PLAIN_VAR=visible", "--secret-env", "MY_CREDS")
    assert res.cfg.slurm.secret_given() == {"HF_TOKEN": SECRET}  # the value is there to be written, and only there
    script, run_yaml = render(res.cfg, res.cfg.run_dir.resolve()), dump_run_config(res.cfg)
    for text in (script, run_yaml):
        assert "Sup3rS3cret" not in text
    assert "export PLAIN_VAR=visible" in script and ". \"$CONTROL/secret_env\"" in script
    assert "HF_TOKEN" not in load_yaml(run_yaml)["slurm"]["env"]
    assert load_yaml(run_yaml)["slurm"]["secret_env"] == ["MY_CREDS", "HF_TOKEN"]
    r = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr
    plain = _resolve(tmp_path / "run2", "--env", "PLAIN_VAR=visible")
    assert "secret_env" not in render(plain.cfg, plain.cfg.run_dir.resolve())  # no secrets: no sourcing


def load_yaml(text: str) -> dict:
    import yaml

    return yaml.safe_load(text)


def test_submit_writes_secrets_0600_and_never_into_run_yaml(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("MY_CREDS", "from-the-environment")
    from tests.helpers.hf_shape import hf_shaped_dir

    hf_shaped_dir(tmp_path / "hf", "tiny-qwen3")  # a checkpoint given: no random-init one is made (seconds on 2 cores)
    rd = prepare_run_dir(_resolve(tmp_path / "run", "--env", f"WANDB_API_KEY={SECRET}", "--secret-env", "MY_CREDS",
                                  "--group-shared", "--hf-checkpoint", str(tmp_path / "hf")))
    secret_file = rd.control_dir / "secret_env"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert read_secret_env(rd.path) == {"MY_CREDS": "from-the-environment", "WANDB_API_KEY": SECRET}
    for f in rd.path.rglob("*"):
        if f.is_file() and f != secret_file:
            assert b"Sup3rS3cret" not in f.read_bytes() and b"from-the-environment" not in f.read_bytes(), f
    assert load_run_config(rd.path).slurm.secret_env == ["MY_CREDS", "WANDB_API_KEY"]
    # `rlslurm run` gives its processes the secrets and the plain --env values
    env = _clean_env(0, rd)
    assert env["WANDB_API_KEY"] == SECRET and env["MY_CREDS"] == "from-the-environment"
    # a resubmit (cfg from run.yaml: no values) keeps the file as it is
    from rlslurm.resolve import Resolved
    from rlslurm.settings.model_config import load_model_config

    cfg = load_run_config(rd.path)
    prepare_run_dir(Resolved(cfg, load_model_config(cfg.model.model)), resume=True)
    assert read_secret_env(rd.path)["WANDB_API_KEY"] == SECRET


def test_secret_without_a_value_is_refused_before_anything_is_created(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("MY_CREDS", raising=False)
    with pytest.raises(ConfigError, match=r"--secret-env MY_CREDS: MY_CREDS is not set"):
        prepare_run_dir(_resolve(tmp_path / "run", "--secret-env", "MY_CREDS"))
    assert not (tmp_path / "run").exists()


def test_secret_file_is_sourced_by_bash_intact_and_runs_nothing(tmp_path: Path) -> None:
    values = {"HF_TOKEN": SECRET, "EMPTY_KEY": "", "QUOTES_SECRET": "'\"'\"'", "MULTI_TOKEN": "a\n\nb\t c "}
    f = tmp_path / "secret_env"
    f.write_text(render_env_file(values))
    assert parse_env_file(f.read_text(), where=str(f)) == values
    for name, value in values.items():
        r = subprocess.run(["bash", "-c", f'. "$1" && printf %s "${name}"', "bash", str(f)], cwd=tmp_path,
                           capture_output=True, env={"PATH": os.environ["PATH"]})
        assert r.returncode == 0 and r.stdout.decode() == value, (name, r)
    assert not list(tmp_path.glob("pwned*"))


def test_a_file_rlslurm_did_not_write_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="secret_env: not a file rlslurm wrote"):
        parse_env_file("HF_TOKEN=x\n", where=str(tmp_path / "secret_env"))
