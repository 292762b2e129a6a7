"""Low precision is refused with its reason, never dropped (issue 32 item 6): slime's FP8/FP4 training
flags and the matching --megatron-* fields (no transformer-engine), and a quantized --hf-checkpoint
(config.json quantization_config), which rlslurm's loader and weight sync cannot take."""

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


@pytest.mark.parametrize("quant, shown", [
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}, "quant_method 'fp8', fmt e4m3"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "quant_method 'compressed-tensors', format "
                                                                          "pack-quantized"),
])
@pytest.mark.parametrize("flag", ["--hf-checkpoint", "--ref-load"])
def test_a_quantized_checkpoint_is_refused_naming_the_method(tmp_path: Path, quant: dict, shown: str,
                                                              flag: str) -> None:
    """Qwen3-4B-FP8's config.json (quant_method fp8, e4m3, 128x128 blocks) and an INT4
    compressed-tensors one: detected from config.json alone, at submit, dry run included."""
    hf = hf_shaped_dir(tmp_path / "hf", "tiny-qwen3")
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    from rlslurm.resolve import resolve

    with pytest.raises(ConfigError) as e:
        resolve(["--model", "tiny-qwen3", flag, str(hf)], strict_inputs=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{flag} {hf}: a quantized checkpoint (config.json "
                                              f"quantization_config: {shown})"), msg
    assert "pass the unquantized checkpoint" in msg
    # the same directory without quantization_config passes
    (hf / "config.json").write_text(json.dumps(cfg))
    resolve(["--model", "tiny-qwen3", flag, str(hf)], strict_inputs=False)
