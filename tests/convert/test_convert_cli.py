"""`rlslurm convert` end to end: HF -> Megatron dist checkpoint -> HF under torchrun at
different TP/PP/EP/ETP and pipeline splits on each side, bit-identical tensors, and the export
loads and generates in HF.
The conversions run in one set of processes (tests/convert/cli_worker.py); a command in torchrun
processes of its own is tests/slurm/test_convert_submit.py's (TP=2 under SLURM), one from another
directory tests/convert/test_ckpt_convert_entry.py's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from convert_helpers import REPO
from typer.testing import CliRunner

from rlslurm.convert import HFCheckpoint

pytestmark = [pytest.mark.megatron, pytest.mark.slow]


def _assert_bit_identical(src: Path, dst: Path, dtype: torch.dtype) -> None:
    a, b = HFCheckpoint(src), HFCheckpoint(dst)
    assert set(a.names()) == set(b.names())
    for n in a.names():
        x, y = a.get(n), b.get(n)
        assert y.dtype == dtype and torch.equal(x, y), n


def _generates(hf_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert model.get_input_embeddings().weight.shape[0] == 64  # trimmed, not the TP-padded 128/256
    ids = tok("say a b c", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out.shape[1] == ids.shape[1] + 4


def _bf16_qwen3(root: Path) -> Path:
    """tiny-qwen3 with 3 layers (its model config beside it, `qwen3-3.yaml`), in bf16, under `root`: 3
    layers split unevenly over 2 pipeline stages (--decoder-first-pipeline-num-layers 2)."""
    import yaml

    from rlslurm.settings.model_config import MODEL_CONFIG_DIR, load_model_config
    from rlslurm.tiny import make_tiny_checkpoint

    root.mkdir(parents=True, exist_ok=True)
    raw = yaml.safe_load((MODEL_CONFIG_DIR / "tiny-qwen3.yaml").read_text())
    raw["name"], raw["arch"]["num_layers"] = "tiny-qwen3-3", 3
    (root / "qwen3-3.yaml").write_text(yaml.safe_dump(raw))
    return make_tiny_checkpoint(load_model_config(str(root / "qwen3-3.yaml")), root / "tiny-qwen3", dtype="bfloat16")


def two_rank_run(request: pytest.FixtureRequest, root: Path) -> list[str]:
    """The fourteen conversions of the seven round trips below, each a real `rlslurm.convert` command
    (the CLI's typer app with a user's argv) on 2 ranks, all in one set of processes
    (tests/convert/cli_worker.py; in the session's one 2-process torchrun of tests/convert, conftest.py
    two_rank_runs): the commands are independent of one another but for the process group they share.
    `<root>/<case>/{mc,hf}`; the 3-layer bf16 tiny-qwen3 in `<root>/bf16`."""
    tiny_ckpts = request.getfixturevalue("tiny_ckpts")
    bf16_qwen3 = _bf16_qwen3(root / "bf16")
    glm4, deepseek, minimax = tiny_ckpts / "tiny-glm4", tiny_ckpts / "tiny-deepseek-v3", tiny_ckpts / "tiny-minimax-m2"
    q, g, d, m = root / "qwen3", root / "glm4", root / "deepseek", root / "minimax"
    qn_src, qn = tiny_ckpts / "tiny-qwen3-next", root / "qwen3-next"
    qwen3 = str(bf16_qwen3.parent / "qwen3-3.yaml")
    plan = [
        # 3 layers over 2 stages, 2 + 1 (slime's uneven pipeline flags), read back at TP 2 on one stage
        ["hf-to-mcore", "--model", qwen3, "--hf", str(bf16_qwen3), "--out", str(q / "mc"), "--pp", "2",
         "--decoder-first-pipeline-num-layers", "2", "--dtype", "bf16"],
        ["mcore-to-hf", "--model", qwen3, "--load", str(q / "mc"), "--out", str(q / "hf"), "--tp", "2",
         "--hf-config-from", str(bf16_qwen3)],
        ["hf-to-mcore", "--model", "tiny-glm4", "--hf", str(glm4), "--out", str(g / "mc"), "--tp", "2",
         "--dtype", "fp32", "--vocab-divisible-by", "64"],
        ["mcore-to-hf", "--model", "tiny-glm4", "--load", str(g / "mc"), "--out", str(g / "hf"), "--pp", "2",
         "--hf-config-from", str(glm4)],
        # experts sharded over EP=2, each whole (ETP=1) while attention is split over TP=2 (slime's MoE
        # layout, 2 ranks), read back at TP=2 with the experts split over it (ETP=2, EP=1)
        ["hf-to-mcore", "--model", "tiny-deepseek-v3", "--hf", str(deepseek), "--out", str(d / "mc"), "--tp", "2",
         "--ep", "2", "--etp", "1", "--dtype", "fp32"],
        ["mcore-to-hf", "--model", "tiny-deepseek-v3", "--load", str(d / "mc"), "--out", str(d / "hf"), "--tp", "2",
         "--hf-config-from", str(deepseek)],
        # MiniMax-M2's all-heads q/k norm weights, split by heads over TP=2 when written, whole at TP=1
        # (one layer per pipeline stage) when read: dist_checkpointing must know them as TP-sharded
        ["hf-to-mcore", "--model", "tiny-minimax-m2", "--hf", str(minimax), "--out", str(m / "mc"), "--tp", "2",
         "--dtype", "fp32"],
        ["mcore-to-hf", "--model", "tiny-minimax-m2", "--load", str(m / "mc"), "--out", str(m / "hf"), "--pp", "2",
         "--hf-config-from", str(minimax)],
        # Qwen3-Next's gated delta nets: in_proj and conv1d written as TP=2 shards part by part
        # (megatron GatedDeltaNet's sharded_state_dict), read back whole at TP=1 (experts over EP=2)
        ["hf-to-mcore", "--model", "tiny-qwen3-next", "--hf", str(qn_src), "--out", str(qn / "mc"), "--tp", "2",
         "--dtype", "fp32"],
        ["mcore-to-hf", "--model", "tiny-qwen3-next", "--load", str(qn / "mc"), "--out", str(qn / "hf"), "--ep", "2",
         "--hf-config-from", str(qn_src)],
    ]
    plan += _glm5_plan(tiny_ckpts, root / "glm5")
    (root / "plan.json").write_text(json.dumps(plan))
    return ["tests/convert/cli_worker.py", str(root / "plan.json")]


def _glm5_plan(tiny_ckpts: Path, r: Path) -> list[list[str]]:
    """GLM-5 (tiny-glm-moe-dsa: sparse-attention indexers in layers 0 and 1, none in the shared layer 2):
    TP 2 read back on 2 stages ([0], [1, 2]), and EP 2 x ETP 1 read back at TP 2. dist_checkpointing must
    take the indexer's replicated tensors (rlslurm/models/dsa.py) in both."""
    hf = str(tiny_ckpts / "tiny-glm-moe-dsa")
    m = ["--model", "tiny-glm-moe-dsa"]
    return [["hf-to-mcore", *m, "--hf", hf, "--out", str(r / "tp2"), "--tp", "2", "--dtype", "fp32"],
            ["mcore-to-hf", *m, "--load", str(r / "tp2"), "--out", str(r / "hf-pp2"), "--pp", "2",
             "--decoder-first-pipeline-num-layers", "1", "--hf-config-from", hf],
            ["hf-to-mcore", *m, "--hf", hf, "--out", str(r / "ep2"), "--ep", "2", "--etp", "1", "--dtype", "fp32"],
            ["mcore-to-hf", *m, "--load", str(r / "ep2"), "--out", str(r / "hf-tp2"), "--tp", "2",
             "--hf-config-from", hf]]


@pytest.fixture(scope="module")
def converted(two_rank_runs) -> Path:
    return two_rank_runs[__name__]


@pytest.fixture(scope="module")
def bf16_qwen3(converted) -> Path:
    return converted / "bf16" / "tiny-qwen3"


def test_qwen3_bf16_uneven_pp2_to_tp2(bf16_qwen3, converted):
    """Written at PP 2 with 2 + 1 layers (each stage's layers under their global numbers), read back
    on one stage at TP 2: bit-identical, every layer in its place."""
    from rlslurm.convert.meta import read_meta

    assert len(list((converted / "qwen3" / "mc").glob("*.distcp"))) >= 2
    assert read_meta(converted / "qwen3" / "mc")["decoder_first_pipeline_num_layers"] == 2
    _assert_bit_identical(bf16_qwen3, converted / "qwen3" / "hf", torch.bfloat16)
    _generates(converted / "qwen3" / "hf")


def test_glm4_tp2_to_pp2(tiny_ckpts, converted):
    from rlslurm.convert.meta import read_meta

    assert read_meta(converted / "glm4" / "mc")["vocab_size_padded"] == 128  # 64 x TP 2, read back at TP 1
    hf = converted / "glm4" / "hf"
    assert (hf / "model.safetensors.index.json").exists()  # one shard per stage + index
    _assert_bit_identical(tiny_ckpts / "tiny-glm4", hf, torch.float32)
    _generates(hf)


def test_deepseek_ep2_etp1_to_tp2(tiny_ckpts, converted):
    """Experts sharded over EP=2 and whole (ETP=1) under TP=2 written, read back at TP=2 = ETP
    (sequence parallel, MLA duplicated): dist_checkpointing reshards the experts between the two
    expert grids, bit for bit."""
    from rlslurm.convert.meta import read_meta

    meta = read_meta(converted / "deepseek" / "mc")
    assert (meta["tp"], meta["ep"], meta["etp"]) == (2, 2, 1)
    _assert_bit_identical(tiny_ckpts / "tiny-deepseek-v3", converted / "deepseek" / "hf", torch.float32)
    _generates(converted / "deepseek" / "hf")


def test_minimax_m2_tp2_to_pp2(tiny_ckpts, converted):
    """The q/k norm weights written as TP=2 shards (each rank's heads' chunk) come back whole at TP=1,
    bit for bit, with every other tensor (routed experts under Mixtral's names)."""
    from rlslurm.convert.meta import read_meta

    assert read_meta(converted / "minimax" / "mc")["tp"] == 2
    _assert_bit_identical(tiny_ckpts / "tiny-minimax-m2", converted / "minimax" / "hf", torch.float32)
    _generates(converted / "minimax" / "hf")


def test_qwen3_next_tp2_to_ep2(tiny_ckpts, converted):
    """The gated delta nets' fused in_proj and conv1d, written as TP=2 shards ([q_r; k_r; v_r; ...] on
    each rank), come back whole at TP=1, bit for bit, with every other tensor; the MTP tensors of the
    file are not in the export (never read)."""
    from convert_helpers import mapped

    from rlslurm.convert.meta import read_meta

    assert read_meta(converted / "qwen3-next" / "mc")["tp"] == 2
    a, b = HFCheckpoint(tiny_ckpts / "tiny-qwen3-next"), HFCheckpoint(converted / "qwen3-next" / "hf")
    assert mapped("tiny-qwen3-next", a.names()) == set(b.names()) != set(a.names())
    for n in b.names():
        assert b.get(n).dtype == torch.float32 and torch.equal(a.get(n), b.get(n)), n
    _generates(converted / "qwen3-next" / "hf")


def test_glm5_sparse_attention_round_trips(tiny_ckpts, converted):
    """tiny-glm-moe-dsa, TP 2 -> PP 2 and EP 2 x ETP 1 -> TP 2: every tensor back bit for bit, the
    indexers' included (and none in the shared layer)."""
    for out in ("hf-pp2", "hf-tp2"):
        _assert_bit_identical(tiny_ckpts / "tiny-glm-moe-dsa", converted / "glm5" / out, torch.float32)
    _generates(converted / "glm5" / "hf-pp2")


def test_wrong_model_config_is_refused_naming_the_field(tiny_ckpts, tmp_path):
    from rlslurm.convert.cli import app

    r = CliRunner().invoke(app, ["hf-to-mcore", "--model", "tiny-llama", "--hf", str(tiny_ckpts / "tiny-qwen3"),
                                 "--out", str(tmp_path / "x")])
    assert r.exit_code == 2
    assert "hf_model_type='llama'" in r.output and "model_type='qwen3'" in r.output
    assert not (tmp_path / "x").exists()


def test_checkpoint_written_before_the_all_heads_qk_norm_field_reads_as_its_default(tmp_path):
    """rlslurm_model.json of a checkpoint converted before arch.qk_layernorm_all_heads existed lacks the
    field: it is the default (per-head) for every model it was made from, and still not a MiniMax-M2."""
    from rlslurm.convert.meta import check_meta, write_meta
    from rlslurm.errors import ConfigError
    from rlslurm.settings.model_config import load_model_config

    for name in ("tiny-qwen3", "tiny-minimax-m2"):
        arch = load_model_config(name).arch.model_dump(mode="json")
        del arch["qk_layernorm_all_heads"]
        (tmp_path / name).mkdir()
        write_meta(tmp_path / name, {"arch": arch, "vocab_size_padded": 128})
    assert check_meta(load_model_config("tiny-qwen3"), tmp_path / "tiny-qwen3", 1) == 128
    with pytest.raises(ConfigError, match=r"arch.qk_layernorm_all_heads=True but the checkpoint .* has False$"):
        check_meta(load_model_config("tiny-minimax-m2"), tmp_path / "tiny-minimax-m2", 1)


def test_checkpoint_of_another_architecture_is_refused(tmp_path):
    from rlslurm.convert.cli import app
    from rlslurm.convert.meta import write_meta
    from rlslurm.settings.model_config import load_model_config

    ck = tmp_path / "mc"
    ck.mkdir()
    arch = load_model_config("tiny-qwen3").arch.model_dump(mode="json")
    write_meta(ck, {"arch": {**arch, "num_layers": 3}, "vocab_size_padded": 128, "dtype": "float32"})
    r = CliRunner().invoke(app, ["mcore-to-hf", "--model", "tiny-qwen3", "--load", str(ck),
                                 "--out", str(tmp_path / "o")])
    assert r.exit_code == 2
    assert "arch.num_layers=2" in r.output and "has 3" in r.output


def test_padded_vocabulary_must_divide_by_the_reader_tp(tmp_path):
    from rlslurm.convert.meta import check_meta, write_meta
    from rlslurm.errors import ConfigError
    from rlslurm.settings.model_config import load_model_config

    mc = load_model_config("tiny-qwen3")
    write_meta(tmp_path, {"arch": mc.arch.model_dump(mode="json"), "vocab_size_padded": 384})
    assert check_meta(mc, tmp_path, tp=3) == 384
    with pytest.raises(ConfigError, match="tensor parallel size 5 does not divide .* 384"):
        check_meta(mc, tmp_path, tp=5)


def test_expert_tensor_parallelism_sets_the_process_count(monkeypatch):
    """The converter runs PP x lcm(TP, ETP x EP) processes (convert/runtime.py); `--submit` starts as many."""
    from rlslurm.convert.runtime import check_world
    from rlslurm.errors import ConfigError
    from rlslurm.slurm.convert_job import split_submit_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert check_world(2, 1, 2, 1) == 1 and check_world(2, 1, 1) == 2
    with pytest.raises(ConfigError, match=r"^--tp 2 --pp 1 --ep 2 needs 4 processes"):
        check_world(2, 1, 2, 2)
    with pytest.raises(ConfigError, match=r"^--tp 4 --pp 2 --ep 8 --etp 1 needs 16 processes"):
        check_world(4, 2, 8, 1)
    assert split_submit_args(["hf-to-mcore", "--tp", "2", "--ep", "2", "--etp", "1"]).nproc == 2
    assert split_submit_args(["hf-to-mcore", "--tp", "2", "--ep", "2"]).nproc == 4


def test_pipeline_split_is_refused_before_any_process_group(tiny_ckpts, tmp_path, monkeypatch):
    """The uneven split's rule (rlslurm/settings/parallel_grid.py) in the converter's flags, one line."""
    from rlslurm.convert.cli import app

    monkeypatch.setenv("WORLD_SIZE", "2")  # what --pp 2 needs: the next check is the split's
    r = CliRunner().invoke(app, ["hf-to-mcore", "--model", "tiny-qwen3", "--hf", str(tiny_ckpts / "tiny-qwen3"),
                                 "--out", str(tmp_path / "x"), "--pp", "2", "--decoder-first-pipeline-num-layers", "2"])
    assert r.exit_code == 2
    assert "--decoder-first-pipeline-num-layers 2 at --pp 2: the 1 other stage would hold 0 of tiny-qwen3's 2 " \
           "layers" in " ".join(r.output.split())
    assert not (tmp_path / "x").exists()


def test_world_size_must_match_the_parallel_sizes(tiny_ckpts, tmp_path):
    r = subprocess.run([sys.executable, "-m", "rlslurm.convert", "hf-to-mcore", "--model", "tiny-qwen3", "--hf",
                        str(tiny_ckpts / "tiny-qwen3"), "--out", str(tmp_path / "o"), "--tp", "2"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--tp 2 --pp 1 --ep 1 needs 2 processes" in r.stderr
