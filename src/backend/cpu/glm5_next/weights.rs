//! `glm5_next`'s weights as the CPU holds them: the model's loader (`model::glm5_next::weights`)
//! instantiated with [`CpuLinear`] projections, f32 rows or the checkpoint's quantized blocks.

use crate::backend::cpu::linear::{CpuLinear, WeightRows};
use crate::model::glm5_next::weights::{self as layout, LinearWeight};
use crate::model::glm5_next::Glm5Config;
use crate::model::{ModelError, WeightSource};

pub type HyperConnection = layout::HyperConnection<CpuLinear>;
pub type KdaWeights = layout::KdaWeights<CpuLinear>;
pub type IndexerWeights = layout::IndexerWeights<CpuLinear>;
pub type MlaWeights = layout::MlaWeights<CpuLinear>;
pub type Mixer = layout::Mixer<CpuLinear>;
pub type Mlp = layout::Mlp<CpuLinear>;
pub type Moe = layout::Moe<CpuLinear>;
pub type Ffn = layout::Ffn<CpuLinear>;
pub type Glm5Weights = layout::Glm5Weights<CpuLinear>;

impl LinearWeight for CpuLinear {
    fn load(w: &dyn WeightSource, base: &str, out: usize, inp: usize) -> Result<Self, ModelError> {
        CpuLinear::load(w, base, out, inp, false)
    }

    fn from_f32(data: Vec<f32>, out: usize, inp: usize) -> Self {
        CpuLinear { rows: out, cols: inp, weight: WeightRows::F32(data), bias: None }
    }

    /// Stacked in one format where possible, else part by part (a quantized projection beside
    /// a plain parameter, as the indexer's `wk` beside `index_kpool_compress_gate`).
    fn stack(parts: Vec<Self>) -> Result<Self, Vec<Self>> {
        CpuLinear::stack_mixed(parts)
    }

    /// As f32 (the CPU computes in f32, whatever the rows are stored as).
    fn bytes(&self) -> usize {
        self.rows * self.cols * 4
    }
}

/// Load every text tensor of `c` from `w` as CPU projections.
pub fn load(c: &Glm5Config, w: &dyn WeightSource) -> Result<Glm5Weights, ModelError> {
    layout::load(c, w)
}
