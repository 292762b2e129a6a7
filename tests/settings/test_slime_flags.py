"""slime's spellings (issue 16 item 2): the ones that mean the same are accepted, the new settings are
validated at submit, and a slime flag rlslurm deliberately lacks is refused with what to use instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlslurm.errors import ConfigError
from rlslurm.resolve import resolve
from rlslurm.settings.flags import FIELDS, flag_name, parse_flags
from rlslurm.settings.rm_types import RM_REGISTRY
from rlslurm.settings.slime_flags import SLIME_ALIASES, SLIME_INSTEAD
from tests.helpers.config_errors import one_line_naming


def test_slime_normalization_switches_set_the_fields(argv: list[str]) -> None:
    cfg = resolve(argv + ["--disable-grpo-std-normalization", "--num-rollout", "4"]).cfg
    assert cfg.train.grpo_std_normalization is False and cfg.rollout.num_rollout == 4
    assert cfg.train.rewards_normalization is True
    cfg = resolve(argv + ["--disable-rewards-normalization"]).cfg
    assert cfg.train.rewards_normalization is False and cfg.train.grpo_std_normalization is True
    assert resolve(argv + ["--no-rewards-normalization"]).cfg.train.rewards_normalization is False
    assert resolve(argv).cfg.train.rewards_normalization is True


def test_rollout_max_prompt_len_is_max_prompt_len() -> None:
    assert parse_flags(["--rollout-max-prompt-len", "100"]).values[("data", "max_prompt_len")] == "100"
    with pytest.raises(ConfigError, match=r"^--rollout-max-prompt-len needs a value$"):
        parse_flags(["--rollout-max-prompt-len"])


def test_the_tables_name_what_exists() -> None:
    for slime, (field, _) in SLIME_ALIASES.items():
        assert field in FIELDS and slime not in FIELDS, slime
    assert not set(SLIME_INSTEAD) & set(FIELDS)  # a field would never reach its hint


@pytest.mark.parametrize("slime", sorted(SLIME_INSTEAD))
def test_unsupported_slime_flag_says_what_to_use_instead(slime: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_flags([flag_name(slime), "1"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"unknown flag {flag_name(slime)} (a slime flag")
    assert SLIME_INSTEAD[slime] in msg


def test_start_rollout_id_points_at_resubmit(argv: list[str]) -> None:
    one_line_naming(argv + ["--start-rollout-id", "100"], "--start-rollout-id", "rlslurm resubmit RUN")


def test_slime_keys_in_yaml_name_the_field(tmp_path: Path) -> None:
    from rlslurm.settings.flags import load_yaml_layer

    y = tmp_path / "run.yaml"
    y.write_text("rollout_batch_size: 4\ndisable_rewards_normalization: true\n")
    with pytest.raises(ConfigError, match=r"run.yaml:2: unknown setting 'disable_rewards_normalization' "
                                          r"\(slime's spelling of rewards_normalization: False\)"):
        load_yaml_layer(y)


@pytest.mark.parametrize("rm_type", sorted(RM_REGISTRY))
def test_every_registered_rm_type_resolves(argv: list[str], rm_type: str) -> None:
    extra = ["--rm-url", "http://rm.example:8000/score"] if RM_REGISTRY[rm_type].needs_url else []
    if RM_REGISTRY[rm_type].dict_keys:
        extra += ["--reward-key", "score"]
    assert resolve(argv + ["--rm-type", rm_type, *extra]).cfg.rollout.rm_type == rm_type


def test_rm_type_errors_name_the_flag(argv: list[str]) -> None:
    one_line_naming(argv + ["--rm-type", "ifbench"], "--rm-type", "ifbench", "--custom-rm-path")
    one_line_naming(argv + ["--rm-type", "remote_rm"], "--rm-type remote_rm needs --rm-url")
    one_line_naming(argv + ["--rm-type", "dapo"], "--rm-type dapo", "--reward-key score")
    one_line_naming(argv + ["--rm-type", "dapo", "--reward-key", "reward"], "--rm-type dapo", "'reward'")
    # a custom reward function replaces the rule, and with it the rule's keys
    plugin = Path(argv[-1]).parent / "rm.py"
    plugin.write_text("def rm(sample):\n    return 1.0\n")
    resolve(argv + ["--rm-type", "dapo", "--custom-rm-path", f"{plugin}:rm"])


def test_normalization_switches_an_estimator_ignores_are_refused(argv: list[str]) -> None:
    one_line_naming(argv + ["--disable-rewards-normalization", "--advantage-estimator", "ppo"],
                     "--disable-rewards-normalization", "ppo", "grpo")
    one_line_naming(argv + ["--disable-grpo-std-normalization", "--advantage-estimator",
                             "reinforce_plus_plus_baseline", "--normalize-advantages"],
                     "--disable-grpo-std-normalization", "reinforce_plus_plus_baseline")
    # Dr.GRPO, and no baseline at all for the estimator that has one
    resolve(argv + ["--disable-grpo-std-normalization"])
    resolve(argv + ["--disable-rewards-normalization", "--advantage-estimator", "reinforce_plus_plus_baseline",
                    "--normalize-advantages"])


def test_trainer_gets_rewards_normalization() -> None:
    pytest.importorskip("torch")
    from rlslurm.settings.config import TrainSection
    from rlslurm.trainer.advantages import rl_configs_from_train

    adv, _ = rl_configs_from_train(TrainSection(rewards_normalization=False))
    assert adv.rewards_normalization is False
    assert rl_configs_from_train(TrainSection())[0].rewards_normalization is True


def test_context_len_and_eval_sampling_are_validated(argv: list[str]) -> None:
    one_line_naming(argv + ["--rollout-max-context-len", "1"], "--rollout-max-context-len")
    one_line_naming(argv + ["--rollout-max-context-len", "64", "--max-prompt-len", "64"],
                     "--max-prompt-len 64", "--rollout-max-context-len 64")
    one_line_naming(argv + ["--rollout-max-context-len", "64", "--rollout-max-prompt-len", "80"],
                     "--max-prompt-len 80", "--rollout-max-context-len 64")
    one_line_naming(argv + ["--eval-top-k", "0"], "--eval-top-k", "-1")
    one_line_naming(argv + ["--eval-top-p", "1.5"], "--eval-top-p")
    one_line_naming(argv + ["--eval-top-p", "0"], "--eval-top-p")


def test_eval_sampling_falls_back_to_the_rollout_values(argv: list[str]) -> None:
    from rlslurm.rollout.driver import max_prompt_len, sampling_params

    cfg = resolve(argv + ["--rollout-top-p", "0.9", "--rollout-top-k", "50"]).cfg
    assert (sampling_params(cfg, eval=True)["top_p"], sampling_params(cfg, eval=True)["top_k"]) == (0.9, 50)
    cfg = resolve(argv + ["--rollout-top-p", "0.9", "--eval-top-p", "0.7", "--eval-top-k", "20"]).cfg
    assert (sampling_params(cfg, eval=True)["top_p"], sampling_params(cfg, eval=True)["top_k"]) == (0.7, 20)
    assert (sampling_params(cfg)["top_p"], sampling_params(cfg)["top_k"]) == (0.9, -1)
    # slime's default: a prompt must leave room for one token; an explicit --max-prompt-len wins
    assert max_prompt_len(resolve(argv + ["--rollout-max-context-len", "64"]).cfg) == 63
    assert max_prompt_len(resolve(argv + ["--rollout-max-context-len", "64", "--max-prompt-len", "10"]).cfg) == 10
    assert max_prompt_len(cfg) is None
