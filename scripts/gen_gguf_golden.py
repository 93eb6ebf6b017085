#!/usr/bin/env python3
"""Reference rows of un-permuted q/k projections from the SmolLM2 GGUF.

llama.cpp's converter permutes q/k rows for GGML's interleaved RoPE; shelfserve serves them in
HF's rotate-half order. This script produces the expected HF-order rows with references we did
not write: the `gguf` package dequantises, and transformers' own GGUF loader
(`LlamaTensorProcessor`, the code behind `from_pretrained(..., gguf_file=...)`) undoes the
permutation.

Usage: /opt/refenv/bin/python scripts/gen_gguf_golden.py [GGUF] [OUT]
  GGUF defaults to $SHELFSERVE_DEFAULT_GGUF; OUT to tests/fixtures/gguf/smollm2_qk_rows.json.

Output (JSON):
  {"source": <gguf file name>, "gguf_version": <gguf package version>,
   "transformers_version": ...,
   "cases": [{"gguf_name": "blk.0.attn_q.weight", "hf_name": "model.layers.0.self_attn.q_proj.weight",
              "dtype": "Q4_1", "shape": [rows, cols] (row-major, outermost first),
              "rows": [{"row": r, "first": [8 floats], "sum": float (f64 sum of the whole row)}]}]}
"""
import json
from importlib.metadata import version
import os
import sys
from pathlib import Path

import gguf
import numpy as np
import transformers
from gguf.quants import dequantize
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

ROOT = Path(__file__).resolve().parent.parent


def main():
    src = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ["SHELFSERVE_DEFAULT_GGUF"])
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else ROOT / "tests/fixtures/gguf/smollm2_qk_rows.json"
    r = gguf.GGUFReader(str(src))
    n_head = int(r.fields["llama.attention.head_count"].contents())
    n_kv = int(r.fields["llama.attention.head_count_kv"].contents())
    proc = LlamaTensorProcessor(config={"num_attention_heads": n_head, "num_key_value_heads": n_kv})
    tensors = {t.name: t for t in r.tensors}
    cases = []
    for layer in (0, 17, 29):
        for kind, hf in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
            name = f"blk.{layer}.{kind}.weight"
            t = tensors[name]
            w = dequantize(t.data, t.tensor_type).astype(np.float32)
            w = w.reshape([int(d) for d in reversed(t.shape)])  # ne is innermost-first
            w = proc.process(weights=w, name=name).weights
            rows = sorted({0, 1, 2, 31, 32, 33, 63, 64, 65, w.shape[0] - 1})
            cases.append({
                "gguf_name": name,
                "hf_name": f"model.layers.{layer}.self_attn.{hf}.weight",
                "dtype": t.tensor_type.name,
                "shape": list(w.shape),
                "rows": [
                    {"row": int(i), "first": [float(x) for x in w[i, :8]], "sum": float(w[i].astype(np.float64).sum())}
                    for i in rows
                ],
            })
    doc = {
        "source": src.name,
        "gguf_version": version("gguf"),
        "transformers_version": transformers.__version__,
        "cases": cases,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out} ({len(cases)} tensors)")


if __name__ == "__main__":
    main()
