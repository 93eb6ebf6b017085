#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu_build.sh: the same `shelfserve bench` points under several
# launch tunings, one bench per variant, then one table. A variant is a comma-separated list of
# SHELFSERVE_CUDA_* settings without the prefix ("-" for the defaults), e.g.
#   VARIANTS="- PDL=0 GRAPHS=0,PDL=0 DEFINES=GEMV_R1_BLOCKS_ROPE=2+GEMV_R1_BLOCKS_SWIGLU=2" gpu_ab.sh configs/llama-8b.json
# A `BIN=name` entry runs $HERE/name instead of $HERE/shelfserve (another build of the engine
# copied next to it), e.g. VARIANTS="BIN=shelfserve_base -".
# BENCH_ARGS overrides the points (default: batch 1 and 8 at 1k and 8k, prefill 2k).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/gpu_env.sh"
config=${1:-$HERE/configs/llama-8b.json}
OUTDIR=${OUT:-/tmp}
i=0
for v in ${VARIANTS:--}; do
  i=$((i + 1))
  envs=()
  bin="$HERE/shelfserve"
  [ "$v" != "-" ] && for kv in ${v//,/ }; do
    case "$kv" in BIN=*) bin="$HERE/${kv#BIN=}" ;; *) envs+=("SHELFSERVE_CUDA_$kv") ;; esac
  done
  echo "=== variant $i: ${v}" >&2
  env "${envs[@]}" "$bin" bench --config "$config" ${BENCH_ARGS:---batches 1,8 --contexts 1024,8192 --prefill 2048} \
    --json "$OUTDIR/ab-$i.jsonl" >&2 || echo "variant $i failed" >&2
  echo "$v" > "$OUTDIR/ab-$i.name"
done
python3 - "$OUTDIR" "$i" <<'PY'
import json, sys, os
out, n = sys.argv[1], int(sys.argv[2])
runs = []
for i in range(1, n + 1):
    p = os.path.join(out, f"ab-{i}.jsonl")
    rows = [json.loads(l) for l in open(p)] if os.path.exists(p) else []
    runs.append((open(os.path.join(out, f"ab-{i}.name")).read().strip(), rows))
keys = []
for _, rows in runs:
    for r in rows:
        k = (r["kind"], r.get("batch"), r.get("ctx") or r.get("tokens"))
        if "tok_per_s" in r and k not in keys:
            keys.append(k)
print("variant".ljust(36) + "".join(f"{k[0][:3]} {k[1] or ''}@{k[2]}".rjust(14) for k in keys) + "  copy GB/s")
for name, rows in runs:
    d = {(r["kind"], r.get("batch"), r.get("ctx") or r.get("tokens")): r for r in rows}
    cells = []
    for k in keys:
        r = d.get(k, {})
        share = r.get("of_copy", r.get("of_gemm"))
        cells.append(f"{r['tok_per_s']:.0f} ({100*share:.1f}%)" if "tok_per_s" in r else "-")
    copy = next((r["copy_bytes_per_s"] / 1e9 for r in rows if r["kind"] == "ceiling"), 0)
    print(name[:35].ljust(36) + "".join(c.rjust(14) for c in cells) + f"  {copy:.0f}")
PY
