#!/usr/bin/env python3
"""Video through the OFFICIAL `openai` client against a running shelfserve that serves
tests/fixtures/glm5/vision-chat with `--allowed-local-media-path ALLOWED_DIR`,
`--max-video-frames 8` and `--max-videos-per-request 1`.

Usage:
  test_video_clients.py BASE_URL --model NAME --frames PNG... --fps N --allowed-dir DIR
                        --expected-text TEXT --prompt-tokens N --max-tokens N

--expected-text: what the engine produced in process for the same prompt ids with the frame pairs
processed by `media::VideoProcessor` (greedy); --prompt-tokens: the prompt length with the video
expanded (frame markers, placeholders, timestamps).

Plain script (no pytest): each check prints PASS/FAIL; the last line is `N passed, N failed` and
the exit status is non-zero when anything failed. `tests/vision_video.rs` starts the real binary
and runs this.
"""

import argparse
import base64
import concurrent.futures
import os
import shutil
import sys
import traceback

import openai

CHECKS = []
ARGS = None
OAI = None
QUESTION = "What happens in the video?"


def check(fn):
    CHECKS.append(fn)
    return fn


def expect(cond, msg):
    if not cond:
        raise AssertionError(msg)


def data_url(path, mime="image/png"):
    with open(path, "rb") as f:
        return f"data:{mime};base64," + base64.b64encode(f.read()).decode()


def frames_part(urls, fps=None):
    part = {"type": "video", "video": urls}
    if fps is not None:
        part["fps"] = fps
    return part


def chat(parts, **kw):
    return OAI.chat.completions.create(
        model=ARGS.model,
        messages=[{"role": "user", "content": parts}],
        max_tokens=ARGS.max_tokens,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        **kw,
    )


def expect_openai_400(parts, needle, param=None):
    try:
        chat(parts)
    except openai.BadRequestError as e:
        expect(e.status_code == 400, f"status {e.status_code}")
        body = e.body if isinstance(e.body, dict) else {}
        msg = body.get("message") or str(e)
        expect(needle in msg, f"{needle!r} not in {msg!r}")
        if param is not None:
            expect(body.get("param") == param, f"param {body.get('param')!r} != {param!r}")
        return body
    raise AssertionError("the request was accepted")


def good_parts():
    return [frames_part([data_url(f) for f in ARGS.frames], ARGS.fps), {"type": "text", "text": QUESTION}]


@check
def frame_list_video_matches_the_engine_in_process():
    r = chat(good_parts())
    got = r.choices[0].message.content
    expect(got == ARGS.expected_text, f"content {got!r} != the engine's {ARGS.expected_text!r}")
    expect(r.usage.prompt_tokens == ARGS.prompt_tokens,
           f"prompt_tokens {r.usage.prompt_tokens} != {ARGS.prompt_tokens} (video tokens counted)")


@check
def streamed_video_reply_equals_the_plain_one():
    stream = chat(good_parts(), stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    expect(text == ARGS.expected_text, f"streamed {text!r} != {ARGS.expected_text!r}")


@check
def local_frame_files_inside_the_allowed_dir_are_read():
    urls = []
    for k, f in enumerate(ARGS.frames):
        inside = os.path.join(ARGS.allowed_dir, f"frame_{k}.png")
        shutil.copy(f, inside)
        urls.append("file://" + inside)
    r = chat([frames_part(urls, ARGS.fps), {"type": "text", "text": QUESTION}])
    expect(r.choices[0].message.content == ARGS.expected_text, "file:// frames differ from their data URLs")


@check
def a_bad_video_is_a_400_while_a_concurrent_good_request_succeeds():
    junk = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n not a frame").decode()
    bad = [frames_part([data_url(ARGS.frames[0]), junk], ARGS.fps), {"type": "text", "text": QUESTION}]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        goods = [pool.submit(chat, good_parts()) for _ in range(2)]
        bads = [pool.submit(expect_openai_400, bad, "could not be decoded", "messages[0].content[0].video[1]")
                for _ in range(2)]
        for b in bads:
            b.result()
        for g in goods:
            got = g.result().choices[0].message.content
            expect(got == ARGS.expected_text, f"a good request beside bad ones gave {got!r}")


@check
def too_many_frames_is_a_400_naming_the_limit():
    urls = [data_url(ARGS.frames[0])] * 9
    expect_openai_400([frames_part(urls, 1), {"type": "text", "text": QUESTION}], "--max-video-frames",
                      "messages[0].content[0].video")


@check
def too_many_videos_is_a_400_naming_the_limit():
    one = frames_part([data_url(f) for f in ARGS.frames[:2]], 1)
    expect_openai_400([one, one, {"type": "text", "text": QUESTION}], "--max-videos-per-request",
                      "messages[0].content[1]")


@check
def frames_of_different_sizes_are_a_400():
    expect_openai_400([frames_part([data_url(ARGS.frames[0]), data_url(ARGS.other_size)], 1),
                       {"type": "text", "text": QUESTION}], "one size")


@check
def a_container_without_the_decoder_feature_is_a_400_naming_it():
    mp4 = "data:video/mp4;base64," + base64.b64encode(b"\x00\x00\x00\x18ftypmp42").decode()
    body = expect_openai_400([{"type": "video_url", "video_url": {"url": mp4}}, {"type": "text", "text": QUESTION}],
                             "video-ffmpeg", "messages[0].content[0]")
    expect("frames" in body.get("message", ""), "the message names the frame-list form")


@check
def remote_frames_are_refused_when_off():
    expect_openai_400([frames_part(["https://example.invalid/f.png"], 1), {"type": "text", "text": QUESTION}],
                      "--allow-remote-media")


def main():
    global ARGS, OAI
    p = argparse.ArgumentParser()
    p.add_argument("base_url")
    p.add_argument("--model", required=True)
    p.add_argument("--frames", nargs="+", required=True)
    p.add_argument("--other-size", required=True)
    p.add_argument("--fps", type=float, required=True)
    p.add_argument("--allowed-dir", required=True)
    p.add_argument("--expected-text", required=True)
    p.add_argument("--prompt-tokens", type=int, required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    ARGS = p.parse_args()
    OAI = openai.OpenAI(base_url=ARGS.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
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
