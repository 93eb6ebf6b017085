use super::config::*;
use super::file::*;
use super::testutil::*;
use super::types::*;
use super::weights::*;
use crate::config::{LlamaConfig, RopeScaling};
use crate::model::{DType, ModelError, WeightSource};
use std::path::Path;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

fn err_of(r: Result<GgufFile, ModelError>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string(),
    }
}

fn q8_0_block(d: f32, qs: [i8; 32]) -> Vec<u8> {
    let mut v = half::f16::from_f32(d).to_le_bytes().to_vec();
    v.extend(qs.iter().map(|&q| q as u8));
    v
}

#[test]
fn parses_every_value_type_alignment_and_tensors() {
    let dir = tmp();
    let mut b = GgufBuilder::new();
    b.alignment = 64;
    b.raw("general.alignment", 4, 64u32.to_le_bytes().to_vec())
        .raw("t.u8", 0, vec![200])
        .raw("t.i8", 1, vec![0xfe])
        .raw("t.u16", 2, 60000u16.to_le_bytes().to_vec())
        .raw("t.i16", 3, (-3i16).to_le_bytes().to_vec())
        .u32("t.u32", 4_000_000_000)
        .raw("t.i32", 5, (-7i32).to_le_bytes().to_vec())
        .f32("t.f32", 1.5)
        .bool("t.bool", true)
        .str("t.str", "héllo")
        .raw("t.u64", 10, 5_000_000_000u64.to_le_bytes().to_vec())
        .raw("t.i64", 11, (-9i64).to_le_bytes().to_vec())
        .raw("t.f64", 12, 0.25f64.to_le_bytes().to_vec())
        .str_array("t.strs", &["a", "", "ü"])
        .i32_array("t.i32s", &[1, -2, 3]);
    // [[ "x" ], [ "y", "z" ]]: an array of arrays of strings.
    let inner1 = array_payload(8, 1, &str_bytes("x"));
    let inner2 = array_payload(8, 2, &[str_bytes("y"), str_bytes("z")].concat());
    b.raw("t.nested", 9, array_payload(9, 2, &[inner1, inner2].concat()));
    let f32_vals: Vec<f32> = (0..6).map(|x| x as f32).collect();
    b.f32_tensor("a", &[2, 3], &f32_vals);
    let q = [q8_0_block(0.5, [1; 32]), q8_0_block(2.0, [-1; 32])].concat();
    b.tensor("q", &[2, 32], 8, q.clone());
    b.tensor("h", &[3], 1, [1.0f32, 2.0, -0.5].iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect());
    let p = b.write(dir.path(), "all.gguf");

    let g = GgufFile::open(&p).unwrap();
    assert_eq!(g.version(), 3);
    assert_eq!(g.alignment(), 64);
    assert_eq!(g.data_offset() % 64, 0);
    assert_eq!(g.get("t.u8"), Some(&MetaValue::U8(200)));
    assert_eq!(g.get("t.i8"), Some(&MetaValue::I8(-2)));
    assert_eq!(g.get("t.u16"), Some(&MetaValue::U16(60000)));
    assert_eq!(g.get("t.i16"), Some(&MetaValue::I16(-3)));
    assert_eq!(g.get_u32("t.u32").unwrap(), Some(4_000_000_000));
    assert_eq!(g.get_u64("t.u64").unwrap(), Some(5_000_000_000));
    assert!(g.get_u32("t.u64").is_err(), "5e9 must not silently truncate to u32");
    assert!(g.get_u32("t.i32").is_err(), "negative must not convert to u32");
    assert_eq!(g.get("t.i64"), Some(&MetaValue::I64(-9)));
    assert_eq!(g.get_f32("t.f32").unwrap(), Some(1.5));
    assert_eq!(g.get_f32("t.f64").unwrap(), Some(0.25));
    assert_eq!(g.get_bool("t.bool").unwrap(), Some(true));
    assert_eq!(g.get_str("t.str").unwrap(), Some("héllo"));
    assert_eq!(g.get_str("missing").unwrap(), None);
    assert_eq!(g.get_str_array("t.strs").unwrap().unwrap(), ["a", "", "ü"]);
    assert_eq!(g.get_i32_array("t.i32s").unwrap().unwrap(), vec![1, -2, 3]);
    assert_eq!(
        g.get("t.nested"),
        Some(&MetaValue::Array(MetaArray::Array(vec![
            MetaArray::Str(vec!["x".into()]),
            MetaArray::Str(vec!["y".into(), "z".into()]),
        ])))
    );
    let wrong = g.get_str("t.u32").unwrap_err().to_string();
    assert!(wrong.contains("all.gguf") && wrong.contains("t.u32") && wrong.contains("u32"), "{wrong}");
    assert_eq!(g.keys().next(), Some("general.alignment"));

    let a = g.tensor("a").unwrap();
    assert_eq!((a.dtype, a.shape), (DType::F32, &[2usize, 3][..]));
    assert_eq!(a.data, f32_vals.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
    let t = g.tensor("q").unwrap();
    assert_eq!((t.dtype, t.shape, t.data), (DType::Q8_0, &[2usize, 32][..], &q[..]));
    let h = g.tensor("h").unwrap();
    assert_eq!((h.dtype, h.shape, h.data.len()), (DType::F16, &[3usize][..], 6));
    for info in g.tensor_infos() {
        assert_eq!(info.offset % 64, 0, "{}", info.name);
    }
    let missing = g.tensor("nope").unwrap_err().to_string();
    assert!(missing.contains("nope") && missing.contains("all.gguf"), "{missing}");
}

fn small_file() -> GgufBuilder {
    let mut b = GgufBuilder::new();
    b.str("general.architecture", "llama").str_array("names", &["one", "two"]);
    b.f32_tensor("w", &[4, 8], &[0.5; 32]);
    b
}

#[test]
fn every_truncation_is_an_error_naming_the_file() {
    let dir = tmp();
    let full = small_file().bytes();
    for cut in [0, 3, 6, 20, 40, 60, 90, 120, full.len() - 1] {
        let p = dir.path().join(format!("cut{cut}.gguf"));
        std::fs::write(&p, &full[..cut]).unwrap();
        let e = err_of(GgufFile::open(&p));
        assert!(e.contains(&format!("cut{cut}.gguf")) && e.contains("truncated"), "cut {cut}: {e}");
    }
    // Cutting inside the tensor data names the tensor.
    let p = dir.path().join("data.gguf");
    std::fs::write(&p, &full[..full.len() - 4]).unwrap();
    let e = err_of(GgufFile::open(&p));
    assert!(e.contains("tensor `w`") && e.contains("beyond the end"), "{e}");
}

#[test]
fn bad_magic_and_versions_are_named() {
    let dir = tmp();
    let mut bytes = small_file().bytes();
    bytes[..4].copy_from_slice(b"GGML");
    let p = dir.path().join("magic.gguf");
    std::fs::write(&p, &bytes).unwrap();
    let e = err_of(GgufFile::open(&p));
    assert!(e.contains("magic.gguf") && e.contains("not a GGUF file"), "{e}");

    for (v, needle) in [(1u32, "version 1"), (4, "version 4"), (3u32.swap_bytes(), "big-endian")] {
        let mut b = small_file();
        b.version = v;
        let p = b.write(dir.path(), "ver.gguf");
        let e = err_of(GgufFile::open(&p));
        assert!(e.contains("ver.gguf") && e.contains(needle), "{e}");
    }
    let mut b = small_file();
    b.version = 2;
    assert!(GgufFile::open(&b.write(dir.path(), "v2.gguf")).is_ok());
}

#[test]
fn unknown_and_unsupported_tensor_types() {
    let dir = tmp();
    let mut b = GgufBuilder::new();
    b.tensor("weird", &[1, 32], 99, vec![0; 32]);
    let e = err_of(GgufFile::open(&b.write(dir.path(), "unknown.gguf")));
    assert!(e.contains("unknown.gguf") && e.contains("`weird`") && e.contains("99"), "{e}");

    // A known GGML type we cannot compute with: the file opens, the tensor does not.
    let mut b = GgufBuilder::new();
    b.tensor("blk.0.attn_q.weight", &[1, 256], 10, vec![0; 84]);
    let p = b.write(dir.path(), "q2k.gguf");
    let g = GgufFile::open(&p).unwrap();
    let e = g.tensor("blk.0.attn_q.weight").unwrap_err();
    assert!(matches!(e, ModelError::UnsupportedDType { .. }));
    let e = e.to_string();
    assert!(e.contains("q2k.gguf") && e.contains("blk.0.attn_q.weight") && e.contains("Q2_K"), "{e}");
}

#[test]
fn offsets_beyond_eof_misaligned_and_bad_rows_are_rejected() {
    let dir = tmp();
    // Patch the single tensor's relative offset: it follows the name, n_dims, two dims and
    // the type id in the tensor info.
    let bytes = small_file().bytes();
    let needle = [str_bytes("w"), 2u32.to_le_bytes().to_vec()].concat();
    let at = bytes.windows(needle.len()).position(|w| w == needle.as_slice()).unwrap() + needle.len() + 16 + 4;
    for (rel, what) in
        [(1u64 << 20, "beyond the end"), (8, "not a multiple of the alignment"), (u64::MAX - 31, "out of range")]
    {
        let mut patched = bytes.clone();
        patched[at..at + 8].copy_from_slice(&rel.to_le_bytes());
        let p = dir.path().join("off.gguf");
        std::fs::write(&p, &patched).unwrap();
        let e = err_of(GgufFile::open(&p));
        assert!(e.contains("off.gguf") && e.contains("`w`") && e.contains(what), "{rel}: {e}");
    }
    let mut b = GgufBuilder::new();
    b.tensor("ragged", &[2, 31], 8, vec![0; 68]);
    let e = err_of(GgufFile::open(&b.write(dir.path(), "ragged.gguf")));
    assert!(e.contains("`ragged`") && e.contains("block size 32"), "{e}");
}

#[test]
fn maps_names_to_hf() {
    assert_eq!(hf_tensor_name("token_embd.weight").as_deref(), Some("model.embed_tokens.weight"));
    assert_eq!(hf_tensor_name("output_norm.weight").as_deref(), Some("model.norm.weight"));
    assert_eq!(hf_tensor_name("output.weight").as_deref(), Some("lm_head.weight"));
    assert_eq!(hf_tensor_name("blk.12.attn_norm.weight").as_deref(), Some("model.layers.12.input_layernorm.weight"));
    assert_eq!(
        hf_tensor_name("blk.0.ffn_norm.weight").as_deref(),
        Some("model.layers.0.post_attention_layernorm.weight")
    );
    assert_eq!(hf_tensor_name("blk.3.attn_q.bias").as_deref(), Some("model.layers.3.self_attn.q_proj.bias"));
    assert_eq!(hf_tensor_name("blk.3.attn_output.weight").as_deref(), Some("model.layers.3.self_attn.o_proj.weight"));
    assert_eq!(hf_tensor_name("blk.7.ffn_down.weight").as_deref(), Some("model.layers.7.mlp.down_proj.weight"));
    assert_eq!(hf_tensor_name("rope_freqs.weight"), None);
    assert_eq!(hf_tensor_name("blk.x.attn_q.weight"), None);
}

/// A one-layer llama with hidden 8, 2 query heads and 1 kv head of dim 4. Row `r` of every
/// q/k tensor is filled with the value `r` so the served row order is visible.
fn tiny_llama(with_output: bool) -> GgufBuilder {
    let mut b = GgufBuilder::new();
    b.str("general.architecture", "llama")
        .u32("llama.block_count", 1)
        .u32("llama.context_length", 64)
        .u32("llama.embedding_length", 8)
        .u32("llama.feed_forward_length", 16)
        .u32("llama.attention.head_count", 2)
        .u32("llama.attention.head_count_kv", 1)
        .f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .u32("llama.rope.dimension_count", 4)
        .str("llama.rope.scaling.type", "linear")
        .f32("llama.rope.scaling.factor", 2.0)
        .u32("tokenizer.ggml.bos_token_id", 1)
        .u32("tokenizer.ggml.eos_token_id", 2)
        .str("tokenizer.ggml.model", "llama")
        .str_array("tokenizer.ggml.tokens", &["a", "b", "c", "d"]);
    let rows = |n: usize| -> Vec<f32> { (0..n).flat_map(|r| [r as f32; 8]).collect() };
    b.f32_tensor("token_embd.weight", &[4, 8], &[0.0; 32])
        .f32_tensor("output_norm.weight", &[8], &[1.0; 8])
        .f32_tensor("blk.0.attn_norm.weight", &[8], &[1.0; 8])
        .f32_tensor("blk.0.ffn_norm.weight", &[8], &[1.0; 8])
        .f32_tensor("blk.0.attn_q.weight", &[8, 8], &rows(8))
        .f32_tensor("blk.0.attn_q.bias", &[8], &(0..8).map(|r| r as f32).collect::<Vec<_>>())
        .f32_tensor("blk.0.attn_k.weight", &[4, 8], &rows(4))
        .f32_tensor("blk.0.attn_v.weight", &[4, 8], &rows(4))
        .f32_tensor("blk.0.attn_output.weight", &[8, 8], &rows(8))
        .f32_tensor("blk.0.ffn_gate.weight", &[16, 8], &[0.0; 128])
        .f32_tensor("blk.0.ffn_up.weight", &[16, 8], &[0.0; 128])
        .f32_tensor("blk.0.ffn_down.weight", &[8, 16], &[0.0; 128]);
    if with_output {
        b.f32_tensor("output.weight", &[4, 8], &[0.0; 32]);
    }
    b
}

fn row_ids(w: &dyn WeightSource, name: &str, row_len: usize) -> Vec<f32> {
    let t = w.tensor(name).unwrap_or_else(|| panic!("{name} missing"));
    t.data.chunks_exact(4 * row_len).map(|r| f32::from_le_bytes([r[0], r[1], r[2], r[3]])).collect()
}

#[test]
fn opens_tiny_llama_with_hf_names_and_unpermuted_qk() {
    let dir = tmp();
    let p = tiny_llama(false).write(dir.path(), "tiny.gguf");
    let m = open_file(&p).unwrap();
    let c = &m.config;
    assert_eq!((c.hidden_size, c.intermediate_size, c.num_hidden_layers), (8, 16, 1));
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (2, 1, 4));
    assert_eq!((c.vocab_size, c.max_position_embeddings), (4, 64));
    assert_eq!(c.rope_theta, 10000.0);
    assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 2.0 }));
    assert!(c.tie_word_embeddings && c.attention_qkv_bias && !c.attention_out_bias && !c.mlp_bias);
    assert_eq!((c.bos_token_id, c.eos_token_ids.clone()), (Some(1), vec![2]));
    assert_eq!(m.generation.eos_token_ids, vec![2]);
    assert!(m.tokenizer.is_none(), "a `llama` (sentencepiece) vocabulary is not built");
    assert!(m.weights.tensor("lm_head.weight").is_none());
    assert!(m.weights.tensor_names().contains(&"model.layers.0.mlp.down_proj.weight".to_string()));

    // llama.cpp stores head h's rows as [h0, h2, h1, h3] (pairs interleaved); HF order is
    // [h0, h1, h2, h3]. Written by hand from the converter's reshape/swapaxes.
    assert_eq!(row_ids(&*m.weights, "model.layers.0.self_attn.q_proj.weight", 8), [0., 2., 1., 3., 4., 6., 5., 7.]);
    assert_eq!(row_ids(&*m.weights, "model.layers.0.self_attn.q_proj.bias", 1), [0., 2., 1., 3., 4., 6., 5., 7.]);
    assert_eq!(row_ids(&*m.weights, "model.layers.0.self_attn.k_proj.weight", 8), [0., 2., 1., 3.]);
    // Everything else is served as stored.
    assert_eq!(row_ids(&*m.weights, "model.layers.0.self_attn.v_proj.weight", 8), [0., 1., 2., 3.]);
    assert_eq!(row_ids(&*m.weights, "model.layers.0.self_attn.o_proj.weight", 8), [0., 1., 2., 3., 4., 5., 6., 7.]);
    let q = m.weights.expect("model.layers.0.self_attn.q_proj.weight", &[8, 8]).unwrap();
    assert_eq!(q.dtype, DType::F32);

    let p = tiny_llama(true).write(dir.path(), "untied.gguf");
    let m = open_file(&p).unwrap();
    assert!(!m.config.tie_word_embeddings);
    assert_eq!(m.weights.tensor("lm_head.weight").map(|t| t.shape.to_vec()), Some(vec![4, 8]));
}

#[test]
fn quantized_qk_rows_move_whole() {
    // Two heads of dim 4, Q8_0 rows of 32: each row is one block whose scale encodes its row.
    let rows: Vec<u8> = (0..8).flat_map(|r| q8_0_block(r as f32, [1; 32])).collect();
    let out = unpermute_qk_rows(&rows, 8, 2);
    let scales: Vec<f32> = out.chunks_exact(34).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
    assert_eq!(scales, [0., 2., 1., 3., 4., 6., 5., 7.]);
}

#[test]
fn wrong_architecture_and_unsupported_weight_type_are_named() {
    let dir = tmp();
    let mut b = tiny_llama(false);
    b.str("general.architecture", "gemma"); // duplicate key: rejected first
    let e = open_file(&b.write(dir.path(), "dup.gguf")).err().expect("duplicate key").to_string();
    assert!(e.contains("duplicate metadata key `general.architecture`"), "{e}");

    let mut b = GgufBuilder::new();
    b.str("general.architecture", "gemma");
    let e = open_file(&b.write(dir.path(), "gemma.gguf")).err().expect("gemma");
    assert!(matches!(e, ModelError::UnsupportedArchitecture { ref arch, .. } if arch == "gemma"), "{e}");
    assert!(e.to_string().contains("gemma.gguf"));

    let mut b = tiny_llama(false);
    b.tensor("output.weight", &[4, 256], 11, vec![0; 4 * 110]);
    let e = open_file(&b.write(dir.path(), "q3k.gguf")).err().expect("Q3_K output");
    assert!(matches!(e, ModelError::UnsupportedDType { .. }), "{e}");
    let e = e.to_string();
    assert!(e.contains("q3k.gguf") && e.contains("output.weight") && e.contains("Q3_K"), "{e}");
}

#[test]
fn llama3_rope_freqs_are_recognised() {
    let dir = tmp();
    let mut b = tiny_llama(false);
    let cfg = LlamaConfig {
        model_type: "llama".into(),
        vocab_size: 4,
        hidden_size: 8,
        intermediate_size: 16,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 4,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        max_position_embeddings: 64,
        tie_word_embeddings: true,
        attention_qkv_bias: false,
        attention_out_bias: false,
        mlp_bias: false,
        qk_norm: false,
        sliding_window: None,
        rope_ggml_style: true,
        bos_token_id: None,
        eos_token_ids: vec![],
    };
    // Metadata scaling and a rope_freqs tensor at once is ambiguous: refused.
    b.f32_tensor("rope_freqs.weight", &[2], &[1.0, 8.0]);
    let e = open_file(&b.write(dir.path(), "both.gguf")).err().expect("conflict").to_string();
    assert!(e.contains("rope_freqs.weight"), "{e}");

    let base = LlamaConfig { rope_theta: 500000.0, head_dim: 128, ..cfg };
    let wanted = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let plain = base.rope_inv_freq();
    let scaled = LlamaConfig { rope_scaling: Some(wanted.clone()), ..base.clone() }.rope_inv_freq();
    let divisors: Vec<f32> = plain.iter().zip(&scaled).map(|(p, s)| p / s).collect();
    assert!(divisors.contains(&1.0) && divisors.iter().any(|&d| (d - 8.0).abs() < 1e-4));
    let mut b = GgufBuilder::new();
    b.str("general.architecture", "llama")
        .u32("llama.block_count", 1)
        .u32("llama.embedding_length", 256)
        .u32("llama.feed_forward_length", 16)
        .u32("llama.attention.head_count", 2)
        .f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .f32("llama.rope.freq_base", 500000.0)
        .u32("llama.vocab_size", 4)
        .f32_tensor("rope_freqs.weight", &[64], &divisors);
    let m = open_file(&b.write(dir.path(), "l3.gguf")).unwrap();
    assert_eq!(m.config.rope_scaling, Some(wanted));
    assert_eq!(m.config.head_dim, 128);

    let mut bad = divisors.clone();
    bad[63] = 3.0;
    let mut b2 = GgufBuilder::new();
    b2.str("general.architecture", "llama")
        .u32("llama.block_count", 1)
        .u32("llama.embedding_length", 256)
        .u32("llama.feed_forward_length", 16)
        .u32("llama.attention.head_count", 2)
        .f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        .f32("llama.rope.freq_base", 500000.0)
        .u32("llama.vocab_size", 4)
        .f32_tensor("rope_freqs.weight", &[64], &bad);
    let e = open_file(&b2.write(dir.path(), "l3bad.gguf")).err().expect("mismatch").to_string();
    assert!(e.contains("l3bad.gguf") && e.contains("does not match"), "{e}");
}

/// The real SmolLM2 GGUF: config values, and un-permuted q/k rows against the reference
/// written by `scripts/gen_gguf_golden.py` (gguf-python dequantisation + transformers'
/// own reverse permutation).
#[test]
fn smollm2_config_and_unpermuted_rows_match_reference() {
    let Some(path) = std::env::var_os("SHELFSERVE_DEFAULT_GGUF") else {
        eprintln!("skipped: SHELFSERVE_DEFAULT_GGUF is not set (path to SmolLM2-135M-Instruct.Q4_1.gguf)");
        return;
    };
    let m = open_file(Path::new(&path)).unwrap();
    let c = &m.config;
    assert_eq!((c.hidden_size, c.intermediate_size, c.num_hidden_layers), (576, 1536, 30));
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (9, 3, 64));
    assert_eq!((c.vocab_size, c.max_position_embeddings), (49152, 8192));
    assert_eq!((c.rope_theta, c.rope_scaling.clone()), (100000.0, None));
    assert!((c.rms_norm_eps - 1e-5).abs() < 1e-9);
    assert!(c.tie_word_embeddings && !c.attention_qkv_bias && !c.mlp_bias);
    assert_eq!((c.bos_token_id, c.eos_token_ids.clone()), (Some(1), vec![2]));
    let tok = m.tokenizer.as_ref().expect("gpt2 tokenizer");
    assert!(tok.eos_token_ids.contains(&2));

    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/smollm2_qk_rows.json");
    let text = std::fs::read_to_string(&fixture).unwrap_or_else(|e| panic!("{}: {e}", fixture.display()));
    let fx: serde_json::Value = serde_json::from_str(&text).expect("fixture json");
    let cases = fx["cases"].as_array().expect("cases");
    assert!(cases.len() >= 4);
    for case in cases {
        let name = case["hf_name"].as_str().unwrap();
        let t = m.weights.tensor(name).unwrap_or_else(|| panic!("{name}"));
        let shape: Vec<usize> =
            case["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
        assert_eq!(t.shape, shape.as_slice(), "{name}");
        assert_eq!(t.dtype.name(), case["dtype"].as_str().unwrap(), "{name}");
        let values = crate::model::tensor::to_f32(&t);
        let cols = shape[1];
        for row in case["rows"].as_array().unwrap() {
            let r = row["row"].as_u64().unwrap() as usize;
            let got = &values[r * cols..(r + 1) * cols];
            let head: Vec<f64> = row["first"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
            for (k, &want) in head.iter().enumerate() {
                assert!(
                    (got[k] as f64 - want).abs() <= 1e-6 * want.abs().max(1e-3),
                    "{name} row {r} col {k}: {} vs {want}",
                    got[k]
                );
            }
            let sum: f64 = got.iter().map(|&x| x as f64).sum();
            let want_sum = row["sum"].as_f64().unwrap();
            assert!(
                (sum - want_sum).abs() <= 1e-4 * want_sum.abs().max(1.0),
                "{name} row {r}: sum {sum} vs {want_sum}"
            );
        }
    }
}
