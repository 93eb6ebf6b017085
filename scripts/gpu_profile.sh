#!/usr/bin/env bash
# On the GPU machine, after scripts/gpu_build.sh: where one batch-1 decode step's time goes.
# Runs `shelfserve bench` under Nsight Compute (kernel durations only, clocks left alone) with
# CUDA graphs off so each kernel is launched and seen on its own, profiles the kernels of one
# step after the 3 warm-up steps, and prints the time per kernel name (sum over the step).
# Usage: gpu_profile.sh [config.json] [ctx]   (PER_STEP: kernels per decode step, default 163 =
# embed + 5 per layer × 32 + final GEMV + argmax of the fused 8B decode path with the streaming
# decode attention; 195 with SHELFSERVE_CUDA_STREAM_DECODE=0, which adds the combine kernel)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
. "$HERE/gpu_env.sh"
cfg=${1:-$HERE/configs/llama-8b.json}
ctx=${2:-1024}
per_step=${PER_STEP:-163}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "profile: no ncu on this machine"; exit 1; }
csv=${OUT:-/tmp}/profile-ctx$ctx.csv
SHELFSERVE_CUDA_GRAPHS=0 "$NCU" --clock-control none --metrics gpu__time_duration.sum \
  -k 'regex:gemv|attn_|embed|argmax|rmsnorm|qkv_rope|swiglu|add_bias' \
  --launch-skip $((3 * per_step)) --launch-count "$per_step" --csv \
  "$HERE/shelfserve" bench --config "$cfg" --batches 1 --contexts "$ctx" --prefill 16 --steps 2 >"$csv" 2>"$csv.err"
echo "profile: ncu exit $?"
python3 - "$csv" "$ctx" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0] if rows else []
if "Kernel Name" not in head:
    print("profile: no kernel rows"); print(open(sys.argv[1]).read()[-2000:]); sys.exit(0)
ki, ui, vi, gi = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value"), head.index("Grid Size")
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
tot, cnt, grid = collections.Counter(), collections.Counter(), {}
for r in rows[1:]:
    name = r[ki].split("(")[0]
    tot[name] += float(r[vi].replace(",", "")) * scale.get(r[ui], 1.0)
    cnt[name] += 1
    grid[name] = r[gi]
print(f"\n== one decode step, batch 1, ctx {sys.argv[2]}: kernel time by kernel (ncu, graphs off) ==")
print(f"{'kernel':<34} {'launches':>8} {'total us':>10} {'us each':>9} {'grid':>16}")
for name, t in tot.most_common():
    print(f"{name:<34} {cnt[name]:>8} {t:>10.1f} {t / cnt[name]:>9.2f} {grid[name]:>16}")
print(f"{'sum':<34} {sum(cnt.values()):>8} {sum(tot.values()):>10.1f}")
PY
