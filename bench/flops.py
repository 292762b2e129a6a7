"""Model FLOPs of a dense decoder (Qwen3/Llama shape), for MFU figures in the benches.

Per token, forward: 2 x every weight matrix's parameters (embedding lookup excluded, the output
projection included, tied or not) + the attention scores and their weighted sum,
2 x 2 x layers x (heads x head_dim) x the attended length (causal: on average half the sequence).
Training = 3 x forward (backward is twice the forward). Recompute (no grad) = 1 x forward.
Peak: dense bf16 tensor-core FLOP/s from the vendor's data sheets (no sparsity).
"""

from __future__ import annotations

PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}


def forward_flops_per_token(*, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, head_dim: int,
                            vocab: int, seq: float) -> float:
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * ffn  # qkv, out proj, SwiGLU
    matmul = layers * per_layer + hidden * vocab                        # + output projection
    attn = 2 * layers * q * (seq / 2)                                   # QK^T and AV, causal average
    return 2 * matmul + 2 * attn


def qwen3_forward_flops_per_token(arch, seq: float) -> float:
    """`arch` is a model config's ArchConfig (rlslurm.settings.model_config)."""
    return forward_flops_per_token(layers=arch.num_layers, hidden=arch.hidden_size, ffn=arch.ffn_hidden_size,
                                   heads=arch.num_attention_heads, kv_heads=arch.num_query_groups,
                                   head_dim=arch.kv_channels, vocab=arch.vocab_size, seq=seq)


def peak_bf16(gpu_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16.items() if k in gpu_name), None)
