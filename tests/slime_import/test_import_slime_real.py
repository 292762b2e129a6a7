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


def test_sglang_flags_take_the_values_sglang_takes() -> None:
    """rlslurm's parser takes every value up to the next flag after a --sglang-* flag (a multi-valued
    one was refused as 'unexpected argument'); submit then holds each to SGLang's own count."""
    from rlslurm.errors import ConfigError
    from rlslurm.resolve import resolve

    base = ["--model", "tiny-qwen3"]
    ok = resolve(base + ["--sglang-cuda-graph-bs-decode", "1", "2", "4"], strict_inputs=False)
    assert ok.cfg.sglang_args == ["--cuda-graph-bs-decode", "1", "2", "4"]
    for argv, msg in ((["--sglang-enable-dp-lm-head", "stray"], "--sglang-enable-dp-lm-head takes no value in "
                                                                "SGLang, got 'stray'"),
                      (["--sglang-mem-fraction-static", "0.5", "0.6"], "--sglang-mem-fraction-static takes one "
                                                                        "value in SGLang, got '0.5 0.6'")):
        with pytest.raises(ConfigError, match=f"^{re.escape(msg)}$"):
            resolve(base + argv, strict_inputs=False)


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


# ------------------------------------------------------------------------------ variables and environment


def test_base_dir_comes_from_the_environment_or_var_and_is_never_dropped() -> None:
    kimi = SLIME / "scripts" / "run-kimi-k2-Thinking.sh"
    imp = import_script(kimi, check=False, environ={"BASE_DIR": "/data"})
    cfg = build_config([parse_flags(imp.argv)])
    assert str(cfg.model.hf_checkpoint) == "/data/Kimi-K2-Thinking-fp8"
    assert str(cfg.data.prompt_data) == "/data/dapo-math-17k/dapo-math-17k.jsonl"
    assert cfg.data.eval_prompt_data == ["aime", "/data/aime-2024.jsonl"]
    assert ": to fill: " not in _report(imp)
    # --var wins over the environment
    var = import_script(kimi, check=False, variables={"BASE_DIR": "/lus"}, environ={"BASE_DIR": "/data"})
    assert _values(var.argv, "--hf-checkpoint") == ["/lus/Kimi-K2-Thinking-fp8/"]
    # neither: the flags stay, with a placeholder submit refuses, each named on one line
    unknown = import_script(kimi, check=False, environ={})
    assert _values(unknown.argv, "--hf-checkpoint") == ["<unset:BASE_DIR>/Kimi-K2-Thinking-fp8/"]
    assert _values(unknown.argv, "--prompt-data") == ["<unset:BASE_DIR>/dapo-math-17k/dapo-math-17k.jsonl"]
    fill = [ln for ln in unknown.report_lines() if ": to fill: " in ln]
    assert len(fill) == 1 and "<unset:BASE_DIR> in --hf-checkpoint, --prompt-data, --eval-prompt-data" in fill[0]
    assert not any("not mapped: --hf-checkpoint" in ln or "not mapped: --prompt-data" in ln
                   for ln in unknown.report_lines())


def test_submit_refuses_a_placeholder_naming_flag_and_variable(tmp_path: Path) -> None:
    from rlslurm.errors import ConfigError
    from rlslurm.resolve import resolve
    from rlslurm.slime_import import as_yaml

    unknown = import_script(SLIME / "scripts" / "run-kimi-k2-Thinking.sh", check=False, environ={})
    with pytest.raises(ConfigError, match=r"^--hf-checkpoint <unset:BASE_DIR>/Kimi-K2-Thinking-fp8/: a value rlslurm "
                                          r"import-slime could not know \(BASE_DIR where the script was read\); import "
                                          r"again with --var BASE_DIR=VALUE"):
        resolve(unknown.argv, strict_inputs=False)
    y = tmp_path / "run.yaml"
    y.write_text(as_yaml(unknown))  # the YAML keeps them too, and `submit --config` refuses them the same way
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(y))}:\d+: (hf_checkpoint|prompt_data) <unset:BASE_DIR>/"):
        resolve([], config_file=y, strict_inputs=False)


def test_the_cli_takes_var_and_its_environment(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    kimi = SLIME / "scripts" / "run-kimi-k2-Thinking.sh"
    env = {**os.environ, "BASE_DIR": "/data"}
    p = subprocess.run([sys.executable, "-m", "rlslurm.cli", "import-slime", str(kimi), "--var", "HAS_NVLINK=1"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "--hf-checkpoint /data/Kimi-K2-Thinking-fp8/" in p.stdout
    assert "--env NCCL_NVLS_ENABLE=1" in p.stdout  # known once given: carried
    assert "$BASE_DIR is not set in the script: BASE_DIR '/data' from import-slime's environment" in p.stderr
    bad = subprocess.run([sys.executable, "-m", "rlslurm.cli", "import-slime", str(kimi), "--var", "1X=2"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert bad.returncode == 2 and "--var '1X=2': expected NAME=VALUE" in bad.stderr


def test_ray_runtime_env_is_carried_and_what_rlslurm_sets_is_listed() -> None:
    """The reproducibility recipe's determinism settings reach every step."""
    imp = import_script(SLIME / "scripts" / "run-qwen2.5-0.5B-reproducibility.sh", check=False)
    cfg = build_config([parse_flags(imp.argv)])
    assert cfg.slurm.env == {"PYTHONUNBUFFERED": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NCCL_ALGO": "Ring",
                             "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    report = _report(imp)
    assert re.search(r":\d+: not mapped: PYTHONPATH \(--runtime-env-json\): not carried: slime's Megatron-LM "
                     r"checkout", report)
    kimi = import_script(SLIME / "scripts" / "run-kimi-k2-Thinking.sh", check=False, environ={"BASE_DIR": "/d"})
    env = build_config([parse_flags(kimi.argv)]).slurm.env
    assert env == {"PYTHONUNBUFFERED": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "NVSHMEM_DISABLE_NCCL": "1"}
    report = _report(kimi)
    for name in ("NCCL_NVLS_ENABLE", "MASTER_ADDR", "no_proxy", "PYTHONPATH"):
        assert re.search(rf":\d+: not mapped: {name} \(--runtime-env-json\)\S*: not carried: ", report), name


def test_a_secret_of_the_runtime_env_is_passed_by_name_never_printed(tmp_path: Path) -> None:
    """An invented script: slime's own put no secret in their runtime env."""
    s = tmp_path / "run.sh"
    s.write_text("KEY=s3cr3t-value\n"
                 "ray job submit --runtime-env-json='{\"env_vars\": {\"WANDB_API_KEY\": \"'$KEY'\", \"X\": \"1\"}}' "
                 "-- python3 train.py --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate\n")
    imp = import_script(s, check=False)
    from rlslurm.slime_import import as_command

    assert imp.argv[-4:] == ["--secret-env", "WANDB_API_KEY", "--env", "X=1"]
    assert "s3cr3t" not in as_command(imp) + _report(imp)


# ------------------------------------------------------------------------------ layouts and SFT epochs


@pytest.mark.parametrize("script, layout", [
    # 1 trainer GPU + 3 engine GPUs of the script's `ray start --num-gpus 4` node
    ("examples/fully_async/run-qwen2.5-0.5B-fully_async.sh", (1, 4, 1, 3)),
    # 2 + 4 GPUs of an 8-GPU node
    ("examples/on_policy_distillation/run-qwen3-8B-opd.sh", (1, 6, 2, 4)),
    # train-only on one node: no spare rollout node, the trainer on every GPU
    ("scripts/run-qwen3-4B-base-sft.sh", (1, 8, None, None)),
])
def test_a_layout_that_fits_one_node_imports_as_one_node(script: str, layout: tuple) -> None:
    from rlslurm.settings.layout import place_groups

    imp = import_script(SLIME / script, check=False)
    cfg = build_config([parse_flags(imp.argv)])
    s = cfg.slurm
    assert (s.nodes, s.gpus_per_node, s.trainer_gpus, s.rollout_gpus) == layout
    assert s.trainer_nodes is None and s.rollout_nodes is None
    place_groups(cfg)  # rlslurm's placement of it: one group of the one node, its GPUs split as the script's
    assert cfg.single_node and (s.trainer_nodes, s.rollout_nodes) == (1, 1)


def test_sft_epochs_give_the_steps_slime_trains(tmp_path: Path) -> None:
    """slime's SFT script: --num-epoch 3, no --num-rollout, 128 conversations a rollout: with 20,000
    conversations slime trains 20000 // 128 x 3 = 468 steps; the dry run says so."""
    import json

    from rlslurm.resolve import resolve
    from rlslurm.settings.model_config import load_model_config
    from rlslurm.tiny import hf_config_dict, tokenizer_json

    imp = import_script(SLIME / "scripts" / "run-qwen3-4B-base-sft.sh", check=False)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(hf_config_dict(load_model_config("qwen3-4B"))))
    (hf / "model.safetensors").write_bytes(b"")
    (hf / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    (hf / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<eos>",
        "chat_template": "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
                         "{% if add_generation_prompt %}assistant : {% endif %}"}))
    data = tmp_path / "conversations.jsonl"
    conv = {"messages": [{"role": "user", "content": "say digits"}, {"role": "assistant", "content": "1 2 3"}]}
    data.write_text((json.dumps(conv) + "\n") * 20000)
    argv = list(imp.argv)
    argv[argv.index("--hf-checkpoint") + 1] = str(hf)
    argv[argv.index("--prompt-data") + 1] = str(data)
    res = resolve(argv + ["--run-dir", str(tmp_path / "run")], strict_inputs=False)
    assert res.cfg.rollout.num_rollout == 468
    assert ("--num-epoch 3: --prompt-data's 20000 records // --rollout-batch-size 128 = 156 rollouts per epoch, so "
            "--num-rollout 468: 468 training steps (slime's rule)") in res.notes
    # --num-rollout given: it wins and --num-epoch caps the passes, as slime ignores --num-epoch then
    given = resolve(argv + ["--num-rollout", "10", "--run-dir", str(tmp_path / "run2")], strict_inputs=False)
    assert given.cfg.rollout.num_rollout == 10


# ------------------------------------------------------------------------------ nothing dropped silently


def test_every_flag_and_variable_is_accounted_for() -> None:
    """The closing check names every launch flag's fate; the VLM and PD-disaggregation flags are listed
    with the capability the run lacks, not as unknown flags."""
    from rlslurm.slime_import.bash import read_script
    from rlslurm.slime_import.mapping import group_flags

    for script in sorted(SLIME.rglob("*.sh")):
        imp = import_script(script, check=False, environ={"BASE_DIR": "/data"})
        sc = read_script(script.read_text(), str(script), environ={"BASE_DIR": "/data"})
        n = len(group_flags(sc.launch[1], []))
        summary = next(ln for ln in imp.report_lines() if ": checked: " in ln)
        counts = [int(x) for x in re.findall(r"(\d+) (?:carried|renamed|set by rlslurm|not carried)[,;( ]",
                                             summary)[:4]]
        assert summary.startswith(f"{script}: checked: {n} launch flags: ") and sum(counts) == n, summary
        assert "no rule of the import took it" not in _report(imp)
    geo = import_script(SLIME / "examples" / "geo3k_vlm" / "run_geo3k_qwen35.sh", check=False)
    report = _report(geo)
    assert re.search(r":\d+: not mapped: --multimodal-keys: slime feeds the records' images", report)
    assert "VLM inputs (--multimodal-keys)" in next(ln for ln in geo.report_lines() if ": warning: the imported" in ln)
    glm5 = import_script(SLIME / "scripts" / "run-glm5-744B-A40B.sh", check=False)
    assert re.search(r":\d+: not mapped: --prefill-num-servers: slime runs this many SGLang prefill servers",
                     _report(glm5))
