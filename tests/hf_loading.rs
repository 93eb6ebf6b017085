//! Opening the tiny HF checkpoints in tests/fixtures/hf (written by transformers through
//! scripts/gen_hf_tiny.py): configs, weight layout and bytes, tokenizer and chat template against
//! what transformers produced, and error messages for broken directories.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use serde_json::Value;
use shelfserve::config::{LlamaConfig, RopeScaling};
use shelfserve::model::default_model::CacheDir;
use shelfserve::model::{self, DType, ModelBundle, ModelError};

const FIXTURES: &[&str] = &["llama3-tiny", "qwen2-tiny", "qwen3-tiny", "mistral-tiny", "llama-tok"];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf").join(name)
}

fn open_path(path: &Path) -> Result<ModelBundle, ModelError> {
    model::open(path.to_str().expect("utf-8 path"), &CacheDir::from_env())
}

fn open(name: &str) -> ModelBundle {
    open_path(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn open_err(path: &Path) -> (ModelError, String) {
    match open_path(path) {
        Ok(_) => panic!("{}: expected an error", path.display()),
        Err(e) => {
            let s = e.to_string();
            (e, s)
        }
    }
}

/// Every tensor a llama-family checkpoint must have, with its PyTorch shape, from the config.
fn llama_layout(c: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let (h, i, v) = (c.hidden_size, c.intermediate_size, c.vocab_size);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, h]), ("model.norm.weight".into(), vec![h])];
    if !c.tie_word_embeddings {
        out.push(("lm_head.weight".into(), vec![v, h]));
    }
    for l in 0..c.num_hidden_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        out.push((p("input_layernorm.weight"), vec![h]));
        out.push((p("post_attention_layernorm.weight"), vec![h]));
        out.push((p("self_attn.q_proj.weight"), vec![c.q_dim(), h]));
        out.push((p("self_attn.k_proj.weight"), vec![c.kv_dim(), h]));
        out.push((p("self_attn.v_proj.weight"), vec![c.kv_dim(), h]));
        out.push((p("self_attn.o_proj.weight"), vec![h, c.q_dim()]));
        if c.attention_qkv_bias {
            out.push((p("self_attn.q_proj.bias"), vec![c.q_dim()]));
            out.push((p("self_attn.k_proj.bias"), vec![c.kv_dim()]));
            out.push((p("self_attn.v_proj.bias"), vec![c.kv_dim()]));
        }
        if c.attention_out_bias {
            out.push((p("self_attn.o_proj.bias"), vec![h]));
        }
        if c.qk_norm {
            out.push((p("self_attn.q_norm.weight"), vec![c.head_dim]));
            out.push((p("self_attn.k_norm.weight"), vec![c.head_dim]));
        }
        out.push((p("mlp.gate_proj.weight"), vec![i, h]));
        out.push((p("mlp.up_proj.weight"), vec![i, h]));
        out.push((p("mlp.down_proj.weight"), vec![h, i]));
    }
    out
}

/// Check every expected tensor through `expect` (shape) and that nothing else is there.
fn check_layout(b: &ModelBundle, dtype: DType) -> Result<(), ModelError> {
    let layout = llama_layout(&b.config);
    for (name, shape) in &layout {
        let t = b.weights.expect(name, shape)?;
        assert_eq!(t.dtype, dtype, "{}: {name}", b.name);
        assert_eq!(t.data.len(), t.elem_count() * dtype.block_bytes(), "{}: {name}", b.name);
    }
    let expected: BTreeSet<String> = layout.into_iter().map(|(n, _)| n).collect();
    let found: BTreeSet<String> = b.weights.tensor_names().into_iter().collect();
    assert_eq!(found, expected, "{}: tensor names", b.name);
    Ok(())
}

/// An independent reading of a safetensors file (8-byte length, JSON header, data): returns
/// (name, dtype string, shape, bytes) for every tensor.
fn parse_safetensors_by_hand(path: &Path) -> Vec<(String, String, Vec<usize>, Vec<u8>)> {
    let bytes = fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    header
        .into_iter()
        .filter(|(k, _)| k != "__metadata__")
        .map(|(k, v)| {
            let off: Vec<usize> =
                v["data_offsets"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
            let shape = v["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
            (k, v["dtype"].as_str().unwrap().to_string(), shape, data[off[0]..off[1]].to_vec())
        })
        .collect()
}

#[test]
fn configs_match_what_the_script_built() {
    let b = open("llama3-tiny");
    let c = &b.config;
    assert_eq!(b.name, "llama3-tiny");
    assert_eq!(c.model_type, "llama");
    assert_eq!((c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers), (512, 64, 128, 2));
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (4, 2, 16));
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert_eq!(c.rope_theta, 10000.0);
    assert_eq!(
        c.rope_scaling,
        Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64
        })
    );
    assert!(c.tie_word_embeddings);
    assert!(!c.attention_qkv_bias && !c.attention_out_bias && !c.mlp_bias && !c.qk_norm);
    assert_eq!(c.sliding_window, None);
    // transformers' llama3 rope (printed by the script): ratios to the unscaled frequencies are
    // [1.0, 0.7728, 0.1304, 0.125, 0.125, 0.125, 0.125, 0.125].
    let unscaled: Vec<f64> = (0..8).map(|i| 1.0 / 10000f64.powf(2.0 * i as f64 / 16.0)).collect();
    let ratios: Vec<f64> = c.rope_inv_freq().iter().zip(&unscaled).map(|(&f, u)| f as f64 / u).collect();
    for (r, hf) in ratios.iter().zip([1.0, 0.7728, 0.1304, 0.125, 0.125, 0.125, 0.125, 0.125]) {
        assert!((r - hf).abs() < 1e-4, "{ratios:?}");
    }

    let c = open("qwen2-tiny").config;
    assert_eq!(c.model_type, "qwen2");
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (4, 2, 16));
    assert!(c.attention_qkv_bias && !c.attention_out_bias && !c.qk_norm);
    assert!(!c.tie_word_embeddings);
    assert_eq!((c.rope_theta, &c.rope_scaling, c.sliding_window), (1e6, &None, None));

    let c = open("qwen3-tiny").config;
    assert_eq!(c.model_type, "qwen3");
    assert_eq!((c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim), (64, 4, 2, 32));
    assert_eq!((c.q_dim(), c.kv_dim()), (128, 64));
    assert!(c.qk_norm && !c.attention_qkv_bias && !c.tie_word_embeddings);
    assert_eq!(c.sliding_window, None);

    let c = open("mistral-tiny").config;
    assert_eq!(c.model_type, "mistral");
    assert_eq!(c.sliding_window, Some(8));
    assert!(!c.attention_qkv_bias && !c.qk_norm && !c.tie_word_embeddings);

    let b = open("llama-tok");
    let c = &b.config;
    assert_eq!((c.vocab_size, c.hidden_size, c.num_hidden_layers, c.head_dim), (49152, 32, 1, 8));
    assert!(c.tie_word_embeddings);
    assert_eq!((c.bos_token_id, &c.eos_token_ids), (Some(1), &vec![2]));
}

#[test]
fn every_fixture_has_the_llama_layout() {
    for name in FIXTURES {
        let b = open(name);
        let dtype = if matches!(*name, "qwen3-tiny" | "llama-tok") { DType::BF16 } else { DType::F32 };
        check_layout(&b, dtype).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(b.tokenizer.is_some(), *name == "llama-tok", "{name}");
    }
}

#[test]
fn views_hold_the_bytes_on_disk() {
    for name in ["llama3-tiny", "llama-tok"] {
        let b = open(name);
        let file = fixture(name).join("model.safetensors");
        let tensors = parse_safetensors_by_hand(&file);
        assert_eq!(tensors.len(), b.weights.tensor_names().len());
        for (tname, dtype, shape, bytes) in tensors {
            let t = b.weights.tensor(&tname).unwrap();
            assert_eq!((t.dtype.name(), t.shape), (dtype.as_str(), shape.as_slice()), "{tname}");
            assert!(t.data == bytes.as_slice(), "{name}: bytes of {tname} differ");
            assert_eq!(b.weights.file_of(&tname), file);
        }
    }
}

#[test]
fn sharded_fixture_maps_each_tensor_to_its_shard() {
    let dir = fixture("qwen3-tiny");
    let b = open("qwen3-tiny");
    let index: Value =
        serde_json::from_str(&fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let shards: BTreeSet<&str> = map.values().map(|v| v.as_str().unwrap()).collect();
    assert!(shards.len() >= 2, "{shards:?}");
    assert_eq!(map.len(), b.weights.tensor_names().len());
    for (name, shard) in map {
        assert_eq!(b.weights.file_of(name), dir.join(shard.as_str().unwrap()), "{name}");
    }
    for shard in shards {
        for (tname, _, _, bytes) in parse_safetensors_by_hand(&dir.join(shard)) {
            assert!(b.weights.tensor(&tname).unwrap().data == bytes.as_slice(), "{tname}");
        }
    }
}

#[derive(serde::Deserialize)]
struct TokCase {
    text: String,
    add_special_tokens: bool,
    ids: Vec<u32>,
    decoded: String,
}

#[test]
fn llama_tok_tokenizer_matches_transformers() {
    let dir = fixture("llama-tok");
    let b = open("llama-tok");
    let t = b.tokenizer.as_ref().expect("llama-tok has a tokenizer");
    let golden: Value = serde_json::from_str(&fs::read_to_string(dir.join("tokenizer_golden.json")).unwrap()).unwrap();
    let cases: Vec<TokCase> = serde_json::from_value(golden["cases"].clone()).unwrap();
    assert!(cases.len() >= 8);
    for c in &cases {
        let ids = t.encode(&c.text, c.add_special_tokens).unwrap();
        assert_eq!(ids, c.ids, "encode({:?}, add_special = {})", c.text, c.add_special_tokens);
        assert_eq!(t.decode(&ids, false).unwrap(), c.decoded, "decode of {:?}", c.text);
    }

    assert_eq!(t.bos_token.as_deref(), golden["bos_token"].as_str());
    assert_eq!(t.eos_token.as_deref(), golden["eos_token"].as_str());
    assert_eq!(t.bos_token_id, Some(1));
    assert!(!t.add_bos_token);
    let eos = golden["eos_token_id"].as_u64().unwrap() as u32;
    assert!(t.is_eos(eos));
    // <|im_end|> from the tokenizer and config, <|endoftext|> from generation_config.json.
    assert_eq!(t.eos_token_ids, vec![0, 2]);
    assert_eq!(b.eos_token_ids(), vec![0, 2]);

    let g = &b.generation;
    assert_eq!(g.eos_token_ids, vec![2, 0]);
    assert_eq!((g.temperature, g.top_p, g.top_k, g.repetition_penalty), (Some(0.2), Some(0.9), Some(50), Some(1.1)));

    // The template transformers saved (chat_template.jinja), rendered independently here, must
    // give transformers' own rendering, and its encoding transformers' ids.
    let template = t.chat_template.as_deref().expect("chat template");
    assert_eq!(template, fs::read_to_string(dir.join("chat_template.jinja")).unwrap());
    let chat = &golden["chat"];
    let mut env = minijinja::Environment::new();
    env.add_template("chat", template).unwrap();
    let rendered = env
        .get_template("chat")
        .unwrap()
        .render(minijinja::context! {
            messages => chat["messages"].clone(),
            add_generation_prompt => chat["add_generation_prompt"].as_bool().unwrap(),
        })
        .unwrap();
    assert_eq!(rendered, chat["rendered"].as_str().unwrap());
    let want: Vec<u32> = serde_json::from_value(chat["ids"].clone()).unwrap();
    assert_eq!(t.encode(&rendered, false).unwrap(), want);
}

fn copy_fixture(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
    }
    tmp
}

/// Rewrite one tensor of a safetensors file with another (same-size) shape.
fn reshape_tensor(file: &Path, tensor: &str, shape: Vec<usize>) {
    use safetensors::tensor::TensorView;
    let bytes = fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<(String, TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            let v = if n == tensor { TensorView::new(v.dtype(), shape.clone(), v.data()).unwrap() } else { v };
            (n, v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, file).unwrap();
}

#[test]
fn broken_config_is_named() {
    let tmp = copy_fixture("llama3-tiny");
    let cfg = tmp.path().join("config.json");
    let text = fs::read_to_string(&cfg).unwrap();
    fs::write(&cfg, &text[..text.len() / 2]).unwrap();
    let (e, s) = open_err(tmp.path());
    assert!(matches!(e, ModelError::Config { ref file, .. } if file == &cfg), "{s}");
    assert!(s.contains("config.json"), "{s}");

    let mut json: Value = serde_json::from_str(&text).unwrap();
    json.as_object_mut().unwrap().remove("hidden_size");
    fs::write(&cfg, json.to_string()).unwrap();
    let (_, s) = open_err(tmp.path());
    assert!(s.contains("config.json") && s.contains("hidden_size"), "{s}");

    json["hidden_size"] = 64.into();
    json["num_key_value_heads"] = 3.into();
    fs::write(&cfg, json.to_string()).unwrap();
    let (_, s) = open_err(tmp.path());
    assert!(s.contains("config.json") && s.contains("num_key_value_heads"), "{s}");
}

#[test]
fn missing_shard_names_index_and_shard() {
    let tmp = copy_fixture("qwen3-tiny");
    let shard = tmp.path().join("model-00002-of-00004.safetensors");
    fs::remove_file(&shard).unwrap();
    let (e, s) = open_err(tmp.path());
    assert!(matches!(e, ModelError::MissingFile { ref path, .. } if path == &shard), "{s}");
    assert!(s.contains("model-00002-of-00004.safetensors") && s.contains("model.safetensors.index.json"), "{s}");
}

#[test]
fn wrong_tensor_shape_names_file_and_tensor() {
    // Single file: k_proj is [kv_dim, hidden] = [32, 64]; store it as [64, 32].
    let tmp = copy_fixture("llama3-tiny");
    let file = tmp.path().join("model.safetensors");
    let tensor = "model.layers.1.self_attn.k_proj.weight";
    reshape_tensor(&file, tensor, vec![64, 32]);
    let b = open_path(tmp.path()).unwrap();
    let e = check_layout(&b, DType::F32).unwrap_err();
    assert!(
        matches!(e, ModelError::ShapeMismatch { file: ref f, tensor: ref t, .. } if f == &file && t == tensor),
        "{e}"
    );
    let s = e.to_string();
    assert!(
        s.contains("model.safetensors") && s.contains(tensor) && s.contains("[64, 32]") && s.contains("[32, 64]"),
        "{s}"
    );

    // Sharded: the message names the shard that holds the tensor, not the directory.
    let tmp = copy_fixture("qwen3-tiny");
    let index: Value =
        serde_json::from_str(&fs::read_to_string(tmp.path().join("model.safetensors.index.json")).unwrap()).unwrap();
    let tensor = "model.layers.1.self_attn.q_norm.weight";
    let shard = tmp.path().join(index["weight_map"][tensor].as_str().unwrap());
    reshape_tensor(&shard, tensor, vec![2, 16]);
    let b = open_path(tmp.path()).unwrap();
    let s = check_layout(&b, DType::BF16).unwrap_err().to_string();
    assert!(s.contains(shard.file_name().unwrap().to_str().unwrap()) && s.contains(tensor), "{s}");
}

#[test]
fn missing_tensor_and_truncated_file_are_named() {
    let tmp = copy_fixture("mistral-tiny");
    let file = tmp.path().join("model.safetensors");
    let bytes = fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let keep: Vec<_> = st.tensors().into_iter().filter(|(n, _)| n != "model.norm.weight").collect();
    safetensors::serialize_to_file(keep, None, &file).unwrap();
    let b = open_path(tmp.path()).unwrap();
    let e = check_layout(&b, DType::F32).unwrap_err();
    assert!(matches!(e, ModelError::MissingTensor { ref tensor, .. } if tensor == "model.norm.weight"), "{e}");
    assert!(e.to_string().contains("model.safetensors"), "{e}");

    fs::write(&file, &bytes[..bytes.len() - 100]).unwrap();
    let (e, s) = open_err(tmp.path());
    assert!(matches!(e, ModelError::Format { file: ref f, .. } if f == &file), "{s}");
}
