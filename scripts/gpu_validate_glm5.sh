#!/usr/bin/env bash
# On the GPU machine, from the repository root, after `scripts/gpu_build.sh glm5`: run the
# glm5_next CUDA validation tests (tests/gpu_validate_glm5.rs, ignored in CI: CUDA f32 vs the CPU
# backend and transformers, bf16 error vs transformers, cache images, rollback) and print their
# tables. Output also goes to $OUT/validate_glm5.log when OUT is set.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/gpu_env.sh"
link_fixtures
log=${OUT:-/tmp}/validate_glm5.log
"$HERE/gpu_validate_glm5" --include-ignored --nocapture --test-threads=1 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
