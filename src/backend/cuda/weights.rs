//! Model weights in device memory: matrices in the backend's storage precision (f16/f32/bf16
//! converted and GGUF blocks dequantized at load, through the `WeightSource`), q/k/v and
//! gate/up stacked into one matrix each so one GEMM computes them; norms and biases in f32.
//! Or seeded random weights generated on the device, for benchmarks of any size.

use rayon::prelude::*;

use super::gpu::{cfg, grid_for, DevBuf, Gpu, Precision};
use crate::backend::BackendError;
use crate::config::LlamaConfig;
use crate::launch;
use crate::model::llama::{LinearSpec, LlamaSpec};
use crate::model::tensor::to_f32;
use crate::model::WeightSource;

pub struct LayerWeights {
    pub input_norm: DevBuf,
    /// `[q_dim + 2·kv_dim, hidden]`.
    pub qkv: DevBuf,
    pub qkv_bias: Option<DevBuf>,
    pub q_norm: Option<DevBuf>,
    pub k_norm: Option<DevBuf>,
    pub o: DevBuf,
    pub o_bias: Option<DevBuf>,
    pub post_norm: DevBuf,
    /// `[2·intermediate, hidden]`: gate rows, then up rows.
    pub gate_up: DevBuf,
    pub gate_up_bias: Option<DevBuf>,
    pub down: DevBuf,
    pub down_bias: Option<DevBuf>,
}

pub struct DeviceWeights {
    pub embed: DevBuf,
    pub layers: Vec<LayerWeights>,
    pub final_norm: DevBuf,
    /// `None` when tied to the embedding.
    pub lm_head: Option<DevBuf>,
}

impl DeviceWeights {
    /// Bytes of matrices and vectors on the device.
    pub fn bytes(&self) -> usize {
        let opt = |b: &Option<DevBuf>| b.as_ref().map_or(0, DevBuf::bytes);
        self.embed.bytes()
            + self.final_norm.bytes()
            + opt(&self.lm_head)
            + self
                .layers
                .iter()
                .map(|l| {
                    l.input_norm.bytes()
                        + l.qkv.bytes()
                        + opt(&l.qkv_bias)
                        + opt(&l.q_norm)
                        + opt(&l.k_norm)
                        + l.o.bytes()
                        + opt(&l.o_bias)
                        + l.post_norm.bytes()
                        + l.gate_up.bytes()
                        + opt(&l.gate_up_bias)
                        + l.down.bytes()
                        + opt(&l.down_bias)
                })
                .sum::<usize>()
    }

    /// Load every tensor of `w`, converting matrices to `prec`.
    pub fn load(gpu: &Gpu, c: &LlamaConfig, w: &dyn WeightSource, prec: Precision) -> Result<Self, BackendError> {
        let spec = LlamaSpec::new(c);
        let h = c.hidden_size;
        let matrix = |parts: &[&LinearSpec]| -> Result<DevBuf, BackendError> {
            let mut all = Vec::new();
            for p in parts {
                all.extend(to_f32(&w.expect(&p.weight(), &[p.out, p.inp])?));
            }
            upload_matrix(gpu, &all, prec)
        };
        let bias = |parts: &[&LinearSpec]| -> Result<Option<DevBuf>, BackendError> {
            if !parts[0].bias {
                return Ok(None);
            }
            let mut all = Vec::new();
            for p in parts {
                all.extend(to_f32(&w.expect(&p.bias_name(), &[p.out])?));
            }
            Ok(Some(gpu.upload(&all)?))
        };
        let vector =
            |name: &str, len: usize| -> Result<DevBuf, BackendError> { gpu.upload(&to_f32(&w.expect(name, &[len])?)) };
        let mut layers = Vec::with_capacity(spec.layers.len());
        for l in &spec.layers {
            layers.push(LayerWeights {
                input_norm: vector(&l.input_norm, h)?,
                qkv: matrix(&[&l.q, &l.k, &l.v])?,
                qkv_bias: bias(&[&l.q, &l.k, &l.v])?,
                q_norm: l.q_norm.as_ref().map(|n| vector(n, c.head_dim)).transpose()?,
                k_norm: l.k_norm.as_ref().map(|n| vector(n, c.head_dim)).transpose()?,
                o: matrix(&[&l.o])?,
                o_bias: bias(&[&l.o])?,
                post_norm: vector(&l.post_attention_norm, h)?,
                gate_up: matrix(&[&l.gate, &l.up])?,
                gate_up_bias: bias(&[&l.gate, &l.up])?,
                down: matrix(&[&l.down])?,
                down_bias: bias(&[&l.down])?,
            });
        }
        let embed = upload_matrix(gpu, &to_f32(&w.expect(&spec.embed, &[c.vocab_size, h])?), prec)?;
        let lm_head = if c.tie_word_embeddings { None } else { Some(matrix(&[&spec.lm_head])?) };
        Ok(DeviceWeights { embed, layers, final_norm: vector(&spec.final_norm, h)?, lm_head })
    }

    /// Seeded uniform weights made on the device with the distributions of
    /// `model::synthetic::SyntheticWeights` (matrices ±1/√fan_in, embedding ±1, norms 1 ± 0.1,
    /// biases ±0.1); not the same values, which are drawn on the host there.
    pub fn synthetic(gpu: &mut Gpu, c: &LlamaConfig, prec: Precision, seed: u64) -> Result<Self, BackendError> {
        let spec = LlamaSpec::new(c);
        let h = c.hidden_size;
        let mut f = Filler { counter: seed.wrapping_mul(1_000_003) };
        let lin =
            |gpu: &mut Gpu, f: &mut Filler, parts: &[&LinearSpec]| -> Result<(DevBuf, Option<DevBuf>), BackendError> {
                let n: usize = parts.iter().map(|p| p.out * p.inp).sum();
                let w = f.fill(gpu, n, prec, 0.0, 1.0 / (parts[0].inp as f32).sqrt())?;
                let b = if parts[0].bias {
                    Some(f.fill(gpu, parts.iter().map(|p| p.out).sum(), Precision::F32, 0.0, 0.1)?)
                } else {
                    None
                };
                Ok((w, b))
            };
        let mut layers = Vec::with_capacity(spec.layers.len());
        for l in &spec.layers {
            let (qkv, qkv_bias) = lin(gpu, &mut f, &[&l.q, &l.k, &l.v])?;
            let (o, o_bias) = lin(gpu, &mut f, &[&l.o])?;
            let (gate_up, gate_up_bias) = lin(gpu, &mut f, &[&l.gate, &l.up])?;
            let (down, down_bias) = lin(gpu, &mut f, &[&l.down])?;
            let q_norm = if c.qk_norm { Some(f.fill(gpu, c.head_dim, Precision::F32, 1.0, 0.1)?) } else { None };
            let k_norm = if c.qk_norm { Some(f.fill(gpu, c.head_dim, Precision::F32, 1.0, 0.1)?) } else { None };
            layers.push(LayerWeights {
                input_norm: f.fill(gpu, h, Precision::F32, 1.0, 0.1)?,
                qkv,
                qkv_bias,
                q_norm,
                k_norm,
                o,
                o_bias,
                post_norm: f.fill(gpu, h, Precision::F32, 1.0, 0.1)?,
                gate_up,
                gate_up_bias,
                down,
                down_bias,
            });
        }
        let embed = f.fill(gpu, c.vocab_size * h, prec, 0.0, 1.0)?;
        let lm_head = if c.tie_word_embeddings {
            None
        } else {
            Some(f.fill(gpu, c.vocab_size * h, prec, 0.0, 1.0 / (h as f32).sqrt())?)
        };
        let final_norm = f.fill(gpu, h, Precision::F32, 1.0, 0.1)?;
        gpu.sync()?;
        Ok(DeviceWeights { embed, layers, final_norm, lm_head })
    }
}

fn upload_matrix(gpu: &Gpu, values: &[f32], prec: Precision) -> Result<DevBuf, BackendError> {
    match prec {
        Precision::F32 => gpu.upload(values),
        Precision::Bf16 => {
            let v: Vec<u16> = values.par_iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
            gpu.upload(&v)
        }
    }
}

/// Seeded device fills, each tensor with its own stream of the counter-based generator.
struct Filler {
    counter: u64,
}

impl Filler {
    fn fill(&mut self, gpu: &mut Gpu, n: usize, p: Precision, center: f32, scale: f32) -> Result<DevBuf, BackendError> {
        self.counter = self.counter.wrapping_add(1);
        let b = gpu.alloc(n * p.bytes())?;
        let f = gpu.func("llama", &format!("fill_uniform_{}", p.suffix()))?;
        let (ptr, n64, seed) = (b.ptr(), n as i64, self.counter);
        launch!(gpu, f, cfg((grid_for(n, 256).min(8192), 1), 256, 0), &ptr, &n64, &seed, &center, &scale)?;
        Ok(b)
    }
}
