#!/usr/bin/env python3
"""PyTorch peer for `shelfserve bench` on a glm5_next config: transformers'
Glm5NextForConditionalGeneration (text config from the same JSON, default vision tower) with
random bf16 weights on the same GPU. Decode: a prompt of `ctx` random tokens per sequence is
prefilled (transformers' caches hold KDA states as well as latents, so they cannot be filled with
random values as ours are), then `steps` greedy steps are timed. Prefill: one sequence, timed.
Each point that runs out of memory is reported as skipped. Writes one JSON object per
measurement, keyed like the Rust bench's output, and prints progress."""
import argparse, json, time

import torch
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

ap = argparse.ArgumentParser()
ap.add_argument("--config", required=True)
ap.add_argument("--batches", default="1,8,32")
ap.add_argument("--contexts", default="1024")
ap.add_argument("--prefill", default="2048,8192")
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--json", required=True)
a = ap.parse_args()

text = {k: v for k, v in json.load(open(a.config)).items() if k not in ("model_type", "architectures", "torch_dtype")}
cfg = Glm5NextConfig(text_config=text, tie_word_embeddings=False)
dev = torch.device("cuda")
t0 = time.time()
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
with dev:
    model = Glm5NextForConditionalGeneration(cfg)
model.eval()
torch.set_default_dtype(torch.float32)
params = sum(p.numel() for p in model.parameters())
print(f"peer: {a.config}: {params / 1e9:.1f} B parameters built on {torch.cuda.get_device_name()} in {time.time() - t0:.1f}s", flush=True)
out = open(a.json, "w")
vocab = cfg.text_config.vocab_size


def emit(**r):
    out.write(json.dumps(r) + "\n")
    out.flush()
    print("peer:", r, flush=True)


def timed(f):
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = f()
    torch.cuda.synchronize()
    return time.perf_counter() - t, r


@torch.inference_mode()
def decode(batch, ctx, steps):
    ids = torch.randint(0, vocab, (batch, ctx), device=dev)
    try:
        secs, o = timed(lambda: model(input_ids=ids, use_cache=True))
        print(f"peer: prefilled {batch} x {ctx} in {secs:.1f}s", flush=True)
        cache = o.past_key_values
        nxt = o.logits[:, -1:].argmax(-1)
        del o
        for _ in range(2):
            o = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            nxt = o.logits[:, -1:].argmax(-1)

        def run():
            nonlocal nxt
            for _ in range(steps):
                o = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                nxt = o.logits[:, -1:].argmax(-1)

        secs, _ = timed(run)
        emit(kind="decode", batch=batch, ctx=ctx, secs_per_step=secs / steps, tok_per_s=batch * steps / secs)
    except torch.OutOfMemoryError:
        emit(kind="decode", batch=batch, ctx=ctx, skipped="out of memory")
    finally:
        torch.cuda.empty_cache()


@torch.inference_mode()
def prefill(n):
    ids = torch.randint(0, vocab, (1, n), device=dev)
    try:
        model(input_ids=ids[:, :256])  # warm-up
        times = sorted(timed(lambda: model(input_ids=ids, logits_to_keep=1))[0] for _ in range(2))
        emit(kind="prefill", tokens=n, secs=times[0], tok_per_s=n / times[0])
    except torch.OutOfMemoryError:
        emit(kind="prefill", tokens=n, skipped="out of memory")
    finally:
        torch.cuda.empty_cache()


for ctx in map(int, a.contexts.split(",")):
    for b in map(int, a.batches.split(",")):
        decode(b, ctx, a.steps)
for n in map(int, a.prefill.split(",")):
    prefill(n)
