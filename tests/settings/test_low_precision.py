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
from tests.config_errors import one_line_naming
from tests.hf_shape import hf_shaped_dir


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
    assert auto_receiver("cuda", "qwen3", False) == "rlslurm" and auto_receiver("cuda", "qwen3", False, fp8=True) == "sglang"
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
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"},
     "quant_method 'compressed-tensors', format pack-quantized", "is not block-wise FP8"),
    ({**FP8, "weight_block_size": None}, "quant_method 'fp8'", "per-tensor FP8 (no weight_block_size)"),
    ({**FP8, "weight_block_size": [64, 64]}, "weight_block_size [64, 64]", "weight_block_size [64, 64]"),
    ({**FP8, "fmt": "e5m2"}, "fmt e5m2", "FP8 format 'e5m2'"),
    ({**FP8, "activation_scheme": "static"}, "activation_scheme static", "activation_scheme 'static', not 'dynamic'"),
    ({**FP8, "quant_method": "mxfp8"}, "quant_method 'mxfp8'", "is not block-wise FP8"),
])
@pytest.mark.parametrize("flag", ["--hf-checkpoint", "--ref-load"])
def test_other_quantizations_are_refused_naming_the_layout(tmp_path: Path, quant: dict, shown: str, why: str,
                                                          flag: str) -> None:
    """slime's INT4 recipes (compressed-tensors) and any FP8 layout but e4m3 128x128 blocks with dynamic
    activations: detected from config.json alone, at submit, dry run included, one line."""
    from rlslurm.resolve import resolve

    hf = _quantized(tmp_path, {k: v for k, v in quant.items() if v is not None})
    with pytest.raises(ConfigError) as e:
        resolve(["--model", "tiny-qwen3", flag, str(hf)], strict_inputs=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{flag} {hf}: config.json quantization_config ("), msg
    assert shown in msg and why in msg, msg
    assert "pass that, or the unquantized checkpoint this one was made from" in msg


def test_sglang_quantization_must_match_an_fp8_checkpoint(tmp_path: Path) -> None:
    from rlslurm.resolve import resolve

    hf = _quantized(tmp_path, FP8)
    with pytest.raises(ConfigError, match=r"^--sglang-quantization w8a8_int8: --hf-checkpoint is block-wise FP8"):
        resolve(["--model", "tiny-qwen3", "--hf-checkpoint", str(hf), "--sglang-quantization", "w8a8_int8"],
                strict_inputs=False)
