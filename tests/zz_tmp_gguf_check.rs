use std::path::Path;
use shelfserve::model::gguf::open_file;
use shelfserve::model::WeightSource;
use shelfserve::config::RopeScaling;
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
            let values = shelfserve::model::tensor::to_f32(&t);
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
