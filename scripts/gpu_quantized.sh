#!/usr/bin/env bash
# Packed quantized linears on CUDA (FP8 blocks, int4, NVFP4; tests/gpu_quantized.rs): the
# kernels against the CPU's dequantize-and-dot on random packed matrices, and the quantized
# llama fixtures served on CUDA against the CPU backend and transformers; then `shelfserve bench`
# on the 8B config with random packed weights (configs/bench/llama-8b-{fp8,int4,nvfp4}.json) and
# dense bf16 for comparison: decode tok/s at batch 1/8/32 and achieved ÷ copy bandwidth.
#   here (builds the test binary):   scripts/gpu_quantized.sh build      -> .dev/quant
#   on the GPU machine (carry .dev/quant):  .dev/quant/gpu_quantized.sh
# Prints both tests' tables, then a short summary last. Log: $OUT/quantized.log when OUT is set.
set -uo pipefail
if [ "${1:-}" = build ]; then
  cd "$(dirname "$0")/.."
  export DEST=${DEST:-.dev/quant}
  TESTS=gpu_quantized PROFILE_ARGS=${PROFILE_ARGS:---profile test} scripts/gpu_build.sh glm5 || exit 1
  # The server binary for the bench, in the test profile (opt-level 3) like the test.
  cargo build --profile test --bin shelfserve || exit 1
  strip -o "$DEST/shelfserve" target/debug/shelfserve
  cp scripts/gpu_quantized.sh "$DEST/"
  mkdir -p "$DEST/configs" && cp configs/bench/llama-8b*.json "$DEST/configs/"
  exit 0
fi
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/gpu_env.sh"
link_fixtures
log=${OUT:-/tmp}/quantized.log
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1
"$HERE/gpu_quantized" --include-ignored --nocapture --test-threads=1 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
bench=${OUT:-/tmp}/quantized_bench.log
: > "$bench"
for q in fp8 int4 nvfp4 ""; do
  cfg="$HERE/configs/llama-8b${q:+-$q}.json"
  "$HERE/shelfserve" bench --config "$cfg" --batches 1,8,32 --contexts 1024 --prefill 2048 --steps 20 \
    --json "${OUT:-/tmp}/quantized_bench.jsonl" 2>&1 | tee -a "$bench" || rc=1
done
echo
echo "=== summary (kernels: worst error / its bound, < 1 passes; fixtures: f32 max rel < 1e-4, bf16 rel L2 < 0.25) ==="
grep -E '^(FP8|int4|NVFP4|llama-)' "$log" | awk '{ print }' | sort -u | head -60
echo "--- packed GEMV alone, 8B matrices (format matrix m us GB/s) ---"
grep -E '^(fp8|int4|nvfp4) ' "$log"
grep -E '^test |^test result' "$log"
echo "--- bench (name batch ctx sampling ms/step tok/s GB/s of-copy; prefill rows) ---"
grep -E '^(llama-8b|device )' "$bench"
exit "$rc"
