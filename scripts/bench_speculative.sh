#!/usr/bin/env bash
# Speculative decoding benchmark (issue 7): one release server with a plain lane and an n-gram
# drafting lane (k = 7), the same greedy requests on both, code/agent and prose workloads.
# usage: scripts/bench_speculative.sh [THREADS]
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${1:-$(nproc)}"
cargo build --release --quiet
BIN=target/release/shelfserve
free_port() { python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
wait_health() { for _ in $(seq 1 600); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.2; done; echo "server at $1 did not come up" >&2; return 1; }
CFG=$(mktemp --suffix .toml)
PLAIN=$(free_port); DRAFTED=$(free_port)
sed -e "s/^port = 8888/port = $PLAIN/" -e "s/^port = 8889/port = $DRAFTED/" configs/default.toml > "$CFG"
python3 - "$CFG" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
# The agent lane drafts; the voice lane does not.
s = s.replace('name = "agent"', 'name = "agent"\nspeculative = "ngram"\nnum_speculative_tokens = 7')
open(p, "w").write(s)
PY
SHELFSERVE_LOG=warn $BIN serve --config "$CFG" --threads "$THREADS" &
PID=$!
trap 'kill $PID 2>/dev/null || true; rm -f "$CFG"' EXIT
wait_health "http://127.0.0.1:$PLAIN/health"
echo "== shelfserve $(git rev-parse --short HEAD), $THREADS threads: plain lane :$PLAIN, n-gram lane :$DRAFTED"
python3 scripts/bench_speculative.py "http://127.0.0.1:$PLAIN" "http://127.0.0.1:$DRAFTED"
