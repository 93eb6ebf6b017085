#!/usr/bin/env bash
# `shelfserve kld` of the default model (SmolLM2-135M-Instruct) in the safetensors formats, on the
# CPU. The model ships only as a Q4_1 GGUF, so the reference is that file dequantized to f32 and
# saved as an HF checkpoint (not a bf16 original, which is not reachable from here); the formats
# are made from that checkpoint by the real tools, calibration-free (round-to-nearest from the
# weights), by scripts/quant_default_model.py:
#   fp8             transformers' FineGrainedFP8 (`quant_method: fp8`, 128x128 blocks)
#   fp8-block-ct    llmcompressor FP8_BLOCK (compressed-tensors float-quantized)
#   int4            llmcompressor W4A16 (pack-quantized, group 128)
#   int4-ragged     the same past its divisibility check (bypass_divisibility_checks)
#   int4-g128-skip  W4A16 with the projections whose width is not a multiple of 128 ignored
#   int4-g64        llmcompressor, W4A16's scheme with group 64
#   nvfp4           llmcompressor NVFP4A16
# A format the tool cannot make, or shelfserve refuses, is reported with the reason. Real-text
# prompts (two chats through the chat template, code, prose; 479 tokens) are scored on the
# reference by `shelfserve score`; `shelfserve kld` compares each checkpoint, and the original
# Q4_1 GGUF itself, against them. Prints mean KL over all positions, max KL, top-1 agreement and
# the weight file's size; then transformers' f32 forward as a cross-check: the reference's logits
# against shelfserve's, each format's weights as its tool decompresses them against the reference,
# and the reference with its linear inputs rounded to Q8 blocks (the GGUF path's activation
# arithmetic, which is what separates the GGUF row from the reference).
#
# Needs python with `pip install llmcompressor gguf` (brings torch, transformers and
# compressed-tensors); run with PYTHON=that/python.
#   scripts/quant_kld_default.sh [OUT_DIR]   (default /tmp/shelfserve-quant-kld-default, emptied first)
# SHELFSERVE=path/to/shelfserve uses that binary instead of building the test-profile one.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/shelfserve-quant-kld-default}
PY=${PYTHON:-python3}
H=scripts/quant_default_model.py
if [ -z "${SHELFSERVE:-}" ]; then
  cargo build --profile test --bin shelfserve >&2
  SHELFSERVE=target/debug/shelfserve
fi
S=$SHELFSERVE
# OUT is emptied first, but only a directory this script made (marked) or an empty one.
if [ -n "$(ls -A "$OUT" 2>/dev/null)" ] && [ ! -e "$OUT/.quant_kld_default" ]; then
  echo "$OUT is not empty and not one of this script's output directories" >&2
  exit 2
fi
rm -rf "$OUT"
mkdir -p "$OUT"
touch "$OUT/.quant_kld_default"
"$PY" -c "from importlib.metadata import version as v
print(', '.join(f'{p} {v(p)}' for p in ('torch', 'transformers', 'compressed-tensors', 'llmcompressor', 'gguf')))" |
  tee "$OUT/versions.txt"

GGUF=$("$S" fetch-default 2>/dev/null | tail -1)
"$PY" $H reference "$GGUF" "$OUT/reference" 2>"$OUT/reference.log"
"$PY" $H prompts "$OUT/reference" "$OUT/ids.txt" 2>>"$OUT/reference.log"
n=0
while read -r ids; do
  "$S" score --model "$OUT/reference" --device cpu --input-ids "$ids" --output "$OUT/ref-$n.safetensors" \
    >/dev/null 2>>"$OUT/score.log"
  n=$((n + 1))
done <"$OUT/ids.txt"

# kld NAME MODEL: every prompt's report lines, prefixed by NAME, into kl.txt; 1 when refused.
kld() {
  local p
  for ((p = 0; p < n; p++)); do
    if ! "$S" kld --model "$2" --device cpu --reference "$OUT/ref-$p.safetensors" >"$OUT/kld-$1-$p.txt" 2>"$OUT/kld-$1-$p.err"; then
      grep -m1 '^Error' "$OUT/kld-$1-$p.err" | cut -c1-600
      return 1
    fi
    sed "s/^/$1 /" "$OUT/kld-$1-$p.txt" >>"$OUT/kl.txt"
  done
}

: >"$OUT/kl.txt"
: >"$OUT/sizes.txt"
echo "gguf-q4_1 $(stat -c %s "$GGUF")" >>"$OUT/sizes.txt"
echo "reference-f32 $(stat -c %s "$OUT/reference/model.safetensors")" >>"$OUT/sizes.txt"
kld gguf-q4_1 "$GGUF"
made=()
for f in fp8 fp8-block-ct int4 int4-ragged int4-g128-skip int4-g64 nvfp4; do
  if ! "$PY" $H quantize "$OUT/reference" $f "$OUT/$f" >"$OUT/quantize-$f.log" 2>&1; then
    echo "$f: not made: $(tail -1 "$OUT/quantize-$f.log" | cut -c1-600)"
    continue
  fi
  grep "^$f: " "$OUT/quantize-$f.log"
  made+=("$OUT/$f")
  echo "$f $(stat -c %s "$OUT/$f/model.safetensors")" >>"$OUT/sizes.txt"
  kld $f "$OUT/$f" || true
done

"$PY" - "$OUT/kl.txt" "$OUT/sizes.txt" <<'PY'
import collections, sys
d = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    p = line.split()
    d[p[0]][" ".join(p[1:-1])].append(float(p[-1]))
size = dict(line.split() for line in open(sys.argv[2]))
print(f"{'checkpoint':<16} {'MB':>6} {'positions':>9} {'mean KL':>10} {'max KL':>8} {'top-1':>6}")
for name, v in d.items():
    pos = v["positions"]
    mean = sum(m * n for m, n in zip(v["mean KL divergence"], pos)) / sum(pos)
    top1 = sum(t * n for t, n in zip(v["top-1 agreement"], pos)) / sum(pos)
    print(f"{name:<16} {int(size[name]) / 1e6:>6.1f} {int(sum(pos)):>9} {mean:>10.3e} {max(v['max KL divergence']):>8.3f} {top1:>6.3f}")
PY
echo "cross-check, transformers f32 forward:"
"$PY" $H pykld "$OUT/reference" "$OUT/ids.txt" "$OUT" "${made[@]}" 2>"$OUT/pykld.log"
