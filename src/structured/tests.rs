//! Against the SmolLM2 tokenizer fixture (byte-level BPE, 49152 tokens, `<|im_end|>` special).

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use serde_json::{json, Value};

use super::*;
use crate::tokenizer::TokenizerBundle;

fn bundle() -> Arc<TokenizerBundle> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama-tok");
    let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).expect("fixture tokenizer");
    Arc::new(TokenizerBundle {
        tokenizer,
        origin: dir,
        chat_template: None,
        bos_token: None,
        eos_token: Some("<|im_end|>".into()),
        bos_token_id: None,
        eos_token_ids: vec![2, 0],
        add_bos_token: false,
    })
}

fn compiler() -> &'static GrammarCompiler {
    static C: OnceLock<GrammarCompiler> = OnceLock::new();
    C.get_or_init(|| GrammarCompiler::new(bundle()).expect("vocabulary builds"))
}

fn state(spec: &GrammarSpec) -> GrammarState {
    let c = compiler();
    GrammarState::new(c.compile(spec).expect("compiles"), None, vec![2, 0], c.vocab().vocab_size())
}

fn ids(text: &str) -> Vec<u32> {
    compiler().vocab().encode(text)
}

fn schema() -> Value {
    json!({"type": "object", "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "mood": {"enum": ["happy", "sad"]},
        "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age", "mood", "tags"], "additionalProperties": false})
}

/// Walk `text` token by token: each must be allowed by the mask before it.
fn walk(g: &mut GrammarState, text: &str) {
    for t in ids(text) {
        let mask = g.next_mask().expect("constrained");
        assert!(mask.is_allowed(t), "token {t} of {text:?} refused");
        g.consume(&[t]);
    }
}

#[test]
fn a_schema_allows_its_documents_and_then_only_eos() {
    let mut g = state(&GrammarSpec::JsonSchema { schema: schema(), strict: true });
    let first = g.next_mask().unwrap();
    // The schema forces `{"name": "`: llguidance allows the canonical first token of it.
    assert!(first.is_allowed(ids(r#"{"name""#)[0]));
    assert!(!first.is_allowed(ids("Hello")[0]), "prose is not JSON");
    assert!(!first.is_allowed(2) && !first.is_allowed(0), "an empty reply is not an object");
    walk(&mut g, r#"{"name": "Ann", "age": 41, "mood": "sad", "tags": ["a", "b"]}"#);
    let end = g.next_mask().unwrap();
    assert!(end.is_allowed(2) && end.is_allowed(0), "every EOS ends a complete document");
    assert_eq!(end.num_set(), 2, "nothing but EOS after the closing brace");
    assert!(g.is_finished());
}

#[test]
fn a_schema_refuses_wrong_types_keys_and_enum_values() {
    let mut g = state(&GrammarSpec::JsonSchema { schema: schema(), strict: true });
    walk(&mut g, r#"{"name": "Ann", "age": "#);
    let m = g.next_mask().unwrap();
    assert!(!m.is_allowed(ids("\"")[0]), "a string where an integer belongs");
    assert!(m.is_allowed(ids("4")[0]));
    let mut g = state(&GrammarSpec::JsonSchema { schema: schema(), strict: true });
    walk(&mut g, r#"{"name": "Ann", "age": 41, "mood": ""#);
    let m = g.next_mask().unwrap();
    assert!(m.is_allowed(ids("happy")[0]) || m.is_allowed(ids("h")[0]));
    assert!(!m.is_allowed(ids("angry")[0]) && !m.is_allowed(ids("a")[0]), "not an enum value");
    let mut g = state(&GrammarSpec::JsonSchema { schema: schema(), strict: true });
    walk(&mut g, "{\"");
    let m = g.next_mask().unwrap();
    assert!(m.is_allowed(ids("name")[0]) && !m.is_allowed(ids("x")[0]), "an unknown key");
}

#[test]
fn json_object_is_any_object() {
    let mut g = state(&GrammarSpec::JsonObject);
    assert!(!g.next_mask().unwrap().is_allowed(ids("[")[0]), "an array is not an object");
    walk(&mut g, r#"{"anything": [1, {"deep": null}]}"#);
    assert!(g.next_mask().unwrap().is_allowed(2));
}

#[test]
fn regex_choice_and_lark() {
    let mut g = state(&GrammarSpec::Choice(vec!["yes".into(), "no".into()]));
    let m = g.next_mask().unwrap();
    assert!(m.is_allowed(ids("yes")[0]) && m.is_allowed(ids("no")[0]) && !m.is_allowed(ids("maybe")[0]));
    let mut g = state(&GrammarSpec::Regex("[0-9]{3}-[0-9]{4}".into()));
    walk(&mut g, "555-1234");
    assert_eq!(g.next_mask().unwrap().num_set(), 2);
    let mut g = state(&GrammarSpec::Lark("start: \"ok \" NUM\nNUM: /[0-9]+/".into()));
    walk(&mut g, "ok 12");
    let m = g.next_mask().unwrap();
    assert!(m.is_allowed(2) && m.is_allowed(ids("3")[0]) && !m.is_allowed(ids("x")[0]));
}

#[test]
fn bad_schemas_and_grammars_say_why() {
    let c = compiler();
    let err = |spec: GrammarSpec| match c.compile(&spec) {
        Err(GrammarError::Invalid(m)) => m,
        other => panic!("expected an invalid grammar, got {:?}", other.map(|_| ())),
    };
    let m = err(GrammarSpec::JsonSchema {
        schema: json!({"type": "object", "properties": {"a": {"type": "wat"}}}),
        strict: true,
    });
    assert!(m.contains("wat"), "{m}");
    let m =
        err(GrammarSpec::JsonSchema { schema: json!({"type": "integer", "minimum": 5, "maximum": 1}), strict: true });
    assert!(!m.is_empty());
    let m = err(GrammarSpec::JsonSchema { schema: json!("not a schema"), strict: true });
    assert!(m.contains("must be an object"), "{m}");
    let m = err(GrammarSpec::Lark("start: missing_rule".into()));
    assert!(m.contains("missing_rule"), "{m}");
    assert!(!err(GrammarSpec::Regex("(unclosed".into())).is_empty());
    assert!(!err(GrammarSpec::Choice(vec![])).is_empty());
    assert!(!err(GrammarSpec::Lark("  ".into())).is_empty());
}

#[test]
fn masks_for_drafts_equal_stepwise_masks_and_leave_the_matcher_in_place() {
    let spec = GrammarSpec::JsonSchema { schema: schema(), strict: true };
    let drafts = ids(r#"{"name": "Bo"#);
    let mut stepwise = state(&spec);
    let mut expected = Vec::new();
    for &d in &drafts {
        expected.push(stepwise.next_mask());
        stepwise.consume(&[d]);
    }
    expected.push(stepwise.next_mask());
    let mut g = state(&spec);
    let before = g.next_mask().map(|m| m.to_list());
    let masks = g.masks_for(&drafts);
    assert_eq!(masks.len(), drafts.len() + 1);
    for (i, (a, b)) in masks.iter().zip(&expected).enumerate() {
        assert_eq!(a.as_ref().map(|m| m.to_list()), b.as_ref().map(|m| m.to_list()), "row {i}");
    }
    assert_eq!(g.next_mask().map(|m| m.to_list()), before, "rolled back");
    // A draft the grammar refuses: later rows repeat its row, and the matcher is still in place.
    let bad = [ids("{")[0], ids("Hello")[0], ids("x")[0]];
    let masks = g.masks_for(&bad);
    assert_eq!(masks.len(), 4);
    assert_eq!(masks[2].as_ref().map(|m| m.to_list()), masks[1].as_ref().map(|m| m.to_list()));
    assert_eq!(masks[3].as_ref().map(|m| m.to_list()), masks[1].as_ref().map(|m| m.to_list()));
    assert_eq!(g.next_mask().map(|m| m.to_list()), before);
}

#[test]
fn drafts_are_cut_at_the_first_refused_token() {
    let mut g = state(&GrammarSpec::JsonSchema { schema: schema(), strict: true });
    let mut drafts = ids(r#"{"name""#);
    let good = drafts.len();
    drafts.extend(ids(" and then prose"));
    assert_eq!(g.valid_prefix(&drafts), good);
    assert_eq!(g.valid_prefix(&ids("Sure! {")), 0);
    // Nothing was consumed by the checks.
    assert!(g.next_mask().unwrap().is_allowed(ids(r#"{"name""#)[0]));
}

#[test]
fn a_grammar_after_a_marker_starts_there() {
    let c = compiler();
    let marker = ids("</think>");
    let matcher = c.compile(&GrammarSpec::JsonObject).unwrap();
    let mut g = GrammarState::new(matcher, Some(marker.clone()), vec![2], c.vocab().vocab_size());
    assert!(g.next_mask().is_none(), "reasoning is free text");
    let thoughts = ids("hmm, an object. </thi");
    assert_eq!(g.valid_prefix(&thoughts), thoughts.len());
    let masks = g.masks_for(&marker);
    assert!(masks[0].is_none() && masks[marker.len()].is_some(), "constrained right after the marker");
    assert!(g.next_mask().is_none(), "the draft walk was rolled back");
    g.consume(&ids("hmm"));
    g.consume(&marker);
    let m = g.next_mask().expect("constrained after the marker");
    assert!(m.is_allowed(ids("{")[0]) && !m.is_allowed(ids("hmm")[0]));
}

#[test]
fn masks_forbid_what_they_do_not_allow_and_every_id_past_them() {
    let mut g = state(&GrammarSpec::Choice(vec!["yes".into()]));
    let mask = g.next_mask().unwrap();
    let mut logits = vec![1.0f32; mask.len() + 7];
    apply_mask(&mask, &mut logits);
    let yes = ids("yes")[0] as usize;
    assert_eq!(logits[yes], 1.0);
    assert!(logits.iter().enumerate().all(|(i, &l)| i == yes || l == f32::NEG_INFINITY || mask.is_allowed(i as u32)));
    assert!(logits[mask.len()..].iter().all(|&l| l == f32::NEG_INFINITY));
}

#[test]
fn pending_masks_are_computed_off_the_caller_and_joined() {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let handle = state(&GrammarSpec::JsonObject).into_handle();
    let drafts = ids(r#"{"a"#);
    let pending = PendingMasks::start(&pool, &handle, drafts.clone());
    let lists = |m: &[Option<TokenMask>]| m.iter().map(|m| m.as_ref().map(|m| m.to_list())).collect::<Vec<_>>();
    let masks = pending.wait(drafts.len() + 1);
    assert_eq!(lists(&masks), lists(&handle.lock().masks_for(&drafts)));
    // Waiting again gives the same answer; rows the job never computed are EOS only.
    assert_eq!(lists(&pending.wait(1)), lists(&masks[..1]));
    let extra = pending.wait(drafts.len() + 2);
    assert_eq!(extra.last().unwrap().as_ref().unwrap().to_list(), vec![0, 2]);
}
