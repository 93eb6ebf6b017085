#!/usr/bin/env bash
# Grouped tensor-core expert GEMMs vs one GEMM pair per expert (SHELFSERVE_GLM5_MOE_GEMM=grouped|
# cublas), glm5_next prefill at GLM-5.3-Flash widths cut to 5 layers so bf16 fits an 80 GB card.
# Payload script: copy into .dev/<dir>/ beside gpu_env.sh, configs/ (configs/bench/glm5-next-flash*.json)
# and an xz-compressed shelfserve build, then `run` it with that dir in carry. Prints, per format,
# mode and repeat: prefill ms, tok/s, share of the GEMM ceiling, MoE ms per layer.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
. "$HERE/gpu_env.sh"
unpack_payload
for q in "" -fp8 -int4; do
  python3 -c "import json,sys; c=json.load(open(sys.argv[1])); c['num_hidden_layers']=5; json.dump(c, open(sys.argv[2],'w'))" \
    "$HERE/configs/glm5-next-flash$q.json" "$R/g5L$q.json"
done
for rep in 1 2; do
  for q in "" -fp8 -int4; do
    for m in grouped cublas; do
      SHELFSERVE_GLM5_MOE_GEMM=$m timeout 80 "$HERE/shelfserve" bench --config "$R/g5L$q.json" --batches 1 \
        --contexts 1024 --prefill 2048,8192,16384 --steps 3 --json "$R/g5L$q-$m-$rep.jsonl" > /dev/null \
        2> "$R/g5L$q-$m-$rep.log" || { echo "FAIL g5L$q $m"; tail -3 "$R/g5L$q-$m-$rep.log"; }
    done
  done
done
cat "$R"/*.jsonl > "$O/all.jsonl"
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
