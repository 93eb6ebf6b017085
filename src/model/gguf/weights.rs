//! Serving a GGUF file's tensors under HF names: the GGUF→HF naming and undoing llama.cpp's q/k
//! row permutation (done once, on first access).

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use super::file::GgufFile;
use crate::model::{DType, OwnedTensor, TensorView, WeightSource};

/// The HF name of a llama-family GGUF tensor, or `None` for tensors the model does not use.
pub fn hf_tensor_name(gguf: &str) -> Option<String> {
    let (base, suffix) = gguf.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let top = match base {
        "token_embd" => Some("model.embed_tokens"),
        "output_norm" => Some("model.norm"),
        "output" => Some("lm_head"),
        _ => None,
    };
    if let Some(t) = top {
        return Some(format!("{t}.{suffix}"));
    }
    let (layer, part) = base.strip_prefix("blk.")?.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let hf = match part {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// Undo llama.cpp's converter permutation of q/k rows (`LlamaModel.permute`:
/// `w.reshape(n_head, 2, hd/2, ...).swapaxes(1, 2)`), which interleaves each head's two
/// rotary halves for GGML's adjacent-pair RoPE. Our model uses HF's rotate-half RoPE, so HF row
/// `h*hd + j*hd/2 + i` is GGUF row `h*hd + 2*i + j`. Rows move whole and quantization blocks
/// run along a row, so quantized data is permuted without requantising.
pub fn unpermute_qk_rows(data: &[u8], rows: usize, n_head: usize) -> Vec<u8> {
    let row_bytes = data.len() / rows;
    let hd = rows / n_head;
    let half = hd / 2;
    let mut out = vec![0u8; data.len()];
    for h in 0..n_head {
        for j in 0..2 {
            for i in 0..half {
                let src = (h * hd + 2 * i + j) * row_bytes;
                let dst = (h * hd + j * half + i) * row_bytes;
                out[dst..dst + row_bytes].copy_from_slice(&data[src..src + row_bytes]);
            }
        }
    }
    out
}

pub(super) struct Served {
    pub(super) index: usize,
    pub(super) dtype: DType,
    /// `Some(n_head)` for q/k tensors whose rows must be un-permuted.
    pub(super) unpermute: Option<usize>,
    pub(super) owned: OnceLock<OwnedTensor>,
}

/// Weights of a `llama` GGUF served under HF names: zero-copy views of the map, except q/k
/// projections, which are un-permuted into owned buffers on first access.
pub struct GgufWeights {
    pub(super) file: GgufFile,
    pub(super) by_hf: HashMap<String, Served>,
}

impl GgufWeights {
    pub fn gguf(&self) -> &GgufFile {
        &self.file
    }
}

impl WeightSource for GgufWeights {
    fn origin(&self) -> &Path {
        self.file.path()
    }

    fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let s = self.by_hf.get(name)?;
        let info = &self.file.tensor_infos()[s.index];
        match s.unpermute {
            None => Some(TensorView { dtype: s.dtype, shape: &info.shape, data: self.file.tensor_bytes(info) }),
            Some(n_head) => {
                let t = s.owned.get_or_init(|| OwnedTensor {
                    dtype: s.dtype,
                    shape: info.shape.clone(),
                    data: unpermute_qk_rows(self.file.tensor_bytes(info), info.shape[0], n_head),
                });
                Some(t.view())
            }
        }
    }

    fn tensor_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.by_hf.keys().cloned().collect();
        v.sort();
        v
    }
}
