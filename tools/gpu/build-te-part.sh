#!/usr/bin/env bash
# Here (CPU, with network), after tools/install.sh --mcore019: builds the bundle part that puts
# transformer-engine on the GPU machines (docs/gpu.md, "transformer-engine"): OUT (default .gpu-bundle/p3)
# with one te-VERSION-sm90.tar.xz laid out as `pip install --target` lays it out, which
# tools/gpu/stage.sh unpacks after p1 and p2 (it fits beside neither in one call's carry).
#
# Why each step (measured on 2026-12-07, docs/gpu.md):
# - transformer-engine-torch has no wheel on PyPI, only an sdist built against the installed torch: it is
#   built here against the GPU stack's torch 2.11.0+cu130 (the one in .venv-mcore019), for sm_90 only.
# - The cu13 runtime wheels lack CUDA's crt/ and nv/ (CCCL) headers, which the build includes: they come from
#   this machine's CUDA 13.0 toolkit (CUDA_HOME, default /usr/local/cuda-13.0), those two alone on the
#   include path (the rest from the wheels torch was built with).
# - transformer-engine-cu13's core library is 343 MB (kernels for 10 architectures): trimmed to sm_90 by
#   tools/gpu/fatbin_trim.py and stripped of its static symbols (the dynamic ones the extension links stay).
#   bash tools/gpu/build-te-part.sh [OUT]
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${1:-$here/.gpu-bundle/p3}"
TE="${TE_VERSION:-2.20.2}"
PY="$here/.venv-mcore019/bin/python"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda-13.0}"
"$PY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.11.0") else 1)' \
  || { echo "build-te-part: $PY has no torch 2.11.0 (run tools/install.sh --mcore019 first)" >&2; exit 2; }
[ -d "$CUDA_HOME/include/crt" ] || { echo "build-te-part: no $CUDA_HOME/include/crt (set CUDA_HOME)" >&2; exit 2; }
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
log() { printf '[te-part] %s %s\n' "$(date +%H:%M:%S)" "$*"; }

dl() { "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$work/whl" "$@"; }
log "download transformer-engine $TE and the onnx modules its import needs"
dl "transformer-engine==$TE" "transformer-engine-cu13==$TE" onnx onnxscript onnx_ir ml_dtypes protobuf
"$PY" -m pip download -q --no-deps --no-build-isolation --no-binary=:all: -d "$work/src" "transformer-engine-torch==$TE"

log "lay out the wheels as pip --target does"
mkdir -p "$work/tree"
for w in "$work"/whl/*.whl; do unzip -q -o "$w" -d "$work/tree"; done

log "build transformer_engine_torch against $("$PY" -c 'import torch; print(torch.__version__)') for sm_90"
mkdir -p "$work/inc" && ln -s "$CUDA_HOME/include/crt" "$work/inc/crt" && ln -s "$CUDA_HOME/include/nv" "$work/inc/nv"
( cd "$work" && PYTHONPATH="$work/tree" CPLUS_INCLUDE_PATH="$work/inc" \
  NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_BUILD_USE_NVIDIA_WHEELS=1 NVTE_CUDA_ARCHS=90 NVTE_FRAMEWORK=pytorch \
  MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
  "$PY" -m pip wheel -q --no-build-isolation --no-deps -w "$work/built" "$work"/src/transformer_engine_torch-*.tar.gz )
unzip -q -o "$work"/built/transformer_engine_torch-*.whl -d "$work/tree"

log "trim the core library to sm_90"
lib="$(find "$work/tree" -name 'libtransformer_engine.so' | head -1)"
python3 "$here/tools/gpu/fatbin_trim.py" "$lib" --keep 90
strip --strip-unneeded "$lib"

rm -rf "$OUT"; mkdir -p "$OUT"
tar -C "$work/tree" -cf - . | xz -T0 -9 > "$OUT/te-$TE-sm90.tar.xz"
log "$OUT/te-$TE-sm90.tar.xz: $(du -b "$OUT/te-$TE-sm90.tar.xz" | cut -f1) bytes, sha256 $(sha256sum "$OUT/te-$TE-sm90.tar.xz" | cut -c1-16)"
