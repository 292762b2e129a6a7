"""Minimal stand-in for vllm on rlslurm's SGLang CPU path: only `vllm._custom_ops.rotary_embedding`.

SGLang 0.5.23 with `--device cpu` (but without the sgl-kernel CPU build) falls back to
`from vllm._custom_ops import rotary_embedding`; nothing else of vllm is needed. Any other
`vllm.*` import fails with ImportError, which SGLang treats as "vllm absent".
"""
