"""Train a DFlash block drafter for SmolLM2-135M-Instruct by self-distillation, and export it in
the format `shelfserve --speculative dflash:DIR` reads (config.json + model.safetensors, the
layout of z-lab's published DFlash checkpoints).

Needs only torch and transformers (a GGUF target is read by this script); no network and no
outside data:
  1. the target is the default model's own GGUF (the one `shelfserve fetch-default` caches);
  2. prompts: the model writes user requests itself from short built-in task kinds (code, JSON,
     lists, prose, ...), then answers them greedily — its own generations are the training text;
     then it continues raw prefixes of those answers with no chat template (`--raw-share`), as
     completion requests and agents' resent contexts arrive;
  3. the drafter learns, from the target's hidden states at a few layers (the context features)
     and the anchor token, to predict the next `block_size - 1` greedy tokens in one non-causal
     pass (cross-entropy, earlier positions weighted more);
  4. it reports acceptance per draft position on held-out generations (greedy: a draft token is
     accepted while every one before it matched) and writes DIR/config.json,
     DIR/model.safetensors and DIR/TRAINING.json.

Full run (H200, ~10 min):   python scripts/train_dflash.py --out drafters/smollm2-dflash
Smoke test (CPU, a minute): python scripts/train_dflash.py --tiny --out /tmp/dflash-smoke
"""

import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

DEFAULT_GGUF = os.path.join(
    os.environ.get("SHELFSERVE_CACHE", os.path.expanduser("~/.cache/shelfserve")),
    "smollm2-135m-instruct",
    "SmolLM2-135M-Instruct.Q4_1.gguf",
)

# Kinds of requests the model is asked to invent (the requests and answers are its own).
TASK_KINDS = [
    "a short Python function", "a Rust function", "a JavaScript snippet", "a SQL query", "a bash command",
    "a JSON object describing a product", "a JSON list of users", "a YAML config file", "a CSV table",
    "a numbered list of steps", "a bulleted shopping list", "a short email", "a haiku", "a short story",
    "a recipe", "a math word problem and its solution", "an explanation of a science fact",
    "a summary of a historical event", "a definition of a word", "a comparison of two animals",
    "advice for studying", "a dialogue between two people", "a product review", "a travel itinerary",
    "a regular expression with explanation", "an HTML page skeleton", "a unit test", "a markdown table",
    "a list of pros and cons", "a poem about the sea", "instructions for a board game", "a joke",
]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", "--target", dest="gguf", default=DEFAULT_GGUF,
                   help="the target: a GGUF file or an HF directory (default: shelfserve's cached default model)")
    p.add_argument("--out", required=True, help="directory to write the drafter to")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=0,
                   help="the drafter's MLP width (default: the target's); smaller ships smaller")
    p.add_argument("--export-dtype", choices=["bf16", "f32"], default="bf16")
    p.add_argument("--data-cache", default="", help="save the self-distillation data here, or reuse it")
    p.add_argument("--max-minutes", type=float, default=0, help="stop training after this long (0: no limit)")
    p.add_argument("--eval-every", type=int, default=250,
                   help="score the held-out generations every N steps and keep the best drafter (0: off)")
    p.add_argument("--target-layers", type=int, default=4, help="how many target layers to tap")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--sliding-window", type=int, default=2048)
    p.add_argument("--mask-token-id", type=int, default=16, help="<empty_output>: never in chat text")
    p.add_argument("--prompts", type=int, default=4096, help="self-written requests to answer")
    p.add_argument("--gen-tokens", type=int, default=256, help="tokens per answer")
    p.add_argument("--request-tokens", type=int, default=48, help="tokens per self-written request")
    p.add_argument("--gen-batch", type=int, default=128)
    p.add_argument("--raw-share", type=float, default=0.5,
                   help="raw continuations (no chat template) to add, as a share of the chat answers")
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--blocks", type=int, default=16, help="anchors per sequence per step")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--decay", type=float, default=7.0, help="loss weight exp(-(i-1)/decay) at draft position i")
    p.add_argument("--heldout", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--tiny", action="store_true", help="a few prompts and steps (CPU smoke test)")
    a = p.parse_args()
    if a.tiny:
        a.prompts, a.gen_tokens, a.request_tokens, a.gen_batch = 8, 24, 12, 8
        a.steps, a.batch, a.blocks, a.log_every = 6, 4, 4, 1
    return a


def target_layer_ids(num_target_layers, n):
    """Evenly spaced from layer 1 to L-3, as the reference's helper picks them."""
    if n == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [round(start + i * (end - start) / (n - 1)) for i in range(n)]


GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_BF16 = 0, 1, 2, 3, 8, 30


def read_gguf(path):
    """Metadata and tensors (as float32 numpy arrays) of a GGUF file: F32/F16/BF16/Q4_0/Q4_1/Q8_0
    (what the default model ships). Self-contained, so the script needs no GGUF package."""
    import struct

    import numpy as np

    data = memoryview(open(path, "rb").read())
    off = 0

    def take(fmt):
        nonlocal off
        v = struct.unpack_from("<" + fmt, data, off)
        off += struct.calcsize("<" + fmt)
        return v[0]

    def string():
        nonlocal off
        n = take("Q")
        s = bytes(data[off : off + n]).decode("utf-8", errors="replace")
        off += n
        return s

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(t):
        if t == 8:
            return string()
        if t == 9:
            inner, n = take("I"), take("Q")
            return [value(inner) for _ in range(n)]
        return take(scalar[t])

    assert bytes(data[:4]) == b"GGUF", f"{path} is not a GGUF file"
    off = 4
    take("I")
    n_tensors, n_kv = take("Q"), take("Q")
    meta = {}
    for _ in range(n_kv):
        k = string()
        meta[k] = value(take("I"))
    infos = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        infos.append((name, dims, take("I"), take("Q")))
    align = meta.get("general.alignment", 32)
    base = (off + align - 1) // align * align
    tensors = {}
    for name, dims, kind, rel in infos:
        n = int(np.prod(dims))
        raw = np.frombuffer(data, dtype=np.uint8, offset=base + rel, count=_ggml_bytes(kind, n))
        tensors[name] = _dequantize(raw, kind, n).reshape(list(reversed(dims)))
    return meta, tensors


def _ggml_bytes(kind, n):
    per_block = {GGML_Q4_0: (32, 18), GGML_Q4_1: (32, 20), GGML_Q8_0: (32, 34)}
    if kind in per_block:
        q, b = per_block[kind]
        return n // q * b
    return n * {GGML_F32: 4, GGML_F16: 2, GGML_BF16: 2}[kind]


def _dequantize(raw, kind, n):
    import numpy as np

    if kind == GGML_F32:
        return raw.view(np.float32).copy()
    if kind == GGML_F16:
        return raw.view(np.float16).astype(np.float32)
    if kind == GGML_BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if kind == GGML_Q8_0:
        b = raw.reshape(-1, 34)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        return (b[:, 2:].copy().view(np.int8).astype(np.float32) * d).reshape(-1)
    if kind in (GGML_Q4_0, GGML_Q4_1):
        width = 18 if kind == GGML_Q4_0 else 20
        b = raw.reshape(-1, width)
        d = b[:, :2].copy().view(np.float16).astype(np.float32)
        qs = b[:, width - 16 :]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        if kind == GGML_Q4_0:
            return ((q - 8.0) * d).reshape(-1)
        m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        return (q * d + m).reshape(-1)
    raise ValueError(f"GGML tensor type {kind} is not supported here")


def _unpermute(w, heads):
    """llama.cpp stores q/k rows interleaved for its RoPE; HF keeps each head's halves apart."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, -1).swapaxes(1, 2).reshape(w.shape)


def load_target(path, device):
    """The target from an HF directory, or from a GGUF file (read here, no extra packages)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    if os.path.isdir(path):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        meta, t = read_gguf(path)
        arch = meta["general.architecture"]
        g = lambda k, d=None: meta.get(f"{arch}.{k}", d)
        heads, kv_heads = g("attention.head_count"), g("attention.head_count_kv")
        tokens = meta["tokenizer.ggml.tokens"]
        cfg = LlamaConfig(
            vocab_size=len(tokens),
            hidden_size=g("embedding_length"),
            intermediate_size=g("feed_forward_length"),
            num_hidden_layers=g("block_count"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            rms_norm_eps=g("attention.layer_norm_rms_epsilon"),
            max_position_embeddings=g("context_length"),
            rope_theta=g("rope.freq_base", 10000.0),
            tie_word_embeddings="output.weight" not in t,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        )
        names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
        state = {"model.embed_tokens.weight": t["token_embd.weight"], "model.norm.weight": t["output_norm.weight"]}
        if "output.weight" in t:
            state["lm_head.weight"] = t["output.weight"]
        for name, w in t.items():
            parts = name.split(".")
            if parts[0] == "blk" and parts[2] in names:
                if parts[2] == "attn_q":
                    w = _unpermute(w, heads)
                elif parts[2] == "attn_k":
                    w = _unpermute(w, kv_heads)
                state[f"model.layers.{parts[1]}.{names[parts[2]]}.weight"] = w
        model = LlamaForCausalLM(cfg)
        missing, unexpected = model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()}, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
        assert not missing and not unexpected, (missing, unexpected)
        if cfg.tie_word_embeddings:
            model.tie_weights()
        # Byte-level BPE from the file's vocabulary and merges (the GPT-2 scheme SmolLM2 uses).
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        bpe = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(tokens)}, merges=merges))
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
        tok.add_special_tokens({"additional_special_tokens": [s for s, ty in zip(tokens, types) if ty == 3]})
        tok.eos_token = tokens[meta["tokenizer.ggml.eos_token_id"]]
        tok.chat_template = meta.get("tokenizer.chat_template")
    model = model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return tok, model


@torch.no_grad()
def generate(model, tok, prompts, max_new, batch, device, greedy=True):
    """Left-padded batched generation; returns the new tokens of each prompt."""
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    out = []
    for i in range(0, len(prompts), batch):
        enc = tok(prompts[i : i + batch], return_tensors="pt", padding=True).to(device)
        kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=0.8, top_p=0.95)
        gen = model.generate(**enc, max_new_tokens=max_new, pad_token_id=tok.pad_token_id, **kw)
        for row in gen[:, enc["input_ids"].shape[1] :].tolist():
            if tok.eos_token_id in row:
                row = row[: row.index(tok.eos_token_id) + 1]
            out.append(row)
        print(f"  generated {min(i + batch, len(prompts))}/{len(prompts)}", flush=True)
    return out


def chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def self_distillation_data(model, tok, args, device):
    rng = random.Random(args.seed)
    # 1. The model writes the requests (sampled, for variety).
    asks = [
        chat(tok, f"Write one request a user might send to an assistant, asking for {rng.choice(TASK_KINDS)}. "
                  f"Only the request, topic number {rng.randrange(10_000)}.")
        for _ in range(args.prompts)
    ]
    print(f"writing {len(asks)} requests", flush=True)
    requests = [tok.decode(r, skip_special_tokens=True).strip() for r in generate(model, tok, asks, args.request_tokens, args.gen_batch, device, greedy=False)]
    requests = [r for r in requests if r] or ["Say hello."]
    # 2. It answers them greedily: those answers are what a greedy verifier accepts.
    prompts = [chat(tok, r) for r in requests]
    print(f"answering {len(prompts)} requests", flush=True)
    answers = generate(model, tok, prompts, args.gen_tokens, args.gen_batch, device, greedy=True)
    seqs = []
    for p, a in zip(prompts, answers):
        ids = tok(p, add_special_tokens=False)["input_ids"]
        if len(a) > args.block_size:
            seqs.append((ids + a, len(ids)))
    # 3. Raw continuations, with no chat template around them (what /v1/completions and an agent's
    #    resent context look like): a prefix of one of its answers, continued greedily. Without
    #    these, the drafter only ever saw assistant turns.
    n_raw = min(int(len(seqs) * args.raw_share), len(answers))
    if n_raw:
        prefixes = []
        for i in rng.sample(range(len(answers)), n_raw):
            a = [t for t in answers[i] if t != tok.eos_token_id]
            cut = rng.randint(min(8, len(a)), max(min(8, len(a)), min(len(a), 96)))
            text = tok.decode(a[:cut], skip_special_tokens=True)
            if text.strip():
                prefixes.append(text)
        print(f"continuing {len(prefixes)} raw prefixes", flush=True)
        continued = generate(model, tok, prefixes, args.gen_tokens, args.gen_batch, device, greedy=True)
        for p, c in zip(prefixes, continued):
            ids = tok(p, add_special_tokens=False)["input_ids"]
            if ids and len(c) > args.block_size:
                seqs.append((ids + c, len(ids)))
    return seqs


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x, pos, theta):
    """Rotate-half RoPE; x [B, heads, T, d], pos [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    f = pos.float()[:, None, :, None] * inv
    cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return (x.float() * cos + torch.cat([-x2, x1], -1).float() * sin).to(x.dtype)


class DraftLayer(nn.Module):
    """The DFlash decoder layer: queries from the block, keys/values from context + block."""

    def __init__(self, c):
        super().__init__()
        h, hd = c["hidden_size"], c["head_dim"]
        self.nh, self.nkv, self.hd, self.theta = c["num_attention_heads"], c["num_key_value_heads"], hd, c["rope_theta"]
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(h, self.nh * hd, bias=False)
        self.self_attn.k_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.self_attn.v_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.self_attn.o_proj = nn.Linear(self.nh * hd, h, bias=False)
        self.self_attn.q_norm = RMSNorm(hd, c["rms_norm_eps"])
        self.self_attn.k_norm = RMSNorm(hd, c["rms_norm_eps"])
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, c["intermediate_size"], bias=False)
        self.mlp.up_proj = nn.Linear(h, c["intermediate_size"], bias=False)
        self.mlp.down_proj = nn.Linear(c["intermediate_size"], h, bias=False)
        self.input_layernorm = RMSNorm(h, c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(h, c["rms_norm_eps"])

    def forward(self, x, ctx, q_pos, k_pos, mask):
        a = self.self_attn
        B, T, _ = x.shape
        xn = self.input_layernorm(x)
        kv_in = torch.cat([ctx, xn], 1)
        q = a.q_norm(a.q_proj(xn).view(B, T, self.nh, self.hd)).transpose(1, 2)
        k = a.k_norm(a.k_proj(kv_in).view(B, -1, self.nkv, self.hd)).transpose(1, 2)
        v = a.v_proj(kv_in).view(B, -1, self.nkv, self.hd).transpose(1, 2)
        q, k = rotate(q, q_pos, self.theta), rotate(k, k_pos, self.theta)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        x = x + a.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        m = self.mlp
        xn = self.post_attention_layernorm(x)
        return x + m.down_proj(F.silu(m.gate_proj(xn)) * m.up_proj(xn))


class DFlashDrafter(nn.Module):
    def __init__(self, c):
        super().__init__()
        h = c["hidden_size"]
        self.c = c
        self.layers = nn.ModuleList([DraftLayer(c) for _ in range(c["num_hidden_layers"])])
        self.fc = nn.Linear(len(c["dflash_config"]["target_layer_ids"]) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, c["rms_norm_eps"])
        self.norm = RMSNorm(h, c["rms_norm_eps"])

    def forward(self, features, block_emb, ctx_pos, block_pos, mask):
        ctx = self.hidden_norm(self.fc(features))
        x = block_emb
        k_pos = torch.cat([ctx_pos, block_pos], 1)
        for layer in self.layers:
            x = layer(x, ctx, block_pos, k_pos, mask)
        return self.norm(x)


def init_from_target(draft, target, c):
    """Start each draft layer from one of the target's last layers (faster to train)."""
    tl = target.model.layers
    picks = [len(tl) - len(draft.layers) + i for i in range(len(draft.layers))]
    with torch.no_grad():
        for d, i in zip(draft.layers, picks):
            t = tl[i]
            for name in ["q_proj", "k_proj", "v_proj", "o_proj"]:
                getattr(d.self_attn, name).weight.copy_(getattr(t.self_attn, name).weight)
            # A narrower drafter MLP starts from the first rows (columns for down) of the target's.
            inner = d.mlp.gate_proj.weight.shape[0]
            for name in ["gate_proj", "up_proj"]:
                getattr(d.mlp, name).weight.copy_(getattr(t.mlp, name).weight[:inner])
            d.mlp.down_proj.weight.copy_(t.mlp.down_proj.weight[:, :inner])
            d.input_layernorm.weight.copy_(t.input_layernorm.weight)
            d.post_attention_layernorm.weight.copy_(t.post_attention_layernorm.weight)
        draft.norm.weight.copy_(target.model.norm.weight)
        nn.init.normal_(draft.fc.weight, std=1.0 / math.sqrt(draft.fc.weight.shape[1]))


def make_batch(seqs, idx, args, device, rng):
    """Pad sequences and pick anchors in the answers (each with a full block after it)."""
    chosen = [seqs[i] for i in idx]
    L = max(len(s) for s, _ in chosen)
    tokens = torch.zeros(len(chosen), L, dtype=torch.long)
    lengths = []
    anchors = torch.zeros(len(chosen), args.blocks, dtype=torch.long)
    for b, (s, start) in enumerate(chosen):
        tokens[b, : len(s)] = torch.tensor(s)
        lengths.append(len(s))
        hi = len(s) - args.block_size
        lo = max(start - 1, 1)
        anchors[b] = torch.tensor([rng.randint(lo, max(lo, hi)) for _ in range(args.blocks)])
    return tokens.to(device), torch.tensor(lengths, device=device), anchors.to(device)


def block_inputs(target, tokens, lengths, anchors, args, layer_ids):
    """Context features, block embeddings, positions, the attention mask and the labels."""
    B, L = tokens.shape
    bs, n = args.block_size, anchors.shape[1]
    with torch.no_grad():
        out = target(tokens, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[l + 1] for l in layer_ids], -1)
        emb = target.get_input_embeddings()
    offs = torch.arange(bs, device=tokens.device)
    block_pos = (anchors[:, :, None] + offs).reshape(B, n * bs)
    block_tok = torch.full((B, n, bs), args.mask_token_id, device=tokens.device)
    block_tok[:, :, 0] = tokens.gather(1, anchors)
    block_emb = emb(block_tok.reshape(B, n * bs))
    labels = tokens.gather(1, block_pos.clamp(max=L - 1)).reshape(B, n, bs)[:, :, 1:]
    valid = (block_pos.reshape(B, n, bs)[:, :, 1:] < lengths[:, None, None])
    ctx_pos = torch.arange(L, device=tokens.device)[None].expand(B, L)
    # Block row (i, j) sees context positions before its anchor (within the window) and its own
    # block, in both directions (non-causal).
    q_pos = block_pos[:, :, None]
    anc = anchors.repeat_interleave(bs, 1)[:, :, None]
    ctx_ok = (ctx_pos[:, None, :] < anc) & (q_pos - ctx_pos[:, None, :] < args.sliding_window)
    blk = torch.arange(n * bs, device=tokens.device) // bs
    blk_ok = (blk[:, None] == blk[None, :])[None].expand(B, -1, -1)
    mask = torch.cat([ctx_ok, blk_ok], 2)
    return feats, block_emb, ctx_pos, block_pos, mask, labels, valid


def run_drafter(draft, target, batch, args, layer_ids):
    tokens, lengths, anchors = batch
    feats, block_emb, ctx_pos, block_pos, mask, labels, valid = block_inputs(target, tokens, lengths, anchors, args, layer_ids)
    B, n, bs = anchors.shape[0], anchors.shape[1], args.block_size
    hidden = draft(feats, block_emb, ctx_pos, block_pos, mask).view(B, n, bs, -1)[:, :, 1:]
    logits = target.get_output_embeddings()(hidden).float()
    return logits, labels, valid


def acceptance(logits, labels, valid):
    """Greedy acceptance: per position, whether it and every earlier draft matched."""
    match = (logits.argmax(-1) == labels) & valid
    run = match.int().cumprod(-1)
    return run.float().mean((0, 1)), run.sum(-1).float().mean()


def export(draft, c, out, stats, dtype):
    os.makedirs(out, exist_ok=True)
    cast = torch.bfloat16 if dtype == "bf16" else torch.float32
    state = {k: v.detach().to(cast).contiguous().cpu() for k, v in draft.state_dict().items()}
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    with open(os.path.join(out, "TRAINING.json"), "w") as f:
        json.dump(stats, f, indent=2)


@torch.no_grad()
def heldout_score(draft, target, held, args, device, layer_ids, amp):
    """Greedy acceptance by draft position and mean accepted drafts per block on the held-out
    generations (fixed anchors, so scores at different steps compare)."""
    was_training = draft.training
    draft.eval()
    rng = random.Random(12345)
    per_pos_sum, lens, batches = 0, [], 0
    with amp:
        for i in range(0, len(held), args.batch):
            batch = make_batch(held, list(range(i, min(i + args.batch, len(held)))), args, device, rng)
            logits, labels, valid = run_drafter(draft, target, batch, args, layer_ids)
            per_pos, mean_len = acceptance(logits, labels, valid)
            per_pos_sum, batches = per_pos_sum + per_pos, batches + 1
            lens.append(mean_len.item())
    draft.train(was_training)
    return (per_pos_sum / max(batches, 1)).tolist(), sum(lens) / max(len(lens), 1)


def main():
    args = parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    device = torch.device(args.device)
    if not os.path.exists(args.gguf):
        sys.exit(f"no target GGUF at {args.gguf}: run `shelfserve fetch-default` first or pass --gguf")
    print(f"target {args.gguf} on {device}", flush=True)
    tok, target = load_target(args.gguf, device)
    tc = target.config
    layer_ids = target_layer_ids(tc.num_hidden_layers, args.target_layers)
    c = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": tc.hidden_size,
        "intermediate_size": args.intermediate_size or tc.intermediate_size,
        "num_hidden_layers": args.draft_layers,
        "num_attention_heads": tc.num_attention_heads,
        "num_key_value_heads": tc.num_key_value_heads,
        "head_dim": tc.hidden_size // tc.num_attention_heads,
        "rms_norm_eps": tc.rms_norm_eps,
        "vocab_size": tc.vocab_size,
        "max_position_embeddings": tc.max_position_embeddings,
        "rope_theta": float(getattr(tc, "rope_theta", None) or tc.rope_parameters["rope_theta"]),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(getattr(tc, "rope_theta", None) or tc.rope_parameters["rope_theta"])},
        "layer_types": ["sliding_attention"] * (args.draft_layers - 1) + ["full_attention"],
        "sliding_window": args.sliding_window,
        "use_sliding_window": True,
        "is_causal": False,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "num_target_layers": tc.num_hidden_layers,
        "dflash_config": {"block_size": args.block_size, "mask_token_id": args.mask_token_id, "target_layer_ids": layer_ids},
    }
    print(f"drafter: {args.draft_layers} layers, taps {layer_ids}, block {args.block_size}", flush=True)

    t0 = time.time()
    if args.data_cache and os.path.exists(args.data_cache):
        seqs = [tuple(x) for x in json.load(open(args.data_cache))]
        print(f"reusing {len(seqs)} generations from {args.data_cache}", flush=True)
    else:
        seqs = self_distillation_data(target, tok, args, device)
        if args.data_cache:
            # Written whole, then renamed: a second run waiting for the cache never reads half.
            with open(args.data_cache + ".tmp", "w") as f:
                json.dump(seqs, f)
            os.replace(args.data_cache + ".tmp", args.data_cache)
    rng.shuffle(seqs)
    n_held = max(1, int(len(seqs) * args.heldout))
    held, train = seqs[:n_held], seqs[n_held:] or seqs
    print(f"{len(train)} training / {len(held)} held-out generations in {time.time() - t0:.0f} s", flush=True)

    draft = DFlashDrafter(c).to(device)
    init_from_target(draft, target, c)
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warm = max(1, args.steps // 20)
    t_train = time.time()

    def progress(s):
        # Under a time budget the cosine ends with the budget, whichever comes first.
        by_time = (time.time() - t_train) / (args.max_minutes * 60) if args.max_minutes else 0.0
        return min(1.0, max(s / args.steps, by_time))

    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * progress(s)))
    )
    weights = torch.exp(-torch.arange(args.block_size - 1, device=device) / args.decay)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    t0 = time.time()
    steps_done = 0
    # (held-out accepted per block, state, step) of the best drafter so far: with little data the
    # drafter memorises its training generations long before the schedule ends.
    best = None
    for step in range(1, args.steps + 1):
        if args.max_minutes and time.time() - t0 > args.max_minutes * 60:
            print(f"time limit: stopping after {steps_done} of {args.steps} steps", flush=True)
            break
        steps_done = step
        idx = [rng.randrange(len(train)) for _ in range(args.batch)]
        batch = make_batch(train, idx, args, device, rng)
        with amp:
            logits, labels, valid = run_drafter(draft, target, batch, args, layer_ids)
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(labels)
        w = weights * valid
        loss = (ce * w).sum() / w.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.log_every == 0 or step == args.steps:
            per_pos, mean_len = acceptance(logits.detach(), labels, valid)
            print(
                f"step {step}/{args.steps} loss {loss.item():.3f} accepted/block {mean_len.item():.2f} "
                f"pos1 {per_pos[0].item():.2f} lr {sched.get_last_lr()[0]:.2e} {time.time() - t0:.0f} s",
                flush=True,
            )
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            _, held_len = heldout_score(draft, target, held, args, device, layer_ids, amp)
            print(f"step {step}: held-out accepted/block {held_len:.3f}", flush=True)
            if best is None or held_len > best[0]:
                best = (held_len, {k: v.detach().clone() for k, v in draft.state_dict().items()}, step)

    train_seconds = time.time() - t0
    kept_step = steps_done
    per_pos, mean_len = heldout_score(draft, target, held, args, device, layer_ids, amp)
    if best is not None and best[0] > mean_len:
        print(f"keeping the drafter of step {best[2]} (held-out {best[0]:.3f} accepted per block)", flush=True)
        draft.load_state_dict(best[1])
        kept_step = best[2]
        per_pos, mean_len = heldout_score(draft, target, held, args, device, layer_ids, amp)
    stats = {
        "target": os.path.basename(args.gguf),
        "train_generations": len(train),
        "heldout_generations": len(held),
        "steps": steps_done,
        "draft_layers": args.draft_layers,
        "intermediate_size": c["intermediate_size"],
        "raw_share": args.raw_share,
        "train_seconds": round(train_seconds),
        "heldout_acceptance_by_position": [round(p, 4) for p in per_pos],
        "heldout_mean_accepted_per_block": round(mean_len, 3),
        "kept_step": kept_step,
        "torch": torch.__version__,
    }
    print("held-out acceptance by position:", " ".join(f"{p:.2f}" for p in per_pos), flush=True)
    print(f"held-out mean accepted drafts per block: {stats['heldout_mean_accepted_per_block']:.2f}", flush=True)
    export(draft, c, args.out, stats, args.export_dtype)
    print(f"wrote {args.out} (use: shelfserve serve --speculative dflash:{args.out})", flush=True)


if __name__ == "__main__":
    main()
