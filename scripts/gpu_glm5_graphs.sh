#!/usr/bin/env bash
# glm5_next decode replayed from CUDA graphs: the validation tests (tests/gpu_validate_glm5.rs,
# graphs on by default, plus the graph-vs-plain bitwise test), then `shelfserve bench` at
# GLM-5.3-Flash widths (5 layers) with graphs on and off side by side in one call, bf16, FP8 and
# int4 experts. Payload: .dev/<dir>/ with gpu_env.sh, configs/glm5-next-flash{,-fp8,-int4}.json,
# shelfserve.xz (stripped, xz) and glm5/ from `DEST=.dev/<dir>/glm5 scripts/gpu_build.sh glm5`.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
. "$HERE/gpu_env.sh"
unpack_payload
OUT=$O timeout 240 bash "$HERE/glm5/gpu_validate_glm5.sh" > "$R/validate.log" 2>&1; echo "validate rc=$?"
grep -E "^test |replayed|test result" "$R/validate.log" | tail -14
L=${LAYERS:-5}
for q in "" -fp8 -int4; do
  layered_config "$q" "$L"
  for g in 1 0; do
    SHELFSERVE_CUDA_GRAPHS=$g timeout 100 "$HERE/shelfserve" bench --config "$R/g$L$q.json" --batches 1,8,32 \
      --contexts 1024,8192 --prefill 16 --steps 30 --json "$R/b$q-g$g.jsonl" > "$R/b$q-g$g.txt" 2> "$R/b$q-g$g.log" \
      || { echo "FAIL bench$q graphs=$g"; tail -3 "$R/b$q-g$g.log"; }
  done
done
for f in "$R"/b*.jsonl; do n=$(basename "$f" .jsonl); sed "s/^{/{\"run\":\"$n\",/" "$f"; done > "$O/graphs.jsonl"
cp "$R/validate.log" "$O/" 2>/dev/null
python3 - "$R" <<'PY'
import json, sys
R = sys.argv[1]
def load(name):
    out, ceil = {}, None
    try:
        for line in open(f'{R}/{name}.jsonl'):
            r = json.loads(line)
            if r['kind'] == 'ceiling': ceil = r
            if r['kind'] == 'decode' and 'secs_per_step' in r:
                out[(r['batch'], r['ctx'])] = r
    except FileNotFoundError:
        pass
    return out, ceil
print('experts  b   ctx | graphs step ms queue ms ÷copy | plain step ms queue ms ÷copy | speed-up')
for q in ['', '-fp8', '-int4']:
    on, c = load(f'b{q}-g1'); off, _ = load(f'b{q}-g0')
    if c: print('#', c['gpu'], 'copy %.0f GB/s' % (c['copy_bytes_per_s'] / 1e9))
    for k in sorted(set(on) & set(off), key=lambda k: (k[1], k[0])):
        a, b = on[k], off[k]
        print(f"{q or '-bf16':6} {k[0]:3} {k[1]:5} | {a['secs_per_step']*1e3:9.3f} {a['queue_secs_per_step']*1e3:8.3f} {a['of_copy']*100:4.0f}% |"
              f" {b['secs_per_step']*1e3:9.3f} {b['queue_secs_per_step']*1e3:8.3f} {b['of_copy']*100:4.0f}% | {b['secs_per_step']/a['secs_per_step']:.2f}x")
PY
