#!/usr/bin/env python3
"""The default model (SmolLM2-135M-Instruct, shipped only as a Q4_1 GGUF) as an HF safetensors
checkpoint, quantized by the real tools into the safetensors formats shelfserve loads. Used by
scripts/quant_kld_default.sh; CPU only, calibration-free (round-to-nearest from the weights).

    quant_default_model.py reference GGUF OUT       the GGUF dequantized to f32 (transformers'
                                                    GGUF loader), saved by save_pretrained with
                                                    the tokenizer; every tensor checked against
                                                    gguf-py's own dequantization
    quant_default_model.py quantize REF FORMAT OUT  quantize REF into FORMAT (below); exit 3 with
                                                    the reason when the tool cannot make it
    quant_default_model.py prompts REF OUT          real-text prompts tokenized with REF's
                                                    tokenizer, one comma-separated id line each
    quant_default_model.py pykld REF IDS SCORES Q...
                                                    transformers' f32 forward as a cross-check:
                                                    REF's logits against shelfserve's (score
                                                    files SCORES/ref-<i>.safetensors), and each
                                                    quantized dir Q's weights, as its tool
                                                    decompresses them, against REF's logits;
                                                    and REF with Q8-rounded activations (the
                                                    GGUF path's arithmetic) against REF

FORMAT:
  fp8             transformers' FineGrainedFP8 save-time quantizer (`Fp8Quantize`, 128x128
                  blocks), as scripts/gen_quant_fixtures.py runs it; `quant_method: fp8`
  fp8-block-ct    llmcompressor `QuantizationModifier(scheme="FP8_BLOCK")`: compressed-tensors
                  `float-quantized`, 128x128 weight blocks and dynamic FP8 activations
  int4            llmcompressor `QuantizationModifier(scheme="W4A16")`: pack-quantized, group 128
  int4-ragged     the same with `bypass_divisibility_checks=True` (the other way out the tool's
                  error names): a 576-wide row gets 4 groups of 128 and one of 64
  int4-g128-skip  W4A16, with the projections whose width is not a multiple of 128 on `ignore`
                  (what the tool's error message tells one to do)
  int4-g64        llmcompressor, the W4A16 scheme with `group_size` 64 (symmetric int4, group)
  nvfp4           llmcompressor `QuantizationModifier(scheme="NVFP4A16")`: nvfp4-pack-quantized
"""

import json
import shutil
import sys
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Chat, code and prose; written for this script.
CHAT = [
    {"role": "system", "content": "You are a helpful assistant who answers briefly."},
    {"role": "user", "content": "Why does the sky look blue during the day but red at sunset?"},
    {"role": "assistant", "content": "Sunlight is scattered by the molecules in the air, and short (blue) "
     "wavelengths scatter much more strongly than long (red) ones, so blue light reaches your eyes from every "
     "direction of the sky. At sunset the light crosses far more air before it reaches you; most of the blue "
     "is scattered away on the way, and the remaining light is dominated by orange and red."},
]
CHAT2 = [
    {"role": "user", "content": "Give me three tips for writing a good commit message."},
    {"role": "assistant", "content": "1. Start with a short summary line in the imperative mood, such as "
     "\"Fix crash when the config file is empty\".\n2. Leave a blank line, then explain why the change was "
     "needed, not only what it does.\n3. Keep each commit to one logical change so the message can describe "
     "it completely."},
]
CODE = '''def merge_intervals(intervals):
    """Merge overlapping [start, end] intervals and return them sorted."""
    if not intervals:
        return []
    intervals = sorted(intervals, key=lambda iv: iv[0])
    merged = [list(intervals[0])]
    for start, end in intervals[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return merged


if __name__ == "__main__":
    print(merge_intervals([[1, 3], [2, 6], [8, 10], [15, 18]]))
'''
PROSE = ("The town sat at the bend of a slow brown river, and for most of the year nothing much happened "
         "there. In spring the water rose over the lower fields, and the farmers moved their sheep to the "
         "hill behind the church. In summer the children swam from the old stone bridge, although their "
         "parents told them every year that it was dangerous. By autumn the orchards were heavy with apples, "
         "and the smell of cider drifted through the narrow streets until the first frost.")


def fail(msg, code=3):
    print(msg, file=sys.stderr)
    sys.exit(code)


def reference(gguf_path, out):
    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from train_dflash import _unpermute as unpermute  # llama.cpp's q/k row order back to HF's

    gguf_path, out = Path(gguf_path), Path(out)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    config = loaded.config
    del config.quantization_config  # the weights below are plain f32
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(loaded.state_dict())
    state = model.state_dict()

    # Every tensor equals gguf-py's dequantization of the GGUF's (q/k rows un-permuted).
    reader = gguf.GGUFReader(str(gguf_path))
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    per_layer = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    types = {}
    for t in reader.tensors:
        if t.name.startswith("blk."):
            _, layer, kind, _ = t.name.split(".")
            hf = f"model.layers.{layer}.{per_layer[kind]}.weight"
        else:
            hf = names[t.name]
        w = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        w = w.reshape(state[hf].shape)
        if hf.endswith("q_proj.weight"):
            w = unpermute(w, config.num_attention_heads)
        elif hf.endswith("k_proj.weight"):
            w = unpermute(w, config.num_key_value_heads)
        if not torch.equal(w, state[hf]):
            fail(f"{hf}: transformers' GGUF load differs from gguf-py's dequantization of {t.name}", 1)
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    if len(reader.tensors) != len([k for k in state if k != "lm_head.weight"]):
        fail(f"{len(reader.tensors)} GGUF tensors, {len(state)} in the model", 1)

    model.save_pretrained(out)
    tok.save_pretrained(out)
    # transformers' GGUF tokenizer conversion names <|im_start|> as eos; the GGUF says id 2.
    eos = reader.fields["tokenizer.ggml.eos_token_id"].contents()
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["eos_token"], tc["eos_token_id"] = tok.convert_ids_to_tokens(eos), eos
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    stored = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in stored and stored["eos_token_id"] == eos
    print(f"reference: {len(reader.tensors)} GGUF tensors ({types}) dequantized to f32, each equal to gguf-py's; "
          f"chat template {'kept' if tok.chat_template else 'MISSING'}; eos {tc['eos_token']!r}")


def copy_aux(ref, out):
    for name in TOKENIZER_FILES:
        if (Path(ref) / name).exists():
            shutil.copy(Path(ref) / name, Path(out) / name)


def quantize_fp8(ref, out):
    from types import SimpleNamespace

    from safetensors.torch import load_file, save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    cfg = FineGrainedFP8Config(weight_block_size=(128, 128), modules_to_not_convert=["lm_head"])
    op = Fp8Quantize(SimpleNamespace(quantization_config=cfg))
    state = load_file(str(Path(ref) / "model.safetensors"))
    result, quantized, kept = {}, [], {}
    for name, t in state.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in PROJECTIONS:
            res = op._quantize_one(name, t)
            if len(res) == 2:
                quantized.append(module)
            else:
                kept[tuple(t.shape)] = kept.get(tuple(t.shape), 0) + 1
            result.update(res)
        else:
            result[name] = t
    if not quantized:
        fail(f"fp8: transformers' FineGrainedFP8 quantizer (Fp8Quantize) leaves every projection unquantized: no "
             f"shape tiles into 128x128 blocks ({', '.join(f'{n} x {list(s)}' for s, n in kept.items())}); "
             f"hidden size 576 = 4.5 x 128")
    Path(out).mkdir(parents=True)
    save_file(result, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(ref) / "config.json").read_text())
    config["quantization_config"] = {k: v for k, v in cfg.to_dict().items() if k != "dequantize"}
    (Path(out) / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_aux(ref, out)
    print(f"fp8: {len(quantized)} projections quantized, {sum(kept.values())} left in f32")


def quantize_llmcompressor(ref, fmt, out):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    ignore = ["lm_head"]
    if fmt == "int4-g128-skip":
        ignore += [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
                   and m.in_features % 128]
    kwargs = {"bypass_divisibility_checks": True} if fmt == "int4-ragged" else {}
    if fmt == "int4-g64":
        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
            num_bits=4, type="int", symmetric=True, strategy="group", group_size=64))
        recipe = QuantizationModifier(config_groups={"group_0": scheme}, ignore=ignore)
    else:
        preset = {"fp8-block-ct": "FP8_BLOCK", "int4": "W4A16", "int4-ragged": "W4A16", "int4-g128-skip": "W4A16",
                  "nvfp4": "NVFP4A16"}[fmt]
        recipe = QuantizationModifier(targets="Linear", scheme=preset, ignore=ignore, **kwargs)
    try:
        oneshot(model=model, recipe=recipe)
    except Exception as e:  # the tool refusing this model: say why, make nothing
        why, *layers = " ".join(str(e).split()).split(" - ")
        listed = f" ({len(layers)} layers listed, first: {layers[0]})" if layers else ""
        fail(f"{fmt}: llmcompressor refuses: {type(e).__name__}: {why}{listed}")
    model.save_pretrained(out, save_compressed=True)
    copy_aux(ref, out)
    q = json.loads((Path(out) / "config.json").read_text())["quantization_config"]
    linears = sum(isinstance(m, torch.nn.Linear) for n, m in model.named_modules() if n != "lm_head")
    skipped = len(ignore) - 1
    print(f"{fmt}: format {q.get('format')}, {linears - skipped} projections quantized, {skipped} on ignore")


def prompts(ref, out):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ref)
    rows = [tok.apply_chat_template(CHAT, tokenize=False), tok.apply_chat_template(CHAT2, tokenize=False), CODE, PROSE]
    lines = []
    for text in rows:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text, "tokenizer round trip"
        lines.append(",".join(map(str, ids)))
    Path(out).write_text("\n".join(lines) + "\n")
    print(f"prompts: {len(lines)} (chat, chat, code, prose), {[len(l.split(',')) for l in lines]} tokens")


def decompress(qdir):
    """The quantized projections of `qdir` as its tool decompresses them, in f32."""
    from safetensors.torch import load_file

    from gen_quant_fixtures import decompress_all

    q = json.loads((Path(qdir) / "config.json").read_text())["quantization_config"]
    stored = load_file(str(Path(qdir) / "model.safetensors"))
    if q["quant_method"] == "fp8":
        return decompress_all(stored, "fp8")
    fmt = q["format"]
    if fmt in ("pack-quantized", "nvfp4-pack-quantized"):
        # The checkpoint's own scheme: its group size is not always the preset's.
        from compressed_tensors.quantization import QuantizationScheme
        scheme = QuantizationScheme.model_validate(next(iter(q["config_groups"].values())))
        return decompress_all(stored, "int4" if fmt == "pack-quantized" else "nvfp4", scheme)
    if fmt == "float-quantized":
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import dequantize
        args = QuantizationArgs.model_validate(next(iter(q["config_groups"].values()))["weights"])
        out = {}
        for name, t in stored.items():
            if name.endswith(".weight_scale"):
                continue
            s = stored.get(name[: -len("weight")] + "weight_scale")
            out[name] = (dequantize(x_q=t.float(), scale=s.float(), args=args, dtype=torch.float32)
                         if s is not None else t.float())
        return out
    fail(f"{qdir}: no decompression for format {fmt}", 1)


def q8_round(x):
    blocks = x.reshape(-1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1)), 0)
    return (q * d.half().float()).reshape(x.shape)


def pykld(ref, ids_file, score_dir, qdirs):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    prompts = [[int(x) for x in line.split(",")] for line in Path(ids_file).read_text().split()]
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    base = {k: v.clone() for k, v in model.state_dict().items()}

    def logits():
        with torch.no_grad():
            return [model(input_ids=torch.tensor([p]), use_cache=False).logits[0].double() for p in prompts]

    def kl(refs, ours):
        rows = [(torch.log_softmax(a, -1), torch.log_softmax(b, -1)) for a, b in zip(refs, ours)]
        per = torch.cat([(la.exp() * (la - lb)).sum(-1) for la, lb in rows])
        top1 = torch.cat([(la.argmax(-1) == lb.argmax(-1)).double() for la, lb in rows])
        return f"mean KL {per.mean():.3e}, max KL {per.max():.3e}, top-1 {top1.mean():.3f} ({len(per)} positions)"

    ref_logits = logits()
    ours = [load_file(str(Path(score_dir) / f"ref-{i}.safetensors"))["logits"].double() for i in range(len(prompts))]
    diff = max((a - b).abs().max().item() for a, b in zip(ref_logits, ours))
    print(f"reference, shelfserve score against transformers: {kl(ref_logits, ours)}, max |dlogit| {diff:.2e}")
    # The GGUF path's activation arithmetic: every linear's input (the LM head's too) rounded to
    # Q8 blocks of 32 (scale amax/127, kept as f16), as GGML quantizes activations for Q4_1/Q8_0 dots.
    hooks = [m.register_forward_pre_hook(lambda m, a: (q8_round(a[0]),) + a[1:])
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    print(f"reference with Q8-rounded linear inputs, against reference: {kl(ref_logits, logits())}")
    for h in hooks:
        h.remove()
    for qdir in qdirs:
        weights = decompress(qdir)
        model.load_state_dict({k: weights.get(k, v).reshape(v.shape).float() for k, v in base.items()})
        print(f"{Path(qdir).name} (transformers, the tool's decompressed weights): {kl(ref_logits, logits())}")
        model.load_state_dict(base)


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "reference":
        reference(*args)
    elif cmd == "quantize":
        ref, fmt, out = args
        if fmt == "fp8":
            quantize_fp8(ref, out)
        else:
            quantize_llmcompressor(ref, fmt, out)
    elif cmd == "prompts":
        prompts(*args)
    elif cmd == "pykld":
        pykld(args[0], args[1], args[2], args[3:])
    else:
        fail(__doc__, 2)


if __name__ == "__main__":
    main()
