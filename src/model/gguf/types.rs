//! GGUF element types (GGML type ids, block sizes) and metadata values: the vocabulary of the
//! container format, with no file access.

use crate::model::DType;

pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Tensor data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// GGML tensors have at most four dimensions; llama.cpp rejects more.
pub(super) const MAX_DIMS: usize = 4;

/// A GGML tensor element type id, as stored in a GGUF tensor info.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GgmlType(pub u32);

/// (id, name, elements per block, bytes per block) for every GGML type we can size; sizes come
/// from ggml's type traits, so tensors of types we cannot compute with are still bounds-checked.
const GGML_TYPES: &[(u32, &str, usize, usize)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 40),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
    (40, "NVFP4", 64, 36),
    (41, "Q1_0", 128, 18),
];

impl GgmlType {
    fn entry(self) -> Option<&'static (u32, &'static str, usize, usize)> {
        GGML_TYPES.iter().find(|e| e.0 == self.0)
    }

    /// The GGML name (`Q4_K`), or `type N` for an id we do not know.
    pub fn name(self) -> String {
        match self.entry() {
            Some(e) => e.1.to_string(),
            None => format!("type {}", self.0),
        }
    }

    /// (elements per block, bytes per block), when the type is known.
    pub fn block(self) -> Option<(usize, usize)> {
        self.entry().map(|e| (e.2, e.3))
    }

    /// The element type our kernels understand, if any.
    pub fn dtype(self) -> Option<DType> {
        match self.0 {
            0 => Some(DType::F32),
            1 => Some(DType::F16),
            30 => Some(DType::BF16),
            8 => Some(DType::Q8_0),
            2 => Some(DType::Q4_0),
            3 => Some(DType::Q4_1),
            12 => Some(DType::Q4_K),
            13 => Some(DType::Q5_K),
            14 => Some(DType::Q6_K),
            _ => None,
        }
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    U64(u64),
    I64(i64),
    F64(f64),
    Array(MetaArray),
}

/// A metadata array: homogeneous, possibly nested.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaArray {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    Str(Vec<String>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
    Array(Vec<MetaArray>),
}

impl MetaArray {
    pub fn len(&self) -> usize {
        match self {
            MetaArray::U8(v) => v.len(),
            MetaArray::I8(v) => v.len(),
            MetaArray::U16(v) => v.len(),
            MetaArray::I16(v) => v.len(),
            MetaArray::U32(v) => v.len(),
            MetaArray::I32(v) => v.len(),
            MetaArray::F32(v) => v.len(),
            MetaArray::Bool(v) => v.len(),
            MetaArray::Str(v) => v.len(),
            MetaArray::U64(v) => v.len(),
            MetaArray::I64(v) => v.len(),
            MetaArray::F64(v) => v.len(),
            MetaArray::Array(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(super) fn type_name(&self) -> &'static str {
        match self {
            MetaArray::U8(_) => "array of u8",
            MetaArray::I8(_) => "array of i8",
            MetaArray::U16(_) => "array of u16",
            MetaArray::I16(_) => "array of i16",
            MetaArray::U32(_) => "array of u32",
            MetaArray::I32(_) => "array of i32",
            MetaArray::F32(_) => "array of f32",
            MetaArray::Bool(_) => "array of bool",
            MetaArray::Str(_) => "array of string",
            MetaArray::U64(_) => "array of u64",
            MetaArray::I64(_) => "array of i64",
            MetaArray::F64(_) => "array of f64",
            MetaArray::Array(_) => "array of arrays",
        }
    }

    /// Integer elements widened to i64 (`None` for non-integer arrays).
    pub(super) fn to_i64s(&self) -> Option<Vec<i64>> {
        fn w<T: Copy + Into<i64>>(v: &[T]) -> Vec<i64> {
            v.iter().map(|&x| x.into()).collect()
        }
        Some(match self {
            MetaArray::U8(v) => w(v),
            MetaArray::I8(v) => w(v),
            MetaArray::U16(v) => w(v),
            MetaArray::I16(v) => w(v),
            MetaArray::U32(v) => w(v),
            MetaArray::I32(v) => w(v),
            MetaArray::I64(v) => v.clone(),
            MetaArray::U64(v) => v.iter().map(|&x| i64::try_from(x).unwrap_or(i64::MAX)).collect(),
            _ => return None,
        })
    }
}

impl MetaValue {
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::F32(_) => "f32",
            MetaValue::Bool(_) => "bool",
            MetaValue::Str(_) => "string",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F64(_) => "f64",
            MetaValue::Array(a) => a.type_name(),
        }
    }

    /// Any integer value, widened. Converters disagree on integer widths for the same key
    /// (u32 vs i32 vs u64), so getters accept all of them and range-check instead.
    pub(super) fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(x) => x.into(),
            MetaValue::I8(x) => x.into(),
            MetaValue::U16(x) => x.into(),
            MetaValue::I16(x) => x.into(),
            MetaValue::U32(x) => x.into(),
            MetaValue::I32(x) => x.into(),
            MetaValue::U64(x) => x.into(),
            MetaValue::I64(x) => x.into(),
            _ => return None,
        })
    }
}
