//! Model configuration: the `llama` family hyper-parameters, read from an HF `config.json` or
//! (by the GGUF reader) from GGUF metadata; the serving configuration (`engine`) and the
//! precedence of its sources (`layers`: flag > environment > file > model family > device).
//! Owns parsing, defaults and validation only; it knows nothing about weights or device memory.

pub mod engine;
pub mod layers;

use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

use crate::model::ModelError;

/// RoPE frequency scaling variants we implement.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.x "llama3" scaling (wavelength-dependent interpolation).
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_max_position_embeddings: usize },
    /// Position interpolation: positions divided by `factor`.
    Linear { factor: f32 },
}

/// Hyper-parameters of one `llama`-family model (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// The HF `model_type` (or GGUF architecture) it was read from, for messages.
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v projections (Qwen2, some Llama variants).
    pub attention_qkv_bias: bool,
    /// Bias on the attention output projection (Llama `attention_bias = true`).
    pub attention_out_bias: bool,
    /// Bias on gate/up/down projections.
    pub mlp_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Mistral-style sliding attention window (keys older than this many positions are masked).
    pub sliding_window: Option<usize>,
    /// Compute RoPE angles and rotations the way GGML does (f32 angle recurrence, fused
    /// multiply-adds) rather than HF's `pos · inv_freq`; the two differ in the last bits, which a
    /// quantized model amplifies. Set by the GGUF reader so GGUF models reproduce llama.cpp.
    pub rope_ggml_style: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

#[derive(Deserialize)]
struct HfRaw {
    model_type: Option<String>,
    architectures: Option<Vec<String>>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f32>,
    rope_theta: Option<f32>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    sliding_window: Option<Value>,
    use_sliding_window: Option<bool>,
    hidden_act: Option<String>,
    bos_token_id: Option<Value>,
    eos_token_id: Option<Value>,
}

pub const SUPPORTED_LLAMA_TYPES: &[&str] = &["llama", "mistral", "qwen2", "qwen3", "smollm3"];

pub(crate) fn token_ids(v: &Option<Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

fn parse_rope_scaling(v: &Value, file: &Path) -> Result<Option<RopeScaling>, ModelError> {
    let obj = match v.as_object() {
        Some(o) => o,
        None => return Ok(None),
    };
    let kind = obj.get("rope_type").or_else(|| obj.get("type")).and_then(Value::as_str).unwrap_or("default");
    let num = |k: &str| obj.get(k).and_then(Value::as_f64).map(|x| x as f32);
    let bad = |msg: String| ModelError::Config { file: file.to_path_buf(), msg };
    match kind {
        "default" => Ok(None),
        "linear" => Ok(Some(RopeScaling::Linear {
            factor: num("factor").ok_or_else(|| bad("linear rope scaling without `factor`".into()))?,
        })),
        "llama3" => Ok(Some(RopeScaling::Llama3 {
            factor: num("factor").ok_or_else(|| bad("llama3 rope scaling without `factor`".into()))?,
            low_freq_factor: num("low_freq_factor").unwrap_or(1.0),
            high_freq_factor: num("high_freq_factor").unwrap_or(4.0),
            original_max_position_embeddings: obj
                .get("original_max_position_embeddings")
                .and_then(Value::as_u64)
                .unwrap_or(8192) as usize,
        })),
        other => Err(bad(format!("unsupported rope scaling type `{other}` (supported: default, linear, llama3)"))),
    }
}

impl LlamaConfig {
    /// Parse an HF `config.json` of a llama-family model.
    pub fn from_hf_json(text: &str, file: &Path) -> Result<Self, ModelError> {
        let bad = |msg: String| ModelError::Config { file: file.to_path_buf(), msg };
        let raw: HfRaw = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        let model_type = raw
            .model_type
            .clone()
            .or_else(|| raw.architectures.as_ref().and_then(|a| a.first()).map(|a| a.to_lowercase()))
            .unwrap_or_default();
        if !SUPPORTED_LLAMA_TYPES.contains(&model_type.as_str()) {
            return Err(ModelError::UnsupportedArchitecture { file: file.to_path_buf(), arch: model_type });
        }
        if let Some(act) = &raw.hidden_act {
            if act != "silu" {
                return Err(bad(format!("unsupported hidden_act `{act}` (only silu)")));
            }
        }
        // transformers >= 5 writes `rope_parameters` (with rope_theta inside); older versions
        // write `rope_theta` and `rope_scaling` at the top level.
        let mut rope_theta = raw.rope_theta;
        let mut rope_scaling = None;
        if let Some(rp) = &raw.rope_parameters {
            if let Some(t) = rp.get("rope_theta").and_then(Value::as_f64) {
                rope_theta = Some(t as f32);
            }
            rope_scaling = parse_rope_scaling(rp, file)?;
        }
        if let Some(rs) = &raw.rope_scaling {
            if rope_scaling.is_none() {
                rope_scaling = parse_rope_scaling(rs, file)?;
            }
        }
        let is_qwen2 = model_type == "qwen2";
        let sliding_window = match (&raw.sliding_window, raw.use_sliding_window) {
            (_, Some(false)) => None,
            (Some(Value::Number(n)), _) => n.as_u64().map(|x| x as usize),
            _ => None,
        };
        // Qwen2 has sliding_window in its config but only applies it when use_sliding_window.
        let sliding_window = if is_qwen2 && raw.use_sliding_window != Some(true) { None } else { sliding_window };
        let cfg = LlamaConfig {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads: raw.num_key_value_heads.unwrap_or(raw.num_attention_heads),
            head_dim: raw.head_dim.unwrap_or(raw.hidden_size / raw.num_attention_heads.max(1)),
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: rope_theta.unwrap_or(10000.0),
            rope_scaling,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(4096),
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            attention_qkv_bias: is_qwen2 || raw.attention_bias.unwrap_or(false),
            attention_out_bias: !is_qwen2 && raw.attention_bias.unwrap_or(false),
            mlp_bias: raw.mlp_bias.unwrap_or(false),
            qk_norm: model_type == "qwen3",
            sliding_window,
            rope_ggml_style: false,
            bos_token_id: token_ids(&raw.bos_token_id).first().copied(),
            eos_token_ids: token_ids(&raw.eos_token_id),
            model_type,
        };
        cfg.validate(file)?;
        Ok(cfg)
    }

    /// Reject shapes the implementation cannot run, naming the field.
    pub fn validate(&self, file: &Path) -> Result<(), ModelError> {
        let bad = |msg: String| Err(ModelError::Config { file: file.to_path_buf(), msg });
        if self.num_attention_heads == 0 || self.num_key_value_heads == 0 {
            return bad("num_attention_heads and num_key_value_heads must be positive".into());
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return bad(format!(
                "num_attention_heads ({}) is not a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim ({}) must be even and positive", self.head_dim));
        }
        if self.hidden_size == 0 || self.vocab_size == 0 || self.num_hidden_layers == 0 {
            return bad("hidden_size, vocab_size and num_hidden_layers must be positive".into());
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Inverse RoPE frequencies, one per pair of dimensions, with any scaling applied.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let half = self.head_dim / 2;
        let base: Vec<f64> =
            (0..half).map(|i| 1.0 / (self.rope_theta as f64).powf((2 * i) as f64 / self.head_dim as f64)).collect();
        match &self.rope_scaling {
            None => base.iter().map(|&f| f as f32).collect(),
            Some(RopeScaling::Linear { factor }) => base.iter().map(|&f| (f / *factor as f64) as f32).collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let (factor, lo, hi) = (*factor as f64, *low_freq_factor as f64, *high_freq_factor as f64);
                let old = *original_max_position_embeddings as f64;
                let low_wavelen = old / lo;
                let high_wavelen = old / hi;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        let v = if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - lo) / (hi - lo);
                            (1.0 - smooth) * f / factor + smooth * f
                        };
                        v as f32
                    })
                    .collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_llama3_rope_scaling_and_defaults() {
        let j = r#"{"model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":16,
            "num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,
            "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
            "high_freq_factor":4.0,"original_max_position_embeddings":8192},"eos_token_id":[1,2]}"#;
        let c = LlamaConfig::from_hf_json(j, Path::new("config.json")).unwrap();
        assert_eq!(c.head_dim, 4);
        assert_eq!(c.eos_token_ids, vec![1, 2]);
        assert!(matches!(c.rope_scaling, Some(RopeScaling::Llama3 { .. })));
        assert_eq!(c.rope_inv_freq().len(), 2);
    }

    #[test]
    fn qwen2_gets_qkv_bias_and_unknown_arch_is_named() {
        let j = r#"{"model_type":"qwen2","vocab_size":10,"hidden_size":8,"intermediate_size":16,
            "num_hidden_layers":1,"num_attention_heads":2,"sliding_window":4096}"#;
        let c = LlamaConfig::from_hf_json(j, Path::new("c.json")).unwrap();
        assert!(c.attention_qkv_bias && !c.attention_out_bias);
        assert_eq!(c.sliding_window, None);
        let j = j.replace("qwen2", "gpt_neox");
        let e = LlamaConfig::from_hf_json(&j, Path::new("c.json")).unwrap_err().to_string();
        assert!(e.contains("gpt_neox") && e.contains("c.json"), "{e}");
    }
}
