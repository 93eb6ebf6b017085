#!/usr/bin/env python3
"""PyTorch peer for `shelfserve bench`: transformers' LlamaForCausalLM with the same config and
random bf16 weights on the same GPU, a static KV cache filled with random values at the same
contexts (no prefill needed, as ours), greedy decode steps replayed as a CUDA graph where capture
works (eager otherwise; the mode is printed), and prefill of one sequence with SDPA attention.
Writes one JSON object per measurement, keyed like the Rust bench's output."""
import argparse, json, time

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import StaticCache

ap = argparse.ArgumentParser()
ap.add_argument("--config", required=True)
ap.add_argument("--batches", default="1,8,32,128")
ap.add_argument("--contexts", default="1024,8192")
ap.add_argument("--prefill", default="2048,8192")
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--json", required=True)
a = ap.parse_args()

cfg = LlamaConfig.from_dict(json.load(open(a.config)))
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
dev = torch.device("cuda")
t0 = time.time()
torch.set_default_dtype(torch.bfloat16)
with dev:
    model = LlamaForCausalLM(cfg)
model.eval()
torch.set_default_dtype(torch.float32)
print(f"peer: {a.config}: model built on {torch.cuda.get_device_name()} in {time.time()-t0:.1f}s", flush=True)
out = open(a.json, "w")
kv_token_bytes = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads) * 2


def emit(**r):
    out.write(json.dumps(r) + "\n")
    out.flush()
    print("peer:", r, flush=True)


@torch.inference_mode()
def decode(batch, ctx, steps):
    free = torch.cuda.mem_get_info()[0]
    need = batch * (ctx + steps + 8) * kv_token_bytes
    if need > free - (6 << 30):
        return emit(kind="decode", batch=batch, ctx=ctx, skipped="kv does not fit")
    cache = StaticCache(config=cfg, max_cache_len=ctx + steps + 8)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), device=dev)
    pos = torch.tensor([0], device=dev)
    model(input_ids=ids, cache_position=pos, past_key_values=cache, use_cache=True)  # allocates the cache
    for layer in cache.layers:
        layer.keys.normal_()
        layer.values.normal_()
    pos.fill_(ctx)

    def step():
        logits = model(input_ids=ids, cache_position=pos, past_key_values=cache, use_cache=True).logits
        ids.copy_(logits[:, -1:].argmax(-1))
        pos.add_(1)

    mode = "cuda-graph"
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        run = g.replay
        run()
    except Exception as e:  # capture fails when the model syncs with the host
        print(f"peer: graph capture failed ({type(e).__name__}: {str(e)[:120]}); eager", flush=True)
        torch.cuda.synchronize()
        mode, run = "eager", step
        pos.fill_(ctx)
        run()
    pos.fill_(ctx + 3)
    torch.cuda.synchronize()
    t = time.time()
    for _ in range(steps):
        run()
    torch.cuda.synchronize()
    secs = (time.time() - t) / steps
    emit(kind="decode", batch=batch, ctx=ctx, secs_per_step=secs, tok_per_s=batch / secs, mode=mode)
    del cache
    torch.cuda.empty_cache()


@torch.inference_mode()
def prefill(n):
    ids = torch.randint(0, cfg.vocab_size, (1, n), device=dev)
    times = []
    for i in range(4):
        torch.cuda.synchronize()
        t = time.time()
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits
        logits.argmax(-1).cpu()
        times.append(time.time() - t)
    secs = sorted(times[1:])[1]
    emit(kind="prefill", tokens=n, secs=secs, tok_per_s=n / secs)


for ctx in map(int, a.contexts.split(",")):
    for b in map(int, a.batches.split(",")):
        try:
            decode(b, ctx, a.steps)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            emit(kind="decode", batch=b, ctx=ctx, skipped="out of memory")
for n in map(int, a.prefill.split(",")):
    prefill(n)
