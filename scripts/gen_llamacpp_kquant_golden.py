#!/usr/bin/env python3
"""Tiny llama GGUFs quantized by llama.cpp's own quantizer to Q4_K_M and Q5_K_M, and llama.cpp's
logits and greedy continuations on them: the golden data of tests/golden_llamacpp_kquant.rs.

Run from the repository root with llama-cpp-python (0.3.36, AVX2 build), gguf and numpy:

    /work/wt/venv/bin/python scripts/gen_llamacpp_kquant_golden.py [SmolLM2.gguf]
    /work/wt/venv/bin/python scripts/gen_llamacpp_kquant_golden.py --bench-source OUT.gguf [SmolLM2.gguf]

The second form only writes a larger F32 source of the same kind (hidden 1024, 16 heads / 4 kv
heads, feed-forward 2816, 16 layers: 0.2 B parameters) for `scripts/bench_vs_llamacpp.sh GGUF
THREADS Q4_K_M`, where K-quant decode speed is compared with llama.cpp's on one file.

The default model (SmolLM2-135M, hidden 576) cannot exercise the K formats: llama.cpp quantizes
only rows that are a multiple of 256 to K-quants and falls back to Q5_0/Q8_0 for the rest. So
this script writes its own small llama (seeded numpy weights; hidden 256, 4 heads / 2 kv heads of
64, feed-forward 512, 2 layers, tied embeddings, vocab 512: SmolLM2's first 512 tokens and the
merges among them) as an F32 GGUF with llama.cpp's gguf-py writer, then has llama.cpp
(`llama_model_quantize`) quantize it:
    Q4_K_M: Q4_K matrices, Q6_K for layer 1's attn_v and ffn_down (llama.cpp's "more bits" rule);
    Q5_K_M: Q5_K matrices, the same two Q6_K.
The F32 source is not committed (5 MB); rerunning this script rebuilds it bit for bit.

Outputs in tests/fixtures/llamacpp_kquant/:
    tiny-<mix>.gguf             the quantized files, as llama.cpp wrote them
    tiny-<mix>.safetensors      ids_{i} i32 [n] and logits_{i} f32 [n, 512]: llama.cpp's logits for
                                every position of prompt i (one prefill, logits_all)
    golden.json                 per file: tensor types; row 0 of one tensor per quantized type as
                                gguf-py's dequantizer decodes it; per prompt the ids and
                                llama.cpp's 24 greedy tokens (top_k 1, no penalties)
    VERSIONS.txt                tool versions
"""

import json
import os
import sys
from pathlib import Path

import numpy as np

OUT = Path("tests/fixtures/llamacpp_kquant")
VOCAB, HIDDEN, HEADS, KV_HEADS, FF, LAYERS = 512, 256, 4, 2, 512, 2
HEAD_DIM = HIDDEN // HEADS
MIXES = {"Q4_K_M": 15, "Q5_K_M": 17}  # llama_ftype values
PROMPT_LENGTHS = (5, 17, 40)
N_GEN = 24


def tokenizer_from(path):
    import gguf

    r = gguf.GGUFReader(path)
    val = lambda k: r.fields[k].contents()
    toks = val("tokenizer.ggml.tokens")[:VOCAB]
    types = val("tokenizer.ggml.token_type")[:VOCAB]
    ids = {t: i for i, t in enumerate(toks)}
    merges = [m for m in val("tokenizer.ggml.merges")
              if all(p in ids for p in m.split(" ")) and m.replace(" ", "") in ids]
    return toks, types, merges, val("tokenizer.ggml.pre")


def write_f32(path, smollm, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, ff=FF, layers=LAYERS):
    import gguf

    head_dim = hidden // heads
    rng = np.random.default_rng(1717)
    # Unit-gain matrices and small embeddings keep logits at a scale (std ~4) where the model is
    # not chaotic: larger weights made 17-token prompts amplify last-bit differences.
    mat = lambda rows, cols: (rng.standard_normal((rows, cols)) * (1.0 / np.sqrt(cols))).astype(np.float32)
    norm = lambda n: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("shelfserve-kquant-tiny")
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_file_type(0)
    toks, types, merges, pre = tokenizer_from(smollm)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_tensor("token_embd.weight", (0.25 * rng.standard_normal((VOCAB, hidden))).astype(np.float32))
    w.add_tensor("output_norm.weight", norm(hidden))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", norm(hidden))
        w.add_tensor(p + "attn_q.weight", mat(heads * head_dim, hidden))
        w.add_tensor(p + "attn_k.weight", mat(kv_heads * head_dim, hidden))
        w.add_tensor(p + "attn_v.weight", mat(kv_heads * head_dim, hidden))
        w.add_tensor(p + "attn_output.weight", mat(hidden, heads * head_dim))
        w.add_tensor(p + "ffn_norm.weight", norm(hidden))
        w.add_tensor(p + "ffn_gate.weight", mat(ff, hidden))
        w.add_tensor(p + "ffn_up.weight", mat(ff, hidden))
        w.add_tensor(p + "ffn_down.weight", mat(hidden, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(src, dst, ftype):
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    assert rc == 0, f"llama_model_quantize returned {rc}"


def tensor_types(path):
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def dequantized_rows(path):
    """Row 0 of the first tensor of each quantized type, as gguf-py's numpy dequantizer gives it:
    a reference for our block decoding that does not go through a model."""
    import gguf

    rows = {}
    for t in gguf.GGUFReader(path).tensors:
        name = t.tensor_type.name
        if name in ("F32", "F16") or name in {v["type"] for v in rows.values()}:
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        rows[t.name] = {"type": name, "row0": [float(v) for v in values.reshape(-1, values.shape[-1])[0]]}
    return rows


def write_safetensors(path, tensors):
    from safetensors.numpy import save_file

    save_file(tensors, str(path))


def golden(path):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=512, n_threads=2, n_batch=512, seed=0,
                          verbose=False)
    rng = np.random.default_rng(2424)
    tensors, prompts = {}, []
    for i, n in enumerate(PROMPT_LENGTHS):
        ids = [int(t) for t in rng.integers(3, VOCAB, n)]
        llm.reset()
        llm.eval(ids)
        logits = np.array(llm.scores[:n], dtype=np.float32)
        tensors[f"ids_{i}"] = np.array(ids, dtype=np.int32)
        tensors[f"logits_{i}"] = logits
        llm.reset()
        gen = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            gen.append(int(tok))
            if len(gen) == N_GEN:
                break
        assert gen[0] == int(np.argmax(logits[-1]))
        top2 = np.sort(logits, axis=1)[:, -2:]
        prompts.append({"prompt_ids": ids, "generated_ids": gen,
                        "min_top2_margin": float((top2[:, 1] - top2[:, 0]).min())})
    return tensors, prompts


def main():
    import llama_cpp

    args = sys.argv[1:]
    if args[:1] == ["--bench-source"]:
        smollm = args[2] if len(args) > 2 else os.environ["SHELFSERVE_DEFAULT_GGUF"]
        write_f32(Path(args[1]), smollm, hidden=1024, heads=16, kv_heads=4, ff=2816, layers=16)
        print(f"wrote {args[1]}")
        return
    smollm = args[0] if args else os.environ["SHELFSERVE_DEFAULT_GGUF"]
    OUT.mkdir(parents=True, exist_ok=True)
    src = Path("/tmp/shelfserve-kquant-tiny-f32.gguf")
    write_f32(src, smollm)
    doc = {"source": "scripts/gen_llamacpp_kquant_golden.py (seeded F32 GGUF, see its doc)", "files": {}}
    for mix, ftype in MIXES.items():
        dst = OUT / f"tiny-{mix}.gguf"
        quantize(src, dst, ftype)
        types = tensor_types(dst)
        tensors, prompts = golden(dst)
        write_safetensors(OUT / f"tiny-{mix}.safetensors", tensors)
        counts = {}
        for t in types.values():
            counts[t] = counts.get(t, 0) + 1
        doc["files"][mix] = {"gguf": dst.name, "logits": f"tiny-{mix}.safetensors", "tensor_types": types,
                             "dequantized_rows": dequantized_rows(dst), "prompts": prompts}
        print(f"{mix}: {dst.stat().st_size / 1e6:.2f} MB, types {counts}, "
              f"min top-2 margins {[round(p['min_top2_margin'], 3) for p in prompts]}")
    (OUT / "golden.json").write_text(json.dumps(doc, indent=1) + "\n")
    lib = Path(llama_cpp.__file__).parent / "lib"
    ggml = sorted(p.name for p in lib.glob("libggml.so.*.*"))
    from importlib.metadata import version
    (OUT / "VERSIONS.txt").write_text(
        f"llama-cpp-python {llama_cpp.__version__} (llama.cpp {llama_cpp.llama_version().decode()}, "
        f"{ggml[-1] if ggml else 'ggml ?'})\n"
        f"system_info {llama_cpp.llama_print_system_info().decode().strip()}\n"
        f"gguf {version('gguf')}\nnumpy {np.__version__}\n")


if __name__ == "__main__":
    main()
