#!/usr/bin/env python3
"""Images through the OFFICIAL `openai` and `anthropic` clients against a running shelfserve that
serves tests/fixtures/glm5/vision-chat with `--allowed-local-media-path ALLOWED_DIR` and
`--max-images-per-request 2`.

Usage:
  test_vision_clients.py BASE_URL --model NAME --image PNG --allowed-dir DIR --outside PNG
                         --expected-text TEXT --prompt-tokens N --max-tokens N

--expected-text: what the engine's own `generate --image` path produced for the same prompt
(greedy); --prompt-tokens: the prompt length with the image's placeholders expanded.

Plain script (no pytest): each check prints PASS/FAIL; the last line is `N passed, N failed` and
the exit status is non-zero when anything failed. `tests/vision_api.rs` starts the real binary
and runs this.
"""

import argparse
import base64
import os
import shutil
import sys
import traceback

import anthropic
import openai

CHECKS = []
ARGS = None
OAI = None
ANT = None
QUESTION = "What is in the picture?"


def check(fn):
    CHECKS.append(fn)
    return fn


def expect(cond, msg):
    if not cond:
        raise AssertionError(msg)


def png_b64():
    with open(ARGS.image, "rb") as f:
        return base64.b64encode(f.read()).decode()


def data_url(b64=None):
    return "data:image/png;base64," + (b64 or png_b64())


def chat(parts, **kw):
    return OAI.chat.completions.create(
        model=ARGS.model,
        messages=[{"role": "user", "content": parts}],
        max_tokens=ARGS.max_tokens,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        **kw,
    )


def image_part(url):
    return {"type": "image_url", "image_url": {"url": url}}


def expect_openai_400(parts, needle):
    try:
        chat(parts)
    except openai.BadRequestError as e:
        expect(e.status_code == 400, f"status {e.status_code}")
        body = e.body if isinstance(e.body, dict) else {}
        msg = body.get("message") or str(e)
        expect(needle in msg, f"{needle!r} not in {msg!r}")
        return body
    raise AssertionError("the request was accepted")


@check
def openai_data_url_image_matches_the_engines_generate():
    r = chat([image_part(data_url()), {"type": "text", "text": QUESTION}])
    got = r.choices[0].message.content
    expect(got == ARGS.expected_text, f"content {got!r} != generate's {ARGS.expected_text!r}")
    expect(r.usage.prompt_tokens == ARGS.prompt_tokens,
           f"prompt_tokens {r.usage.prompt_tokens} != {ARGS.prompt_tokens} (image tokens counted)")


@check
def openai_streamed_image_reply_equals_the_plain_one():
    stream = chat([image_part(data_url()), {"type": "text", "text": QUESTION}], stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    expect(text == ARGS.expected_text, f"streamed {text!r} != {ARGS.expected_text!r}")


@check
def openai_local_file_inside_the_allowed_dir_is_read():
    inside = os.path.join(ARGS.allowed_dir, "inside.png")
    shutil.copy(ARGS.image, inside)
    r = chat([image_part("file://" + inside), {"type": "text", "text": QUESTION}])
    expect(r.choices[0].message.content == ARGS.expected_text, "a file:// image differs from its data URL")


@check
def anthropic_base64_image_block_matches_the_engines_generate():
    r = ANT.messages.create(
        model=ARGS.model,
        max_tokens=ARGS.max_tokens,
        # Greedy, thinking off (as the OpenAI requests), through the body: client versions differ
        # in which of these they take as arguments.
        extra_body={"temperature": 0, "thinking": {"type": "disabled"}},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_b64()}},
            {"type": "text", "text": QUESTION},
        ]}],
    )
    got = "".join(b.text for b in r.content if b.type == "text")
    expect(got == ARGS.expected_text, f"text {got!r} != generate's {ARGS.expected_text!r}")
    expect(r.usage.input_tokens == ARGS.prompt_tokens, f"input_tokens {r.usage.input_tokens} != {ARGS.prompt_tokens}")


@check
def too_many_images_is_a_400_naming_the_limit():
    body = expect_openai_400([image_part(data_url())] * 3 + [{"type": "text", "text": QUESTION}],
                             "--max-images-per-request")
    expect(body.get("param") == "messages[0].content[2]", f"param {body.get('param')!r}")


@check
def undecodable_bytes_are_a_400():
    junk = base64.b64encode(b"\x89PNG\r\n\x1a\n this is not a picture").decode()
    expect_openai_400([image_part(data_url(junk)), {"type": "text", "text": QUESTION}], "could not be decoded")


@check
def remote_urls_are_refused_when_off():
    expect_openai_400([image_part("https://example.invalid/cat.png"), {"type": "text", "text": QUESTION}],
                      "--allow-remote-media")


@check
def a_file_outside_the_allowed_dir_is_refused():
    expect_openai_400([image_part("file://" + ARGS.outside), {"type": "text", "text": QUESTION}],
                      "outside the allowed media directory")


@check
def anthropic_undecodable_image_is_a_400_in_anthropic_shape():
    try:
        ANT.messages.create(
            model=ARGS.model,
            max_tokens=4,
            messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": base64.b64encode(b"GIF89a broken").decode()}},
                {"type": "text", "text": QUESTION},
            ]}],
        )
    except anthropic.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        expect(body.get("type") == "error", f"body {body!r}")
        expect(body.get("error", {}).get("type") == "invalid_request_error", f"body {body!r}")
        expect("could not be decoded" in body.get("error", {}).get("message", ""), f"body {body!r}")
        return
    raise AssertionError("the request was accepted")


def main():
    global ARGS, OAI, ANT
    p = argparse.ArgumentParser()
    p.add_argument("base_url")
    p.add_argument("--model", required=True)
    p.add_argument("--image", required=True)
    p.add_argument("--allowed-dir", required=True)
    p.add_argument("--outside", required=True)
    p.add_argument("--expected-text", required=True)
    p.add_argument("--prompt-tokens", type=int, required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    ARGS = p.parse_args()
    OAI = openai.OpenAI(base_url=ARGS.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    ANT = anthropic.Anthropic(base_url=ARGS.base_url, api_key="none", max_retries=0, timeout=120)
    passed = failed = 0
    for fn in CHECKS:
        try:
            fn()
            print(f"PASS {fn.__name__}")
            passed += 1
        except Exception as e:  # noqa: BLE001 - every failure is reported, then counted
            print(f"FAIL {fn.__name__}: {e}")
            traceback.print_exc(file=sys.stdout)
            failed += 1
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
