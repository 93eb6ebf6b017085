//! Seeded random weights for any llama-family config, held in memory: for benchmarks (the same
//! shapes as a real checkpoint without shipping one) and for tests of backend invariants.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::llama::LlamaSpec;
use super::quant::quantize_weight;
use super::{DType, OwnedTensor, TensorView, WeightSource};
use crate::config::LlamaConfig;

/// In-memory weights named like an HF checkpoint.
pub struct SyntheticWeights {
    origin: PathBuf,
    tensors: HashMap<String, OwnedTensor>,
}

fn encode(dtype: DType, values: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        DType::BF16 => values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
        q => quantize_weight(q, values),
    }
}

impl SyntheticWeights {
    /// Matrices get `matrix_dtype` (F32/F16/BF16/Q8_0/Q4_0/Q4_1, or Q4_K/Q5_K/Q6_K when every
    /// matrix width is a multiple of 256) with values uniform in
    /// ±1/√fan_in; norms are 1 ± 0.1, biases ±0.1. Same seed, same weights.
    pub fn new(cfg: &LlamaConfig, matrix_dtype: DType, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut tensors = HashMap::new();
        let mut put = |name: String, shape: Vec<usize>, dtype: DType, rng: &mut ChaCha8Rng, center: f32, scale: f32| {
            let n: usize = shape.iter().product();
            let vals: Vec<f32> = (0..n).map(|_| center + scale * (rng.random::<f32>() * 2.0 - 1.0)).collect();
            tensors.insert(name, OwnedTensor { dtype, data: encode(dtype, &vals), shape });
        };
        let spec = LlamaSpec::new(cfg);
        let h = cfg.hidden_size;
        put(spec.embed.clone(), vec![cfg.vocab_size, h], matrix_dtype, &mut rng, 0.0, 1.0);
        for l in &spec.layers {
            for lin in [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down] {
                put(lin.weight(), vec![lin.out, lin.inp], matrix_dtype, &mut rng, 0.0, 1.0 / (lin.inp as f32).sqrt());
                if lin.bias {
                    put(lin.bias_name(), vec![lin.out], DType::F32, &mut rng, 0.0, 0.1);
                }
            }
            for norm in [&l.input_norm, &l.post_attention_norm] {
                put(norm.clone(), vec![h], DType::F32, &mut rng, 1.0, 0.1);
            }
            for norm in [&l.q_norm, &l.k_norm].into_iter().flatten() {
                put(norm.clone(), vec![cfg.head_dim], DType::F32, &mut rng, 1.0, 0.1);
            }
        }
        put(spec.final_norm.clone(), vec![h], DType::F32, &mut rng, 1.0, 0.1);
        if !cfg.tie_word_embeddings {
            put(spec.lm_head.weight(), vec![cfg.vocab_size, h], matrix_dtype, &mut rng, 0.0, 1.0 / (h as f32).sqrt());
        }
        SyntheticWeights { origin: PathBuf::from(format!("<synthetic seed {seed}>")), tensors }
    }
}

impl WeightSource for SyntheticWeights {
    fn origin(&self) -> &Path {
        &self.origin
    }

    fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.tensors.get(name).map(OwnedTensor::view)
    }

    fn tensor_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.tensors.keys().cloned().collect();
        v.sort();
        v
    }
}

/// A small llama config for tests and benches.
pub fn tiny_llama_config() -> LlamaConfig {
    LlamaConfig {
        model_type: "llama".into(),
        vocab_size: 256,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 16,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        max_position_embeddings: 2048,
        tie_word_embeddings: false,
        attention_qkv_bias: false,
        attention_out_bias: false,
        mlp_bias: false,
        qk_norm: false,
        sliding_window: None,
        rope_ggml_style: false,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    }
}
