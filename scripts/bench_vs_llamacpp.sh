#!/usr/bin/env bash
# Our engine vs llama.cpp's server (llama-cpp-python) on the same GGUF, same machine, same run:
# single-stream decode tok/s and 8-parallel aggregate tok/s, and the ratios.
#
# usage: scripts/bench_vs_llamacpp.sh [GGUF] [THREADS]
#   GGUF defaults to the cached default model (fetched if needed); THREADS to all cores.
# Needs: a release build (built here if missing) and python3 with pip (installs
# llama-cpp-python[server] into .bench-venv on first use; that compiles llama.cpp, minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${2:-$(nproc)}"
cargo build --release --quiet
BIN=target/release/shelfserve
GGUF="${1:-$($BIN fetch-default 2>/dev/null | tail -n1)}"
VENV="${BENCH_VENV:-.bench-venv}"
if ! "$VENV/bin/python" -c "import llama_cpp.server" 2>/dev/null; then
  echo "== installing llama-cpp-python[server] into $VENV (compiles llama.cpp; this takes a while)"
  python3 -m venv "$VENV"
  CMAKE_ARGS="-DGGML_NATIVE=ON" "$VENV/bin/pip" install --quiet 'llama-cpp-python[server]'
fi
LLAMA_VERSION=$("$VENV/bin/python" -c "import llama_cpp; print(llama_cpp.__version__)")
free_port() { python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
wait_health() { for _ in $(seq 1 300); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.2; done; echo "server at $1 did not come up" >&2; return 1; }
OUT=$(mktemp -d)
cleanup() { kill "${PIDS[@]}" 2>/dev/null || true; rm -rf "$OUT"; }
PIDS=()
trap cleanup EXIT

echo "== shelfserve ($THREADS threads)"
P=$(free_port)
SHELFSERVE_LOG=warn $BIN serve --model "$GGUF" --threads "$THREADS" --lane-port "voice=$P,agent=0" --max-num-seqs 8 &
PIDS+=($!)
wait_health "http://127.0.0.1:$P/health"
python3 scripts/bench_client.py "http://127.0.0.1:$P/v1" --label shelfserve --json "$OUT/ours.json"
kill "${PIDS[0]}"; wait "${PIDS[0]}" 2>/dev/null || true

echo "== llama.cpp server (llama-cpp-python $LLAMA_VERSION, $THREADS threads)"
P=$(free_port)
"$VENV/bin/python" -m llama_cpp.server --model "$GGUF" --n_threads "$THREADS" --n_threads_batch "$THREADS" \
  --n_ctx 4096 --interrupt_requests False --host 127.0.0.1 --port "$P" >"$OUT/llama.log" 2>&1 &
PIDS+=($!)
wait_health "http://127.0.0.1:$P/v1/models"
python3 scripts/bench_client.py "http://127.0.0.1:$P/v1" --label llama.cpp --json "$OUT/llama.json"

python3 - "$OUT/ours.json" "$OUT/llama.json" "$LLAMA_VERSION" <<'PY'
import json, sys
o, l = (json.load(open(p)) for p in sys.argv[1:3])
print()
print(f"| metric | shelfserve | llama.cpp (llama-cpp-python {sys.argv[3]}) | ratio |")
print("|---|---|---|---|")
for k, name in [("single_stream_tok_s", "single-stream decode tok/s"), ("parallel_aggregate_tok_s", "8-parallel aggregate tok/s")]:
    print(f"| {name} | {o[k]:.1f} | {l[k]:.1f} | {o[k] / l[k]:.2f}x |")
print(f"| single-stream TTFT (s) | {o['single_ttft_s']:.3f} | {l['single_ttft_s']:.3f} | |")
print(f"| 8-parallel completion tokens | {o['parallel_tokens']} | {l['parallel_tokens']} | |")
for r in (o, l):
    if r["parallel_errors"]:
        print(f"{r['label']}: {len(r['parallel_errors'])} parallel requests failed: {r['parallel_errors'][0]}")
PY
