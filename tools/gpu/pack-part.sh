#!/usr/bin/env bash
# Here, after tools/gpu/build-bundle.sh: turn one bundle part's wheels into one wheels.tar.xz of their
# unpacked files (what `pip install --target` would put there: none of them has a .data/ directory,
# checked below), which tools/gpu/stage.sh unpacks the same way. xz took p1 from 62.9 to 42.5 MB
# (sglang-router's and flashinfer's wheels are deflate-compressed .so files), so a part plus this
# repository stays under the device tool's 64 MiB per call as the repository grows (docs/gpu.md).
#   bash tools/gpu/pack-part.sh .gpu-bundle/p1
set -euo pipefail
part="${1:?usage: pack-part.sh BUNDLE_PART_DIR}"
compgen -G "$part/*.whl" >/dev/null || { echo "$part: no wheels to pack"; exit 0; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
for w in "$part"/*.whl; do
  if unzip -Z1 "$w" | grep -q '^[^/]*\.data/'; then
    echo "$w has a .data/ directory: left as a wheel (stage.sh installs it with pip)"; continue
  fi
  unzip -q -o "$w" -d "$tmp/tree" && rm "$w"
done
[ -d "$tmp/tree" ] && tar -C "$tmp/tree" -cf - . | xz -T0 -6 > "$part/wheels.tar.xz"
echo "$part: $(du -sb "$part" | cut -f1) bytes"
