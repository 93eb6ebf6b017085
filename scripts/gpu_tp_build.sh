#!/usr/bin/env bash
# Build the CUDA tensor-parallel payload here (the GPU machine has no Rust toolchain): the release
# binary and the gpu_tp test binary, stripped, plus scripts/gpu_tp.sh and the bench configs, into
# DEST (default .dev/tp of this checkout; ignored by git). Then, on the two-GPU machine, from the
# repository root, with DEST carried: DEST/gpu_tp.sh
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-.dev/tp}
mkdir -p "$DEST"
cargo build --release --bin shelfserve
test_bin=$(cargo test --release --no-run --test gpu_tp --message-format=json 2>/dev/null |
  python3 -c 'import sys,json
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="gpu_tp": print(m["executable"])' | tail -1)
strip -o "$DEST/shelfserve" target/release/shelfserve
strip -o "$DEST/gpu_tp" "$test_bin"
cp scripts/gpu_tp.sh "$DEST/"
mkdir -p "$DEST/configs" && cp configs/bench/*.json "$DEST/configs/"
# The test binary finds its fixtures and configs under the manifest directory it was built in.
echo "$PWD" > "$DEST/manifest_dir"
du -sh "$DEST"
