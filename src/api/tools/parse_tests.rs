//! The tool-call parser on golden model outputs (strings following the examples each family
//! documents for its chat template), fed whole, cut in two at every character, one character at
//! a time and in token-like chunks: every feeding must give the same content and calls, and every
//! arguments string must be serde_json's own compact serialisation of the typed object.

use serde_json::{json, Value};

use super::*;
use crate::api::tools::args::arguments_json;

fn tools() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: "get_weather".into(),
            description: None,
            parameters: json!({"type": "object", "properties": {"location": {"type": "string"},
                "unit": {"type": "string"}, "days": {"type": "integer"}}}),
        },
        ToolSpec { name: "get_time".into(), description: None, parameters: json!({}) },
    ]
}

/// (content, [(name, arguments, whole)]) and the argument pieces each call released.
type Parsed = (String, Vec<(String, String, bool)>);

fn feed(format: ToolFormat, pieces: &[&str]) -> (Parsed, Vec<usize>) {
    let mut p = ToolCallParser::new(format, tools());
    let mut events = Vec::new();
    for s in pieces {
        events.extend(p.push(s));
    }
    events.extend(p.finish());
    let mut content = String::new();
    let mut list = CallList::default();
    let mut counts = Vec::new();
    let mut open = None;
    let mut whole = Vec::new();
    for e in events {
        match e {
            Piece::Content(c) => {
                assert!(open.is_none(), "content inside call {open:?}: {c:?}");
                content.push_str(&c);
            }
            Piece::Call(e) => {
                match &e {
                    CallEvent::Start { index, id, .. } => {
                        assert!(open.is_none() && *index == counts.len(), "start {index} while {open:?}");
                        assert!(id.starts_with("call_") && id.len() == 29, "{id}");
                        open = Some(*index);
                        counts.push(0);
                    }
                    CallEvent::Arguments { index, text } => {
                        assert_eq!(open, Some(*index), "pieces of a call that is not open");
                        assert!(!text.is_empty());
                        counts[*index] += 1;
                    }
                    CallEvent::End { index, whole: w } => {
                        assert_eq!(open.take(), Some(*index));
                        whole.push(*w);
                    }
                }
                list.add(e);
            }
        }
    }
    assert!(open.is_none(), "a call never ended");
    assert_eq!(list.whole, whole.iter().filter(|w| **w).count());
    let calls = list.calls.into_iter().zip(whole).map(|(c, w)| (c.name, c.arguments, w)).collect();
    ((content, calls), counts)
}

/// `text` fed whole and in every other way must agree; the argument pieces per call when fed
/// one character at a time are returned too.
fn parse(format: ToolFormat, text: &str) -> (Parsed, Vec<usize>) {
    let (whole, counts_whole) = feed(format, &[text]);
    for i in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
        assert_eq!(feed(format, &[&text[..i], &text[i..]]).0, whole, "cut at {i}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let (by_char, counts) = feed(format, &chars.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(by_char, whole, "char by char");
    let chunks: Vec<String> = chars.chunks(3).map(|c| c.concat()).collect();
    assert_eq!(feed(format, &chunks.iter().map(String::as_str).collect::<Vec<_>>()).0, whole, "in chunks of 3");
    for (name, args, _) in &whole.1 {
        let v: Value = serde_json::from_str(args).unwrap_or_else(|e| panic!("{name}: {args}: {e}"));
        assert!(v.is_object(), "{args}");
        assert_eq!(&v.to_string(), args, "serde_json's compact form, keys in written order");
    }
    assert!(counts.iter().zip(&counts_whole).all(|(c, w)| c >= w));
    (whole, counts)
}

fn call(name: &str, args: &str) -> (String, String, bool) {
    (name.to_owned(), args.to_owned(), true)
}

#[test]
fn the_writer_spells_objects_as_serde_json_does() {
    let v = json!({"b": 1, "a": "x \"q\" é 😀 \n\u{1}", "n": null, "o": {"z": [1.5, true], "y": {}}, "e": []});
    let Value::Object(m) = v.clone() else { unreachable!() };
    assert_eq!(arguments_json(&m), v.to_string());
    assert_eq!(arguments_json(&serde_json::Map::new()), "{}");
}

#[test]
fn hermes_qwen_single_parallel_and_zero_argument_calls() {
    let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"San Francisco, CA\", \"unit\": \"celsius\"}}\n</tool_call>";
    let ((content, calls), counts) = parse(ToolFormat::Hermes, text);
    assert_eq!(content, "");
    assert_eq!(calls, vec![call("get_weather", r#"{"location":"San Francisco, CA","unit":"celsius"}"#)]);
    assert!(counts[0] > 3, "string values stream as written: {counts:?}");

    let text = "Let me check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\", \"days\": \"3\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
    let ((content, calls), _) = parse(ToolFormat::Hermes, text);
    assert_eq!(content, "Let me check both.\n");
    assert_eq!(calls, vec![call("get_weather", r#"{"location":"Paris","days":3}"#), call("get_time", "{}")]);

    // No `arguments` at all, arguments before the name, arguments as a JSON string: still calls.
    let text = "<tool_call>{\"name\": \"get_time\"}</tool_call><tool_call>{\"arguments\": {\"days\": \"2\"}, \"name\": \"get_weather\"}</tool_call><tool_call>{\"name\": \"get_weather\", \"arguments\": \"{\\\"days\\\": 4}\"}</tool_call>";
    let ((content, calls), _) = parse(ToolFormat::Hermes, text);
    assert_eq!(content, "");
    assert_eq!(
        calls,
        vec![call("get_time", "{}"), call("get_weather", r#"{"days":2}"#), call("get_weather", r#"{"days":4}"#)]
    );
}

#[test]
fn each_argument_is_released_before_the_call_closes() {
    // Token-like pieces, split inside the markers, the key strings and the number.
    let tokens = [
        "<tool",
        "_call",
        ">\n",
        "{\"",
        "name",
        "\":",
        " \"",
        "get",
        "_weather",
        "\",",
        " \"arguments",
        "\":",
        " {\"",
        "loc",
        "ation",
        "\":",
        " \"",
        "Os",
        "lo",
        "\",",
        " \"",
        "days",
        "\":",
        " ",
        "1",
        "2",
        "}",
        "}\n",
        "</",
        "tool",
        "_call",
        ">",
    ];
    let mut p = ToolCallParser::new(ToolFormat::Hermes, tools());
    let mut released = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        released.extend(p.push(t).into_iter().map(|piece| (i, piece)));
    }
    released.extend(p.finish().into_iter().map(|piece| (tokens.len(), piece)));
    let seen: Vec<(usize, String)> = released
        .iter()
        .map(|(i, p)| match p {
            Piece::Call(CallEvent::Start { name, .. }) => (*i, format!("start {name}")),
            Piece::Call(CallEvent::Arguments { text, .. }) => (*i, text.clone()),
            Piece::Call(CallEvent::End { whole, .. }) => (*i, format!("end {whole}")),
            Piece::Content(c) => (*i, format!("content {c}")),
        })
        .collect();
    let expected = [
        (9, "start get_weather"),
        (16, "{\"location\":\""),
        (17, "Os"),
        (18, "lo"),
        (19, "\""),
        (26, ",\"days\":12"),
        (26, "}"),
        (27, "end true"),
    ];
    assert_eq!(seen, expected.map(|(i, s)| (i, s.to_owned())));
}

#[test]
fn escapes_and_unicode_stream_exactly() {
    let text = r#"<tool_call>{"name": "get_weather", "arguments": {"location": "A \"q\" \\ \/ \u00e9 \ud83d\ude00 é\n\ttab", "unit": "\u0001", "days": "7"}}</tool_call>"#;
    let ((content, calls), _) = parse(ToolFormat::Hermes, text);
    assert_eq!(content, "");
    assert_eq!(
        calls,
        vec![call(
            "get_weather",
            "{\"location\":\"A \\\"q\\\" \\\\ / é 😀 é\\n\\ttab\",\"unit\":\"\\u0001\",\"days\":7}"
        )]
    );
    // GLM values are raw text: escaped as JSON strings, wherever the text was cut.
    let text = "<tool_call>get_weather<arg_key>location</arg_key><arg_value>say \"hi\"\n\\ é😀 </arg_val</arg_value></tool_call>";
    let ((_, calls), _) = parse(ToolFormat::Glm, text);
    assert_eq!(calls, vec![call("get_weather", "{\"location\":\"say \\\"hi\\\"\\n\\\\ é😀 </arg_val\"}")]);
    // A lone surrogate is not JSON: the call is closed with what was sent, the text is content.
    let text = r#"<tool_call>{"name": "get_weather", "arguments": {"location": "x\ud83dy"}}</tool_call>"#;
    let ((content, calls), _) = parse(ToolFormat::Hermes, text);
    assert_eq!(content, text);
    assert_eq!(calls, vec![("get_weather".into(), r#"{"location":"x"}"#.into(), false)]);
}

#[test]
fn hermes_text_without_calls_and_unknown_tools_stay_content() {
    let text = "Use the <tool tag> like <tool_ca... no.";
    assert_eq!(parse(ToolFormat::Hermes, text).0, (text.to_owned(), vec![]));
    let text = "<tool_call>\n{\"name\": oops}\n</tool_call>";
    assert_eq!(parse(ToolFormat::Hermes, text).0, (text.to_owned(), vec![]));
    let text = "<tool_call>\n{\"name\": \"launch_rocket\", \"arguments\": {}}\n</tool_call>";
    assert_eq!(parse(ToolFormat::Hermes, text).0, (text.to_owned(), vec![]), "not an offered tool");
    // Max tokens before the closing tag, but the JSON is complete: still a call.
    let ((content, calls), _) = parse(ToolFormat::Hermes, "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n");
    assert_eq!((content.as_str(), calls), ("", vec![call("get_time", "{}")]));
    // Cut before the name is complete: given back as text.
    let text = "<tool_call>\n{\"name\": \"get_ti";
    assert_eq!(parse(ToolFormat::Hermes, text).0, (text.to_owned(), vec![]));
}

#[test]
fn a_call_that_breaks_after_its_header_is_closed_and_its_text_kept() {
    // A value that is not JSON: the arguments sent so far are closed into an object, the call
    // ends not whole, and the call's text from its marker on is content.
    let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\", \"days\": soon}}\n</tool_call> ok";
    let ((content, calls), _) = parse(ToolFormat::Hermes, text);
    assert_eq!(calls, vec![("get_weather".into(), r#"{"location":"Paris"}"#.into(), false)]);
    assert_eq!(content, text);
    // Cut by max tokens inside a string: the string and the object are closed.
    let text = "Sure.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"days\": 2, \"location\": \"Par";
    let ((content, calls), _) = parse(ToolFormat::Hermes, text);
    assert_eq!(calls, vec![("get_weather".into(), r#"{"days":2,"location":"Par"}"#.into(), false)]);
    assert_eq!(content, text);
    // Cut right after the header: `{}`.
    let text = "<tool_call>{\"name\": \"get_weather\", \"arguments\": ";
    assert_eq!(parse(ToolFormat::Hermes, text).0, (text.into(), vec![("get_weather".into(), "{}".into(), false)]));
    // GLM: a key without a value.
    let text = "<tool_call>get_weather<arg_key>location</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key>3</tool_call>";
    let ((content, calls), _) = parse(ToolFormat::Glm, text);
    assert_eq!(calls, vec![("get_weather".into(), r#"{"location":"Oslo"}"#.into(), false)]);
    assert_eq!(content, text);
    // A broken call does not hide a good one after it.
    let text = "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"days\": x}}</tool_call>\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>";
    let ((content, calls), _) = parse(ToolFormat::Hermes, text);
    assert_eq!(calls, vec![("get_weather".into(), "{}".into(), false), call("get_time", "{}")]);
    assert_eq!(content, "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"days\": x}}</tool_call>\n");
}

#[test]
fn glm_calls_with_typed_arguments() {
    // GLM-4.5 writes each part on its own line; GLM-4.7 / 5 write them back to back.
    let glm45 = "I'll look it up.\n<tool_call>get_weather\n<arg_key>location</arg_key>\n<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>";
    let ((content, calls), counts) = parse(ToolFormat::Glm, glm45);
    assert_eq!(content, "I'll look it up.\n");
    assert_eq!(calls, vec![call("get_weather", r#"{"location":"Beijing","days":2}"#)]);
    assert!(counts[0] > 2, "{counts:?}");

    let glm47 = "<tool_call>get_weather<arg_key>location</arg_key><arg_value>42</arg_value></tool_call><tool_call>get_time</tool_call>";
    let ((content, calls), _) = parse(ToolFormat::Glm, glm47);
    assert_eq!(content, "");
    // `location` is a string in the schema: "42" stays a string.
    assert_eq!(calls, vec![call("get_weather", r#"{"location":"42"}"#), call("get_time", "{}")]);
    // A forced call's `</tool_call>` is a stop string: the reply ends after the last value.
    let ((_, calls), _) =
        parse(ToolFormat::Glm, "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>5</arg_value>\n");
    assert_eq!(calls, vec![call("get_weather", r#"{"days":5}"#)]);
    let text = "<tool_call>what is this</tool_call>";
    assert_eq!(parse(ToolFormat::Glm, text).0, (text.into(), vec![]));
}

#[test]
fn llama3_json_calls() {
    let text = "{\"name\": \"get_weather\", \"parameters\": {\"location\": \"Paris\", \"days\": 2}}";
    let ((content, calls), counts) = parse(ToolFormat::Llama3Json, text);
    assert_eq!((content.as_str(), calls), ("", vec![call("get_weather", r#"{"location":"Paris","days":2}"#)]));
    assert!(counts[0] > 2);
    let text = "<|python_tag|>{\"name\": \"get_time\", \"parameters\": {}}; {\"name\": \"get_weather\", \"parameters\": {\"location\": \"Rome\"}}";
    let ((content, calls), _) = parse(ToolFormat::Llama3Json, text);
    assert_eq!(content, "");
    assert_eq!(calls, vec![call("get_time", "{}"), call("get_weather", r#"{"location":"Rome"}"#)]);
    // Prose is prose, even if it contains braces later or starts with one.
    let text = "The set {1, 2} has two elements.";
    assert_eq!(parse(ToolFormat::Llama3Json, text).0, (text.to_owned(), vec![]));
    let text = "{1, 2} is a set.";
    assert_eq!(parse(ToolFormat::Llama3Json, text).0, (text.to_owned(), vec![]));
}

#[test]
fn mistral_calls() {
    let text = "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\", \"days\": 1}}, {\"name\": \"get_time\", \"arguments\": {}}]";
    let ((content, calls), counts) = parse(ToolFormat::Mistral, text);
    assert_eq!(content, "");
    assert_eq!(calls, vec![call("get_weather", r#"{"location":"Paris","days":1}"#), call("get_time", "{}")]);
    assert!(counts[0] > 2);
    let text = "[TOOL_CALLS]get_weather[ARGS]{\"location\": \"Paris\", \"days\": \"1\"}[TOOL_CALLS]get_time[ARGS]{}";
    let ((content, calls), _) = parse(ToolFormat::Mistral, text);
    assert_eq!(content, "");
    assert_eq!(calls, vec![call("get_weather", r#"{"location":"Paris","days":1}"#), call("get_time", "{}")]);
    let text = "No tools needed: [TOOL_CALLS] is just a word here.";
    assert_eq!(parse(ToolFormat::Mistral, text).0, (text.to_owned(), vec![]));
}

/// Random argument objects (nested values, escapes, non-ASCII, surrogate pairs), written as the
/// model might (compact, spaced, pretty, `\u` escapes), in every format and cut at random
/// places: the assembled arguments are always serde_json's compact form of the object the old
/// whole-text path built (parsed, then typed by the schema).
#[test]
fn random_objects_in_random_pieces_match_the_whole_text_path() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(20);
    let words = ["Oslo", "a \"q\"", "back\\slash", "é😀", "new\nline", "tab\t", "", "12", "</tool_call>", "{x}"];
    let keys = ["location", "unit", "days", "note", "k\"ey"];
    let schema = tools()[0].parameters.clone();
    for case in 0..300 {
        let mut obj = serde_json::Map::new();
        for _ in 0..rng.random_range(0..4) {
            let key = keys[rng.random_range(0..keys.len())];
            let v = match rng.random_range(0..6) {
                0 => json!(rng.random_range(-50..500)),
                1 => json!(words[rng.random_range(0..words.len())]),
                2 => json!([1.5, {"deep": words[rng.random_range(0..words.len())]}, null]),
                3 => json!(rng.random_bool(0.5)),
                4 => json!(format!("{}", rng.random_range(0..9))),
                _ => json!({"nested": {"list": [true, "x"]}}),
            };
            obj.insert(key.to_owned(), v);
        }
        let mut expected = obj.clone();
        crate::api::tools::type_arguments(&mut expected, Some(&schema));
        let expected = Value::Object(expected).to_string();
        let written = match case % 3 {
            0 => Value::Object(obj.clone()).to_string(),
            1 => serde_json::to_string_pretty(&obj).unwrap(),
            // ASCII-only, as Python's json.dumps writes it.
            _ => Value::Object(obj.clone())
                .to_string()
                .chars()
                .map(|c| {
                    if c.is_ascii() {
                        c.to_string()
                    } else {
                        c.encode_utf16(&mut [0; 2]).iter().map(|u| format!("\\u{u:04x}")).collect()
                    }
                })
                .collect(),
        };
        // GLM writes values as text: strings as they are, other values as JSON.
        let mut glm = String::from("<tool_call>get_weather");
        let mut glm_expected = serde_json::Map::new();
        for (k, v) in &obj {
            let raw = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
            glm.push_str(&format!("\n<arg_key>{k}</arg_key>\n<arg_value>{raw}</arg_value>"));
            glm_expected.insert(k.clone(), Value::String(raw));
        }
        glm.push_str("\n</tool_call>");
        crate::api::tools::type_arguments(&mut glm_expected, Some(&schema));
        let glm_chars: Vec<String> = glm.chars().map(String::from).collect();
        let ((_, glm_calls), _) = feed(ToolFormat::Glm, &glm_chars.iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(glm_calls, vec![call("get_weather", &Value::Object(glm_expected).to_string())], "{glm}");
        let texts = [
            (
                ToolFormat::Hermes,
                format!("<tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {written}}}\n</tool_call>"),
            ),
            (ToolFormat::Llama3Json, format!("{{\"name\": \"get_weather\", \"parameters\": {written}}}")),
            (ToolFormat::Mistral, format!("[TOOL_CALLS][{{\"name\": \"get_weather\", \"arguments\": {written}}}]")),
            (ToolFormat::Mistral, format!("[TOOL_CALLS]get_weather[ARGS]{written}")),
        ];
        for (format, text) in texts {
            let chars: Vec<char> = text.chars().collect();
            let mut pieces = Vec::new();
            let mut at = 0;
            while at < chars.len() {
                let n = rng.random_range(1..6).min(chars.len() - at);
                pieces.push(chars[at..at + n].iter().collect::<String>());
                at += n;
            }
            let (whole, _) = feed(format, &[&text]);
            let (cut, _) = feed(format, &pieces.iter().map(String::as_str).collect::<Vec<_>>());
            assert_eq!(whole, cut, "{text}");
            assert_eq!(whole, (String::new(), vec![call("get_weather", &expected)]), "{format:?} {text}");
        }
    }
}
