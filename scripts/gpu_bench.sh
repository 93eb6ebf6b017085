#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu_build.sh: `shelfserve bench` on each config, then the
# PyTorch peer (transformers LlamaForCausalLM, same config, random bf16 weights, static cache,
# CUDA graphs where capture works) on the same GPU, and a table of ratios.
# Usage: gpu_bench.sh [config.json ...]   (default: the 8B and 1B configs)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/gpu_env.sh"
export PYTHONUNBUFFERED=1
OUTDIR=${OUT:-/tmp}
configs=("$@")
[ ${#configs[@]} -eq 0 ] && configs=("$HERE/configs/llama-8b.json" "$HERE/configs/llama-1b.json")
for c in "${configs[@]}"; do
  n=$(basename "$c" .json)
  "$HERE/shelfserve" bench --config "$c" --json "$OUTDIR/ours-$n.jsonl" ${BENCH_ARGS:-} || echo "bench failed on $n"
  if [ -z "${NO_PEER:-}" ]; then
    python3 "$HERE/bench_peer.py" --config "$c" --json "$OUTDIR/peer-$n.jsonl" ${PEER_ARGS:-} || echo "peer failed on $n"
  fi
  python3 - "$OUTDIR/ours-$n.jsonl" "$OUTDIR/peer-$n.jsonl" "$n" <<'PY'
import json, sys, os
def load(p):
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
ours, peer, name = load(sys.argv[1]), load(sys.argv[2]), sys.argv[3]
key = lambda r: (r["kind"], r.get("batch"), r.get("ctx"), r.get("tokens"))
pm = {key(r): r for r in peer}
print(f"\n== {name}: shelfserve vs PyTorch peer ==")
print(f"{'what':<8} {'batch':>5} {'ctx/tok':>7} {'ours tok/s':>11} {'peer tok/s':>11} {'ours/peer':>9} {'ceiling %':>9}")
for r in ours:
    if r["kind"] == "ceiling":
        print(f"ceilings: copy {r['copy_bytes_per_s']/1e9:.0f} GB/s, bf16 GEMM {r['gemm_flops']/1e12:.0f} TFLOP/s")
        continue
    if "tok_per_s" not in r:
        continue
    p = pm.get(key(r), {})
    pt = p.get("tok_per_s")
    ceil = r.get("of_copy", r.get("of_gemm"))
    print(f"{r['kind']:<8} {str(r.get('batch') or ''):>5} {str(r.get('ctx') or r.get('tokens')):>7} {r['tok_per_s']:>11.0f} "
          f"{(f'{pt:.0f}' if pt else p.get('skipped', '-')):>11} {(f'{r['tok_per_s']/pt:.2f}' if pt else '-'):>9} {100*ceil:>8.0f}%")
PY
done
