//! The GGUF container: a bounds-checked reader over the memory map, header, metadata and
//! tensor-info parsing with every offset validated against the file, and typed metadata lookups.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::types::{GgmlType, MetaArray, MetaValue, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS};
use crate::model::{DType, ModelError, TensorView};

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

    pub(super) fn dtype_of(&self, info: &GgufTensorInfo) -> Result<DType, ModelError> {
        info.ggml_type.dtype().ok_or_else(|| ModelError::UnsupportedDType {
            file: self.path.clone(),
            tensor: info.name.clone(),
            dtype: format!("{} (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K)", info.ggml_type.name()),
        })
    }
}
