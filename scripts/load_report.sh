#!/usr/bin/env bash
# Mixed-load report (issue 3): starts a release shelfserve on the default model with both lanes,
# drives them at once with scripts/load_report.py, and prints per-lane requests/s, tokens/s,
# TTFT and inter-token percentiles.
#
# usage: scripts/load_report.sh [DURATION_S] [AGENTS] [VOICE_RATE] [extra serve flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION="${1:-60}"; AGENTS="${2:-6}"; RATE="${3:-0.5}"; shift $(( $# < 3 ? $# : 3 ))
cargo build --release --quiet
BIN=target/release/shelfserve
free_port() { python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])"; }
wait_health() { for _ in $(seq 1 600); do curl -sf "$1" >/dev/null 2>&1 && return 0; sleep 0.2; done; echo "server at $1 did not come up" >&2; return 1; }
VP=$(free_port); AP=$(free_port)
SHELFSERVE_LOG=warn $BIN serve --lane-port "voice=$VP,agent=$AP" "$@" &
PID=$!
trap 'kill $PID 2>/dev/null || true' EXIT
wait_health "http://127.0.0.1:$VP/health"
echo "== shelfserve $(git rev-parse --short HEAD), $(nproc) cores, voice :$VP agent :$AP"
python3 scripts/load_report.py --voice "http://127.0.0.1:$VP/v1" --agent "http://127.0.0.1:$AP/v1" \
  --duration "$DURATION" --agents "$AGENTS" --voice-rate "$RATE"
