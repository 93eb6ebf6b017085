#!/usr/bin/env bash
# On the GPU machine, from the repository root, after scripts/gpu_build.sh: run the CUDA
# validation tests (tests/gpu_validate.rs, ignored in CI) and print their tables.
# Output also goes to $OUT/validate.log when OUT is set.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/gpu_env.sh"
link_fixtures
log=${OUT:-/tmp}/validate.log
"$HERE/gpu_validate" --include-ignored --nocapture --test-threads=1 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
