"""How many of slime's launch scripts rlslurm takes, on real inputs (issues 32 and 44).

    python bench/bench_slime_scripts.py SLIME [--markdown OUT.md] [--site-flag=FLAG ...]

SLIME is a checkout (or `git archive`) of THUDM/slime. Fetches nothing. Every launch script under its
scripts/, scripts/low_precision/ and examples/ (any file name ending .sh with a `python3 train.py`
or `train_async.py` launch; scripts/models/ aside) goes through what a slime user would do:
`rlslurm import-slime` with only `BASE_DIR=/data` in its environment (the variable slime's scripts
build their paths from), then `rlslurm submit --dry-run` of the printed command (in this process:
resolve() and render(), as the CLI does), with the script's data and checkpoint paths, which do not
exist here, replaced by files made to match:

- --prompt-data: a JSON Lines file of DAPO-math-17k's size (17398 records) with the script's
  --input-key / --label-key (SFT scripts: one conversation per record);
- --eval-prompt-data paths: a small file of the same shape;
- --hf-checkpoint: a directory with a config.json and an empty safetensors file. The config.json is
  the release's own, as released (tests/fixtures/release_configs/, its README names each source),
  when the checkpoint the script names is one of them or of the same architecture (STAND_INS);
  else rlslurm's shipped YAML's (hf_config_dict) when the sourced `models/X.sh` names one; else
  translated from that script's MODEL_ARGS for the families rlslurm maps (the "derived" column).
  When the checkpoint path or the script's name says INT4, the config.json gets the W4A16
  quantization_config slime's tools/convert_hf_to_int4.py writes, in the group size of the
  script's fake-QAT env; FP8 without a release file, the block-wise FP8 one Qwen's *-FP8 releases
  have. SFT scripts also get rlslurm's tiny tokenizer with a chat template (submit masks the first
  conversations with it), and the records use its words.

Only those paths are substituted; every other flag is the script's as imported. `--site-flag`
appends a site's own setting to every command (the recorded figure uses one:
--engine-span-ports-closed, docs/security.md). Prints one JSON line: scripts, imported, dry_run_ok,
the refusal reasons counted (first clause of each), and the settings not carried.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# the chat template of the SFT placeholder's tokenizer (tests/trainer/test_sft_run.py's)
SFT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <eos> {% endfor %}"
                "{% if add_generation_prompt %}assistant : {% endif %}")
DAPO_RECORDS = 17398  # zhuzilin/dapo-math-17k (slime's --prompt-data in most scripts)

# slime's models/<stem>.sh -> (HF model_type, architecture); first match of the stem's prefix wins.
# Families rlslurm maps get a translated config.json; the others keep their own model_type.
FAMILIES = [
    ("qwen2.5", "qwen2", "Qwen2ForCausalLM"), ("qwen3-next", "qwen3_next", "Qwen3NextForCausalLM"),
    ("qwen3.5", "qwen3_5", "Qwen3_5ForConditionalGeneration"), ("qwen3", "qwen3", "Qwen3ForCausalLM"),
    ("glm4-", "glm4", "Glm4ForCausalLM"), ("glm4.5", "glm4_moe", "Glm4MoeForCausalLM"),
    ("glm4.7", "glm4_moe", "Glm4MoeForCausalLM"), ("glm5", "glm_moe_dsa", "GlmMoeDsaForCausalLM"),
    ("deepseek-v3", "deepseek_v3", "DeepseekV3ForCausalLM"), ("kimi-k2", "deepseek_v3", "DeepseekV3ForCausalLM"),
    ("moonlight", "deepseek_v3", "DeepseekV3ForCausalLM"), ("mimo", "mimo", "MiMoForCausalLM"),
    ("minimax", "minimax_m2", "MiniMaxM2ForCausalLM"), ("llama", "llama", "LlamaForCausalLM"),
]
# slime's model script stem -> rlslurm's shipped model config of the same checkpoint
SHIPPED = {"moonlight": "moonlight-16B-A3B"}
RELEASES = ROOT / "tests" / "fixtures" / "release_configs"
# the checkpoint a script names (its --hf-checkpoint's last component) -> the release config of the
# same architecture that stands for it, where its own release file is not among the fixtures
STAND_INS = {
    "Kimi-K2-Thinking-fp8": "Kimi-K2-Instruct",   # K2-Thinking converted to block FP8: K2's architecture
    "Kimi-K2-Thinking": "Kimi-K2-Instruct",       # the INT4 release: its quantization_config below
    "MiMo-7B-RL": "MiMo-7B-Base",
    "Qwen3-235B-A22B-INT4": "Qwen3-235B-A22B", "Qwen3-30B-A3B-INT4": "Qwen3-30B-A3B",
}
ENVIRON = {"BASE_DIR": "/data"}


def _flags(elements) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    cur = None
    for e in elements:
        if e.text is not None and e.text.startswith("--"):
            cur = e.text[2:]
            out[cur] = []
        elif cur is not None and e.text is not None:
            out[cur].append(e.text)
    return out


def _hf_config(model_script: Path) -> dict:
    """config.json for the model a slime models/X.sh describes (see the module docstring)."""
    from rlslurm.settings.model_config import available_models, load_model_config
    from rlslurm.slime_import.bash import read_script
    from rlslurm.tiny import hf_config_dict

    stem = model_script.stem
    shipped = SHIPPED.get(stem) or next((n for n in available_models() if n.lower() == stem.lower()), None)
    if shipped:
        return hf_config_dict(load_model_config(shipped))
    sc = read_script(model_script.read_text(), str(model_script))
    arr = sc.arrays.get("MODEL_ARGS")
    m = re.search(r"^((?:[A-Za-z_]\w*=\S+\s+)*)source\s+.*?/([\w.-]+\.sh)", model_script.read_text(), re.M)
    if arr is None and m:  # a variant of another model script (qwen3-4B-Instruct-2507.sh: qwen3-4B.sh, its rope base)
        given = dict(a.split("=", 1) for a in m.group(1).split())
        base = model_script.parent / m.group(2)
        sc = read_script(base.read_text(), str(base), given)
        arr = sc.arrays.get("MODEL_ARGS")
    f = _flags(arr if isinstance(arr, list) else [])
    mt, archs = next(((t, a) for p, t, a in FAMILIES if stem.lower().startswith(p)), ("unknown", "Unknown"))
    mla = "multi-latent-attention" in f
    if mt == "glm4_moe" and mla:
        mt, archs = "glm4_moe_lite", "Glm4MoeLiteForCausalLM"  # GLM-4.7-Flash: MLA, not GLM-4.5's GQA
    if mt == "qwen3" and "num-experts" in f:
        mt, archs = "qwen3_moe", "Qwen3MoeForCausalLM"
    if mt == "qwen3_5" and "num-experts" in f:
        mt, archs = "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"  # Qwen3.5-35B-A3B: its own model_type
    one = lambda k, d=None: (f.get(k) or [d])[0]  # noqa: E731
    heads = int(one("num-attention-heads", 1))
    cfg: dict = {
        "architectures": [archs], "model_type": mt, "num_hidden_layers": int(one("num-layers", 1)),
        "hidden_size": int(one("hidden-size", 1)), "intermediate_size": int(one("ffn-hidden-size", 1)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(one("num-query-groups", heads)) if "group-query-attention" in f else heads,
        "head_dim": int(one("kv-channels", int(one("hidden-size", 1)) // heads)),
        "vocab_size": int(one("vocab-size", 1)), "rms_norm_eps": float(one("norm-epsilon", 1e-5)),
        "rope_theta": float(one("rotary-base", 10000)),
        "tie_word_embeddings": "untie-embeddings-and-output-weights" not in f,
        "max_position_embeddings": int(one("max-position-embeddings", 131072)), "hidden_act": "silu",
        "attention_bias": "add-qkv-bias" in f, "torch_dtype": "bfloat16",
    }
    if one("rotary-percent", "1.0") != "1.0" or mt == "glm4_moe":
        cfg["partial_rotary_factor"] = float(one("rotary-percent", 1.0))
    if mt == "qwen2":
        del cfg["attention_bias"]
    dense = _first_dense(sc)
    if mt == "qwen3_moe":
        cfg.update(num_experts=int(one("num-experts")), num_experts_per_tok=int(one("moe-router-topk")),
                   moe_intermediate_size=int(one("moe-ffn-hidden-size")), norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[])
    if mt == "mimo":  # MiMoConfig: Qwen2's fields plus its MTP layer count (remote code, as released)
        cfg.update(num_nextn_predict_layers=int(one("mtp-num-layers", 0)),
                   auto_map={"AutoConfig": "configuration_mimo.MiMoConfig",
                             "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM"})
    if mt in ("glm4_moe", "deepseek_v3", "glm4_moe_lite", "glm_moe_dsa"):
        moe_ffn = int(one("moe-ffn-hidden-size"))
        cfg.update(n_routed_experts=int(one("num-experts")), num_experts_per_tok=int(one("moe-router-topk")),
                   moe_intermediate_size=moe_ffn,
                   n_shared_experts=int(one("moe-shared-expert-intermediate-size", 0)) // moe_ffn,
                   first_k_dense_replace=dense, norm_topk_prob=True,
                   routed_scaling_factor=float(one("moe-router-topk-scaling-factor", 1.0)),
                   n_group=int(one("moe-router-num-groups", 1)), topk_group=int(one("moe-router-group-topk", 1)),
                   num_nextn_predict_layers=0)
    if mt == "minimax_m2":
        # the release's fields (tests/convert/test_hf_config_slime_families.py MINIMAX_M2): no
        # attention_bias field, rotary as rotary_dim, every layer MoE with intermediate_size the
        # experts' width, and the switches transformers' MiniMaxM2 reads as fixed
        del cfg["attention_bias"]
        cfg.update(intermediate_size=int(one("moe-ffn-hidden-size")), num_local_experts=int(one("num-experts")),
                   num_experts_per_tok=int(one("moe-router-topk")),
                   rotary_dim=int(cfg["head_dim"] * float(one("rotary-percent", 1.0))),
                   use_qk_norm="qk-layernorm" in f, qk_norm_type="per_layer",
                   scoring_func=one("moe-router-score-function", "softmax"),
                   use_routing_bias="moe-router-enable-expert-bias" in f,
                   shared_intermediate_size=int(one("moe-shared-expert-intermediate-size", 0)),
                   attn_type_list=[1] * cfg["num_hidden_layers"])
    if mt == "qwen3_next":
        # the release's fields (tests/convert/test_hf_config_slime_families.py QWEN3_NEXT): slime's script
        # sizes the attention and MoE; the linear-attention heads are the release's (slime's plugin reads
        # them from config.json), every 4th layer full attention
        n = cfg["num_hidden_layers"]
        cfg.update(num_experts=int(one("num-experts")), num_experts_per_tok=int(one("moe-router-topk")),
                   moe_intermediate_size=int(one("moe-ffn-hidden-size")),
                   shared_expert_intermediate_size=int(one("moe-shared-expert-intermediate-size", 0)),
                   norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=list(range(dense)),
                   partial_rotary_factor=float(one("rotary-percent", 1.0)), linear_conv_kernel_dim=4,
                   linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                   linear_num_value_heads=32,
                   layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(n)])
    if mt in ("qwen3_5", "qwen3_5_moe"):
        # a vision-language model: the language model's fields in text_config (the release's linear
        # attention: 16 key heads of 128, 48 value heads for the 27B, every 4th layer full attention)
        n = cfg["num_hidden_layers"]
        text = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype", "rope_theta")}
        text.update(attn_output_gate="attention-output-gate" in f, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                    linear_value_head_dim=128, linear_num_key_heads=16,
                    linear_num_value_heads=48 if stem.lower().startswith("qwen3.5-27b") else 32,
                    layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(n)],
                    rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"],
                                     "partial_rotary_factor": float(one("rotary-percent", 1.0)),
                                     "mrope_interleaved": True, "mrope_section": [11, 11, 10]})
        text.pop("partial_rotary_factor", None)
        if mt == "qwen3_5_moe":  # every layer MoE, no dense MLP (no intermediate_size)
            del text["intermediate_size"]
            text.update(num_experts=int(one("num-experts")), num_experts_per_tok=int(one("moe-router-topk")),
                        moe_intermediate_size=int(one("moe-ffn-hidden-size")),
                        shared_expert_intermediate_size=int(one("moe-shared-expert-intermediate-size", 0)))
        cfg = {"architectures": [archs], "model_type": mt, "text_config": text,
               "tie_word_embeddings": cfg["tie_word_embeddings"], "torch_dtype": "bfloat16"}
    if mt == "glm4_moe":
        cfg["use_qk_norm"] = "qk-layernorm" in f
    if mt == "glm4_moe_lite":
        # transformers reads the dense layers from mlp_layer_types, SGLang from first_k_dense_replace.
        # (slime's --add-qkv-bias in glm4.7-30B-A3B.sh is a no-op for megatron-core's MLA; the release
        # has attention_bias false, which the MLA branch below gives by dropping the field.)
        cfg["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (cfg["num_hidden_layers"] - dense)
    if mt == "glm_moe_dsa":
        # GLM-5's config.json (tests/convert/test_hf_config_slime_families.py GLM5): dense layers in
        # mlp_layer_types too, and the indexer's sizes, which slime's spec reads from the checkpoint
        # (slime_plugins/models/glm5: index_n_heads, index_head_dim, index_topk) and its models/X.sh does
        # not carry: the release's. GLM-5.2 also has the cross-layer top-k schedule its script's comment
        # names (index_topk_freq 4, index_skip_topk_offset 3).
        cfg["mlp_layer_types"] = ["dense"] * dense + ["sparse"] * (cfg["num_hidden_layers"] - dense)
        cfg.update(index_n_heads=32, index_head_dim=128, index_topk=2048)
        if stem.startswith("glm5.2"):
            cfg.update(index_topk_freq=4, index_skip_topk_offset=3)
    if mt in ("deepseek_v3", "glm4_moe_lite", "glm_moe_dsa"):
        del cfg["head_dim"], cfg["attention_bias"]
        q = one("q-lora-rank")
        cfg.update(q_lora_rank=int(q) if q else None, kv_lora_rank=int(one("kv-lora-rank")),
                   qk_nope_head_dim=int(one("qk-head-dim")), qk_rope_head_dim=int(one("qk-pos-emb-head-dim")),
                   v_head_dim=int(one("v-head-dim")), rope_interleave=True)
        if mt == "deepseek_v3":
            cfg["scoring_func"] = "sigmoid"
        factor = float(one("rotary-scaling-factor", 1.0))
        if factor != 1.0:
            cfg["rope_scaling"] = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 4096,
                                   "beta_fast": 32, "beta_slow": 1, "mscale": float(one("mscale", 1.0)),
                                   "mscale_all_dim": float(one("mscale-all-dim", 1.0))}
    if stem.lower().startswith("kimi-k2"):
        # as Kimi-K2's release writes it (tests/fixtures/release_configs/Kimi-K2-Instruct): its own
        # model_type, the DeepSeek-V3 architecture, the config class as remote code
        cfg.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                                                   "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})
    return cfg


def _first_dense(sc) -> int:
    """Leading dense layers: slime's scripts say it as FIRST_K_DENSE_REPLACE or N_DENSE_LAYERS (their
    --moe-layer-freq is built from it in a bash loop the importer does not run)."""
    for name in ("FIRST_K_DENSE_REPLACE", "N_DENSE_LAYERS"):
        v = sc.scalars.get(name)
        if isinstance(v, str) and v.isdigit():
            return int(v)
    return 0


def _data(path: Path, n: int, input_key: str, label_key: str, sft: bool) -> Path:
    with path.open("w") as fh:
        for i in range(n):
            if sft:  # words the tiny tokenizer knows (rlslurm/tiny.py)
                rec = {input_key: [{"role": "user", "content": "say digits"},
                                   {"role": "assistant", "content": "1 2 3"}]}
            else:
                rec = {input_key: f"What is {i} + 1?", label_key: str(i + 1)}
            fh.write(json.dumps(rec) + "\n")
    return path


def _model_script(script: Path, root: Path) -> Path | None:
    m = re.search(r"models/([A-Za-z0-9._-]+\.sh)", script.read_text())
    if not m:
        return None
    hits = sorted((root / "scripts" / "models").glob(m.group(1))) or sorted(root.rglob(m.group(1)))
    return hits[0] if hits else None


def _release(ckpt: str) -> str | None:
    """The release directory whose config.json stands for checkpoint path `ckpt`, or None."""
    name = ckpt.rstrip("/").rsplit("/", 1)[-1]
    name = STAND_INS.get(name, name)
    return name if (RELEASES / name / "config.json").is_file() else None


def _substitute(argv: list[str], work: Path, script: Path, root: Path, source: list[str]) -> list[str]:
    """The imported command with its data and checkpoint paths replaced by files made to match;
    `source[0]` is set to where the config.json came from."""
    from rlslurm.settings.flags import parse_flags

    cfg_layer = parse_flags(argv).values
    get = lambda name, default: cfg_layer.get(("data", name), default)  # noqa: E731
    input_key, label_key = get("input_key", "prompt"), get("label_key", "label") or "label"
    sft = any(a.endswith("sft_rollout.generate_rollout") or a == "rlslurm.rollout.sft:generate_rollout" for a in argv)
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("--prompt-data", "--hf-checkpoint", "--eval-prompt-data"):
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            vals = argv[i + 1:j]
            if a == "--eval-prompt-data":
                names = vals[0::2]
                out += [a] + [x for k, nm in enumerate(names) for x in
                              (nm, str(_data(work / f"eval-{k}.jsonl", 32, input_key, label_key, False)))]
            i = j
            continue
        out.append(a)
        i += 1
    prompts = _data(work / "prompts.jsonl", DAPO_RECORDS, input_key, label_key, sft)
    out += ["--prompt-data", str(prompts)]
    ms = _model_script(script, root)
    hf = work / "hf"
    hf.mkdir()
    ckpt_arg = next((argv[k + 1] for k, a in enumerate(argv[:-1]) if a == "--hf-checkpoint"), "")
    release = _release(ckpt_arg)
    if release:
        config = json.loads((RELEASES / release / "config.json").read_text())
        source[0] = f"release {release}"
    else:
        config = _hf_config(ms) if ms else {"model_type": "unknown"}
        source[0] = f"derived from models/{ms.name}" if ms else "none"
    # the script's checkpoint (or the script, scripts/low_precision/*-int4.sh) names a quantized release
    # (Qwen3-4B-FP8, *-INT4): so is its placeholder, as
    # the real config.json carries quantization_config (Qwen/Qwen3-4B-FP8: fp8 e4m3, dynamic activation
    # scales, 128x128 blocks; SGLang's Fp8Config requires activation_scheme)
    ckpt = next((argv[k + 1] for k, a in enumerate(argv[:-1]) if a == "--hf-checkpoint"), "") + " " + script.name
    int4 = re.search(r"int4", ckpt, re.I) or (release == "Kimi-K2-Instruct" and ckpt_arg.rstrip("/").endswith(
        "Kimi-K2-Thinking"))  # the Thinking release is INT4 W4A16 (group 32)
    if re.search(r"fp8", ckpt, re.I) and "quantization_config" not in config:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    elif int4:
        # llm-compressor's W4A16 preset, as slime's tools/convert_hf_to_int4.py writes it (routed experts
        # only), in the group size the script trains with (Kimi-K2-Thinking's release: 32)
        m = re.search(r'OPEN_TRAINING_INT4_GROUP_SIZE\\?"?\s*[:=]\s*\\?"?(\d+)', script.read_text())
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                          "output_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                      "strategy": "group", "group_size": int(m.group(1)) if m else 128,
                                                      "dynamic": False, "actorder": None}}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*",
                       "re:.*mlp\\.gate$"]}
    (hf / "config.json").write_text(json.dumps(config))
    (hf / "model.safetensors").write_bytes(b"")
    if sft:  # SFT is checked with the checkpoint's tokenizer and chat template: give it rlslurm's tiny one
        from rlslurm.tiny import tokenizer_json

        (hf / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
        (hf / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
            "pad_token": "<pad>", "unk_token": "<unk>", "chat_template": SFT_TEMPLATE}))
    out += ["--hf-checkpoint", str(hf), "--run-dir", str(work / "run")]
    return out


def _reason(msg: str) -> str:
    """The refusal's kind: its message without paths and numbers, first clause."""
    msg = re.sub(r"/\S+", "PATH", msg)
    msg = re.sub(r"\d+(\.\d+)?", "N", msg)
    return msg.split(": ")[0][:100] if msg.startswith("--") else msg[:100]


def launch_scripts(root: Path) -> list[Path]:
    """slime's launch scripts: every .sh of scripts/ (its models/ aside), scripts/low_precision/ and
    examples/ with a train.py or train_async.py launch."""
    from rlslurm.slime_import.bash import LAUNCHERS

    found = [*sorted((root / "scripts").glob("*.sh")), *sorted((root / "scripts" / "low_precision").glob("*.sh")),
             *sorted((root / "examples").rglob("*.sh"))]
    return [p for p in found if any(re.search(rf"\b{re.escape(b)}\b", p.read_text()) for b in LAUNCHERS)]


def run(root: Path, site: tuple[str, ...] = ()) -> tuple[dict, list[dict]]:
    """`site`: flags appended to every command, as a site's own settings (--site-flag)."""
    from rlslurm.errors import UserError
    from rlslurm.resolve import resolve
    from rlslurm.slime_import import import_script
    from rlslurm.slurm.render import render

    scripts = launch_scripts(root)
    rows, reasons = [], collections.Counter()
    imported = ok = unsaid = 0
    for s in scripts:
        row = {"script": str(s.relative_to(root)), "imported": False, "dry_run": "", "reason": "", "warnings": 0,
               "not_carried": [], "to_fill": [], "config": ""}
        try:
            imp = import_script(s, check=False, environ=ENVIRON)
            row["imported"] = True
            imported += 1
            row["not_carried"] = [msg.split(": ", 1)[0] for _, msg in sorted(imp.dropped)]
            row["to_fill"] = [msg.split(" in ", 1)[0] for _, msg in imp.placeholders]
            row["warnings"] = len(imp.warnings)  # a missing `\`, plugins or FP8 the run lacks
            unsaid += sum("no rule of the import took it" in msg for _, msg in imp.dropped)
            source = [""]
            with tempfile.TemporaryDirectory() as tmp:
                argv = _substitute(imp.argv, Path(tmp), s, root, source) + list(site)
                row["config"] = source[0]
                res = resolve(argv, strict_inputs=False)
                render(res.cfg, res.cfg.run_dir.resolve())
            row["dry_run"] = "ok"
            ok += 1
        except UserError as e:
            msg = " ".join(str(e).split())
            row["dry_run"] = "refused" if row["imported"] else "import failed"
            row["reason"] = msg
            reasons[_reason(msg)] += 1
        except Exception as e:  # a crash is a finding of its own: recorded, never hidden
            row["dry_run"] = "crash"
            row["reason"] = f"{type(e).__name__}: {e}"
            reasons[f"crash {type(e).__name__}"] += 1
        rows.append(row)
    summary = {"scripts": len(scripts), "imported": imported, "dry_run_ok": ok,
               "refusals": dict(reasons.most_common()),
               "settings_not_carried": sum(len(r["not_carried"]) for r in rows),
               "settings_lost_without_a_line": unsaid, "environ": ENVIRON,
               **({"site_flags": list(site)} if site else {})}
    return summary, rows


def markdown(summary: dict, rows: list[dict], root: Path) -> str:
    lines = ["| script | config.json | dry run | reason | not carried (each on its own line of the import) |",
             "|---|---|---|---|---|"]
    for r in rows:
        reason = re.sub(r"/tmp/\S+?/hf", "HF", r["reason"])[:240].replace("|", "\\|")
        nc = ", ".join(r["not_carried"]).replace("|", "\\|")
        if r["to_fill"]:
            nc = f"to fill: {', '.join(r['to_fill'])}; " + nc
        lines.append(f"| {r['script']} | {r['config']} | {r['dry_run']} | {reason} | {nc} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("slime", type=Path, help="a checkout of THUDM/slime (its scripts/ and examples/ are read)")
    ap.add_argument("--markdown", type=Path, help="also write the per-script table here")
    ap.add_argument("--site-flag", action="append", default=[], metavar="FLAG",
                    help="append FLAG to every command, as a site setting a script cannot carry (e.g. "
                         "--site-flag=--engine-span-ports-closed); repeatable. The recorded figure uses none")
    a = ap.parse_args()
    import logging

    logging.disable(logging.WARNING)
    summary, rows = run(a.slime, tuple(a.site_flag))
    print(json.dumps(summary))
    if a.markdown:
        a.markdown.write_text(markdown(summary, rows, a.slime))


if __name__ == "__main__":
    main()
