#!/usr/bin/env python3
"""Speculative decoding speedup, same engine, same run: the same greedy requests on a lane
without drafting and on a drafting lane (n-gram, a draft model, DFlash, MTP), on an
agent/code-editing workload (the prompt contains much of the answer) and on prose. Prints
tokens/s per lane and workload, the speedup, the per-position acceptance read from /metrics
(`source` label: the drafter's name) and the mean accepted length per verification.
Standard library only.

usage: bench_speculative.py PLAIN_URL DRAFTED_URL [--max-tokens 128] [--label ngram]
                            [--source SOURCE] [--json OUT]
"""
import argparse
import json
import re
import sys
import time
import urllib.request

CODE = [
    "Here is a Python function:\n\ndef total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
    "        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n    return subtotal + tax\n\n"
    "Rename the variable subtotal to net_total and rewrite the whole function:\n\ndef total_price(items, tax_rate):\n",
    "Config file:\nserver:\n  host: 127.0.0.1\n  port: 8080\n  workers: 4\n  timeout: 30\nlogging:\n  level: info\n"
    "  file: /var/log/app.log\n\nChange the port to 9090 and print the full config file again:\nserver:\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n        self.items.append(x)\n"
    "    def pop(self):\n        return self.items.pop()\n\nAdd a method peek and repeat the full class:\nclass Stack:\n",
]
PROSE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how rain forms, for a ten-year-old.",
    "Describe a walk through a busy market in a city you invent.",
]


def complete(base, prompt, max_tokens):
    body = json.dumps({"model": "default", "messages": [{"role": "user", "content": prompt}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=900) as r:
        out = json.load(r)
    return out["usage"]["completion_tokens"], time.perf_counter() - t0, out["choices"][0]["message"]["content"]


def metric_rows(text, name):
    """(labels dict, value) of every sample of counter `name`."""
    for m in re.finditer(name + r'\{([^}]*)\} (\d+(?:\.\d+)?(?:e[+-]?\d+)?)', text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        yield labels, float(m.group(2))


def acceptance(base, source=None):
    """Acceptance by draft position and the mean accepted length per verification (emitted tokens
    per verify step, bonus included), for drafter `source` (all sources when None)."""
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    keep = lambda labels: source is None or labels.get("source", "").startswith(source)
    drafted, accepted = {}, {}
    for name, table in (("shelfserve_spec_draft_tokens_total", drafted), ("shelfserve_spec_accepted_tokens_total", accepted)):
        for labels, v in metric_rows(text, name):
            if keep(labels) and "position" in labels:
                p = int(labels["position"])
                table[p] = table.get(p, 0.0) + v
    steps = sum(v for l, v in metric_rows(text, "shelfserve_spec_verify_steps_total") if keep(l))
    emitted = sum(v for l, v in metric_rows(text, "shelfserve_spec_emitted_tokens_total") if keep(l))
    by_pos = {p: accepted.get(p, 0) / d for p, d in sorted(drafted.items()) if d}
    return by_pos, (emitted / steps if steps else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("plain")
    ap.add_argument("drafted")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--label", default="ngram", help="the drafting lane's name in the table")
    ap.add_argument("--source", help="only this drafter's metrics (`source` label, e.g. dflash)")
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for workload, prompts in (("code/agent", CODE), ("prose", PROSE)):
        res = {}
        for label, base in (("plain", a.plain), (a.label, a.drafted)):
            toks = secs = 0
            texts = []
            for p in prompts:
                n, s, t = complete(base, p, a.max_tokens)
                toks, secs = toks + n, secs + s
                texts.append(t)
                print(f"  {workload:10s} {label:6s} {n:4d} tokens in {s:6.2f} s", file=sys.stderr, flush=True)
            res[label] = (toks / secs, texts)
        same = res["plain"][1] == res[a.label][1]
        rows.append({"workload": workload, "plain_tok_s": res["plain"][0], "drafted_tok_s": res[a.label][0],
                     "speedup": res[a.label][0] / res["plain"][0], "identical_text": same})
    acc, mean_len = acceptance(a.drafted, a.source)
    print(f"\n| workload | no drafting tok/s | {a.label} k=7 tok/s | speedup | identical output |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['plain_tok_s']:.1f} | {r['drafted_tok_s']:.1f} | {r['speedup']:.2f}x | {r['identical_text']} |")
    print(f"\nacceptance by draft position ({a.source or 'all sources'}): " + ", ".join(f"{p}: {v:.0%}" for p, v in acc.items()))
    if mean_len is not None:
        print(f"mean tokens per verification (accepted + bonus): {mean_len:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "acceptance": acc, "mean_tokens_per_verify": mean_len}, f, indent=1)
    return 0 if all(r["identical_text"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
