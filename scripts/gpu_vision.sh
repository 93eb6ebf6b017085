#!/usr/bin/env bash
# On the GPU machine, from the repository root, after `scripts/gpu_build.sh vision`: run the
# glm5_next vision tower CUDA tests (tests/gpu_vision.rs, ignored in CI: CUDA f32 tower and image
# prompt vs the CPU and transformers, batched vs alone, bf16 error vs f32, bad input) and print
# their tables. Output also goes to $OUT/vision.log when OUT is set.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/gpu_env.sh"
link_fixtures
log=${OUT:-/tmp}/vision.log
"$HERE/gpu_vision" --include-ignored --nocapture --test-threads=1 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
