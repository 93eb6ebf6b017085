//! Seeded random `glm5_next` weights made on the device, for `shelfserve bench` at widths no
//! host could hold in f32 (the real loader passes through host f32). Shapes are the loader's
//! (`model::glm5_next::weights`) and the distributions those of the host's synthetic weights
//! (`model::glm5_next::layout::text_tensors`: matrices ±1/√fan_in, embedding ±1, norms and mHC
//! scales 1 ± 0.1, mHC bases and KDA gate parameters ±0.5); not the same values, which are drawn on
//! the host there. Random routers spread tokens evenly over the experts, the most expert weight a
//! step can touch. With a packed format (`quantization` in the bench config) every projection but
//! the embedding, LM head, router, mHC maps and MLA's absorbed `kv_b` is random packed codes and
//! scales in that format, as an FP8 / int4 / NVFP4 checkpoint stores them; the routed experts then
//! take the grouped packed kernels.

use super::super::gpu::{DevBuf, Gpu, Precision};
use super::super::quant::LinearWeight as DevWeight;
use super::super::weights::{random_packed, Filler};
use super::weights::{
    DevLinear, Experts, Ffn, Glm5DeviceWeights, GroupedPacked, HyperConnection, Indexer, Kda, Layer, Mixer, Mla, Mlp,
    Moe,
};
use crate::backend::BackendError;
use crate::model::glm5_next::config::{FfnKind, MixerKind};
use crate::model::glm5_next::Glm5Config;
use crate::model::quant::packed::PackedFormat;

struct Maker<'a> {
    gpu: &'a mut Gpu,
    fill: Filler,
    prec: Precision,
    bytes: usize,
    /// Projections packed in this format (`None`: dense in `prec`).
    format: Option<PackedFormat>,
}

impl Maker<'_> {
    fn vector(&mut self, n: usize, center: f32, scale: f32) -> Result<DevBuf, BackendError> {
        self.bytes += 4 * n;
        self.fill.fill(self.gpu, n, Precision::F32, center, scale)
    }

    fn matrix(&mut self, rows: usize, cols: usize, prec: Precision) -> Result<DevBuf, BackendError> {
        self.bytes += prec.bytes() * rows * cols;
        self.fill.fill(self.gpu, rows * cols, prec, 0.0, 1.0 / (cols as f32).sqrt())
    }

    /// A dense matrix in `prec` (the embedding and LM head stay so in quantized checkpoints).
    fn dense_linear(&mut self, rows: usize, cols: usize) -> Result<DevLinear, BackendError> {
        let prec = self.prec;
        Ok(DevLinear::dense(rows, cols, prec, self.matrix(rows, cols, prec)?))
    }

    /// A projection: packed when the bench asks for a format, else dense.
    fn weight(&mut self, rows: usize, cols: usize) -> Result<DevWeight, BackendError> {
        match self.format {
            Some(format) => {
                let p = random_packed(self.gpu, &mut self.fill, format, rows, cols)?;
                self.bytes += p.bytes();
                Ok(DevWeight::Packed(p))
            }
            None => Ok(DevWeight::Dense { buf: self.matrix(rows, cols, self.prec)?, rows }),
        }
    }

    fn linear(&mut self, rows: usize, cols: usize) -> Result<DevLinear, BackendError> {
        Ok(DevLinear { rows, cols, prec: self.prec, w: self.weight(rows, cols)? })
    }

    fn linear_f32(&mut self, rows: usize, cols: usize) -> Result<DevLinear, BackendError> {
        Ok(DevLinear::dense(rows, cols, Precision::F32, self.matrix(rows, cols, Precision::F32)?))
    }

    fn hyper_connection(&mut self, c: &Glm5Config) -> Result<HyperConnection, BackendError> {
        let m = c.hc_mult;
        let n = (2 + m) * m;
        let proj = self.linear_f32(n, m * c.hidden_size)?;
        Ok(HyperConnection { proj, base: self.vector(n, 0.0, 0.5)?, scale: [1.0; 3] })
    }

    fn mlp(&mut self, inter: usize, d: usize) -> Result<Mlp, BackendError> {
        Ok(Mlp { gate_up: self.linear(2 * inter, d)?, down: self.linear(d, inter)? })
    }

    fn kda(&mut self, c: &Glm5Config) -> Result<Kda, BackendError> {
        let (d, q, k, h, hd) =
            (c.hidden_size, c.linear_qkv_dim(), c.linear_conv_kernel_dim, c.linear_num_heads, c.linear_head_dim);
        Ok(Kda {
            qkv: self.linear(3 * q, d)?,
            conv: self.vector(3 * q * k, 0.0, 1.0 / (k as f32).sqrt())?,
            f_a: self.linear(hd, d)?,
            f_b: self.linear(q, hd)?,
            dt_bias: self.vector(q, 0.0, 0.5)?,
            a_log: self.vector(h, 0.0, 0.5)?,
            b_proj: self.linear(h, d)?,
            g_a: self.linear(hd, d)?,
            g_b: self.linear(q, hd)?,
            o_norm: self.vector(hd, 1.0, 0.1)?,
            o_proj: self.linear(d, q)?,
        })
    }

    fn mla(&mut self, c: &Glm5Config, with_indexer: bool) -> Result<Mla, BackendError> {
        let (d, h) = (c.hidden_size, c.num_attention_heads);
        let indexer = if with_indexer {
            let (hi, di) = (c.index_n_heads, c.index_head_dim);
            Some(Indexer {
                wq_b: self.linear(hi * di, c.q_lora_rank)?,
                k_gate_w: self.linear(2 * di + hi, d)?,
                k_norm_w: self.vector(di, 1.0, 0.1)?,
                k_norm_b: self.vector(di, 0.0, 0.1)?,
                ape: self.vector(c.index_kpool * di, 0.0, 0.5)?,
            })
        } else {
            None
        };
        let prec = self.prec;
        Ok(Mla {
            q_a: self.linear(c.q_lora_rank, d)?,
            q_a_norm: self.vector(c.q_lora_rank, 1.0, 0.1)?,
            q_b: self.linear(h * c.qk_nope_head_dim, c.q_lora_rank)?,
            kv_a: self.linear(c.kv_lora_rank, d)?,
            kv_a_norm: self.vector(c.kv_lora_rank, 1.0, 0.1)?,
            kv_b: self.matrix(h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank, prec)?,
            o_proj: self.linear(d, h * c.v_head_dim)?,
            indexer,
        })
    }

    fn moe(&mut self, c: &Glm5Config) -> Result<Moe, BackendError> {
        let (d, e, i) = (c.hidden_size, c.n_routed_experts, c.moe_intermediate_size);
        let prec = self.prec;
        Ok(Moe {
            router: self.linear_f32(e, d)?,
            correction_bias: self.vector(e, 0.0, 0.05)?,
            experts: match self.format {
                None => {
                    Experts::Stacked { gate_up: self.matrix(e * 2 * i, d, prec)?, down: self.matrix(e * d, i, prec)? }
                }
                Some(_) => {
                    let pairs = (0..e)
                        .map(|_| Ok::<_, BackendError>((self.weight(2 * i, d)?, self.weight(d, i)?)))
                        .collect::<Result<Vec<_>, _>>()?;
                    let grouped = GroupedPacked::build(self.gpu, &pairs)?;
                    Experts::PerExpert { pairs, grouped }
                }
            },
            inter: i,
            shared: self.mlp(i * c.n_shared_experts, d)?,
        })
    }
}

/// Every text weight of `c` on the device, seeded by `seed`; progress on stderr per layer (a
/// full-width MoE layer is 14 GB in bf16).
pub fn synthetic(
    gpu: &mut Gpu,
    c: &Glm5Config,
    prec: Precision,
    seed: u64,
    format: Option<PackedFormat>,
) -> Result<Glm5DeviceWeights, BackendError> {
    if format.is_some() {
        gpu.load_quant()?;
    }
    let mut mk = Maker { gpu, fill: Filler::new(seed), prec, bytes: 0, format };
    let d = c.hidden_size;
    let embed = mk.dense_linear(c.vocab_size, d)?;
    let mut layers = Vec::with_capacity(c.num_hidden_layers);
    for l in 0..c.num_hidden_layers {
        let mixer = match c.layer_types[l] {
            MixerKind::Kda => Mixer::Kda(mk.kda(c)?),
            MixerKind::Dsa => Mixer::Dsa(mk.mla(c, c.has_indexer(l))?),
        };
        let ffn = match c.mlp_layer_types[l] {
            FfnKind::Dense => Ffn::Dense(mk.mlp(c.intermediate_size, d)?),
            FfnKind::Moe => Ffn::Moe(mk.moe(c)?),
        };
        layers.push(Layer {
            attn_hc: mk.hyper_connection(c)?,
            ffn_hc: mk.hyper_connection(c)?,
            input_norm: mk.vector(d, 1.0, 0.1)?,
            post_norm: mk.vector(d, 1.0, 0.1)?,
            mixer,
            ffn,
        });
        mk.gpu.sync()?;
        eprintln!(
            "bench: layer {}/{} generated ({:?} mixer, {:?} FFN), {:.1} GB so far",
            l + 1,
            c.num_hidden_layers,
            c.layer_types[l],
            c.mlp_layer_types[l],
            mk.bytes as f64 / 1e9
        );
    }
    let norm = mk.vector(d, 1.0, 0.1)?;
    let lm_head = if c.tie_word_embeddings { None } else { Some(mk.dense_linear(c.vocab_size, d)?) };
    mk.gpu.sync()?;
    Ok(Glm5DeviceWeights { embed, layers, norm, lm_head, bytes: mk.bytes })
}
