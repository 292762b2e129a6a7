"""Values that used to pass validation and fail later (in the job, or by requeueing forever):
each is refused at resolve with one line naming the flag."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlslurm.errors import ConfigError
from rlslurm.resolve import resolve
from rlslurm.slurm.timespec import time_limit_s


@pytest.fixture
def argv(tmp_path: Path) -> list[str]:
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "say a", "label": "a"}) + "\n")
    return ["--model", "tiny-qwen3", "--prompt-data", str(p)]


@pytest.mark.parametrize("value,seconds", [
    ("30", 1800), ("90", 5400), ("5:30", 330), ("02:00:00", 7200), ("1-0", 86400), ("2-12", 216000),
    ("1-02:30", 95400), ("1-00:00:10", 86410), ("UNLIMITED", None), ("infinite", None), ("0", None),
])
def test_slurm_time_formats(value: str, seconds: int | None) -> None:
    assert time_limit_s(value) == seconds


@pytest.mark.parametrize("value", ["", "1:2:3:4", "1-2-3", "-5", "10m", "1:00\n", "1-", "1.5", "unlimited\n"])
def test_bad_slurm_times(value: str) -> None:
    with pytest.raises(ValueError, match="not a SLURM time"):
        time_limit_s(value)


def test_time_shorter_than_twice_the_grace_is_refused(argv: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"--time 5 \(300 s\) must be at least twice --signal-grace-s 300") as e:
        resolve(argv + ["--time", "5"])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"--time 00:09:59 \(599 s\) .* --signal-grace-s 300"):
        resolve(argv + ["--time", "00:09:59"])
    with pytest.raises(ConfigError, match=r"--time 1 \(60 s\) .* --signal-grace-s 31"):
        resolve(argv + ["--time", "1", "--signal-grace-s", "31"])
    for ok in (["--time", "10"], ["--time", "2", "--signal-grace-s", "60"], ["--time", "UNLIMITED"],
               ["--time", "1-00"]):
        resolve(argv + ok)


@pytest.mark.parametrize("flag,value", [
    ("--partition", "gpu\n"), ("--account", "proj\n"), ("--qos", "high\n#SBATCH --uid=0"), ("--mem", "64G\n"),
    ("--time", "10\n"), ("--sbatch-extra", "--constraint=h100\n"),
])
def test_trailing_newline_is_not_a_valid_slurm_value(argv: list[str], flag: str, value: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        resolve(argv + [f"{flag}={value}"])


def test_env_name_with_trailing_newline_is_refused(argv: list[str]) -> None:
    with pytest.raises(ConfigError, match="--env"):
        resolve(argv + ["--env", "MY_VAR\n=1"])


@pytest.mark.parametrize("flag", ["--lr", "--adam-beta1", "--adam-beta2", "--rollout-temperature", "--min-lr",
                                  "--eps-clip", "--weight-sync-timeout-s"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_nan_and_inf_are_refused(argv: list[str], flag: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"^{flag}: .*finite"):
        resolve(argv + [flag, value])


def test_nan_in_yaml_names_the_line(argv: list[str], tmp_path: Path) -> None:
    y = tmp_path / "run.yaml"
    y.write_text("train:\n  lr: .nan\n")
    with pytest.raises(ConfigError, match=r"run.yaml:2: .*finite"):
        resolve(argv, y)


@pytest.mark.parametrize("flag,value", [("--adam-beta1", "1.0"), ("--adam-beta2", "-0.1"), ("--adam-eps", "0")])
def test_adam_hyperparameters_are_bounded(argv: list[str], flag: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"^{flag}: "):
        resolve(argv + [flag, value])


@pytest.mark.parametrize("value,ok", [("-1", True), ("1", True), ("50", True), ("0", False), ("-5", False)])
def test_top_k_is_minus_one_or_positive(argv: list[str], value: str, ok: bool) -> None:
    if ok:
        assert resolve(argv + ["--rollout-top-k", value]).cfg.rollout.rollout_top_k == int(value)
    else:
        with pytest.raises(ConfigError, match=r"^--rollout-top-k: must be -1 .* or >= 1"):
            resolve(argv + ["--rollout-top-k", value])
