//! The DFlash / DFlash2 drafter's `config.json`: a Qwen3-style config whose drafter settings sit in
//! `dflash_config` (each one may also appear at the top level, which `dflash_config` overrides, as
//! the reference reads them).

use std::path::Path;

use serde_json::{Map, Value};

use crate::spec::DraftError;

/// DFlash2's extra parts: a dynamic causal convolution around each layer's attention and MLP, and
/// the candidate selector that picks a path through the top candidates of every position.
#[derive(Clone, Debug, PartialEq)]
pub struct DFlash2Config {
    pub conv_kernel_size: usize,
    pub conv_group_size: usize,
    pub selector_rank: usize,
    pub selector_top_k: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct DFlashConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub vocab_size: usize,
    pub rope_theta: f32,
    /// Per layer: the attention window (`sliding_attention` layers) or `None` (full).
    pub sliding_window: Vec<Option<usize>>,
    /// Per layer: causal attention inside the block (DFlash drafters are trained non-causal).
    pub causal: Vec<bool>,
    /// Tokens per proposed block: the anchor (last known token) plus `block_size - 1` drafts.
    pub block_size: usize,
    pub mask_token_id: u32,
    /// Target layers whose outputs, side by side, are the drafter's context features.
    pub target_layer_ids: Vec<usize>,
    pub output_multiplier: f32,
    pub final_logit_softcapping: Option<f32>,
    pub input_embedding_scale: f32,
    pub dflash2: Option<DFlash2Config>,
}

fn bad(path: &Path, msg: impl Into<String>) -> DraftError {
    DraftError::DraftModel { path: path.display().to_string(), msg: msg.into() }
}

impl DFlashConfig {
    /// Read `dir/config.json`.
    pub fn read(dir: &Path) -> Result<Self, DraftError> {
        let file = dir.join("config.json");
        let text = std::fs::read_to_string(&file).map_err(|e| bad(dir, format!("reading {}: {e}", file.display())))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| bad(dir, format!("{}: {e}", file.display())))?;
        Self::from_json(&json).map_err(|msg| bad(dir, format!("{}: {msg}", file.display())))
    }

    pub fn from_json(json: &Value) -> Result<Self, String> {
        let top = json.as_object().ok_or("the config is not a JSON object")?;
        let empty = Map::new();
        let dflash = top.get("dflash_config").and_then(Value::as_object).unwrap_or(&empty);
        let get = |name: &str| dflash.get(name).or_else(|| top.get(name)).filter(|v| !v.is_null());
        let usize_of = |name: &str| -> Result<Option<usize>, String> {
            get(name)
                .map(|v| v.as_u64().map(|n| n as usize).ok_or(format!("`{name}` must be a non-negative integer")))
                .transpose()
        };
        let need = |name: &str| usize_of(name)?.ok_or(format!("`{name}` is missing"));
        let float_of = |name: &str| -> Result<Option<f32>, String> {
            get(name).map(|v| v.as_f64().map(|f| f as f32).ok_or(format!("`{name}` must be a number"))).transpose()
        };
        let hidden_size = need("hidden_size")?;
        let num_heads = need("num_attention_heads")?;
        let num_layers = need("num_hidden_layers")?;
        let head_dim = usize_of("head_dim")?.unwrap_or(hidden_size / num_heads.max(1));
        let num_kv_heads = usize_of("num_key_value_heads")?.unwrap_or(num_heads);
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 || head_dim % 2 != 0 {
            return Err(format!("{num_heads} heads over {num_kv_heads} KV heads of dimension {head_dim} do not fit"));
        }
        let rope = top.get("rope_parameters").or_else(|| top.get("rope_scaling")).and_then(Value::as_object);
        if let Some(kind) = rope.and_then(|r| r.get("rope_type").or_else(|| r.get("type"))).and_then(Value::as_str) {
            if kind != "default" {
                return Err(format!("rope type `{kind}` is not supported by the DFlash drafter (only `default`)"));
            }
        }
        let rope_theta = rope
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
            .or_else(|| top.get("rope_theta").and_then(Value::as_f64))
            .unwrap_or(10000.0) as f32;
        let layer_types: Vec<String> = match top.get("layer_types").filter(|v| !v.is_null()) {
            Some(v) => serde_json::from_value(v.clone()).map_err(|e| format!("`layer_types`: {e}"))?,
            None => vec!["full_attention".into(); num_layers],
        };
        if layer_types.len() != num_layers {
            return Err(format!("{} layer types for {num_layers} layers", layer_types.len()));
        }
        let window = usize_of("sliding_window")?;
        let is_causal = get("is_causal").and_then(Value::as_bool);
        let mut sliding_window = Vec::with_capacity(num_layers);
        let mut causal = Vec::with_capacity(num_layers);
        for t in &layer_types {
            let sliding = match t.as_str() {
                "sliding_attention" => true,
                "full_attention" => false,
                other => return Err(format!("layer type `{other}` is not an attention layer type")),
            };
            if sliding && window.is_none() {
                return Err("a `sliding_attention` layer needs `sliding_window`".into());
            }
            sliding_window.push(if sliding { window } else { None });
            // As the reference: unset `is_causal` makes sliding layers causal and full ones not.
            causal.push(is_causal.unwrap_or(sliding));
        }
        let target_layer_ids: Vec<usize> = match get("target_layer_ids") {
            Some(v) => serde_json::from_value(v.clone()).map_err(|e| format!("`target_layer_ids`: {e}"))?,
            None => return Err("`dflash_config.target_layer_ids` is missing".into()),
        };
        if target_layer_ids.is_empty() {
            return Err("`target_layer_ids` is empty".into());
        }
        let block_size = usize_of("block_size")?.unwrap_or(16);
        if block_size < 2 {
            return Err(format!("block_size {block_size} proposes nothing"));
        }
        let vocab_size = need("vocab_size")?;
        let mask_token_id = need("mask_token_id")? as u32;
        if mask_token_id as usize >= vocab_size {
            return Err(format!("mask_token_id {mask_token_id} is outside the vocabulary ({vocab_size})"));
        }
        let architectures: Vec<String> =
            top.get("architectures").and_then(|v| serde_json::from_value(v.clone()).ok()).unwrap_or_default();
        let is_v2 = architectures.iter().any(|a| a.starts_with("DFlash2")) || get("selector_top_k").is_some();
        let dflash2 = if is_v2 {
            Some(DFlash2Config {
                conv_kernel_size: need("conv_kernel_size")?,
                conv_group_size: need("conv_group_size")?,
                selector_rank: need("selector_rank")?,
                selector_top_k: need("selector_top_k")?,
            })
        } else {
            None
        };
        if let Some(v2) = &dflash2 {
            if v2.conv_group_size == 0 || hidden_size % v2.conv_group_size != 0 {
                return Err(format!(
                    "conv_group_size {} does not divide hidden_size {hidden_size}",
                    v2.conv_group_size
                ));
            }
            if v2.selector_top_k == 0 || v2.selector_top_k > vocab_size || v2.conv_kernel_size == 0 {
                return Err("selector_top_k and conv_kernel_size must be positive".into());
            }
        }
        Ok(DFlashConfig {
            hidden_size,
            intermediate_size: need("intermediate_size")?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: float_of("rms_norm_eps")?.unwrap_or(1e-6),
            vocab_size,
            rope_theta,
            sliding_window,
            causal,
            block_size,
            mask_token_id,
            target_layer_ids,
            output_multiplier: float_of("output_multiplier")?.unwrap_or(1.0),
            final_logit_softcapping: float_of("final_logit_softcapping")?.filter(|&c| c > 0.0),
            input_embedding_scale: float_of("input_embedding_scale")?.unwrap_or(1.0),
            dflash2,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Value {
        serde_json::json!({
            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512,
            "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4, "is_causal": false,
            "dflash_config": {"block_size": 8, "mask_token_id": 511, "target_layer_ids": [0, 1]}
        })
    }

    #[test]
    fn reads_drafter_settings_and_refuses_what_it_cannot_run() {
        let c = DFlashConfig::from_json(&base()).unwrap();
        assert_eq!((c.block_size, c.mask_token_id, c.target_layer_ids.clone()), (8, 511, vec![0, 1]));
        assert_eq!((c.sliding_window.clone(), c.causal.clone()), (vec![Some(4), None], vec![false, false]));
        assert!(c.dflash2.is_none());
        let mut j = base();
        j["is_causal"] = Value::Null;
        assert_eq!(DFlashConfig::from_json(&j).unwrap().causal, vec![true, false], "the reference's default");
        let mut j = base();
        j["dflash_config"]["mask_token_id"] = 512.into();
        assert!(DFlashConfig::from_json(&j).unwrap_err().contains("outside the vocabulary"));
        let mut j = base();
        j["dflash_config"].as_object_mut().unwrap().remove("target_layer_ids");
        assert!(DFlashConfig::from_json(&j).unwrap_err().contains("target_layer_ids"));
        let mut j = base();
        j["rope_parameters"] = serde_json::json!({"rope_type": "yarn"});
        assert!(DFlashConfig::from_json(&j).unwrap_err().contains("yarn"));
        let mut j = base();
        j["architectures"] = serde_json::json!(["DFlash2DraftModel"]);
        assert!(DFlashConfig::from_json(&j).unwrap_err().contains("conv_kernel_size"));
    }
}
