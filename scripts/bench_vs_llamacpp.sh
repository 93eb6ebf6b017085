#!/usr/bin/env bash
# Our engine vs llama.cpp's server (llama-cpp-python) on the same GGUF, same machine, same run:
# single-stream decode tok/s and 8-parallel aggregate tok/s, and the ratios.
#
# usage: scripts/bench_vs_llamacpp.sh [GGUF] [THREADS] [QUANT]
#   GGUF defaults to the cached default model (fetched if needed); THREADS to all cores.
#   QUANT (Q4_K_M, Q5_K_M, Q6_K, Q4_K_S, Q5_K_S, Q8_0, ...): first quantize GGUF with llama.cpp's
#   own quantizer (llama_model_quantize, requantizing if needed) and compare on that file. K-quants
#   need rows that are multiples of 256 (llama.cpp falls back to Q5_0/Q5_1 elsewhere, which
#   shelfserve refuses by name): the default model (hidden 576) is not such a model; one that is:
#     python scripts/gen_llamacpp_kquant_golden.py --bench-source /tmp/kq-bench-f32.gguf
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
QUANT="${3:-}"
if [ -n "$QUANT" ]; then
  QDIR=$(mktemp -d)
  SRC="$GGUF"
  GGUF="$QDIR/$(basename "${SRC%.gguf}")-$QUANT.gguf"
  echo "== quantizing $SRC to $QUANT with llama.cpp's quantizer"
  "$VENV/bin/python" - "$SRC" "$GGUF" "$QUANT" <<'PY'
import sys, llama_cpp
src, dst, quant = sys.argv[1:4]
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant}")
p.allow_requantize = True
assert llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p) == 0, "llama_model_quantize failed"
PY
fi
free_port() { python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
wait_health() { for _ in $(seq 1 300); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.2; done; echo "server at $1 did not come up" >&2; return 1; }
OUT=$(mktemp -d)
cleanup() { kill "${PIDS[@]}" 2>/dev/null || true; rm -rf "$OUT" "${QDIR:-}"; }
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

python3 - "$OUT/ours.json" "$OUT/llama.json" "$LLAMA_VERSION" "$(basename "$GGUF")" <<'PY'
import json, sys
o, l = (json.load(open(p)) for p in sys.argv[1:3])
print()
print(f"model: {sys.argv[4]}")
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
