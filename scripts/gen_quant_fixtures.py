#!/usr/bin/env python3
"""Quantized checkpoints made by the real tools, and transformers' logits for them.

Run from the repository root with the reference environment (CPU):

    /work/wt/venv/bin/python scripts/gen_quant_fixtures.py

Writes tests/fixtures/quant/<model>-<format>/ (config.json with its quantization_config,
model.safetensors, golden.safetensors) for two tiny random models:

  llama   LlamaConfig, vocab 256, hidden 128, 2 layers, 4 heads / 2 kv heads (head_dim 32),
          intermediate 256, tied embeddings.
  glm5    glm5_next (flat text config), vocab 128, hidden 128, layers [KDA, DSA(full)], mlp
          [dense, MoE with 4 routed experts (top 2) + 1 shared expert], hc_mult 2, 8 indexer heads
          (prompts whose DSA top-k ties at the selection boundary are redrawn), every big
          projection 128 wide so the 128-column groups fit; saved in transformers' on-disk
          layout (per-expert `experts.{e}.gate_proj`), as quantized GLM checkpoints ship.

and three formats, each written by the tool that defines it:

  fp8     transformers' FineGrainedFP8 quantizer (`Fp8Quantize`, the op `save_pretrained` runs
          for `FineGrainedFP8Config(weight_block_size=(128, 128))`): float8_e4m3fn weights and
          f32 `weight_scale_inv` per 128x128 block. Like transformers, projections whose shape does
          not tile into 128x128 blocks stay unquantized; `modules_to_not_convert` names one more
          (a tile-able projection) that must stay unquantized.
  int4    compressed-tensors `pack-quantized` (preset W4A16: symmetric int4, group 128), scales
          from compressed-tensors' `calculate_qparams`, packed by its `PackedQuantizationCompressor`.
          Projections whose input width is not a multiple of 128 are on the `ignore` list.
  nvfp4   compressed-tensors `nvfp4-pack-quantized` (preset NVFP4A16: E2M1, group 16, E4M3
          scales, `generate_gparam` global scale), packed by its `NVFP4PackedCompressor`.
          Its decompressor is run in f32 here (it otherwise rounds the dequantized weights to bf16).

Plain tensors (embeddings, norms, unquantized projections) are bf16-representable and stored in
bf16; scales are f32 (the tools keep the scale in the weight's dtype, here f32), so a loader reads
exactly what the tool computed.

golden.safetensors, for prompt i = 0, 1 (pseudo-random ids, lengths 21 and 40):
  ids_{i}     i64 [n]
  logits_{i}  f32 [n, vocab]  transformers' logits for the quantized checkpoint, loaded from the
                              saved directory on CPU in float32. transformers cannot run these
                              formats' kernels on CPU, so it computes with the weights its
                              own load-time decompression produces: FP8 dequantized by
                              `Fp8Dequantize` (f32), int4 by compressed-tensors' decompressor.
                              Where transformers' quantized load cannot run on CPU (NVFP4: it hands
                              bf16 decompressed weights to an f32 forward) or disagrees with the
                              tool's decompression (glm5 FP8: transformers 5.24 loads the MLA
                              `o_proj` codes without their scale and keeps the KDA conv in bf16),
                              the golden is transformers' f32 forward of a plain model holding the
                              weights the tool's decompression computes in f32 (FP8:
                              `Fp8Dequantize`; int4: `PackedQuantizationCompressor.decompress`;
                              NVFP4: compressed-tensors' unpack + dequantize in f32). Which one is
                              in the file's metadata (`reference`) and in VERSIONS.txt.
  greedy_{i}  i64 [24]        generate(do_sample=False, max_new_tokens=24) from the same model.
The script also dequantizes every packed tensor itself with the tool's decompress function,
loads the result into a plain model and checks the logits agree (so the golden is not an artefact
of a loader path), and reports each prompt's smallest top-2 logit margin along the greedy path.
"""

import json
import re
import math
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import compressed_tensors
import torch
import transformers
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from compressed_tensors.quantization.lifecycle.forward import dequantize
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    FineGrainedFP8Config,
    Glm5NextConfig,
    Glm5NextForConditionalGeneration,
    LlamaConfig,
)
from transformers.integrations.finegrained_fp8 import Fp8Quantize

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_glm5_tiny import boundary_ties  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "quant"
NEW_TOKENS = 24
PROMPT_LENS = (21, 40)
SEED = 4321
# Smallest top-2 logit gap accepted along a prompt and its greedy continuation (ours and the
# reference differ by ~1e-5 relative, i.e. ~2e-4 at these logit sizes).
MIN_MARGIN = 5e-3

LLAMA = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, intermediate_size=256, rms_norm_eps=1e-5, tie_word_embeddings=True,
             max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
KDA, DSA = "linear_attention", "deepseek_sparse_attention"
GLM5 = dict(
    vocab_size=128, hidden_size=128, intermediate_size=128, moe_intermediate_size=128,
    num_hidden_layers=2, layer_types=[KDA, DSA], indexer_types=["full", "full"], mlp_layer_types=["dense", "sparse"],
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128,
    qk_nope_head_dim=64, v_head_dim=64, qk_rope_head_dim=0,
    linear_num_heads=2, linear_head_dim=64, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
    routed_scaling_factor=2.5, norm_topk_prob=True, swiglu_limit=10.0,
    index_n_heads=8, index_head_dim=16, index_kpool=4, index_topk=8,
    hc_mult=2, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-5,
    pad_token_id=0, eos_token_id=None, bos_token_id=None, tie_word_embeddings=False,
)
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=128,
              projection_intermediate_size=16)
GLM5_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj",
                "wq_b", "wk", "weights_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                "gate_proj", "up_proj", "down_proj"}
# Tile-able projections the FP8 config leaves in bf16 (module names as the checkpoint stores them).
FP8_NOT_CONVERTED = {"llama": ["model.layers.1.mlp.down_proj"], "glm5": ["model.language_model.layers.0.mlp.down_proj"]}


def randomize(model, seed, gain, embed_std):
    g = torch.Generator().manual_seed(seed)
    n = lambda shape, s: torch.randn(shape, generator=g) * s
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.copy_(n(p.shape, embed_std))
            elif name == "lm_head.weight":
                p.copy_(n(p.shape, 4.0 / math.sqrt(p.shape[-1])))
            elif name.endswith("A_log"):
                p.copy_(n(p.shape, 0.5))
            elif name.endswith("dt_bias") or name.endswith(".base"):
                p.copy_(n(p.shape, 0.5))
            elif name.endswith(".scale") or (p.ndim == 1 and name.endswith("weight")):
                p.copy_(1 + n(p.shape, 0.1))
            elif p.ndim == 1 or name.endswith("compress_ape"):
                p.copy_(n(p.shape, 0.1 if p.ndim == 1 else 0.5))
            else:
                p.copy_(n(p.shape, gain / math.sqrt(p.shape[-1])))
            p.copy_(p.to(torch.bfloat16).float())
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(n(b.shape, 0.05).to(torch.bfloat16).float())


def make_base(kind, tmp):
    """A seeded random model saved by `save_pretrained`: its directory and on-disk state dict."""
    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(**LLAMA)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        randomize(model, SEED, gain=1.0, embed_std=0.4)
    else:
        cfg = Glm5NextConfig(text_config=GLM5, vision_config=VISION, tie_word_embeddings=False)
        model = Glm5NextForConditionalGeneration(cfg).eval()
        randomize(model, SEED + 1, gain=0.6, embed_std=1.0)
    base = Path(tmp) / kind
    model.save_pretrained(base)
    state = load_file(str(base / "model.safetensors"))
    config = json.loads((base / "config.json").read_text())
    if kind == "glm5":
        # Text tensors only (the engine sets the vision tower aside; transformers re-initialises it).
        state = {k: v for k, v in state.items() if not k.startswith("model.visual.")}
    config["dtype"] = "float32"
    return state, config


def is_linear(kind, name, t):
    if not name.endswith(".weight") or t.ndim != 2 or "embed_tokens" in name or name == "lm_head.weight":
        return False
    module = name[: -len(".weight")].rsplit(".", 1)[-1]
    if kind == "llama":
        return module in {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    return name.startswith("model.language_model.layers.") and module in GLM5_LINEARS


def quantize_fp8(kind, state):
    cfg = FineGrainedFP8Config(weight_block_size=(128, 128), modules_to_not_convert=["lm_head"] + FP8_NOT_CONVERTED[kind])
    op = Fp8Quantize(SimpleNamespace(quantization_config=cfg))
    out, quantized = {}, []
    for name, t in state.items():
        module = name[: -len(".weight")]
        if is_linear(kind, name, t) and module not in FP8_NOT_CONVERTED[kind]:
            res = op._quantize_one(name, t.float())
            if len(res) == 2:
                quantized.append(module)
            out.update(res)
        else:
            out[name] = t
    qc = cfg.to_dict()
    qc = {k: v for k, v in qc.items() if k != "dequantize"}
    return out, qc, quantized


def ct_scheme(fmt):
    return preset_name_to_scheme("W4A16" if fmt == "int4" else "NVFP4A16", ["Linear"])


def quantize_ct(kind, state, fmt):
    scheme = ct_scheme(fmt)
    args = scheme.weights
    compressor = PackedQuantizationCompressor if fmt == "int4" else NVFP4PackedCompressor
    # `ignore` names modules as the quantizing tool sees them: transformers' in-memory model
    # (KDA's forget-gate projections live under `forget_gate.`), and the vision tower.
    out, ignore, quantized = {}, ["lm_head"] + (["re:.*visual.*"] if kind == "glm5" else []), []
    for name, t in state.items():
        module = name[: -len(".weight")]
        if not is_linear(kind, name, t):
            out[name] = t
            continue
        w = t.float()
        rows, cols = w.shape
        if cols % args.group_size:
            ignore.append(re.sub(r"self_attn\.(f_a_proj|f_b_proj)$", r"self_attn.forget_gate.\1", module))
            out[name] = t
            continue
        groups = w.reshape(rows, cols // args.group_size, args.group_size)
        mn, mx = groups.amin(-1), groups.amax(-1)
        sd = {"weight": w}
        global_scale = None
        if fmt == "nvfp4":
            global_scale = generate_gparam(w.amin(), w.amax())
            sd["weight_global_scale"] = global_scale
        scale, zp = calculate_qparams(mn, mx, args, global_scale=global_scale)
        sd["weight_scale"], sd["weight_zero_point"] = scale, zp
        for k, v in compressor.compress(sd, scheme).items():
            out[f"{module}.{k}"] = v.contiguous()
        quantized.append(module)
    qc = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="pack-quantized" if fmt == "int4" else "nvfp4-pack-quantized",
        quantization_status="compressed",
        ignore=ignore,
    ).to_dict()
    return out, qc, quantized


def decompress_all(state, fmt, scheme=None):
    """Every quantized projection dequantized by the tool's own decompression, as f32; int4 and
    nvfp4 under `scheme` (default: the preset these fixtures are made with)."""
    out = {}
    if fmt == "fp8":
        cfg = FineGrainedFP8Config(weight_block_size=(128, 128))
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize
        op = Fp8Dequantize(SimpleNamespace(quantization_config=cfg))
        for name, t in state.items():
            if name.endswith("weight_scale_inv"):
                continue
            inv = state.get(name + "_scale_inv")
            out[name] = op._dequantize_one(t, inv, output_dtype=torch.float32) if inv is not None else t.float()
        return out
    scheme = scheme or ct_scheme(fmt)
    params = ("weight_packed", "weight_scale", "weight_shape", "weight_global_scale")
    for name, t in state.items():
        module, _, param = name.rpartition(".")
        if param in params:
            if param == "weight_packed":
                sd = {p: state[f"{module}.{p}"] for p in params if f"{module}.{p}" in state}
                if fmt == "int4":
                    w = PackedQuantizationCompressor.decompress(sd, scheme)["weight"]
                else:
                    # NVFP4PackedCompressor.decompress, in f32: its unpack defaults to bf16 output,
                    # which would round the dequantized weights to bf16.
                    rows, half = sd["weight_packed"].shape
                    codes = unpack_fp4_from_uint8(sd["weight_packed"], rows, 2 * half, dtype=torch.float32)
                    w = dequantize(x_q=codes, scale=sd["weight_scale"].to(torch.float32), args=scheme.weights,
                                   global_scale=sd["weight_global_scale"], dtype=torch.float32)
                out[f"{module}.weight"] = w.float()
            continue
        out[name] = t.float()
    return out


def margins(logits):
    top2 = torch.topk(logits, 2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]).min().item()


def goldens(path, plain_state, plain_config, vocab, tag):
    """Logits and greedy tokens of transformers' model loaded from `path`; where transformers
    cannot run that model on CPU, or computes something else than the tool's decompression (see
    the module doc), those of a plain f32 model holding the tool's decompressed weights."""
    cls = Glm5NextForConditionalGeneration if plain_config["model_type"] == "glm5_next" else AutoModelForCausalLM
    try:
        model, load_error = cls.from_pretrained(path, dtype=torch.float32).eval(), None
    except Exception as e:  # transformers' own loader failing on its own checkpoint format
        model, load_error = None, f"its quantized load fails ({str(e).splitlines()[0]})"
    with tempfile.TemporaryDirectory() as d:
        save_file({k: v.contiguous() for k, v in plain_state.items()}, f"{d}/model.safetensors", metadata={"format": "pt"})
        (Path(d) / "config.json").write_text(json.dumps(plain_config))
        plain = cls.from_pretrained(d, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(SEED + 2)
    out, report = {}, []
    source = "transformers, quantized checkpoint"
    if model is None:
        print(f"{tag}: {load_error}; golden from the decompressed weights")
        model, source = plain, f"transformers, weights decompressed by the tool in f32 ({load_error})"
    for i, n in enumerate(PROMPT_LENS):
        while True:
            ids = torch.randint(3, vocab, (1, n), generator=g)
            # DSA's ReLU index scores can tie exactly at the top-k boundary, where two correct
            # implementations may pick different pools; and a near-tie between the top two
            # logits makes greedy decoding a coin toss at f32 rounding. Draw another prompt.
            if plain_config["model_type"] == "glm5_next" and boundary_ties(plain, ids):
                continue
            with torch.no_grad():
                check = plain(input_ids=ids, use_cache=False).logits[0].float()
                if model is not plain:
                    try:
                        logits = model(input_ids=ids, use_cache=False).logits[0].float()
                        diff = (logits - check).abs().max().item()
                        why = f"its quantized load disagrees with the tool's decompression by {diff:.2e}"
                    except RuntimeError as e:
                        diff, why = float("inf"), f"its quantized load does not run on CPU ({e})"
                    if diff > 1e-4 * max(1.0, check.abs().max().item()):
                        print(f"{tag}: {why}; golden from the decompressed weights")
                        model, source = plain, f"transformers, weights decompressed by the tool in f32 ({why})"
            if model is plain:
                logits, diff = check, 0.0
            with torch.no_grad():
                gen = model.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                     do_sample=False, return_dict_in_generate=True, output_logits=True,
                                     eos_token_id=None, pad_token_id=0)
            m = min(margins(logits), margins(torch.cat(gen.logits, 0).float()))
            if m >= MIN_MARGIN:
                break
        out[f"ids_{i}"] = ids[0].clone()
        out[f"logits_{i}"] = logits.contiguous()
        out[f"greedy_{i}"] = gen.sequences[0, n:].clone()
        report.append(f"prompt {i}: max |logit| {logits.abs().max().item():.2f}, min top-2 margin {m:.4f}, "
                      f"quantized-load vs decompressed {diff:.2e}")
    save_file(out, str(path / "golden.safetensors"), metadata={"reference": source})
    return [f"reference: {source}"] + report


def main():
    torch.set_num_threads(2)
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    summary = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("llama", "glm5"):
            state, config = make_base(kind, tmp)
            vocab = config.get("text_config", config)["vocab_size"]
            for fmt in ("fp8", "int4", "nvfp4"):
                if fmt == "fp8":
                    qstate, qc, quantized = quantize_fp8(kind, state)
                else:
                    qstate, qc, quantized = quantize_ct(kind, state, fmt)
                path = OUT / f"{kind}-{fmt}"
                path.mkdir()
                # Plain tensors in bf16 (they are bf16 values), quantization tensors as the tool made them.
                stored = {k: (v.to(torch.bfloat16) if v.dtype == torch.float32 and not k.rsplit(".", 1)[-1].startswith("weight_") else v)
                          for k, v in qstate.items()}
                save_file({k: v.contiguous() for k, v in stored.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
                (path / "config.json").write_text(json.dumps(dict(config, quantization_config=qc), indent=2) + "\n")
                report = goldens(path, decompress_all(qstate, fmt), config, vocab, f"{kind}-{fmt}")
                size = sum(f.stat().st_size for f in path.iterdir())
                summary.append(f"{kind}-{fmt}: {len(quantized)} projections quantized, {size / 1e3:.0f} kB")
                summary += ["  " + r for r in report]
                print(summary[-4:], flush=True)
    (OUT / "VERSIONS.txt").write_text(
        f"transformers {transformers.__version__}\ncompressed-tensors {compressed_tensors.__version__}\n"
        f"torch {torch.__version__}\npython {platform.python_version()}\ndevice cpu, dtype float32\n\n"
        + "\n".join(summary) + "\n"
    )
    print("\n".join(summary))


if __name__ == "__main__":
    main()
