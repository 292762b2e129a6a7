"""`rlslurm import-slime` on slime's scripts as they are at THUDM/slime 624b824 (tests/fixtures/slime_624b824,
copied unedited): SGLang flags SGLang renamed carried to the installed version's names, variables and the
Ray runtime environment carried, SFT epochs, one-node layouts, and nothing dropped without a line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rlslurm.engines import sglang_versions
from rlslurm.settings.flags import build_config, parse_flags
from rlslurm.slime_import import import_script

SLIME = Path(__file__).resolve().parents[1] / "fixtures" / "slime_624b824"


def _report(imp) -> str:
    return "\n".join(imp.report_lines())


def _values(argv: list[str], flag: str) -> list[str]:
    k = argv.index(flag)
    out = []
    for tok in argv[k + 1:]:
        if tok.startswith("--"):
            break
        out.append(tok)
    return out


# ------------------------------------------------------------------------------ renamed SGLang flags


def test_renamed_sglang_flags_are_carried_to_the_installed_names() -> None:
    """slime writes SGLang 0.5.14's deprecated spellings; SGLang 0.5.23 has only the new names."""
    version = sglang_versions.installed_sglang_version()
    assert version == "0.5.23"  # the CPU stack's: the table below is its
    qwen = SLIME / "scripts" / "run-qwen3-30B-A3B.sh"
    imp = import_script(qwen, check=False)
    assert "--sglang-cuda-graph-bs" not in imp.argv
    assert _values(imp.argv, "--sglang-cuda-graph-bs-decode") == ["1", "2", "4", "8", *map(str, range(16, 257, 8))]
    sg = build_config([parse_flags(imp.argv)]).sglang_args
    assert sg[sg.index("--cuda-graph-bs-decode") + 1:sg.index("--cuda-graph-bs-decode") + 3] == ["1", "2"]
    report = _report(imp)
    assert re.search(r"run-qwen3-30B-A3B\.sh:\d+: note: --sglang-cuda-graph-bs: SGLang 0.5.23 calls it "
                     r"--sglang-cuda-graph-bs-decode", report)
    assert "not mapped: --sglang-cuda-graph-bs" not in report

    glm5 = import_script(SLIME / "scripts" / "run-glm5-744B-A40B.sh", check=False)
    sg = build_config([parse_flags(glm5.argv)]).sglang_args
    assert sg[sg.index("--dsa-decode-backend") + 1] == "flashmla_sparse"
    assert sg[sg.index("--dsa-prefill-backend") + 1] == "flashmla_sparse"
    assert sg[sg.index("--cuda-graph-max-bs-decode") + 1] == "8"
    assert not any(re.search(r"not mapped: --sglang-(nsa|cuda-graph)", ln) for ln in glm5.report_lines())

    q35 = import_script(SLIME / "scripts" / "run-qwen3.5-27B.sh", check=False)
    assert _values(q35.argv, "--sglang-mamba-radix-cache-strategy") == ["extra_buffer"]


def test_every_new_name_is_a_flag_of_that_sglang() -> None:
    from rlslurm.engines.sglang_flags import sglang_server_flags

    have = sglang_server_flags()
    table = sglang_versions.RENAMED_FLAGS[sglang_versions.installed_sglang_version()]
    for old, r in table.items():
        assert old not in have, old            # dropped, or it would not be in the table
        assert r.new is None or r.new in have, (old, r.new)


def test_a_dropped_flag_with_nothing_in_its_place_is_one_line_of_what_is_lost(tmp_path: Path) -> None:
    """An invented script (slime's own write none of these) with one flag of each kind."""
    s = tmp_path / "run.sh"
    s.write_text("python3 train.py --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate \\\n"
                 "   --sglang-piecewise-cuda-graph-compiler eager \\\n"
                 "   --sglang-enforce-piecewise-cuda-graph \\\n"
                 "   --sglang-prefill-cp-mode round-robin-split\n")
    imp = import_script(s, check=False)
    cfg = build_config([parse_flags(imp.argv)])
    assert cfg.sglang_args == ["--cuda-graph-backend-prefill", "tc_piecewise", "--cp-strategy", "interleave"]
    report = imp.report_lines()
    lost = [ln for ln in report if ln.startswith(f"{s}:2: not mapped: --sglang-piecewise-cuda-graph-compiler: ")]
    assert len(lost) == 1 and "the run does not have the choice of compiler" in lost[0]
    assert any("warning: the imported run does not do what this script does: --sglang-piecewise" in ln
               for ln in report)
