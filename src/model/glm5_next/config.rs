//! `glm5_next` hyper-parameters from an HF `config.json`: the nested form (`text_config` inside a
//! `Glm5NextConfig`) or a flat text-only one, with transformers' derived defaults applied in
//! `Glm5NextTextConfig.__post_init__` order (mlp_layer_types, layer_types, indexer_types,
//! `linear_attn_config` overrides) and its validation rules.

use std::path::Path;

use serde_json::{Map, Value};

use crate::model::ModelError;

/// The token mixer of one decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixerKind {
    /// Kimi-style delta-rule linear attention (`linear_attention`).
    Kda,
    /// NoPE MLA with a DeepSeek-sparse-attention indexer (`deepseek_sparse_attention`,
    /// `indexed_attention`; transformers rewrites `full_attention` to it).
    Dsa,
}

/// Whether a DSA layer runs its own indexer or reuses the previous layer's selection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexerKind {
    Full,
    Shared,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    Dense,
    Moe,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Glm5Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub v_head_dim: usize,
    pub attention_bias: bool,
    pub linear_num_heads: usize,
    pub linear_head_dim: usize,
    pub linear_conv_kernel_dim: usize,
    /// `None` selects the unbounded `-exp(A)·softplus` gate.
    pub linear_lower_bound: Option<f32>,
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_shared_experts: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f32,
    pub norm_topk_prob: bool,
    pub swiglu_limit: f32,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_kpool: usize,
    pub index_topk: usize,
    pub index_kpool_always_select_tail: bool,
    pub hc_mult: usize,
    pub hc_eps: f32,
    pub hc_sinkhorn_iters: usize,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub layer_types: Vec<MixerKind>,
    pub indexer_types: Vec<IndexerKind>,
    pub mlp_layer_types: Vec<FfnKind>,
}

fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

/// Typed access to a JSON object with defaults, errors naming the field.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    file: &'a Path,
}

impl Fields<'_> {
    fn bad(&self, msg: String) -> ModelError {
        ModelError::Config { file: self.file.to_path_buf(), msg }
    }

    fn usize(&self, key: &str, default: usize) -> Result<usize, ModelError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| self.bad(format!("`{key}` must be an integer"))),
        }
    }

    fn f32(&self, key: &str, default: f32) -> Result<f32, ModelError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_f64().map(|x| x as f32).ok_or_else(|| self.bad(format!("`{key}` must be a number"))),
        }
    }

    fn bool(&self, key: &str, default: bool) -> Result<bool, ModelError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| self.bad(format!("`{key}` must be a boolean"))),
        }
    }

    fn strings(&self, key: &str) -> Result<Option<Vec<String>>, ModelError> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().map(str::to_string).ok_or_else(|| self.bad(format!("`{key}` must hold strings"))))
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(Value::String(s)) => Ok(Some(s.chars().map(|c| c.to_string()).collect())),
            Some(_) => Err(self.bad(format!("`{key}` must be a list of strings"))),
        }
    }
}

impl Glm5Config {
    /// Parse `config.json` text; `file` is only used in messages.
    pub fn from_hf_json(text: &str, file: &Path) -> Result<Self, ModelError> {
        let bad = |msg: String| ModelError::Config { file: file.to_path_buf(), msg };
        let root: Value = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        let root = root.as_object().ok_or_else(|| bad("config.json is not a JSON object".into()))?;
        let model_type = root.get("model_type").and_then(Value::as_str).unwrap_or_default();
        if !matches!(model_type, "glm5_next" | "glm5_next_text") {
            return Err(ModelError::UnsupportedArchitecture { file: file.to_path_buf(), arch: model_type.into() });
        }
        // A flat text-only config forwards every top-level key to the text config.
        let text_obj = match root.get("text_config") {
            Some(Value::Object(t)) => t,
            Some(_) => return Err(bad("`text_config` must be an object".into())),
            None => root,
        };
        let f = Fields { obj: text_obj, file };
        if let Some(act) = text_obj.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(bad(format!("unsupported hidden_act `{act}` (only silu)")));
            }
        }
        let layers = f.usize("num_hidden_layers", 45)?;
        let heads = f.usize("num_attention_heads", 64)?;

        let mut linear_num_heads = f.usize("linear_num_heads", 64)?;
        let mut linear_head_dim = f.usize("linear_head_dim", 128)?;
        let mut linear_conv = f.usize("linear_conv_kernel_dim", 4)?;
        let mut lower_bound = match text_obj.get("linear_lower_bound") {
            Some(Value::Null) => None,
            _ => Some(f.f32("linear_lower_bound", -5.0)?),
        };
        // Kimi-style overrides (transformers applies them after the plain fields).
        if let Some(Value::Object(lac)) = text_obj.get("linear_attn_config") {
            let lf = Fields { obj: lac, file };
            linear_head_dim = lf.usize("head_dim", linear_head_dim)?;
            linear_num_heads = lf.usize("num_heads", linear_num_heads)?;
            linear_conv = lf.usize("short_conv_kernel_size", linear_conv)?;
            if lac.contains_key("gate_lower_bound") {
                lower_bound = match lac.get("gate_lower_bound") {
                    Some(Value::Null) => None,
                    _ => Some(lf.f32("gate_lower_bound", -5.0)?),
                };
            }
            if lf.bool("safe_gate", true)? && lower_bound.is_none() {
                lower_bound = Some(-5.0);
            }
        }

        let mlp_layer_types = match f.strings("mlp_layer_types")? {
            None => (0..layers).map(|i| if i < 3 { FfnKind::Dense } else { FfnKind::Moe }).collect(),
            Some(v) => v
                .iter()
                .map(|s| match s.as_str() {
                    "dense" => Ok(FfnKind::Dense),
                    "sparse" => Ok(FfnKind::Moe),
                    o => Err(bad(format!("unknown mlp_layer_types entry `{o}` (dense, sparse)"))),
                })
                .collect::<Result<Vec<_>, _>>()?,
        };
        let layer_types = match f.strings("layer_types")? {
            None => (0..layers).map(|i| if i % 4 == 3 { MixerKind::Dsa } else { MixerKind::Kda }).collect(),
            Some(v) => v
                .iter()
                .map(|s| match s.as_str() {
                    "linear_attention" => Ok(MixerKind::Kda),
                    "deepseek_sparse_attention" | "indexed_attention" | "full_attention" => Ok(MixerKind::Dsa),
                    o => Err(bad(format!("unknown layer_types entry `{o}`"))),
                })
                .collect::<Result<Vec<_>, _>>()?,
        };
        let indexer_types = match f.strings("indexer_types")?.or(f.strings("index_topk_pattern")?) {
            Some(v) => v
                .iter()
                .map(|s| match s.as_str() {
                    "full" | "F" => Ok(IndexerKind::Full),
                    "shared" | "S" => Ok(IndexerKind::Shared),
                    o => Err(bad(format!("unknown indexer_types entry `{o}` (full, shared)"))),
                })
                .collect::<Result<Vec<_>, _>>()?,
            None => {
                let freq = f.usize("index_topk_freq", 1)?.max(1);
                let offset = f.usize("index_skip_topk_offset", 2)?;
                (0..layers)
                    .map(|i| {
                        if (i + 1).saturating_sub(offset) % freq == 0 {
                            IndexerKind::Full
                        } else {
                            IndexerKind::Shared
                        }
                    })
                    .collect()
            }
        };
        let eos = token_ids(text_obj.get("eos_token_id").or(root.get("eos_token_id")));
        let bos = token_ids(text_obj.get("bos_token_id").or(root.get("bos_token_id"))).first().copied();
        let cfg = Glm5Config {
            vocab_size: f.usize("vocab_size", 154880)?,
            hidden_size: f.usize("hidden_size", 4096)?,
            intermediate_size: f.usize("intermediate_size", 12288)?,
            moe_intermediate_size: f.usize("moe_intermediate_size", 2048)?,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            q_lora_rank: f.usize("q_lora_rank", 1536)?,
            kv_lora_rank: f.usize("kv_lora_rank", 512)?,
            qk_nope_head_dim: f.usize("qk_nope_head_dim", 256)?,
            v_head_dim: f.usize("v_head_dim", 256)?,
            attention_bias: f.bool("attention_bias", false)?,
            linear_num_heads,
            linear_head_dim,
            linear_conv_kernel_dim: linear_conv,
            linear_lower_bound: lower_bound,
            n_routed_experts: f.usize("n_routed_experts", f.usize("num_local_experts", 288)?)?,
            num_experts_per_tok: f.usize("num_experts_per_tok", 8)?,
            n_shared_experts: f.usize("n_shared_experts", 1)?,
            n_group: f.usize("n_group", 1)?,
            topk_group: f.usize("topk_group", 1)?,
            routed_scaling_factor: f.f32("routed_scaling_factor", 2.5)?,
            norm_topk_prob: f.bool("norm_topk_prob", true)?,
            swiglu_limit: f.f32("swiglu_limit", 10.0)?,
            index_n_heads: f.usize("index_n_heads", 32)?,
            index_head_dim: f.usize("index_head_dim", 128)?,
            index_kpool: f.usize("index_kpool", 16)?,
            index_topk: f.usize("index_topk", 2048)?,
            index_kpool_always_select_tail: f.bool("index_kpool_always_select_tail", true)?,
            hc_mult: f.usize("hc_mult", 4)?,
            hc_eps: f.f32("hc_eps", 1e-6)?,
            hc_sinkhorn_iters: f.usize("hc_sinkhorn_iters", 20)?,
            rms_norm_eps: f.f32("rms_norm_eps", 1e-5)?,
            max_position_embeddings: f.usize("max_position_embeddings", 1 << 20)?,
            tie_word_embeddings: f.bool(
                "tie_word_embeddings",
                root.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
            )?,
            eos_token_ids: eos,
            bos_token_id: bos,
            layer_types,
            indexer_types,
            mlp_layer_types,
        };
        // Fields transformers validates or that this implementation cannot run.
        let kv_heads = f.usize("num_key_value_heads", heads)?;
        if kv_heads != heads {
            return Err(bad(format!("num_key_value_heads ({kv_heads}) must equal num_attention_heads ({heads})")));
        }
        if f.usize("qk_rope_head_dim", 0)? != 0 {
            return Err(bad("qk_rope_head_dim must be 0 (glm5_next is NoPE)".into()));
        }
        if text_obj.get("q_lora_rank") == Some(&Value::Null) {
            return Err(bad("q_lora_rank must be set (glm5_next always uses the q LoRA path)".into()));
        }
        cfg.validate().map_err(bad)?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<(), String> {
        let l = self.num_hidden_layers;
        for (name, n) in [
            ("layer_types", self.layer_types.len()),
            ("indexer_types", self.indexer_types.len()),
            ("mlp_layer_types", self.mlp_layer_types.len()),
        ] {
            if n < l {
                return Err(format!("{name} has {n} entries for {l} layers"));
            }
        }
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_attention_heads", self.num_attention_heads),
            ("linear_num_heads", self.linear_num_heads),
            ("linear_head_dim", self.linear_head_dim),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
            ("index_kpool", self.index_kpool),
            ("index_n_heads", self.index_n_heads),
            ("hc_mult", self.hc_mult),
            ("n_group", self.n_group),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("hc_sinkhorn_iters", self.hc_sinkhorn_iters),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} must be positive"));
        }
        if !self.index_topk.is_multiple_of(self.index_kpool) || self.index_topk == 0 {
            return Err(format!(
                "index_topk ({}) must be a positive multiple of index_kpool ({})",
                self.index_topk, self.index_kpool
            ));
        }
        if self.mlp_layer_types[..l].contains(&FfnKind::Moe) {
            let per_group = self.n_routed_experts / self.n_group;
            if !self.n_routed_experts.is_multiple_of(self.n_group) || per_group < 2 {
                return Err(format!(
                    "n_routed_experts ({}) must split into n_group ({}) groups of at least 2",
                    self.n_routed_experts, self.n_group
                ));
            }
            if self.topk_group == 0 || self.topk_group > self.n_group {
                return Err(format!("topk_group ({}) must be in 1..={}", self.topk_group, self.n_group));
            }
            if self.num_experts_per_tok > self.topk_group * per_group {
                return Err(format!(
                    "num_experts_per_tok ({}) exceeds the {} experts of the kept groups",
                    self.num_experts_per_tok,
                    self.topk_group * per_group
                ));
            }
        }
        for i in 0..l {
            if self.layer_types[i] == MixerKind::Dsa && self.indexer_types[i] == IndexerKind::Shared {
                let ok = i > 0
                    && self.layer_types[i - 1] == MixerKind::Dsa
                    && self.indexer_types[i - 1] == IndexerKind::Full;
                if !ok {
                    return Err(format!(
                        "layer {i} is a shared-indexer DSA layer but layer {} is not a full-indexer DSA layer",
                        i.wrapping_sub(1) as isize
                    ));
                }
            }
        }
        Ok(())
    }

    /// Whether layer `i` runs its own DSA indexer.
    pub fn has_indexer(&self, i: usize) -> bool {
        self.layer_types[i] == MixerKind::Dsa && self.indexer_types[i] == IndexerKind::Full
    }

    /// Width of the KDA q/k/v projections (`linear_num_heads · linear_head_dim`).
    pub fn linear_qkv_dim(&self) -> usize {
        self.linear_num_heads * self.linear_head_dim
    }

    /// DSA selection budget in pools.
    pub fn pool_budget(&self) -> usize {
        self.index_topk / self.index_kpool
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<Glm5Config, ModelError> {
        Glm5Config::from_hf_json(json, Path::new("config.json"))
    }

    #[test]
    fn defaults_follow_transformers_post_init() {
        let c = parse(r#"{"model_type": "glm5_next", "text_config": {}}"#).unwrap();
        assert_eq!(c.num_hidden_layers, 45);
        let dsa: Vec<usize> = (0..45).filter(|&i| c.layer_types[i] == MixerKind::Dsa).collect();
        assert_eq!(dsa, (0..11).map(|k| 4 * k + 3).collect::<Vec<_>>());
        assert_eq!(c.mlp_layer_types.iter().filter(|&&k| k == FfnKind::Dense).count(), 3);
        assert!(c.indexer_types.iter().all(|&k| k == IndexerKind::Full));
        assert_eq!(c.linear_lower_bound, Some(-5.0));
        assert_eq!(c.pool_budget(), 128);
    }

    #[test]
    fn flat_config_and_overrides() {
        let c = parse(
            r#"{"model_type": "glm5_next_text", "num_hidden_layers": 4, "layer_types": ["linear_attention",
            "full_attention", "indexed_attention", "linear_attention"], "index_topk_pattern": "FFSF",
            "linear_attn_config": {"num_heads": 3, "head_dim": 8, "gate_lower_bound": null, "safe_gate": false}}"#,
        )
        .unwrap();
        assert_eq!(c.layer_types[1], MixerKind::Dsa);
        assert_eq!(c.indexer_types[2], IndexerKind::Shared);
        assert_eq!((c.linear_num_heads, c.linear_head_dim, c.linear_lower_bound), (3, 8, None));
    }

    #[test]
    fn rejects_what_transformers_rejects() {
        for (json, needle) in [
            (r#"{"model_type": "llama"}"#, "unsupported architecture"),
            (r#"{"model_type": "glm5_next", "qk_rope_head_dim": 64}"#, "NoPE"),
            (r#"{"model_type": "glm5_next", "num_key_value_heads": 8}"#, "num_key_value_heads"),
            (r#"{"model_type": "glm5_next", "index_topk": 100}"#, "index_topk"),
            (
                r#"{"model_type": "glm5_next", "num_hidden_layers": 2, "index_topk_pattern": "FS",
                "layer_types": ["linear_attention", "deepseek_sparse_attention"]}"#,
                "shared-indexer",
            ),
            (r#"{"model_type": "glm5_next", "hidden_act": "gelu"}"#, "hidden_act"),
            (r#"{"model_type": "glm5_next", "n_group": 5}"#, "n_group"),
            (r#"{"model_type": "glm5_next", "layer_types": ["mamba"]}"#, "mamba"),
        ] {
            let err = parse(json).unwrap_err().to_string();
            assert!(err.contains(needle), "{json}: {err}");
        }
    }
}
