//! Weight layout of the `llama` family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM): which tensors
//! exist, under which HF names, with which shapes, for a given config. Backends load through this
//! spec so that every backend checks the same shapes and names the same tensors in errors.

use crate::config::LlamaConfig;

/// A projection `y = x · Wᵀ (+ b)` with `W: [out, inp]`.
#[derive(Clone, Debug, PartialEq)]
pub struct LinearSpec {
    /// Tensor name without the `.weight` / `.bias` suffix.
    pub name: String,
    pub out: usize,
    pub inp: usize,
    pub bias: bool,
}

impl LinearSpec {
    fn new(name: String, out: usize, inp: usize, bias: bool) -> Self {
        LinearSpec { name, out, inp, bias }
    }

    pub fn weight(&self) -> String {
        format!("{}.weight", self.name)
    }

    pub fn bias_name(&self) -> String {
        format!("{}.bias", self.name)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct LayerSpec {
    pub input_norm: String,
    pub q: LinearSpec,
    pub k: LinearSpec,
    pub v: LinearSpec,
    pub o: LinearSpec,
    /// Qwen3's per-head RMSNorm weights (`[head_dim]`).
    pub q_norm: Option<String>,
    pub k_norm: Option<String>,
    pub post_attention_norm: String,
    pub gate: LinearSpec,
    pub up: LinearSpec,
    pub down: LinearSpec,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LlamaSpec {
    /// `[vocab, hidden]`.
    pub embed: String,
    pub layers: Vec<LayerSpec>,
    pub final_norm: String,
    /// The output projection; its name is the embedding's when embeddings are tied.
    pub lm_head: LinearSpec,
}

impl LlamaSpec {
    pub fn new(c: &LlamaConfig) -> Self {
        let h = c.hidden_size;
        let layers = (0..c.num_hidden_layers)
            .map(|i| {
                let p = format!("model.layers.{i}");
                let lin = |n: &str, out, inp, bias| LinearSpec::new(format!("{p}.{n}"), out, inp, bias);
                LayerSpec {
                    input_norm: format!("{p}.input_layernorm.weight"),
                    q: lin("self_attn.q_proj", c.q_dim(), h, c.attention_qkv_bias),
                    k: lin("self_attn.k_proj", c.kv_dim(), h, c.attention_qkv_bias),
                    v: lin("self_attn.v_proj", c.kv_dim(), h, c.attention_qkv_bias),
                    o: lin("self_attn.o_proj", h, c.q_dim(), c.attention_out_bias),
                    q_norm: c.qk_norm.then(|| format!("{p}.self_attn.q_norm.weight")),
                    k_norm: c.qk_norm.then(|| format!("{p}.self_attn.k_norm.weight")),
                    post_attention_norm: format!("{p}.post_attention_layernorm.weight"),
                    gate: lin("mlp.gate_proj", c.intermediate_size, h, c.mlp_bias),
                    up: lin("mlp.up_proj", c.intermediate_size, h, c.mlp_bias),
                    down: lin("mlp.down_proj", h, c.intermediate_size, c.mlp_bias),
                }
            })
            .collect();
        let lm_head = if c.tie_word_embeddings {
            LinearSpec::new("model.embed_tokens".into(), c.vocab_size, h, false)
        } else {
            LinearSpec::new("lm_head".into(), c.vocab_size, h, false)
        };
        LlamaSpec { embed: "model.embed_tokens.weight".into(), layers, final_norm: "model.norm.weight".into(), lm_head }
    }

    /// Bytes of weights a decode step reads (every matrix once, norms and the embedding row
    /// ignored): the numerator of the memory-bandwidth roofline.
    pub fn decode_weight_elems(&self) -> usize {
        let lin = |l: &LinearSpec| l.out * l.inp;
        self.layers
            .iter()
            .map(|l| lin(&l.q) + lin(&l.k) + lin(&l.v) + lin(&l.o) + lin(&l.gate) + lin(&l.up) + lin(&l.down))
            .sum::<usize>()
            + lin(&self.lm_head)
    }
}
