#!/usr/bin/env python3
"""llama.cpp reference logits and greedy continuations for the SmolLM2 GGUF.

Usage: /opt/llamaenv/bin/python scripts/gen_llamacpp_golden.py [GGUF]
  GGUF defaults to $SHELFSERVE_DEFAULT_GGUF. Needs only llama-cpp-python and numpy (the
  safetensors file is written directly; its format is a u64 header length, a JSON header and
  the raw little-endian tensor bytes).

llama.cpp settings: Llama(model_path, logits_all=True, n_ctx=512, n_threads=2, n_batch=512,
default f16 KV cache), CPU. Prompts are tokenized with tokenize(text, add_bos=True,
special=True): add_bos=True lets the model's own `tokenizer.ggml.add_bos_token` decide (false for
SmolLM2, so no BOS is added), special=True parses <|im_start|> etc. in the chat prompt. The chat
prompt is rendered with the GGUF's own `tokenizer.chat_template` (llama-cpp-python's Jinja2
formatter, add_generation_prompt=True).

Fixture formats
---------------
tests/fixtures/llamacpp/smollm2_logits.safetensors
  For each prompt i (0-based, same order as the JSON below):
    ids_{i}     I32 [n_tokens]          prompt token ids
    logits_{i}  F16 [n_tokens, 49152]   llama.cpp logits after every prompt position (row t is
                                        the distribution for the token following ids[0..=t])
  __metadata__ (all strings): "prompts" (JSON list of the prompt texts),
    "llama_cpp_python_version", "llama_cpp_version", "ggml_version", "source" (GGUF file name),
    "n_prompts".

tests/fixtures/llamacpp/smollm2_greedy.json
  {"source": <GGUF file name>, "llama_cpp_python_version": "...", "llama_cpp_version": "...",
   "ggml_version": "...", "system_info": "...",
   "settings": {...the Llama() and sampling settings...},
   "eos_token_ids": [end-of-generation ids llama.cpp reports for this vocab],
   "prompts": [{"name": "...", "text": "...", "prompt_ids": [...],
                "generated_ids": [40 ids, greedy, NOT stopped at end-of-generation],
                "first_eog_index": index in generated_ids of the first end-of-generation id or null,
                "generated_text": llama.cpp detokenization of generated_ids up to (excluding) the
                                  first end-of-generation id}]}
  Greedy = temperature 0 (llama.cpp's greedy sampler), top_k 1, top_p 1, min_p 0,
  repeat_penalty 1.0 (off). A comparison should use generated_ids[:first_eog_index + 1] when an
  engine stops at EOS.
"""
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "tests/fixtures/llamacpp"
N_GEN = 40
MAX_PROMPT_TOKENS = 20

PLAIN_PROMPTS = [
    ("english", "The capital of France is Paris, and the capital of Germany is"),
    ("code", "def add(a, b):\n    return"),
    ("non_ascii", "Größe 日本語 café 🙂"),
    ("numbers", "1, 2, 3, 5, 8,"),
    ("story", "Once upon a time, there was a little"),
]
# A system message keeps the template from inserting its long default system prompt, so the
# chat prompt stays short (19 tokens; the others are <= 16, about 7.6 MB of logits in all).
CHAT_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
]


def write_safetensors(path, tensors, metadata):
    """tensors: dict name -> numpy array (int32 or float16), written in insertion order."""
    dtypes = {np.dtype(np.int32): "I32", np.dtype(np.float16): "F16"}
    header = {"__metadata__": metadata}
    blobs = []
    offset = 0
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dtypes[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)  # keep the data section 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def main():
    import llama_cpp
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    src = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ["SHELFSERVE_DEFAULT_GGUF"])
    settings = {"logits_all": True, "n_ctx": 512, "n_threads": 2, "n_batch": 512, "seed": 0}
    llm = llama_cpp.Llama(model_path=str(src), verbose=False, **settings)
    meta = llm.metadata
    vocab = llm.n_vocab()

    template = meta["tokenizer.chat_template"]
    eos_text = llm.detokenize([llm.token_eos()], special=True).decode()
    bos_text = llm.detokenize([llm.token_bos()], special=True).decode()
    fmt = Jinja2ChatFormatter(template=template, eos_token=eos_text, bos_token=bos_text, add_generation_prompt=True)
    chat_text = fmt(messages=CHAT_MESSAGES).prompt
    prompts = PLAIN_PROMPTS + [("chat", chat_text)]

    eog = sorted(i for i in range(vocab) if llama_cpp.llama_vocab_is_eog(llm._model.vocab, i))

    tensors = {}
    records = []
    for i, (name, text) in enumerate(prompts):
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
        assert 0 < len(ids) <= MAX_PROMPT_TOKENS, (name, len(ids))
        llm.reset()
        llm.eval(ids)
        logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
        assert logits.shape == (len(ids), vocab)
        tensors[f"ids_{i}"] = np.array(ids, dtype=np.int32)
        tensors[f"logits_{i}"] = logits.astype(np.float16)

        llm.reset()
        gen = []
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            gen.append(int(tok))
            if len(gen) == N_GEN:
                break
        first_eog = next((k for k, t in enumerate(gen) if t in eog), None)
        shown = gen if first_eog is None else gen[:first_eog]
        records.append({
            "name": name,
            "text": text,
            "prompt_ids": [int(t) for t in ids],
            "generated_ids": gen,
            "first_eog_index": first_eog,
            "generated_text": llm.detokenize(shown).decode("utf-8", errors="replace"),
        })
        # Sanity: greedy's first token is the argmax of the last prompt position.
        assert gen[0] == int(np.argmax(logits[-1])), (name, gen[0], int(np.argmax(logits[-1])))

    versions = {
        "llama_cpp_python_version": llama_cpp.__version__,
        "llama_cpp_version": llama_cpp.llama_version().decode(),
        "ggml_version": _ggml_version(),
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    st_meta = {"prompts": json.dumps([t for _, t in prompts], ensure_ascii=False), "source": src.name,
               "n_prompts": str(len(prompts)), **versions}
    write_safetensors(OUT_DIR / "smollm2_logits.safetensors", tensors, st_meta)
    doc = {
        "source": src.name,
        **versions,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "settings": {**settings, "type_k": "f16 (default)", "type_v": "f16 (default)", "add_bos": "model default",
                     "sampling": {"temp": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0},
                     "n_generated": N_GEN},
        "eos_token_ids": eog,
        "prompts": records,
    }
    (OUT_DIR / "smollm2_greedy.json").write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    print(f"llama-cpp-python {versions['llama_cpp_python_version']} (llama.cpp {versions['llama_cpp_version']}, "
          f"ggml {versions['ggml_version']})")
    for r in records:
        print(f"{r['name']}: {len(r['prompt_ids'])} prompt tokens -> {r['generated_text']!r}")
    size = (OUT_DIR / "smollm2_logits.safetensors").stat().st_size
    print(f"wrote {OUT_DIR} (logits file {size / 1e6:.1f} MB)")


def _ggml_version():
    lib = Path(__import__("llama_cpp").__file__).parent / "lib"
    names = sorted(p.name for p in lib.glob("libggml.so.*.*"))
    return names[-1].removeprefix("libggml.so.") if names else "unknown"


if __name__ == "__main__":
    main()
