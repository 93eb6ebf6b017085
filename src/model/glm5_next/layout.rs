//! Every text tensor a `glm5_next` checkpoint holds for a config, under the on-disk names
//! `save_pretrained` writes (spec Appendix A), and seeded random weights with those names for
//! benchmarks and invariance tests at sizes no fixture ships.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::config::{FfnKind, Glm5Config, MixerKind};
use super::weights::TEXT_PREFIX;
use crate::model::{DType, OwnedTensor, TensorView, WeightSource};

/// How a tensor is initialised by [`SyntheticGlm5Weights`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Uniform in ±1/√(last dim).
    FanIn,
    /// 1 ± 0.1 (norm weights, mHC scales).
    One,
    /// ± the given amplitude.
    Small(f32),
}

/// `(name, shape, init)` of every text tensor, on-disk names.
pub fn text_tensors(c: &Glm5Config) -> Vec<(String, Vec<usize>, Init)> {
    let d = c.hidden_size;
    let p = TEXT_PREFIX;
    let mut v = vec![(format!("{p}embed_tokens.weight"), vec![c.vocab_size, d], Init::Small(1.0))];
    let (q, hd, lh) = (c.linear_qkv_dim(), c.linear_head_dim, c.linear_num_heads);
    for l in 0..c.num_hidden_layers {
        let lp = format!("{p}layers.{l}.");
        let mut t = |n: &str, shape: Vec<usize>, init: Init| v.push((format!("{lp}{n}"), shape, init));
        let m = c.hc_mult;
        for site in ["attn", "ffn"] {
            t(&format!("hc_{site}_fn"), vec![(2 + m) * m, m * d], Init::FanIn);
            t(&format!("hc_{site}_base"), vec![(2 + m) * m], Init::Small(0.5));
            t(&format!("hc_{site}_scale"), vec![3], Init::One);
        }
        t("input_layernorm.weight", vec![d], Init::One);
        t("post_attention_layernorm.weight", vec![d], Init::One);
        match c.layer_types[l] {
            MixerKind::Kda => {
                for n in ["q", "k", "v"] {
                    t(&format!("self_attn.{n}_proj.weight"), vec![q, d], Init::FanIn);
                    t(&format!("self_attn.{n}_conv1d.weight"), vec![q, 1, c.linear_conv_kernel_dim], Init::FanIn);
                }
                t("self_attn.f_a_proj.weight", vec![hd, d], Init::FanIn);
                t("self_attn.f_b_proj.weight", vec![q, hd], Init::FanIn);
                t("self_attn.dt_bias", vec![q], Init::Small(0.5));
                t("self_attn.A_log", vec![lh], Init::Small(0.5));
                t("self_attn.b_proj.weight", vec![lh, d], Init::FanIn);
                t("self_attn.g_a_proj.weight", vec![hd, d], Init::FanIn);
                t("self_attn.g_b_proj.weight", vec![q, hd], Init::FanIn);
                t("self_attn.o_norm.weight", vec![hd], Init::One);
                t("self_attn.o_proj.weight", vec![d, q], Init::FanIn);
            }
            MixerKind::Dsa => {
                let h = c.num_attention_heads;
                t("self_attn.q_a_proj.weight", vec![c.q_lora_rank, d], Init::FanIn);
                t("self_attn.q_a_layernorm.weight", vec![c.q_lora_rank], Init::One);
                t("self_attn.q_b_proj.weight", vec![h * c.qk_nope_head_dim, c.q_lora_rank], Init::FanIn);
                t("self_attn.kv_a_proj_with_mqa.weight", vec![c.kv_lora_rank, d], Init::FanIn);
                t("self_attn.kv_a_layernorm.weight", vec![c.kv_lora_rank], Init::One);
                let kvb = h * (c.qk_nope_head_dim + c.v_head_dim);
                t("self_attn.kv_b_proj.weight", vec![kvb, c.kv_lora_rank], Init::FanIn);
                t("self_attn.o_proj.weight", vec![d, h * c.v_head_dim], Init::FanIn);
                if c.has_indexer(l) {
                    let (hi, di) = (c.index_n_heads, c.index_head_dim);
                    t("self_attn.indexer.wq_b.weight", vec![hi * di, c.q_lora_rank], Init::FanIn);
                    t("self_attn.indexer.wk.weight", vec![di, d], Init::FanIn);
                    t("self_attn.indexer.k_norm.weight", vec![di], Init::One);
                    t("self_attn.indexer.k_norm.bias", vec![di], Init::Small(0.1));
                    t("self_attn.indexer.weights_proj.weight", vec![hi, d], Init::FanIn);
                    t("self_attn.indexer.index_kpool_compress_ape", vec![c.index_kpool, di], Init::Small(0.5));
                    t("self_attn.indexer.index_kpool_compress_gate", vec![di, d], Init::FanIn);
                }
            }
        }
        let mlp = |t: &mut dyn FnMut(&str, Vec<usize>, Init), pre: &str, inter: usize| {
            t(&format!("{pre}gate_proj.weight"), vec![inter, d], Init::FanIn);
            t(&format!("{pre}up_proj.weight"), vec![inter, d], Init::FanIn);
            t(&format!("{pre}down_proj.weight"), vec![d, inter], Init::FanIn);
        };
        match c.mlp_layer_types[l] {
            FfnKind::Dense => mlp(&mut t, "mlp.", c.intermediate_size),
            FfnKind::Moe => {
                t("mlp.gate.weight", vec![c.n_routed_experts, d], Init::FanIn);
                t("mlp.gate.e_score_correction_bias", vec![c.n_routed_experts], Init::Small(0.05));
                for e in 0..c.n_routed_experts {
                    mlp(&mut t, &format!("mlp.experts.{e}."), c.moe_intermediate_size);
                }
                mlp(&mut t, "mlp.shared_experts.", c.moe_intermediate_size * c.n_shared_experts);
            }
        }
    }
    v.push((format!("{p}norm.weight"), vec![d], Init::One));
    if !c.tie_word_embeddings {
        v.push(("lm_head.weight".into(), vec![c.vocab_size, d], Init::FanIn));
    }
    v
}

/// Seeded random f32 weights for every text tensor of a config.
pub struct SyntheticGlm5Weights {
    origin: PathBuf,
    tensors: HashMap<String, OwnedTensor>,
}

impl SyntheticGlm5Weights {
    pub fn new(c: &Glm5Config, seed: u64) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let tensors = text_tensors(c)
            .into_iter()
            .map(|(name, shape, init)| {
                let n: usize = shape.iter().product();
                let (center, amp) = match init {
                    Init::FanIn => (0.0, 1.0 / (*shape.last().unwrap_or(&1) as f32).sqrt()),
                    Init::One => (1.0, 0.1),
                    Init::Small(a) => (0.0, a),
                };
                let data =
                    (0..n).flat_map(|_| (center + amp * (rng.random::<f32>() * 2.0 - 1.0)).to_le_bytes()).collect();
                (name, OwnedTensor { dtype: DType::F32, shape, data })
            })
            .collect();
        SyntheticGlm5Weights { origin: PathBuf::from("<synthetic glm5_next>"), tensors }
    }
}

impl WeightSource for SyntheticGlm5Weights {
    fn origin(&self) -> &Path {
        &self.origin
    }

    fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.tensors.get(name).map(OwnedTensor::view)
    }

    fn tensor_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.tensors.keys().cloned().collect();
        v.sort_unstable();
        v
    }
}
