#!/usr/bin/env python3
"""Golden outputs for images in: transformers' GLM-5.3-Flash image processor on a few small
committed images, and the tiny glm5 checkpoint's multimodal forward with those images.

Run from the repository root with the reference environment (CPU, fp32):

    /work/wt/venv/bin/python scripts/gen_media_golden.py

Writes tests/fixtures/media/:
  *.png, *.jpg, *.gif, *.webp   the input images (made here from seeded noise and gradients)
  cases.json                    per case: image file, processor settings, grid (t, h, w)
  processor.safetensors         pixel_values_{case} f32 [N, 1176] from `Glm5NextImageProcessorPil`
                                (the processor transformers picks without torchvision: PIL's
                                bicubic resize, exactly as the model card's pipeline runs here)
  forward.safetensors           the vision checkpoint below with two images:
    ids           i64 [n]     text ids around two runs of image placeholders (t·h·w/4 each)
    pixel_values  f32 [N, 1176], grid i64 [2, 3]
    image_embeds  f32 [n_img_tokens, 64]  `model.model.get_image_features(...).pooler_output`
    logits        f32 [n, V]  the full forward with the image embeddings scattered in
    text_ids / text_logits    the same ids with the placeholders replaced by text: a text-only
                              forward, unchanged by the vision tower
  VERSIONS.txt
and tests/fixtures/glm5/vision-tiny/: the tiny text checkpoint (tests/fixtures/glm5/tiny) with its
vision tower re-randomised at fan-in scale (the tiny checkpoint's 0.02-scale tower makes image
embeddings of ~1e-7, which no logits comparison could tell apart from zeros), saved with
`save_pretrained`.

The tiny checkpoint's vocabulary (256) does not contain `image_token_id` (154854), so the script
does what `Glm5NextModel.forward` does, in its order, with the placeholder rows embedded from id
0 before they are overwritten: embed → `get_image_features` → `masked_scatter` over the
placeholder mask → the language model on `inputs_embeds`.
"""

import json
import shutil
import platform
from pathlib import Path

import numpy as np
import PIL
import torch
import transformers
from PIL import Image
from safetensors.torch import save_file
from transformers import Glm5NextForConditionalGeneration
from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "media"
TINY = ROOT / "tests" / "fixtures" / "glm5" / "tiny"
VISION_TINY = ROOT / "tests" / "fixtures" / "glm5" / "vision-tiny"


def noise(rng, h, w, c):
    """Noise over a gradient: resampling artefacts show, and no two channels are alike."""
    y, x = np.mgrid[0:h, 0:w]
    planes = [x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), ((x + y) * 7) % 256, 255 - (x * y) % 200]
    base = np.stack(planes, -1)[..., :c]
    return np.clip(base + rng.integers(-60, 61, size=(h, w, c)), 0, 255).astype(np.uint8)


def make_images(rng):
    images = {}
    images["tiny.png"] = Image.fromarray(noise(rng, 3, 5, 3), "RGB")  # upscaled to the token minimum
    images["exact.png"] = Image.fromarray(noise(rng, 56, 56, 3), "RGB")  # already aligned: no resize
    rgba = noise(rng, 60, 90, 4)
    rgba[..., 3] = np.where(rng.random((60, 90)) < 0.3, 0, rgba[..., 3])  # some fully transparent
    images["alpha.png"] = Image.fromarray(rgba, "RGBA")
    images["gray.png"] = Image.fromarray(noise(rng, 120, 200, 1)[..., 0], "L")  # downscaled
    images["photo.jpg"] = Image.fromarray(noise(rng, 41, 57, 3), "RGB")
    pal = Image.fromarray(noise(rng, 30, 40, 3), "RGB").quantize(colors=16, dither=Image.Dither.NONE)
    images["anim.gif"] = pal
    images["lossless.webp"] = Image.fromarray(noise(rng, 28, 70, 3), "RGB")
    for name, img in images.items():
        path = OUT / name
        if name.endswith(".jpg"):
            img.save(path, quality=92, subsampling=0)
        elif name.endswith(".gif"):
            second = Image.fromarray(noise(rng, 30, 40, 3), "RGB").quantize(colors=16, dither=Image.Dither.NONE)
            img.save(path, save_all=True, append_images=[second], transparency=0, duration=100, loop=0)
        elif name.endswith(".webp"):
            img.save(path, lossless=True)
        else:
            img.save(path)


CASES = [
    # name, file, processor settings (the defaults are min 16 / max 8000 image tokens)
    ("tiny", "tiny.png", {}),
    ("exact", "exact.png", {"min_image_tokens": 4, "max_image_tokens": 64}),
    ("alpha", "alpha.png", {"min_image_tokens": 4, "max_image_tokens": 12}),
    ("gray", "gray.png", {"min_image_tokens": 4, "max_image_tokens": 10}),
    ("photo", "photo.jpg", {"min_image_tokens": 4, "max_image_tokens": 8}),
    ("anim", "anim.gif", {"min_image_tokens": 4, "max_image_tokens": 6}),
    ("lossless", "lossless.webp", {"min_image_tokens": 2, "max_image_tokens": 16}),
]


def process(name, settings):
    proc = Glm5NextImageProcessorPil(**settings)
    out = proc(images=[Image.open(OUT / name)], return_tensors="pt")
    return out["pixel_values"].float().contiguous(), out["image_grid_thw"]


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    make_images(np.random.default_rng(2718))
    tensors, cases = {}, []
    for case, file, settings in CASES:
        pv, grid = process(file, settings)
        tensors[f"pixel_values_{case}"] = pv
        cases.append({"name": case, "file": file, "settings": settings, "grid": grid[0].tolist()})
    save_file(tensors, OUT / "processor.safetensors")
    (OUT / "cases.json").write_text(json.dumps(cases, indent=1) + "\n")

    model = Glm5NextForConditionalGeneration.from_pretrained(TINY, dtype=torch.float32).eval()
    model.config._attn_implementation = "sdpa"
    gen = torch.Generator().manual_seed(31337)
    with torch.no_grad():
        for name, p in model.model.visual.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
    if VISION_TINY.exists():
        shutil.rmtree(VISION_TINY)
    model.save_pretrained(VISION_TINY)
    cfg = model.config
    merge = cfg.vision_config.spatial_merge_size
    pv = torch.cat([tensors["pixel_values_exact"], tensors["pixel_values_anim"]])
    grid = torch.tensor([cases[1]["grid"], cases[5]["grid"]])
    counts = [int(g.prod()) // merge**2 for g in grid]
    g = torch.Generator().manual_seed(99)
    text = lambda n: torch.randint(1, cfg.text_config.vocab_size, (n,), generator=g)
    img = cfg.image_token_id
    ids = torch.cat([text(5), torch.full((counts[0],), img), text(7), torch.full((counts[1],), img), text(4)])
    with torch.no_grad():
        mask = ids == img
        embeds = model.model.get_input_embeddings()(torch.where(mask, 0, ids))[None]
        image_embeds = torch.cat(model.model.get_image_features(pv, grid, return_dict=True).pooler_output)
        embeds = embeds.masked_scatter(mask[None, :, None].expand_as(embeds), image_embeds)
        logits = model(inputs_embeds=embeds).logits[0]
        text_ids = torch.where(mask, 7, ids)
        text_logits = model(input_ids=text_ids[None]).logits[0]
    save_file(
        {
            "ids": ids,
            "pixel_values": pv.contiguous(),
            "grid": grid,
            "image_embeds": image_embeds.contiguous(),
            "logits": logits.contiguous(),
            "text_ids": text_ids,
            "text_logits": text_logits.contiguous(),
        },
        OUT / "forward.safetensors",
    )
    (OUT / "VERSIONS.txt").write_text(
        f"transformers {transformers.__version__}\ntorch {torch.__version__}\nPillow {PIL.__version__}\n"
        f"numpy {np.__version__}\npython {platform.python_version()}\n"
        "device cpu, dtype float32, attn sdpa; image processor: Glm5NextImageProcessorPil\n"
    )
    print("image embeddings: max |v|", float(image_embeds.abs().max()), "mean |v|", float(image_embeds.abs().mean()))
    print("cases:", [(c["name"], c["grid"]) for c in cases], "forward ids", len(ids), "image tokens", counts)


if __name__ == "__main__":
    main()
