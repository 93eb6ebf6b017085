//! Raw weight tensors as stored on disk: element types (plain and block-quantized) and borrowed
//! views into memory-mapped files. Shapes are row-major, outermost dimension first (the PyTorch
//! convention); GGUF's reversed `ne` order is normalised by the GGUF reader.

use std::fmt;

/// Element type of a stored tensor. Quantized types are stored in blocks along the innermost
/// dimension (the GGML layouts). Variants carry GGML's type names (`Q4_K`).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F16,
    BF16,
    /// 32 values: f16 scale `d`, then 32 × i8. value = d · q.
    Q8_0,
    /// 32 values: f16 scale `d`, then 16 bytes of 4-bit codes. value = d · (q − 8).
    Q4_0,
    /// 32 values: f16 scale `d`, f16 min `m`, then 16 bytes of 4-bit codes. value = d · q + m.
    Q4_1,
    /// 256 values (8 sub-blocks of 32): f16 `d`, f16 `dmin`, 12 bytes of 6-bit sub-block scales
    /// and mins, 128 bytes of 4-bit codes. value = d · sc · q − dmin · m.
    Q4_K,
    /// As [`DType::Q4_K`] plus 32 bytes holding each code's fifth bit (codes 0..31).
    Q5_K,
    /// 256 values (16 groups of 16): 128 bytes of low 4 bits, 64 bytes of high 2 bits, 16 i8
    /// group scales, f16 `d` (last). value = d · sc · (q − 32).
    Q6_K,
}

impl DType {
    /// Number of elements in one storage block.
    pub fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => 32,
            DType::Q4_K | DType::Q5_K | DType::Q6_K => 256,
        }
    }

    /// Bytes of one storage block.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q4_K => 144,
            DType::Q5_K => 176,
            DType::Q6_K => 210,
        }
    }

    /// Bytes needed for `elems` elements, or `None` when `elems` is not a whole number of blocks.
    pub fn storage_bytes(self, elems: usize) -> Option<usize> {
        let be = self.block_elems();
        elems.is_multiple_of(be).then(|| elems / be * self.block_bytes())
    }

    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q4_K => "Q4_K",
            DType::Q5_K => "Q5_K",
            DType::Q6_K => "Q6_K",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A tensor borrowed from a weight file (usually a memory map).
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub dtype: DType,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

impl TensorView<'_> {
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }
}

/// An owned tensor, used where a loader has to rewrite data (e.g. un-permuting GGUF q/k rows).
#[derive(Clone, Debug)]
pub struct OwnedTensor {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl OwnedTensor {
    pub fn view(&self) -> TensorView<'_> {
        TensorView { dtype: self.dtype, shape: &self.shape, data: &self.data }
    }
}

/// Decode one tensor (any dtype) to f32, row-major.
pub fn to_f32(view: &TensorView<'_>) -> Vec<f32> {
    let n = view.elem_count();
    let mut out = vec![0f32; n];
    crate::model::quant::dequantize_into(view.dtype, view.data, &mut out);
    out
}
