#!/usr/bin/env bash
# On the GPU machine, from the repository root, after
#   TESTS="gpu_sampling gpu_exactness" DEST=... scripts/gpu_build.sh
# here: device sampling against the host sampler (tests/gpu_sampling.rs), the engine on CUDA
# (tests/gpu_exactness.rs: device vs host sampling, the three exactness rules), then decode step
# time with greedy / device-sampled / host-sampled tokens on the 8B config (shelfserve bench).
# Output also goes to $OUT/sampling.log when OUT is set. Skip the bench with BENCH=0.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/gpu_env.sh"
link_fixtures
log=${OUT:-/tmp}/sampling.log
{
  status=0
  for t in gpu_sampling gpu_exactness; do
    echo "== $t"
    "$HERE/$t" --include-ignored --nocapture --test-threads=1 || status=1
  done
  if [ "${BENCH:-1}" != 0 ]; then
    echo "== bench: decode with greedy / device / host sampled tokens"
    "$HERE/shelfserve" bench --config "$HERE/configs/llama-8b.json" --batches 1,32,128 --contexts 1024 \
      --prefill 128 --steps 20 --sampling greedy,device,host || status=1
  fi
  exit $status
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
