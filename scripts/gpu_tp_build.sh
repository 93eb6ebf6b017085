#!/usr/bin/env bash
# Build the CUDA tensor-parallel payload (release binary, gpu_tp test binary, scripts/gpu_tp.sh,
# bench configs) into DEST (default .dev/tp). Then, on the two-GPU machine, from the repository
# root, with DEST carried: DEST/gpu_tp.sh. Kept as an entry point; the build is gpu_build.sh's.
exec "$(dirname "$0")/gpu_build.sh" tp
