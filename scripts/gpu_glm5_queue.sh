#!/usr/bin/env bash
# Is glm5_next decode bound by the host's launches or by the device? `shelfserve bench` prints,
# per decode point, the step's wall time and the host time spent queueing its launches (queue ms):
# a queue time near the step time means the GPU waits for the host. GLM-5.3-Flash widths, bf16,
# FP8 and int4 experts; 10 layers on a card with more than 100 GB, else 5. On such a card the
# grouped-vs-per-expert MoE A/B (scripts/gpu_grouped_moe_ab.sh, once, at 10 layers) runs after it.
# Payload script: copy into .dev/<dir>/ beside gpu_env.sh, gpu_grouped_moe_ab.sh, configs/
# (configs/bench/glm5-next-flash*.json) and an xz-compressed shelfserve build, then `run` it with
# that dir in carry.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
. "$HERE/gpu_env.sh"
unpack_payload
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
L=5; [ "${MEM:-0}" -gt 100000 ] && L=10
echo "device memory ${MEM} MiB: ${L} layers"
for q in "" -fp8 -int4; do
  layered_config "$q" "$L"
done
for q in "" -fp8 -int4; do
  timeout 150 "$HERE/shelfserve" bench --config "$R/g$L$q.json" --batches 1,8,32 --contexts 1024,8192 \
    --prefill 2048 --steps 20 --json "$R/decode$q.jsonl" > "$R/decode$q.txt" 2> "$R/decode$q.log" \
    || { echo "FAIL decode$q"; tail -3 "$R/decode$q.log"; }
done
cat "$R"/*.jsonl > "$O/all.jsonl"
python3 - "$R" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + '/*.jsonl')):
    name = f.split('/')[-1][:-6]
    for line in open(f):
        r = json.loads(line)
        if r['kind'] == 'ceiling' and name.startswith('decode'):
            print(name, r['gpu'], 'copy %.0f GB/s' % (r['copy_bytes_per_s'] / 1e9), 'gemm %.0f TFLOP/s' % (r['gemm_flops'] / 1e12))
        elif r['kind'] == 'decode' and 'secs_per_step' in r:
            print(name.ljust(14), 'b', r['batch'], 'ctx', r['ctx'], 'step_ms %.3f' % (r['secs_per_step'] * 1e3),
                  'queue_ms %.3f' % (r['queue_secs_per_step'] * 1e3), 'tok/s %.0f' % r['tok_per_s'],
                  'copy %.0f%%' % (r['of_copy'] * 100))
        elif r['kind'] == 'prefill':
            print(name.ljust(14), 'prefill', r['tokens'], 'ms %.1f' % (r['secs'] * 1e3), 'tok/s %.0f' % r['tok_per_s'],
                  'gemm %.1f%%' % (r['of_gemm'] * 100), 'moe_layer_ms %.2f' % (r['layer_secs']['moe_ffn'] * 1e3))
PY
if [ "$L" = 10 ]; then LAYERS=10 REPS=1 bash "$HERE/gpu_grouped_moe_ab.sh"; fi
