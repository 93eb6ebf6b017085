//! `glm5_next`'s weights in device memory, loaded through the model's loader
//! (`model::glm5_next::weights`, the same names, shapes and stacking the CPU reads) into host
//! projections (f32 rows, or codes and scales as a quantized checkpoint stores them), then uploaded
//! layer by layer, each host layer freed after its upload: dense matrices in the backend's storage
//! precision, packed ones as stored (FP8 blocks, int4, NVFP4: `backend::cuda::quant`, the kernels
//! the llama family uses), the router and the mHC maps in f32 (the spec computes both in fp32),
//! norms, biases, conv taps and gate parameters in f32. A MoE layer whose experts are all dense is
//! packed into one `[E, 2I, D]` gate/up and one `[E, D, I]` down matrix, so a kernel can address any
//! expert's rows; quantized experts stay one projection pair per expert.

use super::super::gpu::{DevBuf, Gpu, Precision};
use super::super::quant::{DevPacked, LinearWeight as DevWeight};
use crate::backend::BackendError;
use crate::model::glm5_next::weights::{self as layout, LinearWeight};
use crate::model::glm5_next::Glm5Config;
use crate::model::quant::packed::{PackedFormat, PackedRows};
use crate::model::tensor::to_f32;
use crate::model::{quantized, ModelError, WeightSource};

/// A projection as the model's loader hands it over, before upload.
#[derive(Debug)]
pub enum HostLinear {
    /// `[rows, cols]` f32.
    Dense { rows: usize, cols: usize, data: Vec<f32> },
    /// Codes and scales as the checkpoint stores them.
    Packed(PackedRows),
    /// Parts of different formats stacked by rows (a quantized projection beside a plain one).
    Parts(Vec<HostLinear>),
}

impl HostLinear {
    pub fn rows(&self) -> usize {
        match self {
            HostLinear::Dense { rows, .. } => *rows,
            HostLinear::Packed(p) => p.rows,
            HostLinear::Parts(parts) => parts.iter().map(HostLinear::rows).sum(),
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            HostLinear::Dense { cols, .. } => *cols,
            HostLinear::Packed(p) => p.cols,
            HostLinear::Parts(parts) => parts.first().map_or(0, HostLinear::cols),
        }
    }

    /// The f32 rows, for tensors a kernel reads as a plain matrix (embeddings, the vision
    /// tower); `what` names the tensor in the error.
    pub fn dense(&self, what: &str) -> Result<&[f32], BackendError> {
        match self {
            HostLinear::Dense { data, .. } => Ok(data),
            _ => Err(BackendError::Device(format!(
                "glm5_next on CUDA reads {what} as a plain matrix; this checkpoint stores it quantized"
            ))),
        }
    }

    fn is_packed(&self) -> bool {
        match self {
            HostLinear::Dense { .. } => false,
            HostLinear::Packed(_) => true,
            HostLinear::Parts(parts) => parts.iter().any(HostLinear::is_packed),
        }
    }
}

impl LinearWeight for HostLinear {
    fn load(w: &dyn WeightSource, base: &str, out: usize, inp: usize) -> Result<Self, ModelError> {
        if let Some(packed) = quantized::load_linear(w, base, out, inp)? {
            return Ok(HostLinear::Packed(packed));
        }
        let t = w.expect(&format!("{base}.weight"), &[out, inp])?;
        Ok(HostLinear::Dense { rows: out, cols: inp, data: to_f32(&t) })
    }

    fn from_f32(data: Vec<f32>, out: usize, inp: usize) -> Self {
        HostLinear::Dense { rows: out, cols: inp, data }
    }

    /// Consecutive parts of one kind (f32, or packed in one format) become one matrix; parts of
    /// different kinds stay side by side, each writing its own output columns.
    fn stack(parts: Vec<Self>) -> Result<Self, Vec<Self>> {
        if parts.is_empty() || parts.windows(2).any(|p| p[0].cols() != p[1].cols()) {
            return Err(parts);
        }
        let flat = parts.into_iter().flat_map(|p| match p {
            HostLinear::Parts(inner) => inner,
            one => vec![one],
        });
        let mut runs: Vec<HostLinear> = Vec::new();
        for part in flat {
            let merged = match (runs.pop(), part) {
                (Some(HostLinear::Dense { rows, cols, mut data }), HostLinear::Dense { rows: r, data: d, .. }) => {
                    data.extend(d);
                    vec![HostLinear::Dense { rows: rows + r, cols, data }]
                }
                (Some(HostLinear::Packed(a)), HostLinear::Packed(b)) if a.format == b.format => {
                    vec![HostLinear::Packed(
                        PackedRows::concat(vec![a, b]).unwrap_or_else(|_| unreachable!("one format, one width")),
                    )]
                }
                (Some(last), part) => vec![last, part],
                (None, part) => vec![part],
            };
            runs.extend(merged);
        }
        Ok(if runs.len() == 1 { runs.remove(0) } else { HostLinear::Parts(runs) })
    }

    fn bytes(&self) -> usize {
        match self {
            HostLinear::Dense { data, .. } => data.len() * 4,
            HostLinear::Packed(p) => p.bytes(),
            HostLinear::Parts(parts) => parts.iter().map(LinearWeight::bytes).sum(),
        }
    }
}

/// A projection `[rows, cols]` on the device: dense in `prec`, or packed as stored (whose kernels
/// take their input in `prec`).
pub struct DevLinear {
    pub rows: usize,
    pub cols: usize,
    pub prec: Precision,
    pub w: DevWeight,
}

impl DevLinear {
    /// A dense `[rows, cols]` matrix already on the device in `prec`.
    pub fn dense(rows: usize, cols: usize, prec: Precision, buf: DevBuf) -> DevLinear {
        DevLinear { rows, cols, prec, w: DevWeight::Dense { buf, rows } }
    }

    /// The matrix's address, for kernels that read it as a plain matrix (embedding rows, the
    /// mHC maps); a packed projection there is a loader bug, reported as an error.
    pub fn dense_ptr(&self) -> Result<u64, BackendError> {
        self.w.dense().map(DevBuf::ptr).ok_or_else(|| {
            BackendError::Device(format!(
                "a packed [{}, {}] projection where a plain matrix is read",
                self.rows, self.cols
            ))
        })
    }

    pub fn bytes(&self) -> usize {
        self.w.bytes()
    }
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

/// A host projection on the device: f32 rows in `prec`, packed ones as stored.
fn dev_weight(gpu: &Gpu, l: &HostLinear, prec: Precision) -> Result<DevWeight, BackendError> {
    Ok(match l {
        HostLinear::Dense { rows, data, .. } => DevWeight::Dense { buf: upload_matrix(gpu, data, prec)?, rows: *rows },
        HostLinear::Packed(p) => DevWeight::Packed(DevPacked::upload(gpu, p)?),
        HostLinear::Parts(parts) => {
            DevWeight::Parts(parts.iter().map(|p| dev_weight(gpu, p, prec)).collect::<Result<_, _>>()?)
        }
    })
}

fn lin(gpu: &Gpu, l: &HostLinear, prec: Precision) -> Result<DevLinear, BackendError> {
    Ok(DevLinear { rows: l.rows(), cols: l.cols(), prec, w: dev_weight(gpu, l, prec)? })
}

/// A projection read as a plain matrix (the mHC maps, the router: f32 by the spec; embeddings).
fn plain(gpu: &Gpu, l: &HostLinear, prec: Precision, what: &str) -> Result<DevLinear, BackendError> {
    Ok(DevLinear::dense(l.rows(), l.cols(), prec, upload_matrix(gpu, l.dense(what)?, prec)?))
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

/// The routed experts of a MoE layer.
pub enum Experts {
    /// Every expert dense in the storage precision, stacked so a kernel addresses any expert's
    /// rows: gate/up `[E, 2I, D]`, down `[E, D, I]`.
    Stacked { gate_up: DevBuf, down: DevBuf },
    /// A quantized checkpoint's experts, one (gate/up `[2I, D]`, down `[D, I]`) pair each, as
    /// stored; `grouped` when every matrix is packed in one format (decode steps then run them
    /// through `quant_moe_grouped`, cuda/quant_gemv.cu).
    PerExpert { pairs: Vec<(DevWeight, DevWeight)>, grouped: Option<GroupedPacked> },
}

/// Per-expert pointer tables (`ExpertPacked` in cuda/quant_gemv.cu) of experts all packed in
/// `format`, so one launch reaches any expert's codes and scales.
pub struct GroupedPacked {
    pub format: PackedFormat,
    pub gate_up: DevBuf,
    pub down: DevBuf,
}

impl GroupedPacked {
    /// `None` unless every gate/up and down matrix is one packed matrix of the same format.
    pub fn build(gpu: &Gpu, pairs: &[(DevWeight, DevWeight)]) -> Result<Option<GroupedPacked>, BackendError> {
        fn packed(w: &DevWeight) -> Option<&DevPacked> {
            match w {
                DevWeight::Packed(p) => Some(p),
                _ => None,
            }
        }
        let Some(format) = pairs.first().and_then(|(gu, _)| packed(gu)).map(|p| p.format) else { return Ok(None) };
        let mut tables = [Vec::new(), Vec::new()];
        for (gu, down) in pairs {
            for (table, w) in tables.iter_mut().zip([gu, down]) {
                let Some(p) = packed(w).filter(|p| p.format == format) else { return Ok(None) };
                let ptr = |b: &Option<DevBuf>| b.as_ref().map_or(0, DevBuf::ptr);
                table.extend([p.codes.ptr(), ptr(&p.scales), ptr(&p.scale_codes), ptr(&p.row_global)]);
            }
        }
        let [gate_up, down] = tables;
        Ok(Some(GroupedPacked { format, gate_up: gpu.upload(&gate_up)?, down: gpu.upload(&down)? }))
    }
}

pub struct Moe {
    /// `[E, D]`, f32.
    pub router: DevLinear,
    pub correction_bias: DevBuf,
    pub experts: Experts,
    pub inter: usize,
    pub shared: Mlp,
}

// One per layer, built once at load and never moved in a step: the size gap costs nothing.
#[allow(clippy::large_enum_variant)]
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
    let host: layout::Glm5Weights<HostLinear> = layout::load(c, w)?;
    let f32p = Precision::F32;
    let mut bytes = 0usize;
    let mut up = |v: &[f32]| -> Result<DevBuf, BackendError> {
        bytes += v.len() * 4;
        gpu.upload(v)
    };
    let hc = |h: &layout::HyperConnection<HostLinear>, up: &mut dyn FnMut(&[f32]) -> Result<DevBuf, BackendError>| {
        Ok::<_, BackendError>(HyperConnection {
            proj: plain(gpu, &h.proj, f32p, "an mHC map")?,
            base: up(&h.base)?,
            scale: h.scale,
        })
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
                let experts = if m.experts.iter().any(|e| e.gate_up.is_packed() || e.down.is_packed()) {
                    let pair = |e: &layout::Mlp<HostLinear>| {
                        Ok::<_, BackendError>((dev_weight(gpu, &e.gate_up, prec)?, dev_weight(gpu, &e.down, prec)?))
                    };
                    let pairs: Vec<_> = m.experts.iter().map(pair).collect::<Result<_, _>>()?;
                    Experts::PerExpert { grouped: GroupedPacked::build(gpu, &pairs)?, pairs }
                } else {
                    let mut gu =
                        Vec::with_capacity(m.experts.iter().map(|e| e.gate_up.rows() * e.gate_up.cols()).sum());
                    let mut down = Vec::with_capacity(m.experts.iter().map(|e| e.down.rows() * e.down.cols()).sum());
                    for e in &m.experts {
                        gu.extend_from_slice(e.gate_up.dense("an expert's gate/up")?);
                        down.extend_from_slice(e.down.dense("an expert's down")?);
                    }
                    Experts::Stacked { gate_up: upload_matrix(gpu, &gu, prec)?, down: upload_matrix(gpu, &down, prec)? }
                };
                Ffn::Moe(Moe {
                    router: plain(gpu, &m.router, f32p, "the router")?,
                    correction_bias: up(&m.correction_bias)?,
                    experts,
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
    let embed = plain(gpu, &host.embed, prec, "the embedding")?;
    let lm_head = host.lm_head.as_ref().map(|h| lin(gpu, h, prec)).transpose()?;
    let mut w = Glm5DeviceWeights { embed, layers, norm, lm_head, bytes: 0 };
    w.bytes = bytes + w.linear_bytes();
    Ok(w)
}

impl Glm5DeviceWeights {
    /// Every matrix the text model multiplies that is held as a device weight (projections, mHC
    /// maps, router, embedding, head, packed experts), and the bytes of those held as plain
    /// buffers beside them (MLA's absorbed `kv_b`, stacked experts, the grouped-expert pointer
    /// tables): the one walk the byte count and the dequantize scratch's size are read from.
    fn matrices(&self) -> (Vec<&DevWeight>, usize) {
        let mut all: Vec<&DevWeight> = vec![&self.embed.w];
        all.extend(self.lm_head.as_ref().map(|h| &h.w));
        let mut plain = 0;
        for layer in &self.layers {
            all.extend([&layer.attn_hc.proj.w, &layer.ffn_hc.proj.w]);
            match &layer.mixer {
                Mixer::Kda(k) => {
                    all.extend([&k.qkv, &k.f_a, &k.f_b, &k.b_proj, &k.g_a, &k.g_b, &k.o_proj].map(|l| &l.w))
                }
                Mixer::Dsa(m) => {
                    all.extend([&m.q_a, &m.q_b, &m.kv_a, &m.o_proj].map(|l| &l.w));
                    all.extend(m.indexer.iter().flat_map(|i| [&i.wq_b.w, &i.k_gate_w.w]));
                    plain += m.kv_b.bytes();
                }
            }
            match &layer.ffn {
                Ffn::Dense(m) => all.extend([&m.gate_up.w, &m.down.w]),
                Ffn::Moe(m) => {
                    all.extend([&m.router.w, &m.shared.gate_up.w, &m.shared.down.w]);
                    match &m.experts {
                        Experts::Stacked { gate_up, down } => plain += gate_up.bytes() + down.bytes(),
                        Experts::PerExpert { pairs, grouped } => {
                            all.extend(pairs.iter().flat_map(|(gu, d)| [gu, d]));
                            plain += grouped.as_ref().map_or(0, |g| g.gate_up.bytes() + g.down.bytes());
                        }
                    }
                }
            }
        }
        (all, plain)
    }

    /// Elements of the largest packed matrix (the dequantize scratch's size), 0 if none.
    pub fn max_packed_elems(&self) -> usize {
        self.matrices().0.into_iter().map(DevWeight::max_packed_elems).max().unwrap_or(0)
    }

    fn linear_bytes(&self) -> usize {
        let (matrices, plain) = self.matrices();
        matrices.into_iter().map(DevWeight::bytes).sum::<usize>() + plain
    }
}
