#!/usr/bin/env python3
"""Generate a tiny random GLM-5.3-Flash (`glm5_next`) checkpoint that carries a tokenizer and a
chat template, and the text transformers' greedy `generate` produces for a few chat and plain
prompts: the fixture for serving the model end to end (`tests/glm5_serve.rs`).

Run from the repository root with the reference environment (CPU, fp32):

    /opt/refenv/bin/python scripts/gen_glm5_chat.py

Writes tests/fixtures/glm5/chat/ (model, config and generation config via `save_pretrained`;
tokenizer.json, tokenizer_config.json and chat_template.jinja via the tokenizer's
`save_pretrained`) and tests/fixtures/glm5/chat-golden.json.

* Tokenizer: a byte-level BPE trained with the `tokenizers` library on the fixed text below
  (vocab target 640; the alphabet is only the bytes of that text, so every id decodes to
  ASCII and a random model cannot emit half a UTF-8 character), plus GLM's special tokens.
* Chat template: GLM-style roles (`[gMASK]<sop><|system|>\n...<|user|>\n...<|assistant|>`)
  with GLM's `enable_thinking` switch (`<think></think>` when thinking is off).
* End of generation: `<|endoftext|>`, `<|user|>` and `<|observation|>` (as GLM ships them).
* Model: the architecture of scripts/gen_glm5_tiny.py's `tiny` (every text path, a vision tower
  to set aside) with the tokenizer's vocabulary; weights re-randomised the same way.

chat-golden.json: for each case the request (messages + `enable_thinking`, or a plain prompt),
the prompt ids transformers builds (`apply_chat_template(..., add_generation_prompt=True)`, or
`tokenizer(prompt)`), the greedy ids (`generate(do_sample=False, max_new_tokens=MAX_NEW)`,
stopping at an end-of-generation id), the text `decode(ids, skip_special_tokens=True)` and the
OpenAI `finish_reason`. The script refuses a seed whose DSA top-k has an exact tie at the
selection boundary anywhere in a prompt + continuation, and checks the cached `generate`
against a cache-free argmax loop.
"""

import json
import os
import platform
import shutil
import sys
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_glm5_tiny import TEXT, VISION, boundary_ties, randomize  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "glm5"
SEED = 4321
MAX_NEW = 24
VOCAB_TARGET = 640

SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
            "<think>", "</think>"]
EOS = ["<|endoftext|>", "<|user|>", "<|observation|>"]

CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + '\n' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '\n<think></think>' }}{% endif %}"
    "{{ '\n' }}{% endif %}"
)

CORPUS = """\
The voice assistant answers short questions while the coding agent works through long tasks.
Both share one engine, one pool of cache pages, and one scheduler that decides every step.
A page holds the latent keys of a few thousand tokens and a snapshot of the recurrent state.
When a page is evicted it spills to disk in chunks, each with a checksum, and comes back later.
What is the capital of France? Paris is the capital of France, and Rome is the capital of Italy.
Name three primary colors: red, yellow and blue. How many legs does a spider have? Eight legs.
Write a short poem about the sea. The sea is wide and grey, the waves come in and go away.
def add(a, b):
    return a + b
for i in range(10):
    print(i, add(i, i))
The model reads the prompt, fills the cache, and then writes one token at a time until it stops.
Experts are small networks; the router picks eight of them for every token and mixes their answers.
Linear attention keeps a state that is updated token by token; sparse attention picks a few pools.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 1000. Symbols: ( ) [ ] { } < > = + - * / , . ; : ! ? ' " #
Tell me a story about a cat who learned to read. Once upon a time a small cat found a book.
"""

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "How many legs does a spider have?"},
     {"role": "assistant", "content": "Eight legs."},
     {"role": "user", "content": "Tell me a story about a cat."}],
]
COMPLETIONS = ["The model reads the prompt, fills the cache, and", "def add(a, b):\n"]


def train_tokenizer(work: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_TARGET, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=SPECIALS[1:], clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def greedy(model, ids, eos_ids):
    with torch.no_grad():
        gen = model.generate(input_ids=ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos_ids,
                             pad_token_id=eos_ids[0])
    out = gen[0, ids.shape[1]:].tolist()
    # The cached path must agree with a cache-free argmax loop.
    seq, loop = ids, []
    for _ in range(MAX_NEW):
        with torch.no_grad():
            nxt = int(model(input_ids=seq, use_cache=False).logits[0, -1].argmax())
        loop.append(nxt)
        if nxt in eos_ids:
            break
        seq = torch.cat([seq, torch.tensor([[nxt]])], 1)
    if loop != out:
        sys.exit(f"cached generate {out} differs from the cache-free argmax loop {loop}")
    return out


def main():
    torch.set_num_threads(2)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out_dir = OUT / "chat"
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tokenizer = train_tokenizer(out_dir)
    vocab = len(tokenizer)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in EOS]
    text = dict(TEXT, vocab_size=vocab, eos_token_id=eos_ids, pad_token_id=eos_ids[0])
    cfg = Glm5NextConfig(text_config=text, vision_config=VISION, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Glm5NextForConditionalGeneration(cfg).eval()
    randomize(model, SEED)
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = eos_ids[0]
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # Goldens come from what was saved, read back the way a user would.
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    model = Glm5NextForConditionalGeneration.from_pretrained(out_dir, dtype=torch.float32,
                                                             attn_implementation="sdpa").eval()
    assert len(tokenizer) == vocab and tokenizer.chat_template == CHAT_TEMPLATE

    cases = []
    for i, messages in enumerate(CHATS):
        for thinking in (False, True):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=thinking,
                                                tokenize=True, return_dict=False)
            rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     enable_thinking=thinking, tokenize=False)
            cases.append(dict(name=f"chat{i}-thinking-{str(thinking).lower()}", kind="chat", messages=messages,
                              enable_thinking=thinking, rendered=rendered, prompt_ids=list(ids)))
    for i, prompt in enumerate(COMPLETIONS):
        ids = tokenizer(prompt)["input_ids"]
        cases.append(dict(name=f"completion{i}", kind="completion", prompt=prompt, prompt_ids=list(ids)))

    for case in cases:
        ids = torch.tensor([case["prompt_ids"]])
        out = greedy(model, ids, eos_ids)
        ties = boundary_ties(model, torch.tensor([case["prompt_ids"] + out]))
        if ties:
            sys.exit(f"{case['name']}: exact DSA top-k ties at (layer, query) {ties[:5]}: change SEED")
        stopped = bool(out) and out[-1] in eos_ids
        case["output_ids"] = out
        case["text"] = tokenizer.decode(out, skip_special_tokens=True)
        case["finish_reason"] = "stop" if stopped else "length"
        if "\ufffd" in case["text"]:
            sys.exit(f"{case['name']}: decoded text has a replacement character")
        print(f"{case['name']}: prompt {len(case['prompt_ids'])} tokens, {len(out)} out, "
              f"{case['finish_reason']}: {case['text']!r}")

    golden = dict(
        max_tokens=MAX_NEW, vocab_size=vocab, eos_token_ids=eos_ids,
        versions=f"transformers {transformers.__version__}, torch {torch.__version__}, "
                 f"python {platform.python_version()}, cpu float32 sdpa",
        cases=cases,
    )
    (OUT / "chat-golden.json").write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
    total = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
    print(f"wrote {out_dir} ({total / 1e6:.2f} MB), vocab {vocab}")


if __name__ == "__main__":
    main()
