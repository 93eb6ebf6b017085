//! Loading a `glm5_next` checkpoint as transformers' `save_pretrained` writes it: text tensors
//! under `model.language_model.`, `lm_head.weight`, the on-disk (original) names — split
//! `q/k/v_conv1d`, per-expert `experts.{e}.*`, `hc_attn_*`, bare `f_a_proj`/`dt_bias`/`A_log` — and
//! also the in-memory names (`conv1d`, packed `gate_up_proj`/`down_proj`, `attn_hc.fn`,
//! `forget_gate.*`) that `save_original_format=False` writes. Vision-tower and MTP tensors are
//! set aside with a log line; any other tensor nobody reads is an error naming file and tensor.
//!
//! The loader is generic over how a device stores a projection ([`LinearWeight`]): every backend
//! reads the same names, shapes and stacking from here; vectors (norms, biases, conv taps) are
//! widened to f32 on the host. Quantized checkpoints (`model::quantized`) store projections —
//! routed and shared experts included — as per-expert codes and scales, which `L::load` reads;
//! `kv_b_proj`, consumed per head in absorbed form, is dequantized to f32.

use std::cell::RefCell;
use std::collections::BTreeSet;

use super::config::{FfnKind, Glm5Config, MixerKind};
use crate::model::tensor::to_f32;
use crate::model::{quantized, ModelError, WeightSource};

pub const TEXT_PREFIX: &str = "model.language_model.";

/// How a backend holds a dense projection `[rows, cols]` (rows = outputs).
pub trait LinearWeight: Sized {
    /// Load `{base}.weight` of shape `[out, inp]` in the device's storage format.
    fn load(w: &dyn WeightSource, base: &str, out: usize, inp: usize) -> Result<Self, ModelError>;
    /// A projection from f32 rows (tensors stored without a `.weight` suffix, slices of packed
    /// expert tensors).
    fn from_f32(data: Vec<f32>, out: usize, inp: usize) -> Self;
    /// Stack projections with the same input into one (`[Σout, inp]`); the parts come back when
    /// their storage formats differ.
    fn stack(parts: Vec<Self>) -> Result<Self, Vec<Self>>;
    /// Bytes the backend accounts for this projection.
    fn bytes(&self) -> usize;
}

/// The mHC parameters of one site (before the mixer or before the FFN).
pub struct HyperConnection<L> {
    /// The `fn` map `[(2+M)·M, M·D]`.
    pub proj: L,
    /// `[(2+M)·M]`.
    pub base: Vec<f32>,
    /// pre, post and comb scales.
    pub scale: [f32; 3],
}

pub struct KdaWeights<L> {
    /// q, k and v projections stacked (`[3Q, D]`).
    pub qkv: L,
    /// Depthwise causal conv taps `[3Q, K]`, q|k|v channel order.
    pub conv: Vec<f32>,
    pub f_a: L,
    pub f_b: L,
    pub dt_bias: Vec<f32>,
    pub a_log: Vec<f32>,
    pub b_proj: L,
    pub g_a: L,
    pub g_b: L,
    pub o_norm: Vec<f32>,
    pub o_proj: L,
}

pub struct IndexerWeights<L> {
    /// `wq_b` `[H_I·d_I, r_q]`.
    pub wq_b: L,
    /// `wk`, `index_kpool_compress_gate` and `weights_proj` stacked: `[d_I + d_I + H_I, D]`.
    pub k_gate_w: L,
    pub k_norm_w: Vec<f32>,
    pub k_norm_b: Vec<f32>,
    /// `[P, d_I]`.
    pub ape: Vec<f32>,
}

pub struct MlaWeights<L> {
    pub q_a: L,
    pub q_a_norm: Vec<f32>,
    pub q_b: L,
    pub kv_a: L,
    pub kv_a_norm: Vec<f32>,
    /// `kv_b_proj` rows `[H·(d_n + d_v), r_kv]`: per head `d_n` key rows then `d_v` value rows.
    pub kv_b: Vec<f32>,
    pub o_proj: L,
    pub indexer: Option<IndexerWeights<L>>,
}

pub enum Mixer<L> {
    Kda(KdaWeights<L>),
    Dsa(MlaWeights<L>),
}

/// A SwiGLU MLP (dense layer, shared expert or one routed expert).
pub struct Mlp<L> {
    /// gate rows then up rows: `[2I, D]`.
    pub gate_up: L,
    pub down: L,
}

pub struct Moe<L> {
    /// Router `[E, D]` (fp32 in transformers).
    pub router: L,
    pub correction_bias: Vec<f32>,
    pub experts: Vec<Mlp<L>>,
    pub shared: Mlp<L>,
}

pub enum Ffn<L> {
    Dense(Mlp<L>),
    Moe(Moe<L>),
}

pub struct Layer<L> {
    pub attn_hc: HyperConnection<L>,
    pub ffn_hc: HyperConnection<L>,
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub mixer: Mixer<L>,
    pub ffn: Ffn<L>,
}

pub struct Glm5Weights<L> {
    pub embed: L,
    pub layers: Vec<Layer<L>>,
    pub norm: Vec<f32>,
    /// `None` when tied to the embedding.
    pub lm_head: Option<L>,
}

impl<L: LinearWeight> Glm5Weights<L> {
    /// Bytes of projection weights held (as each projection accounts them), plus MLA's `kv_b`.
    pub fn bytes(&self) -> usize {
        fn lin<L: LinearWeight>(l: &L) -> usize {
            l.bytes()
        }
        fn mlp<L: LinearWeight>(m: &Mlp<L>) -> usize {
            lin(&m.gate_up) + lin(&m.down)
        }
        let mut total = lin(&self.embed) + self.lm_head.as_ref().map_or(0, lin);
        for l in &self.layers {
            total += lin(&l.attn_hc.proj) + lin(&l.ffn_hc.proj);
            total += match &l.mixer {
                Mixer::Kda(k) => {
                    lin(&k.qkv)
                        + lin(&k.f_a)
                        + lin(&k.f_b)
                        + lin(&k.b_proj)
                        + lin(&k.g_a)
                        + lin(&k.g_b)
                        + lin(&k.o_proj)
                }
                Mixer::Dsa(m) => {
                    lin(&m.q_a)
                        + lin(&m.q_b)
                        + lin(&m.kv_a)
                        + 4 * m.kv_b.len()
                        + lin(&m.o_proj)
                        + m.indexer.as_ref().map_or(0, |i| lin(&i.wq_b) + lin(&i.k_gate_w))
                }
            };
            total += match &l.ffn {
                Ffn::Dense(m) => mlp(m),
                Ffn::Moe(m) => lin(&m.router) + mlp(&m.shared) + m.experts.iter().map(mlp).sum::<usize>(),
            };
        }
        total
    }
}

/// Tensor lookups that remember what was read, so unread tensors can be reported.
struct Loader<'a> {
    w: &'a dyn WeightSource,
    used: RefCell<BTreeSet<String>>,
}

impl Loader<'_> {
    /// Whether the checkpoint stores `name` (for a `.weight`, possibly as a quantized projection).
    fn has(&self, name: &str) -> bool {
        let packed = name.strip_suffix(".weight").map(|base| format!("{base}.weight_packed"));
        self.w.raw_tensor(name).is_some()
            || self.w.tensor(name).is_some()
            || packed.is_some_and(|p| self.w.raw_tensor(&p).is_some())
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
        let t = self.w.expect(name, &[len])?;
        self.used.borrow_mut().insert(name.to_string());
        Ok(to_f32(&t))
    }

    fn matrix(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        let t = self.w.expect(name, shape)?;
        self.used.borrow_mut().insert(name.to_string());
        Ok(to_f32(&t))
    }

    /// `name` is the full tensor name including `.weight`. A projection of a quantized
    /// checkpoint is read with its codes and scales, which count as used.
    fn linear<L: LinearWeight>(&self, name: &str, out: usize, inp: usize) -> Result<L, ModelError> {
        let base = name.strip_suffix(".weight").unwrap_or(name);
        let l = L::load(self.w, base, out, inp)?;
        self.mark_linear(base);
        Ok(l)
    }

    fn mark_linear(&self, base: &str) {
        let mut used = self.used.borrow_mut();
        used.extend(quantized::linear_tensor_names(base).into_iter().filter(|n| self.w.raw_tensor(n).is_some()));
        used.insert(format!("{base}.weight"));
    }

    /// A projection the backends consume as f32 rows (MLA's `kv_b_proj`), dequantized with the
    /// checkpoint tool's arithmetic when it is stored quantized.
    fn matrix_of_linear(&self, name: &str, out: usize, inp: usize) -> Result<Vec<f32>, ModelError> {
        let base = name.strip_suffix(".weight").unwrap_or(name);
        let m = quantized::load_matrix_f32(self.w, base, out, inp)?;
        self.mark_linear(base);
        Ok(m)
    }

    fn linear_from<L: LinearWeight>(&self, data: Vec<f32>, out: usize, inp: usize) -> L {
        L::from_f32(data, out, inp)
    }

    fn stack<L: LinearWeight>(&self, parts: Vec<L>, what: &str) -> Result<L, ModelError> {
        L::stack(parts).map_err(|_| ModelError::Format {
            file: self.w.origin().to_path_buf(),
            msg: format!("{what}: the stacked projections have different storage formats"),
        })
    }
}

fn hyper_connection<L: LinearWeight>(
    ld: &Loader<'_>,
    p: &str,
    site: &str,
    c: &Glm5Config,
) -> Result<HyperConnection<L>, ModelError> {
    let m = c.hc_mult;
    let n = (2 + m) * m;
    let disk = format!("{p}hc_{site}_");
    let mem = format!("{p}{site}_hc.");
    let name = |k: &str| {
        let a = format!("{disk}{k}");
        if ld.has(&a) {
            a
        } else {
            format!("{mem}{k}")
        }
    };
    let scale = ld.vector(&name("scale"), 3)?;
    Ok(HyperConnection {
        proj: ld.linear_from(ld.matrix(&name("fn"), &[n, m * c.hidden_size])?, n, m * c.hidden_size),
        base: ld.vector(&name("base"), n)?,
        scale: [scale[0], scale[1], scale[2]],
    })
}

fn kda<L: LinearWeight>(ld: &Loader<'_>, p: &str, c: &Glm5Config) -> Result<KdaWeights<L>, ModelError> {
    let (d, q, k, h) = (c.hidden_size, c.linear_qkv_dim(), c.linear_conv_kernel_dim, c.linear_num_heads);
    let a = format!("{p}self_attn.");
    let parts = ["q_proj", "k_proj", "v_proj"]
        .iter()
        .map(|n| ld.linear(&format!("{a}{n}.weight"), q, d))
        .collect::<Result<Vec<_>, _>>()?;
    let qkv = ld.stack(parts, &format!("{a}q/k/v_proj"))?;
    let packed = format!("{a}conv1d.weight");
    let conv = if ld.has(&packed) {
        ld.matrix(&packed, &[3 * q, 1, k])?
    } else {
        let mut v = Vec::with_capacity(3 * q * k);
        for n in ["q_conv1d", "k_conv1d", "v_conv1d"] {
            v.extend(ld.matrix(&format!("{a}{n}.weight"), &[q, 1, k])?);
        }
        v
    };
    let fg = |n: &str| {
        let disk = format!("{a}{n}");
        if ld.has(&disk) {
            disk
        } else {
            format!("{a}forget_gate.{n}")
        }
    };
    Ok(KdaWeights {
        qkv,
        conv,
        f_a: ld.linear(&fg("f_a_proj.weight"), c.linear_head_dim, d)?,
        f_b: ld.linear(&fg("f_b_proj.weight"), q, c.linear_head_dim)?,
        dt_bias: ld.vector(&fg("dt_bias"), q)?,
        a_log: ld.vector(&fg("A_log"), h)?,
        b_proj: ld.linear(&format!("{a}b_proj.weight"), h, d)?,
        g_a: ld.linear(&format!("{a}g_a_proj.weight"), c.linear_head_dim, d)?,
        g_b: ld.linear(&format!("{a}g_b_proj.weight"), q, c.linear_head_dim)?,
        o_norm: ld.vector(&format!("{a}o_norm.weight"), c.linear_head_dim)?,
        o_proj: ld.linear(&format!("{a}o_proj.weight"), d, q)?,
    })
}

fn mla<L: LinearWeight>(
    ld: &Loader<'_>,
    p: &str,
    c: &Glm5Config,
    with_indexer: bool,
) -> Result<MlaWeights<L>, ModelError> {
    let d = c.hidden_size;
    let h = c.num_attention_heads;
    let a = format!("{p}self_attn.");
    if c.attention_bias {
        return Err(ModelError::Config {
            file: ld.w.origin().join("config.json"),
            msg: "attention_bias = true is not supported for glm5_next".into(),
        });
    }
    let indexer = if with_indexer {
        let x = format!("{a}indexer.");
        let (hi, di) = (c.index_n_heads, c.index_head_dim);
        let parts = vec![
            ld.linear(&format!("{x}wk.weight"), di, d)?,
            ld.linear_from(ld.matrix(&format!("{x}index_kpool_compress_gate"), &[di, d])?, di, d),
            ld.linear(&format!("{x}weights_proj.weight"), hi, d)?,
        ];
        Some(IndexerWeights {
            wq_b: ld.linear(&format!("{x}wq_b.weight"), hi * di, c.q_lora_rank)?,
            k_gate_w: ld.stack(parts, &format!("{x}wk/gate/weights_proj"))?,
            k_norm_w: ld.vector(&format!("{x}k_norm.weight"), di)?,
            k_norm_b: ld.vector(&format!("{x}k_norm.bias"), di)?,
            ape: ld.matrix(&format!("{x}index_kpool_compress_ape"), &[c.index_kpool, di])?,
        })
    } else {
        None
    };
    let kvb_rows = h * (c.qk_nope_head_dim + c.v_head_dim);
    Ok(MlaWeights {
        q_a: ld.linear(&format!("{a}q_a_proj.weight"), c.q_lora_rank, d)?,
        q_a_norm: ld.vector(&format!("{a}q_a_layernorm.weight"), c.q_lora_rank)?,
        q_b: ld.linear(&format!("{a}q_b_proj.weight"), h * c.qk_nope_head_dim, c.q_lora_rank)?,
        kv_a: ld.linear(&format!("{a}kv_a_proj_with_mqa.weight"), c.kv_lora_rank, d)?,
        kv_a_norm: ld.vector(&format!("{a}kv_a_layernorm.weight"), c.kv_lora_rank)?,
        kv_b: ld.matrix_of_linear(&format!("{a}kv_b_proj.weight"), kvb_rows, c.kv_lora_rank)?,
        o_proj: ld.linear(&format!("{a}o_proj.weight"), d, h * c.v_head_dim)?,
        indexer,
    })
}

fn mlp<L: LinearWeight>(ld: &Loader<'_>, p: &str, inter: usize, d: usize) -> Result<Mlp<L>, ModelError> {
    let parts = vec![
        ld.linear(&format!("{p}gate_proj.weight"), inter, d)?,
        ld.linear(&format!("{p}up_proj.weight"), inter, d)?,
    ];
    Ok(Mlp {
        gate_up: ld.stack(parts, &format!("{p}gate/up_proj"))?,
        down: ld.linear(&format!("{p}down_proj.weight"), d, inter)?,
    })
}

fn moe<L: LinearWeight>(ld: &Loader<'_>, p: &str, c: &Glm5Config) -> Result<Moe<L>, ModelError> {
    let (d, e, i) = (c.hidden_size, c.n_routed_experts, c.moe_intermediate_size);
    let m = format!("{p}mlp.");
    let packed = format!("{m}experts.gate_up_proj");
    let experts = if ld.has(&packed) {
        let gu = ld.matrix(&packed, &[e, 2 * i, d])?;
        let down = ld.matrix(&format!("{m}experts.down_proj"), &[e, d, i])?;
        (0..e)
            .map(|x| Mlp {
                gate_up: ld.linear_from(gu[x * 2 * i * d..(x + 1) * 2 * i * d].to_vec(), 2 * i, d),
                down: ld.linear_from(down[x * d * i..(x + 1) * d * i].to_vec(), d, i),
            })
            .collect()
    } else {
        (0..e).map(|x| mlp(ld, &format!("{m}experts.{x}."), i, d)).collect::<Result<Vec<_>, _>>()?
    };
    Ok(Moe {
        router: ld.linear(&format!("{m}gate.weight"), e, d)?,
        correction_bias: ld.vector(&format!("{m}gate.e_score_correction_bias"), e)?,
        experts,
        shared: mlp(ld, &format!("{m}shared_experts."), i * c.n_shared_experts, d)?,
    })
}

/// Tensors that belong to parts this engine does not run: the vision tower and the MTP layer
/// (layer index `num_hidden_layers`, or any `shared_head`).
fn set_aside(name: &str, c: &Glm5Config) -> bool {
    let mtp = format!(".layers.{}.", c.num_hidden_layers);
    name.starts_with("model.visual.") || name.contains(&mtp) || name.contains(".shared_head.")
}

/// Load every text tensor of `c` from `w`.
pub fn load<L: LinearWeight>(c: &Glm5Config, w: &dyn WeightSource) -> Result<Glm5Weights<L>, ModelError> {
    let ld = Loader { w, used: RefCell::new(BTreeSet::new()) };
    let d = c.hidden_size;
    let p = TEXT_PREFIX;
    let embed = ld.linear(&format!("{p}embed_tokens.weight"), c.vocab_size, d)?;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for l in 0..c.num_hidden_layers {
        let lp = format!("{p}layers.{l}.");
        let mixer = match c.layer_types[l] {
            MixerKind::Kda => Mixer::Kda(kda(&ld, &lp, c)?),
            MixerKind::Dsa => Mixer::Dsa(mla(&ld, &lp, c, c.has_indexer(l))?),
        };
        let ffn = match c.mlp_layer_types[l] {
            FfnKind::Dense => Ffn::Dense(mlp(&ld, &format!("{lp}mlp."), c.intermediate_size, d)?),
            FfnKind::Moe => Ffn::Moe(moe(&ld, &lp, c)?),
        };
        layers.push(Layer {
            attn_hc: hyper_connection(&ld, &lp, "attn", c)?,
            ffn_hc: hyper_connection(&ld, &lp, "ffn", c)?,
            input_norm: ld.vector(&format!("{lp}input_layernorm.weight"), d)?,
            post_norm: ld.vector(&format!("{lp}post_attention_layernorm.weight"), d)?,
            mixer,
            ffn,
        });
    }
    let norm = ld.vector(&format!("{p}norm.weight"), d)?;
    let lm_head = if c.tie_word_embeddings { None } else { Some(ld.linear("lm_head.weight", c.vocab_size, d)?) };
    let used = ld.used.into_inner();
    let mut aside = 0usize;
    for name in w.tensor_names() {
        if used.contains(&name) {
            continue;
        }
        if set_aside(&name, c) {
            aside += 1;
            continue;
        }
        return Err(ModelError::Format {
            file: w.file_of(&name),
            msg: format!("unexpected tensor `{name}` for this glm5_next config (not a text, vision or MTP tensor)"),
        });
    }
    if aside > 0 {
        tracing::info!(tensors = aside, "glm5_next: vision-tower and MTP tensors set aside (not used)");
    }
    Ok(Glm5Weights { embed, layers, norm, lm_head })
}

/// One MTP (next-token-prediction) layer, stored after the decoder layers at
/// `model.language_model.layers.{num_hidden_layers + i}.` in the DeepSeek-V3 layout
/// (`../shared/glm5_next_spec.md` §6): `enorm`/`hnorm`, `eh_proj` `[D, 2D]` over
/// `[enorm(embedding) ; hnorm(hidden)]`, an ordinary decoder block (mixer and FFN kinds read from
/// which tensors are there) and `shared_head.norm`. `embed_tokens` and `shared_head.head` are
/// copies of the main model's; when a checkpoint leaves them out, the main ones are used.
pub struct MtpWeights<L> {
    /// The layer's index in the checkpoint (`num_hidden_layers + i`).
    pub index: usize,
    pub mixer: MixerKind,
    pub ffn: FfnKind,
    pub enorm: Vec<f32>,
    pub hnorm: Vec<f32>,
    /// `[D, 2D]`, the embedding half first.
    pub eh_proj: L,
    pub embed: Option<L>,
    pub block: Layer<L>,
    pub head_norm: Vec<f32>,
    pub head: Option<L>,
    /// The main model's final norm: the MTP reads the main model's final *normed* hidden state,
    /// while the engine's taps hand out the state before that norm.
    pub main_norm: Vec<f32>,
}

impl<L> MtpWeights<L> {
    /// `c` as a one-layer model whose only layer is this MTP block (what the block's cache and
    /// forward are laid out from).
    pub fn block_config(&self, c: &Glm5Config) -> Glm5Config {
        use super::config::IndexerKind;
        Glm5Config {
            num_hidden_layers: 1,
            layer_types: vec![self.mixer],
            indexer_types: vec![IndexerKind::Full],
            mlp_layer_types: vec![self.ffn],
            ..c.clone()
        }
    }
}

/// `num_nextn_predict_layers` from the checkpoint's `config.json` (nested under `text_config` or
/// flat); 0 when absent.
pub fn num_nextn_predict_layers(dir: &std::path::Path) -> Result<usize, ModelError> {
    let file = dir.join("config.json");
    let text =
        std::fs::read_to_string(&file).map_err(|e| ModelError::Config { file: file.clone(), msg: e.to_string() })?;
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| ModelError::Config { file: file.clone(), msg: e.to_string() })?;
    let get = |o: &serde_json::Value| o.get("num_nextn_predict_layers").and_then(serde_json::Value::as_u64);
    Ok(v.get("text_config").and_then(get).or_else(|| get(&v)).unwrap_or(0) as usize)
}

/// Load the checkpoint's MTP layers (`num_nextn_predict_layers` of them). A checkpoint without
/// any, or with one whose tensors are missing, is an error that says so.
pub fn load_mtp<L: LinearWeight>(c: &Glm5Config, w: &dyn WeightSource) -> Result<Vec<MtpWeights<L>>, ModelError> {
    let n = num_nextn_predict_layers(w.origin())?;
    let no_mtp = |msg: String| ModelError::Config { file: w.origin().join("config.json"), msg };
    if n == 0 {
        return Err(no_mtp(
            "the checkpoint has no MTP layer (`num_nextn_predict_layers` is 0 or absent in config.json), so \
             `--speculative mtp` cannot be used with it"
                .into(),
        ));
    }
    let ld = Loader { w, used: RefCell::new(BTreeSet::new()) };
    let d = c.hidden_size;
    let main_norm = ld.vector(&format!("{TEXT_PREFIX}norm.weight"), d)?;
    (0..n)
        .map(|i| {
            let index = c.num_hidden_layers + i;
            let lp = format!("{TEXT_PREFIX}layers.{index}.");
            let missing = |e: ModelError| {
                no_mtp(format!(
                    "config.json declares {n} MTP layer(s), but MTP layer {index} (`{lp}*`) cannot be loaded: {e}"
                ))
            };
            if !ld.has(&format!("{lp}eh_proj.weight")) {
                return Err(missing(ModelError::Format {
                    file: w.origin().to_path_buf(),
                    msg: format!("tensor `{lp}eh_proj.weight` is missing"),
                }));
            }
            let mixer = if ld.has(&format!("{lp}self_attn.q_a_proj.weight")) { MixerKind::Dsa } else { MixerKind::Kda };
            let ffn = if ld.has(&format!("{lp}mlp.gate.weight")) { FfnKind::Moe } else { FfnKind::Dense };
            let with_indexer = ld.has(&format!("{lp}self_attn.indexer.wq_b.weight"));
            if mixer == MixerKind::Dsa && !with_indexer {
                return Err(missing(ModelError::Format {
                    file: w.origin().to_path_buf(),
                    msg: "an MLA block without its own indexer (a shared-indexer MTP block has no layer to share with)"
                        .into(),
                }));
            }
            let load = || -> Result<MtpWeights<L>, ModelError> {
                let block = Layer {
                    attn_hc: hyper_connection(&ld, &lp, "attn", c)?,
                    ffn_hc: hyper_connection(&ld, &lp, "ffn", c)?,
                    input_norm: ld.vector(&format!("{lp}input_layernorm.weight"), d)?,
                    post_norm: ld.vector(&format!("{lp}post_attention_layernorm.weight"), d)?,
                    mixer: match mixer {
                        MixerKind::Kda => Mixer::Kda(kda(&ld, &lp, c)?),
                        MixerKind::Dsa => Mixer::Dsa(mla(&ld, &lp, c, true)?),
                    },
                    ffn: match ffn {
                        FfnKind::Dense => Ffn::Dense(mlp(&ld, &format!("{lp}mlp."), c.intermediate_size, d)?),
                        FfnKind::Moe => Ffn::Moe(moe(&ld, &lp, c)?),
                    },
                };
                let optional = |name: String| -> Result<Option<L>, ModelError> {
                    if ld.has(&name) {
                        Ok(Some(ld.linear(&name, c.vocab_size, d)?))
                    } else {
                        Ok(None)
                    }
                };
                Ok(MtpWeights {
                    index,
                    mixer,
                    ffn,
                    enorm: ld.vector(&format!("{lp}enorm.weight"), d)?,
                    hnorm: ld.vector(&format!("{lp}hnorm.weight"), d)?,
                    eh_proj: ld.linear(&format!("{lp}eh_proj.weight"), d, 2 * d)?,
                    embed: optional(format!("{lp}embed_tokens.weight"))?,
                    block,
                    head_norm: ld.vector(&format!("{lp}shared_head.norm.weight"), d)?,
                    head: optional(format!("{lp}shared_head.head.weight"))?,
                    main_norm: main_norm.clone(),
                })
            };
            load().map_err(missing)
        })
        .collect()
}
