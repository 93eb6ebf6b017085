#!/usr/bin/env bash
# On the GPU machine, from the repository root, after scripts/gpu_build.sh: run the CUDA
# validation tests (tests/gpu_validate.rs, ignored in CI) and print their tables.
# Output also goes to $OUT/validate.log when OUT is set.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib:/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
# Fixtures are found under the directory the test binary was built in: point it here.
built=$(cat "$HERE/manifest_dir")
if [ ! -e "$built/tests/fixtures" ]; then mkdir -p "$(dirname "$built")" && ln -sfn "$PWD" "$built"; fi
log=${OUT:-/tmp}/validate.log
"$HERE/gpu_validate" --include-ignored --nocapture --test-threads=1 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
