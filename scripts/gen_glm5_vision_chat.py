#!/usr/bin/env python3
"""The smallest GLM-5.3-Flash chat checkpoint that takes images: tests/fixtures/glm5/vision-chat/,
the fixture of the image end-to-end tests (`tests/vision_api.rs`). Derived from two committed
fixtures, so it needs only numpy and safetensors:

* text model, tokenizer and generation config: tests/fixtures/glm5/chat (scripts/gen_glm5_chat.py);
* vision tower: tests/fixtures/glm5/vision-tiny (scripts/gen_media_golden.py), whose fan-in scale
  tower media_golden checks against transformers (the chat fixture's own 0.02-scale tower makes
  image embeddings of ~1e-7, which no output could tell from zeros). Both towers have the same
  config and shapes.

Changes on top of the chat fixture, as GLM ships its multimodal checkpoints:
* the tokenizer gains GLM's image markers `<|begin_of_image|>`, `<|image|>`, `<|end_of_image|>`
  as special tokens (ids 502, 503, 504), and `config.json` names them (`image_start_token_id`,
  `image_token_id`, `image_end_token_id`); the embedding and lm_head gain three seeded rows at the
  scales scripts/gen_glm5_tiny.py's `randomize` uses (embedding 1.0, lm_head 0.6/sqrt(fan-in));
* the chat template renders a list content of `text` / `image` / `video` parts, an image as
  `<|begin_of_image|><|image|><|end_of_image|>` (one placeholder: the server expands it to the
  image's `t·h·w/4` tokens, as transformers' processor does), a video as
  `<|begin_of_video|><|video|><|end_of_video|>` (the server replaces `<|video|>` with one
  `<|begin_of_image|>` run `<|end_of_image|>` plus timestamp text per frame pair, as
  `Glm5NextProcessor.replace_video_token` does);
* the video markers are special tokens too (ids 505, 506, 507), named in `config.json`
  (`video_start_token_id`, `video_token_id`, `video_end_token_id`), with seeded embedding and
  lm_head rows drawn after the image markers' (so those rows stay as they were).

Run from the repository root:

    /work/wt/venv/bin/python scripts/gen_glm5_vision_chat.py
"""

import json
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "glm5"
CHAT, TOWER, OUT = FIX / "chat", FIX / "vision-tiny", FIX / "vision-chat"
IMAGE_MARKERS = ["<|begin_of_image|>", "<|image|>", "<|end_of_image|>"]
VIDEO_MARKERS = ["<|begin_of_video|>", "<|video|>", "<|end_of_video|>"]
MARKERS = IMAGE_MARKERS + VIDEO_MARKERS
SEED = 2718

CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + '\n' }}"
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %}{{ p['text'] }}"
    "{% elif p['type'] == 'image' %}{{ '<|begin_of_image|><|image|><|end_of_image|>' }}"
    "{% elif p['type'] == 'video' %}{{ '<|begin_of_video|><|video|><|end_of_video|>' }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '\n<think></think>' }}{% endif %}"
    "{{ '\n' }}{% endif %}"
)


def main():
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir()
    shutil.copy(CHAT / "generation_config.json", OUT)

    tok = json.loads((CHAT / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"])
    assert max(t["id"] for t in tok["added_tokens"]) < vocab
    ids = list(range(vocab, vocab + len(MARKERS)))
    template = dict(tok["added_tokens"][-1])
    for i, m in zip(ids, MARKERS):
        tok["added_tokens"].append(dict(template, id=i, content=m))
    (OUT / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False, indent=1) + "\n")
    tcfg = json.loads((CHAT / "tokenizer_config.json").read_text())
    tcfg["extra_special_tokens"] = tcfg["extra_special_tokens"] + MARKERS
    (OUT / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    (OUT / "chat_template.jinja").write_text(CHAT_TEMPLATE)

    cfg = json.loads((CHAT / "config.json").read_text())
    tower_cfg = json.loads((TOWER / "config.json").read_text())
    assert {k: v for k, v in cfg["vision_config"].items() if k != "dtype"} == {
        k: v for k, v in tower_cfg["vision_config"].items() if k != "dtype"
    }
    cfg["image_start_token_id"], cfg["image_token_id"], cfg["image_end_token_id"] = ids[:3]
    cfg["video_start_token_id"], cfg["video_token_id"], cfg["video_end_token_id"] = ids[3:]
    cfg["text_config"]["vocab_size"] = vocab + len(MARKERS)
    (OUT / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    weights = load_file(CHAT / "model.safetensors")
    tower = load_file(TOWER / "model.safetensors")
    rng = np.random.default_rng(SEED)
    emb = "model.language_model.embed_tokens.weight"
    hidden = weights[emb].shape[1]
    rows = []
    for group in (IMAGE_MARKERS, VIDEO_MARKERS):
        emb_rows = rng.standard_normal((len(group), hidden)).astype(np.float32)
        head_rows = (rng.standard_normal((len(group), hidden)) * 0.6 / np.sqrt(hidden)).astype(np.float32)
        rows.append((emb_rows, head_rows))
    extra_emb = np.concatenate([r[0] for r in rows])
    extra_head = np.concatenate([r[1] for r in rows])
    weights[emb] = np.concatenate([weights[emb], extra_emb])
    weights["lm_head.weight"] = np.concatenate([weights["lm_head.weight"], extra_head])
    for name in [k for k in weights if k.startswith("model.visual.")]:
        assert tower[name].shape == weights[name].shape, name
        weights[name] = tower[name]
    save_file(weights, OUT / "model.safetensors", metadata={"format": "pt"})
    total = sum(f.stat().st_size for f in OUT.iterdir())
    print(f"wrote {OUT} ({total / 1e6:.2f} MB): image markers {dict(zip(MARKERS, ids))}")


if __name__ == "__main__":
    main()
