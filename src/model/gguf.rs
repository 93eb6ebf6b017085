//! GGUF reader: parses GGUF (v2/v3, little-endian) metadata and tensor infos over a memory map,
//! validates every offset and size against the file, and opens `llama`-architecture files as a
//! [`ModelBundle`] whose weights are served under HF names. Owns the GGUF container format, the
//! GGUF→HF tensor naming, and undoing llama.cpp's q/k row permutation; block decoding lives in
//! `quant`, tokenizer construction in `tokenizer::gguf_vocab`.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use memmap2::Mmap;

use super::{DType, GenerationDefaults, ModelBundle, ModelError, OwnedTensor, TensorView, WeightSource};
use crate::config::{LlamaConfig, RopeScaling};

pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Tensor data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;
/// GGML tensors have at most four dimensions; llama.cpp rejects more.
const MAX_DIMS: usize = 4;

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

    fn type_name(&self) -> &'static str {
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
    fn to_i64s(&self) -> Option<Vec<i64>> {
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
    fn as_i128(&self) -> Option<i128> {
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

/// One tensor's header, with the shape already normalised to row-major outermost-first.
#[derive(Clone, Debug)]
pub struct GgufTensorInfo {
    pub name: String,
    pub ggml_type: GgmlType,
    /// Outermost dimension first (GGUF's `ne` reversed).
    pub shape: Vec<usize>,
    /// Absolute byte offset of the data in the file.
    pub offset: usize,
    pub n_bytes: usize,
}

/// A parsed GGUF file: metadata, tensor infos, and the memory map the tensor data lives in.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    version: u32,
    alignment: usize,
    data_offset: usize,
    metadata: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<GgufTensorInfo>,
    tensor_index: HashMap<String, usize>,
}

/// Bounds-checked little-endian cursor. `ctx` names what is being read so that a truncation
/// error says which key or tensor it hit.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    file: &'a Path,
    ctx: String,
}

impl<'a> Reader<'a> {
    fn err(&self, msg: String) -> ModelError {
        ModelError::Format { file: self.file.to_path_buf(), msg }
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], ModelError> {
        if n > self.remaining() {
            return Err(self.err(format!(
                "truncated: reading {} needs {n} bytes at offset {}, but the file is {} bytes",
                self.ctx,
                self.pos,
                self.buf.len()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], ModelError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, ModelError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, ModelError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, ModelError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A length or count that must fit in the rest of the file at `min_elem` bytes per item;
    /// checked before allocating so a corrupt count cannot ask for terabytes.
    fn count(&mut self, min_elem: usize) -> Result<usize, ModelError> {
        let n = self.u64()?;
        let fits = usize::try_from(n).ok().filter(|&n| n.checked_mul(min_elem).is_some_and(|b| b <= self.remaining()));
        fits.ok_or_else(|| {
            self.err(format!(
                "truncated or corrupt: {} declares {n} items at offset {}, more than the {} bytes left",
                self.ctx,
                self.pos - 8,
                self.remaining()
            ))
        })
    }

    fn string(&mut self) -> Result<String, ModelError> {
        let n = self.count(1)?;
        let bytes = self.take(n)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.err(format!("{}: string is not valid UTF-8", self.ctx)))
    }

    fn vec<T, const N: usize>(&mut self, n: usize, f: fn([u8; N]) -> T) -> Result<Vec<T>, ModelError> {
        let bytes = self.take(n * N)?;
        Ok(bytes
            .chunks_exact(N)
            .map(|c| {
                let mut a = [0u8; N];
                a.copy_from_slice(c);
                f(a)
            })
            .collect())
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<MetaValue, ModelError> {
        Ok(match ty {
            0 => MetaValue::U8(self.u8()?),
            1 => MetaValue::I8(i8::from_le_bytes(self.array()?)),
            2 => MetaValue::U16(u16::from_le_bytes(self.array()?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array()?)),
            4 => MetaValue::U32(self.u32()?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array()?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array()?)),
            7 => MetaValue::Bool(self.u8()? != 0),
            8 => MetaValue::Str(self.string()?),
            9 => MetaValue::Array(self.meta_array(depth)?),
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array()?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(self.err(format!("{}: unknown metadata value type {other}", self.ctx))),
        })
    }

    fn meta_array(&mut self, depth: usize) -> Result<MetaArray, ModelError> {
        // Nesting is legal but never deep in practice; the cap keeps a hostile file from
        // recursing us off the stack.
        if depth > 16 {
            return Err(self.err(format!("{}: arrays nested more than 16 deep", self.ctx)));
        }
        let ty = self.u32()?;
        // Minimum bytes per element: strings and arrays carry at least their u64 length.
        let min = match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 | 10..=12 => 8,
            9 => 12,
            other => return Err(self.err(format!("{}: unknown array element type {other}", self.ctx))),
        };
        let n = self.count(min)?;
        Ok(match ty {
            0 => MetaArray::U8(self.take(n)?.to_vec()),
            1 => MetaArray::I8(self.vec(n, i8::from_le_bytes)?),
            2 => MetaArray::U16(self.vec(n, u16::from_le_bytes)?),
            3 => MetaArray::I16(self.vec(n, i16::from_le_bytes)?),
            4 => MetaArray::U32(self.vec(n, u32::from_le_bytes)?),
            5 => MetaArray::I32(self.vec(n, i32::from_le_bytes)?),
            6 => MetaArray::F32(self.vec(n, f32::from_le_bytes)?),
            7 => MetaArray::Bool(self.take(n)?.iter().map(|&b| b != 0).collect()),
            8 => MetaArray::Str((0..n).map(|_| self.string()).collect::<Result<_, _>>()?),
            10 => MetaArray::U64(self.vec(n, u64::from_le_bytes)?),
            11 => MetaArray::I64(self.vec(n, i64::from_le_bytes)?),
            12 => MetaArray::F64(self.vec(n, f64::from_le_bytes)?),
            _ => MetaArray::Array((0..n).map(|_| self.meta_array(depth + 1)).collect::<Result<_, _>>()?),
        })
    }
}

impl GgufFile {
    /// Map and parse a GGUF file. Metadata and tensor infos are validated here; tensor data is
    /// only bounds-checked (it is read lazily through the map).
    pub fn open(path: &Path) -> Result<GgufFile, ModelError> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let len = file.metadata().map_err(|e| ModelError::io(path, e))?.len();
        if len < 4 {
            return Err(ModelError::Format {
                file: path.to_path_buf(),
                msg: format!("truncated: {len} bytes is too short for a GGUF header"),
            });
        }
        // SAFETY: the map is read-only and private to this struct. Another process truncating
        // or rewriting the file while we serve from it is outside what we can defend against
        // (the same contract as every mmap-based loader, llama.cpp included).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        Self::parse(path, mmap)
    }

    fn parse(path: &Path, mmap: Mmap) -> Result<GgufFile, ModelError> {
        let mut r = Reader { buf: &mmap[..], pos: 0, file: path, ctx: "the header".into() };
        let magic: [u8; 4] = r.array()?;
        if magic != GGUF_MAGIC {
            return Err(r.err(format!("not a GGUF file: magic is {magic:02x?}, expected \"GGUF\"")));
        }
        let version = r.u32()?;
        if version != 2 && version != 3 {
            let hint = if matches!(version.swap_bytes(), 2 | 3) { " (a big-endian GGUF)" } else { "" };
            return Err(r.err(format!("unsupported GGUF version {version}{hint}; supported: 2 and 3, little-endian")));
        }
        r.ctx = "the tensor count".into();
        let n_tensors = r.count(24)?;
        r.ctx = "the metadata count".into();
        let n_kv = r.count(12)?;

        let mut metadata = Vec::with_capacity(n_kv);
        let mut meta_index = HashMap::with_capacity(n_kv);
        for i in 0..n_kv {
            r.ctx = format!("metadata key #{i}");
            let key = r.string()?;
            r.ctx = format!("metadata `{key}`");
            let ty = r.u32()?;
            let value = r.value(ty, 0)?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(r.err(format!("duplicate metadata key `{key}`")));
            }
            metadata.push((key, value));
        }

        let alignment = match meta_index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_i128() {
                Some(a) if a > 0 && (a as u128).is_power_of_two() && a <= 1 << 30 => a as usize,
                _ => return Err(r.err(format!("general.alignment must be a power of two, got {v:?}"))),
            },
        };

        let mut raw = Vec::with_capacity(n_tensors);
        for i in 0..n_tensors {
            r.ctx = format!("tensor info #{i}");
            let name = r.string()?;
            r.ctx = format!("tensor `{name}` info");
            let n_dims = r.u32()? as usize;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(r.err(format!("tensor `{name}` has {n_dims} dimensions (1..={MAX_DIMS} allowed)")));
            }
            let ne = (0..n_dims).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
            let ty = GgmlType(r.u32()?);
            let rel = r.u64()?;
            raw.push((name, ne, ty, rel));
        }
        let header_end = r.pos;
        let data_offset = header_end.div_ceil(alignment) * alignment;
        let file_len = mmap.len();

        let bad = |msg: String| ModelError::Format { file: path.to_path_buf(), msg };
        let mut tensors = Vec::with_capacity(raw.len());
        let mut tensor_index = HashMap::with_capacity(raw.len());
        for (name, ne, ty, rel) in raw {
            let Some((blk_elems, blk_bytes)) = ty.block() else {
                return Err(bad(format!("tensor `{name}` has unknown GGML type id {}", ty.0)));
            };
            let dims = ne
                .iter()
                .map(|&d| usize::try_from(d).ok().filter(|&d| d > 0))
                .collect::<Option<Vec<usize>>>()
                .ok_or_else(|| bad(format!("tensor `{name}` has an invalid dimension in {ne:?}")))?;
            let elems = dims
                .iter()
                .try_fold(1usize, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| bad(format!("tensor `{name}` has too many elements: {ne:?}")))?;
            // ne[0] is the innermost (contiguous) dimension; blocks never straddle rows.
            if dims[0] % blk_elems != 0 {
                return Err(bad(format!(
                    "tensor `{name}` ({}) has row length {} that is not a multiple of its block size {blk_elems}",
                    ty.name(),
                    dims[0]
                )));
            }
            let n_bytes = elems / blk_elems * blk_bytes;
            let rel =
                usize::try_from(rel).map_err(|_| bad(format!("tensor `{name}` has offset {rel} out of range")))?;
            if rel % alignment != 0 {
                return Err(bad(format!(
                    "tensor `{name}` data offset {rel} is not a multiple of the alignment {alignment}"
                )));
            }
            let offset = data_offset.checked_add(rel);
            let end = offset.and_then(|o| o.checked_add(n_bytes));
            let (Some(offset), Some(end)) = (offset, end) else {
                return Err(bad(format!("tensor `{name}` has offset {rel} out of range")));
            };
            if end > file_len {
                return Err(bad(format!(
                    "truncated: tensor `{name}` data spans bytes {offset}..{end}, beyond the end of the file ({file_len} bytes)"
                )));
            }
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(bad(format!("duplicate tensor `{name}`")));
            }
            let shape = dims.into_iter().rev().collect();
            tensors.push(GgufTensorInfo { name, ggml_type: ty, shape, offset, n_bytes });
        }

        Ok(GgufFile {
            path: path.to_path_buf(),
            mmap,
            version,
            alignment,
            data_offset,
            metadata,
            meta_index,
            tensors,
            tensor_index,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn version(&self) -> u32 {
        self.version
    }
    pub fn alignment(&self) -> usize {
        self.alignment
    }
    /// Absolute offset where the tensor data section begins.
    pub fn data_offset(&self) -> usize {
        self.data_offset
    }

    fn meta_err(&self, key: &str, v: &MetaValue, expected: &str) -> ModelError {
        ModelError::Format {
            file: self.path.clone(),
            msg: format!("metadata `{key}` has type {}, expected {expected}", v.type_name()),
        }
    }

    fn missing(&self, key: &str) -> ModelError {
        ModelError::Format { file: self.path.clone(), msg: format!("missing metadata `{key}`") }
    }

    /// Metadata keys in file order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.metadata.iter().map(|(k, _)| k.as_str())
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// `Ok(None)` when absent; an error (naming file and key) when present with another type.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Str(s)) => Ok(Some(s)),
            Some(v) => Err(self.meta_err(key, v, "string")),
        }
    }

    fn get_int(&self, key: &str, expected: &str) -> Result<Option<i128>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_i128().map(Some).ok_or_else(|| self.meta_err(key, v, expected)),
        }
    }

    /// Any integer type whose value fits in u32.
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>, ModelError> {
        match self.get_int(key, "an integer")? {
            None => Ok(None),
            Some(x) => u32::try_from(x).map(Some).map_err(|_| ModelError::Format {
                file: self.path.clone(),
                msg: format!("metadata `{key}` = {x} does not fit in u32"),
            }),
        }
    }

    /// Any integer type whose value fits in u64.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>, ModelError> {
        match self.get_int(key, "an integer")? {
            None => Ok(None),
            Some(x) => u64::try_from(x).map(Some).map_err(|_| ModelError::Format {
                file: self.path.clone(),
                msg: format!("metadata `{key}` = {x} does not fit in u64"),
            }),
        }
    }

    /// f32 or f64 (narrowed).
    pub fn get_f32(&self, key: &str) -> Result<Option<f32>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::F32(x)) => Ok(Some(*x)),
            Some(MetaValue::F64(x)) => Ok(Some(*x as f32)),
            Some(v) => Err(self.meta_err(key, v, "a float")),
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.meta_err(key, v, "bool")),
        }
    }

    pub fn get_array(&self, key: &str) -> Result<Option<&MetaArray>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Array(a)) => Ok(Some(a)),
            Some(v) => Err(self.meta_err(key, v, "an array")),
        }
    }

    pub fn get_str_array(&self, key: &str) -> Result<Option<&[String]>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Array(MetaArray::Str(v))) => Ok(Some(v)),
            // An empty array may have been written with any element type.
            Some(MetaValue::Array(a)) if a.is_empty() => Ok(Some(&[])),
            Some(v) => Err(self.meta_err(key, v, "array of string")),
        }
    }

    /// Any integer array whose values fit in i32.
    pub fn get_i32_array(&self, key: &str) -> Result<Option<Vec<i32>>, ModelError> {
        let Some(a) = self.get_array(key)? else { return Ok(None) };
        let Some(wide) = a.to_i64s() else {
            return Err(ModelError::Format {
                file: self.path.clone(),
                msg: format!("metadata `{key}` has type {}, expected an integer array", a.type_name()),
            });
        };
        wide.into_iter().map(i32::try_from).collect::<Result<Vec<_>, _>>().map(Some).map_err(|_| ModelError::Format {
            file: self.path.clone(),
            msg: format!("metadata `{key}` has values beyond i32"),
        })
    }

    pub fn require_str(&self, key: &str) -> Result<&str, ModelError> {
        self.get_str(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn require_u32(&self, key: &str) -> Result<u32, ModelError> {
        self.get_u32(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn require_f32(&self, key: &str) -> Result<f32, ModelError> {
        self.get_f32(key)?.ok_or_else(|| self.missing(key))
    }

    pub fn tensor_infos(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The raw bytes of a tensor (any GGML type).
    pub fn tensor_bytes(&self, info: &GgufTensorInfo) -> &[u8] {
        &self.mmap[info.offset..info.offset + info.n_bytes]
    }

    /// A zero-copy view of a tensor by its GGUF name, in the file's own layout (q/k still
    /// permuted; see [`open_file`] for the HF-layout view).
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>, ModelError> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| ModelError::MissingTensor { file: self.path.clone(), tensor: name.to_string() })?;
        let dtype = self.dtype_of(info)?;
        Ok(TensorView { dtype, shape: &info.shape, data: self.tensor_bytes(info) })
    }

    fn dtype_of(&self, info: &GgufTensorInfo) -> Result<DType, ModelError> {
        info.ggml_type.dtype().ok_or_else(|| ModelError::UnsupportedDType {
            file: self.path.clone(),
            tensor: info.name.clone(),
            dtype: format!("{} (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)", info.ggml_type.name()),
        })
    }
}

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

struct Served {
    index: usize,
    dtype: DType,
    /// `Some(n_head)` for q/k tensors whose rows must be un-permuted.
    unpermute: Option<usize>,
    owned: OnceLock<OwnedTensor>,
}

/// Weights of a `llama` GGUF served under HF names: zero-copy views of the map, except q/k
/// projections, which are un-permuted into owned buffers on first access.
pub struct GgufWeights {
    file: GgufFile,
    by_hf: HashMap<String, Served>,
}

impl GgufWeights {
    pub fn gguf(&self) -> &GgufFile {
        &self.file
    }
}

impl WeightSource for GgufWeights {
    fn origin(&self) -> &Path {
        &self.file.path
    }

    fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        let s = self.by_hf.get(name)?;
        let info = &self.file.tensors[s.index];
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

const ARCH: &str = "llama";

fn config_err(g: &GgufFile, msg: String) -> ModelError {
    ModelError::Config { file: g.path.clone(), msg }
}

/// RoPE scaling from metadata, or from a `rope_freqs.weight` tensor (how llama.cpp's converter
/// stores Llama 3.x scaling: per-frequency divisors, with no parameters in the metadata).
fn rope_scaling(g: &GgufFile, base: &LlamaConfig) -> Result<Option<RopeScaling>, ModelError> {
    let mut scaling = match g.get_str("llama.rope.scaling.type")? {
        None | Some("none") => None,
        Some("linear") => {
            let factor = g.require_f32("llama.rope.scaling.factor")?;
            Some(RopeScaling::Linear { factor })
        }
        Some(other) => {
            return Err(config_err(
                g,
                format!("unsupported llama.rope.scaling.type `{other}` (supported: none, linear)"),
            ))
        }
    };
    if scaling.is_none() {
        // Older converters wrote a bare linear factor.
        if let Some(f) = g.get_f32("llama.rope.scale_linear")? {
            if f != 1.0 {
                scaling = Some(RopeScaling::Linear { factor: f });
            }
        }
    }
    let Some(info) = g.tensor_info("rope_freqs.weight") else { return Ok(scaling) };
    if scaling.is_some() {
        return Err(config_err(g, "both rope scaling metadata and rope_freqs.weight are present".into()));
    }
    let half = base.head_dim / 2;
    if info.ggml_type != GgmlType(0) || info.shape != [half] {
        return Err(config_err(
            g,
            format!("rope_freqs.weight must be F32 [{half}], found {} {:?}", info.ggml_type.name(), info.shape),
        ));
    }
    let divisors: Vec<f32> =
        g.tensor_bytes(info).chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let factor = divisors.iter().copied().fold(1.0f32, f32::max);
    if factor == 1.0 {
        return Ok(None);
    }
    // Only Llama 3.x produces these, with low/high frequency factors 1 and 4; accept the
    // tensor when it matches that formula, else refuse rather than run with wrong positions.
    let original = g.get_u32("llama.rope.scaling.original_context_length")?.unwrap_or(8192) as usize;
    let candidate = RopeScaling::Llama3 {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: original,
    };
    let plain = LlamaConfig { rope_scaling: None, ..base.clone() }.rope_inv_freq();
    let scaled = LlamaConfig { rope_scaling: Some(candidate.clone()), ..base.clone() }.rope_inv_freq();
    let matches = plain.iter().zip(&scaled).zip(&divisors).all(|((p, s), d)| ((p / s) - d).abs() <= 1e-3 * d.abs());
    if !matches {
        return Err(config_err(
            g,
            format!("rope_freqs.weight does not match Llama 3 rope scaling (factor {factor}); not supported"),
        ));
    }
    Ok(Some(candidate))
}

fn llama_config(g: &GgufFile) -> Result<LlamaConfig, ModelError> {
    let key = |k: &str| format!("{ARCH}.{k}");
    let req = |k: &str| g.require_u32(&key(k)).map(|x| x as usize);
    let hidden_size = req("embedding_length")?;
    let num_attention_heads = req("attention.head_count")?;
    let num_key_value_heads = g.get_u32(&key("attention.head_count_kv"))?.map_or(num_attention_heads, |x| x as usize);
    let rope_dims = g.get_u32(&key("rope.dimension_count"))?.map(|x| x as usize);
    let head_dim = match g.get_u32(&key("attention.key_length"))? {
        Some(k) => k as usize,
        None => rope_dims.unwrap_or(hidden_size / num_attention_heads.max(1)),
    };
    if let Some(rd) = rope_dims {
        if rd != head_dim {
            return Err(config_err(g, format!("partial rotary embedding ({rd} of {head_dim} dims) is not supported")));
        }
    }
    if let Some(v) = g.get_u32(&key("attention.value_length"))? {
        if v as usize != head_dim {
            return Err(config_err(g, format!("value head size {v} differs from key head size {head_dim}")));
        }
    }
    let tokens_len = g.get_array("tokenizer.ggml.tokens")?.map(MetaArray::len);
    let vocab_size = match g.get_u32(&key("vocab_size"))? {
        Some(v) => v as usize,
        None => tokens_len
            .or_else(|| g.tensor_info("token_embd.weight").map(|t| t.shape[0]))
            .ok_or_else(|| config_err(g, "no llama.vocab_size, token list or token_embd.weight".into()))?,
    };
    let has = |n: &str| g.tensor_info(n).is_some();
    let eos = g.get_u32("tokenizer.ggml.eos_token_id")?;
    let mut cfg = LlamaConfig {
        model_type: ARCH.to_string(),
        vocab_size,
        hidden_size,
        intermediate_size: req("feed_forward_length")?,
        num_hidden_layers: req("block_count")?,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps: g.require_f32(&key("attention.layer_norm_rms_epsilon"))?,
        rope_theta: g.get_f32(&key("rope.freq_base"))?.unwrap_or(10000.0),
        rope_scaling: None,
        max_position_embeddings: g.get_u32(&key("context_length"))?.map_or(4096, |x| x as usize),
        tie_word_embeddings: !has("output.weight"),
        attention_qkv_bias: has("blk.0.attn_q.bias"),
        attention_out_bias: has("blk.0.attn_output.bias"),
        mlp_bias: has("blk.0.ffn_gate.bias") || has("blk.0.ffn_up.bias"),
        qk_norm: false,
        sliding_window: None,
        // llama.cpp is the reference for GGUF files: follow its RoPE arithmetic bit for bit.
        rope_ggml_style: true,
        bos_token_id: g.get_u32("tokenizer.ggml.bos_token_id")?,
        eos_token_ids: eos.into_iter().collect(),
    };
    cfg.rope_scaling = rope_scaling(g, &cfg)?;
    cfg.validate(&g.path)?;
    Ok(cfg)
}

/// Open a `llama`-architecture GGUF file: config from `llama.*` metadata, weights under HF
/// names (q/k rows un-permuted), and the tokenizer when it is a gpt2-style BPE vocabulary.
pub fn open_file(path: &Path) -> Result<ModelBundle, ModelError> {
    let g = GgufFile::open(path)?;
    let arch = g.require_str("general.architecture")?;
    if arch != ARCH {
        return Err(ModelError::UnsupportedArchitecture { file: path.to_path_buf(), arch: arch.to_string() });
    }
    let config = llama_config(&g)?;

    let mut by_hf = HashMap::new();
    for (index, info) in g.tensors.iter().enumerate() {
        let Some(hf) = hf_tensor_name(&info.name) else {
            if info.name != "rope_freqs.weight" {
                tracing::debug!(tensor = %info.name, file = %path.display(), "ignoring GGUF tensor the llama model does not use");
            }
            continue;
        };
        let dtype = g.dtype_of(info)?;
        let unpermute = if info.name.contains(".attn_q.") {
            Some(config.num_attention_heads)
        } else if info.name.contains(".attn_k.") {
            Some(config.num_key_value_heads)
        } else {
            None
        };
        if let Some(n_head) = unpermute {
            // Validate here so the lazy un-permutation in `tensor()` cannot fail.
            let rows = info.shape[0];
            let whole_rows = info.shape.len() > 1 || !dtype.is_quantized();
            if rows % n_head != 0 || (rows / n_head) % 2 != 0 || !whole_rows {
                return Err(ModelError::Format {
                    file: path.to_path_buf(),
                    msg: format!(
                        "tensor `{}` with shape {:?} ({dtype}) cannot be split into {n_head} heads of even size",
                        info.name, info.shape
                    ),
                });
            }
        }
        by_hf.insert(hf, Served { index, dtype, unpermute, owned: OnceLock::new() });
    }

    let tokenizer = match g.get_str("tokenizer.ggml.model")? {
        Some("gpt2") => Some(crate::tokenizer::gguf_vocab::tokenizer_from_gguf(&g, path)?),
        other => {
            tracing::warn!(
                file = %path.display(),
                tokenizer = other.unwrap_or("(none)"),
                "GGUF tokenizer type not supported (only gpt2-style BPE); the model is usable with token ids only"
            );
            None
        }
    };
    let generation = GenerationDefaults { eos_token_ids: config.eos_token_ids.clone(), ..Default::default() };
    let name = path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
    Ok(ModelBundle { name, config, weights: Box::new(GgufWeights { file: g, by_hf }), tokenizer, generation })
}

/// Builds GGUF files in memory, for tests of this reader and of the GGUF tokenizer.
#[cfg(test)]
pub(crate) mod testutil {
    #[derive(Default)]
    pub struct GgufBuilder {
        pub version: u32,
        kv: Vec<(String, u32, Vec<u8>)>,
        tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
        pub alignment: usize,
    }

    pub fn str_bytes(s: &str) -> Vec<u8> {
        let mut v = (s.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(s.as_bytes());
        v
    }

    /// Payload of an array value: element type, count, then the elements' bytes.
    pub fn array_payload(elem_ty: u32, count: usize, elems: &[u8]) -> Vec<u8> {
        let mut v = elem_ty.to_le_bytes().to_vec();
        v.extend_from_slice(&(count as u64).to_le_bytes());
        v.extend_from_slice(elems);
        v
    }

    impl GgufBuilder {
        pub fn new() -> Self {
            GgufBuilder { version: 3, alignment: 32, ..Default::default() }
        }
        pub fn raw(&mut self, key: &str, ty: u32, payload: Vec<u8>) -> &mut Self {
            self.kv.push((key.to_string(), ty, payload));
            self
        }
        pub fn u32(&mut self, key: &str, v: u32) -> &mut Self {
            self.raw(key, 4, v.to_le_bytes().to_vec())
        }
        pub fn f32(&mut self, key: &str, v: f32) -> &mut Self {
            self.raw(key, 6, v.to_le_bytes().to_vec())
        }
        pub fn bool(&mut self, key: &str, v: bool) -> &mut Self {
            self.raw(key, 7, vec![v as u8])
        }
        pub fn str(&mut self, key: &str, v: &str) -> &mut Self {
            self.raw(key, 8, str_bytes(v))
        }
        pub fn str_array(&mut self, key: &str, v: &[&str]) -> &mut Self {
            let elems: Vec<u8> = v.iter().flat_map(|s| str_bytes(s)).collect();
            self.raw(key, 9, array_payload(8, v.len(), &elems))
        }
        pub fn i32_array(&mut self, key: &str, v: &[i32]) -> &mut Self {
            let elems: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            self.raw(key, 9, array_payload(5, v.len(), &elems))
        }
        /// A tensor with row-major `shape` (written reversed, as GGUF's `ne`).
        pub fn tensor(&mut self, name: &str, shape: &[usize], ggml_type: u32, data: Vec<u8>) -> &mut Self {
            let ne = shape.iter().rev().map(|&d| d as u64).collect();
            self.tensors.push((name.to_string(), ne, ggml_type, data));
            self
        }
        pub fn f32_tensor(&mut self, name: &str, shape: &[usize], values: &[f32]) -> &mut Self {
            self.tensor(name, shape, 0, values.iter().flat_map(|x| x.to_le_bytes()).collect())
        }

        pub fn bytes(&self) -> Vec<u8> {
            let mut out = b"GGUF".to_vec();
            out.extend_from_slice(&self.version.to_le_bytes());
            out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
            out.extend_from_slice(&(self.kv.len() as u64).to_le_bytes());
            for (k, ty, payload) in &self.kv {
                out.extend(str_bytes(k));
                out.extend_from_slice(&ty.to_le_bytes());
                out.extend_from_slice(payload);
            }
            let align = |n: usize| n.div_ceil(self.alignment) * self.alignment;
            let mut rel = 0usize;
            let mut offsets = Vec::new();
            for (name, ne, ty, data) in &self.tensors {
                out.extend(str_bytes(name));
                out.extend_from_slice(&(ne.len() as u32).to_le_bytes());
                for d in ne {
                    out.extend_from_slice(&d.to_le_bytes());
                }
                out.extend_from_slice(&ty.to_le_bytes());
                out.extend_from_slice(&(rel as u64).to_le_bytes());
                offsets.push(rel);
                rel = align(rel + data.len());
            }
            let data_start = align(out.len());
            out.resize(data_start, 0);
            for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
                out.resize(data_start + off, 0);
                out.extend_from_slice(data);
            }
            out
        }

        pub fn write(&self, dir: &std::path::Path, name: &str) -> std::path::PathBuf {
            let p = dir.join(name);
            std::fs::write(&p, self.bytes()).expect("write test gguf");
            p
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::*;
    use super::*;

    fn tmp() -> tempfile::TempDir {
        tempfile::tempdir().expect("tempdir")
    }

    fn err_of(r: Result<GgufFile, ModelError>) -> String {
        match r {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    }

    fn q8_0_block(d: f32, qs: [i8; 32]) -> Vec<u8> {
        let mut v = half::f16::from_f32(d).to_le_bytes().to_vec();
        v.extend(qs.iter().map(|&q| q as u8));
        v
    }

    #[test]
    fn parses_every_value_type_alignment_and_tensors() {
        let dir = tmp();
        let mut b = GgufBuilder::new();
        b.alignment = 64;
        b.raw("general.alignment", 4, 64u32.to_le_bytes().to_vec())
            .raw("t.u8", 0, vec![200])
            .raw("t.i8", 1, vec![0xfe])
            .raw("t.u16", 2, 60000u16.to_le_bytes().to_vec())
            .raw("t.i16", 3, (-3i16).to_le_bytes().to_vec())
            .u32("t.u32", 4_000_000_000)
            .raw("t.i32", 5, (-7i32).to_le_bytes().to_vec())
            .f32("t.f32", 1.5)
            .bool("t.bool", true)
            .str("t.str", "héllo")
            .raw("t.u64", 10, 5_000_000_000u64.to_le_bytes().to_vec())
            .raw("t.i64", 11, (-9i64).to_le_bytes().to_vec())
            .raw("t.f64", 12, 0.25f64.to_le_bytes().to_vec())
            .str_array("t.strs", &["a", "", "ü"])
            .i32_array("t.i32s", &[1, -2, 3]);
        // [[ "x" ], [ "y", "z" ]]: an array of arrays of strings.
        let inner1 = array_payload(8, 1, &str_bytes("x"));
        let inner2 = array_payload(8, 2, &[str_bytes("y"), str_bytes("z")].concat());
        b.raw("t.nested", 9, array_payload(9, 2, &[inner1, inner2].concat()));
        let f32_vals: Vec<f32> = (0..6).map(|x| x as f32).collect();
        b.f32_tensor("a", &[2, 3], &f32_vals);
        let q = [q8_0_block(0.5, [1; 32]), q8_0_block(2.0, [-1; 32])].concat();
        b.tensor("q", &[2, 32], 8, q.clone());
        b.tensor(
            "h",
            &[3],
            1,
            [1.0f32, 2.0, -0.5].iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes()).collect(),
        );
        let p = b.write(dir.path(), "all.gguf");

        let g = GgufFile::open(&p).unwrap();
        assert_eq!(g.version(), 3);
        assert_eq!(g.alignment(), 64);
        assert_eq!(g.data_offset() % 64, 0);
        assert_eq!(g.get("t.u8"), Some(&MetaValue::U8(200)));
        assert_eq!(g.get("t.i8"), Some(&MetaValue::I8(-2)));
        assert_eq!(g.get("t.u16"), Some(&MetaValue::U16(60000)));
        assert_eq!(g.get("t.i16"), Some(&MetaValue::I16(-3)));
        assert_eq!(g.get_u32("t.u32").unwrap(), Some(4_000_000_000));
        assert_eq!(g.get_u64("t.u64").unwrap(), Some(5_000_000_000));
        assert!(g.get_u32("t.u64").is_err(), "5e9 must not silently truncate to u32");
        assert!(g.get_u32("t.i32").is_err(), "negative must not convert to u32");
        assert_eq!(g.get("t.i64"), Some(&MetaValue::I64(-9)));
        assert_eq!(g.get_f32("t.f32").unwrap(), Some(1.5));
        assert_eq!(g.get_f32("t.f64").unwrap(), Some(0.25));
        assert_eq!(g.get_bool("t.bool").unwrap(), Some(true));
        assert_eq!(g.get_str("t.str").unwrap(), Some("héllo"));
        assert_eq!(g.get_str("missing").unwrap(), None);
        assert_eq!(g.get_str_array("t.strs").unwrap().unwrap(), ["a", "", "ü"]);
        assert_eq!(g.get_i32_array("t.i32s").unwrap().unwrap(), vec![1, -2, 3]);
        assert_eq!(
            g.get("t.nested"),
            Some(&MetaValue::Array(MetaArray::Array(vec![
                MetaArray::Str(vec!["x".into()]),
                MetaArray::Str(vec!["y".into(), "z".into()]),
            ])))
        );
        let wrong = g.get_str("t.u32").unwrap_err().to_string();
        assert!(wrong.contains("all.gguf") && wrong.contains("t.u32") && wrong.contains("u32"), "{wrong}");
        assert_eq!(g.keys().next(), Some("general.alignment"));

        let a = g.tensor("a").unwrap();
        assert_eq!((a.dtype, a.shape), (DType::F32, &[2usize, 3][..]));
        assert_eq!(a.data, f32_vals.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>());
        let t = g.tensor("q").unwrap();
        assert_eq!((t.dtype, t.shape, t.data), (DType::Q8_0, &[2usize, 32][..], &q[..]));
        let h = g.tensor("h").unwrap();
        assert_eq!((h.dtype, h.shape, h.data.len()), (DType::F16, &[3usize][..], 6));
        for info in g.tensor_infos() {
            assert_eq!(info.offset % 64, 0, "{}", info.name);
        }
        let missing = g.tensor("nope").unwrap_err().to_string();
        assert!(missing.contains("nope") && missing.contains("all.gguf"), "{missing}");
    }

    fn small_file() -> GgufBuilder {
        let mut b = GgufBuilder::new();
        b.str("general.architecture", "llama").str_array("names", &["one", "two"]);
        b.f32_tensor("w", &[4, 8], &[0.5; 32]);
        b
    }

    #[test]
    fn every_truncation_is_an_error_naming_the_file() {
        let dir = tmp();
        let full = small_file().bytes();
        for cut in [0, 3, 6, 20, 40, 60, 90, 120, full.len() - 1] {
            let p = dir.path().join(format!("cut{cut}.gguf"));
            std::fs::write(&p, &full[..cut]).unwrap();
            let e = err_of(GgufFile::open(&p));
            assert!(e.contains(&format!("cut{cut}.gguf")) && e.contains("truncated"), "cut {cut}: {e}");
        }
        // Cutting inside the tensor data names the tensor.
        let p = dir.path().join("data.gguf");
        std::fs::write(&p, &full[..full.len() - 4]).unwrap();
        let e = err_of(GgufFile::open(&p));
        assert!(e.contains("tensor `w`") && e.contains("beyond the end"), "{e}");
    }

    #[test]
    fn bad_magic_and_versions_are_named() {
        let dir = tmp();
        let mut bytes = small_file().bytes();
        bytes[..4].copy_from_slice(b"GGML");
        let p = dir.path().join("magic.gguf");
        std::fs::write(&p, &bytes).unwrap();
        let e = err_of(GgufFile::open(&p));
        assert!(e.contains("magic.gguf") && e.contains("not a GGUF file"), "{e}");

        for (v, needle) in [(1u32, "version 1"), (4, "version 4"), (3u32.swap_bytes(), "big-endian")] {
            let mut b = small_file();
            b.version = v;
            let p = b.write(dir.path(), "ver.gguf");
            let e = err_of(GgufFile::open(&p));
            assert!(e.contains("ver.gguf") && e.contains(needle), "{e}");
        }
        let mut b = small_file();
        b.version = 2;
        assert!(GgufFile::open(&b.write(dir.path(), "v2.gguf")).is_ok());
    }

    #[test]
    fn unknown_and_unsupported_tensor_types() {
        let dir = tmp();
        let mut b = GgufBuilder::new();
        b.tensor("weird", &[1, 32], 99, vec![0; 32]);
        let e = err_of(GgufFile::open(&b.write(dir.path(), "unknown.gguf")));
        assert!(e.contains("unknown.gguf") && e.contains("`weird`") && e.contains("99"), "{e}");

        // A known GGML type we cannot compute with: the file opens, the tensor does not.
        let mut b = GgufBuilder::new();
        b.tensor("blk.0.attn_q.weight", &[1, 256], 12, vec![0; 144]);
        let p = b.write(dir.path(), "q4k.gguf");
        let g = GgufFile::open(&p).unwrap();
        let e = g.tensor("blk.0.attn_q.weight").unwrap_err();
        assert!(matches!(e, ModelError::UnsupportedDType { .. }));
        let e = e.to_string();
        assert!(e.contains("q4k.gguf") && e.contains("blk.0.attn_q.weight") && e.contains("Q4_K"), "{e}");
    }

    #[test]
    fn offsets_beyond_eof_misaligned_and_bad_rows_are_rejected() {
        let dir = tmp();
        // Patch the single tensor's relative offset: it follows the name, n_dims, two dims and
        // the type id in the tensor info.
        let bytes = small_file().bytes();
        let needle = [str_bytes("w"), 2u32.to_le_bytes().to_vec()].concat();
        let at = bytes.windows(needle.len()).position(|w| w == needle.as_slice()).unwrap() + needle.len() + 16 + 4;
        for (rel, what) in
            [(1u64 << 20, "beyond the end"), (8, "not a multiple of the alignment"), (u64::MAX - 31, "out of range")]
        {
            let mut patched = bytes.clone();
            patched[at..at + 8].copy_from_slice(&rel.to_le_bytes());
            let p = dir.path().join("off.gguf");
            std::fs::write(&p, &patched).unwrap();
            let e = err_of(GgufFile::open(&p));
            assert!(e.contains("off.gguf") && e.contains("`w`") && e.contains(what), "{rel}: {e}");
        }
        let mut b = GgufBuilder::new();
        b.tensor("ragged", &[2, 31], 8, vec![0; 68]);
        let e = err_of(GgufFile::open(&b.write(dir.path(), "ragged.gguf")));
        assert!(e.contains("`ragged`") && e.contains("block size 32"), "{e}");
    }

    #[test]
    fn maps_names_to_hf() {
        assert_eq!(hf_tensor_name("token_embd.weight").as_deref(), Some("model.embed_tokens.weight"));
        assert_eq!(hf_tensor_name("output_norm.weight").as_deref(), Some("model.norm.weight"));
        assert_eq!(hf_tensor_name("output.weight").as_deref(), Some("lm_head.weight"));
        assert_eq!(
            hf_tensor_name("blk.12.attn_norm.weight").as_deref(),
            Some("model.layers.12.input_layernorm.weight")
        );
        assert_eq!(
            hf_tensor_name("blk.0.ffn_norm.weight").as_deref(),
            Some("model.layers.0.post_attention_layernorm.weight")
        );
        assert_eq!(hf_tensor_name("blk.3.attn_q.bias").as_deref(), Some("model.layers.3.self_attn.q_proj.bias"));
        assert_eq!(
            hf_tensor_name("blk.3.attn_output.weight").as_deref(),
            Some("model.layers.3.self_attn.o_proj.weight")
        );
        assert_eq!(hf_tensor_name("blk.7.ffn_down.weight").as_deref(), Some("model.layers.7.mlp.down_proj.weight"));
        assert_eq!(hf_tensor_name("rope_freqs.weight"), None);
        assert_eq!(hf_tensor_name("blk.x.attn_q.weight"), None);
    }

    /// A one-layer llama with hidden 8, 2 query heads and 1 kv head of dim 4. Row `r` of every
    /// q/k tensor is filled with the value `r` so the served row order is visible.
    fn tiny_llama(with_output: bool) -> GgufBuilder {
        let mut b = GgufBuilder::new();
        b.str("general.architecture", "llama")
            .u32("llama.block_count", 1)
            .u32("llama.context_length", 64)
            .u32("llama.embedding_length", 8)
            .u32("llama.feed_forward_length", 16)
            .u32("llama.attention.head_count", 2)
            .u32("llama.attention.head_count_kv", 1)
            .f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
            .u32("llama.rope.dimension_count", 4)
            .str("llama.rope.scaling.type", "linear")
            .f32("llama.rope.scaling.factor", 2.0)
            .u32("tokenizer.ggml.bos_token_id", 1)
            .u32("tokenizer.ggml.eos_token_id", 2)
            .str("tokenizer.ggml.model", "llama")
            .str_array("tokenizer.ggml.tokens", &["a", "b", "c", "d"]);
        let rows = |n: usize| -> Vec<f32> { (0..n).flat_map(|r| [r as f32; 8]).collect() };
        b.f32_tensor("token_embd.weight", &[4, 8], &[0.0; 32])
            .f32_tensor("output_norm.weight", &[8], &[1.0; 8])
            .f32_tensor("blk.0.attn_norm.weight", &[8], &[1.0; 8])
            .f32_tensor("blk.0.ffn_norm.weight", &[8], &[1.0; 8])
            .f32_tensor("blk.0.attn_q.weight", &[8, 8], &rows(8))
            .f32_tensor("blk.0.attn_q.bias", &[8], &(0..8).map(|r| r as f32).collect::<Vec<_>>())
            .f32_tensor("blk.0.attn_k.weight", &[4, 8], &rows(4))
            .f32_tensor("blk.0.attn_v.weight", &[4, 8], &rows(4))
            .f32_tensor("blk.0.attn_output.weight", &[8, 8], &rows(8))
            .f32_tensor("blk.0.ffn_gate.weight", &[16, 8], &[0.0; 128])
            .f32_tensor("blk.0.ffn_up.weight", &[16, 8], &[0.0; 128])
            .f32_tensor("blk.0.ffn_down.weight", &[8, 16], &[0.0; 128]);
        if with_output {
            b.f32_tensor("output.weight", &[4, 8], &[0.0; 32]);
        }
        b
    }

    fn row_ids(w: &dyn WeightSource, name: &str, row_len: usize) -> Vec<f32> {
        let t = w.tensor(name).unwrap_or_else(|| panic!("{name} missing"));
        t.data.chunks_exact(4 * row_len).map(|r| f32::from_le_bytes([r[0], r[1], r[2], r[3]])).collect()
    }

    #[test]
    fn opens_tiny_llama_with_hf_names_and_unpermuted_qk() {
        let dir = tmp();
        let p = tiny_llama(false).write(dir.path(), "tiny.gguf");
        let m = open_file(&p).unwrap();
        let c = &m.config;
        assert_eq!((c.hidden_size, c.intermediate_size, c.num_hidden_layers), (8, 16, 1));
        assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (2, 1, 4));
        assert_eq!((c.vocab_size, c.max_position_embeddings), (4, 64));
        assert_eq!(c.rope_theta, 10000.0);
        assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 2.0 }));
        assert!(c.tie_word_embeddings && c.attention_qkv_bias && !c.attention_out_bias && !c.mlp_bias);
        assert_eq!((c.bos_token_id, c.eos_token_ids.clone()), (Some(1), vec![2]));
        assert_eq!(m.generation.eos_token_ids, vec![2]);
        assert!(m.tokenizer.is_none(), "a `llama` (sentencepiece) vocabulary is not built");
        assert!(m.weights.tensor("lm_head.weight").is_none());
        assert!(m.weights.tensor_names().contains(&"model.layers.0.mlp.down_proj.weight".to_string()));

        // llama.cpp stores head h's rows as [h0, h2, h1, h3] (pairs interleaved); HF order is
        // [h0, h1, h2, h3]. Written by hand from the converter's reshape/swapaxes.
        assert_eq!(row_ids(&*m.weights, "model.layers.0.self_attn.q_proj.weight", 8), [0., 2., 1., 3., 4., 6., 5., 7.]);
        assert_eq!(row_ids(&*m.weights, "model.layers.0.self_attn.q_proj.bias", 1), [0., 2., 1., 3., 4., 6., 5., 7.]);
        assert_eq!(row_ids(&*m.weights, "model.layers.0.self_attn.k_proj.weight", 8), [0., 2., 1., 3.]);
        // Everything else is served as stored.
        assert_eq!(row_ids(&*m.weights, "model.layers.0.self_attn.v_proj.weight", 8), [0., 1., 2., 3.]);
        assert_eq!(row_ids(&*m.weights, "model.layers.0.self_attn.o_proj.weight", 8), [0., 1., 2., 3., 4., 5., 6., 7.]);
        let q = m.weights.expect("model.layers.0.self_attn.q_proj.weight", &[8, 8]).unwrap();
        assert_eq!(q.dtype, DType::F32);

        let p = tiny_llama(true).write(dir.path(), "untied.gguf");
        let m = open_file(&p).unwrap();
        assert!(!m.config.tie_word_embeddings);
        assert_eq!(m.weights.tensor("lm_head.weight").map(|t| t.shape.to_vec()), Some(vec![4, 8]));
    }

    #[test]
    fn quantized_qk_rows_move_whole() {
        // Two heads of dim 4, Q8_0 rows of 32: each row is one block whose scale encodes its row.
        let rows: Vec<u8> = (0..8).flat_map(|r| q8_0_block(r as f32, [1; 32])).collect();
        let out = unpermute_qk_rows(&rows, 8, 2);
        let scales: Vec<f32> = out.chunks_exact(34).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect();
        assert_eq!(scales, [0., 2., 1., 3., 4., 6., 5., 7.]);
    }

    #[test]
    fn wrong_architecture_and_unsupported_weight_type_are_named() {
        let dir = tmp();
        let mut b = tiny_llama(false);
        b.str("general.architecture", "gemma"); // duplicate key: rejected first
        let e = open_file(&b.write(dir.path(), "dup.gguf")).err().expect("duplicate key").to_string();
        assert!(e.contains("duplicate metadata key `general.architecture`"), "{e}");

        let mut b = GgufBuilder::new();
        b.str("general.architecture", "gemma");
        let e = open_file(&b.write(dir.path(), "gemma.gguf")).err().expect("gemma");
        assert!(matches!(e, ModelError::UnsupportedArchitecture { ref arch, .. } if arch == "gemma"), "{e}");
        assert!(e.to_string().contains("gemma.gguf"));

        let mut b = tiny_llama(false);
        b.tensor("output.weight", &[4, 256], 14, vec![0; 4 * 210]);
        let e = open_file(&b.write(dir.path(), "q6k.gguf")).err().expect("Q6_K output");
        assert!(matches!(e, ModelError::UnsupportedDType { .. }), "{e}");
        let e = e.to_string();
        assert!(e.contains("q6k.gguf") && e.contains("output.weight") && e.contains("Q6_K"), "{e}");
    }

    #[test]
    fn llama3_rope_freqs_are_recognised() {
        let dir = tmp();
        let mut b = tiny_llama(false);
        let cfg = LlamaConfig {
            model_type: "llama".into(),
            vocab_size: 4,
            hidden_size: 8,
            intermediate_size: 16,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim: 4,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: None,
            max_position_embeddings: 64,
            tie_word_embeddings: true,
            attention_qkv_bias: false,
            attention_out_bias: false,
            mlp_bias: false,
            qk_norm: false,
            sliding_window: None,
            rope_ggml_style: true,
            bos_token_id: None,
            eos_token_ids: vec![],
        };
        // Metadata scaling and a rope_freqs tensor at once is ambiguous: refused.
        b.f32_tensor("rope_freqs.weight", &[2], &[1.0, 8.0]);
        let e = open_file(&b.write(dir.path(), "both.gguf")).err().expect("conflict").to_string();
        assert!(e.contains("rope_freqs.weight"), "{e}");

        let base = LlamaConfig { rope_theta: 500000.0, head_dim: 128, ..cfg };
        let wanted = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let plain = base.rope_inv_freq();
        let scaled = LlamaConfig { rope_scaling: Some(wanted.clone()), ..base.clone() }.rope_inv_freq();
        let divisors: Vec<f32> = plain.iter().zip(&scaled).map(|(p, s)| p / s).collect();
        assert!(divisors.contains(&1.0) && divisors.iter().any(|&d| (d - 8.0).abs() < 1e-4));
        let mut b = GgufBuilder::new();
        b.str("general.architecture", "llama")
            .u32("llama.block_count", 1)
            .u32("llama.embedding_length", 256)
            .u32("llama.feed_forward_length", 16)
            .u32("llama.attention.head_count", 2)
            .f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
            .f32("llama.rope.freq_base", 500000.0)
            .u32("llama.vocab_size", 4)
            .f32_tensor("rope_freqs.weight", &[64], &divisors);
        let m = open_file(&b.write(dir.path(), "l3.gguf")).unwrap();
        assert_eq!(m.config.rope_scaling, Some(wanted));
        assert_eq!(m.config.head_dim, 128);

        let mut bad = divisors.clone();
        bad[63] = 3.0;
        let mut b2 = GgufBuilder::new();
        b2.str("general.architecture", "llama")
            .u32("llama.block_count", 1)
            .u32("llama.embedding_length", 256)
            .u32("llama.feed_forward_length", 16)
            .u32("llama.attention.head_count", 2)
            .f32("llama.attention.layer_norm_rms_epsilon", 1e-5)
            .f32("llama.rope.freq_base", 500000.0)
            .u32("llama.vocab_size", 4)
            .f32_tensor("rope_freqs.weight", &[64], &bad);
        let e = open_file(&b2.write(dir.path(), "l3bad.gguf")).err().expect("mismatch").to_string();
        assert!(e.contains("l3bad.gguf") && e.contains("does not match"), "{e}");
    }

    /// The real SmolLM2 GGUF: config values, and un-permuted q/k rows against the reference
    /// written by `scripts/gen_gguf_golden.py` (gguf-python dequantisation + transformers'
    /// own reverse permutation).
    #[test]
    fn smollm2_config_and_unpermuted_rows_match_reference() {
        let Some(path) = std::env::var_os("SHELFSERVE_DEFAULT_GGUF") else {
            eprintln!("skipped: SHELFSERVE_DEFAULT_GGUF is not set (path to SmolLM2-135M-Instruct.Q4_1.gguf)");
            return;
        };
        let m = open_file(Path::new(&path)).unwrap();
        let c = &m.config;
        assert_eq!((c.hidden_size, c.intermediate_size, c.num_hidden_layers), (576, 1536, 30));
        assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (9, 3, 64));
        assert_eq!((c.vocab_size, c.max_position_embeddings), (49152, 8192));
        assert_eq!((c.rope_theta, c.rope_scaling.clone()), (100000.0, None));
        assert!((c.rms_norm_eps - 1e-5).abs() < 1e-9);
        assert!(c.tie_word_embeddings && !c.attention_qkv_bias && !c.mlp_bias);
        assert_eq!((c.bos_token_id, c.eos_token_ids.clone()), (Some(1), vec![2]));
        let tok = m.tokenizer.as_ref().expect("gpt2 tokenizer");
        assert!(tok.eos_token_ids.contains(&2));

        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gguf/smollm2_qk_rows.json");
        let text = std::fs::read_to_string(&fixture).unwrap_or_else(|e| panic!("{}: {e}", fixture.display()));
        let fx: serde_json::Value = serde_json::from_str(&text).expect("fixture json");
        let cases = fx["cases"].as_array().expect("cases");
        assert!(cases.len() >= 4);
        for case in cases {
            let name = case["hf_name"].as_str().unwrap();
            let t = m.weights.tensor(name).unwrap_or_else(|| panic!("{name}"));
            let shape: Vec<usize> =
                case["shape"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect();
            assert_eq!(t.shape, shape.as_slice(), "{name}");
            assert_eq!(t.dtype.name(), case["dtype"].as_str().unwrap(), "{name}");
            let values = crate::model::tensor::to_f32(&t);
            let cols = shape[1];
            for row in case["rows"].as_array().unwrap() {
                let r = row["row"].as_u64().unwrap() as usize;
                let got = &values[r * cols..(r + 1) * cols];
                let head: Vec<f64> = row["first"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
                for (k, &want) in head.iter().enumerate() {
                    assert!(
                        (got[k] as f64 - want).abs() <= 1e-6 * want.abs().max(1e-3),
                        "{name} row {r} col {k}: {} vs {want}",
                        got[k]
                    );
                }
                let sum: f64 = got.iter().map(|&x| x as f64).sum();
                let want_sum = row["sum"].as_f64().unwrap();
                assert!(
                    (sum - want_sum).abs() <= 1e-4 * want_sum.abs().max(1.0),
                    "{name} row {r}: sum {sum} vs {want_sum}"
                );
            }
        }
    }
}
