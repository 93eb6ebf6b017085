# Sourced by the scripts that run on the GPU machine (gpu_validate, gpu_sampling, gpu_bench,
# gpu_profile, gpu_tp), with HERE set to the payload directory: the CUDA, cuBLAS and NCCL
# libraries of that machine's torch install and CUDA toolkit on the library path, NVLink
# multicast off (KINDS.md), and `link_fixtures`, which lets a test binary find its fixtures.
GPU_SITE=/opt/torch/.venv/lib/python3.12/site-packages/nvidia
export LD_LIBRARY_PATH=$GPU_SITE/cu13/lib:$GPU_SITE/nccl/lib:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0

# Test binaries look for tests/fixtures under the directory they were built in (recorded by
# gpu_build.sh in manifest_dir): point that directory at this checkout.
link_fixtures() {
  local built
  built=$(cat "$HERE/manifest_dir")
  if [ ! -e "$built/tests/fixtures" ]; then mkdir -p "$(dirname "$built")" && ln -sfn "$PWD" "$built"; fi
}

# Payload scripts that carry an xz-compressed build beside them: unpack it to $HERE/shelfserve;
# results go to $O ($OUT on the device machine, else /tmp), scratch files to a fresh $R.
unpack_payload() {
  xz -d -k -f "$HERE/shelfserve.xz" && chmod +x "$HERE/shelfserve"
  O=${OUT:-/tmp}
  R=$(mktemp -d)
}

# The payload's glm5 bench config `configs/glm5-next-flash$1.json` ($1: "", -fp8, -int4) cut to $2
# layers, written to $R/g$2$1.json.
layered_config() {
  python3 -c "import json,sys; c=json.load(open(sys.argv[1])); c['num_hidden_layers']=int(sys.argv[3]); json.dump(c, open(sys.argv[2],'w'))" \
    "$HERE/configs/glm5-next-flash$1.json" "$R/g$2$1.json" "$2"
}
