#!/usr/bin/env python3
"""Measure an OpenAI-compatible /v1/completions endpoint: single-stream decode tok/s and
N-parallel aggregate tok/s. Standard library only.

usage: bench_client.py BASE_URL [--parallel 8] [--max-tokens 128] [--label NAME] [--json OUT]

Single stream: one streaming request; decode tok/s = (tokens - 1) / (t_last - t_first), so
prompt processing is excluded. Parallel: N concurrent streaming requests with different prompts;
aggregate tok/s = all completion tokens / wall time from first send to last token.
Greedy (temperature 0) so both engines do the same work per token.
"""
import argparse
import json
import sys
import threading
import time

from sse import stream_chunks

PROMPTS = [
    "Write a detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain step by step how a compiler turns source code into machine code.",
    "Describe the history of the printing press and its effect on Europe.",
    "List the planets of the solar system and describe each one in a paragraph.",
    "Write a long letter from a sailor to his family describing a storm at sea.",
    "Explain how photosynthesis works, in detail, for a curious teenager.",
    "Describe a walk through a busy market in a city you invent.",
    "Explain the rules of chess and give advice for beginners.",
]


def stream(base, prompt, max_tokens, out):
    try:
        _stream(base, prompt, max_tokens, out)
    except Exception as e:  # a refused or broken request must show in the report, not vanish
        out.append({"t0": time.perf_counter(), "times": [], "error": repr(e)})


def _stream(base, prompt, max_tokens, out):
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    times = []
    for chunk in stream_chunks(base + "/completions", body, timeout=600):
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            times.append(time.perf_counter())
    out.append({"t0": t0, "times": times})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--label", default="engine")
    ap.add_argument("--json")
    a = ap.parse_args()
    base = a.base.rstrip("/")
    # Warm-up (first request pays one-time costs).
    stream(base, "Hello", 8, [])
    single = []
    stream(base, PROMPTS[0], a.max_tokens, single)
    ts = single[0]["times"]
    single_tps = (len(ts) - 1) / (ts[-1] - ts[0]) if len(ts) > 1 else float("nan")
    ttft = ts[0] - single[0]["t0"] if ts else float("nan")
    results = []
    threads = [threading.Thread(target=stream, args=(base, PROMPTS[i % len(PROMPTS)], a.max_tokens, results))
               for i in range(a.parallel)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    end = max(r["times"][-1] for r in results if r["times"])
    total = sum(len(r["times"]) for r in results)
    agg_tps = total / (end - start)
    errors = [r["error"] for r in results if "error" in r]
    res = {"label": a.label, "parallel_errors": errors, "single_stream_tok_s": single_tps, "single_ttft_s": ttft,
           "parallel": a.parallel, "parallel_aggregate_tok_s": agg_tps, "parallel_tokens": total}
    print(json.dumps(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    sys.exit(main())
