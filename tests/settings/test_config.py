"""Config resolution and every pre-submit validation error: the message names the culprit."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlslurm.errors import ConfigError, DataError, UserError
from rlslurm.resolve import resolve
from tests.helpers.hf_shape import hf_shaped_dir


def _argv(prompts: Path, *extra: str) -> list[str]:
    return ["--model", "qwen3-4B", "--nodes", "2", "--prompt-data", str(prompts), "--hf-checkpoint",
            str(hf_shaped_dir(prompts.parent / "hf", "qwen3-4B")),
            *extra]


def test_model_defaults_fill_a_sane_job(prompts: Path) -> None:
    res = resolve(_argv(prompts))
    cfg = res.cfg
    assert (cfg.slurm.trainer_nodes, cfg.slurm.rollout_nodes) == (1, 1)
    assert cfg.train.tensor_model_parallel_size == 2
    r, t = cfg.rollout, cfg.train
    assert r.rollout_batch_size * r.n_samples_per_prompt == t.global_batch_size * t.num_steps_per_rollout


def test_flags_override_yaml_and_yaml_overrides_defaults(prompts: Path, tmp_path: Path) -> None:
    y = tmp_path / "run.yaml"
    y.write_text("rollout:\n  rollout_batch_size: 16\n  n_samples_per_prompt: 4\nglobal_batch_size: 64\nlr: 2.0e-6\n")
    res = resolve(_argv(prompts, "--lr", "3e-6"), y)
    assert res.cfg.rollout.rollout_batch_size == 16 and res.cfg.train.global_batch_size == 64
    assert res.cfg.train.lr == 3e-6


def test_passthrough_families(prompts: Path) -> None:
    res = resolve(_argv(prompts, "--sglang-mem-fraction-static", "0.7", "--sglang-enable-metrics",
                        "--megatron-recompute-granularity", "full", "--megatron-recompute-num-layers", "2",
                        "--router-policy", "cache_aware", "--router-cache-threshold=0.3"))
    assert res.cfg.sglang_args == ["--mem-fraction-static", "0.7", "--enable-metrics"]
    # the model config's recompute_method joins the user's full recompute (megatron-core needs one with
    # full; resolve.py `_megatron_defaults`)
    assert res.cfg.megatron == {"recompute_granularity": "full", "recompute_method": "uniform",
                                "recompute_num_layers": 2}
    assert res.cfg.router_args == ["--policy", "cache_aware", "--cache-threshold", "0.3"]


def test_router_args_from_yaml_then_flags(prompts: Path, tmp_path: Path) -> None:
    """--router-* reach the rollout node's router (rollout/node.py) in argv form, YAML first."""
    from rlslurm.engines.router import RouterProcess

    y = tmp_path / "run.yaml"
    y.write_text("router_args: [--policy, consistent_hashing]\n")
    cfg = resolve(_argv(prompts, "--router-log-level", "info"), y).cfg
    assert cfg.router_args == ["--policy", "consistent_hashing", "--log-level", "info"]
    argv = RouterProcess(host="127.0.0.1", port=30000, log_path=tmp_path / "r.log", extra_args=cfg.router_args).argv()
    # after rlslurm's defaults, so the user's value is the one the router's parser keeps
    assert argv[-4:] == cfg.router_args and argv.index("--policy") < len(argv) - 4


def test_batch_identity_names_all_four_flags(prompts: Path) -> None:
    with pytest.raises(ConfigError) as e:
        resolve(_argv(prompts, "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
                      "--global-batch-size", "100", "--num-steps-per-rollout", "2"))
    msg = str(e.value)
    for flag in ("--rollout-batch-size", "--n-samples-per-prompt", "--global-batch-size", "--num-steps-per-rollout"):
        assert flag in msg
    assert "256" in msg and "200" in msg


def test_node_split_must_add_up(prompts: Path) -> None:
    with pytest.raises(ConfigError, match=r"--trainer-nodes 2 \+ --rollout-nodes 1 = 3, but --nodes is 2"):
        resolve(_argv(prompts, "--trainer-nodes", "2", "--rollout-nodes", "1"))


def test_gpus_per_engine_must_divide_rollout_gpus(prompts: Path) -> None:
    with pytest.raises(ConfigError, match=r"--rollout-num-gpus-per-engine 3 does not divide --gpus-per-node 8$"):
        resolve(_argv(prompts, "--rollout-num-gpus-per-engine", "3"))


def test_model_parallel_must_divide_trainer_gpus(prompts: Path) -> None:
    with pytest.raises(ConfigError) as e:
        resolve(_argv(prompts, "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "3"))
    assert "--tensor-model-parallel-size 4" in str(e.value) and "--pipeline-model-parallel-size 3" in str(e.value)
    assert "8 trainer GPUs" in str(e.value)


def test_missing_prompt_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(UserError, match="nope.jsonl"):
        resolve(["--model", "tiny-qwen3", "--prompt-data", str(missing)])


def test_malformed_prompt_line_reports_file_and_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a", "label": "a"}\n{"prompt": "b", "label": "b"}\n{"prompt": "c", oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3"):
        resolve(["--model", "tiny-qwen3", "--prompt-data", str(p)])


def test_missing_label_key_is_named(tmp_path: Path) -> None:
    p = tmp_path / "nolabel.jsonl"
    p.write_text('{"prompt": "a", "answer": "a"}\n')
    with pytest.raises(DataError) as e:
        resolve(["--model", "tiny-qwen3", "--prompt-data", str(p)])
    assert "nolabel.jsonl:1" in str(e.value) and "label" in str(e.value)


def test_parquet_prompts_are_checked(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "train.parquet"
    pq.write_table(pa.table({"question": ["1+1"], "label": ["2"]}), p)
    with pytest.raises(DataError, match="prompt"):
        resolve(["--model", "tiny-qwen3", "--prompt-data", str(p)])
    assert resolve(["--model", "tiny-qwen3", "--prompt-data", str(p), "--input-key", "question"]).cfg


def test_unknown_model_lists_available() -> None:
    with pytest.raises(ConfigError) as e:
        resolve(["--model", "gpt-5"], strict_inputs=False)
    assert "gpt-5" in str(e.value) and "glm4-9B" in str(e.value) and "qwen3-30B-A3B" in str(e.value)


def test_unknown_flag_suggests_the_right_one() -> None:
    with pytest.raises(ConfigError, match=r"--rollout-bach-size.*did you mean --rollout-batch-size"):
        resolve(["--rollout-bach-size", "4"], strict_inputs=False)


def test_a_dotted_flag_gets_the_field_it_names() -> None:
    """A YAML path typed as a flag (as in other launchers' configs) named --trainer-gpus, the closest
    spelling of "train.lr"; the field it names is the flag, under its real YAML section."""
    with pytest.raises(ConfigError, match=r"^unknown flag --train\.lr \(flags are not dotted: --lr; in a --config "
                                          r"YAML: train: \{lr: \.\.\.\}\)$"):
        resolve(["--train.lr", "1e-6"], strict_inputs=False)
    with pytest.raises(ConfigError, match=r"--rollout\.rollout-batch-sise .*did you mean --rollout-batch-size\?"):
        resolve(["--rollout.rollout-batch-sise", "4"], strict_inputs=False)


def test_bad_value_names_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"^--n-samples-per-prompt: .*'many'"):
        resolve(["--n-samples-per-prompt", "many"], strict_inputs=False)


def test_yaml_errors_name_file_and_line(tmp_path: Path) -> None:
    y = tmp_path / "run.yaml"
    y.write_text("model: tiny-qwen3\nrollout:\n  rollout_batch_size: 8\n  n_sample_per_prompt: 4\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:4: unknown setting rollout\.n_sample_per_prompt"):
        resolve([], y, strict_inputs=False)
    y.write_text("model: tiny-qwen3\nrollout:\n  rollout_batch_size: -3\n")
    with pytest.raises(ConfigError, match=r"run\.yaml:3: .*greater than or equal to 1"):
        resolve([], y, strict_inputs=False)


@pytest.mark.parametrize("value, needle", [
    ("{a:", r"^--megatron-foo: invalid YAML value '\{a:': expected the node content"),
    ("[full", r"^--megatron-foo: invalid YAML value '\[full': expected ',' or '\]'"),
    ("@x", r"^--megatron-foo: invalid YAML value '@x': found character '@'"),
])
def test_bad_megatron_yaml_value_names_the_flag(value: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        resolve(["--megatron-foo", value], strict_inputs=False)


def test_config_that_is_not_a_yaml_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^--config: .* is not a file"):
        resolve([], tmp_path, strict_inputs=False)
    b = tmp_path / "run.yaml"
    b.write_bytes(b"\xd7\x00\xff binary")
    with pytest.raises(ConfigError, match=r"^--config: .*run\.yaml is not a text file"):
        resolve([], b, strict_inputs=False)


def test_cli_prints_a_bracketed_value_verbatim(tmp_path: Path) -> None:
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "rlslurm.cli", "submit", "--dry-run", "--model", "tiny-qwen3",
                        "--megatron-recompute-granularity", "[full"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    # one line, and "[full" is not swallowed as console markup
    assert p.stderr.strip().splitlines() == [
        "error: --megatron-recompute-granularity: invalid YAML value '[full': expected ',' or ']', "
        "but got '<stream end>' at column 6"], p.stderr


def test_unsafe_slurm_names_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"^--partition: .*not a valid SLURM name"):
        resolve(["--partition", "gpu; rm -rf /"], strict_inputs=False)
    with pytest.raises(ConfigError, match=r"^--time: "):
        resolve(["--time", "tomorrow"], strict_inputs=False)


def test_kl_loss_and_kl_reward_are_exclusive() -> None:
    with pytest.raises(ConfigError, match="--kl-coef 0.01 .*--use-kl-loss --kl-loss-coef 0.01 .*exclusive"):
        resolve(["--model", "tiny-qwen3", "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-coef", "0.01"],
                strict_inputs=False)


def test_real_submit_requires_inputs_dry_run_only_warns() -> None:
    with pytest.raises(ConfigError, match="--prompt-data is required"):
        resolve(["--model", "glm4-9B", "--nodes", "4"])
    res = resolve(["--model", "glm4-9B", "--nodes", "4"], strict_inputs=False)
    assert any("--hf-checkpoint" in w for w in res.warnings)


def test_huge_model_on_few_nodes_warns() -> None:
    res = resolve(["--model", "deepseek-v3", "--nodes", "2"], strict_inputs=False)
    assert any("GiB per trainer GPU" in w for w in res.warnings)


def test_checkpoints_every_10_rollouts_by_default(prompts: Path) -> None:
    """Without a periodic checkpoint a hard kill (node failure, KILL past KillWait) loses the whole run."""
    assert resolve(_argv(prompts)).cfg.train.save_interval == 10
    assert resolve(_argv(prompts, "--save-interval", "3")).cfg.train.save_interval == 3
