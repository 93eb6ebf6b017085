//! `LlamaConfig` from GGUF metadata (`llama.*` keys, RoPE scaling) and opening a `llama` GGUF
//! as a [`ModelBundle`].

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use super::file::GgufFile;
use super::types::{GgmlType, MetaArray};
use super::weights::{hf_tensor_name, GgufWeights, Served};
use crate::config::{LlamaConfig, RopeScaling};
use crate::model::{GenerationDefaults, ModelBundle, ModelError};

const ARCH: &str = "llama";

fn config_err(g: &GgufFile, msg: String) -> ModelError {
    ModelError::Config { file: g.path().to_path_buf(), msg }
}

/// RoPE scaling from metadata, or from a `rope_freqs.weight` tensor (how llama.cpp's converter
/// stores Llama 3.x scaling: per-frequency divisors, with no parameters in the metadata).
fn rope_scaling(g: &GgufFile, base: &LlamaConfig) -> Result<Option<RopeScaling>, ModelError> {
    let mut scaling = match g.get_str("llama.rope.scaling.type")? {
        None | Some("none") => None,
        Some("linear") => {
            let factor = g.require_f32("llama.rope.scaling.factor")?;
            Some(RopeScaling::Linear { factor })
        }
        Some(other) => {
            return Err(config_err(
                g,
                format!("unsupported llama.rope.scaling.type `{other}` (supported: none, linear)"),
            ))
        }
    };
    if scaling.is_none() {
        // Older converters wrote a bare linear factor.
        if let Some(f) = g.get_f32("llama.rope.scale_linear")? {
            if f != 1.0 {
                scaling = Some(RopeScaling::Linear { factor: f });
            }
        }
    }
    let Some(info) = g.tensor_info("rope_freqs.weight") else { return Ok(scaling) };
    if scaling.is_some() {
        return Err(config_err(g, "both rope scaling metadata and rope_freqs.weight are present".into()));
    }
    let half = base.head_dim / 2;
    if info.ggml_type != GgmlType(0) || info.shape != [half] {
        return Err(config_err(
            g,
            format!("rope_freqs.weight must be F32 [{half}], found {} {:?}", info.ggml_type.name(), info.shape),
        ));
    }
    let divisors: Vec<f32> =
        g.tensor_bytes(info).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let factor = divisors.iter().copied().fold(1.0f32, f32::max);
    if factor == 1.0 {
        return Ok(None);
    }
    // Only Llama 3.x produces these, with low/high frequency factors 1 and 4; accept the
    // tensor when it matches that formula, else refuse rather than run with wrong positions.
    let original = g.get_u32("llama.rope.scaling.original_context_length")?.unwrap_or(8192) as usize;
    let candidate = RopeScaling::Llama3 {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: original,
    };
    let plain = LlamaConfig { rope_scaling: None, ..base.clone() }.rope_inv_freq();
    let scaled = LlamaConfig { rope_scaling: Some(candidate.clone()), ..base.clone() }.rope_inv_freq();
    let matches = plain.iter().zip(&scaled).zip(&divisors).all(|((p, s), d)| ((p / s) - d).abs() <= 1e-3 * d.abs());
    if !matches {
        return Err(config_err(
            g,
            format!("rope_freqs.weight does not match Llama 3 rope scaling (factor {factor}); not supported"),
        ));
    }
    Ok(Some(candidate))
}

fn llama_config(g: &GgufFile) -> Result<LlamaConfig, ModelError> {
    let key = |k: &str| format!("{ARCH}.{k}");
    let req = |k: &str| g.require_u32(&key(k)).map(|x| x as usize);
    let hidden_size = req("embedding_length")?;
    let num_attention_heads = req("attention.head_count")?;
    let num_key_value_heads = g.get_u32(&key("attention.head_count_kv"))?.map_or(num_attention_heads, |x| x as usize);
    let rope_dims = g.get_u32(&key("rope.dimension_count"))?.map(|x| x as usize);
    let head_dim = match g.get_u32(&key("attention.key_length"))? {
        Some(k) => k as usize,
        None => rope_dims.unwrap_or(hidden_size / num_attention_heads.max(1)),
    };
    if let Some(rd) = rope_dims {
        if rd != head_dim {
            return Err(config_err(g, format!("partial rotary embedding ({rd} of {head_dim} dims) is not supported")));
        }
    }
    if let Some(v) = g.get_u32(&key("attention.value_length"))? {
        if v as usize != head_dim {
            return Err(config_err(g, format!("value head size {v} differs from key head size {head_dim}")));
        }
    }
    let tokens_len = g.get_array("tokenizer.ggml.tokens")?.map(MetaArray::len);
    let vocab_size = match g.get_u32(&key("vocab_size"))? {
        Some(v) => v as usize,
        None => tokens_len
            .or_else(|| g.tensor_info("token_embd.weight").map(|t| t.shape[0]))
            .ok_or_else(|| config_err(g, "no llama.vocab_size, token list or token_embd.weight".into()))?,
    };
    let has = |n: &str| g.tensor_info(n).is_some();
    let eos = g.get_u32("tokenizer.ggml.eos_token_id")?;
    let mut cfg = LlamaConfig {
        model_type: ARCH.to_string(),
        vocab_size,
        hidden_size,
        intermediate_size: req("feed_forward_length")?,
        num_hidden_layers: req("block_count")?,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps: g.require_f32(&key("attention.layer_norm_rms_epsilon"))?,
        rope_theta: g.get_f32(&key("rope.freq_base"))?.unwrap_or(10000.0),
        rope_scaling: None,
        max_position_embeddings: g.get_u32(&key("context_length"))?.map_or(4096, |x| x as usize),
        tie_word_embeddings: !has("output.weight"),
        attention_qkv_bias: has("blk.0.attn_q.bias"),
        attention_out_bias: has("blk.0.attn_output.bias"),
        mlp_bias: has("blk.0.ffn_gate.bias") || has("blk.0.ffn_up.bias"),
        qk_norm: false,
        sliding_window: None,
        // llama.cpp is the reference for GGUF files: follow its RoPE arithmetic bit for bit.
        rope_ggml_style: true,
        bos_token_id: g.get_u32("tokenizer.ggml.bos_token_id")?,
        eos_token_ids: eos.into_iter().collect(),
    };
    cfg.rope_scaling = rope_scaling(g, &cfg)?;
    cfg.validate(g.path())?;
    Ok(cfg)
}

/// Open a `llama`-architecture GGUF file: config from `llama.*` metadata, weights under HF
/// names (q/k rows un-permuted), and the tokenizer when it is a gpt2-style BPE vocabulary.
pub fn open_file(path: &Path) -> Result<ModelBundle, ModelError> {
    let g = GgufFile::open(path)?;
    let arch = g.require_str("general.architecture")?;
    if arch != ARCH {
        return Err(ModelError::UnsupportedArchitecture { file: path.to_path_buf(), arch: arch.to_string() });
    }
    let config = llama_config(&g)?;

    let mut by_hf = HashMap::new();
    for (index, info) in g.tensor_infos().iter().enumerate() {
        let Some(hf) = hf_tensor_name(&info.name) else {
            if info.name != "rope_freqs.weight" {
                tracing::debug!(tensor = %info.name, file = %path.display(), "ignoring GGUF tensor the llama model does not use");
            }
            continue;
        };
        let dtype = g.dtype_of(info)?;
        let unpermute = if info.name.contains(".attn_q.") {
            Some(config.num_attention_heads)
        } else if info.name.contains(".attn_k.") {
            Some(config.num_key_value_heads)
        } else {
            None
        };
        if let Some(n_head) = unpermute {
            // Validate here so the lazy un-permutation in `tensor()` cannot fail.
            let rows = info.shape[0];
            let whole_rows = info.shape.len() > 1 || !dtype.is_quantized();
            if rows % n_head != 0 || (rows / n_head) % 2 != 0 || !whole_rows {
                return Err(ModelError::Format {
                    file: path.to_path_buf(),
                    msg: format!(
                        "tensor `{}` with shape {:?} ({dtype}) cannot be split into {n_head} heads of even size",
                        info.name, info.shape
                    ),
                });
            }
        }
        by_hf.insert(hf, Served { index, dtype, unpermute, owned: OnceLock::new() });
    }

    let tokenizer = match g.get_str("tokenizer.ggml.model")? {
        Some("gpt2") => Some(crate::tokenizer::gguf_vocab::tokenizer_from_gguf(&g, path)?),
        other => {
            tracing::warn!(
                file = %path.display(),
                tokenizer = other.unwrap_or("(none)"),
                "GGUF tokenizer type not supported (only gpt2-style BPE); the model is usable with token ids only"
            );
            None
        }
    };
    let generation = GenerationDefaults { eos_token_ids: config.eos_token_ids.clone(), ..Default::default() };
    let name = path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
    Ok(ModelBundle { name, config, weights: Box::new(GgufWeights { file: g, by_hf }), tokenizer, generation })
}
