//! `glm5_next`'s weights in device memory, loaded through the model's loader
//! (`model::glm5_next::weights`, the same names, shapes and stacking the CPU reads) into host f32
//! projections (the whole model at once: peak host memory is the model in f32), then uploaded
//! layer by layer, each host layer freed after its upload: the big matrices in the backend's storage precision,
//! the router and the mHC maps in f32 (the spec computes both in fp32), norms, biases, conv taps and
//! gate parameters in f32. Each MoE layer's experts are packed into one `[E, 2I, D]` gate/up and one
//! `[E, D, I]` down matrix, so a kernel can address any expert's rows.

use super::super::gpu::{DevBuf, Gpu, Precision};
use crate::backend::BackendError;
use crate::model::glm5_next::weights::{self as layout, LinearWeight};
use crate::model::glm5_next::Glm5Config;
use crate::model::tensor::to_f32;
use crate::model::{ModelError, WeightSource};

/// A projection as the model's loader hands it over: f32 rows on the host, before upload.
pub struct HostLinear {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl LinearWeight for HostLinear {
    fn load(w: &dyn WeightSource, base: &str, out: usize, inp: usize) -> Result<Self, ModelError> {
        crate::model::quantized::refuse_on_device(w, "cuda")?;
        let t = w.expect(&format!("{base}.weight"), &[out, inp])?;
        Ok(HostLinear { rows: out, cols: inp, data: to_f32(&t) })
    }

    fn from_f32(data: Vec<f32>, out: usize, inp: usize) -> Self {
        HostLinear { rows: out, cols: inp, data }
    }

    fn stack(parts: Vec<Self>) -> Result<Self, Vec<Self>> {
        if parts.is_empty() || parts.windows(2).any(|p| p[0].cols != p[1].cols) {
            return Err(parts);
        }
        let cols = parts[0].cols;
        let rows = parts.iter().map(|p| p.rows).sum();
        let mut data = Vec::with_capacity(rows * cols);
        for p in parts {
            data.extend(p.data);
        }
        Ok(HostLinear { rows, cols, data })
    }

    fn bytes(&self) -> usize {
        self.data.len() * 4
    }
}

/// A projection `[rows, cols]` on the device, in `prec`.
pub struct DevLinear {
    pub rows: usize,
    pub cols: usize,
    pub prec: Precision,
    pub buf: DevBuf,
}

pub fn upload_matrix(gpu: &Gpu, values: &[f32], prec: Precision) -> Result<DevBuf, BackendError> {
    match prec {
        Precision::F32 => gpu.upload(values),
        Precision::Bf16 => {
            let v: Vec<u16> = values.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
            gpu.upload(&v)
        }
    }
}

fn lin(gpu: &Gpu, l: &HostLinear, prec: Precision) -> Result<DevLinear, BackendError> {
    Ok(DevLinear { rows: l.rows, cols: l.cols, prec, buf: upload_matrix(gpu, &l.data, prec)? })
}

pub struct HyperConnection {
    /// `[(2+M)·M, M·D]`, f32.
    pub proj: DevLinear,
    pub base: DevBuf,
    pub scale: [f32; 3],
}

pub struct Kda {
    pub qkv: DevLinear,
    pub conv: DevBuf,
    pub f_a: DevLinear,
    pub f_b: DevLinear,
    pub dt_bias: DevBuf,
    pub a_log: DevBuf,
    pub b_proj: DevLinear,
    pub g_a: DevLinear,
    pub g_b: DevLinear,
    pub o_norm: DevBuf,
    pub o_proj: DevLinear,
}

pub struct Indexer {
    pub wq_b: DevLinear,
    pub k_gate_w: DevLinear,
    pub k_norm_w: DevBuf,
    pub k_norm_b: DevBuf,
    pub ape: DevBuf,
}

pub struct Mla {
    pub q_a: DevLinear,
    pub q_a_norm: DevBuf,
    pub q_b: DevLinear,
    pub kv_a: DevLinear,
    pub kv_a_norm: DevBuf,
    /// `[H·(d_n + d_v), r_kv]` in the storage precision (read by the attention kernel).
    pub kv_b: DevBuf,
    pub o_proj: DevLinear,
    pub indexer: Option<Indexer>,
}

pub enum Mixer {
    Kda(Kda),
    Dsa(Mla),
}

pub struct Mlp {
    pub gate_up: DevLinear,
    pub down: DevLinear,
}

pub struct Moe {
    /// `[E, D]`, f32.
    pub router: DevLinear,
    pub correction_bias: DevBuf,
    /// `[E, 2I, D]`.
    pub experts_gate_up: DevBuf,
    /// `[E, D, I]`.
    pub experts_down: DevBuf,
    pub inter: usize,
    pub shared: Mlp,
}

pub enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

pub struct Layer {
    pub attn_hc: HyperConnection,
    pub ffn_hc: HyperConnection,
    pub input_norm: DevBuf,
    pub post_norm: DevBuf,
    pub mixer: Mixer,
    pub ffn: Ffn,
}

pub struct Glm5DeviceWeights {
    pub embed: DevLinear,
    pub layers: Vec<Layer>,
    pub norm: DevBuf,
    /// `None` when tied to the embedding.
    pub lm_head: Option<DevLinear>,
    pub bytes: usize,
}

/// Load every text tensor of `c` from `w` onto the device.
pub fn load(
    gpu: &Gpu,
    c: &Glm5Config,
    w: &dyn WeightSource,
    prec: Precision,
) -> Result<Glm5DeviceWeights, BackendError> {
    crate::model::quantized::refuse_on_device(w, "cuda")?;
    let host: layout::Glm5Weights<HostLinear> = layout::load(c, w)?;
    let f32p = Precision::F32;
    let mut bytes = 0usize;
    let mut up = |v: &[f32]| -> Result<DevBuf, BackendError> {
        bytes += v.len() * 4;
        gpu.upload(v)
    };
    let hc = |h: &layout::HyperConnection<HostLinear>, up: &mut dyn FnMut(&[f32]) -> Result<DevBuf, BackendError>| {
        Ok::<_, BackendError>(HyperConnection { proj: lin(gpu, &h.proj, f32p)?, base: up(&h.base)?, scale: h.scale })
    };
    let mlp = |m: &layout::Mlp<HostLinear>| -> Result<Mlp, BackendError> {
        Ok(Mlp { gate_up: lin(gpu, &m.gate_up, prec)?, down: lin(gpu, &m.down, prec)? })
    };
    let mut layers = Vec::with_capacity(host.layers.len());
    for l in host.layers {
        let mixer = match &l.mixer {
            layout::Mixer::Kda(k) => Mixer::Kda(Kda {
                qkv: lin(gpu, &k.qkv, prec)?,
                conv: up(&k.conv)?,
                f_a: lin(gpu, &k.f_a, prec)?,
                f_b: lin(gpu, &k.f_b, prec)?,
                dt_bias: up(&k.dt_bias)?,
                a_log: up(&k.a_log)?,
                b_proj: lin(gpu, &k.b_proj, prec)?,
                g_a: lin(gpu, &k.g_a, prec)?,
                g_b: lin(gpu, &k.g_b, prec)?,
                o_norm: up(&k.o_norm)?,
                o_proj: lin(gpu, &k.o_proj, prec)?,
            }),
            layout::Mixer::Dsa(m) => Mixer::Dsa(Mla {
                q_a: lin(gpu, &m.q_a, prec)?,
                q_a_norm: up(&m.q_a_norm)?,
                q_b: lin(gpu, &m.q_b, prec)?,
                kv_a: lin(gpu, &m.kv_a, prec)?,
                kv_a_norm: up(&m.kv_a_norm)?,
                kv_b: upload_matrix(gpu, &m.kv_b, prec)?,
                o_proj: lin(gpu, &m.o_proj, prec)?,
                indexer: match &m.indexer {
                    Some(ix) => Some(Indexer {
                        wq_b: lin(gpu, &ix.wq_b, prec)?,
                        k_gate_w: lin(gpu, &ix.k_gate_w, prec)?,
                        k_norm_w: up(&ix.k_norm_w)?,
                        k_norm_b: up(&ix.k_norm_b)?,
                        ape: up(&ix.ape)?,
                    }),
                    None => None,
                },
            }),
        };
        let ffn = match &l.ffn {
            layout::Ffn::Dense(m) => Ffn::Dense(mlp(m)?),
            layout::Ffn::Moe(m) => {
                let gu: Vec<f32> = m.experts.iter().flat_map(|e| e.gate_up.data.iter().copied()).collect();
                let down: Vec<f32> = m.experts.iter().flat_map(|e| e.down.data.iter().copied()).collect();
                Ffn::Moe(Moe {
                    router: lin(gpu, &m.router, f32p)?,
                    correction_bias: up(&m.correction_bias)?,
                    experts_gate_up: upload_matrix(gpu, &gu, prec)?,
                    experts_down: upload_matrix(gpu, &down, prec)?,
                    inter: c.moe_intermediate_size,
                    shared: mlp(&m.shared)?,
                })
            }
        };
        layers.push(Layer {
            attn_hc: hc(&l.attn_hc, &mut up)?,
            ffn_hc: hc(&l.ffn_hc, &mut up)?,
            input_norm: up(&l.input_norm)?,
            post_norm: up(&l.post_norm)?,
            mixer,
            ffn,
        });
    }
    let norm = up(&host.norm)?;
    let embed = lin(gpu, &host.embed, prec)?;
    let lm_head = host.lm_head.as_ref().map(|h| lin(gpu, h, prec)).transpose()?;
    let mut w = Glm5DeviceWeights { embed, layers, norm, lm_head, bytes: 0 };
    w.bytes = bytes + w.linear_bytes();
    Ok(w)
}

impl Glm5DeviceWeights {
    fn linear_bytes(&self) -> usize {
        let l = |x: &DevLinear| x.buf.bytes();
        let mut total = l(&self.embed) + self.lm_head.as_ref().map_or(0, l);
        for layer in &self.layers {
            total += l(&layer.attn_hc.proj) + l(&layer.ffn_hc.proj);
            total += match &layer.mixer {
                Mixer::Kda(k) => {
                    l(&k.qkv) + l(&k.f_a) + l(&k.f_b) + l(&k.b_proj) + l(&k.g_a) + l(&k.g_b) + l(&k.o_proj)
                }
                Mixer::Dsa(m) => {
                    l(&m.q_a)
                        + l(&m.q_b)
                        + l(&m.kv_a)
                        + m.kv_b.bytes()
                        + l(&m.o_proj)
                        + m.indexer.as_ref().map_or(0, |i| l(&i.wq_b) + l(&i.k_gate_w))
                }
            };
            total += match &layer.ffn {
                Ffn::Dense(m) => l(&m.gate_up) + l(&m.down),
                Ffn::Moe(m) => {
                    l(&m.router)
                        + m.experts_gate_up.bytes()
                        + m.experts_down.bytes()
                        + l(&m.shared.gate_up)
                        + l(&m.shared.down)
                }
            };
        }
        total
    }
}
