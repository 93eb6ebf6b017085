//! Host side of the fused decode-step GEMVs (`cuda/gemv.cu`): the argument block the kernels
//! take by value, which fusion each projection uses, and one launch helper. Also the other
//! by-value parameter blocks shared with the kernels (RoPE, attention dimensions) and the
//! attention launch helper both attention kernels go through. Plain data; no model logic.

use super::gpu::{cfg, kernel_param, DeviceRepr, Gpu, Precision, GEMV_MAX_ROWS};
use crate::backend::BackendError;

/// Weight rows (output columns) one GEMV block computes (`GEMV_COLS` in cuda/gemv.cu).
pub const GEMV_COLS: usize = 8;
/// Threads per GEMV block (`GEMV_THREADS`).
const GEMV_THREADS: u32 = 256;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RopeParams {
    pub mode: i32,
    pub theta_scale: f32,
    pub freq_scale: f32,
}
// SAFETY: plain `#[repr(C)]` data matching `RopeParams` in cuda/common.cuh.
unsafe impl DeviceRepr for RopeParams {}

#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    pub block_stride: i64,
    pub nh: i32,
    pub nkv: i32,
    pub hd: i32,
    pub block_size: i32,
    pub window: i32,
    pub total_tokens: i32,
    pub scale: f32,
}
// SAFETY: plain `#[repr(C)]` data matching `AttnDims` in cuda/common.cuh.
unsafe impl DeviceRepr for AttnDims {}

/// What a fused GEMV reads and writes (`GemvArgs` in cuda/gemv.cu; device addresses as u64,
/// 0 for "none").
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct GemvArgs {
    /// Plain input: `[m, k]` in the storage type; norm input: the f32 residual stream.
    pub x: u64,
    /// Norm input: source row of each output row (0: row r).
    pub rows: u64,
    pub norm_w: u64,
    /// `[n, k]` weights in the storage type.
    pub w: u64,
    pub bias: u64,
    pub y: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub row_off: u64,
    pub pos: u64,
    pub freqs: u64,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub eps: f32,
    pub rp: RopeParams,
    pub nh: i32,
    pub nkv: i32,
    pub hd: i32,
}
// SAFETY: plain `#[repr(C)]` data matching `GemvArgs` in cuda/gemv.cu (pointers first, then
// 4-byte fields; 128 bytes).
unsafe impl DeviceRepr for GemvArgs {}

/// Which fusion a decode GEMV does (kernel name prefix in cuda/gemv.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvKind {
    /// RMSNorm of the residual, q/k/v, RoPE, K/V into the paged cache.
    NormRope,
    /// RMSNorm of the residual (optionally of a row subset), then `y = x·wᵀ (+ bias)`.
    Norm,
    /// `y += x·wᵀ (+ bias)` (residual add).
    Add,
    /// RMSNorm of the residual, gate/up, SwiGLU.
    NormSwiglu,
}

impl GemvKind {
    fn prefix(self) -> &'static str {
        match self {
            GemvKind::NormRope => "gemv_norm_rope",
            GemvKind::Norm => "gemv_norm",
            GemvKind::Add => "gemv_add",
            GemvKind::NormSwiglu => "gemv_norm_swiglu",
        }
    }
}

/// Kernel name for `rows` token rows: builds for 1, 2 and 3-4 rows, each holding only its rows'
/// accumulators (two or three blocks per SM, as cuda/gemv.cu says per build).
pub fn gemv_kernel_name(kind: GemvKind, rows: usize, prec: Precision) -> String {
    let r = match rows {
        0 | 1 => 1,
        2 => 2,
        _ => 4,
    };
    format!("{}_r{r}_{}", kind.prefix(), prec.suffix())
}

/// Whether a step of `tokens` rows with these matrix widths runs on the fused GEMVs: at most
/// `GEMV_MAX_ROWS` rows and every reduction length a multiple of 8 (16-byte loads).
pub fn fused_decode_fits(tokens: usize, widths: &[usize]) -> bool {
    (1..=GEMV_MAX_ROWS).contains(&tokens) && widths.iter().all(|w| w % 8 == 0)
}

/// Launch one fused GEMV over all `a.n` weight rows.
pub fn launch_gemv(gpu: &mut Gpu, kind: GemvKind, prec: Precision, a: &GemvArgs) -> Result<(), BackendError> {
    debug_assert!(a.m >= 1 && a.m as usize <= GEMV_MAX_ROWS && a.k % 8 == 0);
    debug_assert!(!matches!(kind, GemvKind::NormSwiglu | GemvKind::NormRope) || a.n % 2 == 0);
    let f = gpu.func("gemv", &gemv_kernel_name(kind, a.m as usize, prec))?;
    let blocks = (a.n as usize).div_ceil(GEMV_COLS) as u32;
    let mut params = [kernel_param(a)];
    // SAFETY: every GEMV kernel takes one `GemvArgs` by value (cuda/gemv.cu), and `a` outlives
    // the call. They load weights before `pdl_wait()` and touch activations only after it, so
    // they may start as dependents.
    unsafe { gpu.launch_params(&f, cfg((blocks, 1), GEMV_THREADS, 0), &mut params, true) }
}

/// Dynamic shared memory of the tensor-core prefill attention kernel for head size `hd`: two
/// stages of K and V tiles of 64 keys, rows padded by 8 (cuda/attention_mma.cu).
pub fn mma_attention_smem(hd: usize) -> u32 {
    (2 * 2 * 64 * (hd + 8) * 2) as u32
}

/// Let `f` take `bytes` of dynamic shared memory (above 48 KiB it must be allowed first).
pub fn allow_dynamic_smem(f: &cudarc::driver::CudaFunction, bytes: u32) -> Result<(), BackendError> {
    if bytes <= 48 * 1024 {
        return Ok(());
    }
    f.set_attribute(
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        bytes as i32,
    )
    .map_err(|e| super::gpu::dev_err("raising a kernel's shared memory limit", e))
}

/// The arguments both attention partial kernels take after their work-item list.
pub struct AttnLaunch {
    pub q: u64,
    pub k_base: u64,
    pub v_base: u64,
    pub tables: u64,
    pub table_off: u64,
    pub positions: u64,
    pub dims: AttnDims,
    pub part_acc: u64,
    pub part_ml: u64,
}

impl AttnLaunch {
    /// Launch `f` (the FMA or the tensor-core partial kernel) over `n_items` work items,
    /// `threads` per block (each kernel's own block size).
    pub fn launch(
        &self,
        gpu: &Gpu,
        f: &cudarc::driver::CudaFunction,
        (items, n_items): (u64, usize),
        threads: u32,
        smem: u32,
    ) -> Result<(), BackendError> {
        self.launch_with(gpu, f, (items, n_items), (threads, smem), &[], false)
    }

    /// Launch the tensor-core prefill kernel `f` (`attn_prefill_mma_*`) over `n_items` items,
    /// `threads` per block; items marked single-split write their rows of `out` themselves.
    pub fn launch_prefill_mma(
        &self,
        gpu: &Gpu,
        f: &cudarc::driver::CudaFunction,
        (items, n_items): (u64, usize),
        (threads, smem): (u32, u32),
        out: u64,
    ) -> Result<(), BackendError> {
        self.launch_with(gpu, f, (items, n_items), (threads, smem), &[kernel_param(&out)], false)
    }

    /// Launch the streaming decode kernel `f` (`attn_decode_*`, 128 threads, static shared
    /// memory) over `n_items` decode items; it writes finished rows of `out` itself. It waits on
    /// the q/k/v kernel with `pdl_wait()`, so it is launched as a dependent.
    pub fn launch_streaming(
        &self,
        gpu: &Gpu,
        f: &cudarc::driver::CudaFunction,
        items: u64,
        n_items: usize,
        counters: u64,
        out: u64,
    ) -> Result<(), BackendError> {
        let extra = [kernel_param(&counters), kernel_param(&out)];
        self.launch_with(gpu, f, (items, n_items), (128, 0), &extra, true)
    }

    /// Every attention kernel takes its item list, then these fields in this order, then its own
    /// trailing arguments (`extra`, each as [`kernel_param`] gives it).
    fn launch_with(
        &self,
        gpu: &Gpu,
        f: &cudarc::driver::CudaFunction,
        (items, n_items): (u64, usize),
        (threads, smem): (u32, u32),
        extra: &[*mut std::ffi::c_void],
        dependent: bool,
    ) -> Result<(), BackendError> {
        if n_items == 0 {
            return Ok(());
        }
        let mut params = vec![
            kernel_param(&items),
            kernel_param(&self.q),
            kernel_param(&self.k_base),
            kernel_param(&self.v_base),
            kernel_param(&self.tables),
            kernel_param(&self.table_off),
            kernel_param(&self.positions),
            kernel_param(&self.dims),
            kernel_param(&self.part_acc),
            kernel_param(&self.part_ml),
        ];
        params.extend_from_slice(extra);
        // SAFETY: the attention kernels' parameter lists (cuda/attention*.cu) are the fields
        // above in this order followed by `extra`, which each caller passes for its kernel; all
        // of them outlive the call.
        unsafe { gpu.launch_params(f, cfg((n_items as u32, 1), threads, smem), &mut params, dependent) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argument_blocks_match_the_kernels_layout() {
        // cuda/gemv.cu: 11 pointers, m n k eps, RopeParams (3 × 4 bytes), nh nkv hd.
        assert_eq!(std::mem::size_of::<GemvArgs>(), 11 * 8 + 4 * 4 + 12 + 3 * 4);
        assert_eq!(std::mem::align_of::<GemvArgs>(), 8);
        assert_eq!(std::mem::size_of::<RopeParams>(), 12);
        assert_eq!(std::mem::size_of::<AttnDims>(), 8 + 7 * 4 + 4);
    }

    #[test]
    fn kernel_names_pick_the_row_build() {
        assert_eq!(gemv_kernel_name(GemvKind::NormRope, 1, Precision::Bf16), "gemv_norm_rope_r1_bf16");
        assert_eq!(gemv_kernel_name(GemvKind::Norm, 2, Precision::Bf16), "gemv_norm_r2_bf16");
        assert_eq!(gemv_kernel_name(GemvKind::Add, 3, Precision::F32), "gemv_add_r4_f32");
        assert_eq!(gemv_kernel_name(GemvKind::NormSwiglu, 4, Precision::Bf16), "gemv_norm_swiglu_r4_bf16");
    }

    #[test]
    fn fused_decode_needs_few_rows_and_widths_of_eight() {
        assert!(fused_decode_fits(1, &[4096, 4096, 14336]));
        assert!(fused_decode_fits(4, &[64, 64, 176]));
        assert!(!fused_decode_fits(5, &[4096]));
        assert!(!fused_decode_fits(0, &[4096]));
        assert!(!fused_decode_fits(2, &[4096, 100]));
    }
}
