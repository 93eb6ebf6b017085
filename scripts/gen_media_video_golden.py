#!/usr/bin/env python3
"""Golden outputs for video in: transformers' GLM-5.3-Flash video processor
(`Glm5NextVideoProcessor`, torchvision backend) and the processor's prompt text for a video
(`Glm5NextProcessor.replace_video_token`), on small committed frame lists.

Run from the repository root with the reference environment (CPU):

    /work/venv/bin/python scripts/gen_media_video_golden.py

Writes tests/fixtures/media/video/:
  {case}_{k}.png        the frames of each case (seeded noise over gradients, RGB, lossless)
  cases.json            per case: frame files, fps, processor settings, video_grid_thw, the prompt
                        text transformers writes for the video; plus `sampling`: frame indices of
                        `sample_frames` for decoded videos of given length, fps and duration
  processor.safetensors pixel_values_videos_{case} f32 [N, 1176]
  VERSIONS.txt

The frame-list cases are pre-sampled frames (`do_sample_frames=False`) with metadata
`{"fps": fps, "frames_indices": 0..n}`, which is what the server's `{"type": "video", "video":
[...], "fps": N}` form means. Cases cover frames that need no resize (aligned, and unaligned with
zero padding), an odd frame count (the last frame repeated to the temporal patch), a downscale
under a small `max_image_tokens` and an upscale to the token minimum (torchvision's antialiased
bicubic on uint8, rounded back to uint8).
"""

import json
import platform
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import PIL
import torch
import torchvision
import transformers
from PIL import Image
from safetensors.torch import save_file
from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor
from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor
from transformers.video_utils import VideoMetadata

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "media" / "video"


def noise(rng, h, w, shift):
    y, x = np.mgrid[0:h, 0:w]
    planes = [(x * 255 // max(w - 1, 1) + shift) % 256, y * 255 // max(h - 1, 1), ((x + y) * 7 + 3 * shift) % 256]
    base = np.stack(planes, -1)
    return np.clip(base + rng.integers(-60, 61, size=(h, w, 3)), 0, 255).astype(np.uint8)


# name, frames, height, width, fps, settings
CASES = [
    ("aligned", 8, 56, 56, 2.0, {}),
    ("padded_odd", 5, 60, 90, 1.0, {}),
    ("downscale", 4, 100, 150, 3.0, {"max_image_tokens": 20}),
    ("upscale", 2, 20, 30, 0.5, {}),
    ("tenths", 3, 28, 84, 3.0, {"min_image_tokens": 4}),
]

# total_num_frames, video fps, duration (None: derived), target fps, max_duration, max_frames
SAMPLING = [
    (300, 30.0, 10.0, None, 0, None),
    (91, 29.97, None, 2.0, 0, None),
    (7, 24.0, None, 2.0, 0, None),
    (10, 1.0, 10.0, 4.0, 0, None),
    (600, 30.0, 20.0, 1.0, 8, None),
    (1000, 25.0, 40.0, 2.0, 0, 16),
    (50, 10.0, 5.0, 2.0, 0, None),
]


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for f in OUT.glob("*.png"):
        f.unlink()
    rng = np.random.default_rng(31337)
    cases, tensors = [], {}
    for name, n, h, w, fps, settings in CASES:
        frames = np.stack([noise(rng, h, w, 17 * k) for k in range(n)])
        files = []
        for k, fr in enumerate(frames):
            file = f"{name}_{k}.png"
            Image.fromarray(fr, "RGB").save(OUT / file)
            files.append(file)
        vp = Glm5NextVideoProcessor(**settings)
        meta = {"fps": fps, "total_num_frames": n, "frames_indices": list(range(n))}
        out = vp(videos=[frames], do_sample_frames=False, video_metadata=[meta], return_metadata=True, return_tensors="pt")
        tensors[f"pixel_values_videos_{name}"] = out["pixel_values_videos"].contiguous()
        fake = SimpleNamespace(video_processor=vp, image_token="<|image|>")
        fake.replace_frame_token_id = lambda ts, num_image_tokens=1: Glm5NextProcessor.replace_frame_token_id(
            fake, ts, num_image_tokens
        )
        text = Glm5NextProcessor.replace_video_token(fake, out, 0)
        cases.append(
            {
                "name": name,
                "frames": files,
                "fps": fps,
                "settings": settings,
                "grid": out["video_grid_thw"][0].tolist(),
                "text": text,
            }
        )
    sampling = []
    for total, vfps, duration, target, max_duration, max_frames in SAMPLING:
        vp = Glm5NextVideoProcessor(max_duration=max_duration, **({"max_frames": max_frames} if max_frames else {}))
        meta = VideoMetadata(total_num_frames=total, fps=vfps, duration=duration)
        idx = vp.sample_frames(meta, fps=target).tolist()
        sampling.append(
            {
                "total_frames": total,
                "video_fps": vfps,
                "duration": duration,
                "fps": target,
                "max_duration": max_duration,
                "max_frames": max_frames,
                "indices": idx,
            }
        )
    (OUT / "cases.json").write_text(json.dumps({"cases": cases, "sampling": sampling}, indent=1) + "\n")
    save_file(tensors, OUT / "processor.safetensors")
    (OUT / "VERSIONS.txt").write_text(
        f"transformers {transformers.__version__}\ntorch {torch.__version__}\ntorchvision {torchvision.__version__}\n"
        f"Pillow {PIL.__version__}\nnumpy {np.__version__}\npython {platform.python_version()}\n"
        "video processor: Glm5NextVideoProcessor (torchvision backend), CPU\n"
    )


if __name__ == "__main__":
    main()
