#!/usr/bin/env bash
# On the GPU machine, from the repository root, after `scripts/gpu_build.sh dflash`: run the
# DFlash-on-CUDA tests (tests/gpu_dflash.rs, ignored in CI: CUDA hidden-state taps vs the CPU's,
# the CUDA drafter's proposals and logits vs the CPU drafter and the reference, drafted =
# undrafted greedy output through the runner and the engine in f32 and bf16) and print one table.
# Cheapest groups first, each under its own time limit (GROUP_TIMEOUT seconds, default 240), so a
# stuck group does not hide the others' results. Output also goes to $OUT/dflash.log when OUT is set.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/gpu_env.sh"
link_fixtures
log=${OUT:-/tmp}/dflash.log
: >"$log"
rc=0
for group in cuda_taps proposals runner_ engine_; do
  timeout "${GROUP_TIMEOUT:-240}" "$HERE/gpu_dflash" "$group" --include-ignored --nocapture --test-threads=1 >>"$log" 2>&1 || rc=1
done
grep -E "^test |panicked|assert|left:|right:|did not|Error|error" "$log" | grep -v "^test result" | head -60
echo
echo "| check | result | detail |"
echo "|---|---|---|"
grep -o 'TABLE|.*' "$log" | awk -F'|' '{printf "| %s | %s | %s |\n", $2, $3, $4}'
grep -E "^test result" "$log"
exit "$rc"
