#!/usr/bin/env python3
"""Add llama.cpp greedy continuations made with its *batched* attention kernel to
tests/fixtures/llamacpp/smollm2_greedy.json (key `generated_ids_batched_kernel` per prompt).

Why: llama.cpp computes attention with tinyBLAS when a step has >= 2 query rows (prefill) and
with ggml_vec_dot_f16 when it has one (decode); the two round differently, so its own decode-path
continuations depend on the step shape. Our engine uses one kernel for every step (a sequence's
logits must not depend on batching), which is llama.cpp's batched kernel. Adding a dummy one-token
second sequence (unified KV, removed after each step) keeps every llama.cpp decode step at >= 2
rows, i.e. on that kernel; the continuation of sequence 0 is what is recorded.

usage: /opt/llamaenv/bin/python scripts/gen_llamacpp_batched_greedy.py [GGUF]
  (GGUF defaults to $SHELFSERVE_DEFAULT_GGUF). Same llama.cpp settings as gen_llamacpp_golden.py:
  n_ctx 512, n_batch/n_ubatch 512, 2 threads, f16 KV, flash attention off.
"""
import json
import os
import sys
from pathlib import Path

import numpy as np
import llama_cpp as L

FIXTURE = Path(__file__).resolve().parent.parent / "tests/fixtures/llamacpp/smollm2_greedy.json"


def main():
    gguf = sys.argv[1] if len(sys.argv) > 1 else os.environ["SHELFSERVE_DEFAULT_GGUF"]
    L.llama_backend_init()
    model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
    vocab = L.llama_n_vocab(L.llama_model_get_vocab(model))
    data = json.loads(FIXTURE.read_text())
    for p in data["prompts"]:
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = 512, 512, 512
        cp.n_threads = cp.n_threads_batch = 2
        cp.n_seq_max = 2
        cp.kv_unified = True
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        ctx = L.llama_init_from_model(model, cp)
        mem = L.llama_get_memory(ctx)
        batch = L.llama_batch_init(512, 0, 1)

        def decode(toks, pos0, dummy):
            n = len(toks) + (1 if dummy else 0)
            batch.n_tokens = n
            for i, t in enumerate(toks):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos0 + i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, True
            if dummy:
                i = len(toks)
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = 198, 0, 1
                batch.seq_id[i][0], batch.logits[i] = 1, True
            assert L.llama_decode(ctx, batch) == 0
            lp = L.llama_get_logits(ctx)
            rows = np.ctypeslib.as_array(lp, shape=(n * vocab,)).copy().reshape(n, vocab)[: len(toks)]
            if dummy:
                L.llama_memory_seq_rm(mem, 1, -1, -1)
            return rows

        ids = p["prompt_ids"]
        last = decode(ids, 0, dummy=False)[-1]
        gen, pos = [], len(ids)
        for _ in range(len(p["generated_ids"])):
            tok = int(np.argmax(last))
            gen.append(tok)
            last = decode([tok], pos, dummy=True)[-1]
            pos += 1
        p["generated_ids_batched_kernel"] = gen
        print(p["name"], gen)
        L.llama_batch_free(batch)
        L.llama_free(ctx)
    data["settings"]["batched_kernel_greedy"] = "decode steps carry a dummy 1-token second sequence (unified KV)"
    FIXTURE.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
