"""Low precision is refused with its reason, never dropped (issue 32 item 6): slime's FP8/FP4 training
flags and the matching --megatron-* fields (no transformer-engine); a block-wise FP8 --hf-checkpoint
is taken (the trainer dequantizes it, the sync re-quantizes), any other quantization refused naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlslurm.errors import ConfigError
from rlslurm.settings.flags import parse_flags
from rlslurm.slime_import import import_script
from tests.helpers.config_errors import one_line_naming
from tests.helpers.hf_shape import hf_shaped_dir


@pytest.mark.parametrize("flag", ["--fp8-format", "--fp8-recipe", "--fp4-format"])
def test_slime_fp8_flags_are_refused_with_the_reason(flag: str) -> None:
    with pytest.raises(ConfigError, match=rf"^unknown flag {flag} \(a slime flag rlslurm does not have: FP8/FP4 "
                                          r"training runs in transformer-engine's layers, and rlslurm's trainer has "
                                          r"no transformer-engine"):
        parse_flags([flag, "e4m3"])


@pytest.mark.parametrize("field", ["fp8", "fp8-recipe", "fp4", "fp8-param"])
def test_megatron_fp8_fields_are_refused_naming_the_flag(field: str) -> None:
    one_line_naming(["--model", "tiny-qwen3", f"--megatron-{field}", "e4m3"], f"--megatron-{field} e4m3",
                    "no transformer-engine", "docs/low-precision.md")


def test_import_names_the_fp8_flags_and_warns_the_run_is_bf16(tmp_path: Path) -> None:
    """slime's run-qwen3-30b-a3b-fp8.sh: --fp8-format was reported with a generic reason and
    --fp8-recipe went on as --megatron-fp8-recipe, so FP8 training was silently off."""
    s = tmp_path / "run.sh"
    s.write_text("python3 train.py \\\n   --bf16 \\\n   --fp8-format e4m3 \\\n   --fp8-recipe blockwise\n")
    imp = import_script(s, check=False)
    report = imp.report_lines()
    assert report[0] == (f"{s}:3: warning: the imported run does not do what this script does: FP8/FP4 training: it "
                         "trains in bf16 (docs/low-precision.md) (each not mapped below)")
    for line, flag in ((3, "--fp8-format"), (4, "--fp8-recipe")):
        assert any(ln.startswith(f"{s}:{line}: not mapped: {flag}: FP8/FP4 training runs in transformer-engine's")
                   for ln in report), flag
    assert not any("fp8" in a for a in imp.argv) and "--bf16" in imp.argv


FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _quantized(tmp_path: Path, quant: dict | None) -> Path:
    hf = hf_shaped_dir(tmp_path / "hf", "tiny-qwen3")
    cfg = json.loads((hf / "config.json").read_text())
    if quant is not None:
        cfg["quantization_config"] = quant
    (hf / "config.json").write_text(json.dumps(cfg))
    return hf


def test_a_block_fp8_checkpoint_is_taken_with_a_note_and_an_fp8_plan(tmp_path: Path) -> None:
    """Qwen3-4B-FP8's config.json: accepted at submit with one note (the trainer trains in bf16, the
    engines serve FP8); the weight-sync plan says FP8 in 128x128 blocks for both roles, the engines
    get SGLang's --quantization fp8, and --update-weight-receiver auto keeps SGLang's loader."""
    from rlslurm.resolve import resolve
    from rlslurm.rollout.node import quantization_args
    from rlslurm.settings.weight_plan import auto_receiver, weight_sync_plan

    hf = _quantized(tmp_path, FP8)
    res = resolve(["--model", "tiny-qwen3", "--hf-checkpoint", str(hf)], strict_inputs=False)
    notes = [n for n in res.notes if "FP8" in n]
    assert len(notes) == 1 and "\n" not in notes[0], res.notes
    assert notes[0].startswith(f"--hf-checkpoint {hf}: block-wise FP8 (e4m3, 128x128 blocks): the trainer "
                               "dequantizes it and trains in bf16"), notes[0]
    assert "the engines serve FP8" in notes[0]
    plan = weight_sync_plan(res.cfg)
    assert plan.fp8_block == (128, 128)
    from rlslurm.rollout.node import engine_specs

    args = engine_specs(res.cfg, node=0, host="127.0.0.1", api_key="k", log_dir=tmp_path)[0].server_args()
    assert args[args.index("--quantization") + 1] == "fp8"
    assert quantization_args(plan, ["--quantization=fp8"]) == ()
    # said in the --sglang-config YAML: not said again on the command line, which would win over it
    (tmp_path / "sgl.yaml").write_text("quantization: fp8\n")
    assert quantization_args(plan, ["--config", str(tmp_path / "sgl.yaml")]) == ()
    assert auto_receiver("cuda", "qwen3", False) == "rlslurm"
    assert auto_receiver("cuda", "qwen3", False, quantized=True) == "sglang"
    # the same directory without quantization_config: no note, a plain plan, no flag
    plain = _quantized(tmp_path / "plain", None)
    res = resolve(["--model", "tiny-qwen3", "--hf-checkpoint", str(plain)], strict_inputs=False)
    assert not [n for n in res.notes if "FP8" in n] and weight_sync_plan(res.cfg).fp8_block is None
    assert quantization_args(weight_sync_plan(res.cfg), []) == ()


def test_a_block_fp8_reference_is_taken_with_its_note(tmp_path: Path) -> None:
    from rlslurm.resolve import resolve

    hf = _quantized(tmp_path, FP8)
    res = resolve(["--model", "tiny-qwen3", "--ref-load", str(hf)], strict_inputs=False)
    assert [n for n in res.notes if n.startswith(f"--ref-load {hf}: block-wise FP8: dequantized on load")]


@pytest.mark.parametrize("quant, shown, why", [
    ({**FP8, "weight_block_size": None}, "quant_method 'fp8'", "per-tensor FP8 (no weight_block_size)"),
    ({**FP8, "weight_block_size": [64, 64]}, "weight_block_size [64, 64]", "weight_block_size [64, 64]"),
    ({**FP8, "fmt": "e5m2"}, "fmt e5m2", "FP8 format 'e5m2'"),
    ({**FP8, "activation_scheme": "static"}, "activation_scheme static", "activation_scheme 'static', not 'dynamic'"),
    ({**FP8, "quant_method": "mxfp8"}, "quant_method 'mxfp8'", "is neither block-wise FP8 nor INT4 W4A16"),
    ({"quant_method": "awq", "bits": 4}, "quant_method 'awq', bits 4", "is neither block-wise FP8 nor INT4 W4A16"),
])
@pytest.mark.parametrize("flag", ["--hf-checkpoint", "--ref-load"])
def test_other_quantizations_are_refused_naming_the_layout(tmp_path: Path, quant: dict, shown: str, why: str,
                                                          flag: str) -> None:
    """Any FP8 layout but e4m3 128x128 blocks with dynamic activations, and other methods: detected
    from config.json alone, at submit, dry run included, one line (compressed-tensors: test_int4_*)."""
    from rlslurm.resolve import resolve

    hf = _quantized(tmp_path, {k: v for k, v in quant.items() if v is not None})
    with pytest.raises(ConfigError) as e:
        resolve(["--model", "tiny-qwen3", flag, str(hf)], strict_inputs=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{flag} {hf}: config.json quantization_config ("), msg
    assert shown in msg and why in msg, msg
    assert "pass one of those, or the unquantized checkpoint this one was made from" in msg


def test_sglang_quantization_must_match_an_fp8_checkpoint(tmp_path: Path) -> None:
    from rlslurm.resolve import resolve

    hf = _quantized(tmp_path, FP8)
    with pytest.raises(ConfigError, match=r"^--sglang-quantization w8a8_int8: --hf-checkpoint is block-wise FP8"):
        resolve(["--model", "tiny-qwen3", "--hf-checkpoint", str(hf), "--sglang-quantization", "w8a8_int8"],
                strict_inputs=False)



def test_the_engine_flag_judged_is_the_one_sglang_keeps() -> None:
    """argparse keeps the last of a repeated flag, and that is the value checked: a later fp8 wins over an
    earlier other value, a later other value is refused."""
    from rlslurm.settings.low_precision import check_engine_quantization, check_int4_engine_args

    check_engine_quantization(["--quantization", "w8a8_int8", "--quantization=fp8"], fp8=True)
    with pytest.raises(ConfigError, match=r"^--sglang-quantization w8a8_int8: "):
        check_engine_quantization(["--quantization=fp8", "--quantization", "w8a8_int8"], fp8=True)
    check_int4_engine_args(["--moe-runner-backend", "triton", "--moe-runner-backend", "marlin"], "cuda")
    with pytest.raises(ConfigError, match=r"^--sglang-moe-runner-backend triton: "):
        check_int4_engine_args(["--moe-runner-backend=marlin", "--moe-runner-backend", "triton"], "cuda")

# ------------------------------------------------------------------ INT4 W4A16 compressed-tensors (slime's INT4)
INT4_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                "dynamic": False, "actorder": None}


def _int4(**over) -> dict:
    weights = {**INT4_WEIGHTS, **over.pop("weights", {})}
    group = {"targets": ["Linear"], "input_activations": None, "output_activations": None, "weights": weights,
             **over.pop("group", {})}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head", "re:.*self_attn.*"], **over}


def _int4_dir(tmp_path: Path, quant: dict, names: list[str] | None = None) -> Path:
    hf = hf_shaped_dir(tmp_path / "hf", "tiny-qwen3-moe")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["quantization_config"] = quant
    (hf / "config.json").write_text(json.dumps(cfg))
    if names is not None:  # a sharded checkpoint's index: the names, no tensor read at submit
        (hf / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    return hf


CUDA = ["--device", "cuda", "--gpus-per-node", "2"]
EXPERT_TENSORS = [f"model.layers.0.mlp.experts.0.{p}_proj.weight_{s}" for p in ("gate", "up", "down")
                  for s in ("packed", "scale", "shape")] + ["model.layers.0.self_attn.q_proj.weight"]


def test_an_int4_w4a16_checkpoint_is_taken_with_a_note_and_an_int4_plan(tmp_path: Path) -> None:
    """slime's run-qwen3-30B-A3B-int4.sh checkpoint (llm-compressor's W4A16, experts only): accepted at
    submit with one note; the plan says INT4 in groups of 32 for both roles, the engines get SGLang's
    Marlin MoE pinned, --update-weight-receiver auto keeps SGLang's loader. Before: refused as 'not
    block-wise FP8'."""
    from rlslurm.resolve import resolve
    from rlslurm.rollout.node import engine_specs, quantization_args
    from rlslurm.settings.weight_plan import weight_sync_plan

    hf = _int4_dir(tmp_path, _int4(), EXPERT_TENSORS)
    argv = ["--model", "tiny-qwen3-moe", "--hf-checkpoint", str(hf), "--device", "cuda", "--gpus-per-node", "2"]
    res = resolve(argv, strict_inputs=False)
    notes = [n for n in res.notes if "INT4" in n]
    assert len(notes) == 1 and "\n" not in notes[0], res.notes
    assert notes[0].startswith(f"--hf-checkpoint {hf}: INT4 W4A16 compressed-tensors (group size 32): the trainer "
                               "dequantizes it and trains in bf16"), notes[0]
    assert "SGLang 0.5.23" in notes[0] and "fake-QAT is not done" in notes[0]
    plan = weight_sync_plan(res.cfg)
    assert plan.int4_group == 32 and plan.fp8_block is None and plan.quantized
    assert res.cfg.train.update_weight_receiver == "sglang"
    args = engine_specs(res.cfg, node=0, host="127.0.0.1", api_key="k", log_dir=tmp_path)[0].server_args()
    assert args[args.index("--moe-runner-backend") + 1] == "marlin" and "--quantization" not in args
    assert quantization_args(plan, ["--moe-runner-backend", "marlin"]) == ()


def test_an_int4_reference_is_taken_with_its_note(tmp_path: Path) -> None:
    from rlslurm.resolve import resolve

    hf = _int4_dir(tmp_path, _int4())
    res = resolve(["--model", "tiny-qwen3-moe", "--ref-load", str(hf)], strict_inputs=False)
    assert [n for n in res.notes if n.startswith(f"--ref-load {hf}: INT4 W4A16: dequantized on load")]


@pytest.mark.parametrize("over, field", [
    ({"format": "naive-quantized"}, "format 'naive-quantized'"),
    ({"weights": {"num_bits": 8}}, "config_groups.group_0.weights.num_bits 8"),
    ({"weights": {"symmetric": False}}, "config_groups.group_0.weights.symmetric False"),
    ({"weights": {"strategy": "channel"}}, "config_groups.group_0.weights.strategy 'channel'"),
    ({"weights": {"type": "float"}}, "config_groups.group_0.weights.type 'float'"),
    ({"weights": {"dynamic": True}}, "config_groups.group_0.weights.dynamic True"),
    ({"weights": {"actorder": "group"}}, "config_groups.group_0.weights.actorder 'group'"),
    ({"weights": {"group_size": None}}, "config_groups.group_0.weights.group_size None"),
    ({"group": {"input_activations": {"num_bits": 8, "type": "float"}}}, "config_groups.group_0.input_activations"),
    ({"kv_cache_scheme": {"num_bits": 8}}, "kv_cache_scheme"),
    ({"quantization_status": "frozen"}, "quantization_status 'frozen'"),
])
@pytest.mark.parametrize("flag", ["--hf-checkpoint", "--ref-load"])
def test_other_compressed_tensors_schemes_are_refused_naming_the_field(tmp_path: Path, over: dict, field: str,
                                                                      flag: str) -> None:
    from rlslurm.resolve import resolve

    hf = _int4_dir(tmp_path, _int4(**over))
    with pytest.raises(ConfigError) as e:
        resolve(["--model", "tiny-qwen3-moe", flag, str(hf)], strict_inputs=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{flag} {hf}: config.json quantization_config (quant_method "
                                              f"'compressed-tensors'): {field}"), msg
    assert "rlslurm takes compressed-tensors only as INT4 W4A16" in msg and "docs/low-precision.md" in msg


def test_two_config_groups_and_a_group_size_not_dividing_the_experts_are_refused(tmp_path: Path) -> None:
    from rlslurm.settings.low_precision import int4_scheme

    q = _int4()
    q["config_groups"]["group_1"] = q["config_groups"]["group_0"]
    with pytest.raises(ConfigError, match=r"config_groups \['group_0', 'group_1'\]"):
        int4_scheme(_int4_dir(tmp_path / "a", q))
    # tiny-qwen3-moe: hidden_size 64, moe_intermediate_size 32
    with pytest.raises(ConfigError, match=r"group_size 64 does not divide moe_intermediate_size 32, an input dim "
                                          r"of the INT4 experts"):
        int4_scheme(_int4_dir(tmp_path / "b", _int4(weights={"group_size": 64})))


def test_int4_outside_the_routed_experts_is_refused_at_submit(tmp_path: Path) -> None:
    """SGLang's linear W4A16 layer cannot take a weight update (docs/low-precision.md): a checkpoint
    whose attention is INT4 (llm-compressor's W4A16 without slime's ignore list) is refused, naming it."""
    from rlslurm.resolve import resolve

    names = EXPERT_TENSORS + [f"model.layers.0.self_attn.q_proj.weight_{s}" for s in ("packed", "scale", "shape")]
    hf = _int4_dir(tmp_path, _int4(), [n for n in names if n != "model.layers.0.self_attn.q_proj.weight"])
    with pytest.raises(ConfigError) as e:
        resolve(["--model", "tiny-qwen3-moe", "--hf-checkpoint", str(hf), *CUDA], strict_inputs=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"--hf-checkpoint {hf}: INT4 W4A16 compressed-tensors: "
                                              "model.layers.0.self_attn.q_proj.weight_packed (1 such) is an INT4 "
                                              "layer outside the routed experts"), msg
    assert "SGLang cannot load a weight update into its INT4 linear layers" in msg
    no_scale = [n for n in EXPERT_TENSORS if not n.endswith("up_proj.weight_scale")]
    hf2 = _int4_dir(tmp_path / "noscale", _int4(), no_scale)
    with pytest.raises(ConfigError, match=r"up_proj.weight_packed has no model.layers.0.mlp.experts.0.up_proj"
                                          r".weight_scale beside it"):
        resolve(["--model", "tiny-qwen3-moe", "--hf-checkpoint", str(hf2), *CUDA], strict_inputs=False)


@pytest.mark.parametrize("extra, why", [
    (["--sglang-moe-runner-backend", "triton"], "--sglang-moe-runner-backend triton: --hf-checkpoint is INT4 W4A16, "
                                                "and SGLang can reload INT4 experts only in their Marlin form"),
    (["--sglang-quantization", "fp8"], "--sglang-quantization fp8: --hf-checkpoint is INT4 W4A16 compressed-tensors"),
])
def test_int4_engine_flags_that_cannot_reload_are_refused(tmp_path: Path, extra: list[str], why: str) -> None:
    from rlslurm.resolve import resolve

    hf = _int4_dir(tmp_path, _int4())
    with pytest.raises(ConfigError) as e:
        resolve(["--model", "tiny-qwen3-moe", "--hf-checkpoint", str(hf), *CUDA, *extra],
                strict_inputs=False)
    assert str(e.value).startswith(why) and "\n" not in str(e.value), str(e.value)


def test_int4_on_cpu_engines_is_refused(tmp_path: Path) -> None:
    from rlslurm.resolve import resolve

    hf = _int4_dir(tmp_path, _int4())
    with pytest.raises(ConfigError, match=r"^--hf-checkpoint is INT4 W4A16: SGLang serves it with CUDA Marlin "
                                          r"kernels, and the rollout device is cpu"):
        resolve(["--model", "tiny-qwen3-moe", "--hf-checkpoint", str(hf)], strict_inputs=False)


def test_an_int4_engine_needs_sglangs_weight_update_session(tmp_path: Path) -> None:
    """SGLang 0.5.14 (the GPU machines' version) loads a sync into Marlin-repacked INT4 parameters and
    never repacks (docs/low-precision.md): its engine is refused at start, one line; 0.5.23 starts."""
    from rlslurm.settings.low_precision import check_int4_engine

    hf = _int4_dir(tmp_path, _int4())
    check_int4_engine(hf, True, "0.5.23")
    with pytest.raises(ConfigError) as e:
        check_int4_engine(hf, False, "0.5.14")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{hf}: INT4 W4A16 compressed-tensors, and SGLang 0.5.14 cannot load "
                                              "a weight update into INT4 layers"), msg
    assert "install SGLang 0.5.23 (no supported GPU stack has it yet: --allow-untested-stack" in msg
    check_int4_engine(_quantized(tmp_path / "plain", None), False, "0.5.14")  # unquantized: nothing to say


def test_import_reports_slimes_int4_fake_qat_as_not_mapped(tmp_path: Path) -> None:
    """slime's INT4 scripts turn fake-QAT on in ray's runtime env JSON, which the flag mapping never saw:
    one `not mapped` line now, naming the variables (rlslurm trains plain bf16)."""
    s = tmp_path / "run.sh"
    s.write_text('RUNTIME_ENV_JSON="{\n  \\"env_vars\\": {\n    \\"OPEN_TRAINING_INT4_FAKE_QAT_FLAG\\": \\"1\\",\n'
                 '    \\"OPEN_TRAINING_INT4_GROUP_SIZE\\": \\"128\\"\n  }\n}"\n'
                 'ray job submit --runtime-env-json="${RUNTIME_ENV_JSON}" -- python3 train.py \\\n   --bf16\n')
    report = import_script(s, check=False).report_lines()
    hits = [ln for ln in report if "OPEN_TRAINING_INT4_FAKE_QAT_FLAG" in ln]
    assert hits == [f"{s}:3: not mapped: OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1, OPEN_TRAINING_INT4_GROUP_SIZE=128 (ray "
                    "runtime env): slime's INT4 fake quantization-aware training; rlslurm trains plain bf16 and "
                    "quantizes to INT4 only when it syncs the weights to the engines (docs/low-precision.md)"], report
    off = tmp_path / "off.sh"
    off.write_text(s.read_text().replace('FAKE_QAT_FLAG\\": \\"1', 'FAKE_QAT_FLAG\\": \\"0'))
    # off: not the fake-QAT line, but the variable is still named as not carried (nothing goes unsaid)
    assert [ln for ln in import_script(off, check=False).report_lines() if "FAKE_QAT" in ln] == [
        f"{off}:3: not mapped: OPEN_TRAINING_INT4_FAKE_QAT_FLAG (--runtime-env-json): slime's INT4 fake-QAT switch, "
        "off in this script; rlslurm has no fake-QAT (docs/low-precision.md)"]
