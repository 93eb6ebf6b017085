#!/usr/bin/env bash
# On the two-GPU machine, from the repository root, after scripts/gpu_tp_build.sh: CUDA tensor
# parallelism checks (tests/gpu_tp.rs, ignored in CI) and the TP=1 vs TP=2 decode benchmark of the
# synthetic 8B config, in one call. Logs go to $OUT when OUT is set.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUTDIR=${OUT:-/tmp}
. "$HERE/gpu_env.sh"
export NCCL_DEBUG=${NCCL_DEBUG:-WARN} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# cudarc opens `libnccl.so`; the NCCL wheel ships only `libnccl.so.2`.
nccl=$(ls $GPU_SITE/nccl/lib/libnccl.so* $GPU_SITE/cu13/lib/libnccl.so* /usr/lib/x86_64-linux-gnu/libnccl.so* 2>/dev/null | head -1)
mkdir -p /tmp/ncclib && ln -sf "$nccl" /tmp/ncclib/libnccl.so
export LD_LIBRARY_PATH=/tmp/ncclib:$LD_LIBRARY_PATH
echo "NCCL library: $nccl"
nvidia-smi topo -m 2>&1 | head -4
link_fixtures
status=0
[ -n "${SKIP_TESTS:-}" ] || timeout 300 "$HERE/gpu_tp" --include-ignored --nocapture --test-threads=1 2>&1 | tee "$OUTDIR/gpu_tp.log" || status=1
for tp in 1 2; do
  timeout 150 "$HERE/shelfserve" bench --config "$HERE/configs/llama-8b.json" --batches 1,32 --contexts 1024 \
    --prefill 2048 --steps 40 --tp $tp --json "$OUTDIR/bench_tp$tp.jsonl" 2>&1 | tee "$OUTDIR/bench_tp$tp.log" || status=1
done
echo "== summary"
[ -n "${SKIP_TESTS:-}" ] || grep -E "tp=2 vs tp=1|graphs vs without|test result|panicked" "$OUTDIR/gpu_tp.log"
grep -hE "^llama-8b|^collective" "$OUTDIR"/bench_tp1.log "$OUTDIR"/bench_tp2.log
exit $status
