"""SGLang flags for the trimmed SGLang 0.5.14 bundle of the GPU machines (docs/gpu.md,
tools/gpu/build-bundle.sh): the bundle has no FA3 kernels, flashinfer cubins or grammar backends,
so the engine runs triton attention, pytorch sampling, no CUDA graphs and no grammar backend. One
place for the GPU tier (tests/gpu) and the GPU benches (bench/). These are the only SGLang flags
they set: the engines' memory share is SGLang's default on GPUs of their own and rlslurm's derived
one where they share a GPU with the trainer (rlslurm/engines/memory_share.py)."""

from __future__ import annotations

BUNDLE_FLAGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch", "--disable-cuda-graph",
                "--grammar-backend", "none")


def server_flags() -> tuple[str, ...]:
    """For `sglang.launch_server` (an EngineSpec's extra_args)."""
    return BUNDLE_FLAGS


def run_flags() -> list[str]:
    """The same as `rlslurm submit/run` passthrough flags (`--sglang-<flag>`)."""
    return [f"--sglang-{f[2:]}" if f.startswith("--") else f for f in server_flags()]


def mem_flags(fraction: float | None, prefix: str = "--") -> tuple[str, ...]:
    """A bench's explicit --mem-fraction (to measure another share than the default); none by default."""
    return () if fraction is None else (f"{prefix}mem-fraction-static", str(fraction))
