#!/usr/bin/env bash
# Build the CUDA validation and benchmark payload here (the GPU machine has no Rust toolchain):
# the release binary and the gpu_validate test binary, stripped, plus the scripts and bench
# configs they use, into DEST (default .dev/cuda of this checkout; ignored by git). Then run on
# the GPU machine, from the repository root, with DEST carried:
#   DEST/gpu_validate.sh     # CUDA vs CPU/transformers checks (tests/gpu_validate.rs)
#   DEST/gpu_bench.sh        # shelfserve bench + the PyTorch peer, with ratios
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-.dev/cuda}
mkdir -p "$DEST"
cargo build --release --bin shelfserve
# Test binaries to ship (TESTS="gpu_validate gpu_sampling gpu_exactness", default gpu_validate).
for t in ${TESTS:-gpu_validate}; do
  test_bin=$(cargo test --release --no-run --test "$t" --message-format=json 2>/dev/null |
    T="$t" python3 -c 'import sys,json,os
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]==os.environ["T"]: print(m["executable"])' | tail -1)
  [ -n "$test_bin" ] || { echo "building test $t failed" >&2; cargo test --release --no-run --test "$t" 2>&1 | tail -30 >&2; exit 1; }
  strip -o "$DEST/$t" "$test_bin"
done
strip -o "$DEST/shelfserve" target/release/shelfserve
cp scripts/gpu_validate.sh scripts/gpu_sampling.sh scripts/gpu_bench.sh scripts/gpu_profile.sh scripts/bench_peer.py "$DEST/"
mkdir -p "$DEST/configs" && cp configs/bench/*.json "$DEST/configs/"
# The test binary finds its fixtures under the manifest directory it was built in.
echo "$PWD" > "$DEST/manifest_dir"
du -sh "$DEST"
