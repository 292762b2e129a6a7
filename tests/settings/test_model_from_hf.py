"""The model config from --hf-checkpoint's config.json (issue 32 item 1): every family rlslurm maps,
no silent default model, and import-slime's `source scripts/models/X.sh` without a shipped YAML."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlslurm.errors import ConfigError
from rlslurm.models.model_from_hf import model_config_from_hf
from rlslurm.resolve import resolve
from rlslurm.settings.model_config import available_models, load_model_config
from rlslurm.slime_import import import_script
from rlslurm.tiny import hf_config_dict
from tests.helpers.hf_shape import hf_shaped_dir


@pytest.mark.parametrize("name", available_models())
def test_every_shipped_model_is_rebuilt_from_its_config_json(tmp_path: Path, name: str) -> None:
    """The shipped YAMLs cover qwen2, qwen3, qwen3_moe, llama, glm4, glm4_moe and deepseek_v3 (MLA, MoE,
    YaRN): their config.json must give back the same architecture."""
    mc = load_model_config(name)
    hf = tmp_path / name
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(hf_config_dict(mc)))
    got = model_config_from_hf(hf)
    assert (got.arch, got.hf_model_type, got.hf_architecture) == (mc.arch, mc.hf_model_type, mc.hf_architecture)
    assert got.name == name and got.defaults == {}


def test_without_model_the_run_takes_the_checkpoints_architecture(tmp_path: Path) -> None:
    """A shipped architecture runs with that config's per-node defaults (qwen3-4B at 4 nodes: 64 x 8
    prompts); another one (here qwen3-4B with 40 layers, as no shipped config has) with the flags'."""
    hf = hf_shaped_dir(tmp_path / "Qwen3-4B", "qwen3-4B")
    res = resolve(["--hf-checkpoint", str(hf), "--nodes", "4"], strict_inputs=False)
    assert res.cfg.model.model is None and res.model == load_model_config("qwen3-4B")
    assert (res.cfg.rollout.rollout_batch_size, res.cfg.train.tensor_model_parallel_size) == (64, 2)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 40}))
    res = resolve(["--hf-checkpoint", str(hf), "--nodes", "4", "--rollout-batch-size", "16"], strict_inputs=False)
    assert res.model.name == "Qwen3-4B" and res.model.arch.num_layers == 40 and res.model.defaults == {}
    assert res.model.arch.hidden_size == 2560


@pytest.mark.parametrize("model", [["--model", "glm4-9B"], []])
def test_a_hub_id_for_hf_checkpoint_says_how_to_download_it(tmp_path: Path, monkeypatch, model: list[str]) -> None:
    """slime's scripts and model cards name models by Hub id; the nodes read local files only. The error
    said only "does not exist" (with --model) or "no config.json here" (without)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"prompt": "p", "label": "l"}\n')
    with pytest.raises(ConfigError) as e:
        resolve([*model, "--nodes", "4", "--prompt-data", "train.jsonl", "--hf-checkpoint", "THUDM/GLM-4-9B-0414"])
    assert str(e.value).startswith(f"--hf-checkpoint {tmp_path}/THUDM/GLM-4-9B-0414 does not exist; ")
    assert ("hf download THUDM/GLM-4-9B-0414 --local-dir models/GLM-4-9B-0414, then --hf-checkpoint "
            "models/GLM-4-9B-0414") in str(e.value)


@pytest.mark.parametrize("argv, names", [
    ([], ("no model", "--model", "--hf-checkpoint")),
    (["--hf-checkpoint", "/nowhere/Qwen3-14B"], ("--hf-checkpoint /nowhere/Qwen3-14B: no config.json here",
                                                 "pass --model")),
])
def test_a_run_whose_model_is_unknown_is_refused_naming_the_flags(argv: list[str], names: tuple[str, ...]) -> None:
    """No silent tiny-qwen3: before, these resolved to the default test model and refused later with
    batch-identity errors that never named the model."""
    with pytest.raises(ConfigError) as e:
        resolve(argv, strict_inputs=False)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in names), msg


def test_an_unmapped_family_is_refused_naming_model_type(tmp_path: Path) -> None:
    hf = hf_shaped_dir(tmp_path / "hf", "tiny-qwen3")
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match=r"config.json model_type 'gpt2' has no rlslurm mapping \(supported: .*"
                                          r"deepseek_v3.*\); pass --model"):
        resolve(["--hf-checkpoint", str(hf)], strict_inputs=False)


@pytest.mark.parametrize("content,says", [(b'{"model_type": "qwen3", "name": "\xff\xfe"}', "not UTF-8 text"),
                                         (b"[1, 2]", "a JSON list, not an object")])
def test_a_config_json_that_is_not_a_json_object_is_one_line(tmp_path: Path, content: bytes, says: str) -> None:
    """A non-UTF-8 config.json was a UnicodeDecodeError traceback at submit."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_bytes(content)
    with pytest.raises(ConfigError) as e:
        resolve(["--hf-checkpoint", str(hf)], strict_inputs=False)
    assert "\n" not in str(e.value) and f"{hf}/config.json: {says}" in str(e.value)


def test_import_maps_an_unshipped_model_script_to_the_checkpoint(tmp_path: Path) -> None:
    s = tmp_path / "run.sh"
    s.write_text('source "scripts/models/qwen3-14B.sh"\npython3 train.py ${MODEL_ARGS[@]} --hf-checkpoint /m/Q\n')
    imp = import_script(s, check=False)
    assert imp.model is None and "--model" not in imp.argv
    report = "\n".join(imp.report_lines())
    assert f"{s}:1: note: source qwen3-14B.sh: rlslurm ships no model config 'qwen3-14B', so the model config is " \
           "built from --hf-checkpoint's config.json at submit" in report
    assert "not mapped: source" not in report


def test_what_qwen3_next_gated_delta_nets_cannot_do_is_refused_at_submit(prompts: Path) -> None:
    """Packed sequences are refused before anything is submitted, in one line, as the trainer would refuse
    them on its node; context parallelism is accepted (rlslurm's, models/gated_delta.py)."""
    argv = ["--model", "tiny-qwen3-next", "--prompt-data", str(prompts)]
    resolve(argv, strict_inputs=False)  # the layout of its defaults is fine
    resolve(argv + ["--context-parallel-size", "2", "--trainer-procs-per-node", "2"], strict_inputs=False)
    with pytest.raises(ConfigError) as e:
        resolve(argv + ["--qkv-format", "thd"], strict_inputs=False)
    says = "--qkv-format thd: tiny-qwen3-next's gated delta net layers take no packed sequences"
    assert "\n" not in str(e.value) and says in str(e.value), str(e.value)


@pytest.mark.parametrize("extra, refusal", [
    (["--qkv-format", "thd"], "--qkv-format thd: tiny-glm-moe-dsa's sparse attention (megatron-core's DSA) takes "
                              "no packed sequences"),
    (["--megatron-dsa-indexer-loss-coeff", "0.1"], "--megatron-dsa-indexer-loss-coeff 0.1: rlslurm does not train"),
    (["--megatron-recompute-granularity", "selective"], "--megatron-recompute-granularity selective: megatron-core "
                                                        "0.16's MLA recomputes core_attn without"),
    # GLM-5.2's shared layer 2 (tiny-glm-moe-dsa) would start the second stage
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2"],
     "--pipeline-model-parallel-size 2: the stage starting at layer 2 of tiny-glm-moe-dsa starts with a shared"),
])
def test_glm5_layouts_its_sparse_attention_cannot_take_are_refused_at_submit(extra: list[str], refusal: str) -> None:
    """GLM-5 (glm_moe_dsa): refused by submit in one line naming the flag, not by the trainer at start-up
    (rlslurm/settings/sparse_attention.py; the trainer checks again, tests/convert/test_model_build.py)."""
    base = ["--model", "tiny-glm-moe-dsa", "--nodes", "2"]
    resolve(base, strict_inputs=False)
    resolve(base + ["--context-parallel-size", "2"], strict_inputs=False)  # rlslurm's DSA attention takes CP
    with pytest.raises(ConfigError) as e:
        resolve(base + extra, strict_inputs=False)
    assert str(e.value).startswith(refusal) and "\n" not in str(e.value), str(e.value)
