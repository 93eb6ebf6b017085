#!/usr/bin/env bash
# Where does a glm5_next batch-1 decode step's time go? (1) Per-layer slopes: the same bench at
# two depths; (step(L2) - step(L1)) / (L2 - L1) is one layer's cost, the intercept the fixed
# part (embedding, LM head, sampling). (2) Nsight Compute times every kernel of the timed decode
# steps (steps split at the `glm5_embed_` launches); step wall time minus the kernels' device
# time is the GPU's idle time between launches, the most that CUDA graphs could win back.
# Payload script: copy into .dev/<dir>/ beside gpu_env.sh, configs/glm5-next-flash{,-fp8,-int4}.json
# and an xz-compressed (stripped) shelfserve build, then `run` it with that dir in carry.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$HERE/../.."
. "$HERE/gpu_env.sh"
unpack_payload
MEM=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
LO=2; HI=8; HI_BF16=5; [ "${MEM:-0}" -gt 100000 ] && HI_BF16=8
echo "device memory ${MEM} MiB: layers ${LO} vs ${HI} (bf16 ${HI_BF16})"
# SLOPES=0: only the kernel times (the 5-layer configs are still made).
for q in "" -fp8 -int4; do
  hi=$HI; [ -z "$q" ] && hi=$HI_BF16
  for L in $LO $hi 5; do
    layered_config "$q" "$L"
  done
  [ "${SLOPES:-1}" = 0 ] && continue
  for L in $LO $hi; do
    timeout 120 "$HERE/shelfserve" bench --config "$R/g$L$q.json" --batches 1,8,32 --contexts 1024 \
      --prefill 16 --steps 30 --json "$R/slope$q-L$L.jsonl" > "$R/slope$q-L$L.txt" 2> "$R/slope$q-L$L.log" \
      || { echo "FAIL slope$q L$L"; tail -3 "$R/slope$q-L$L.log"; }
  done
done
# Kernel device time per decode step, 5 layers (the queue-ms run's depth), batch 1 and 8.
for q in -fp8 ""; do
  timeout 100 "$HERE/shelfserve" bench --config "$R/g5$q.json" --batches 1,8 --contexts 1024 --prefill 16 \
    --steps 10 --json "$R/wall$q.jsonl" > "$R/wall$q.txt" 2>&1 || echo "FAIL wall$q"
  timeout 200 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
    --log-file "$R/ncu$q.csv" "$HERE/shelfserve" bench --config "$R/g5$q.json" --batches 1,8 --contexts 1024 \
    --prefill 16 --steps 10 > "$R/ncu$q.txt" 2>&1 || { echo "FAIL ncu$q"; tail -5 "$R/ncu$q.txt"; }
done
cat "$R"/slope*.jsonl > "$O/slope.jsonl"; cat "$R"/wall*.jsonl > "$O/wall.jsonl"
for f in "$R"/ncu*.csv; do [ -s "$f" ] && xz -c "$f" > "$O/$(basename "$f").xz"; done
python3 - "$R" "$LO" "$HI" "$HI_BF16" <<'PY'
import csv, glob, json, statistics, sys, collections
R, LO, HI, HIB = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def decode(path):
    out = {}
    try:
        for line in open(path):
            r = json.loads(line)
            if r['kind'] == 'decode' and 'secs_per_step' in r:
                out[r['batch']] = (r['secs_per_step'] * 1e3, r['queue_secs_per_step'] * 1e3)
    except FileNotFoundError:
        pass
    return out
print('== per-layer slope (ms), ctx 1024')
for q in ['', '-fp8', '-int4']:
    hi = HIB if q == '' else HI
    lo, h = decode(f'{R}/slope{q}-L{LO}.jsonl'), decode(f'{R}/slope{q}-L{hi}.jsonl')
    for b in sorted(set(lo) & set(h)):
        per = (h[b][0] - lo[b][0]) / (hi - LO)
        qper = (h[b][1] - lo[b][1]) / (hi - LO)
        print(f"{q or '-bf16':6} b{b:<3} L{LO} {lo[b][0]:.3f} L{hi} {h[b][0]:.3f} per-layer {per:.3f} fixed {lo[b][0] - LO * per:.3f} | queue per-layer {qper:.3f} fixed {lo[b][1] - LO * qper:.3f}")
print('== kernel device time per timed decode step (ncu), 5 layers, ctx 1024')
for q in ['-fp8', '']:
    wall = decode(f'{R}/wall{q}.jsonl')
    rows = []
    try:
        lines = open(f'{R}/ncu{q}.csv').read().splitlines()
        start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
        for r in csv.DictReader(lines[start:]):
            if r.get('Metric Name') == 'gpu__time_duration.sum':
                v = float(r['Metric Value'].replace(',', ''))
                unit = r.get('Metric Unit', 'nsecond')
                scale = {'nsecond': 1e-6, 'usecond': 1e-3, 'msecond': 1.0, 'second': 1e3}.get(unit, 1e-6)
                rows.append((r['Kernel Name'], v * scale))
    except (FileNotFoundError, StopIteration) as e:
        print(q, 'no ncu data', e); continue
    steps, cur = [], None
    for name, ms in rows:
        if name.startswith('glm5_embed_'):
            cur = []; steps.append(cur)
        if cur is not None:
            cur.append((name, ms))
    # Per decode point: 3 warm-up, 10 timed, 1 profiled step; then one prefill (embed too).
    for i, b in enumerate([1, 8]):
        timed = steps[i * 14 + 3: i * 14 + 13]
        if len(timed) < 10 or b not in wall:
            print(q, 'b', b, 'incomplete', len(steps)); continue
        dev = statistics.median(sum(ms for _, ms in s) for s in timed)
        n = statistics.median(len(s) for s in timed)
        w = wall[b][0]
        print(f"{q or '-bf16':6} b{b:<3} kernels/step {n:.0f} device {dev:.3f} ms wall {w:.3f} ms idle {w - dev:.3f} ms ({100 * (w - dev) / w:.0f}%) queue {wall[b][1]:.3f} ms")
        agg = collections.defaultdict(lambda: [0, 0.0])
        for name, ms in timed[len(timed) // 2]:
            k = name.split('(')[0]; agg[k][0] += 1; agg[k][1] += ms
        for k, (c, ms) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:12]:
            print(f"    {k[:60]:60} x{c:<3} {ms * 1e3:8.1f} us")
PY
