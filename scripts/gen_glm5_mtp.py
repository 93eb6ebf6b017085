#!/usr/bin/env python3
"""Generate a tiny glm5_next checkpoint WITH an MTP (next-token-prediction) layer, and a reference
for the MTP head's logits.

Run from the repository root (CPU, fp32):

    /work/venv/bin/python scripts/gen_glm5_mtp.py

Writes tests/fixtures/glm5/tiny-mtp/ (config.json, model.safetensors) and
tests/fixtures/glm5/golden-mtp.safetensors.

The checkpoint layout follows the DeepSeek-V3 convention (../shared/glm5_next_spec.md §6): with
L = num_hidden_layers, the MTP layer lives under `model.language_model.layers.{L}.`:
  enorm.weight, hnorm.weight          RMSNorms of the embedding half and the hidden half
  eh_proj.weight [D, 2D]              input = [enorm(E[t_{i+1}]) ; hnorm(h_i)], embedding half first
  embed_tokens.weight                 a copy of the main embedding (DeepSeek stores it; shared)
  shared_head.norm.weight             the norm before the head
  shared_head.head.weight             a copy of lm_head (shared)
  everything else                     an ordinary glm5_next decoder block (mHC sites, mixer, FFN),
                                      written with transformers' on-disk names
and config.json says `num_nextn_predict_layers: 1`.

What the reference computes (transformers defines no MTP for glm5_next, spec §6, so this is OUR
reading of the DeepSeek-V3 convention applied to the mHC model, and the Rust side follows it):
  h_i  = the main model's final normed hidden state at position i (`last_hidden_state`: the mean of
         the mHC streams after the last layer, then the final norm);
  x'_i = eh_proj([enorm(E[t_{i+1}]) ; hnorm(h_i)]);
  the block runs over the sequence x'_0, x'_1, ... exactly as a glm5_next text model of one layer
  would over input embeddings: the M mHC streams start as copies of x'_i, the block is causal over
  the MTP's own positions, and its output is collapsed by the unweighted stream mean and normed
  with shared_head.norm. This is computed with transformers' own `Glm5NextTextModel` (one layer,
  `inputs_embeds=x'`, its `norm` = shared_head.norm), so the block and the collapse are HF's code;
  only enorm/hnorm/eh_proj and the head around it are written here (RMSNorm with HF's module, a
  bias-free Linear);
  logits_i = head(that), predicting t_{i+2}.
Chaining for k > 1 (the drafter's policy, not part of this reference): the next depth feeds the
MTP's own normed output in place of h.

The MTP layer is not left random: a random layer would never agree with the target, so it is
trained here for a few hundred Adam steps to predict the main model's own greedy continuations
(self-distillation, as MTP heads are trained), which gives the engine's acceptance test something
to measure. The main model's weights are random (gen_glm5_tiny.py's scheme).

`--kda` writes a second, untrained variant (tests/fixtures/glm5/tiny-mtp-kda/,
golden-mtp-kda.safetensors) whose MTP block is KDA + dense MLP, so the drafter's recurrent-state
handling (slot copy before a chained draft, put back after) is covered too; its layer stays random.

golden-mtp.safetensors, for prompt i = 0, 1:
  ids_{i}         i64 [n]         the prompt followed by the main model's greedy continuation
  mtp_logits_{i}  f32 [n-1, V]    row j: the MTP's logits at position j (inputs h_j, t_{j+1})
  logits_{i}      f32 [n, V]      the main model's logits (for sanity)
"""

import json
import math
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextModel, Glm5NextTextRMSNorm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_glm5_tiny import FLAT_TEXT, VISION, randomize  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "glm5"
SEED = 4321
KDA, DSA = "linear_attention", "deepseek_sparse_attention"
# Main model: 3 layers [KDA, DSA, KDA]; the MTP block: DSA (own indexer) + MoE, like DeepSeek's.
MAIN = dict(FLAT_TEXT, layer_types=[KDA, DSA, KDA], indexer_types=["full"] * 3, linear_lower_bound=-5.0)
L = MAIN["num_hidden_layers"]
MTP_BLOCK = dict(layer_types=[DSA], indexer_types=["full"], mlp_layer_types=["sparse"])
KDA_VARIANT = "--kda" in sys.argv[1:]
if KDA_VARIANT:
    MTP_BLOCK = dict(layer_types=[KDA], indexer_types=["full"], mlp_layer_types=["dense"])
SUFFIX = "-kda" if KDA_VARIANT else ""
TRAIN_PROMPTS, PROMPT_LEN, GEN = 192, 12, 40
TEST_LENS = [(21, 24), (9, 30)]


class Mtp(torch.nn.Module):
    def __init__(self, text_cfg):
        super().__init__()
        d = text_cfg.hidden_size
        cfg = Glm5NextTextConfig(**dict(MAIN, num_hidden_layers=1, **MTP_BLOCK))
        cfg._attn_implementation = "sdpa"
        self.enorm = Glm5NextTextRMSNorm(d, text_cfg.rms_norm_eps)
        self.hnorm = Glm5NextTextRMSNorm(d, text_cfg.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * d, d, bias=False)
        self.block = Glm5NextTextModel(cfg)  # its `norm` is shared_head.norm; embed_tokens unused

    def forward(self, embed, head, ids_next, h):
        """ids_next [B,S] = t_{i+1}; h [B,S,D] = the main model's h_i. Returns logits [B,S,V]."""
        x = self.eh_proj(torch.cat([self.enorm(embed(ids_next)), self.hnorm(h)], -1))
        return head(self.block(inputs_embeds=x, use_cache=False).last_hidden_state)


def main_hidden(model, ids):
    out = model.model.language_model(input_ids=ids, use_cache=False)
    h = out.last_hidden_state
    return h, model.lm_head(h)


def main():
    torch.set_num_threads(2)
    cfg = Glm5NextConfig(text_config=MAIN, vision_config=VISION, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Glm5NextForConditionalGeneration(cfg).eval()
    randomize(model, SEED)
    v = MAIN["vocab_size"]
    g = torch.Generator().manual_seed(SEED + 1)

    # Training data: the main model's greedy continuations of random prompts.
    seqs = []
    for b in range(0 if KDA_VARIANT else TRAIN_PROMPTS // 32):
        p = torch.randint(1, v, (32, PROMPT_LEN), generator=g)
        with torch.no_grad():
            s = model.generate(input_ids=p, max_new_tokens=GEN, min_new_tokens=GEN, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        seqs.append(s)
        print(f"generated batch {b}", flush=True)
    if not KDA_VARIANT:
        seqs = torch.cat(seqs, 0)
        with torch.no_grad():
            hidden, _ = main_hidden(model, seqs)

    torch.manual_seed(SEED + 2)
    mtp = Mtp(cfg.text_config)
    randomize(mtp, SEED + 3)
    embed, head = model.model.language_model.embed_tokens, model.lm_head
    for p in list(embed.parameters()) + list(head.parameters()):
        p.requires_grad_(False)
    opt = torch.optim.Adam(mtp.parameters(), lr=3e-3)
    # Position i predicts t_{i+2}; only greedy tokens are predictable (the prompt is random).
    first = PROMPT_LEN - 2
    n_train = TRAIN_PROMPTS - 32
    for step in range(0 if KDA_VARIANT else 400):
        idx = torch.randint(0, n_train, (32,), generator=g)
        s, h = seqs[idx], hidden[idx]
        logits = mtp(embed, head, s[:, 1:-1], h[:, :-2])
        loss = torch.nn.functional.cross_entropy(logits[:, first:].reshape(-1, v), s[:, first + 2:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    mtp.eval()
    if not KDA_VARIANT:
        with torch.no_grad():
            s, h = seqs[n_train:], hidden[n_train:]
            pred = mtp(embed, head, s[:, 1:-1], h[:, :-2]).argmax(-1)[:, first:]
            acc = (pred == s[:, first + 2:]).float().mean().item()
        print(f"held-out top-1 agreement of the MTP head with the main model's greedy next-next token: {acc:.3f}")

    # Save: the main model with the MTP block as an extra layer L (transformers writes its on-disk
    # names), then the config cut back to L layers and the MTP's own tensors added.
    big_text = dict(MAIN, num_hidden_layers=L + 1,
                    layer_types=MAIN["layer_types"] + MTP_BLOCK["layer_types"],
                    indexer_types=MAIN["indexer_types"] + MTP_BLOCK["indexer_types"],
                    mlp_layer_types=MAIN["mlp_layer_types"] + MTP_BLOCK["mlp_layer_types"])
    big_cfg = Glm5NextConfig(text_config=big_text, vision_config=VISION, tie_word_embeddings=False)
    big = Glm5NextForConditionalGeneration(big_cfg).eval()
    state = dict(model.state_dict())
    for k, t in mtp.block.layers[0].state_dict().items():
        state[f"model.language_model.layers.{L}.{k}"] = t
    missing, unexpected = big.load_state_dict(state, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    out_dir = OUT / f"tiny-mtp{SUFFIX}"
    if out_dir.exists():
        shutil.rmtree(out_dir)
    big.save_pretrained(out_dir)
    st_path = out_dir / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(st_path)).items() if not k.startswith("model.visual.")}
    p = f"model.language_model.layers.{L}."
    tensors[p + "enorm.weight"] = mtp.enorm.weight.detach().clone()
    tensors[p + "hnorm.weight"] = mtp.hnorm.weight.detach().clone()
    tensors[p + "eh_proj.weight"] = mtp.eh_proj.weight.detach().clone()
    tensors[p + "embed_tokens.weight"] = embed.weight.detach().clone()
    tensors[p + "shared_head.norm.weight"] = mtp.block.norm.weight.detach().clone()
    tensors[p + "shared_head.head.weight"] = head.weight.detach().clone()
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(st_path), metadata={"format": "pt"})
    full = json.loads((out_dir / "config.json").read_text())
    flat = dict(full["text_config"], model_type="glm5_next", architectures=full["architectures"])
    flat.update(num_hidden_layers=L, layer_types=flat["layer_types"][:L], indexer_types=MAIN["indexer_types"],
                mlp_layer_types=flat["mlp_layer_types"][:L], num_nextn_predict_layers=1)
    (out_dir / "config.json").write_text(json.dumps(flat, indent=2) + "\n")
    for f in out_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            f.unlink()

    # Goldens on prompts + continuations the MTP was not trained on.
    out = {}
    for i, (plen, gen) in enumerate(TEST_LENS):
        p = torch.randint(1, v, (1, plen), generator=torch.Generator().manual_seed(SEED + 10 + i))
        with torch.no_grad():
            ids = model.generate(input_ids=p, max_new_tokens=gen, min_new_tokens=gen, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            h, logits = main_hidden(model, ids)
            ml = mtp(embed, head, ids[:, 1:], h[:, :-1])
        out[f"ids_{i}"] = ids[0].clone()
        out[f"logits_{i}"] = logits[0].float().contiguous()
        out[f"mtp_logits_{i}"] = ml[0].float().contiguous()
        agree = (ml[0, plen - 1:-1].argmax(-1) == ids[0, plen + 1:]).float().mean().item()
        print(f"prompt {i}: len {plen} + {gen}, MTP agreement on the continuation {agree:.3f}")
    golden = OUT / f"golden-mtp{SUFFIX}.safetensors"
    save_file(out, str(golden))
    total = sum(f.stat().st_size for f in [st_path, out_dir / "config.json", golden])
    print(f"wrote {out_dir} and {golden.name} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
