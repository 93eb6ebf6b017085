#!/usr/bin/env python3
"""Build `tests/fixtures/hf/llama3-tiny-draft`: a draft model for the `llama3-tiny` fixture.

It is `llama3-tiny` with every tensor perturbed by seeded Gaussian noise (2 % of the tensor's own
standard deviation), so it shares the target's 512-id vocabulary, BOS and EOS ids, and agrees with
the target's greedy next token about 80 % of the time: a draft that is partly accepted and partly
rejected, which is what the draft-model tests need. Printed: the measured agreement on random
contexts.

Run with the reference environment (transformers 5.24, torch):
    /opt/refenv/bin/python scripts/gen_hf_draft.py
"""
import json
import pathlib
import shutil

import torch
from transformers import AutoModelForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
SRC = ROOT / "llama3-tiny"
DST = ROOT / "llama3-tiny-draft"
NOISE = 0.02
SEED = 1


def main():
    target = AutoModelForCausalLM.from_pretrained(SRC, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(SRC, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for _, p in sorted(draft.named_parameters()):
            if p.numel() > 1:
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * NOISE)
        ctx = torch.randint(3, 500, (16, 40), generator=torch.Generator().manual_seed(0))
        agree = (draft(ctx).logits.argmax(-1) == target(ctx).logits.argmax(-1)).float().mean().item()
    if DST.exists():
        shutil.rmtree(DST)
    draft.save_pretrained(DST, safe_serialization=True)
    shutil.copy(SRC / "generation_config.json", DST / "generation_config.json")
    cfg = json.loads((DST / "config.json").read_text())
    assert cfg["vocab_size"] == 512 and cfg["eos_token_id"] == 2, cfg
    print(f"wrote {DST}: greedy next-token agreement with llama3-tiny on random contexts {agree:.3f}")


if __name__ == "__main__":
    main()
