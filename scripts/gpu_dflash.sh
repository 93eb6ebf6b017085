#!/usr/bin/env bash
# On the GPU machine, from the repository root, after `scripts/gpu_build.sh dflash`: run the
# DFlash-on-CUDA tests (tests/gpu_dflash.rs, ignored in CI: CUDA hidden-state taps vs the CPU's,
# the CUDA drafter's proposals and logits vs the CPU drafter and the reference, drafted =
# undrafted greedy output through the runner and the engine in f32 and bf16) and print one table.
# Output also goes to $OUT/dflash.log when OUT is set.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/gpu_env.sh"
link_fixtures
log=${OUT:-/tmp}/dflash.log
"$HERE/gpu_dflash" --include-ignored --nocapture --test-threads=1 >"$log" 2>&1
rc=$?
grep -E "^test |panicked|assert|left:|right:|Error|error" "$log" | grep -v "^test result" | head -60
echo
echo "| check | result | detail |"
echo "|---|---|---|"
grep "^TABLE|" "$log" | awk -F'|' '{printf "| %s | %s | %s |\n", $2, $3, $4}'
grep -E "^test result" "$log"
exit "$rc"
