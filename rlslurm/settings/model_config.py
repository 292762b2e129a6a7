"""Model configs: `rlslurm/settings/model_configs/<name>.yaml`, shipped as package data.

A model config carries the architecture (the numbers that change the math, checked against the HF
checkpoint's `config.json` at start-up) and sensible defaults per node count, so that
`--model glm4-9B --nodes 4` alone renders a sane job.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rlslurm.errors import ConfigError

MODEL_CONFIG_DIR = Path(__file__).resolve().parent / "model_configs"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MoEArch(_Strict):
    num_experts: int
    router_topk: int
    moe_ffn_hidden_size: int
    shared_expert_ffn_hidden_size: int = 0  # 0: no shared expert
    first_k_dense: int = 0                  # leading dense layers (DeepSeek-V3: 3)
    router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    router_topk_norm: bool = True           # renormalise top-k probabilities (HF norm_topk_prob)
    router_scaling_factor: float = 1.0
    router_num_groups: int = 1              # group-limited routing (DeepSeek n_group)
    router_group_topk: int = 1
    router_expert_bias: bool = False        # DeepSeek-V3 e_score_correction_bias
    # Qwen3-Next: the shared expert's output is scaled by sigmoid(hidden @ shared_expert_gate), one
    # number per token (megatron's moe_shared_expert_gate)
    shared_expert_gate: bool = False

    @model_validator(mode="after")
    def _megatron_routes_as_hf(self) -> "MoEArch":
        """Routing megatron-core computes differently from HF's sigmoid routers (deepseek_v3,
        glm4_moe); docs/model-families.md, "Routing megatron-core cannot express"."""
        if self.router_num_groups > 1 and self.router_topk // self.router_group_topk != 2:
            raise ValueError(
                f"router_group_topk={self.router_group_topk} with router_topk={self.router_topk} and "
                f"router_num_groups={self.router_num_groups} is not supported: megatron-core ranks expert groups by "
                f"their top router_topk // router_group_topk scores, HF by their top 2"
            )
        if self.shared_expert_gate and not self.shared_expert_ffn_hidden_size:
            raise ValueError("shared_expert_gate needs a shared expert (shared_expert_ffn_hidden_size > 0)")
        if self.router_score_function == "sigmoid" and self.router_topk == 1 and self.router_topk_norm:
            raise ValueError("router_topk=1 with sigmoid scores and router_topk_norm is not supported: megatron-core "
                             "does not renormalise a single expert's score, HF does")
        return self


class MLAArch(_Strict):
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_head_dim: int        # "nope" part
    qk_pos_emb_head_dim: int
    v_head_dim: int


class GatedDeltaNetArch(_Strict):
    """Qwen3-Next's linear-attention layers (transformers' Qwen3NextGatedDeltaNet, megatron-core's
    GatedDeltaNet with rlslurm's kernels, models/gated_delta.py; docs/model-families.md "Qwen3-Next").
    Layer i (0-based) is full attention when (i + 1) % full_attention_interval == 0, else a gated
    delta net (transformers' default layer_types, megatron's int linear_attention_freq)."""

    full_attention_interval: int = Field(gt=0)
    conv_kernel_dim: int = Field(default=4, gt=0)
    key_head_dim: int = Field(gt=0)
    value_head_dim: int = Field(gt=0)
    num_key_heads: int = Field(gt=0)
    num_value_heads: int = Field(gt=0)

    @model_validator(mode="after")
    def _heads(self) -> "GatedDeltaNetArch":
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"num_value_heads={self.num_value_heads} is not a multiple of "
                             f"num_key_heads={self.num_key_heads}")
        return self


class DSAArch(_Strict):
    """DeepSeek sparse attention's lightning indexer (GLM-5, `glm_moe_dsa`): per query it scores every
    earlier key with `index_n_heads` small heads of `index_head_dim` and keeps the `index_topk` best;
    MLA then attends to those keys only (models/dsa.py, docs/model-families.md "GLM-5")."""

    index_n_heads: int = Field(gt=0)
    index_head_dim: int = Field(gt=0)
    index_topk: int = Field(gt=0)
    # GLM-5.2's cross-layer top-k sharing (HF indexer_types "shared"): these layers (0-based) have no
    # indexer and reuse the top-k of the last layer before them that has one
    shared_layers: tuple[int, ...] = ()


class RopeScaling(_Strict):
    type: Literal["yarn", "llama3"]
    factor: float
    original_max_position_embeddings: int
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None


class Arch(_Strict):
    """Architecture in Megatron's terms; every field changes the math."""

    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    ffn_hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_query_groups: int = Field(gt=0)
    kv_channels: int = Field(gt=0)  # head dim
    vocab_size: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    norm_epsilon: float
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    activation: Literal["swiglu", "gelu"] = "swiglu"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rotary_interleaved: bool = False
    rope_scaling: RopeScaling | None = None
    qk_layernorm: bool = False
    # MiniMax-M2: the q (k) norm is one RMSNorm over all heads' q (k) at once, before the head split,
    # not one per head; its weights are split over TP by heads (models/qk_norm.py,
    # docs/model-families.md "MiniMax-M2")
    qk_layernorm_all_heads: bool = False
    add_qkv_bias: bool = False
    add_bias_linear: bool = False
    tie_word_embeddings: bool = False
    post_self_attn_layernorm: bool = False  # GLM-4 (0414) sandwich norms
    post_mlp_layernorm: bool = False
    # Qwen3-Next: every norm's weight is stored as its offset from 1 (megatron's
    # layernorm_zero_centered_gamma), and the full-attention layers' q_proj also yields a per-head
    # output gate, sigmoid(gate) * attention before o_proj (megatron's attention_output_gate)
    norm_zero_centered: bool = False
    attention_output_gate: bool = False
    moe: MoEArch | None = None
    mla: MLAArch | None = None
    gated_delta_net: GatedDeltaNetArch | None = None
    dsa: DSAArch | None = None  # GLM-5's sparse attention indexer (needs MLA with a query LoRA)

    @model_validator(mode="after")
    def _heads(self) -> "Arch":
        if self.dsa is not None:
            if self.mla is None or self.mla.q_lora_rank is None:
                raise ValueError("dsa (the sparse attention indexer) needs mla with a q_lora_rank: its queries are "
                                 "projected from MLA's normalised query latent")
            sh = self.dsa.shared_layers
            if sh and (0 in sh or max(sh) >= self.num_layers or list(sh) != sorted(set(sh))):
                raise ValueError(f"dsa.shared_layers={list(sh)}: sorted, distinct layers 1..{self.num_layers - 1} "
                                 "(layer 0 has no earlier indexer to share)")
            d = self.dsa.index_head_dim
            if d & (d - 1) or d < self.mla.qk_pos_emb_head_dim:
                raise ValueError(f"dsa.index_head_dim={d} must be a power of 2 (its Hadamard rotation, "
                                 f"models/hadamard.py) and at least mla.qk_pos_emb_head_dim="
                                 f"{self.mla.qk_pos_emb_head_dim} (the rotary part)")
        if self.qk_layernorm_all_heads and not self.qk_layernorm:
            raise ValueError("qk_layernorm_all_heads needs qk_layernorm (it says how the q/k norm spans the heads)")
        if self.qk_layernorm_all_heads and self.mla is not None:
            raise ValueError("qk_layernorm_all_heads is for grouped-query attention, not MLA")
        if self.gated_delta_net is not None and (self.mla is not None or self.qk_layernorm_all_heads):
            raise ValueError("gated_delta_net layers go with grouped-query attention (per-head q/k norm), not "
                             "MLA or qk_layernorm_all_heads")
        if self.attention_output_gate and self.mla is not None:
            raise ValueError("attention_output_gate is for grouped-query attention, not MLA (megatron-core "
                             "refuses it there)")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups}"
            )
        return self


class NodeDefaults(_Strict):
    """Defaults for one node count; any run flag may appear (flag name with underscores)."""

    model_config = ConfigDict(extra="allow", frozen=True)


class ModelConfig(_Strict):
    name: str
    hf_architecture: str           # e.g. Qwen3ForCausalLM
    hf_model_type: str             # config.json "model_type"
    hf_repo: str | None = None     # where the public weights live (informational)
    tiny: bool = False             # random-init test model, runs on CPU in seconds
    arch: Arch
    # node count -> run-flag defaults; the largest key <= --nodes applies.
    defaults: dict[int, dict[str, Any]] = Field(default_factory=dict)
    # megatron-core settings of every GPU run of this model (`--megatron-<field>`); the user's flags
    # win key by key (resolve.py `_megatron_defaults`)
    megatron: dict[str, Any] = Field(default_factory=dict)

    @property
    def num_params(self) -> int:
        return estimate_params(self.arch)

    def defaults_for(self, nodes: int) -> dict[str, Any]:
        """Defaults of the largest node count <= `nodes`; its trainer/rollout split is scaled to
        `nodes` in the same proportion (each group keeps at least one node). One node, where the
        config has no `1:` entry, takes the smallest count's defaults without its node split: the
        two groups then share the node (docs/single-node.md)."""
        keys = sorted(k for k in self.defaults if k <= nodes)
        if not keys and nodes == 1 and self.defaults:
            out = dict(self.defaults[min(self.defaults)])
            return {k: v for k, v in out.items() if k not in ("trainer_nodes", "rollout_nodes")}
        if not keys:
            return {}
        base = keys[-1]
        out = dict(self.defaults[base])
        if base != nodes and "trainer_nodes" in out:
            trainer = min(nodes - 1, max(1, round(nodes * out["trainer_nodes"] / base)))
            out["trainer_nodes"], out["rollout_nodes"] = trainer, nodes - trainer
        return out


def estimate_params(a: Arch) -> int:
    """Parameter count (embeddings included) — for the `models` table and memory sanity checks."""
    h = a.hidden_size
    if a.mla:
        m = a.mla
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        heads = a.num_attention_heads
        q = (h * m.q_lora_rank + m.q_lora_rank * heads * qk) if m.q_lora_rank else h * heads * qk
        kv = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank * heads * (m.qk_head_dim + m.v_head_dim)
        attn = q + kv + a.num_attention_heads * m.v_head_dim * h
    else:
        q_width = a.num_attention_heads * (2 if a.attention_output_gate else 1)
        qkv = h * a.kv_channels * (q_width + 2 * a.num_query_groups)
        attn = qkv + a.num_attention_heads * a.kv_channels * h
    dense_mlp = 3 * h * a.ffn_hidden_size if a.activation == "swiglu" else 2 * h * a.ffn_hidden_size
    if a.moe:
        moe = a.moe
        experts = moe.num_experts * 3 * h * moe.moe_ffn_hidden_size
        moe_mlp = experts + 3 * h * moe.shared_expert_ffn_hidden_size + h * moe.num_experts
        mlp_total = moe.first_k_dense * dense_mlp + (a.num_layers - moe.first_k_dense) * moe_mlp
    else:
        mlp_total = a.num_layers * dense_mlp
    emb = a.vocab_size * h * (1 if a.tie_word_embeddings else 2)
    if a.gated_delta_net:
        d = a.gated_delta_net
        qk, v = d.num_key_heads * d.key_head_dim, d.num_value_heads * d.value_head_dim
        linear = h * (2 * qk + 2 * v + 2 * d.num_value_heads) + (2 * qk + v) * d.conv_kernel_dim + v * h
        full = a.num_layers // d.full_attention_interval
        return full * attn + (a.num_layers - full) * linear + mlp_total + emb
    return a.num_layers * attn + mlp_total + emb


def available_models(config_dir: Path = MODEL_CONFIG_DIR) -> list[str]:
    return sorted(p.stem for p in config_dir.glob("*.yaml"))


def model_config_path(name_or_path: str, config_dir: Path = MODEL_CONFIG_DIR) -> Path:
    """The YAML file `--model` names: a path to one, or a shipped config's name (`glm4-9B`)."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    path = config_dir / f"{name_or_path}.yaml"
    if not path.exists():
        names = available_models(config_dir)
        same_case = [n for n in names if n.lower() == name_or_path.lower()]
        close = same_case or difflib.get_close_matches(name_or_path, names, n=2, cutoff=0.75)
        hint = (f"did you mean {' or '.join(close)}? (`rlslurm models` lists all" if close
                else f"available: {', '.join(names)} (")
        raise ConfigError(f"--model: unknown model {name_or_path!r}; {hint}{', ' if close else ''}or pass a path "
                          f"to a model config YAML)")
    return path


def load_model_config(name_or_path: str, config_dir: Path = MODEL_CONFIG_DIR) -> ModelConfig:
    path = model_config_path(name_or_path, config_dir)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    try:
        return ModelConfig.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise ConfigError(f"{path}: {loc}: {first['msg']}") from None
