"""--transformer-impl (issue 48 item 4): local by default, transformer_engine only when asked for, and refused
at submit in one line where it cannot run: --device cpu, transformer-engine missing or outside the range the
installed megatron-core declares, GLM-5's sparse attention. The trainer's side: tests/convert/test_model_build.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlslurm.resolve import resolve
from rlslurm.settings.flags import build_config, parse_flags
from rlslurm.settings.transformer_impl import megatron_te_requirement
from rlslurm.slime_import import import_script
from tests.helpers.config_errors import one_line_naming
from tests.helpers.transformer_engine_stub import fake_transformer_engine

TE_FLAG = ["--transformer-impl", "transformer_engine"]
CUDA = ["--device", "cuda", "--gpus-per-node", "4"]


def test_the_default_is_local(argv: list[str]) -> None:
    assert resolve(argv).cfg.train.transformer_impl == "local"


def test_cpu_is_refused(argv: list[str]) -> None:
    one_line_naming([*argv, *TE_FLAG, "--device", "cpu"], "--transformer-impl transformer_engine with --device cpu",
                    "no CPU kernels", "--transformer-impl local")


def test_missing_transformer_engine_is_refused_where_the_job_runs_this_environment(argv: list[str]) -> None:
    pytest.importorskip("megatron.core")
    if __import__("importlib").util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer-engine is installed here")
    one_line_naming([*argv, *TE_FLAG, *CUDA], "--transformer-impl transformer_engine",
                    "transformer-engine is not installed in this Python environment")


def test_another_environment_is_a_warning(argv: list[str], tmp_path: Path) -> None:
    other = tmp_path / "python"
    other.write_text("")
    res = resolve([*argv, *TE_FLAG, *CUDA, "--python", str(other)])
    assert res.cfg.train.transformer_impl == "transformer_engine"
    assert any(w.startswith("--transformer-impl transformer_engine: transformer-engine not checked here")
               for w in res.warnings), res.warnings


def test_a_version_outside_megatron_cores_range_is_refused(argv: list[str], tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    req = megatron_te_requirement()
    if req is None or not req[1]:
        pytest.skip(f"the installed megatron-core declares no transformer-engine range ({req})")
    assert req == ("0.16.1", "<2.12.0,>=2.9.0a0")  # the CPU stack's (constraints/cpu.txt)
    monkeypatch.syspath_prepend(str(fake_transformer_engine(tmp_path / "te", "2.13.0")))
    one_line_naming([*argv, *TE_FLAG, *CUDA],
                    "--transformer-impl transformer_engine: transformer-engine 2.13.0 is outside what megatron-core "
                    "0.16.1 supports (transformer-engine<2.12.0,>=2.9.0a0)")


def test_glm5_sparse_attention_is_refused_with_transformer_engine(argv: list[str]) -> None:
    model = argv.index("--model") + 1
    glm5 = [*argv[:model], "tiny-glm-moe-dsa", *argv[model + 1:]]
    one_line_naming([*glm5, *TE_FLAG, *CUDA], "--transformer-impl transformer_engine",
                    "tiny-glm-moe-dsa's sparse attention", "linear_q_up_proj")


def test_megatron_passthrough_of_the_field_names_the_flag(argv: list[str]) -> None:
    one_line_naming([*argv, "--megatron-transformer-impl", "transformer_engine"],
                    "--megatron-transformer-impl", "use --transformer-impl")


@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_slimes_flag_is_carried_as_written(tmp_path: Path, impl: str) -> None:
    """slime scripts pass Megatron-LM's --transformer-impl (most: transformer_engine); the import used to leave
    it out, so an imported run took transformer-engine's spec whenever it was importable."""
    s = tmp_path / "run.sh"
    s.write_text(f"python3 train.py \\\n   --bf16 \\\n   --transformer-impl {impl}\n")
    imp = import_script(s, check=False)
    assert imp.argv[imp.argv.index("--transformer-impl") + 1] == impl
    assert build_config([parse_flags(imp.argv)]).train.transformer_impl == impl
    assert not any("transformer-impl" in line for line in imp.report_lines()), imp.report_lines()

