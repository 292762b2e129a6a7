#!/usr/bin/env bash
# On the GPU machine: install one bundle part (tools/gpu/build-bundle.sh) into PREFIX (default
# /tmp/rlslurm-gpu). Run it once per part, p1 first, in device runs back to back: /tmp survives between
# runs only while the machine is held (docs/gpu.md). Idempotent per part.
set -euo pipefail
part="${1:?usage: stage.sh BUNDLE_PART_DIR [PREFIX]}"
prefix="${2:-/tmp/rlslurm-gpu}"
mkdir -p "$prefix/site" "$prefix/stubs/IPython"
for t in "$part"/*.tar.xz; do
  [ -e "$t" ] && tar -C "$prefix/site" -xJf "$t"
done
if compgen -G "$part/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$prefix/site" \
    "$part"/*.whl 2>&1 | grep -v -e "^WARNING: Target directory" -e "already exists" || true
fi
# SGLang 0.5.14 imports IPython.display for notebook helpers only; the image has no IPython.
printf 'def display(*a, **k):\n    pass\n\n\nclass HTML(str):\n    pass\n' > "$prefix/stubs/IPython/display.py"
# matplotlib asks a loaded IPython module for its shell (pyplot's REPL hook): none here.
# matplotlib also reads IPython.version_info once it sees the module (a run's reward_curve.png)
printf 'version_info = (8, 0, 0)\n\n\ndef get_ipython():\n    return None\n' > "$prefix/stubs/IPython/__init__.py"
echo "staged $(basename "$part") into $prefix: $(ls "$prefix/site" | wc -l) entries"
