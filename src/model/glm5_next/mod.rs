//! GLM-5.3-Flash (`glm5_next`): the architecture description every backend reads — config,
//! weight names, shapes and stacking (generic over how a device holds a projection), the cache
//! record and state-slot layout, and the cost/memory accounting — matching transformers'
//! `Glm5NextForConditionalGeneration` text model (reference for every formula: `docs`' spec of
//! the architecture and transformers' `modeling_glm5_next.py`).
//!
//! Structure of one decoder layer: 4 mHC residual streams → collapse → RMSNorm → mixer (KDA linear
//! attention, or NoPE MLA with the DSA indexer) → expand; again for the FFN (dense SwiGLU or MoE).
//! The final hidden state is the streams' mean, RMS-normalised, then `lm_head`.
//!
//! Owns the description only: the compute lives in the backends (`backend::cpu::glm5_next`,
//! `backend::cuda::glm5_next`), and nothing here imports `backend`. Never decides which blocks,
//! slots or sequences (the scheduler and KV pool do). The vision tower is described in
//! [`vision`] (its tensors are loaded apart from the text model's); the MTP layer is not run.

pub mod accounting;
pub mod cache_layout;
pub mod config;
pub mod layout;
pub mod shard;
pub mod vision;
pub mod weights;

use std::path::Path;

pub use self::config::Glm5Config;
use crate::config::LlamaConfig;
use crate::model::hf;
use crate::model::{ModelBundle, ModelError};

/// The HF `model_type` values this module serves.
pub const MODEL_TYPES: [&str; 2] = ["glm5_next", "glm5_next_text"];

/// Whether `dir/config.json` declares a `glm5_next` model.
pub fn is_glm5_dir(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join(hf::CONFIG_FILE))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v.get("model_type").and_then(|m| m.as_str()).map(|m| MODEL_TYPES.contains(&m)))
        .unwrap_or(false)
}

/// Read `dir/config.json` as a `glm5_next` config.
pub fn read_config(dir: &Path) -> Result<Glm5Config, ModelError> {
    let path = dir.join(hf::CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    Glm5Config::from_hf_json(&text, &path)
}

/// The llama-shaped summary the serving layers read (vocab, context, special ids); the model
/// itself is described by [`Glm5Config`], re-read from the directory by the backend.
fn summary(c: &Glm5Config) -> LlamaConfig {
    LlamaConfig {
        model_type: MODEL_TYPES[0].into(),
        vocab_size: c.vocab_size,
        hidden_size: c.hidden_size,
        intermediate_size: c.intermediate_size,
        num_hidden_layers: c.num_hidden_layers,
        num_attention_heads: c.num_attention_heads,
        num_key_value_heads: c.num_attention_heads,
        head_dim: c.qk_nope_head_dim,
        rms_norm_eps: c.rms_norm_eps,
        rope_theta: 0.0,
        rope_scaling: None,
        max_position_embeddings: c.max_position_embeddings,
        tie_word_embeddings: c.tie_word_embeddings,
        attention_qkv_bias: false,
        attention_out_bias: false,
        mlp_bias: false,
        qk_norm: false,
        sliding_window: None,
        rope_ggml_style: false,
        bos_token_id: c.bos_token_id,
        eos_token_ids: c.eos_token_ids.clone(),
    }
}

/// Open a `glm5_next` HF directory: config, memory-mapped weights, tokenizer, generation config.
pub fn open_dir(dir: &Path) -> Result<ModelBundle, ModelError> {
    let cfg = read_config(dir)?;
    let config = summary(&cfg);
    let weights = hf::open_weights_checked(dir)?;
    let generation = hf::read_generation_config(dir)?;
    let tokenizer = hf::load_tokenizer(dir, &config, &generation)?;
    tracing::info!(dir = %dir.display(), layers = cfg.num_hidden_layers, tensors = weights.len(), "opened glm5_next model");
    let name = dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| dir.display().to_string());
    Ok(ModelBundle { name, config, weights: Box::new(weights), tokenizer, generation })
}
