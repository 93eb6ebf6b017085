#!/usr/bin/env bash
# Speculative decoding benchmark (issues 7, 19): one release server with a plain lane and a
# drafting lane (k = 7), the same greedy requests on both, code/agent and prose workloads; prints
# tok/s per lane, the speedup and the acceptance by draft position from /metrics.
# usage: scripts/bench_speculative.sh [THREADS]
#   DRAFT=dflash:DIR   the drafting lane's method (default ngram; also draft:PATH, mtp)
#   DEVICE=cuda        the server's --device (default auto); CUDA_PRECISION=f32 for validation
#   BIN=PATH           a prebuilt shelfserve, no cargo build (the GPU machine has no toolchain)
#   MAX_TOKENS=128     tokens per request
# e.g. on the H200: BIN=.dev/cuda/shelfserve DEVICE=cuda DRAFT=dflash:drafters/smollm2 scripts/bench_speculative.sh
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${1:-$(nproc)}"
DRAFT="${DRAFT:-ngram}"
if [ -z "${BIN:-}" ]; then
  cargo build --release --quiet
  BIN=target/release/shelfserve
fi
free_port() { python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
wait_health() { for _ in $(seq 1 1500); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.2; done; echo "server at $1 did not come up" >&2; return 1; }
CFG=$(mktemp --suffix .toml)
PLAIN=$(free_port); DRAFTED=$(free_port)
sed -e "s/^port = 8888/port = $PLAIN/" -e "s/^port = 8889/port = $DRAFTED/" configs/default.toml > "$CFG"
DRAFT="$DRAFT" python3 - "$CFG" <<'PY'
import os, sys
p = sys.argv[1]
s = open(p).read()
# The agent lane drafts; the voice lane does not.
s = s.replace('name = "agent"', 'name = "agent"\nspeculative = "%s"\nnum_speculative_tokens = 7' % os.environ["DRAFT"])
open(p, "w").write(s)
PY
DEV_ARGS=()
[ -n "${DEVICE:-}" ] && DEV_ARGS+=(--device "$DEVICE")
[ -n "${CUDA_PRECISION:-}" ] && DEV_ARGS+=(--cuda-precision "$CUDA_PRECISION")
SHELFSERVE_LOG=${SHELFSERVE_LOG:-warn} $BIN serve --config "$CFG" --threads "$THREADS" "${DEV_ARGS[@]}" &
PID=$!
trap 'kill $PID 2>/dev/null || true; rm -f "$CFG"' EXIT
wait_health "http://127.0.0.1:$PLAIN/health"
LABEL="${DRAFT%%:*}"
echo "== shelfserve $(git rev-parse --short HEAD 2>/dev/null || echo '?'), device ${DEVICE:-auto}, $THREADS threads: plain lane :$PLAIN, $DRAFT lane :$DRAFTED"
python3 scripts/bench_speculative.py "http://127.0.0.1:$PLAIN" "http://127.0.0.1:$DRAFTED" \
  --label "$LABEL" --source "$LABEL" --max-tokens "${MAX_TOKENS:-128}"
