#!/usr/bin/env python3
"""Drive a running shelfserve with the OFFICIAL `openai` Python client.

Usage:
  test_openai_client.py BASE_URL [--model NAME] [--prompt-text TEXT --prompt-ids 1,2,3]
                        [--auth-url URL --auth-agent-url URL --api-key KEY]

BASE_URL is a lane's OpenAI root, e.g. http://127.0.0.1:8888/v1 (a server without an API key).
The --auth-* options name a second server started with `--api-key KEY`, whose agent lane allows
one sequence and one waiting request (so a 429 is cheap to provoke). --prompt-ids are the
tokenizer's ids for --prompt-text, for the token-id prompt checks. Checks that need an option
that was not given are reported as skipped.

Plain script (no pytest): each check prints PASS/FAIL/SKIP; the last line is `N passed, N failed`
and the exit status is non-zero when anything failed. `tests/openai_client.rs` starts the real
binary and runs this.
"""

import argparse
import concurrent.futures
import sys
import time
import traceback

import openai
from openai import OpenAI

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


class Skip(Exception):
    pass


def expect(cond, msg):
    if not cond:
        raise AssertionError(msg)


ARGS = None
CLIENT = None
SYSTEM = {"role": "system", "content": "Answer briefly."}


def user(text):
    return [SYSTEM, {"role": "user", "content": text}]


def chat(**kw):
    kw.setdefault("model", ARGS.model)
    return CLIENT.chat.completions.create(**kw)


def complete(**kw):
    kw.setdefault("model", ARGS.model)
    return CLIENT.completions.create(**kw)


def expect_usage(usage, max_completion=None):
    expect(usage is not None, "usage is missing")
    expect(usage.prompt_tokens > 0, f"prompt_tokens {usage.prompt_tokens}")
    expect(usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, f"usage does not add up: {usage}")
    if max_completion is not None:
        expect(0 < usage.completion_tokens <= max_completion, f"completion_tokens {usage.completion_tokens}")
    details = usage.prompt_tokens_details
    expect(details is not None and details.cached_tokens is not None, f"prompt_tokens_details missing: {usage}")


# ---------------------------------------------------------------- models


@check
def models_list():
    models = CLIENT.models.list()
    ids = [m.id for m in models.data]
    expect(ARGS.model in ids, f"{ARGS.model} not in {ids}")
    m = CLIENT.models.retrieve(ARGS.model)
    expect(m.id == ARGS.model and m.object == "model", f"retrieve: {m}")


# ---------------------------------------------------------------- chat


@check
def chat_non_stream_and_stream_agree():
    msgs = user("What is the capital of France?")
    r = chat(messages=msgs, max_tokens=12, temperature=0)
    expect(r.object == "chat.completion", r.object)
    expect(len(r.choices) == 1 and r.choices[0].index == 0, f"choices {r.choices}")
    c = r.choices[0]
    expect(c.message.role == "assistant", c.message.role)
    expect(isinstance(c.message.content, str) and c.message.content, f"content {c.message.content!r}")
    expect(c.finish_reason in ("stop", "length"), c.finish_reason)
    expect_usage(r.usage, 12)

    stream = chat(messages=msgs, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True})
    text, finish, usage, roles, ids = "", None, None, set(), set()
    for chunk in stream:
        expect(chunk.object == "chat.completion.chunk", chunk.object)
        ids.add(chunk.id)
        if chunk.usage is not None:
            expect(chunk.choices == [], "the usage chunk has no choices")
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.role:
                roles.add(ch.delta.role)
            text += ch.delta.content or ""
            if ch.finish_reason:
                finish = ch.finish_reason
    expect(len(ids) == 1, f"one id per stream, got {ids}")
    expect(roles == {"assistant"}, f"roles {roles}")
    expect(text == c.message.content, f"greedy stream {text!r} != non-stream {c.message.content!r}")
    expect(finish == c.finish_reason, f"finish {finish} vs {c.finish_reason}")
    expect(usage is not None and usage.completion_tokens == r.usage.completion_tokens, f"stream usage {usage}")
    expect(usage.prompt_tokens == r.usage.prompt_tokens, f"prompt tokens {usage} vs {r.usage}")


@check
def chat_content_parts_equal_string_content():
    a = chat(messages=[SYSTEM, {"role": "user", "content": "Name a color."}], max_tokens=6, temperature=0)
    b = chat(
        messages=[SYSTEM, {"role": "user", "content": [{"type": "text", "text": "Name a color."}]}],
        max_tokens=6,
        temperature=0,
    )
    expect(a.choices[0].message.content == b.choices[0].message.content, "content parts change the answer")
    expect(a.usage.prompt_tokens == b.usage.prompt_tokens, "content parts change the prompt")


@check
def chat_max_tokens_gives_length():
    r = chat(messages=user("Tell me a story."), max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    expect(r.choices[0].finish_reason == "length", r.choices[0].finish_reason)
    expect(r.usage.completion_tokens == 3, f"completion_tokens {r.usage.completion_tokens}")
    r = chat(messages=user("Tell me a story."), max_completion_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    expect(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2, f"{r}")


@check
def chat_logprobs_shape():
    r = chat(messages=user("Say yes."), max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    c = r.choices[0]
    content = c.logprobs.content
    expect(len(content) == r.usage.completion_tokens, f"{len(content)} logprobs for {r.usage.completion_tokens} tokens")
    for t in content:
        expect(isinstance(t.token, str), t)
        expect(t.logprob <= 0.0, f"logprob {t.logprob}")
        expect(t.bytes is not None and bytes(t.bytes).decode("utf-8", "replace") is not None, t)
        expect(len(t.top_logprobs) == 3, f"top_logprobs {t.top_logprobs}")
        lps = [x.logprob for x in t.top_logprobs]
        expect(lps == sorted(lps, reverse=True), f"top_logprobs not sorted: {lps}")
        # Greedy: the chosen token is the most likely one.
        expect(t.top_logprobs[0].token == t.token, f"greedy chose {t.token!r}, top is {t.top_logprobs[0].token!r}")
        expect(abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4, f"{t.logprob} vs {t.top_logprobs[0].logprob}")
    joined = b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace")
    expect(joined == c.message.content, f"token bytes {joined!r} != content {c.message.content!r}")
    r = chat(messages=user("Say yes."), max_tokens=2, temperature=0)
    expect(r.choices[0].logprobs is None, "no logprobs unless asked")


@check
def chat_stop_strings():
    base = chat(messages=user("Count from one to ten in words."), max_tokens=24, temperature=0)
    text = base.choices[0].message.content
    expect(len(text) >= 6, f"need some text to cut: {text!r}")
    mid = len(text) // 2
    stop = text[mid : mid + 3]
    expect(stop.strip(), f"stop string from {text!r} is blank")
    want = text[: text.index(stop)]
    r = chat(messages=user("Count from one to ten in words."), max_tokens=24, temperature=0, stop=[stop, "@@never@@"])
    got = r.choices[0].message.content
    expect(got == want, f"stop {stop!r}: got {got!r}, want {want!r}")
    expect(stop not in got, "the stop string is not in the output")
    expect(r.choices[0].finish_reason == "stop", r.choices[0].finish_reason)
    # Streamed, with a single string.
    chunks = chat(messages=user("Count from one to ten in words."), max_tokens=24, temperature=0, stop=stop, stream=True)
    text, finish = "", None
    for ch in chunks:
        for c in ch.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    expect(text == want and finish == "stop", f"streamed stop: {text!r} {finish}")


@check
def chat_n_choices():
    r = chat(messages=user("Pick a number."), max_tokens=4, temperature=0.9, seed=3, n=3)
    expect(sorted(c.index for c in r.choices) == [0, 1, 2], f"indexes {[c.index for c in r.choices]}")
    expect(all(c.finish_reason in ("stop", "length") for c in r.choices), "finish reasons")
    expect(3 <= r.usage.completion_tokens <= 12, f"usage counts every choice's tokens: {r.usage}")
    stream = chat(messages=user("Pick a number."), max_tokens=4, temperature=0.9, seed=3, n=2, stream=True)
    seen, finished = set(), set()
    for ch in stream:
        for c in ch.choices:
            seen.add(c.index)
            if c.finish_reason:
                finished.add(c.index)
    expect(seen == {0, 1} and finished == {0, 1}, f"stream choices {seen}, finished {finished}")


@check
def chat_seed_determinism():
    msgs = user("Write a short line about rain.")
    runs = [chat(messages=msgs, max_tokens=10, temperature=1.0, seed=1234).choices[0].message.content for _ in range(2)]
    expect(runs[0] == runs[1], f"same seed, different text: {runs}")
    others = {chat(messages=msgs, max_tokens=10, temperature=1.0, seed=s).choices[0].message.content for s in (1, 2, 3)}
    others.add(runs[0])
    expect(len(others) > 1, f"four seeds at temperature 1 all gave {others}")


# ---------------------------------------------------------------- completions


@check
def completions_string_list_and_echo():
    r = complete(prompt="The capital of France is", max_tokens=6, temperature=0)
    expect(r.object == "text_completion", r.object)
    expect(len(r.choices) == 1 and isinstance(r.choices[0].text, str), f"{r.choices}")
    expect(r.choices[0].finish_reason in ("stop", "length"), r.choices[0].finish_reason)
    expect_usage(r.usage, 6)
    first = r.choices[0].text

    r = complete(prompt=["The capital of France is", "One plus one is"], max_tokens=4, temperature=0)
    expect(sorted(c.index for c in r.choices) == [0, 1], f"indexes {[c.index for c in r.choices]}")
    by_index = {c.index: c.text for c in r.choices}
    expect(first.startswith(by_index[0]), f"batched {by_index[0]!r} is not a prefix of solo {first!r}")

    r = complete(prompt="The capital of France is", max_tokens=6, temperature=0, echo=True)
    expect(r.choices[0].text == "The capital of France is" + first, f"echo: {r.choices[0].text!r}")

    stream = complete(prompt="The capital of France is", max_tokens=6, temperature=0, stream=True)
    text = "".join(c.text for ch in stream for c in ch.choices)
    expect(text == first, f"streamed {text!r} != {first!r}")


@check
def completions_token_ids():
    if not ARGS.prompt_ids:
        raise Skip("no --prompt-ids")
    ids = [int(x) for x in ARGS.prompt_ids.split(",")]
    by_text = complete(prompt=ARGS.prompt_text, max_tokens=5, temperature=0)
    by_ids = complete(prompt=ids, max_tokens=5, temperature=0)
    expect(by_ids.usage.prompt_tokens == len(ids), f"prompt_tokens {by_ids.usage.prompt_tokens} for {len(ids)} ids")
    expect(by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens, "ids and text tokenize alike")
    expect(by_ids.choices[0].text == by_text.choices[0].text, f"{by_ids.choices[0].text!r} vs {by_text.choices[0].text!r}")
    echo = complete(prompt=ids, max_tokens=2, temperature=0, echo=True)
    expect(echo.choices[0].text.startswith(ARGS.prompt_text), f"echoed ids: {echo.choices[0].text!r}")
    two = complete(prompt=[ids, ids[:-1]], max_tokens=2, temperature=0)
    expect(len(two.choices) == 2, f"list of id lists: {len(two.choices)} choices")


@check
def completions_logprobs_shape():
    r = complete(prompt="The sky is", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    expect(len(lp.tokens) == n and len(lp.token_logprobs) == n and len(lp.top_logprobs) == n, f"{lp}")
    expect(len(lp.text_offset) == n, f"text_offset {lp.text_offset}")
    for tok, p, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        expect(p <= 0.0, f"logprob {p}")
        expect(1 <= len(top) <= 2, f"top {top}")
        expect(max(top.values()) == p or tok in top, f"greedy token {tok!r} not among {top}")
    expect("".join(lp.tokens) == r.choices[0].text, f"tokens {lp.tokens} vs text {r.choices[0].text!r}")


# ---------------------------------------------------------------- errors


def expect_error(cls, status, fn, param=None, says=()):
    try:
        fn()
    except cls as e:
        expect(e.status_code == status, f"status {e.status_code}, expected {status}")
        body = e.body if isinstance(e.body, dict) else {}
        err = body.get("error", body)
        if param is not None:
            expect(err.get("param") == param, f"param {err.get('param')!r}, expected {param!r}: {err}")
        for s in says:
            expect(s in str(err.get("message")), f"message does not say {s!r}: {err.get('message')!r}")
        return e
    except openai.APIError as e:
        raise AssertionError(f"expected {cls.__name__}, got {type(e).__name__}: {e}")
    raise AssertionError(f"expected {cls.__name__}, the request succeeded")


@check
def errors_bad_request():
    expect_error(openai.BadRequestError, 400, lambda: chat(messages=user("hi"), max_tokens=2, temperature=-1), "temperature")
    expect_error(openai.BadRequestError, 400, lambda: chat(messages=user("hi"), max_tokens=2, top_p=1.5), "top_p")
    expect_error(openai.BadRequestError, 400, lambda: chat(messages=user("hi"), max_tokens=0), "max_tokens")
    expect_error(openai.BadRequestError, 400, lambda: chat(messages=user("hi"), max_tokens=2, n=0), "n")
    expect_error(openai.BadRequestError, 400, lambda: chat(messages=[], max_tokens=2), "messages")
    expect_error(
        openai.BadRequestError,
        400,
        lambda: chat(messages=user("hi"), max_tokens=2, logprobs=True, top_logprobs=50),
        "top_logprobs",
    )
    expect_error(openai.BadRequestError, 400, lambda: complete(prompt="hi", max_tokens=2, logprobs=99), "logprobs")


@check
def errors_prompt_too_long():
    words = "hello " * 12000
    e = expect_error(openai.BadRequestError, 400, lambda: chat(messages=user(words), max_tokens=4))
    msg = str(e.body.get("message") if isinstance(e.body, dict) else e)
    digits = [w for w in msg.replace(",", " ").replace("(", " ").replace(")", " ").split() if w.isdigit()]
    expect(len(digits) >= 2, f"the message names the prompt length and the limit: {msg!r}")


@check
def errors_unknown_model():
    expect_error(openai.NotFoundError, 404, lambda: chat(model="no-such-model", messages=user("hi"), max_tokens=2), "model")
    expect_error(openai.NotFoundError, 404, lambda: CLIENT.models.retrieve("no-such-model"))


def auth_client(key, base=None, **kw):
    return OpenAI(base_url=base or ARGS.auth_url, api_key=key, max_retries=0, timeout=600, **kw)


@check
def errors_authentication():
    if not ARGS.auth_url:
        raise Skip("no --auth-url")
    bad = auth_client("sk-wrong")
    expect_error(openai.AuthenticationError, 401, lambda: bad.models.list())
    expect_error(
        openai.AuthenticationError,
        401,
        lambda: bad.chat.completions.create(model=ARGS.model, messages=user("hi"), max_tokens=2),
    )
    good = auth_client(ARGS.api_key)
    expect(ARGS.model in [m.id for m in good.models.list().data], "the right key lists the model")
    r = good.chat.completions.create(model=ARGS.model, messages=user("hi"), max_tokens=2, temperature=0)
    expect(r.choices[0].finish_reason in ("stop", "length"), "the right key generates")


@check
def errors_rate_limit():
    if not ARGS.auth_agent_url:
        raise Skip("no --auth-agent-url")
    agent = auth_client(ARGS.api_key, ARGS.auth_agent_url)
    # One sequence runs at a time on that server and its agent queue holds one request: a
    # long-running stream occupies the slot, the next request waits, the one after is refused.
    hog = agent.chat.completions.create(
        model=ARGS.model,
        messages=user("Count to one thousand."),
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    try:
        for chunk in hog:
            if any(c.delta.content for c in chunk.choices):
                break  # it has produced a token, so it no longer counts as queued

        def small():
            return agent.chat.completions.create(model=ARGS.model, messages=user("hi"), max_tokens=2, temperature=0)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(small), pool.submit(small)]
            done, _ = concurrent.futures.wait(futures, timeout=600, return_when=concurrent.futures.FIRST_COMPLETED)
            first = next(iter(done))
            try:
                first.result()
                raise AssertionError("expected one of two requests behind a busy lane to get 429")
            except openai.RateLimitError as e:
                expect(e.status_code == 429, f"status {e.status_code}")
                err = e.body.get("error", e.body) if isinstance(e.body, dict) else {}
                expect(err.get("type") == "rate_limit_error", f"error {err}")
            hog.close()  # the waiting request may run now
            other = futures[1] if first is futures[0] else futures[0]
            r = other.result(timeout=600)
            expect(r.choices[0].finish_reason in ("stop", "length"), "the queued request completes")
    finally:
        hog.close()


def main():
    global ARGS, CLIENT
    p = argparse.ArgumentParser()
    p.add_argument("base_url")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompt-text", default="The capital of France is")
    p.add_argument("--prompt-ids", default="")
    p.add_argument("--auth-url", default="")
    p.add_argument("--auth-agent-url", default="")
    p.add_argument("--api-key", default="")
    p.add_argument("--only", default="", help="run the checks whose names contain this")
    ARGS = p.parse_args()
    # A CPU engine on two cores is slow: long timeouts, and no silent retries that would hide
    # errors this script is checking for.
    CLIENT = OpenAI(base_url=ARGS.base_url, api_key="unused", max_retries=0, timeout=600)
    print(f"openai {openai.__version__} against {ARGS.base_url}", flush=True)
    passed = failed = skipped = 0
    for fn in CHECKS:
        if ARGS.only and ARGS.only not in fn.__name__:
            continue
        start = time.monotonic()
        try:
            fn()
        except Skip as s:
            skipped += 1
            print(f"SKIP {fn.__name__}: {s}", flush=True)
            continue
        except Exception as e:  # a failed check, whatever raised it
            failed += 1
            print(f"FAIL {fn.__name__} ({time.monotonic() - start:.1f} s): {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=3)
            continue
        passed += 1
        print(f"PASS {fn.__name__} ({time.monotonic() - start:.1f} s)", flush=True)
    if skipped:
        print(f"{skipped} skipped", flush=True)
    print(f"{passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
