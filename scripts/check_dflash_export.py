"""Check a drafter written by train_dflash.py against the reference implementation: it must load
into z-lab's DFlashDraftModel with no missing or unexpected tensors, and the training module must
compute what the reference computes on random context features and a random block.

    /work/wt/venv/bin/pip install --no-deps dflash==0.1.0
    python scripts/check_dflash_export.py DIR
"""

import json
import os
import sys

import torch
from dflash.model import DFlashDraftModel
from safetensors.torch import load_file
from transformers import Qwen3Config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_dflash  # noqa: E402

d = sys.argv[1]
c = json.load(open(os.path.join(d, "config.json")))
state = load_file(os.path.join(d, "model.safetensors"))
ref = DFlashDraftModel(Qwen3Config.from_dict(c)).float().eval()
missing, unexpected = ref.load_state_dict(state, strict=False)
assert not missing and not unexpected, (missing, unexpected)
mine = train_dflash.DFlashDrafter(c).eval()
mine.load_state_dict(state)
torch.manual_seed(0)
ctx, bs, h = 20, c["dflash_config"]["block_size"], c["hidden_size"]
feats = torch.randn(1, ctx, len(c["dflash_config"]["target_layer_ids"]) * h)
emb = torch.randn(1, bs, h)
with torch.no_grad():
    want = ref(target_hidden=feats, noise_embedding=emb, position_ids=torch.arange(ctx + bs)[None], use_cache=False)
    got = mine(feats, emb, torch.arange(ctx)[None], torch.arange(ctx, ctx + bs)[None], torch.ones(1, bs, ctx + bs, dtype=torch.bool))
diff = (want - got).abs().max().item()
print(f"reference vs training module: max |diff| {diff:.3g}")
assert diff < 1e-4
