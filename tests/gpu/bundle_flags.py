"""SGLang flags for the trimmed SGLang 0.5.14 bundle of the GPU machines (docs/gpu.md,
tools/gpu/build-bundle.sh): the bundle has no FA3 kernels, flashinfer cubins or grammar backends,
so the engine runs triton attention, pytorch sampling, no CUDA graphs and no grammar backend. One
place for the GPU tier (tests/gpu) and the GPU benches (bench/), which differ only in how much
of the GPU the KV pool may take."""

from __future__ import annotations

BUNDLE_FLAGS = ("--attention-backend", "triton", "--sampling-backend", "pytorch", "--disable-cuda-graph",
                "--grammar-backend", "none")


def server_flags(mem_fraction: float) -> tuple[str, ...]:
    """For `sglang.launch_server` (an EngineSpec's extra_args)."""
    return (*BUNDLE_FLAGS, "--mem-fraction-static", str(mem_fraction))


def run_flags(mem_fraction: float) -> list[str]:
    """The same as `rlslurm submit/run` passthrough flags (`--sglang-<flag>`)."""
    return [f"--sglang-{f[2:]}" if f.startswith("--") else f for f in server_flags(mem_fraction)]
