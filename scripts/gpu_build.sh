#!/usr/bin/env bash
# Build a CUDA payload here (the GPU machine has no Rust toolchain): the release binary and one
# test binary, stripped, plus the scripts and bench configs they use, into DEST (ignored by git).
# Then run on the GPU machine, from the repository root, with DEST carried.
#   scripts/gpu_build.sh [validate]   DEST default .dev/cuda, for one GPU:
#     DEST/gpu_validate.sh   # CUDA vs CPU/transformers checks (tests/gpu_validate.rs)
#     DEST/gpu_bench.sh      # shelfserve bench + the PyTorch peer, with ratios
#     DEST/gpu_sampling.sh   # device sampling and CUDA exactness (with TESTS="gpu_sampling gpu_exactness")
#   scripts/gpu_build.sh tp           DEST default .dev/tp (= scripts/gpu_tp_build.sh), two GPUs:
#     DEST/gpu_tp.sh         # tensor-parallel checks (tests/gpu_tp.rs) and the TP=1 vs TP=2 bench
#   scripts/gpu_build.sh glm5         DEST default .dev/glm5, one GPU, the test binary only:
#     DEST/gpu_validate_glm5.sh   # glm5_next CUDA vs CPU/transformers (tests/gpu_validate_glm5.rs)
#   scripts/gpu_build.sh vision       DEST default .dev/vision, one GPU, the test binary only:
#     DEST/gpu_vision.sh          # the vision tower and image prompts on CUDA (tests/gpu_vision.rs)
#   scripts/gpu_build.sh dflash       DEST default .dev/dflash, one GPU, the test binary only:
#     DEST/gpu_dflash.sh          # hidden-state taps and the DFlash drafter on CUDA (tests/gpu_dflash.rs)
# PROFILE_ARGS="--profile test" builds the test binaries in the test profile (opt-level 3, no
# release build of the dependencies needed where a test-profile build exists).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-validate}" in
  validate)
    test_name=gpu_validate
    DEST=${DEST:-.dev/cuda}
    scripts=(scripts/gpu_env.sh scripts/gpu_validate.sh scripts/gpu_sampling.sh scripts/gpu_bench.sh scripts/gpu_profile.sh scripts/gpu_ab.sh scripts/bench_peer.py)
    ;;
  glm5)
    test_name=gpu_validate_glm5
    DEST=${DEST:-.dev/glm5}
    scripts=(scripts/gpu_env.sh scripts/gpu_validate_glm5.sh)
    no_server=1
    ;;
  vision)
    test_name=gpu_vision
    DEST=${DEST:-.dev/vision}
    scripts=(scripts/gpu_env.sh scripts/gpu_vision.sh)
    no_server=1
    ;;
  dflash)
    test_name=gpu_dflash
    DEST=${DEST:-.dev/dflash}
    scripts=(scripts/gpu_env.sh scripts/gpu_dflash.sh)
    no_server=1
    ;;
  tp)
    test_name=gpu_tp
    DEST=${DEST:-.dev/tp}
    scripts=(scripts/gpu_env.sh scripts/gpu_tp.sh)
    ;;
  *)
    echo "usage: $0 [validate|tp|glm5|vision|dflash]" >&2
    exit 2
    ;;
esac
mkdir -p "$DEST"
[ -n "${no_server:-}" ] || cargo build --release --bin shelfserve
# Test binaries to ship: the mode's own, or TESTS="gpu_validate gpu_sampling gpu_exactness".
for t in ${TESTS:-$test_name}; do
  test_bin=$(cargo test ${PROFILE_ARGS:---release} --no-run --test "$t" --message-format=json 2>/dev/null |
    T="$t" python3 -c 'import sys,json,os
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]==os.environ["T"]: print(m["executable"])' | tail -1)
  [ -n "$test_bin" ] || { echo "building test $t failed" >&2; cargo test ${PROFILE_ARGS:---release} --no-run --test "$t" 2>&1 | tail -30 >&2; exit 1; }
  strip -o "$DEST/$t" "$test_bin"
done
[ -n "${no_server:-}" ] || strip -o "$DEST/shelfserve" target/release/shelfserve
cp "${scripts[@]}" "$DEST/"
mkdir -p "$DEST/configs" && cp configs/bench/*.json "$DEST/configs/"
# The test binary finds its fixtures (and configs) under the manifest directory it was built in.
echo "$PWD" > "$DEST/manifest_dir"
du -sh "$DEST"
