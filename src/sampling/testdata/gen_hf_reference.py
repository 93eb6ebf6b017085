"""Golden cases for `shelfserve::sampling` from HF transformers' logits processors.

Regenerate with:  /opt/refenv/bin/python src/sampling/testdata/gen_hf_reference.py
(writes hf_reference.json beside this file; transformers + torch needed).

Logits come from an integer hash so the Rust test can rebuild the same f32 row bit for bit without
storing 50k-entry rows: logit[i] = f32(((i * MUL + salt * SALT_MUL) mod 2^32) / 2^32 * scale - scale / 2).

Pipeline (vLLM's order, each stage from HF where HF has it):
  logit_bias (plain add) -> RepetitionPenaltyLogitsProcessor over prompt+output
  -> presence/frequency (OpenAI/vLLM formula: logit -= frequency * count + presence * (count > 0),
     over output tokens; HF has no such processor)
  -> greedy: argmax | TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper
  -> MinPLogitsWarper -> softmax.
Raw logprobs: torch.log_softmax of the unmodified row.
"""
import json
import os

import numpy as np
import torch
import transformers
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

MUL = 2654435761
SALT_MUL = 40503


def hashed_logits(n, salt, scale):
    i = np.arange(n, dtype=np.uint64)
    h = (i * np.uint64(MUL) + np.uint64(salt * SALT_MUL)) % np.uint64(2**32)
    return (h.astype(np.float64) / 2.0**32 * scale - scale / 2.0).astype(np.float32)


def reference(case):
    logits = hashed_logits(case["vocab"], case["salt"], case["scale"])
    raw = torch.from_numpy(logits.copy())[None, :]
    scores = raw.clone()
    for tok, bias in case["logit_bias"]:
        scores[0, tok] += np.float32(bias)
    history = case["prompt"] + case["output"]
    if case["repetition_penalty"] != 1.0 and history:
        ids = torch.tensor([history], dtype=torch.long)
        scores = RepetitionPenaltyLogitsProcessor(case["repetition_penalty"])(ids, scores)
    counts = np.bincount(np.array(case["output"], dtype=np.int64), minlength=case["vocab"]).astype(np.float32)
    adj = np.float32(case["frequency_penalty"]) * counts + np.float32(case["presence_penalty"]) * (counts > 0)
    scores = scores - torch.from_numpy(adj.astype(np.float32))[None, :]

    out = {}
    if case["temperature"] == 0.0:
        out["greedy_token"] = int(torch.argmax(scores[0]).item())
    else:
        dummy = torch.zeros((1, 1), dtype=torch.long)
        scores = TemperatureLogitsWarper(case["temperature"])(dummy, scores)
        if case["top_k"] > 0:
            scores = TopKLogitsWarper(case["top_k"])(dummy, scores)
        if case["top_p"] < 1.0:
            scores = TopPLogitsWarper(case["top_p"])(dummy, scores)
        if case["min_p"] > 0.0:
            scores = MinPLogitsWarper(case["min_p"])(dummy, scores)
        probs = torch.softmax(scores[0].double(), dim=-1)
        kept = torch.nonzero(probs > 0).flatten().tolist()
        # Big supports are summarised (count + id sums) and spot-checked (the 64 most likely plus 64
        # spread over the kept ids) to keep this file small; small ones are stored whole.
        out["kept_count"] = len(kept)
        out["kept_id_sum"] = int(sum(kept))
        out["kept_id_sq_sum"] = int(sum(i * i for i in kept))
        if len(kept) > 256:
            top = torch.topk(probs, 64).indices.tolist()
            spread = kept[:: max(1, len(kept) // 64)]
            listed = sorted(set(top) | set(spread))
        else:
            listed = kept
        out["probs"] = [[int(i), float(probs[i])] for i in listed]
    lp = torch.log_softmax(raw[0].double(), dim=-1)
    vals, idx = torch.topk(lp, 5)
    out["top5_raw_logprobs"] = [[int(i), float(v)] for i, v in zip(idx.tolist(), vals.tolist())]
    return out


def case(name, vocab=64, salt=1, scale=8.0, **kw):
    c = dict(
        name=name, vocab=vocab, salt=salt, scale=scale, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
        repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=[], prompt=[], output=[],
    )
    c.update(kw)
    return c


CASES = [
    case("temperature_only", temperature=0.7),
    case("hot", temperature=1.8, salt=2),
    case("top_k", temperature=1.0, top_k=7, salt=3),
    case("top_p", temperature=0.9, top_p=0.8, salt=4),
    case("min_p", temperature=1.1, min_p=0.1, salt=5),
    case("top_k_top_p_min_p", temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, salt=6),
    case("repetition", temperature=1.0, repetition_penalty=1.3, prompt=[1, 2, 3, 5, 8, 13, 21], output=[34, 55, 3], salt=7),
    case("repetition_greedy", temperature=0.0, repetition_penalty=2.0, prompt=list(range(0, 64, 2)), salt=8),
    case("presence_frequency", temperature=1.0, presence_penalty=0.7, frequency_penalty=0.4,
         prompt=[9, 10, 11], output=[10, 12, 12, 12, 40], salt=9),
    case("negative_presence", temperature=0.6, top_p=0.95, presence_penalty=-1.5, frequency_penalty=-0.3,
         output=[4, 4, 17], salt=10),
    case("bias", temperature=1.0, top_k=10, logit_bias=[[0, 5.0], [63, -100.0], [30, 2.5]], salt=11),
    case("everything", temperature=0.75, top_k=30, top_p=0.92, min_p=0.02, repetition_penalty=1.15,
         presence_penalty=0.3, frequency_penalty=0.2, logit_bias=[[5, 1.0], [6, -3.0]],
         prompt=[1, 5, 7, 9], output=[7, 7, 20, 21], salt=12),
    case("greedy_bias", temperature=0.0, logit_bias=[[3, 9.0]], salt=13),
    # Vocabulary sizes of real models: exercise the partial-selection paths against HF's full sort.
    case("smollm_vocab_top_p", vocab=49152, scale=24.0, temperature=0.8, top_p=0.9, salt=14),
    case("smollm_vocab_top_k_top_p", vocab=49152, scale=24.0, temperature=1.0, top_k=50, top_p=0.95, salt=15),
    case("qwen_vocab_min_p", vocab=151936, scale=30.0, temperature=1.0, min_p=0.05, salt=16),
    case("qwen_vocab_flat_top_p", vocab=151936, scale=2.0, temperature=1.0, top_p=0.5, salt=17),
    case("large_vocab_top_k_ties_free", vocab=100000, scale=16.0, temperature=0.5, top_k=200, salt=18),
]


def main():
    torch.set_grad_enabled(False)
    cases = []
    for c in CASES:
        c = dict(c)
        c["expected"] = reference(c)
        cases.append(c)
    doc = {"generator": "gen_hf_reference.py", "transformers": transformers.__version__, "torch": torch.__version__,
           "hash": {"mul": MUL, "salt_mul": SALT_MUL}, "cases": cases}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_reference.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=None, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {len(cases)} cases to {path}")


if __name__ == "__main__":
    main()
