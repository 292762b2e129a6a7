"""Released config.json files as the releases have them (tests/fixtures/release_configs, sources in its
README): each is read as its family by `model_config_from_hf`, agrees with the shipped model config of
the same checkpoint where rlslurm ships one, and `rlslurm submit --dry-run` takes it as --hf-checkpoint
with nothing else but a prompt file. Kimi-K2's `model_type: kimi_k2` (with auto_map custom code) is read
as DeepSeek-V3, the architecture SGLang and slime serve it as, without its code being run."""

from __future__ import annotations

import builtins
import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from rlslurm.errors import ConfigError
from rlslurm.models.hf_config import check_hf_config
from rlslurm.models.model_from_hf import model_config_from_hf, shipped_match
from rlslurm.settings.model_config import load_model_config

RELEASES = Path(__file__).resolve().parents[1] / "fixtures" / "release_configs"
# release directory -> the family (HF model_type) rlslurm maps it as
FAMILY = {
    "Qwen3-1.7B": "qwen3", "Qwen3-8B": "qwen3", "Qwen3-32B": "qwen3", "Qwen3-30B-A3B": "qwen3_moe",
    "Qwen3-30B-A3B-FP8": "qwen3_moe", "Qwen3-235B-A22B": "qwen3_moe", "Qwen3.5-27B": "qwen3_5",
    "Qwen3.5-35B-A3B": "qwen3_5_moe", "DeepSeek-V3": "deepseek_v3", "DeepSeek-R1": "deepseek_v3",
    "Kimi-K2-Instruct": "deepseek_v3", "MiMo-7B-Base": "mimo", "MiniMax-M2.5": "minimax_m2",
    "GLM-5": "glm_moe_dsa", "GLM-5.2": "glm_moe_dsa", "GLM-5.2-FP8": "glm_moe_dsa", "Meta-Llama-3.1-8B": "llama",
    "Qwen3-235B-A22B-FP8": "qwen3_moe",
}
# release directory -> the shipped model config of that very checkpoint
SHIPPED = {"Qwen3-1.7B": "qwen3-1.7B", "Qwen3-8B": "qwen3-8B", "Qwen3-30B-A3B": "qwen3-30B-A3B",
           "Qwen3-30B-A3B-FP8": "qwen3-30B-A3B", "DeepSeek-V3": "deepseek-v3", "DeepSeek-R1": "deepseek-v3"}


def test_the_fixture_directory_is_the_table() -> None:
    dirs = sorted(p.name for p in RELEASES.iterdir() if p.is_dir())
    assert dirs == sorted(FAMILY)
    readme = (RELEASES / "README.md").read_text()
    for name in dirs:  # every file has its source named
        assert f"| {name} |" in readme, name


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_release_is_read_as_its_family(name: str, monkeypatch) -> None:
    monkeypatch.setattr(builtins, "input", lambda *a: pytest.fail("asked on stdin to run custom code"))
    mc = model_config_from_hf(RELEASES / name)
    assert mc.hf_model_type == FAMILY[name]
    assert check_hf_config(mc, RELEASES / name) is not None  # the trainer's start-up check agrees
    if name in SHIPPED:
        shipped = load_model_config(SHIPPED[name])
        check_hf_config(shipped, RELEASES / name)  # raises naming the field where they differ
        assert shipped_match(mc).name == SHIPPED[name]


def test_kimi_k2_is_deepseek_v3_and_its_custom_code_is_not_run(tmp_path: Path, monkeypatch) -> None:
    raw = json.loads((RELEASES / "Kimi-K2-Instruct" / "config.json").read_text())
    assert raw["model_type"] == "kimi_k2" and "AutoConfig" in raw["auto_map"]
    hf = tmp_path / "Kimi-K2-Instruct"
    hf.mkdir()
    shutil.copy(RELEASES / "Kimi-K2-Instruct" / "config.json", hf)
    # the custom code it names, made to fail loudly if anything imported it
    (hf / "configuration_deepseek.py").write_text("raise RuntimeError('custom code was run')\n")
    monkeypatch.setattr(builtins, "input", lambda *a: pytest.fail("asked on stdin to run custom code"))
    mc = model_config_from_hf(hf)
    a = mc.arch
    assert (mc.hf_model_type, mc.hf_architecture) == ("deepseek_v3", "DeepseekV3ForCausalLM")
    assert (a.num_layers, a.hidden_size, a.num_attention_heads, a.vocab_size) == (61, 7168, 64, 163840)
    assert (a.moe.num_experts, a.moe.router_topk, a.moe.first_k_dense, a.moe.router_scaling_factor) == (
        384, 8, 1, 2.827)
    assert a.mla.q_lora_rank == 1536 and a.rope_scaling.type == "yarn" and a.rope_scaling.factor == 32.0


def test_an_unknown_type_with_custom_code_is_one_line_not_a_prompt(tmp_path: Path, monkeypatch) -> None:
    """A model_type neither transformers nor the alias table knows, with auto_map: refused in one line
    naming the file, never a question on stdin (a submit in a batch script would hang on it)."""
    raw = json.loads((RELEASES / "Kimi-K2-Instruct" / "config.json").read_text())
    hf = tmp_path / "m"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({**raw, "model_type": "kimi_k9"}))
    monkeypatch.setattr(builtins, "input", lambda *a: pytest.fail("asked on stdin to run custom code"))
    with pytest.raises(ConfigError, match=r"config\.json: transformers cannot read it") as e:
        model_config_from_hf(hf)
    assert str(e.value).startswith(f"--hf-checkpoint {hf}: ")


@pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                    reason="submit checks the rollout stack: SGLang is not installed here (the mcore019 environment)")
def test_every_release_dry_runs(tmp_path: Path) -> None:
    """`rlslurm submit --dry-run --hf-checkpoint DIR --prompt-data FILE`, the defaults otherwise (DIR:
    the release's config.json beside an empty weights file, which a dry run does not read)."""
    from rlslurm.resolve import resolve
    from rlslurm.slurm.render import render

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1 + 1 = ?", "label": "2"}\n' * 64)
    refused = {}
    for name in sorted(FAMILY):
        hf = tmp_path / "hf" / name
        hf.mkdir(parents=True)
        shutil.copy(RELEASES / name / "config.json", hf)
        (hf / "model.safetensors").write_bytes(b"")
        try:
            res = resolve(["--hf-checkpoint", str(hf), "--prompt-data", str(prompts),
                           "--run-dir", str(tmp_path / "runs" / name)], strict_inputs=False)
            assert "#SBATCH" in render(res.cfg, res.cfg.run_dir)
            assert res.model.hf_model_type == FAMILY[name]
        except ConfigError as e:
            refused[name] = str(e)
    assert refused == {}


def test_the_written_dicts_give_the_releases_model(tmp_path: Path) -> None:
    """tests/helpers/released_configs.py's dicts (fields public fixtures pin, not release files) give the same
    model config as the release files of the same architecture."""
    from tests.helpers import released_configs as written

    for name, cfg in (("Qwen3.5-27B", written.QWEN3_5_27B), ("Qwen3.5-35B-A3B", written.QWEN3_5_35B_A3B),
                      ("GLM-5", written.GLM5), ("MiMo-7B-Base", written.MIMO_7B),
                      ("MiniMax-M2.5", written.MINIMAX_M2)):
        hf = tmp_path / name
        hf.mkdir()
        (hf / "config.json").write_text(json.dumps(cfg))
        assert model_config_from_hf(hf).arch == model_config_from_hf(RELEASES / name).arch, name
