//! The absorbed MLA attention of a `glm5_next` DSA layer over each row's selected positions, in
//! two forms that compute the same thing:
//! - **split** (`cuda/glm5.cu`, f32 arithmetic; every step in the f32 validation precision):
//!   `q̃ = W^Kᵀ q` per (head, row), then flash-decoding splits of `MLA_SPLIT` positions per
//!   (head, row) and a combine that merges the splits in order and projects with `W^V`;
//! - **tensor cores** (`cuda/glm5_mla.cu`, bf16): `q̃` and `o = W^V ĉ` as batched cuBLAS GEMMs
//!   (one batch per head), and between them one block per row that takes all heads at once (every
//!   head reads the same latent records) through mma.sync tiles of 64 positions.
//!
//! Which one a bf16 step takes is [`Glm5CudaBackend::mla_on_tensor_cores`]: by the step's row
//! count, so a row's result may depend on the steps it shares (as the cuBLAS projections already
//! do in bf16); within either form a row never depends on the others.

use super::forward::{StepInputs, BLOCK};
use super::Glm5CudaBackend;
use crate::backend::cuda::decode::allow_dynamic_smem;
use crate::backend::cuda::gpu::{cfg, cfg3, grid_for, Precision, Strided};
use crate::backend::BackendError;
use crate::launch;
use crate::model::glm5_next::Glm5Config;

/// Selected positions per block of the split MLA attention (`MLA_SPLIT` in cuda/glm5.cu).
const MLA_SPLIT: usize = 64;
/// Threads (and latent values) per block of the absorbed query `q̃ = W^Kᵀ q`.
const MLA_QT_THREADS: usize = 128;
/// Blocks per (head, row) that share the MLA output projection `W^V ĉ`.
const MLA_COMBINE_GROUPS: u32 = 4;
/// Most bytes of split partials one MLA attention launch may use; a step with more rows runs in
/// row tiles (the result of a row does not depend on its tile).
const MLA_PART_BYTES: usize = 256 << 20;
/// The tensor-core kernel's limits (`MLA_HEADS_PAD`, `MLA_MAX_NTILES` in cuda/glm5_mla.cu).
const MMA_MAX_HEADS: usize = 64;
const MMA_MAX_RANK: usize = 512;
const MMA_THREADS: u32 = 256;
/// Positions per tile of the tensor-core kernel (`MLA_TILE`).
const MMA_TILE: usize = 64;
/// Steps with at least this many rows take the tensor cores in bf16 unless
/// `SHELFSERVE_GLM5_MLA_MMA_MIN_ROWS` says otherwise (0: never). The crossover measured on the
/// H200 at GLM-5.3-Flash widths (session 15): the split form is faster at 1 and 8 rows, the two
/// are even at 12, the tensor cores faster from 16 (1.3× the DSA layer at 16 rows and 8k context,
/// 2.2× at 32 rows and 1k, 4.5× at 128 rows).
pub const DEFAULT_MMA_MIN_ROWS: usize = 12;

/// Dynamic shared memory of `mla_attend_mma` for latent rank `r`: Q̃ and C tiles (bf16 rows of
/// r + 8), S (f32 rows of 68), P (bf16 rows of 72), three row statistics and the record offsets.
pub fn mma_smem_bytes(r: usize) -> usize {
    let heads = MMA_MAX_HEADS;
    2 * (heads + MMA_TILE) * (r + 8)
        + 4 * heads * (MMA_TILE + 4)
        + 2 * heads * (MMA_TILE + 8)
        + 4 * 3 * heads
        + 8 * MMA_TILE
}

/// The minimum step rows for the tensor-core form, from `SHELFSERVE_GLM5_MLA_MMA_MIN_ROWS`.
pub fn mma_min_rows_from_env() -> Result<usize, BackendError> {
    match std::env::var("SHELFSERVE_GLM5_MLA_MMA_MIN_ROWS") {
        Err(_) => Ok(DEFAULT_MMA_MIN_ROWS),
        Ok(v) => v.trim().parse().map_err(|_| BackendError::Unavailable {
            device: "cuda".into(),
            reason: format!("SHELFSERVE_GLM5_MLA_MMA_MIN_ROWS={v:?} is not a row count (0 turns it off)"),
        }),
    }
}

/// The buffers one MLA attention reads and writes (device addresses).
pub(super) struct MlaAttend {
    /// `[rows, H, d_n]` f32 queries (no-RoPE part).
    pub q: u64,
    /// `[H·(d_n + d_v), r]` in the storage precision: per head W^K rows, then W^V rows.
    pub kv_b: u64,
    /// `[rows, max_sel]` selected positions and `[rows]` their counts.
    pub sel: u64,
    pub sel_count: u64,
    /// Offset of the latent in a token's cache record (f32 elements).
    pub latent_off: usize,
    pub max_sel: usize,
    /// `[rows, H, d_v]` f32 output.
    pub out: u64,
}

impl Glm5CudaBackend {
    /// Whether a DSA layer of this step runs on the tensor cores.
    pub(super) fn mla_on_tensor_cores(&self, c: &Glm5Config, rows: usize) -> bool {
        self.prec == Precision::Bf16
            && self.mla_mma_min_rows > 0
            && rows >= self.mla_mma_min_rows
            && c.num_attention_heads <= MMA_MAX_HEADS
            && c.kv_lora_rank.is_multiple_of(32)
            && c.kv_lora_rank <= MMA_MAX_RANK
    }

    /// Steps with at least `rows` rows take the tensor-core form in bf16 (0: never). Benches and
    /// tests compare the two forms with it.
    pub fn set_mla_mma_min_rows(&mut self, rows: usize) {
        self.mla_mma_min_rows = rows;
        // Captured steps hold the other form's launches.
        self.graphs.forget();
    }

    pub(super) fn mla_attend_split(
        &mut self,
        c: &Glm5Config,
        inp: &StepInputs,
        a: &MlaAttend,
    ) -> Result<(), BackendError> {
        let n = inp.n_rows;
        let (h, dn, dv, r) = (c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank);
        let qt = self.scratch.get(&self.gpu, "mla_qt", 4 * n * h * r)?;
        let splits = a.max_sel.div_ceil(MLA_SPLIT).max(1);
        let part_row = 4 * h * splits * (r + 2);
        let tile = (MLA_PART_BYTES / part_row).clamp(1, n);
        let part = self.scratch.get(&self.gpu, "mla_part", part_row * tile)?;
        let qt_f = self.gpu.func("glm5", &format!("mla_qt_{}", self.prec.suffix()))?;
        let part_f = self.gpu.func("glm5", "mla_attend_part")?;
        let comb_f = self.gpu.func("glm5", &format!("mla_attend_combine_{}", self.prec.suffix()))?;
        let (kv, bs, ts) = (self.kv.ptr(), self.geom.block_size as i32, self.layout.token_stride as i32);
        let (hh, dni, dvi, ri, ms, si, lat_off) =
            (h as i32, dn as i32, dv as i32, r as i32, a.max_sel as i32, splits as i32, a.latent_off as i32);
        let scale = 1.0f32 / (dn as f32).sqrt();
        let part_smem = (4 * (r + MLA_SPLIT).next_multiple_of(2) + 8 * MLA_SPLIT) as u32;
        let mut row0 = 0usize;
        while row0 < n {
            let rows = tile.min(n - row0) as u32;
            let r0 = row0 as i32;
            let qt_cfg = cfg3((h as u32, rows, r.div_ceil(MLA_QT_THREADS) as u32), MLA_QT_THREADS as u32, 0);
            launch!(self.gpu, qt_f.clone(), qt_cfg, &a.q, &a.kv_b, &qt, &r0, &hh, &dni, &dvi, &ri)?;
            launch!(
                self.gpu,
                part_f.clone(),
                cfg3((h as u32, rows, splits as u32), BLOCK, part_smem),
                &qt,
                &kv,
                &inp.dsa_rows,
                &inp.tables,
                &a.sel,
                &a.sel_count,
                &part,
                &r0,
                &bs,
                &ts,
                &lat_off,
                &hh,
                &ri,
                &ms,
                &si,
                &scale
            )?;
            launch!(
                self.gpu,
                comb_f.clone(),
                cfg3((h as u32, rows, MLA_COMBINE_GROUPS), BLOCK, (4 * r) as u32),
                &part,
                &a.kv_b,
                &a.sel_count,
                &a.out,
                &r0,
                &hh,
                &dni,
                &dvi,
                &ri,
                &si
            )?;
            row0 += rows as usize;
        }
        Ok(())
    }

    pub(super) fn mla_attend_mma(
        &mut self,
        c: &Glm5Config,
        inp: &StepInputs,
        a: &MlaAttend,
    ) -> Result<(), BackendError> {
        let n = inp.n_rows;
        let (h, dn, dv, r) = (c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank);
        let head_rows = (dn + dv) * r;
        // q in bf16, then q̃_h[n, r] = q_h[n, d_n] · W^K_h[d_n, r] for every head (bf16 out).
        let q16 = self.scratch.get(&self.gpu, "mla_q16", 2 * n * h * dn)?;
        let cast = self.gpu.func("glm5", "cast_bf16")?;
        let count = (n * h * dn) as i64;
        launch!(self.gpu, cast, cfg((grid_for(n * h * dn, BLOCK), 1), BLOCK, 0), &a.q, &q16, &count)?;
        let qt = self.scratch.get(&self.gpu, "mla_qt16", 2 * n * h * r)?;
        self.gpu.gemm_batched_bf16(
            false,
            (r, n, dn),
            Strided { ptr: a.kv_b, ld: r, stride: head_rows },
            Strided { ptr: q16, ld: h * dn, stride: dn },
            Strided { ptr: qt, ld: h * r, stride: r },
            true,
            h,
        )?;
        let ctx = self.scratch.get(&self.gpu, "mla_ctx16", 2 * n * h * r)?;
        let f = self.gpu.func("glm5_mla", "mla_attend_mma")?;
        let smem = mma_smem_bytes(r) as u32;
        allow_dynamic_smem(&f, smem)?;
        let (kv, bs, ts) = (self.kv.ptr(), self.geom.block_size as i32, self.layout.token_stride as i32);
        let (lat_off, hh, ri, ms) = (a.latent_off as i32, h as i32, r as i32, a.max_sel as i32);
        let scale = 1.0f32 / (dn as f32).sqrt();
        launch!(
            self.gpu,
            f,
            cfg((n as u32, 1), MMA_THREADS, smem),
            &qt,
            &kv,
            &inp.dsa_rows,
            &inp.tables,
            &a.sel,
            &a.sel_count,
            &ctx,
            &bs,
            &ts,
            &lat_off,
            &hh,
            &ri,
            &ms,
            &scale
        )?;
        // o_h[n, d_v] = ĉ_h[n, r] · W^V_hᵀ (W^V_h stored [d_v, r] after W^K_h), f32 out.
        self.gpu.gemm_batched_bf16(
            true,
            (dv, n, r),
            Strided { ptr: a.kv_b + (2 * dn * r) as u64, ld: r, stride: head_rows },
            Strided { ptr: ctx, ld: h * r, stride: r },
            Strided { ptr: a.out, ld: h * dv, stride: dv },
            false,
            h,
        )
    }
}
