#!/usr/bin/env python3
"""The agent API of a running shelfserve, driven by the OFFICIAL `openai` and `anthropic` clients.

Usage:
  test_agent_api.py BASE_URL [--model NAME] [--only SUBSTRING] [--speculative-url URL]

--speculative-url: a second server of the same model drafting with `--speculative ngram`; its
constrained greedy replies must equal this one's.

BASE_URL is a lane's root without `/v1`, e.g. http://127.0.0.1:8889 (a server without an API
key, serving the default model, whose chat template has no tool syntax: tools reach it through
the default Hermes-style tool prompt). Greedy decoding everywhere, so every reply is
reproducible and streamed replies must equal non-streamed ones.

Plain script (no pytest): each check prints PASS/FAIL; the last line is `N passed, N failed` and
the exit status is non-zero when anything failed. `tests/agent_api.rs` starts the real binary
and runs this.
"""

import argparse
import json
import sys
import time
import traceback
import urllib.request

import anthropic
import jsonschema
import openai

CHECKS = []
ARGS = None
OAI = None
ANT = None

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The current time", "parameters": {"type": "object", "properties": {}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check(fn):
    CHECKS.append(fn)
    return fn


def expect(cond, msg):
    if not cond:
        raise AssertionError(msg)


def chat(**kw):
    kw.setdefault("model", ARGS.model)
    kw.setdefault("temperature", 0)
    return OAI.chat.completions.create(**kw)


def collect_stream(stream):
    """(content, reasoning, calls [(id, name, arguments)], finish_reason) of a streamed chat reply."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    expect(slot["id"] is None, f"a second id for call {tc.index}")
                    slot["id"] = tc.id
                if tc.function and tc.function.name:
                    expect(slot["name"] == "", f"the name of call {tc.index} came twice")
                    slot["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
            if ch.finish_reason:
                finish = ch.finish_reason
    ordered = [calls[i] for i in sorted(calls)]
    expect(list(sorted(calls)) == list(range(len(calls))), f"call indexes {sorted(calls)}")
    for c in ordered:
        expect(c["id"] and c["name"], f"streamed call without id or name: {c}")
    return content, reasoning, [(c["id"], c["name"], c["arguments"]) for c in ordered], finish


def schema_of(tool):
    return tool["function"]["parameters"]


# ---------------------------------------------------------------- OpenAI chat


@check
def openai_named_tool_call_validates_and_streams_the_same():
    kw = dict(messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=96)
    r = chat(**kw)
    c = r.choices[0]
    expect(c.finish_reason == "tool_calls", f"finish_reason {c.finish_reason}, message {c.message}")
    calls = c.message.tool_calls
    expect(calls and len(calls) == 1, f"tool_calls {calls}")
    call = calls[0]
    expect(call.type == "function" and call.id.startswith("call_"), f"call {call}")
    expect(call.function.name == "get_weather", call.function.name)
    args = json.loads(call.function.arguments)
    # The call's grammar makes the arguments follow the tool's schema.
    jsonschema.validate(args, schema_of(WEATHER))
    expect(not c.message.content, f"content next to a forced call: {c.message.content!r}")

    content, _, scalls, finish = collect_stream(chat(stream=True, **kw))
    expect(finish == "tool_calls", f"streamed finish {finish}")
    expect([(n, json.loads(a)) for _, n, a in scalls] == [("get_weather", args)], f"streamed {scalls} vs {args}")
    expect(content == "", f"streamed content {content!r}")


@check
def openai_required_tool_call_is_a_call_of_an_offered_tool():
    r = chat(messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=96)
    c = r.choices[0]
    expect(c.finish_reason == "tool_calls", f"finish_reason {c.finish_reason}, message {c.message}")
    call = c.message.tool_calls[0]
    expect(call.function.name == "get_weather", call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema_of(WEATHER))
    # With two tools the grammar picks the tool too: one of those offered, arguments valid.
    kw = dict(messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=96)
    c = chat(**kw).choices[0]
    expect(c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, f"message {c.message}")
    call = c.message.tool_calls[0]
    offered = {"get_weather": WEATHER, "get_time": TIME}
    expect(call.function.name in offered, call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema_of(offered[call.function.name]))
    _, _, scalls, finish = collect_stream(chat(stream=True, **kw))
    expect(finish == "tool_calls", f"streamed finish {finish}")
    expect([(n, json.loads(a)) for _, n, a in scalls] == [(call.function.name, args)], f"streamed {scalls}")


TRIP = {
    "type": "function",
    "function": {
        "name": "plan_trip",
        "description": "Plan a trip",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "days": {"type": "integer", "minimum": 1, "maximum": 30},
                "hotel": {"type": "boolean"},
            },
            "required": ["city", "days", "hotel"],
            "additionalProperties": False,
        },
    },
}
TRIP_ASK = [{"role": "user", "content": "Plan a three day trip to Rome with a hotel."}]


@check
def openai_streamed_arguments_arrive_in_pieces_equal_to_the_whole():
    """A forced call with several arguments: the first delta of the call carries its index, id,
    type and name with empty arguments; the arguments follow in more than one delta, and their
    concatenation is exactly the non-streamed `arguments` string."""
    kw = dict(messages=TRIP_ASK, tools=[TRIP], tool_choice={"type": "function", "function": {"name": "plan_trip"}}, max_tokens=64)
    whole = chat(**kw).choices[0]
    expect(whole.finish_reason == "tool_calls", f"{whole.finish_reason} {whole.message}")
    arguments = whole.message.tool_calls[0].function.arguments
    jsonschema.validate(json.loads(arguments), schema_of(TRIP))
    deltas, finish = [], None
    for chunk in chat(stream=True, **kw):
        for ch in chunk.choices:
            deltas.extend(ch.delta.tool_calls or [])
            finish = ch.finish_reason or finish
    expect(finish == "tool_calls", f"streamed finish {finish}")
    expect(deltas, "no tool call deltas")
    head, rest = deltas[0], deltas[1:]
    expect(
        (head.index, head.type, head.function.name, head.function.arguments) == (0, "function", "plan_trip", "")
        and head.id.startswith("call_"),
        f"first delta {head}",
    )
    expect(all(d.index == 0 and d.id is None and d.function.name is None for d in rest), f"later deltas {rest}")
    pieces = [d.function.arguments for d in rest if d.function.arguments]
    expect(len(pieces) > 1, f"the arguments came in one piece: {pieces}")
    expect("".join(pieces) == arguments, f"streamed {''.join(pieces)!r} != non-streamed {arguments!r}")


# ---------------------------------------------------------------- structured outputs

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "hobbies"],
    "additionalProperties": False,
}
DESCRIBE = [{"role": "user", "content": "Describe a person called Ann as JSON: her name, age, mood and hobbies."}]


def person_format():
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@check
def openai_json_schema_reply_validates_and_streams_the_same():
    kw = dict(messages=DESCRIBE, response_format=person_format(), max_tokens=160)
    c = chat(**kw).choices[0]
    expect(c.finish_reason == "stop", f"finish_reason {c.finish_reason}: {c.message.content!r}")
    jsonschema.validate(json.loads(c.message.content), PERSON)
    content, _, calls, finish = collect_stream(chat(stream=True, **kw))
    expect((content, calls, finish) == (c.message.content, [], "stop"), f"streamed {content!r} {finish}")


@check
def openai_json_object_reply_is_an_object():
    msgs = [{"role": "user", "content": "Give the capital of France as a JSON object."}]
    c = chat(messages=msgs, response_format={"type": "json_object"}, max_tokens=64).choices[0]
    text = c.message.content
    expect(text.startswith("{"), f"not an object: {text!r}")
    if c.finish_reason == "stop":
        expect(isinstance(json.loads(text), dict), text)
    else:
        expect(c.finish_reason == "length", c.finish_reason)


@check
def openai_vllm_spellings_constrain_too():
    c = chat(messages=ASK, max_tokens=8, extra_body={"guided_choice": ["sunny", "rainy"]}).choices[0]
    expect(c.message.content in ("sunny", "rainy") and c.finish_reason == "stop", f"{c.message.content!r} {c.finish_reason}")
    c = chat(messages=ASK, max_tokens=16, extra_body={"structured_outputs": {"regex": "[0-9]{2} degrees"}}).choices[0]
    expect(len(c.message.content) == 10 and c.message.content.endswith(" degrees"), repr(c.message.content))
    grammar = 'start: "It is " WORD "."\nWORD: /[a-z]{1,10}/'
    c = chat(messages=ASK, max_tokens=16, extra_body={"guided_grammar": grammar}).choices[0]
    expect(c.message.content.startswith("It is ") and c.message.content.endswith("."), repr(c.message.content))


@check
def openai_bad_schemas_and_grammars_are_400s():
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}}
    for kw, param in [
        (dict(response_format=bad_schema), "response_format.json_schema.schema"),
        (dict(extra_body={"guided_grammar": "start: missing_rule"}), "guided_grammar"),
        (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex"),
        (dict(response_format={"type": "json_object"}, extra_body={"guided_choice": ["a"]}), "guided_choice"),
    ]:
        try:
            chat(messages=ASK, max_tokens=4, **kw)
            raise AssertionError(f"{kw} was accepted")
        except openai.BadRequestError as e:
            expect(e.body.get("param") == param and e.body.get("message"), f"{kw}: {e.body}")


@check
def speculative_constrained_replies_equal_plain_ones():
    if not ARGS.speculative_url:
        print("  (no --speculative-url: skipped)")
        return
    spec = openai.OpenAI(base_url=ARGS.speculative_url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=600)
    kw = dict(model=ARGS.model, temperature=0, messages=DESCRIBE, response_format=person_format(), max_tokens=160)
    plain = OAI.chat.completions.create(**kw).choices[0].message.content
    drafted = spec.chat.completions.create(**kw).choices[0].message.content
    expect(drafted == plain, f"drafted {drafted!r} vs plain {plain!r}")
    jsonschema.validate(json.loads(drafted), PERSON)
    kw = dict(model=ARGS.model, temperature=0, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=96)
    plain = OAI.chat.completions.create(**kw).choices[0].message.tool_calls[0].function
    drafted = spec.chat.completions.create(**kw).choices[0].message.tool_calls[0].function
    expect((drafted.name, drafted.arguments) == (plain.name, plain.arguments), f"{drafted} vs {plain}")


@check
def openai_tool_choice_none_and_plain_chat_have_no_calls():
    r = chat(messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=16)
    c = r.choices[0]
    expect(not c.message.tool_calls and isinstance(c.message.content, str), f"message {c.message}")
    expect(c.finish_reason in ("stop", "length"), c.finish_reason)


@check
def openai_bad_tool_requests_are_400s():
    for kw, param in [
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {}}]), "tools[0].function.name"),
    ]:
        try:
            chat(messages=ASK, max_tokens=4, **kw)
            raise AssertionError(f"{kw} was accepted")
        except openai.BadRequestError as e:
            expect(e.body.get("param") == param, f"{kw}: {e.body}")


@check
def openai_agent_loop_streamed():
    """tool call → tool result → answer, every step streamed."""
    tools = [WEATHER]
    msgs = list(ASK)
    _, _, calls, finish = collect_stream(chat(messages=msgs, tools=tools, tool_choice="required", max_tokens=96, stream=True))
    expect(finish == "tool_calls" and len(calls) == 1, f"first step: {finish} {calls}")
    call_id, name, arguments = calls[0]
    msgs.append({"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]})
    msgs.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps({"city": "Paris", "sky": "sunny", "celsius": 21})})
    content, _, calls2, finish = collect_stream(chat(messages=msgs, tools=tools, tool_choice="none", max_tokens=24, stream=True))
    expect(finish in ("stop", "length") and not calls2, f"answer step: {finish} {calls2}")
    expect(content.strip(), "the answer is empty")
    # The same conversation not streamed gives the same answer.
    r = chat(messages=msgs, tools=tools, tool_choice="none", max_tokens=24)
    expect(r.choices[0].message.content == content, f"{r.choices[0].message.content!r} != {content!r}")


# ---------------------------------------------------------------- Anthropic messages


GREEDY = {"temperature": 0}


def ant(**kw):
    kw.setdefault("model", ARGS.model)
    kw.setdefault("extra_body", GREEDY)
    return ANT.messages.create(**kw)


ANT_WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": schema_of(WEATHER)}


@check
def anthropic_message_and_stream_agree():
    kw = dict(max_tokens=16, system="Answer briefly.", messages=[{"role": "user", "content": "What is the capital of France?"}])
    m = ant(**kw)
    expect(m.type == "message" and m.role == "assistant" and m.id.startswith("msg_"), f"{m}")
    expect(m.content and m.content[0].type == "text" and m.content[0].text, f"content {m.content}")
    expect(m.stop_reason in ("end_turn", "max_tokens"), m.stop_reason)
    expect(m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 0 and 0 < m.usage.output_tokens <= 16, f"usage {m.usage}")
    with ANT.messages.stream(model=ARGS.model, extra_body=GREEDY, **kw) as s:
        types = [e.type for e in s]
        final = s.get_final_message()
    expect(types[0] == "message_start" and types[-1] == "message_stop", f"event order {types}")
    expect("content_block_start" in types and "message_delta" in types, f"events {types}")
    expect(final.content[0].text == m.content[0].text, f"{final.content} vs {m.content}")
    expect(final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens, f"{final} vs {m}")
    n = ANT.messages.count_tokens(model=ARGS.model, system=kw["system"], messages=kw["messages"])
    expect(n.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0), f"count_tokens {n} vs {m.usage}")


@check
def anthropic_prefix_cache_reads_are_reported():
    long = "Here is a long story about a lighthouse keeper. " * 40
    kw = dict(max_tokens=2, messages=[{"role": "user", "content": long + "Summarise it."}])
    ant(**kw)
    again = ant(**kw)
    expect((again.usage.cache_read_input_tokens or 0) > 0, f"a repeated prompt read nothing from the cache: {again.usage}")


@check
def anthropic_stop_sequences():
    m = ant(max_tokens=32, messages=[{"role": "user", "content": "Count from 1 to 10 with commas."}])
    text = m.content[0].text
    word = next((w for w in text.replace(",", " ").split() if w), None)
    if word is None:
        raise AssertionError(f"no words to stop on in {text!r}")
    m2 = ant(max_tokens=32, stop_sequences=[word], messages=[{"role": "user", "content": "Count from 1 to 10 with commas."}])
    expect(m2.stop_reason == "stop_sequence" and m2.stop_sequence == word, f"{m2.stop_reason} {m2.stop_sequence!r} (stop {word!r} in {text!r})")
    expect(word not in "".join(b.text for b in m2.content if b.type == "text"), f"{m2.content}")


@check
def anthropic_agent_loop_streamed():
    """tool_use → tool_result → answer, streamed, with a forced tool."""
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    with ANT.messages.stream(model=ARGS.model, extra_body=GREEDY, max_tokens=96, tools=[ANT_WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, messages=msgs) as s:
        first = s.get_final_message()
    uses = [b for b in first.content if b.type == "tool_use"]
    expect(first.stop_reason == "tool_use" and len(uses) == 1, f"first step {first}")
    use = uses[0]
    expect(use.name == "get_weather" and use.id.startswith("toolu_"), f"{use}")
    expect(isinstance(use.input, dict), f"{use.input!r}")
    # Not streamed: the same call.
    again = ant(max_tokens=96, tools=[ANT_WEATHER], tool_choice={"type": "tool", "name": "get_weather"}, messages=msgs)
    expect([(b.name, b.input) for b in again.content if b.type == "tool_use"] == [(use.name, use.input)], f"{again.content} vs {use}")
    msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]})
    msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]})
    with ANT.messages.stream(model=ARGS.model, extra_body=GREEDY, max_tokens=24, tools=[ANT_WEATHER], tool_choice={"type": "none"}, messages=msgs) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    expect(text.strip() and final.stop_reason in ("end_turn", "max_tokens"), f"answer {text!r} {final.stop_reason}")


@check
def anthropic_streamed_input_arrives_in_json_pieces():
    """A required tool_use block with several arguments, streamed: `content_block_start` with an
    empty input, more than one `input_json_delta`, `content_block_stop`; the pieces join to the
    non-streamed block's input (in its compact JSON spelling). (The SDK's own assembly of the
    pieces is checked by the agent loop below.)"""
    tool = {"name": "plan_trip", "description": "Plan a trip", "input_schema": schema_of(TRIP)}
    kw = dict(max_tokens=64, tools=[tool], tool_choice={"type": "any"}, messages=TRIP_ASK)
    whole = ant(**kw)
    uses = [b for b in whole.content if b.type == "tool_use"]
    expect(whole.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "plan_trip", f"{whole}")
    jsonschema.validate(uses[0].input, schema_of(TRIP))
    events = list(ant(stream=True, **kw))
    starts = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    expect(len(starts) == 1, f"tool_use starts {starts}")
    start = starts[0]
    expect(start.content_block.name == "plan_trip" and start.content_block.input == {}, f"{start}")
    index = start.index
    after = events[events.index(start) + 1 :]
    stop_at = next(i for i, e in enumerate(after) if e.type == "content_block_stop" and e.index == index)
    inside = after[:stop_at]
    expect(all(e.type == "content_block_delta" and e.index == index and e.delta.type == "input_json_delta" for e in inside), f"{inside}")
    pieces = [e.delta.partial_json for e in inside]
    expect(len(pieces) > 1, f"the input came in one piece: {pieces}")
    joined = "".join(pieces)
    expect(joined == json.dumps(uses[0].input, separators=(",", ":"), ensure_ascii=False), f"{joined!r} vs {uses[0].input}")
    delta = next(e for e in events if e.type == "message_delta")
    expect(delta.delta.stop_reason == "tool_use", f"{delta}")


@check
def anthropic_errors_have_anthropic_shape():
    try:
        ANT.messages.create(model=ARGS.model, max_tokens=8, messages=[])
        raise AssertionError("empty messages accepted")
    except anthropic.BadRequestError as e:
        expect(e.status_code == 400, e.status_code)
        expect(e.body["type"] == "error" and e.body["error"]["type"] == "invalid_request_error", f"{e.body}")
    try:
        ANT.messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("unknown model accepted")
    except anthropic.NotFoundError as e:
        expect(e.body["error"]["type"] == "not_found_error", f"{e.body}")


# ---------------------------------------------------------------- tokenize


def post(path, body):
    req = urllib.request.Request(ARGS.base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


@check
def tokenize_and_detokenize_round_trip():
    t = post("/tokenize", {"prompt": "The capital of France is", "add_special_tokens": False})
    expect(t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] > 0, f"{t}")
    d = post("/detokenize", {"tokens": t["tokens"]})
    expect(d["prompt"] == "The capital of France is", f"{d}")
    chat_ids = post("/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    r = chat(messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    expect(chat_ids["count"] == r.usage.prompt_tokens, f"{chat_ids['count']} vs {r.usage.prompt_tokens}")


def main():
    global ARGS, OAI, ANT
    p = argparse.ArgumentParser()
    p.add_argument("base_url")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--only", default="")
    p.add_argument("--speculative-url", default="")
    ARGS = p.parse_args()
    ARGS.base_url = ARGS.base_url.rstrip("/")
    OAI = openai.OpenAI(base_url=ARGS.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    ANT = anthropic.Anthropic(base_url=ARGS.base_url, api_key="unused", max_retries=0, timeout=600)
    print(f"openai {openai.__version__}, anthropic {anthropic.__version__} against {ARGS.base_url}", flush=True)
    passed = failed = 0
    for fn in CHECKS:
        if ARGS.only and ARGS.only not in fn.__name__:
            continue
        start = time.monotonic()
        try:
            fn()
        except Exception as e:  # a failed check, whatever raised it
            failed += 1
            print(f"FAIL {fn.__name__} ({time.monotonic() - start:.1f} s): {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=3)
            continue
        passed += 1
        print(f"PASS {fn.__name__} ({time.monotonic() - start:.1f} s)", flush=True)
    print(f"{passed} passed, {failed} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
