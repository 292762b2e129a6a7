"""Values that used to pass validation and fail later (in the job, or by requeueing forever):
each is refused at resolve with one line naming the flag."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from rlslurm.errors import ConfigError
from rlslurm.resolve import resolve
from rlslurm.settings.timespec import time_limit_s
from tests.helpers.config_errors import one_line_naming


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


# ------------------------------------------------------- rules across RL settings (rlslurm/settings/rl_settings.py)
# Each used to pass submit and stop the trainer at start-up, after the queue wait.

@pytest.mark.parametrize("extra,flags", [
    (["--advantage-estimator", "reinforce_plus_plus"],
     ["--advantage-estimator reinforce_plus_plus", "--normalize-advantages"]),
    (["--advantage-estimator", "reinforce_plus_plus_baseline"], ["--advantage-estimator", "--normalize-advantages"]),
    (["--num-critic-only-steps", "2"], ["--num-critic-only-steps 2", "--advantage-estimator ppo", "grpo"]),
    (["--use-tis", "--use-rollout-logprobs"], ["--use-tis", "--use-rollout-logprobs", "exclusive"]),
    (["--advantage-estimator", "gspo", "--kl-coef", "0.1"], ["--kl-coef", "--advantage-estimator gspo"]),
    (["--advantage-estimator", "ppo", "--kl-coef", "0.1", "--use-kl-loss", "--kl-loss-coef", "0.2"],
     ["--kl-coef 0.1", "--use-kl-loss --kl-loss-coef 0.2", "exclusive"]),
    (["--tis-clip", "0.5", "--tis-clip-low", "1.0"], ["--tis-clip 0.5", "--tis-clip-low 1"]),
    (["--eps-clip-c", "1.1"], ["--eps-clip-c 1.1", "--eps-clip-high"]),
    (["--eps-clip-c", "1.3", "--eps-clip-high", "0.3"], ["--eps-clip-c 1.3", "--eps-clip-high (1.3"]),
    (["--use-kl-loss", "--kl-loss-coef", "0.1"], ["--use-kl-loss --kl-loss-coef", "--hf-checkpoint", "--ref-load"]),
    (["--use-unbiased-kl"], ["--use-unbiased-kl", "--use-kl-loss --kl-loss-coef"]),
    (["--use-unbiased-kl", "--use-kl-loss", "--kl-loss-coef", "0"], ["--use-unbiased-kl", "--kl-loss-coef > 0"]),
    (["--advantage-estimator", "cispo", "--eps-clip-c", "3"], ["--eps-clip-c", "--advantage-estimator cispo"]),
])
def test_rl_rule_is_checked_at_submit(argv: list[str], extra: list[str], flags: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        resolve(argv + extra)
    msg = str(e.value)
    assert "\n" not in msg
    for f in flags:
        assert f in msg, (f, msg)


@pytest.mark.parametrize("ok", [
    ["--advantage-estimator", "reinforce_plus_plus", "--normalize-advantages"],
    ["--advantage-estimator", "ppo", "--num-critic-only-steps", "2"],
    ["--use-tis"], ["--use-rollout-logprobs"],
    ["--advantage-estimator", "ppo", "--kl-coef", "0.1", "--hf-checkpoint", "HF"],
    ["--use-kl-loss", "--kl-loss-coef", "0.1", "--ref-load", "HF"],
    ["--use-kl-loss", "--kl-loss-coef", "0"],
    ["--eps-clip-c", "3"],
    ["--use-unbiased-kl", "--use-kl-loss", "--kl-loss-coef", "0.1", "--ref-load", "HF"],
    ["--advantage-estimator", "cispo", "--eps-clip", "1", "--eps-clip-high", "4"],
])
def test_rl_rule_neighbours_pass(argv: list[str], tmp_path: Path, ok: list[str]) -> None:
    from tests.helpers.hf_shape import hf_shaped_dir

    hf = str(hf_shaped_dir(tmp_path / "hf", "tiny-qwen3"))
    resolve(argv + [hf if a == "HF" else a for a in ok])


def test_trainer_rechecks_with_the_same_validator() -> None:
    from rlslurm.settings.config import TrainSection
    from rlslurm.trainer.advantages import rl_configs_from_train

    with pytest.raises(ConfigError, match="--advantage-estimator reinforce_plus_plus needs --normalize-advantages"):
        rl_configs_from_train(TrainSection(advantage_estimator="reinforce_plus_plus"))


def test_estimator_names_come_from_one_registry() -> None:
    from rlslurm.settings import rl_settings
    from rlslurm.settings.config import TrainSection
    from rlslurm.trainer import advantages

    literal = typing.get_args(TrainSection.model_fields["advantage_estimator"].annotation)
    assert literal == rl_settings.ESTIMATOR_NAMES == advantages.ESTIMATORS
    assert rl_settings.names_where(critic=True) == ("ppo",)


# ------------------------------------------------------- --loss-type (rlslurm/settings/rl_settings.LOSS_TYPES)

@pytest.mark.parametrize("extra,names", [
    (["--loss-type", "custom_loss"], ["--loss-type custom_loss", "--custom-loss-function-path"]),
    (["--custom-loss-function-path", "LOSS"], ["--custom-loss-function-path", "--loss-type custom_loss",
                                              "not policy_loss"]),
    (["--loss-type", "sft_loss", "--custom-loss-function-path", "LOSS"], ["--custom-loss-function-path",
                                                                          "not sft_loss"]),
    (["--loss-type", "sft_loss", "--use-kl-loss", "--kl-loss-coef", "0.1", "--ref-load", "HF"],
     ["--loss-type sft_loss", "--use-kl-loss --kl-loss-coef"]),
    (["--loss-type", "sft_loss", "--use-tis", "--entropy-coef", "0.01"],
     ["--loss-type sft_loss", "--use-tis, --entropy-coef"]),
    (["--loss-type", "sft_loss", "--advantage-estimator", "ppo", "--kl-coef", "0.1", "--ref-load", "HF"],
     ["--loss-type sft_loss", "--kl-coef"]),
    (["--loss-type", "dpo"], ["--loss-type", "dpo", "sft_loss"]),
])
def test_loss_type_rules(argv: list[str], tmp_path: Path, extra: list[str], names: list[str]) -> None:
    from tests.helpers.hf_shape import hf_shaped_dir

    plugin = tmp_path / "loss.py"
    plugin.write_text("def nll(inputs):\n    return -inputs.reduce(inputs.log_probs), {}\n")
    hf = str(hf_shaped_dir(tmp_path / "hf", "tiny-qwen3"))
    sub = {"HF": hf, "LOSS": f"{plugin}:nll"}
    one_line_naming(argv + [sub.get(a, a) for a in extra], *names)


def test_loss_type_neighbours_pass_and_the_plugin_is_checked(argv: list[str], tmp_path: Path) -> None:
    plugin = tmp_path / "loss.py"
    plugin.write_text("def nll(inputs):\n    return -inputs.reduce(inputs.log_probs), {}\n"
                      "def two(inputs, extra):\n    pass\n")
    assert resolve(argv + ["--loss-type", "sft_loss"]).cfg.train.loss_type == "sft_loss"
    cfg = resolve(argv + ["--loss-type", "custom_loss", "--custom-loss-function-path", f"{plugin}:nll"]).cfg
    assert cfg.train.custom_loss_function_path == f"{plugin}:nll"
    one_line_naming(argv + ["--loss-type", "custom_loss", "--custom-loss-function-path", f"{plugin}:two"],
                    "--custom-loss-function-path", "cannot be called with 1 positional")
    one_line_naming(argv + ["--loss-type", "custom_loss", "--custom-loss-function-path", f"{tmp_path}/none.py:f"],
                    "--custom-loss-function-path", "none.py")


def test_custom_tis_function_needs_use_tis_and_a_callable(argv: list[str], tmp_path: Path) -> None:
    plugin = tmp_path / "tis.py"
    plugin.write_text("def w(inputs):\n    return inputs.loss_mask\ndef two(a, b):\n    pass\n")
    one_line_naming(argv + ["--custom-tis-function-path", f"{plugin}:w"], "--custom-tis-function-path", "--use-tis")
    cfg = resolve(argv + ["--use-tis", "--custom-tis-function-path", f"{plugin}:w"]).cfg
    assert cfg.train.custom_tis_function_path == f"{plugin}:w"
    one_line_naming(argv + ["--use-tis", "--custom-tis-function-path", f"{plugin}:two"],
                    "--custom-tis-function-path", "cannot be called with 1 positional")


def test_custom_advantage_function_rules(argv: list[str], tmp_path: Path) -> None:
    from tests.helpers.hf_shape import hf_shaped_dir

    plugin = tmp_path / "adv.py"
    plugin.write_text("def adv(inputs):\n    return inputs.loss_masks, inputs.loss_masks\n"
                      "def none():\n    pass\n")
    hf = str(hf_shaped_dir(tmp_path / "hf", "tiny-qwen3"))
    spec = ["--custom-advantage-function-path", f"{plugin}:adv"]
    # it replaces the estimator's advantages: the KL in the reward reaches it whatever the estimator,
    # and whether its output needs whitening is its own business
    resolve(argv + spec + ["--kl-coef", "0.1", "--hf-checkpoint", hf])
    resolve(argv + spec + ["--advantage-estimator", "reinforce_plus_plus"])
    one_line_naming(argv + ["--kl-coef", "0.1", "--hf-checkpoint", hf], "--kl-coef", "--advantage-estimator grpo")
    one_line_naming(argv + spec + ["--loss-type", "sft_loss"], "--loss-type sft_loss",
                    "--custom-advantage-function-path")
    one_line_naming(argv + ["--custom-advantage-function-path", f"{plugin}:none"],
                    "--custom-advantage-function-path", "cannot be called with 1 positional")
    one_line_naming(argv + ["--custom-advantage-function-path", "adv_plugin_nowhere:adv"],
                    "--custom-advantage-function-path", "adv_plugin_nowhere")


# ------------------------------------------------------------------ what the nodes used to find (rlslurm/preflight.py)




@pytest.mark.parametrize("body,attr,names", [
    ("import no_such_module_for_rlslurm\ndef rm(s):\n    return 1.0\n", "rm", ["no_such_module_for_rlslurm"]),
    ("def rm(s:\n", "rm", ["SyntaxError"]),
    ("raise RuntimeError('needs a GPU')\n", "rm", ["RuntimeError: needs a GPU"]),
    ("def other(s):\n    return 1.0\n", "rm", ["has no attribute 'rm'", "other"]),
    ("def rm():\n    return 1.0\n", "rm", ["cannot be called with 1 positional"]),
])
def test_plugin_that_does_not_import_is_refused(argv: list[str], tmp_path: Path, body: str, attr: str,
                                                names: list[str]) -> None:
    f = tmp_path / "reward_plugin.py"
    f.write_text(body)
    one_line_naming(argv + ["--custom-rm-path", f"{f}:{attr}"], "--custom-rm-path", str(f), *names)


def test_plugin_module_missing_here_is_a_warning_when_the_job_runs_another_environment(
        argv: list[str], tmp_path: Path) -> None:
    one_line_naming(argv + ["--custom-rm-path", "no_such_pkg_for_rlslurm.rewards:rm"], "--custom-rm-path",
                     "no_such_pkg_for_rlslurm")
    env = tmp_path / "env.sh"
    env.write_text("export PYTHONPATH=/opt/site\n")
    res = resolve(argv + ["--custom-rm-path", "no_such_pkg_for_rlslurm.rewards:rm", "--setup-script", str(env)])
    assert any("--custom-rm-path" in w and "no_such_pkg_for_rlslurm" in w for w in res.warnings), res.warnings


def test_float32_engines_on_gpus_are_refused_before_submit(argv: list[str]) -> None:
    """SGLang's CUDA rmsnorm has no float32: the engine died at its first forward on an H100 (docs/gpu.md)."""
    gpu = argv + ["--device", "cuda", "--gpus-per-node", "2"]
    one_line_naming(gpu + ["--rollout-dtype", "float32"], "--rollout-dtype float32", "--device cuda", "bfloat16")
    assert resolve(gpu + ["--rollout-dtype", "bfloat16"]).cfg.rollout.rollout_dtype == "bfloat16"
    assert resolve(argv + ["--rollout-dtype", "float32"]).cfg.rollout.rollout_dtype == "float32"  # CPU: exact tests


def test_rm_type_must_be_a_builtin(argv: list[str]) -> None:
    one_line_naming(argv + ["--rm-type", "fancy"], "--rm-type", "fancy", "math")


@pytest.mark.parametrize("flag,owned", [("--sglang-api-key", "--api-key"), ("--sglang-port", "--port"),
                                        ("--sglang-model", "--model"), ("--sglang-tp", "--tp-size"),
                                        ("--sglang-nccl-init", "--nccl-init-addr")])
def test_sglang_flags_rlslurm_owns_are_refused(argv: list[str], flag: str, owned: str) -> None:
    if flag in ("--sglang-tp", "--sglang-nccl-init"):
        # an abbreviation SGLang's argparse expands: judged by the flag it resolves to, which only the
        # installed SGLang's parser knows
        pytest.importorskip("sglang")
    one_line_naming(argv + [flag, "x"], flag, f"rlslurm sets {owned}")


def test_unknown_sglang_flag_is_refused_with_a_suggestion(argv: list[str]) -> None:
    pytest.importorskip("sglang")
    one_line_naming(argv + ["--sglang-mem-fraction-statc", "0.7"], "--sglang-mem-fraction-statc",
                     "did you mean --sglang-mem-fraction-static")
    resolve(argv + ["--sglang-mem-fraction-static", "0.7", "--sglang-disable-radix-cache"])


def test_sglang_flag_list_is_kept_per_installed_sglang(tmp_path: Path, monkeypatch) -> None:
    """The probe imports SGLang (~12 CPU-s a process: every `rlslurm submit`/`import-slime` with
    --sglang-* flags paid it): its parser table is kept in the user's cache directory, under a name that changes
    with the SGLang it came from; an unreadable cache file is probed again, never an error."""
    import importlib.machinery
    import os

    from rlslurm.engines import sglang_flags

    pkg = tmp_path / "site" / "sglang"  # an SGLang of this test's own, to change its parser's files
    (pkg / "srt" / "arg_groups").mkdir(parents=True)
    (pkg / "srt" / "server_args.py").write_text("# v1\n")
    (pkg / "srt" / "arg_groups" / "parallel_hook.py").write_text("# v1\n")
    spec = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
    spec.submodule_search_locations = [str(pkg)]
    monkeypatch.setattr(sglang_flags.importlib.util, "find_spec", lambda name: spec if name == "sglang" else None)
    monkeypatch.setattr("importlib.metadata.version", lambda name: "0.5.23")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    probes = []
    table = {"--port": ["port", None, None, "one"], "--tp-size": ["tp_size", None, None, "one"]}
    monkeypatch.setattr(sglang_flags, "_probe", lambda: probes.append(1) or dict(table))

    def flags() -> frozenset[str]:
        sglang_flags.sglang_parser_table.cache_clear()  # a new process
        return sglang_flags.sglang_server_flags()

    try:
        assert flags() == {"--port", "--tp-size"} and len(probes) == 1
        [kept] = (tmp_path / "cache" / "rlslurm").iterdir()
        assert kept.name.startswith("sglang-parser-0.5.23-") and kept.suffix == ".json"
        assert flags() == {"--port", "--tp-size"} and len(probes) == 1  # from the file, SGLang not imported
        kept.write_text('{"format": 1, "options": {"--port": ')  # cut short
        assert flags() == {"--port", "--tp-size"} and len(probes) == 2
        assert flags() == {"--port", "--tp-size"} and len(probes) == 2  # written whole again
        for f in (pkg / "srt" / "server_args.py", pkg / "srt" / "arg_groups" / "parallel_hook.py"):
            os.utime(f, ns=(1, f.stat().st_mtime_ns + 10**9))  # this SGLang's parser changed: probed again
            assert flags() == {"--port", "--tp-size"} and len(probes) == 3 + (f.name == "parallel_hook.py")
        assert len(list((tmp_path / "cache" / "rlslurm").iterdir())) == 3
        (tmp_path / "a-file").write_text("")  # a cache directory that cannot be made: still the probe's list
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a-file"))
        assert flags() == {"--port", "--tp-size"} and len(probes) == 5
        assert flags() == {"--port", "--tp-size"} and len(probes) == 6
    finally:
        sglang_flags.sglang_parser_table.cache_clear()


def test_router_flags_are_checked_before_submit(argv: list[str]) -> None:
    """--router-<flag>: one rlslurm sets is refused; an unknown one names the flag and the close match."""
    pytest.importorskip("sglang_router")
    one_line_naming(argv + ["--router-port", "9"], "--router-port", "rlslurm sets --port")
    one_line_naming(argv + ["--router-worker-urls", "http://x"], "--router-worker-urls", "rlslurm sets --worker-urls")
    one_line_naming(argv + ["--router-polcy", "cache_aware"], "--router-polcy", "did you mean --router-policy")
    assert resolve(argv + ["--router-policy", "cache_aware"]).cfg.router_args == ["--policy", "cache_aware"]


def test_unknown_megatron_field_is_refused(argv: list[str]) -> None:
    pytest.importorskip("megatron.core")
    one_line_naming(argv + ["--megatron-recompute-granularty", "full"], "--megatron-recompute-granularty",
                     "did you mean --megatron-recompute-granularity")
    resolve(argv + ["--megatron-recompute-granularity", "full", "--megatron-apply-wd-to-qk-layernorm", "true"])


def test_megatron_fields_read_from_source_are_the_dataclass_fields() -> None:
    """The submit host reads the field names from megatron-core's source (importing it takes seconds)."""
    pytest.importorskip("megatron.core")
    import dataclasses

    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    from rlslurm.preflight import megatron_fields

    opt = {f.name for f in dataclasses.fields(OptimizerConfig)}
    assert megatron_fields(mla=False) == {f.name for f in dataclasses.fields(TransformerConfig)} | opt
    assert megatron_fields(mla=True) == {f.name for f in dataclasses.fields(MLATransformerConfig)} | opt


def test_context_parallel_is_accepted_at_submit(argv: list[str]) -> None:
    """CP 2 resolves (docs/context-parallel.md); world = TP x PP x CP x DP is checked, and a CP
    communication scheme rlslurm's attention does not do is refused in one line."""
    cpu = ["--device", "cpu", "--engines-per-node", "1", "--gpus-per-node", "0"]
    res = resolve(argv + ["--context-parallel-size", "2", *cpu, "--trainer-procs-per-node", "2"])
    assert res.cfg.train.context_parallel_size == 2
    one_line_naming(argv + ["--context-parallel-size", "2", *cpu, "--trainer-procs-per-node", "3"],
                    "--context-parallel-size 2", "does not divide")
    one_line_naming(argv + ["--context-parallel-size", "2", *cpu, "--trainer-procs-per-node", "2",
                            "--megatron-cp-comm-type", "p2p"], "--megatron-cp-comm-type p2p", "all-gathers")


@pytest.mark.parametrize("content", ["empty", "readme", "config_only", "other_model"])
def test_hf_checkpoint_must_be_an_hf_directory_of_the_model(argv: list[str], tmp_path: Path, content: str) -> None:
    from tests.helpers.hf_shape import hf_shaped_dir

    d = tmp_path / "hf"
    d.mkdir()
    if content == "readme":
        (d / "README.md").write_text("weights elsewhere\n")
    if content == "config_only":
        hf_shaped_dir(d, "tiny-qwen3")
        (d / "model.safetensors").unlink()
    if content == "other_model":
        hf_shaped_dir(d, "tiny-llama")
    why = {"empty": "no config.json", "readme": "no config.json", "config_only": "no *.safetensors",
           "other_model": "does not match"}[content]
    one_line_naming(argv + ["--hf-checkpoint", str(d)], "--hf-checkpoint", str(d), why)
    one_line_naming(argv + ["--ref-load", str(d)], "--ref-load", str(d), why)
    resolve(argv + ["--hf-checkpoint", str(hf_shaped_dir(tmp_path / "good", "tiny-qwen3"))])


def test_replay_buffer_must_hold_committed_rollouts(argv: list[str], tmp_path: Path) -> None:
    empty = tmp_path / "old-run"
    empty.mkdir()
    one_line_naming(argv + ["--load-debug-rollout-data", str(empty)], "--load-debug-rollout-data", str(empty),
                     "buffer")


def test_rollout_function_path_is_checked_at_submit(argv: list[str], tmp_path: Path) -> None:
    plugin = tmp_path / "rollout.py"
    plugin.write_text("async def roll(ctx):\n    pass\n"
                      "def blocking(ctx):\n    pass\n"
                      "async def two(ctx, extra):\n    pass\n")
    flag = ["--rollout-function-path", f"{plugin}:roll"]
    assert resolve(argv + flag).cfg.rollout.rollout_function_path == f"{plugin}:roll"
    one_line_naming(argv + ["--rollout-function-path", f"{plugin}:blocking"], "--rollout-function-path", "async")
    one_line_naming(argv + ["--rollout-function-path", f"{plugin}:two"], "--rollout-function-path",
                    "cannot be called with 1 positional")
    # the driver's group-loop flags do nothing with it: refused, naming both
    for extra in (["--partial-rollout"], ["--over-sampling-batch-size", "16"],
                  ["--dynamic-sampling-filter-path", "rlslurm.rollout.filters:zero_std_filter"]):
        one_line_naming(argv + flag + extra, extra[0], "--rollout-function-path")
    # a generate function is what ctx.run_group uses: allowed with it
    gen = tmp_path / "gen.py"
    gen.write_text("async def g(ctx, prompt, sampling_params):\n    pass\n")
    resolve(argv + flag + ["--custom-generate-function-path", f"{gen}:g"])


def test_fan_out_generate_function_is_checked_at_submit(argv: list[str], tmp_path: Path) -> None:
    gen = tmp_path / "gen.py"
    gen.write_text("from rlslurm.rollout.generate_api import fan_out\n"
                   "@fan_out(2)\nasync def two(ctx, prompt, sampling_params):\n    pass\n"
                   "@fan_out(3)\nasync def three(ctx, prompt, sampling_params):\n    pass\n")
    # tiny-qwen3's defaults: --n-samples-per-prompt 4
    assert resolve(argv + ["--custom-generate-function-path", f"{gen}:two"]).cfg.rollout.n_samples_per_prompt == 4
    one_line_naming(argv + ["--custom-generate-function-path", f"{gen}:three"], "--n-samples-per-prompt 4",
                    "@fan_out(3)")
    one_line_naming(argv + ["--custom-generate-function-path", f"{gen}:two", "--partial-rollout"],
                    "--partial-rollout", "--custom-generate-function-path")
    evals = tmp_path / "e.jsonl"
    evals.write_text('{"prompt": "say a", "label": "a"}\n')
    one_line_naming(argv + ["--custom-generate-function-path", f"{gen}:two", "--eval-prompt-data", "e", str(evals),
                            "--eval-interval", "1", "--n-samples-per-eval-prompt", "3"],
                    "--n-samples-per-eval-prompt", "@fan_out(2)")
