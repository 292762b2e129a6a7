"""`rlslurm import-slime` on the shell forms of slime's launch scripts (issue 32 item 7): `$((...))`
and `$(seq ...)` are evaluated, a missing `\\` is warned about with its file and line, plugins the
import cannot carry are named with the porting guide, and nothing prints a traceback or an emoji
for a line number."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rlslurm.settings.flags import build_config, parse_flags
from rlslurm.slime_import import import_script
from rlslurm.slime_import.bash import read_script
from rlslurm.slime_import.shell_eval import arithmetic, seq

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlslurm.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO)})


def _script(tmp_path: Path, text: str) -> Path:
    s = tmp_path / "run.sh"
    s.write_text(text)
    return s


def test_arithmetic_and_seq_values_are_the_ones_bash_prints(tmp_path: Path) -> None:
    s = _script(tmp_path, (
        "N=4\n"
        "HALF=$(( N / 2 ))\n"
        "ARGS=(\n"
        "   --update-weight-buffer-size $(( ${N} * 512 * 1024 * 1024 ))\n"
        "   --rollout-batch-size $((HALF*3))\n"
        "   --rollout-stop 1 2 4 8 $(seq 16 8 40)\n"
        "   --rollout-stop \"$(seq 3)\"\n"
        ")\n"
        "python3 train.py ${ARGS[@]}\n"))
    sc = read_script(s.read_text(), str(s))
    assert sc.scalars["HALF"] == "2"
    got = [e.text for e in sc.launch[1]]
    assert got[:2] == ["--update-weight-buffer-size", str(4 * 512 * 1024 * 1024)]
    assert got[2:4] == ["--rollout-batch-size", "6"]
    # unquoted: one word per number; quoted: one word with the newlines seq prints
    # (slime's use is --sglang-cuda-graph-bs; a rlslurm list flag here, to check it without importing SGLang)
    assert got[4:13] == ["--rollout-stop", "1", "2", "4", "8", "16", "24", "32", "40"]
    assert got[13:] == ["--rollout-stop", "1\n2\n3"]
    cfg = build_config([parse_flags(import_script(s, check=False).argv)])
    assert cfg.train.update_weight_buffer_size == 4 * 512 * 1024 * 1024 and cfg.rollout.rollout_batch_size == 6
    assert cfg.rollout.rollout_stop == ["1", "2", "4", "8", "16", "24", "32", "40", "1\n2\n3"]


@pytest.mark.parametrize("expr, value", [("-7 / 2", -3), ("-7 % 2", -1), ("7 % -2", 1), ("2 ** 10", 1024),
                                         ("1 << 4 | 1", 17), ("(1 + 2) * 3", 9), ("", 0), ("X * 2", 14)])
def test_arithmetic_follows_c_integer_rules(expr: str, value: int) -> None:
    """bash(1): `/` truncates toward zero and `%` takes the dividend's sign (Python's // and % differ)."""
    assert arithmetic(expr, {"X": "3 + 4"}.__getitem__) == value


@pytest.mark.parametrize("expr", ["1 < 2", "x = 3", "1 ? 2 : 3", "1.5 * 2", "1 / 0", "f(1)"])
def test_unsupported_arithmetic_is_refused_by_name(expr: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(expr.strip())) if expr != "1 / 0" else "divides by zero"):
        arithmetic(expr, {}.__getitem__)


def test_seq_forms() -> None:
    assert seq(["3"]) == ["1", "2", "3"] and seq(["5", "-2", "1"]) == ["5", "3", "1"]
    with pytest.raises(ValueError, match="whole numbers"):
        seq(["-w", "1", "10"])


def test_unknown_values_stay_reported_not_guessed(tmp_path: Path) -> None:
    s = _script(tmp_path, "python3 train.py --lr $(( LR * 2 )) --rollout-batch-size $(nproc)\n")
    imp = import_script(s, check=False)
    report = "\n".join(imp.report_lines())
    # kept in the command, visibly, and named on a line each; submit refuses them until filled
    assert imp.argv == ["--lr", "<unset:$((LR*2))>", "--rollout-batch-size", "<unset:$(nproc)>"]
    assert f"{s}:1: to fill: <unset:$((LR*2))> in --lr: $(( LR * 2 )): $LR has no known value (LR is not set in " \
           "the script" in report
    assert f"{s}:1: to fill: <unset:$(nproc)> in --rollout-batch-size: $(nproc): a command substitution is not " \
           "run" in report
    given = import_script(s, check=False, variables={"LR": "3"})
    assert given.argv[:2] == ["--lr", "6"]


def test_missing_backslash_is_a_warning_naming_file_and_lines(tmp_path: Path) -> None:
    """slime's run-kimi-k2-Instruct.sh line 172: bash ends the launch there, so the arrays on the
    lines after it never reach train.py. The import does as bash does and says so."""
    s = _script(tmp_path, (
        "MODEL_ARGS=(--num-layers 2)\n"
        "ARGS=(--rollout-batch-size 8)\n"
        "python3 train.py \\\n"
        "   --colocate \\\n"
        "   --update-weight-buffer-size $(( 4 * 512 * 1024 * 1024))\n"
        "   ${ARGS[@]} \\\n"
        "   --lr 1e-6\n"))
    imp = import_script(s, check=False)
    warnings = [ln for ln in imp.report_lines() if ": warning: " in ln]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"{s}:6: warning: ${{ARGS[@]}} starts a command of its own: line 5 (the train.py "
                                  "launch) does not end with `\\`")
    assert "--rollout-batch-size" not in imp.argv and "--lr" not in imp.argv
    assert "--update-weight-buffer-size" in imp.argv


def test_continued_lines_are_no_warning(tmp_path: Path) -> None:
    s = _script(tmp_path,
                "ARGS=(\n  --lr 1e-6\n  --colocate\n)\npython3 train.py \\\n  ${ARGS[@]} \\\n  --num-rollout 3\n")
    assert not [ln for ln in import_script(s, check=False).report_lines() if ": warning: " in ln]


def test_plugins_not_carried_are_named_with_the_porting_guide(tmp_path: Path) -> None:
    """slime's examples/on_policy_distillation and examples/retool: the example's defining feature is
    a plugin or switch rlslurm cannot run; each is not mapped on its line, and one warning says the
    imported run lacks it."""
    s = _script(tmp_path, (
        "python3 train.py \\\n"
        "   --custom-rm-path slime.rollout.on_policy_distillation.reward_func \\\n"
        "   --custom-generate-function-path generate_with_retool.generate \\\n"
        "   --use-opd \\\n"
        "   --opd-kl-coef 1.0\n"))
    imp = import_script(s, check=False)
    report = imp.report_lines()
    assert report[0] == (f"{s}:2: warning: the imported run does not do what this script does: on-policy "
                         "distillation (docs/slime-plugins.md); --custom-generate-function-path "
                         "generate_with_retool.generate (docs/slime-plugins.md) (each not mapped below)")
    for line, flag in ((2, "--custom-rm-path"), (3, "--custom-generate-function-path"), (4, "--use-opd"),
                       (5, "--opd-kl-coef")):
        mine = [ln for ln in report if ln.startswith(f"{s}:{line}: not mapped: {flag}: ")]
        assert len(mine) == 1 and "docs/slime-plugins.md" in mine[0], (flag, report)
    assert (REPO / "docs" / "slime-plugins.md").is_file()
    assert not any(a.startswith(("--custom", "--use-opd", "--opd")) for a in imp.argv)


def test_mtp_training_is_not_carried_and_says_what_happens_to_the_mtp_layers(tmp_path: Path) -> None:
    """slime's run-mimo-7B-rl-eagle.sh and run-glm4.7-30B-A3B.sh train the MTP layers; rlslurm
    builds none, so the switch and megatron-core's mtp_* fields are not mapped (never passed through
    as --megatron-mtp-*) and one warning says the run lacks MTP training."""
    s = _script(tmp_path, ("python3 train.py \\\n   --mtp-num-layers 1 \\\n   --enable-mtp-training \\\n"
                           "   --mtp-loss-scaling-factor 0.2 \\\n   --lr 1e-6\n"))
    imp = import_script(s, check=False)
    report = imp.report_lines()
    assert report[0] == (f"{s}:3: warning: the imported run does not do what this script does: MTP training "
                         "(docs/model-families.md) (each not mapped below)")
    for line, flag in ((2, "--mtp-num-layers"), (3, "--enable-mtp-training"), (4, "--mtp-loss-scaling-factor")):
        mine = [ln for ln in report if ln.startswith(f"{s}:{line}: not mapped: {flag}: rlslurm builds and trains "
                                                     "no MTP layers")]
        assert len(mine) == 1, (flag, report)
    assert not any("mtp" in a for a in imp.argv) and imp.argv[-2:] == ["--lr", "1e-6"]


def test_balance_data_is_accepted_with_the_true_reason(tmp_path: Path) -> None:
    """rlslurm balances every step over the DP ranks (trainer/batching.py): slime's switch is
    accepted, by the importer as a note and by `rlslurm submit` itself, never 'not mapped'."""
    s = _script(tmp_path, "python3 train.py --balance-data --lr 1e-6\n")
    report = "\n".join(import_script(s, check=False).report_lines())
    assert f"{s}:1: note: --balance-data: nothing to pass: rlslurm always balances" in report
    assert "not mapped: --balance-data" not in report
    assert build_config([parse_flags(["--balance-data", "--lr", "1e-6"])]) == build_config([parse_flags(["--lr",
                                                                                                         "1e-6"])])


def test_line_100_prints_as_a_line_number_not_an_emoji(tmp_path: Path) -> None:
    """Rich turned `:100:` into 💯 in "run.sh:100: not mapped: ..." (emoji codes, on even without markup)."""
    s = _script(tmp_path, "python3 train.py \\\n" + "   --lr 1e-6 \\\n" * 98 + "   --no-such-flag 1\n")
    p = _cli("import-slime", str(s), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert f"{s}:100: not mapped: --no-such-flag: " in p.stderr and "\U0001f4af" not in p.stderr


def test_a_split_that_leaves_no_node_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """`--trainer-nodes 4` with the default `--nodes 2` gave the rollout group -2 nodes, which the
    config model refused with a pydantic traceback."""
    p = _cli("submit", "--trainer-nodes", "4", "--dry-run", cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().splitlines() == [
        "error: --trainer-nodes 4 with --nodes 2 leaves no node for --rollout-nodes (the rest of --nodes): give "
        "--nodes 5 or more"]


def test_cpu_offload_brings_the_distributed_optimizer_slime_always_has(tmp_path: Path) -> None:
    """slime sets use_distributed_optimizer=True always (its _set_default_megatron_args); rlslurm only at
    DP > 1, so slime's run-qwen3-32B.sh (TP 8 on 8 GPUs, --optimizer-cpu-offload) was refused."""
    s = _script(tmp_path, "python3 train.py --tensor-model-parallel-size 8 \\\n   --optimizer-cpu-offload\n")
    imp = import_script(s, check=False)
    assert "--use-distributed-optimizer" in imp.argv
    assert f"{s}:2: note: --optimizer-cpu-offload: with --use-distributed-optimizer, which slime always sets" in \
        "\n".join(imp.report_lines())
    cfg = build_config([parse_flags(imp.argv)])
    assert cfg.train.use_distributed_optimizer is True and cfg.megatron["optimizer_cpu_offload"] is True


def test_a_train_only_script_gets_its_rollout_node(tmp_path: Path) -> None:
    """slime's run-qwen3-235B-A22B-sft.sh: 4 actor nodes, no rollout GPUs. rlslurm builds SFT rollouts on
    a rollout-group node, so the import asks for 5 nodes instead of leaving --nodes at 2."""
    s = _script(tmp_path, "python3 train.py --actor-num-nodes 4 --actor-num-gpus-per-node 8 --debug-train-only\n")
    cfg = build_config([parse_flags(import_script(s, check=False).argv)])
    assert (cfg.slurm.nodes, cfg.slurm.trainer_nodes, cfg.slurm.rollout_nodes) == (5, 4, 1)


def test_the_script_dir_idiom_and_path_commands_are_known(tmp_path: Path) -> None:
    """slime's `SCRIPT_DIR=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)`, a repository
    root two levels up, and `$(basename ...)`: values the script's own path gives, as bash prints them
    (the shape of examples/eval_multi_task/multi_task.sh and examples/geo3k_vlm at slime 624b824)."""
    d = tmp_path / "slime" / "examples" / "eval"
    d.mkdir(parents=True)
    s = d / "run.sh"
    s.write_text('SCRIPT_DIR="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" &>/dev/null && pwd)"\n'
                 'REPO_ROOT="$(cd -- "${SCRIPT_DIR}/../.." &>/dev/null && pwd)"\n'
                 'NAME=$(basename "org/geo3k_imgurl")\n'
                 'python3 "${REPO_ROOT}/train.py" --eval-config "${REPO_ROOT}/examples/eval/e.yaml" \\\n'
                 '   --prompt-data "/data/${NAME}/train.parquet" --save "$(dirname $0)/ckpt"\n')
    imp = import_script(s, check=False)
    cfg = build_config([parse_flags(imp.argv)])
    assert str(cfg.data.eval_config) == f"{tmp_path}/slime/examples/eval/e.yaml"
    assert str(cfg.data.prompt_data) == "/data/geo3k_imgurl/train.parquet"
    assert ": to fill: " not in "\n".join(imp.report_lines())
    # a `cd` to a relative directory depends on where the script runs: a placeholder, named
    r = _script(tmp_path, 'X="$(cd rel && pwd)"\npython3 train.py --prompt-data "$X/p.jsonl"\n')
    fill = [ln for ln in import_script(r, check=False).report_lines() if ": to fill: " in ln]
    assert fill and "`cd` to a relative directory depends on where the script runs" in fill[0]


def test_slimes_own_sglang_config_is_not_sglangs(tmp_path: Path) -> None:
    """slime's --sglang-config (engine groups for PD disaggregation, run-glm5.2-744B-A40B.sh at 624b824)
    is slime's flag, not SGLang's --config behind the prefix: listed with what the run lacks."""
    s = _script(tmp_path, "python3 train.py --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate \\\n"
                          "   --sglang-config /tmp/groups.yaml\n")
    imp = import_script(s, check=False)
    assert "--sglang-config" not in imp.argv
    report = imp.report_lines()
    assert any(ln.startswith(f"{s}:2: not mapped: --sglang-config: slime's YAML of engine groups") for ln in report)
    assert any("warning: the imported run does not do what this script does: engine groups of slime's "
               "--sglang-config" in ln for ln in report)


def test_a_var_the_script_sets_itself_or_never_uses_is_said(tmp_path: Path) -> None:
    s = _script(tmp_path, "BASE_DIR=/root\npython3 train.py --prompt-data $BASE_DIR/p.jsonl\n")
    imp = import_script(s, check=False, variables={"BASE_DIR": "/data", "FOO": "1"})
    assert imp.argv == ["--prompt-data", "/root/p.jsonl"]  # bash: the script's own assignment wins
    report = imp.report_lines()
    assert f"{s}: note: --var BASE_DIR: not used: the script sets it itself, and its own value wins, as in bash" \
        in report
    assert f"{s}: note: --var FOO: not used: the script does not use it" in report
