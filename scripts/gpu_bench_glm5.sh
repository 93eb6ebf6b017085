#!/usr/bin/env bash
# GLM-5.3-Flash widths on one GPU (issue 16, item 4), from a payload dir HERE holding
# `shelfserve`, `bench_glm5_peer.py`, `gpu_env.sh` and `configs/glm5-next-flash.json`:
# `shelfserve bench` on random weights generated on the GPU (decode ÷ copy bandwidth over the
# bytes a step reads, prefill ÷ the GEMM rate, per-layer-type times extrapolated to 45 layers),
# then the PyTorch peer (transformers' glm5_next, same config and GPU; PEER=0 skips it) and the
# ratio table. JSON and logs go to $OUT.
set -uo pipefail
HERE=${HERE:-$(cd "$(dirname "$0")" && pwd)}
. "$HERE/gpu_env.sh"
OUTDIR=${OUT:-/tmp}
CONFIG=${CONFIG:-$HERE/configs/glm5-next-flash.json}
timeout ${OURS_TIMEOUT:-330} "$HERE/shelfserve" bench --config "$CONFIG" --batches ${BATCHES:-1,8,32,128} \
  --contexts ${CONTEXTS:-1024,8192,65536} --prefill ${PREFILL:-2048,8192} --steps ${STEPS:-10} \
  --json "$OUTDIR/glm5-ours.jsonl" 2> "$OUTDIR/glm5-ours.log" | tee "$OUTDIR/glm5-ours.txt"
echo "ours: rc ${PIPESTATUS[0]}"; tail -4 "$OUTDIR/glm5-ours.log"
if [ "${PEER:-1}" = 1 ]; then
  timeout ${PEER_TIMEOUT:-300} python3 "$HERE/bench_glm5_peer.py" --config "$CONFIG" --batches ${PEER_BATCHES:-1,8,32} \
    --contexts ${PEER_CONTEXTS:-1024} --prefill ${PREFILL:-2048,8192} --json "$OUTDIR/glm5-peer.jsonl" > "$OUTDIR/glm5-peer.log" 2>&1
  echo "peer: rc $?"; tail -3 "$OUTDIR/glm5-peer.log"
fi
python3 - "$OUTDIR" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(n):
    p = os.path.join(out, n)
    return [json.loads(l) for l in open(p)] if os.path.exists(p) else []
ours, peer = load("glm5-ours.jsonl"), load("glm5-peer.jsonl")
pd = {(r["batch"], r["ctx"]): r for r in peer if r.get("kind") == "decode" and "tok_per_s" in r}
pp = {r["tokens"]: r for r in peer if r.get("kind") == "prefill" and "tok_per_s" in r}
print(f"\n{'batch':>5} {'ctx':>6} {'ours tok/s':>11} {'÷copy':>6} {'peer tok/s':>11} {'ours/peer':>9} {'45L tok/s':>10}")
for r in ours:
    if r.get("kind") == "decode" and "tok_per_s" in r:
        p = pd.get((r["batch"], r["ctx"]))
        ratio = f"{r['tok_per_s'] / p['tok_per_s']:.2f}" if p else "-"
        ptok = f"{p['tok_per_s']:.1f}" if p else "-"
        print(f"{r['batch']:>5} {r['ctx']:>6} {r['tok_per_s']:>11.1f} {100 * r['of_copy']:>5.1f}% {ptok:>11} {ratio:>9} {r['full_model_tok_per_s']:>10.1f}")
for r in ours:
    if r.get("kind") == "prefill":
        p = pp.get(r["tokens"])
        ratio = f"{r['tok_per_s'] / p['tok_per_s']:.2f}" if p else "-"
        print(f"prefill {r['tokens']}: ours {r['tok_per_s']:.0f} tok/s ({100 * r['of_gemm']:.1f}% of GEMM), peer {p['tok_per_s'] if p else '-'}, ours/peer {ratio}")
PY
