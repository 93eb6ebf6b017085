#!/usr/bin/env bash
# Grouped tensor-core expert GEMMs vs one GEMM pair per expert (SHELFSERVE_GLM5_MOE_GEMM=grouped|
# cublas), glm5_next prefill at GLM-5.3-Flash widths cut to LAYERS (default 5, so bf16 fits an
# 80 GB card), REPS (default 2) rounds.
# Payload script: copy into .dev/<dir>/ beside gpu_env.sh, configs/ (configs/bench/glm5-next-flash*.json)
# and an xz-compressed shelfserve build, then `run` it with that dir in carry. Prints, per format,
# mode and repeat: prefill ms, tok/s, share of the GEMM ceiling, MoE ms per layer; the rows go to
# $O/grouped_moe_ab.jsonl.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
. "$HERE/gpu_env.sh"
unpack_payload
L=${LAYERS:-5}
for q in "" -fp8 -int4; do
  layered_config "$q" "$L"
done
for rep in $(seq "${REPS:-2}"); do
  for q in "" -fp8 -int4; do
    for m in grouped cublas; do
      SHELFSERVE_GLM5_MOE_GEMM=$m timeout $((16 * L)) "$HERE/shelfserve" bench --config "$R/g$L$q.json" \
        --batches 1 --contexts 1024 --prefill 2048,8192,16384 --steps 3 --json "$R/g$L$q-$m-$rep.jsonl" \
        > /dev/null 2> "$R/g$L$q-$m-$rep.log" || { echo "FAIL g$L$q $m"; tail -3 "$R/g$L$q-$m-$rep.log"; }
    done
  done
done
cat "$R"/*.jsonl > "$O/grouped_moe_ab.jsonl"
python3 - "$R" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + '/*.jsonl')):
    for line in open(f):
        r = json.loads(line)
        if r['kind'] == 'prefill':
            print(f.split('/')[-1][:-6].ljust(22), r['tokens'], 'prefill_ms %.1f' % (r['secs'] * 1e3),
                  'tok/s %.0f' % r['tok_per_s'], 'gemm %.1f%%' % (r['of_gemm'] * 100),
                  'moe_layer_ms %.2f' % (r['layer_secs']['moe_ffn'] * 1e3))
PY
