"""Tiny random DFlash and DFlash2 drafters for the tiny llama target, and golden proposals.

Uses the reference implementation itself (the `dflash` package, z-lab's DFlash / DFlash2 draft
models) on top of transformers, so what the Rust drafter must reproduce is what that code computes:

    /work/wt/venv/bin/pip install --no-deps dflash==0.1.0
    /work/wt/venv/bin/python scripts/gen_dflash_tiny.py

Writes tests/fixtures/dflash/{dflash,dflash2}/ (config.json + model.safetensors in the published
checkpoint layout) and tests/fixtures/dflash/golden.json: for two contexts of the target
(`tests/fixtures/hf/llama3-tiny`), each drafter's greedy block proposal, plus the plain DFlash
drafter's logits for the first context.
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen3Config

from dflash.model import DFlash2DraftModel, DFlashDraftModel, extract_context_feature

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "tests/fixtures/hf/llama3-tiny")
OUT = os.path.join(ROOT, "tests/fixtures/dflash")
BLOCK = 8
MASK = 511
LAYERS = [0, 1]

torch.manual_seed(1234)
torch.set_num_threads(1)
target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()


def config(v2: bool) -> Qwen3Config:
    cfg = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        attention_bias=False,
    )
    cfg.is_causal = False
    cfg.num_target_layers = 2
    dflash = {"block_size": BLOCK, "mask_token_id": MASK, "target_layer_ids": LAYERS}
    if v2:
        dflash.update(
            {
                "conv_kernel_size": 2,
                "conv_group_size": 16,
                "selector_rank": 16,
                "selector_top_k": 4,
                "output_multiplier": 0.75,
                "final_logit_softcapping": 20.0,
            }
        )
    cfg.dflash_config = dflash
    cfg.architectures = ["DFlash2DraftModel" if v2 else "DFlashDraftModel"]
    return cfg


def randomize(model: torch.nn.Module) -> None:
    """Weights large enough that every part matters (the default init is nearly zero)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * (2 * torch.rand_like(p) - 1))
            elif "base_kernel" in name or "codebook" in name:
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_((2 * torch.rand_like(p) - 1) / p.shape[-1] ** 0.5)
            # Blocks that write into the residual stream are scaled up, so the mask token's own
            # embedding (the tied head's strongest match for it) does not decide every proposal.
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(8.0)


def save(model: torch.nn.Module, cfg: Qwen3Config, path: str) -> None:
    os.makedirs(path, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    # The published DFlash2 checkpoints store the codebooks without the `.weight` suffix.
    state = {k.removesuffix(".weight") if "codebook" in k else k: v for k, v in state.items()}
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cfg.to_json_file(os.path.join(path, "config.json"))


drafters = {}
for name, cls, v2 in [("dflash", DFlashDraftModel, False), ("dflash2", DFlash2DraftModel, True)]:
    cfg = config(v2)
    model = cls(cfg).float().eval()
    randomize(model)
    save(model, cfg, os.path.join(OUT, name))
    drafters[name] = model

# The target's greedy continuation of a prompt: contexts are its prefixes.
prompt = [(i * 37 + 11) % 500 + 3 for i in range(12)]
ids = list(prompt)
with torch.no_grad():
    for _ in range(8):
        ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
    out = target(torch.tensor([ids]), output_hidden_states=True)
features = extract_context_feature(out.hidden_states, LAYERS)  # [1, len, 2 * hidden]

head = target.get_output_embeddings()
cases = []
for ctx_len in (12, 15):
    anchor = ids[ctx_len]
    block = torch.tensor([[anchor] + [MASK] * (BLOCK - 1)])
    noise = target.get_input_embeddings()(block)
    positions = torch.arange(0, ctx_len + BLOCK)[None]
    case = {"context": ids[: ctx_len + 1], "proposals": {}}
    with torch.no_grad():
        for name, model in drafters.items():
            hidden = model(
                target_hidden=features[:, :ctx_len],
                noise_embedding=noise,
                position_ids=positions,
                past_key_values=None,
                use_cache=False,
            )[:, 1 - BLOCK :, :]
            if isinstance(model, DFlash2DraftModel):
                path, _, _ = model.propose(hidden, block[:, 0], head, 0.0)
                case["proposals"][name] = path[0].tolist()
            else:
                logits = model.compute_logits(hidden, head)
                case["proposals"][name] = logits[0].argmax(-1).tolist()
                if ctx_len == 12:
                    case["dflash_logits"] = [[round(float(v), 6) for v in row] for row in logits[0]]
    cases.append(case)

with open(os.path.join(OUT, "golden.json"), "w") as f:
    json.dump({"target": "tests/fixtures/hf/llama3-tiny", "cases": cases}, f)
import dflash, transformers, safetensors
with open(os.path.join(OUT, "VERSIONS.txt"), "w") as f:
    f.write(
        f"dflash {getattr(dflash, '__version__', '0.1.0')}\ntransformers {transformers.__version__}\n"
        f"torch {torch.__version__}\nsafetensors {safetensors.__version__}\npython {sys.version.split()[0]}\n"
    )
for c in cases:
    print(len(c["context"]), c["proposals"])
