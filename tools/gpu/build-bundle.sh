#!/usr/bin/env bash
# Builds, on a CPU machine with pip, everything the GPU tier needs on the GPU machines that their image
# lacks (docs/gpu.md): a trimmed SGLang 0.5.14 (the last SGLang whose pin, torch==2.11.0, is the image's
# own torch), sglang-router, megatron-core, and rlslurm's own missing dependencies. Output: OUT/p1, OUT/p2,
# ... (default OUT=.gpu-bundle, git-ignored), each at most 60 MiB, so one part plus this repository fits one
# device run's 64 MiB transfer. tools/gpu/stage.sh installs a part on the GPU machine.
#
# Trimmed: sgl_kernel keeps sm90 only (flash_ops.abi3.so, the 1.76 GB FA3 kernels, and sm100/ dropped:
# the server then runs with --attention-backend triton); flashinfer_cubin (447 MB), xgrammar, llguidance,
# tilelang, deep-gemm and openai_harmony are left out (not needed with the flags in tests/gpu), and so are
# pillow, lxml and uvloop, which the image has.
# transformers 5.8.1 is bundled because SGLang 0.5.14 fails to import with the image's 5.17.
# Every version comes from constraints/gpu-torch211.txt, the GPU stack (docs/supported-stacks.md): a package
# named here without a pin there is taken at its newest release.
set -euo pipefail
OUT="${1:-.gpu-bundle}"
CAP_MIB="${CAP_MIB:-60}"
C="$(cd "$(dirname "$0")/../.." && pwd)/constraints/gpu-torch211.txt"
rm -rf "$OUT"; mkdir -p "$OUT/all" "$OUT/dl" "$OUT/p1"
dl() { python3 -m pip download -q --no-deps -c "$C" --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -d "$1" "${@:2}"; }
# rlslurm's own needs the image lacks, the trainer's megatron-core, the router
dl "$OUT/all" pydantic pydantic-core annotated-types typing-inspection sniffio submitit \
  typer annotated-doc click shellingham \
  megatron-core sglang-router
# SGLang's server and what it imports
dl "$OUT/all" sglang flashinfer_python transformers tokenizers fastapi starlette \
  uvicorn orjson pybase64 setproctitle pyzmq apache-tvm-ffi python-multipart uvloop msgspec \
  partial_json_parser interegular prometheus-client opentelemetry-api opentelemetry-sdk \
  opentelemetry-semantic-conventions openai jiter distro compressed-tensors torchao gguf blobfile \
  torch_memory_saver nvidia-ml-py aiohttp aiohappyeyeballs aiosignal frozenlist multidict yarl propcache \
  pycryptodomex lxml dill multiprocess xxhash easydict einops msgpack cloudpickle psutil loguru frozendict \
  jsonschema jsonschema-specifications referencing rpds-py attrs soundfile cffi pycparser \
  timm py-cpuinfo
dl "$OUT/dl" sglang-kernel
mkdir -p "$OUT/dl/sk"
(cd "$OUT/dl/sk" && unzip -q -o ../sglang_kernel-*.whl -x 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/sm100/*')
tar -C "$OUT/dl/sk" -cJf "$OUT/p1/sgl_kernel-sm90.tar.xz" .   # 35 MB of .so -> about a third
rm -rf "$OUT/dl"
python3 - "$OUT" "$CAP_MIB" <<'PY'
import os, shutil, sys
out, cap = sys.argv[1], int(sys.argv[2]) * 2**20
size_of = lambda d: sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs)
used = {1: size_of(f"{out}/p1")}
for w in sorted(os.listdir(f"{out}/all"), key=lambda f: -os.path.getsize(f"{out}/all/{f}")):
    size = os.path.getsize(f"{out}/all/{w}")
    if size > cap:
        sys.exit(f"{w}: {size / 2**20:.1f} MiB does not fit one part of {cap / 2**20:.0f} MiB")
    part = next((p for p in sorted(used) if used[p] + size <= cap), max(used) + 1)
    used[part] = used.get(part, 0) + size
    os.makedirs(f"{out}/p{part}", exist_ok=True)
    shutil.move(f"{out}/all/{w}", f"{out}/p{part}/{w}")
os.rmdir(f"{out}/all")
for p in sorted(used):
    print(f"p{p}: {used[p] / 2**20:.1f} MiB")
PY
for p in "$OUT"/p*; do bash "$(dirname "$0")/pack-part.sh" "$p"; done  # wheels -> one .tar.xz (docs/gpu.md)
echo "parts: $(ls -d "$OUT"/p* | wc -l); stage each on the GPU machine with tools/gpu/stage.sh (see docs/gpu.md)"
