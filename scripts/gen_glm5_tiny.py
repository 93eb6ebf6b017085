#!/usr/bin/env python3
"""Generate a tiny random GLM-5.3-Flash (`glm5_next`) checkpoint and its golden outputs.

Run from the repository root with the reference environment (CPU, fp32, no optional kernels):

    /opt/refenv/bin/python scripts/gen_glm5_tiny.py

Writes tests/fixtures/glm5/tiny/ (config.json + model.safetensors exactly as transformers'
`save_pretrained` writes them: on-disk names, per-expert tensors, split q/k/v conv, `hc_attn_*`,
a tiny vision tower that the engine must set aside) and tests/fixtures/glm5/golden.safetensors.
Versions used go to tests/fixtures/glm5/VERSIONS.txt.

The config covers every text path with tiny dims:
  layers        [KDA, DSA(full), DSA(shared), KDA, DSA(full)]
  mlp           [dense, dense, sparse, sparse, sparse]   (MoE under KDA, full and shared DSA)
  MoE           8 experts, top-3, n_group 2 / topk_group 1 (group-limited), swiglu_limit 1.0 so the
                clamps fire, 1 shared expert
  DSA           index_kpool 4, index_topk 8 (2 pools) with 8 indexer heads: prompts of 80 tokens
                have 20 pools, so selection is sparse from t = 11 on; tails of 1..3 tokens
  KDA           prompt 80 > HF's chunk of 64: two chunks in the chunked (prefill) path; decode
                uses the recurrent path
Weights are re-randomised at fan-in scale (HF's init leaves gates, ape, mHC base, A_log and the
router bias degenerate). The script refuses a seed whose DSA top-k has an exact tie at the
selection boundary (spec §9: ReLU scores tie at 0).

A second, smaller checkpoint tests/fixtures/glm5/tiny-flat/ (golden: golden-flat.safetensors,
prompt 0 only, length 70) is closer in kind to the real config and covers the other loader and
gate paths:
  * saved with save_original_format=False (in-memory names: packed `experts.gate_up_proj` /
    `experts.down_proj`, packed `conv1d`, `attn_hc.fn`, `forget_gate.*`), vision tensors dropped,
    and config.json rewritten as a flat text-only config (no `text_config`);
  * n_group 1, swiglu_limit 10, linear_lower_bound null (the unbounded -exp(A)·softplus gate),
    layers [KDA, DSA(full), DSA(full)], mlp [dense, sparse, sparse].

golden.safetensors, for prompt i = 0, 1 (ids pseudo-random, lengths 80 and 37):
  ids_{i}          i64 [n]
  logits_{i}       f32 [n, V]   full forward without cache
  greedy_{i}       i64 [24]     generate(do_sample=False, max_new_tokens=24) with the HF cache
                                (prefill: chunked KDA; then recurrent KDA, latent cache)
  greedy_logits_{i} f32 [24, V] the logits `generate` saw at each step
  topk_{i}.{l}     i32 [n, k_I + P - 1]  DSA selection of full layer l, sorted, -1 = none
  router_idx_{i}.{l} i64 [n, k]  MoE experts per token, sorted by id
"""

import math
import os
import platform
import shutil
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "glm5"
SEED = 1234
NEW_TOKENS = 24
PROMPT_LENS = [80, 37]
KDA, DSA = "linear_attention", "deepseek_sparse_attention"

TEXT = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
    num_hidden_layers=5, layer_types=[KDA, DSA, DSA, KDA, DSA],
    indexer_types=["full", "full", "shared", "full", "full"],
    mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse"],
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32, kv_lora_rank=16,
    qk_nope_head_dim=16, v_head_dim=16, qk_rope_head_dim=0,
    linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
    n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=2, topk_group=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, swiglu_limit=1.0,
    index_n_heads=8, index_head_dim=16, index_kpool=4, index_topk=8,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-5,
    pad_token_id=0, eos_token_id=None, bos_token_id=None, tie_word_embeddings=False,
)
FLAT_TEXT = dict(TEXT, vocab_size=128, hidden_size=32, intermediate_size=48, moe_intermediate_size=8,
                 num_hidden_layers=3, layer_types=[KDA, DSA, DSA], indexer_types=["full"] * 3,
                 mlp_layer_types=["dense", "sparse", "sparse"], n_group=1, topk_group=1,
                 num_experts_per_tok=2, swiglu_limit=10.0, linear_lower_bound=None)
FLAT_PROMPT_LEN = 70
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=64,
              projection_intermediate_size=16)


def randomize(model, seed, gain=0.6):
    g = torch.Generator().manual_seed(seed)
    n = lambda shape, s: torch.randn(shape, generator=g) * s
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("model.visual"):
                p.copy_(n(p.shape, 0.02))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(n(p.shape, 1.0))
            elif name.endswith("A_log"):
                p.copy_(n(p.shape, 0.5))
            elif name.endswith("dt_bias") or name.endswith(".base"):
                p.copy_(n(p.shape, 0.5))
            elif name.endswith(".scale") or (p.ndim == 1 and name.endswith("weight")):
                p.copy_(1 + n(p.shape, 0.1))
            elif p.ndim == 1 or name.endswith("compress_ape"):
                p.copy_(n(p.shape, 0.1 if p.ndim == 1 else 0.5))
            else:  # fan-in scaled (conv: fan-in = kernel)
                p.copy_(n(p.shape, gain / math.sqrt(p.shape[-1])))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(n(b.shape, 0.05))


def boundary_ties(model, ids):
    """Queries whose k-th and (k+1)-th best candidate pools score exactly the same."""
    lm, ties, captured = model.model.language_model, [], {}
    hooks = []
    for i, layer in enumerate(lm.layers):
        ix = getattr(layer.self_attn, "indexer", None)
        if ix is not None:
            def pre(mod, args, kwargs, i=i):
                captured[i] = (kwargs["hidden_states"], kwargs["q_resid"])
            hooks.append(ix.register_forward_pre_hook(pre, with_kwargs=True))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    for i, (hs, qr) in captured.items():
        ix = lm.layers[i].self_attn.indexer
        with torch.no_grad():
            b, s = hs.shape[:2]
            q = ix.wq_b(qr).view(b, s, -1, ix.head_dim)
            k = ix.k_norm(ix.wk(hs))
            gate = torch.nn.functional.linear(hs, ix.index_kpool_compress_gate)
            packed = torch.cat([k, gate, torch.ones(b, s, 1)], -1)
            pool_keys, pool_idx, _ = ix.get_pooled_states(packed)
            sc = torch.relu(torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1)) * ix.softmax_scale)
            w = ix.weights_proj(hs).float() * ix.n_heads**-0.5
            idx = torch.matmul(w.unsqueeze(-2), sc).squeeze(-2)[0]
        budget = ix.index_topk // ix.index_kpool
        for t in range(s):
            nc = (t + 1) // ix.index_kpool
            if nc > budget:
                v = idx[t, :nc].sort(descending=True).values
                if v[budget - 1] == v[budget]:
                    ties.append((i, t))
    return ties


def dump_prompt(model, ids, tag, out):
    lm = model.model.language_model
    hooks = []
    for l, layer in enumerate(lm.layers):
        ix = getattr(layer.self_attn, "indexer", None)
        if ix is not None:
            hooks.append(ix.register_forward_hook(
                lambda mod, a, o, l=l: out.__setitem__(f"topk_{tag}.{l}", o[0].sort(-1).values.to(torch.int32).contiguous())))
        if hasattr(layer.mlp, "gate"):
            hooks.append(layer.mlp.gate.register_forward_hook(
                lambda mod, a, o, l=l: out.__setitem__(f"router_idx_{tag}.{l}", o[2].sort(-1).values.contiguous())))
    with torch.no_grad():
        out[f"logits_{tag}"] = model(input_ids=ids, use_cache=False).logits[0].float().contiguous()
    for h in hooks:
        h.remove()
    with torch.no_grad():
        gen = model.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             return_dict_in_generate=True, output_logits=True, eos_token_id=None, pad_token_id=0)
    greedy = gen.sequences[0, ids.shape[1]:].clone()
    assert greedy.numel() == NEW_TOKENS
    # The cache path must agree with a cache-free argmax loop (HF checks itself).
    seq = ids
    for _ in range(NEW_TOKENS):
        with torch.no_grad():
            nxt = model(input_ids=seq, use_cache=False).logits[0, -1].argmax()
        seq = torch.cat([seq, nxt.view(1, 1)], 1)
    if not torch.equal(seq[0, ids.shape[1]:], greedy):
        sys.exit(f"prompt {tag}: cached generate differs from the cache-free argmax loop")
    out[f"ids_{tag}"] = ids[0].clone()
    out[f"greedy_{tag}"] = greedy
    out[f"greedy_logits_{tag}"] = torch.cat(gen.logits, 0).float().contiguous()
    print(f"prompt {tag} (len {ids.shape[1]}): greedy {greedy.tolist()}")


def main():
    torch.set_num_threads(2)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cfg = Glm5NextConfig(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Glm5NextForConditionalGeneration(cfg).eval()
    randomize(model, SEED)
    g = torch.Generator().manual_seed(SEED + 1)
    prompts = [torch.randint(1, TEXT["vocab_size"], (1, n), generator=g) for n in PROMPT_LENS]
    for p in prompts:
        ties = boundary_ties(model, p)
        if ties:
            sys.exit(f"exact DSA top-k ties at (layer, query) {ties[:5]}: change SEED")
    tiny = OUT / "tiny"
    if tiny.exists():
        shutil.rmtree(tiny)
    model.save_pretrained(tiny)
    # Reload what was saved, so the goldens come from the files the engine reads.
    model = Glm5NextForConditionalGeneration.from_pretrained(tiny, dtype=torch.float32, attn_implementation="sdpa").eval()
    out = {}
    for i, p in enumerate(prompts):
        dump_prompt(model, p, str(i), out)
    save_file({k: v.contiguous() for k, v in out.items()}, str(OUT / "golden.safetensors"))
    (OUT / "VERSIONS.txt").write_text(
        f"transformers {transformers.__version__}\ntorch {torch.__version__}\npython {platform.python_version()}\n"
        f"device cpu, dtype float32, attn sdpa, no fla / causal_conv1d kernels (HF's reference PyTorch paths)\n"
    )
    make_flat_variant()
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"wrote {OUT} ({total / 1e6:.2f} MB)")


def make_flat_variant():
    import json
    from safetensors.torch import load_file
    cfg = Glm5NextConfig(text_config=FLAT_TEXT, vision_config=VISION, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1)
    model = Glm5NextForConditionalGeneration(cfg).eval()
    randomize(model, SEED + 7)
    ids = torch.randint(1, FLAT_TEXT["vocab_size"], (1, FLAT_PROMPT_LEN), generator=torch.Generator().manual_seed(SEED + 8))
    ties = boundary_ties(model, ids)
    if ties:
        sys.exit(f"flat variant: exact DSA top-k ties at {ties[:5]}: change its seed")
    out_dir = OUT / "tiny-flat"
    if out_dir.exists():
        shutil.rmtree(out_dir)
    model.save_pretrained(out_dir, save_original_format=False)
    # Drop the vision tower and flatten the config: a text-only checkpoint.
    st_path = out_dir / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(st_path)).items() if not k.startswith("model.visual.")}
    save_file(tensors, str(st_path), metadata={"format": "pt"})
    full = json.loads((out_dir / "config.json").read_text())
    flat = dict(full["text_config"], model_type="glm5_next", architectures=full["architectures"])
    (out_dir / "config.json").write_text(json.dumps(flat, indent=2) + "\n")
    # The goldens come from the in-memory model; check that transformers reads the flat config the same.
    reread = Glm5NextConfig.from_pretrained(out_dir)
    assert reread.text_config.layer_types == cfg.text_config.layer_types
    assert reread.text_config.linear_lower_bound is None and reread.text_config.n_group == 1
    out = {}
    dump_prompt(model, ids, "0", out)
    save_file({k: v.contiguous() for k, v in out.items()}, str(OUT / "golden-flat.safetensors"))
    names = sorted(tensors)
    assert any("experts.gate_up_proj" in n for n in names) and any(".conv1d.weight" in n for n in names), names[:20]


if __name__ == "__main__":
    main()
