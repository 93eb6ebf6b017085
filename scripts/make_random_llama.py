#!/usr/bin/env python3
"""Write a llama checkpoint with random bf16 weights (safetensors shards, HF names) and a real
tokenizer, for serving benchmarks of any size: e.g. the 8B shape with the SmolLM2 tokenizer.
Weights are drawn on the GPU when there is one (N(0, 0.02), norms 1), shards of ~4 GB, with
progress on stderr. Usage:
  make_random_llama.py --out DIR --tokenizer-from DIR [--hidden 4096 --layers 32 ...]
"""
import argparse, json, os, shutil, sys, time

import torch
from safetensors.torch import save_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer-from", required=True, help="dir with tokenizer.json, tokenizer_config.json, chat_template.jinja")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--max-positions", type=int, default=32768)
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if os.path.exists(os.path.join(a.out, "model.safetensors.index.json")):
        print(f"{a.out}: already made", file=sys.stderr)
        return
    os.makedirs(a.out, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(a.seed)
    hd = a.hidden // a.heads
    tok_cfg = json.load(open(os.path.join(a.tokenizer_from, "config.json")))
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.hidden,
        "intermediate_size": a.intermediate, "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads, "head_dim": hd, "vocab_size": a.vocab,
        "max_position_embeddings": a.max_positions, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": tok_cfg.get("bos_token_id"), "eos_token_id": tok_cfg.get("eos_token_id"),
    }
    json.dump(cfg, open(os.path.join(a.out, "config.json"), "w"), indent=1)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        src = os.path.join(a.tokenizer_from, f)
        if os.path.exists(src):
            shutil.copy(src, a.out)
    shapes = [("model.embed_tokens.weight", (a.vocab, a.hidden))]
    for i in range(a.layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (a.hidden,)),
            (p + "self_attn.q_proj.weight", (a.heads * hd, a.hidden)),
            (p + "self_attn.k_proj.weight", (a.kv_heads * hd, a.hidden)),
            (p + "self_attn.v_proj.weight", (a.kv_heads * hd, a.hidden)),
            (p + "self_attn.o_proj.weight", (a.hidden, a.heads * hd)),
            (p + "post_attention_layernorm.weight", (a.hidden,)),
            (p + "mlp.gate_proj.weight", (a.intermediate, a.hidden)),
            (p + "mlp.up_proj.weight", (a.intermediate, a.hidden)),
            (p + "mlp.down_proj.weight", (a.hidden, a.intermediate)),
        ]
    shapes += [("model.norm.weight", (a.hidden,)), ("lm_head.weight", (a.vocab, a.hidden))]
    total = sum(2 * torch.Size(s).numel() for _, s in shapes)
    limit, shard, shard_bytes, shards, done, t0 = a.shard_gb * 1e9, {}, 0, [], 0, time.time()

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(shard, os.path.join(a.out, name), metadata={"format": "pt"})
            shards.append((name, list(shard)))
            shard, shard_bytes = {}, 0

    for name, shape in shapes:
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=g, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()
        shard[name] = t
        shard_bytes += 2 * t.numel()
        done += 2 * t.numel()
        if shard_bytes >= limit:
            flush()
            print(f"  {done / 1e9:.1f}/{total / 1e9:.1f} GB written ({time.time() - t0:.0f} s)", file=sys.stderr)
    flush()
    # The index last: its presence marks a finished checkpoint.
    index = {"metadata": {"total_size": total}, "weight_map": {t: f for f, ts in shards for t in ts}}
    json.dump(index, open(os.path.join(a.out, "model.safetensors.index.json"), "w"))
    print(f"{a.out}: {total / 1e9:.2f} GB in {len(shards)} shards, {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
