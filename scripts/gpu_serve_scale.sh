#!/usr/bin/env bash
# Serving at scale on one GPU (issues 24 and 25), from a payload dir HERE holding `shelfserve`,
# `mixed_load`, `make_random_llama.py` and the `llama-tok` tokenizer fixture:
#   gpu_serve_scale.sh serve   an 8B bf16 llama (random weights, SmolLM2 tokenizer, made once in
#                              /dev/shm), `serve --device cuda` with no other flags: load time and
#                              rate, bench-serve at concurrency 1..256 and a cold 7,284-token prefill,
#                              then `shelfserve bench` at the same batches: the ratio table.
#   gpu_serve_scale.sh overlap two servers side by side on the same GPU (0.45 of its memory each),
#                              overlapped scheduling off (ports 8890/8891) and on (8888/8889);
#                              bench-serve alternates between them at each concurrency (off, on,
#                              off, on), then `shelfserve bench` at the same batches.
#   gpu_serve_scale.sh voice   mixed_load on the same model: voice TTFT idle vs under 8 and 32
#                              agents, lane pacing off and on.
# Results (JSON and logs) go to $OUT.
set -uo pipefail
HERE=${HERE:-$(cd "$(dirname "$0")" && pwd)}
. "$HERE/gpu_env.sh"
OUTDIR=${OUT:-/tmp}
MODEL=${MODEL:-/dev/shm/llama8b}
PORT=8888
CONCURRENCY=${CONCURRENCY:-"1 8 32 64 128 256"}
OUTPUT_LEN=${OUTPUT_LEN:-256}
INPUT_LEN=${INPUT_LEN:-128}

make_model() {
  python3 "$HERE/make_random_llama.py" --out "$MODEL" --tokenizer-from "$HERE/llama-tok" >&2
  du -sb "$MODEL" | awk '{printf "model: %.2f GB on disk\n", $1/1e9}'
  # What the page cache gives one reader, for scale.
  local t0=$(date +%s%N)
  cat "$MODEL"/*.safetensors > /dev/null
  local t1=$(date +%s%N)
  du -sb "$MODEL" | awk -v ns=$((t1 - t0)) '{printf "one reader (cat > /dev/null): %.1f GB/s\n", $1/ns}'
}

serve_up() {
  local t0=$(date +%s%N)
  setsid "$HERE/shelfserve" serve --device cuda --model "$MODEL" "$@" > "$OUTDIR/serve.log" 2>&1 &
  SERVER=$!
  for i in $(seq 1 1200); do
    curl -sf localhost:$PORT/health > /dev/null && break
    kill -0 $SERVER 2>/dev/null || { echo "server died"; tail -20 "$OUTDIR/serve.log"; return 1; }
    sleep 0.1
  done
  local t1=$(date +%s%N)
  echo "serving after $(( (t1 - t0) / 1000000 )) ms (process start to /health 200)"
  grep -E "weights on the device|step workspace|capacity|KV pool|device opened|kernel modules|model loaded" "$OUTDIR/serve.log" \
    | sed 's/\x1b\[[0-9;]*m//g' | sed 's/^[0-9T:.-]*Z *//' | cut -c1-260 | head -12
}

serve_down() {
  kill -TERM $SERVER 2>/dev/null
  for i in $(seq 1 100); do kill -0 $SERVER 2>/dev/null || break; sleep 0.1; done
  kill -9 $SERVER 2>/dev/null
  wait $SERVER 2>/dev/null
}

preemptions() { curl -s localhost:$PORT/metrics | awk '/^shelfserve_preemptions_total/ {print $2}' | head -1; }

case "${1:-serve}" in
serve)
  make_model
  # First start: kernels compiled (empty kernel cache); second: kernels from the cache.
  echo "== cold start"; serve_up || exit 1; serve_down
  echo "== warm start"; serve_up || exit 1
  "$HERE/shelfserve" bench-serve --base-url http://127.0.0.1:$PORT/v1 --concurrency 4 --num-prompts 8 \
    --input-len $INPUT_LEN --output-len 16 --ignore-eos --no-progress > /dev/null 2>&1   # warm-up
  for c in $CONCURRENCY; do
    n=$(( c == 1 ? 4 : (c < 8 ? 8 : 2 * c) ))
    before=$(preemptions)
    "$HERE/shelfserve" bench-serve --base-url http://127.0.0.1:$PORT/v1 --concurrency $c --num-prompts $n \
      --input-len $INPUT_LEN --output-len $OUTPUT_LEN --ignore-eos --no-progress --json "$OUTDIR/serve-c$c.json" \
      > "$OUTDIR/serve-c$c.txt" 2>&1 || { echo "bench-serve c=$c failed"; tail -5 "$OUTDIR/serve-c$c.txt"; }
    after=$(preemptions)
    echo "c=$c: preemptions $(( ${after:-0} - ${before:-0} )), $(grep -ciE '429|rejected' "$OUTDIR/serve-c$c.txt") lines naming 429"
  done
  "$HERE/shelfserve" bench-serve --base-url http://127.0.0.1:$PORT/v1 --concurrency 1 --num-prompts 4 \
    --input-len 7284 --input-len-range 0 --output-len 1 --ignore-eos --no-progress --json "$OUTDIR/serve-prefill.json" \
    > "$OUTDIR/serve-prefill.txt" 2>&1 || echo "prefill run failed"
  curl -s localhost:$PORT/metrics | grep -E "^shelfserve_(preemptions|requests_rejected|http_requests|step_gap_seconds_(sum|count)|step_over_prediction)" | head -12
  curl -s localhost:$PORT/metrics | grep -E "^shelfserve_step_gap_seconds\{quantile" | head -8
  serve_down
  "$HERE/shelfserve" bench --config "$MODEL/config.json" --batches $(echo $CONCURRENCY | tr ' ' ,) \
    --contexts $(( INPUT_LEN + OUTPUT_LEN / 2 )) --prefill 7284 --json "$OUTDIR/bench.jsonl" > "$OUTDIR/bench.txt" 2>&1 \
    || { echo "bench failed"; tail -5 "$OUTDIR/bench.txt"; }
  python3 - "$OUTDIR" $CONCURRENCY <<'PY'
import json, os, sys
out, conc = sys.argv[1], [int(c) for c in sys.argv[2:]]
bench = [json.loads(l) for l in open(os.path.join(out, "bench.jsonl"))] if os.path.exists(os.path.join(out, "bench.jsonl")) else []
dec = {r["batch"]: r["tok_per_s"] for r in bench if r.get("kind") == "decode"}
pre = [r for r in bench if r.get("kind") == "prefill"]
def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else None
def get(d, *keys):
    for k in keys:
        if isinstance(d, dict) and k in d:
            d = d[k]
        else:
            return None
    return d
print(f"\n{'conc':>5} {'http tok/s':>11} {'steady tok/s':>13} {'bench tok/s':>12} {'http/bench':>10} {'steady/bench':>12} {'ttft p50 ms':>12} {'ttft p99 ms':>12} {'tpot p50 ms':>12} {'failed':>6}")
for c in conc:
    r = load(f"serve-c{c}.json")
    if not r:
        print(f"{c:>5} (no result)"); continue
    tps = get(r, "report", "output_throughput")
    t50, t99, tp50 = get(r, "report", "ttft", "p50_ms"), get(r, "report", "ttft", "p99_ms"), get(r, "report", "tpot", "p50_ms")
    b = dec.get(c)
    steady = get(r, "report", "steady_decode", "tok_per_s")
    ratio = f"{tps / b:.2f}" if (tps and b) else "-"
    sratio = f"{steady / b:.2f}" if (steady and b) else "-"
    f = lambda x: f"{x:.1f}" if isinstance(x, (int, float)) else "-"
    print(f"{c:>5} {f(tps):>11} {f(steady):>13} {f(b):>12} {ratio:>10} {sratio:>12} {f(t50):>12} {f(t99):>12} {f(tp50):>12} {str(get(r, 'report', 'failed')):>6}")
p = load("serve-prefill.json")
if p:
    ttft = get(p, "report", "ttft", "p50_ms")
    for r in pre:
        if ttft:
            served = 7284 / (ttft / 1e3)
            print(f"prefill 7284: served TTFT p50 {ttft:.1f} ms = {served:.0f} tok/s; bench {r['tok_per_s']:.0f} tok/s; served/bench {served / r['tok_per_s']:.2f}")
PY
  ;;
overlap)
  [ -f "$MODEL/model.safetensors.index.json" ] || make_model
  start() {  # $1 = overlap on/off, $2 = first lane port
    setsid "$HERE/shelfserve" serve --device cuda --model "$MODEL" --gpu-memory-utilization 0.45 \
      --overlap-scheduling $1 --lane-port voice=$2,agent=$(( $2 + 1 )) > "$OUTDIR/serve-overlap-$1.log" 2>&1 &
    echo $!
  }
  healthy() { for i in $(seq 1 1200); do curl -sf localhost:$1/health > /dev/null && return 0; sleep 0.1; done; return 1; }
  ON=$(start true 8888); healthy 8888 || { echo "on server did not start"; tail -20 "$OUTDIR/serve-overlap-true.log"; exit 1; }
  OFF=$(start false 8890); healthy 8890 || { echo "off server did not start"; tail -20 "$OUTDIR/serve-overlap-false.log"; exit 1; }
  for port in 8888 8890; do
    "$HERE/shelfserve" bench-serve --base-url http://127.0.0.1:$port/v1 --concurrency 4 --num-prompts 8 \
      --input-len $INPUT_LEN --output-len 16 --ignore-eos --no-progress > /dev/null 2>&1
  done
  for c in $CONCURRENCY; do
    n=$(( c == 1 ? 4 : (c < 8 ? 8 : 2 * c) ))
    for round in 1 2; do
      for mode in off on; do
        port=$([ $mode = on ] && echo 8888 || echo 8890)
        "$HERE/shelfserve" bench-serve --base-url http://127.0.0.1:$port/v1 --concurrency $c --num-prompts $n \
          --input-len $INPUT_LEN --output-len $OUTPUT_LEN --ignore-eos --no-progress \
          --json "$OUTDIR/overlap-$mode-c$c-r$round.json" > "$OUTDIR/overlap-$mode-c$c-r$round.txt" 2>&1 \
          || { echo "bench-serve $mode c=$c failed"; tail -5 "$OUTDIR/overlap-$mode-c$c-r$round.txt"; }
      done
    done
  done
  for port in 8888 8890; do
    echo "port $port:"; curl -s localhost:$port/metrics | grep -E "^shelfserve_(steps_overlapped_total|step_gap_seconds_(sum|count)|preemptions_total)" | head -6
  done
  for pid in $ON $OFF; do kill -TERM $pid 2>/dev/null; done; sleep 2; kill -9 $ON $OFF 2>/dev/null
  "$HERE/shelfserve" bench --config "$MODEL/config.json" --batches $(echo $CONCURRENCY | tr ' ' ,) \
    --contexts $(( INPUT_LEN + OUTPUT_LEN / 2 )) --json "$OUTDIR/bench.jsonl" > "$OUTDIR/bench.txt" 2>&1 \
    || { echo "bench failed"; tail -5 "$OUTDIR/bench.txt"; }
  python3 - "$OUTDIR" $CONCURRENCY <<'PY'
import json, os, sys
out, conc = sys.argv[1], [int(c) for c in sys.argv[2:]]
bp = os.path.join(out, "bench.jsonl")
dec = {r["batch"]: r["tok_per_s"] for r in map(json.loads, open(bp)) if r.get("kind") == "decode"} if os.path.exists(bp) else {}
def best(mode, c, key):
    vals = []
    for r in (1, 2):
        p = os.path.join(out, f"overlap-{mode}-c{c}-r{r}.json")
        if os.path.exists(p):
            rep = json.load(open(p)).get("report", {})
            v = rep.get("steady_decode", {}).get("tok_per_s") if key == "steady" else rep.get(key)
            if isinstance(v, (int, float)):
                vals.append(v)
    return sum(vals) / len(vals) if vals else None
f = lambda x: f"{x:.0f}" if x else "-"
g = lambda a, b: f"{a / b:.3f}" if (a and b) else "-"
print(f"\n{'conc':>5} {'bench':>8} {'steady off':>11} {'steady on':>10} {'off/bench':>9} {'on/bench':>9} {'agg off':>8} {'agg on':>8} {'agg on/off':>10}")
for c in conc:
    b = dec.get(c)
    so, sn = best("off", c, "steady"), best("on", c, "steady")
    ao, an = best("off", c, "output_throughput"), best("on", c, "output_throughput")
    print(f"{c:>5} {f(b):>8} {f(so):>11} {f(sn):>10} {g(so, b):>9} {g(sn, b):>9} {f(ao):>8} {f(an):>8} {g(an, ao):>10}")
PY
  ;;
voice)
  [ -f "$MODEL/model.safetensors.index.json" ] || make_model
  for agents in ${AGENTS:-8 32}; do
    echo "== mixed_load, $agents agents"
    "$HERE/mixed_load" --device cuda --model "$MODEL" --agents $agents --phase ${PHASE:-20s} --rounds 1 \
      --agent-prompt-words 2150 --voice-rate ${VOICE_RATE:-2} --pacing ${PACING:-both} ${MIXED_ARGS:-} --json "$OUTDIR/mixed-$agents${TAG:-}.json" 2> "$OUTDIR/mixed-$agents${TAG:-}.log" \
      || { echo "mixed_load failed"; tail -20 "$OUTDIR/mixed-$agents${TAG:-}.log"; }
  done
  ;;
esac
