"""slime's W&B flags at submit (docs/wandb.md): --wandb-* only with --use-wandb, a missing wandb
package named at submit, a run id that stays the same for every attempt, no key on the command
line, and a warning when an online run would have no key."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rlslurm.resolve import resolve
from rlslurm.settings.runfile import dump_run_config
from tests.helpers.config_errors import one_line_naming


@pytest.fixture
def argv(tmp_path: Path, prompts: Path, monkeypatch) -> list[str]:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc: the key warning is this test's to see
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return ["--model", "tiny-qwen3", "--prompt-data", str(prompts), "--run-dir", str(tmp_path / "run")]


@pytest.mark.parametrize("flag, value", [
    ("--wandb-mode", "offline"), ("--wandb-project", "p"), ("--wandb-group", "g"), ("--wandb-team", "t"),
    ("--wandb-host", "https://wandb.example.org"), ("--wandb-dir", "w"), ("--wandb-run-id", "abc"),
])
def test_wandb_flags_need_use_wandb(argv: list[str], flag: str, value: str) -> None:
    msg = one_line_naming(argv + [flag, value], flag, "--use-wandb")
    assert msg.startswith(f"{flag} needs --use-wandb")


def test_wandb_key_is_refused_toward_the_secret_env(argv: list[str]) -> None:
    one_line_naming(argv + ["--use-wandb", "--wandb-key", "k3y"], "--wandb-key", "--secret-env WANDB_API_KEY")


@pytest.mark.parametrize("flag, value", [("--wandb-run-id", "a/b"), ("--wandb-run-id", "x" * 56),
                                         ("--wandb-host", "wandb.example.org"), ("--wandb-mode", "shared")])
def test_bad_values_name_the_flag(argv: list[str], flag: str, value: str) -> None:
    one_line_naming(argv + ["--use-wandb", flag, value], flag)


def test_the_default_run_id_is_stable_per_run_directory(argv: list[str], tmp_path: Path) -> None:
    a = resolve(argv + ["--use-wandb", "--wandb-mode", "offline", "--run-name", "glm/4 grpo"]).cfg
    again = resolve(argv + ["--use-wandb", "--wandb-mode", "offline", "--run-name", "glm/4 grpo"]).cfg
    other = resolve(argv + ["--use-wandb", "--wandb-mode", "offline", "--run-name", "glm/4 grpo",
                            "--run-dir", str(tmp_path / "other")]).cfg
    assert a.run.wandb_run_id == again.run.wandb_run_id != other.run.wandb_run_id
    assert a.run.wandb_run_id.startswith("glm-4-grpo-")
    assert f"wandb_run_id: {a.run.wandb_run_id}" in dump_run_config(a)  # run.yaml keeps it for every attempt
    given = resolve(argv + ["--use-wandb", "--wandb-run-id", "my-run.1", "--wandb-mode", "offline"]).cfg
    assert given.run.wandb_run_id == "my-run.1"
    assert resolve(argv).cfg.run.wandb_run_id is None  # no W&B, no id


def test_wandb_dir_is_made_absolute(argv: list[str], monkeypatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = resolve(argv + ["--use-wandb", "--wandb-mode", "offline", "--wandb-dir", "wb"]).cfg
    assert cfg.run.wandb_dir == tmp_path / "wb"


def test_online_without_a_key_warns_and_the_secret_env_silences_it(argv: list[str]) -> None:
    warned = resolve(argv + ["--use-wandb"]).warnings
    assert any(w.startswith("--use-wandb: no W&B key for the job") and "--secret-env WANDB_API_KEY" in w
               for w in warned), warned
    for extra in (["--secret-env", "WANDB_API_KEY"], ["--wandb-mode", "offline"], ["--env", "WANDB_MODE=offline"]):
        assert not [w for w in resolve(argv + ["--use-wandb", *extra]).warnings if "W&B" in w], extra


def test_missing_wandb_package_is_named_at_submit(argv: list[str], monkeypatch) -> None:
    # None in sys.modules is how Python marks a module as not importable (find_spec answers None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    msg = one_line_naming(argv + ["--use-wandb", "--wandb-mode", "offline"], "--use-wandb", "wandb")
    assert "not installed on this host" in msg
    # a job in another environment may have it: a warning, not an error
    res = resolve(argv + ["--use-wandb", "--wandb-mode", "offline", "--env", "PYTHONPATH=/opt/job-env"])
    assert any(w.startswith("--use-wandb: the wandb package is not installed") for w in res.warnings)
    resolve(argv + ["--use-wandb", "--wandb-mode", "disabled"])  # nothing to import
