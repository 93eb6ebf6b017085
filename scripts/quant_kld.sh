#!/usr/bin/env bash
# `shelfserve kld` of the quantized safetensors fixtures (tests/fixtures/quant/{llama,glm5}-
# {fp8,int4,nvfp4}) against their unquantized originals, on the CPU: the originals are rebuilt
# with scripts/gen_quant_fixtures.py's own seeded `make_base` (needs torch, transformers and
# compressed-tensors at the versions in tests/fixtures/quant/VERSIONS.txt; the unquantized tensors
# of the fixtures are checked to be equal to the rebuilt ones), scored with `shelfserve score` on
# 4 seeded prompts of 64 random ids, then compared. Prints mean KL (averaged over the prompts),
# max KL and top-1 agreement per fixture.
#   scripts/quant_kld.sh [OUT_DIR]   (default /tmp/shelfserve-quant-kld)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/shelfserve-quant-kld}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
cargo build --profile test --bin shelfserve >&2
S=target/debug/shelfserve
(cd scripts && "$PY" - "$OUT" <<'PY'
import sys, torch
out = sys.argv[1]
sys.argv = [sys.argv[0]]
import gen_quant_fixtures as g
from safetensors.torch import load_file
for kind in ["llama", "glm5"]:
    state, _ = g.make_base(kind, out)
    fx = load_file(f"../tests/fixtures/quant/{kind}-fp8/model.safetensors")
    floats = (torch.float32, torch.bfloat16, torch.float16)
    plain = [k for k in fx if k in state and fx[k].dtype in floats and fx[k].shape == state[k].shape]
    bad = [k for k in plain if not torch.equal(fx[k].float(), state[k].float())]
    if bad:
        sys.exit(f"{kind}: the rebuilt original differs from the fixture's unquantized tensors {bad[:3]}")
    print(f"{kind}: original rebuilt, {len(plain)} unquantized tensors equal to the fixture's", file=sys.stderr)
PY
)
: > "$OUT/kl.txt"
for kind in llama glm5; do
  vocab=$("$PY" -c "import json;c=json.load(open('$OUT/$kind/config.json'));print(c.get('text_config',c)['vocab_size'])")
  for p in 0 1 2 3; do
    ids=$("$PY" -c "import random;r=random.Random($p*7+1);print(','.join(str(r.randrange(1,$vocab)) for _ in range(64)))")
    "$S" score --model "$OUT/$kind" --device cpu --input-ids "$ids" --output "$OUT/ref-$kind-$p.safetensors" >/dev/null 2>&1
    for f in fp8 int4 nvfp4; do
      "$S" kld --model "tests/fixtures/quant/$kind-$f" --device cpu --reference "$OUT/ref-$kind-$p.safetensors" 2>/dev/null |
        grep -E "mean KL|max KL|top-1" | sed "s/^/$kind $f $p /" >> "$OUT/kl.txt"
    done
  done
done
"$PY" - "$OUT/kl.txt" <<'PY'
import collections, sys
d = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    p = line.split()
    d[(p[0], p[1])][" ".join(p[3:-1])].append(float(p[-1]))
print(f"{'fixture':<14} {'mean KL':>10} {'max KL':>8} {'top-1':>6}")
for (kind, f), v in d.items():
    mean = sum(v["mean KL divergence"]) / len(v["mean KL divergence"])
    top1 = sum(v["top-1 agreement"]) / len(v["top-1 agreement"])
    print(f"{kind + '-' + f:<14} {mean:>10.3e} {max(v['max KL divergence']):>8.3f} {top1:>6.3f}")
PY
