#!/usr/bin/env python3
"""Tokenizer goldens for the SmolLM2 GGUF: what llama.cpp (and, as a second opinion, HF
transformers' GGUF-converted tokenizer) produce for a varied corpus.

Usage: /opt/llamaenv/bin/python scripts/gen_tokenizer_golden.py [GGUF]
  GGUF defaults to $SHELFSERVE_DEFAULT_GGUF. The llama.cpp part runs in the interpreter that has
  `llama_cpp`; the HF part is run with /opt/refenv/bin/python (transformers) as a subprocess, or
  set SHELFSERVE_HF_PYTHON to another interpreter ("" to skip it).

Output: tests/fixtures/tokenizer/smollm2_llamacpp.json
  {
    "source": "<gguf file name>",
    "llama_cpp_python_version": "...",
    "transformers_version": "..." | null,
    "tokenize": "llama.cpp tokenize(text.encode(), add_bos=False, special=True)",
    "cases": [
      {"text": "...",            # the input string
       "ids": [..],              # llama.cpp token ids
       "hf_ids": [..] | null}    # transformers AutoTokenizer(gguf_file=...).encode(text, add_special_tokens=False)
    ]
  }
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests/fixtures/tokenizer/smollm2_llamacpp.json"

CORPUS = [
    "",
    " ",
    "Hello world",
    "Hello, world! How are you doing today?",
    "  leading spaces and trailing spaces   ",
    "multiple   spaces\tand\ttabs",
    "line one\nline two\n\nline four\n\n\n",
    "\n",
    "\n\n \n",
    "I'm sure you'll see they've said it's John's and we'd all agree we're done.",
    "DON'T SHOUT, IT'S RUDE",
    "The year 2024 had 366 days; π ≈ 3.14159 and 1,000,000 > 999999.",
    "Call 555-0123 or +1 (800) 123-4567 ext. 89",
    "Emoji: 😀🎉👍🏽 family: 👨‍👩‍👧‍👦 flags: 🇫🇷🇯🇵",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "مرحبا بالعالم، كيف حالك؟",
    "Ελληνικά και русский текст, ñandú, façade, naïve, Zürich.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "fn main() {\n\tlet v: Vec<u32> = (0..10).map(|x| x * x).collect();\n\tprintln!(\"{v:?}\");\n}\n",
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
    "{\"key\": [1, 2.5, -3e10, true, null], \"nested\": {\"a\": \"b\"}}",
    "x=1;y=22;z=333;w=4444;",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n",
    "<|endoftext|>text after end<|endoftext|>",
    "not special: <|im_start and im_end|> <repo_name>owner/repo<file_sep>",
    "a<|im_end|>b<|im_start|>c",
    "https://example.com/path?query=1&b=two#frag",
    "      indented with six spaces",
    "trailing newline and spaces \n  \n",
    "Ünïcödé ﬁ ligature, ｆｕｌｌｗｉｄｔｈ, and combining é (e\u0301)",
    "tab\tseparated\tvalues\t\t\tend",
    "a" * 64,
    "1234567890 0.000001 12.5% $99.99 €5",
    "\u00a0non-breaking\u2003em-space\u200bzero-width",
    "windows\r\nline\r\nendings\r\n",
    "   \n   x  \n\t\n",
    "abc123def 4five six7 'tis 's ''quoted'' \"dq\"",
    "<|im_start|><|im_start|>assistant<|im_end|><|im_end|>",
    "word    ",
    "Mixed: naïve café 東京 123 🚀 <|im_end|>\n",
]

HF_SNIPPET = r"""
import json, sys
from pathlib import Path
import transformers
from transformers import AutoTokenizer
src = Path(sys.argv[1])
tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
texts = json.load(sys.stdin)
print(json.dumps({"version": transformers.__version__,
                  "ids": [tok.encode(t, add_special_tokens=False) for t in texts]}))
"""


def hf_ids(src):
    py = os.environ.get("SHELFSERVE_HF_PYTHON", "/opt/refenv/bin/python")
    if not py:
        return None, None
    try:
        res = subprocess.run([py, "-c", HF_SNIPPET, str(src)], input=json.dumps(CORPUS), capture_output=True,
                             text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"HF transformers reference skipped: {e}\n{getattr(e, 'stderr', '')[-2000:]}", file=sys.stderr)
        return None, None
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    return doc["version"], doc["ids"]


def main():
    import llama_cpp

    src = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ["SHELFSERVE_DEFAULT_GGUF"])
    llm = llama_cpp.Llama(model_path=str(src), vocab_only=True, verbose=False)
    hf_version, hf = hf_ids(src)
    cases = []
    for i, text in enumerate(CORPUS):
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        cases.append({"text": text, "ids": list(ids), "hf_ids": hf[i] if hf else None})
    differ = [c["text"] for c in cases if c["hf_ids"] is not None and c["hf_ids"] != c["ids"]]
    doc = {
        "source": src.name,
        "llama_cpp_python_version": llama_cpp.__version__,
        "transformers_version": hf_version,
        "tokenize": "llama.cpp tokenize(text.encode(), add_bos=False, special=True)",
        "cases": cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    print(f"llama-cpp-python {llama_cpp.__version__}; transformers {hf_version}")
    print(f"wrote {OUT}: {len(cases)} cases; HF differs from llama.cpp on {len(differ)}: {differ!r}")


if __name__ == "__main__":
    main()
