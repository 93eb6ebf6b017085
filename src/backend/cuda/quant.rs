//! Quantized linears on the device, kept in their checkpoint format (`cuda/quant_gemv.cu`): FP8
//! 128×128 blocks, compressed-tensors int4 and NVFP4, in the CPU's [`PackedRows`] layout (codes
//! row after row, per-(row, group) scales; NVFP4 with its E4M3 scale bytes and a global per row).
//! A projection is a [`LinearWeight`]: a dense matrix in the storage precision, a packed one, or
//! projections of different formats stacked by rows ([`LinearWeight::Parts`], e.g. an FP8 q_proj
//! beside k/v that transformers left in bf16).
//!
//! [`matmul`] dispatches on the weight: dense matrices go to cuBLAS; packed ones to the GEMV
//! that dequantizes in registers (a warp per [`gemv_warp_rows`] weight rows, token rows in
//! tiles of [`QUANT_GEMV_TILE_ROWS`], each tile re-reading the codes, mostly from L2) for steps
//! of at most [`PackedPolicy::gemv_max_rows`] token rows (8 or 16), else the matrix is
//! dequantized into a reused scratch in the storage precision and multiplied by the same cuBLAS
//! GEMM — an honest interim: prefill reads the dequantized matrix once more than a fused
//! tensor-core GEMM would (Marlin-style 4-bit and FP8 tensor-core GEMMs are later work).

use cudarc::driver::CudaFunction;

use super::gpu::{cfg, grid_for, kernel_param, DevBuf, DeviceRepr, Gpu, Precision};
use crate::backend::BackendError;
use crate::model::quant::packed::{PackedFormat, PackedRows};

/// Token rows of the GEMV's largest build: longer steps run it over tiles of this many rows
/// (grid x), re-reading the codes once per tile.
pub const QUANT_GEMV_TILE_ROWS: usize = 8;
const QUANT_GEMV_THREADS: u32 = 128;

/// Weight rows one warp of the GEMV computes for a step of `m` token rows (`QG_NR_SMALL` /
/// `QG_NR_LARGE` in cuda/quant_gemv.cu): 2 in the 1-2 row builds, 4 in the others.
pub fn gemv_warp_rows(m: usize) -> usize {
    if m <= 2 {
        2
    } else {
        4
    }
}
const QUANT_THREADS: u32 = 256;
/// Bytes of codes each thread loads at once (one 16-byte load).
pub const CHUNK_BYTES: usize = 16;

/// What a quantized kernel reads and writes (`QuantArgs` in cuda/quant_gemv.cu; device addresses
/// as u64, 0 for "none").
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct QuantArgs {
    /// GEMV: `[m, k]` in the storage type.
    pub x: u64,
    pub codes: u64,
    /// FP8 / int4: f32 `[n, k / group]`.
    pub scales: u64,
    /// NVFP4: e4m3 bytes `[n, k / 16]`.
    pub scale_codes: u64,
    /// NVFP4: f32 `[n]`.
    pub row_global: u64,
    /// GEMV: f32 output, row r at `y + r·ldy`; dequantize: `[n, k]` in the storage type.
    pub y: u64,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub ldy: i32,
    pub group: i32,
    pub accumulate: i32,
}
// SAFETY: plain `#[repr(C)]` data matching `QuantArgs` in cuda/quant_gemv.cu (6 pointers, then
// 6 four-byte fields; 72 bytes).
unsafe impl DeviceRepr for QuantArgs {}

/// The kernels' name for a format.
pub fn format_tag(f: PackedFormat) -> &'static str {
    match f {
        PackedFormat::Fp8Block => "fp8",
        PackedFormat::Int4 { .. } => "int4",
        PackedFormat::Nvfp4 => "nvfp4",
    }
}

/// The GEMV grid for `m` token rows of a matrix of `rows` weight rows: token tiles on x (the
/// fastest, so the tiles of one weight block run together and share its codes in L2), weight
/// blocks on y.
pub fn gemv_grid(m: usize, rows: usize) -> Result<(u32, u32), String> {
    let tiles = m.div_ceil(QUANT_GEMV_TILE_ROWS);
    let blocks = rows.div_ceil(gemv_warp_rows(m) * QUANT_GEMV_THREADS as usize / 32);
    if blocks > 65_535 || tiles > u32::MAX as usize {
        return Err(format!("packed GEMV of {rows} rows × {m} token rows exceeds the grid"));
    }
    Ok((tiles as u32, blocks as u32))
}

/// The GEMV build for `rows` token rows (1, 2, 3-4, 5 and more in tiles of 8): each holds only
/// its rows' accumulators.
pub fn gemv_kernel_name(f: PackedFormat, rows: usize, prec: Precision) -> String {
    let r = match rows {
        0 | 1 => 1,
        2 => 2,
        3 | 4 => 4,
        _ => 8,
    };
    format!("quant_gemv_{}_r{r}_{}", format_tag(f), prec.suffix())
}

pub fn dequant_kernel_name(f: PackedFormat, prec: Precision) -> String {
    format!("quant_dequant_{}_{}", format_tag(f), prec.suffix())
}

/// Weights in one 16-byte chunk of codes.
pub fn chunk_weights(f: PackedFormat) -> usize {
    match f {
        PackedFormat::Fp8Block => CHUNK_BYTES,
        _ => 2 * CHUNK_BYTES,
    }
}

/// `Err(why)` unless the kernels can read matrices of `cols` columns in format `f`: every row a
/// whole number of 16-byte chunks (aligned loads), and no chunk straddling two scale groups
/// except NVFP4's two 16-column groups, which the kernels handle.
pub fn check_shape(f: PackedFormat, cols: usize) -> Result<(), String> {
    let w = chunk_weights(f);
    if !cols.is_multiple_of(w) || !cols.is_multiple_of(f.group()) {
        return Err(format!("{} columns of {} are not a whole number of {w}-weight chunks", cols, f.name()));
    }
    if f != PackedFormat::Nvfp4 && !f.group().is_multiple_of(w) {
        return Err(format!("{}: groups of {} split a {w}-weight chunk", f.name(), f.group()));
    }
    Ok(())
}

/// How a step of `m` token rows multiplies a packed matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedPath {
    /// Dequantize in registers (`quant_gemv_*`).
    Gemv,
    /// Dequantize into the scratch, then cuBLAS.
    DequantGemm,
}

/// Where packed matrices switch from the GEMV to dequantize + cuBLAS, per format.
///
/// The GEMV's time grows with the tiles of 8 token rows (each tile decodes the codes again and
/// multiplies on the CUDA cores in f32); dequantize + cuBLAS costs about a dense step plus
/// writing and reading the matrix in bf16 (≈ 6.5 ms a step for FP8, ≈ 10 ms for the 4-bit
/// formats on the 8B llama). Measured on the H200 (docs/quantization.md, session 13): int4 at
/// 16 rows 16.4 ms GEMV vs 17.3 ms dequantize, at 32 rows 30.4 vs 19.3; FP8 at 16 rows 13.8 ms
/// dequantize vs ≈ 2 × its 8-row GEMV (11.5 ms); NVFP4's GEMV is the slowest of the three.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedPolicy {
    /// Steps of at most this many token rows take the GEMV: FP8, int4, NVFP4.
    pub fp8_max_rows: usize,
    pub int4_max_rows: usize,
    pub nvfp4_max_rows: usize,
}

impl Default for PackedPolicy {
    fn default() -> Self {
        PackedPolicy { fp8_max_rows: 8, int4_max_rows: 16, nvfp4_max_rows: 8 }
    }
}

impl PackedPolicy {
    /// The default, or `SHELFSERVE_QUANT_GEMV_MAX_ROWS` for every format (for measuring the
    /// crossover).
    pub fn from_env_value(v: Option<&str>) -> Result<Self, String> {
        match v.map(str::trim) {
            None | Some("") => Ok(Self::default()),
            Some(s) => s
                .parse::<usize>()
                .map(|n| PackedPolicy { fp8_max_rows: n, int4_max_rows: n, nvfp4_max_rows: n })
                .map_err(|_| format!("SHELFSERVE_QUANT_GEMV_MAX_ROWS={s}: expected a row count")),
        }
    }

    /// Read once per process (a bad value is logged and the default kept).
    pub fn current() -> PackedPolicy {
        static POLICY: std::sync::OnceLock<PackedPolicy> = std::sync::OnceLock::new();
        *POLICY.get_or_init(|| {
            let v = std::env::var("SHELFSERVE_QUANT_GEMV_MAX_ROWS").ok();
            Self::from_env_value(v.as_deref()).unwrap_or_else(|e| {
                tracing::warn!("{e}; using the default");
                Self::default()
            })
        })
    }

    pub fn gemv_max_rows(&self, f: PackedFormat) -> usize {
        match f {
            PackedFormat::Fp8Block => self.fp8_max_rows,
            PackedFormat::Int4 { .. } => self.int4_max_rows,
            PackedFormat::Nvfp4 => self.nvfp4_max_rows,
        }
    }

    pub fn path(&self, f: PackedFormat, m: usize) -> PackedPath {
        if m <= self.gemv_max_rows(f) {
            PackedPath::Gemv
        } else {
            PackedPath::DequantGemm
        }
    }

    /// Whether a step of `m` rows may dequantize a matrix of some format (it then needs the
    /// scratch).
    pub fn may_dequantize(&self, m: usize) -> bool {
        m > self.fp8_max_rows.min(self.int4_max_rows).min(self.nvfp4_max_rows)
    }
}

/// The path of a step of `m` token rows on a matrix of format `f` under the process's
/// [`PackedPolicy`].
pub fn packed_path(f: PackedFormat, m: usize) -> PackedPath {
    PackedPolicy::current().path(f, m)
}

/// A packed matrix on the device.
pub struct DevPacked {
    pub format: PackedFormat,
    pub rows: usize,
    pub cols: usize,
    pub codes: DevBuf,
    pub scales: Option<DevBuf>,
    pub scale_codes: Option<DevBuf>,
    pub row_global: Option<DevBuf>,
}

impl DevPacked {
    /// Copy `p` to the device as it is (checked against the kernels' shape rules).
    pub fn upload(gpu: &Gpu, p: &PackedRows) -> Result<Self, BackendError> {
        check_shape(p.format, p.cols).map_err(BackendError::Device)?;
        let opt = |v: &[f32]| if v.is_empty() { Ok(None) } else { gpu.upload(v).map(Some) };
        Ok(DevPacked {
            format: p.format,
            rows: p.rows,
            cols: p.cols,
            codes: gpu.upload(&p.codes)?,
            scales: opt(&p.scales)?,
            scale_codes: if p.scale_codes.is_empty() { None } else { Some(gpu.upload(&p.scale_codes)?) },
            row_global: opt(&p.row_global)?,
        })
    }

    /// Bytes held on the device: codes and scales as stored (what a step reads).
    pub fn bytes(&self) -> usize {
        let opt = |b: &Option<DevBuf>| b.as_ref().map_or(0, DevBuf::bytes);
        self.codes.bytes() + opt(&self.scales) + opt(&self.scale_codes) + opt(&self.row_global)
    }

    fn args(&self, x: u64, y: u64, m: usize, ldy: usize, accumulate: bool) -> QuantArgs {
        let p = |b: &Option<DevBuf>| b.as_ref().map_or(0, DevBuf::ptr);
        QuantArgs {
            x,
            codes: self.codes.ptr(),
            scales: p(&self.scales),
            scale_codes: p(&self.scale_codes),
            row_global: p(&self.row_global),
            y,
            m: m as i32,
            n: self.rows as i32,
            k: self.cols as i32,
            ldy: ldy as i32,
            group: self.format.group() as i32,
            accumulate: i32::from(accumulate),
        }
    }

    /// `y[r, 0..rows] (+)= x[r, :] · Wᵀ` for `m` token rows (`x` in `prec`, `y` f32 with row
    /// stride `ldy`): the build for `m` rows, or the 8-row build over tiles of 8. Launched as a
    /// programmatic dependent (the kernel loads its first codes before `pdl_wait`).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv(
        &self,
        gpu: &mut Gpu,
        prec: Precision,
        m: usize,
        x: u64,
        y: u64,
        ldy: usize,
        accumulate: bool,
    ) -> Result<(), BackendError> {
        if m == 0 || self.rows == 0 {
            return Ok(());
        }
        let f = gpu.func("quant", &gemv_kernel_name(self.format, m, prec))?;
        let a = self.args(x, y, m, ldy, accumulate);
        let grid = gemv_grid(m, self.rows).map_err(BackendError::Device)?;
        let mut params = [kernel_param(&a)];
        // SAFETY: every quant_gemv kernel takes one `QuantArgs` by value; `a` outlives the call;
        // the kernels read only weights before `pdl_wait`.
        unsafe { gpu.launch_params(&f, cfg(grid, QUANT_GEMV_THREADS, 0), &mut params, true) }
    }

    /// The whole matrix as `[rows, cols]` in `prec` at `out` (the tools' f32 weights, rounded to
    /// `prec`).
    pub fn dequantize(&self, gpu: &mut Gpu, prec: Precision, out: u64) -> Result<(), BackendError> {
        let f = gpu.func("quant", &dequant_kernel_name(self.format, prec))?;
        self.dequantize_with(gpu, &f, out)
    }

    /// [`dequantize`](Self::dequantize) with its kernel looked up already (`f`: the
    /// `dequant_kernel_name` of this format and the storage precision).
    pub fn dequantize_with(&self, gpu: &Gpu, f: &CudaFunction, out: u64) -> Result<(), BackendError> {
        let a = self.args(0, out, 0, 0, false);
        let chunks = self.rows * self.cols / chunk_weights(self.format);
        let mut params = [kernel_param(&a)];
        // SAFETY: as above (the dequantize kernels take one `QuantArgs`).
        unsafe { gpu.launch_params(f, cfg((grid_for(chunks, QUANT_THREADS), 1), QUANT_THREADS, 0), &mut params, false) }
    }
}

/// One projection (or several stacked by rows, sharing their input) on the device.
pub enum LinearWeight {
    /// `[rows, cols]` in the storage precision.
    Dense {
        buf: DevBuf,
        rows: usize,
    },
    Packed(DevPacked),
    /// Parts of different formats, stacked by rows: each writes its own output columns.
    Parts(Vec<LinearWeight>),
}

impl LinearWeight {
    pub fn rows(&self) -> usize {
        match self {
            LinearWeight::Dense { rows, .. } => *rows,
            LinearWeight::Packed(p) => p.rows,
            LinearWeight::Parts(parts) => parts.iter().map(LinearWeight::rows).sum(),
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            LinearWeight::Dense { buf, .. } => buf.bytes(),
            LinearWeight::Packed(p) => p.bytes(),
            LinearWeight::Parts(parts) => parts.iter().map(LinearWeight::bytes).sum(),
        }
    }

    /// The dense matrix, when this is one (the fused decode GEMVs take only those).
    pub fn dense(&self) -> Option<&DevBuf> {
        match self {
            LinearWeight::Dense { buf, .. } => Some(buf),
            _ => None,
        }
    }

    /// Elements of the largest packed matrix in it (the dequantize scratch's size), 0 if none.
    pub fn max_packed_elems(&self) -> usize {
        match self {
            LinearWeight::Dense { .. } => 0,
            LinearWeight::Packed(p) => p.rows * p.cols,
            LinearWeight::Parts(parts) => parts.iter().map(LinearWeight::max_packed_elems).max().unwrap_or(0),
        }
    }

    /// Stack parts by rows: one part as it is, several as [`LinearWeight::Parts`].
    pub fn stack(mut parts: Vec<LinearWeight>) -> LinearWeight {
        if parts.len() == 1 {
            parts.pop().unwrap_or(LinearWeight::Parts(Vec::new()))
        } else {
            LinearWeight::Parts(parts)
        }
    }
}

/// Addresses of one [`matmul`].
#[derive(Clone, Copy, Debug)]
pub struct MatmulIo {
    /// `[m, k]` in the storage precision.
    pub x: u64,
    /// f32 output, row stride `ldy`.
    pub y: u64,
    pub ldy: usize,
    /// Scratch for one dequantized matrix (`max_packed_elems` in the storage precision); only
    /// read for steps that [`packed_path`] sends to [`PackedPath::DequantGemm`].
    pub dequant: u64,
}

/// `y[m, 0..w.rows()] (+)= x[m, k] · wᵀ` whatever `w`'s format (see the module doc).
pub fn matmul(
    gpu: &mut Gpu,
    prec: Precision,
    w: &LinearWeight,
    m: usize,
    k: usize,
    io: MatmulIo,
    accumulate: bool,
) -> Result<(), BackendError> {
    match w {
        LinearWeight::Dense { buf, rows } => gpu.gemm_ld(prec, m, *rows, k, io.x, buf.ptr(), io.y, io.ldy, accumulate),
        LinearWeight::Packed(p) => match packed_path(p.format, m) {
            PackedPath::Gemv => p.gemv(gpu, prec, m, io.x, io.y, io.ldy, accumulate),
            PackedPath::DequantGemm => {
                if m == 0 {
                    return Ok(());
                }
                p.dequantize(gpu, prec, io.dequant)?;
                gpu.gemm_ld(prec, m, p.rows, k, io.x, io.dequant, io.y, io.ldy, accumulate)
            }
        },
        LinearWeight::Parts(parts) => {
            let mut col = 0;
            for part in parts {
                let io = MatmulIo { y: io.y + (col * 4) as u64, ..io };
                matmul(gpu, prec, part, m, k, io, accumulate)?;
                col += part.rows();
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_block_matches_the_kernels_layout() {
        assert_eq!(std::mem::size_of::<QuantArgs>(), 6 * 8 + 6 * 4);
        assert_eq!(std::mem::align_of::<QuantArgs>(), 8);
    }

    #[test]
    fn kernel_names_pick_format_row_build_and_storage() {
        let int4 = PackedFormat::Int4 { group: 128 };
        assert_eq!(gemv_kernel_name(PackedFormat::Fp8Block, 1, Precision::Bf16), "quant_gemv_fp8_r1_bf16");
        assert_eq!(gemv_kernel_name(int4, 2, Precision::F32), "quant_gemv_int4_r2_f32");
        assert_eq!(gemv_kernel_name(PackedFormat::Nvfp4, 3, Precision::Bf16), "quant_gemv_nvfp4_r4_bf16");
        assert_eq!(gemv_kernel_name(int4, 5, Precision::Bf16), "quant_gemv_int4_r8_bf16");
        assert_eq!(gemv_kernel_name(int4, 8, Precision::Bf16), "quant_gemv_int4_r8_bf16");
        assert_eq!(gemv_kernel_name(int4, 20, Precision::Bf16), "quant_gemv_int4_r8_bf16", "tiles of 8");
        assert_eq!(dequant_kernel_name(PackedFormat::Nvfp4, Precision::F32), "quant_dequant_nvfp4_f32");
    }

    #[test]
    fn decode_batches_take_the_gemv_larger_steps_dequantize() {
        let p = PackedPolicy::default();
        let (fp8, int4, nvfp4) = (PackedFormat::Fp8Block, PackedFormat::Int4 { group: 128 }, PackedFormat::Nvfp4);
        for f in [fp8, int4, nvfp4] {
            assert_eq!(p.path(f, 1), PackedPath::Gemv, "{f:?}");
            assert_eq!(p.path(f, 8), PackedPath::Gemv, "{f:?}");
            assert_eq!(p.path(f, 17), PackedPath::DequantGemm, "{f:?}");
            assert_eq!(p.path(f, 4096), PackedPath::DequantGemm, "{f:?}");
        }
        // int4's GEMV over two tiles still beats dequantize + cuBLAS at 16 rows; FP8's and
        // NVFP4's do not.
        assert_eq!(p.path(int4, 16), PackedPath::Gemv);
        assert_eq!((p.path(fp8, 9), p.path(nvfp4, 9)), (PackedPath::DequantGemm, PackedPath::DequantGemm));
        assert!(!p.may_dequantize(8) && p.may_dequantize(9));
        let all = PackedPolicy::from_env_value(Some(" 64 ")).unwrap();
        for f in [fp8, int4, nvfp4] {
            assert_eq!((all.path(f, 64), all.path(f, 65)), (PackedPath::Gemv, PackedPath::DequantGemm));
        }
        assert!(!all.may_dequantize(64));
        assert_eq!(PackedPolicy::from_env_value(None).unwrap(), p);
        assert_eq!(PackedPolicy::from_env_value(Some("")).unwrap(), p);
        let e = PackedPolicy::from_env_value(Some("lots")).unwrap_err();
        assert!(e.contains("SHELFSERVE_QUANT_GEMV_MAX_ROWS=lots"), "{e}");
    }

    #[test]
    fn gemv_grid_tiles_token_rows_and_blocks_weight_rows() {
        // 1-2 token rows: 4 warps × 2 weight rows a block; more: 4 × 4.
        assert_eq!(gemv_grid(1, 4096), Ok((1, 512)));
        assert_eq!(gemv_grid(2, 4097), Ok((1, 513)));
        assert_eq!(gemv_grid(3, 4096), Ok((1, 256)));
        assert_eq!(gemv_grid(8, 4097), Ok((1, 257)));
        assert_eq!(gemv_grid(9, 13), Ok((2, 1)));
        assert_eq!(gemv_grid(64, 28672), Ok((8, 1792)));
        assert!(gemv_grid(1, 8 * 65_536).unwrap_err().contains("exceeds the grid"));
        assert!(gemv_grid(8, 8 * 65_536).is_ok());
    }

    #[test]
    fn shapes_must_be_whole_aligned_chunks() {
        assert!(check_shape(PackedFormat::Fp8Block, 128).is_ok());
        assert!(check_shape(PackedFormat::Fp8Block, 4096).is_ok());
        for g in [32, 64, 128] {
            assert!(check_shape(PackedFormat::Int4 { group: g }, 256).is_ok(), "{g}");
        }
        assert!(check_shape(PackedFormat::Int4 { group: 32 }, 96).is_ok());
        assert!(check_shape(PackedFormat::Int4 { group: 64 }, 96).is_err());
        assert!(check_shape(PackedFormat::Int4 { group: 16 }, 256).is_err(), "a 32-weight chunk, two groups");
        assert!(check_shape(PackedFormat::Nvfp4, 64).is_ok());
        let e = check_shape(PackedFormat::Nvfp4, 48).unwrap_err();
        assert!(e.contains("48 columns") && e.contains("32-weight"), "{e}");
        // A row of whole chunks is a multiple of 16 bytes: every 16-byte load is aligned.
        for (f, cols) in
            [(PackedFormat::Fp8Block, 384), (PackedFormat::Nvfp4, 96), (PackedFormat::Int4 { group: 32 }, 160)]
        {
            assert!(check_shape(f, cols).is_ok());
            assert_eq!(f.code_bytes(cols) % CHUNK_BYTES, 0, "{f:?} {cols}");
        }
    }
}
