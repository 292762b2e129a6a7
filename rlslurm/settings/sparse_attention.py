"""What GLM-5's sparse attention (megatron-core 0.16's DSA with rlslurm's indexer, rlslurm/models/dsa.py)
cannot be combined with, in one line each: checked at submit (rlslurm/resolve.py) and again where the
trainer builds its TransformerConfig (rlslurm/models/build.py). No torch here (the CLI imports it).
docs/model-families.md, "GLM-5"."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlslurm.settings.model_config import ModelConfig


def sparse_attention_refusal(mc: "ModelConfig", *, qkv_format: str = "bshd",
                             megatron: dict[str, Any] | None = None, pp: int = 1, first: int | None = None,
                             last: int | None = None, transformer_impl: str = "local") -> str | None:
    """Why this layout or these megatron settings cannot run `mc`'s sparse attention, or None. `pp`,
    `first`, `last`: the pipeline stages (--pipeline-model-parallel-size, --decoder-first/last-pipeline-
    num-layers); `transformer_impl`: --transformer-impl."""
    if mc is None or mc.arch.dsa is None:
        return None
    megatron = megatron or {}
    shared = set(mc.arch.dsa.shared_layers)
    if shared and pp > 1:
        # GLM-5.2: a shared layer reuses the top-k of an earlier layer of its own stage (models/dsa.py)
        from rlslurm.settings.parallel_grid import stage_layers

        starts, at = [], 0
        for n in stage_layers(mc.arch.num_layers, pp, first, last, model=mc.name):
            starts.append(at)
            at += n
        bad = [s for s in starts if s in shared]
        if bad:
            return (f"--pipeline-model-parallel-size {pp}: the stage starting at layer {bad[0]} of {mc.name} starts "
                    "with a shared sparse-attention layer (GLM-5.2's cross-layer top-k), whose top-k comes from an "
                    "earlier stage; move the split (--decoder-first/last-pipeline-num-layers) to a layer with an "
                    "indexer")
    coeff = megatron.get("dsa_indexer_loss_coeff") or 0.0
    if coeff > 0:
        return (f"--megatron-dsa-indexer-loss-coeff {coeff}: rlslurm does not train {mc.name}'s sparse-attention "
                "indexer (transformers runs it under no_grad and slime's GLM-5 scripts train it by no loss; "
                "docs/model-families.md, GLM-5)")
    if megatron.get("recompute_granularity") == "selective" and "core_attn" in (
            megatron.get("recompute_modules") or ["core_attn"]):
        return ("--megatron-recompute-granularity selective: megatron-core 0.16's MLA recomputes core_attn without "
                f"the hidden states and query latent that {mc.name}'s sparse attention needs; use full recompute or "
                "leave core_attn out of --megatron-recompute-modules")
    if transformer_impl == "transformer_engine":
        # the trainer's layer spec would refuse it at build (models/build.py layer_specs)
        return (f"--transformer-impl transformer_engine: {mc.name}'s sparse attention reads MLA's normalised "
                "query latent, which transformer-engine's spec fuses into linear_q_up_proj; use --transformer-impl "
                "local")
    if qkv_format == "thd":
        return (f"--qkv-format thd: {mc.name}'s sparse attention (megatron-core's DSA) takes no packed sequences; "
                "use bshd")
    return None
