//! The routed-expert FFN of a `glm5_next` step on the GPU: the router, then either the
//! device-grouped GEMVs (stacked dense experts, steps of at most `MOE_GEMV_MAX_ROWS` rows: pairs
//! grouped by expert on the device, each used expert read once) or one projection pair per used
//! expert (cuBLAS for dense experts; the packed kernels of `backend::cuda::quant` for a quantized
//! checkpoint's, in their own format), the shared expert, and the weighted combine. Larger steps
//! with packed experts and few pairs an expert run every used expert in one grouped tensor-core
//! launch per projection (`cuda/glm5_moe.cu`, `MoeGemm`). Split from `forward.rs`, whose step
//! calls `moe`.

use super::forward::{BLOCK, HC_CHUNK};
use super::weights::{Experts, Moe};
use super::Glm5CudaBackend;
use crate::backend::cuda::decode::allow_dynamic_smem;
use crate::backend::cuda::gpu::{cfg, grid_for, Precision};
use crate::backend::cuda::quant::{self, MatmulIo};
use crate::backend::BackendError;
use crate::launch;
use crate::model::glm5_next::Glm5Config;

/// Steps of at most this many token rows run the routed experts as grouped GEMVs (each used
/// expert read once, pairs grouped on the device); larger steps take one cuBLAS GEMM pair per
/// used expert. Up to here a row's result does not depend on the batch.
const MOE_GEMV_MAX_ROWS: usize = 64;

/// The same limit for packed experts (`quant_moe_grouped`), whose other path dequantizes every
/// used expert before its GEMM; `SHELFSERVE_GLM5_PACKED_MOE_MAX_ROWS` overrides it. Measured on
/// the H200 at GLM-5.3-Flash widths (10 layers, 1k context), grouped against per-expert: FP8
/// batch 64 1,797 / 1,794 tok/s, 128 2,044 / 1,714, 256 2,180 / 2,549; NVFP4 128 1,807 / 1,591,
/// 256 1,940 / 2,263.
pub(super) const PACKED_MOE_GEMV_MAX_ROWS: usize = 128;

/// Streams the dense experts' GEMMs of a large step are spread over (the main one included);
/// `SHELFSERVE_GLM5_MOE_STREAMS` overrides it (1: the main stream only).
pub(super) const MOE_LANES: usize = 4;

/// How the experts of a step over `MOE_GEMV_MAX_ROWS` rows run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum MoeGemm {
    /// Grouped tiles where they measured faster (`grouped_tiles_pay`), per expert elsewhere.
    Auto,
    /// Every used expert's row tiles in one launch per projection (`cuda/glm5_moe.cu`), the
    /// SwiGLU in the gate/up epilogue and the scatter in the down epilogue, wherever the shapes
    /// allow and the tiles are at least a quarter full.
    Grouped,
    /// One GEMM pair per used expert (cuBLAS for dense experts, dequantize + cuBLAS for packed
    /// ones) over the side lanes.
    PerExpert,
}

impl MoeGemm {
    /// `SHELFSERVE_GLM5_MOE_GEMM`: `auto` (the default), `grouped` or `cublas`.
    pub(super) fn from_env() -> Result<Self, BackendError> {
        match std::env::var("SHELFSERVE_GLM5_MOE_GEMM").as_deref() {
            Err(_) | Ok("auto") => Ok(MoeGemm::Auto),
            Ok("grouped") => Ok(MoeGemm::Grouped),
            Ok("cublas") => Ok(MoeGemm::PerExpert),
            Ok(v) => Err(BackendError::Unavailable {
                device: "cuda".into(),
                reason: format!("SHELFSERVE_GLM5_MOE_GEMM={v:?} is none of \"auto\", \"grouped\", \"cublas\""),
            }),
        }
    }
}

/// Pairs per tile of the grouped kernels (cuda/glm5_moe.cu: MG_BM).
const MOE_TILE_ROWS: usize = 128;

/// Dynamic shared memory of the grouped kernels (cuda/glm5_moe.cu): MG_STAGES (4) slices of A,
/// and of B 4 slices (dense) or 2 decoded ones (packed), each 128 rows of MG_LD (40) bf16.
fn moe_gemm_smem(format: &str) -> u32 {
    let b_slices = if format == "bf16" { 4 } else { 2 };
    ((4 + b_slices) * 128 * 40 * 2) as u32
}

/// Whether the grouped kernels' 128-pair tiles run a step of `pairs` pairs over `used` experts.
///
/// Measured on an H100 at GLM-5.3-Flash widths (docs/benchmarks.md, session 21), MoE time per
/// layer, per expert ÷ grouped: packed experts 1.34x (FP8) and 1.65x (int4) at a 2k-token prefill
/// (~57 pairs an expert), 0.89x and 1.02x at 8k (~228), 0.71x and 0.77x at 16k; dense bf16 0.94x
/// at 2k, 0.82x at 8k, 0.74x at 16k. So `Auto` takes them for packed experts up to one tile an expert on average, and
/// never for dense ones (cuBLAS sizes its tiles to the rows and its mainloop is faster than
/// ours once tiles are full). `Grouped` takes them from a quarter-full tile on average (at decode
/// sizes, ~4 pairs an expert, the tiles would multiply the tensor work ~30-fold).
fn grouped_tiles_pay(mode: MoeGemm, pairs: usize, used: usize, packed: bool) -> bool {
    match mode {
        MoeGemm::Auto => packed && pairs <= MOE_TILE_ROWS * used,
        MoeGemm::Grouped => packed || pairs >= 32 * used,
        MoeGemm::PerExpert => false,
    }
}

/// The grouped kernels' tile list: `[expert, first sorted pair, pairs, 0]` per tile of at most
/// `MOE_TILE_ROWS` pairs of one expert, from the used experts' `(expert, first row, rows)`.
fn moe_tiles(used: &[(usize, usize, usize)]) -> Vec<i32> {
    used.iter()
        .flat_map(|&(ex, row, m)| {
            (0..m)
                .step_by(MOE_TILE_ROWS)
                .flat_map(move |o| [ex as i32, (row + o) as i32, (m - o).min(MOE_TILE_ROWS) as i32, 0])
        })
        .collect()
}

pub(super) fn moe_lanes_from_env() -> Result<usize, BackendError> {
    match std::env::var("SHELFSERVE_GLM5_MOE_STREAMS") {
        Err(_) => Ok(MOE_LANES),
        Ok(v) => {
            v.trim().parse().ok().filter(|&n: &usize| (1..=16).contains(&n)).ok_or_else(|| BackendError::Unavailable {
                device: "cuda".into(),
                reason: format!("SHELFSERVE_GLM5_MOE_STREAMS={v:?} is not a stream count in 1..=16"),
            })
        }
    }
}

pub(super) fn packed_moe_max_rows_from_env() -> Result<usize, BackendError> {
    match std::env::var("SHELFSERVE_GLM5_PACKED_MOE_MAX_ROWS") {
        Err(_) => Ok(PACKED_MOE_GEMV_MAX_ROWS),
        Ok(v) => v.trim().parse().map_err(|_| BackendError::Unavailable {
            device: "cuda".into(),
            reason: format!("SHELFSERVE_GLM5_PACKED_MOE_MAX_ROWS={v:?} is not a row count"),
        }),
    }
}

/// Which projection of an expert.
#[derive(Clone, Copy)]
enum Projection {
    GateUp,
    Down,
}

impl Projection {
    /// This projection's member of a (gate/up, down) pair.
    fn pick<T>(self, (gate_up, down): (T, T)) -> T {
        match self {
            Projection::GateUp => gate_up,
            Projection::Down => down,
        }
    }
}

/// What the grouped tensor-core kernels read besides the weights: the step's f32 token rows
/// `u` (`n` of them) and, per sorted pair, its token and its row of the slot outputs.
struct GroupedInput {
    u: u64,
    n: usize,
    token_of_pair: u64,
    slot_of_pair: u64,
}

/// Where the grouped kernels read one projection's weights (`MoeWeights` in cuda/glm5_moe.cu):
/// the stacked dense matrix, or the per-expert table of packed ones with their group size.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct MoeWeightsArg {
    dense: u64,
    packed: u64,
    group: i32,
    _pad: i32,
}
// SAFETY: plain `#[repr(C)]` data matching `MoeWeights` in cuda/glm5_moe.cu (two pointers and an
// int, padded to 24 bytes).
unsafe impl crate::backend::cuda::gpu::DeviceRepr for MoeWeightsArg {}

/// The kernels' format suffix and the (gate/up, down) weights of `experts` for the grouped
/// tensor-core kernels, or `None` where they do not apply: shapes off their tiles (hidden a
/// multiple of 128, expert width of 64), packed experts of mixed formats, or more tiles than a
/// grid's y axis takes.
fn grouped_weights(
    experts: &Experts,
    d: usize,
    inter: usize,
    tiles: usize,
) -> Option<(&'static str, MoeWeightsArg, MoeWeightsArg)> {
    if !d.is_multiple_of(128) || !inter.is_multiple_of(64) || tiles > 65_535 {
        return None;
    }
    match experts {
        Experts::Stacked { gate_up, down } => Some((
            "bf16",
            MoeWeightsArg { dense: gate_up.ptr(), ..Default::default() },
            MoeWeightsArg { dense: down.ptr(), ..Default::default() },
        )),
        Experts::PerExpert { grouped: Some(g), .. } => {
            let group = g.format.group() as i32;
            Some((
                quant::format_tag(g.format),
                MoeWeightsArg { packed: g.gate_up.ptr(), group, ..Default::default() },
                MoeWeightsArg { packed: g.down.ptr(), group, ..Default::default() },
            ))
        }
        Experts::PerExpert { grouped: None, .. } => None,
    }
}

/// A step's (token, slot) pairs grouped by expert on the device (`moe_sort`).
#[derive(Clone, Copy)]
struct SortedPairs {
    order: u64,
    groups: u64,
    n_used: u64,
    /// Blocks on the grid's y axis: at most one per used expert.
    slots: u32,
}

impl Glm5CudaBackend {
    /// Large steps run their experts through the grouped tensor-core kernels (`true`) or one GEMM
    /// pair per used expert, whatever `SHELFSERVE_GLM5_MOE_GEMM` says. Tests compare the two.
    pub fn set_moe_gemm_grouped(&mut self, grouped: bool) {
        self.moe_gemm = if grouped { MoeGemm::Grouped } else { MoeGemm::PerExpert };
    }

    /// Whether a step of `n` rows groups its pairs by expert on the device (no routes read back).
    pub(super) fn moe_on_device(&self, w: &Moe, n: usize) -> bool {
        match &w.experts {
            Experts::Stacked { .. } => n <= MOE_GEMV_MAX_ROWS,
            Experts::PerExpert { grouped: Some(_), .. } => n <= self.packed_moe_max_rows,
            Experts::PerExpert { grouped: None, .. } => false,
        }
    }

    pub(super) fn moe(&mut self, c: &Glm5Config, w: &Moe, u: u64, n: usize, l: usize) -> Result<u64, BackendError> {
        let (d, e, k, inter) = (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, w.inter);
        let logits = self.scratch.get(&self.gpu, "moe_logits", 4 * n * e)?;
        self.linear(u, n, &w.router, logits)?;
        let experts = self.scratch.get(&self.gpu, "moe_experts", 4 * n * k)?;
        let weights = self.scratch.get(&self.gpu, "moe_weights", 4 * n * k)?;
        let f = self.gpu.func("glm5", "moe_route")?;
        let (bias, ei, gi, tgi, ki, norm) = (
            w.correction_bias.ptr(),
            e as i32,
            c.n_group as i32,
            c.topk_group as i32,
            k as i32,
            c.norm_topk_prob as i32,
        );
        launch!(
            self.gpu,
            f,
            cfg((n as u32, 1), BLOCK, (3 * e * 4) as u32),
            &logits,
            &bias,
            &experts,
            &weights,
            &ei,
            &gi,
            &tgi,
            &ki,
            &norm,
            &c.routed_scaling_factor
        )?;
        let pairs = n * k;
        let slot_out = self.scratch.get(&self.gpu, "moe_slot_out", 4 * pairs * d)?;
        if self.moe_on_device(w, n) {
            if self.profile.is_some() {
                let mut routes = vec![0i32; n * k];
                self.gpu.copy_dtoh(&mut routes, experts)?;
                self.profile_experts(l, &routes);
            }
            // Pairs grouped by expert on the device: no host round trip, each expert read once.
            let order = self.scratch.get(&self.gpu, "moe_order", 4 * pairs)?;
            let groups = self.scratch.get(&self.gpu, "moe_groups", 12 * e.min(pairs))?;
            let n_used = self.scratch.get(&self.gpu, "moe_n_used", 4)?;
            let sort = self.gpu.func("glm5", "moe_sort")?;
            let (pi, ei) = (pairs as i32, e as i32);
            launch!(self.gpu, sort, cfg((1, 1), 1024, (8 * e) as u32), &experts, &pi, &ei, &order, &groups, &n_used)?;
            let sorted = SortedPairs { order, groups, n_used, slots: e.min(pairs) as u32 };
            let gu = self.scratch.get(&self.gpu, "moe_gu", 4 * pairs * 2 * inter)?;
            self.expert_gemv(&w.experts, Projection::GateUp, &sorted, (u, k as i32), gu, (2 * inter, d))?;
            let act = self.scratch.get(&self.gpu, "moe_act", 4 * pairs * inter)?;
            let sw = self.gpu.func("glm5", "swiglu_clamped_f32")?;
            let (ii, pi) = (inter as i32, pairs as i32);
            launch!(
                self.gpu,
                sw,
                cfg((grid_for(inter, BLOCK).min(64), pairs as u32), BLOCK, 0),
                &gu,
                &act,
                &ii,
                &pi,
                &c.swiglu_limit
            )?;
            self.expert_gemv(&w.experts, Projection::Down, &sorted, (act, 1), slot_out, (d, inter))?;
        } else {
            self.moe_grouped(c, w, u, n, (experts, slot_out), l)?;
        }
        let y = self.mlp(c, &w.shared, u, n, "ffn_out")?;
        let f = self.gpu.func("glm5", "moe_combine")?;
        let (ki, di) = (k as i32, d as i32);
        let chunks = d.div_ceil(HC_CHUNK) as u32;
        launch!(self.gpu, f, cfg((n as u32, chunks), BLOCK, 0), &slot_out, &weights, &y, &ki, &di)?;
        Ok(y)
    }

    /// One projection of the used experts for every pair grouped by `sorted`: `y[p] = W_e ·
    /// x[p / x_div]` (`[n_out, k_in]` per expert), dense experts from the stacked matrix, packed
    /// ones through their pointer table, each decoded in registers.
    fn expert_gemv(
        &mut self,
        experts: &Experts,
        which: Projection,
        sorted: &SortedPairs,
        (x, x_div): (u64, i32),
        y: u64,
        (n_out, k_in): (usize, usize),
    ) -> Result<(), BackendError> {
        let (no, ki) = (n_out as i32, k_in as i32);
        // Output rows per block: one per warp for dense experts, QM_NR (4) per warp for packed ones.
        let rows_per_block = match experts {
            Experts::Stacked { .. } => BLOCK as usize / 32,
            Experts::PerExpert { .. } => 4 * BLOCK as usize / 32,
        };
        let grid = cfg(((n_out.div_ceil(rows_per_block) as u32).min(1024), sorted.slots), BLOCK, 0);
        let SortedPairs { order, groups, n_used, .. } = *sorted;
        match experts {
            Experts::Stacked { gate_up, down } => {
                let w = which.pick((gate_up, down)).ptr();
                let stride = (n_out * k_in) as i64;
                let f = self.gpu.func("glm5", &format!("moe_gemv_grouped_{}", self.prec.suffix()))?;
                launch!(self.gpu, f, grid, &x, &x_div, &order, &groups, &n_used, &w, &stride, &y, &no, &ki)
            }
            Experts::PerExpert { grouped: Some(g), .. } => {
                let table = which.pick((&g.gate_up, &g.down)).ptr();
                let group = g.format.group() as i32;
                let f = self.gpu.func("quant", &format!("quant_moe_grouped_{}", quant::format_tag(g.format)))?;
                launch!(self.gpu, f, grid, &x, &x_div, &order, &groups, &n_used, &table, &group, &y, &no, &ki)
            }
            Experts::PerExpert { grouped: None, .. } => {
                Err(BackendError::Device("packed experts of mixed formats take the per-expert path".into()))
            }
        }
    }

    /// `y[m, n_out] = x[m, k_in] · W_exᵀ` for one projection of expert `ex` (`x` in the storage
    /// precision): the stacked dense matrix through cuBLAS, a packed one as `quant::matmul`
    /// dispatches it (dequantizing into `dequant` for larger `m`).
    #[allow(clippy::too_many_arguments)]
    fn expert_matmul(
        &mut self,
        experts: &Experts,
        which: Projection,
        (ex, lane): (usize, usize),
        m: usize,
        (x, y): (u64, u64),
        (n_out, k_in): (usize, usize),
        dequant: u64,
    ) -> Result<(), BackendError> {
        match experts {
            Experts::Stacked { gate_up, down } => {
                let w = which.pick((gate_up, down)).at(ex * n_out * k_in * self.prec.bytes());
                self.gpu.gemm_on(lane, self.prec, m, n_out, k_in, x, w, y)
            }
            Experts::PerExpert { pairs, .. } => {
                let (gate_up, down) = &pairs[ex];
                let io = MatmulIo { x, y, ldy: n_out, dequant };
                quant::matmul(&mut self.gpu, self.prec, which.pick((gate_up, down)), m, k_in, io, false)
            }
        }
    }

    /// Run `work(self, lane)` for lanes 0..`lanes` between a fork and a join of the side lanes;
    /// the join happens on an error too, so no side work outlives the call unfenced.
    fn on_lanes(
        &mut self,
        lanes: usize,
        mut work: impl FnMut(&mut Self, usize) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        if lanes > 1 {
            self.gpu.fork_lanes()?;
        }
        let done = (0..lanes).try_for_each(|lane| work(self, lane));
        let joined = if lanes > 1 { self.gpu.join_lanes() } else { Ok(()) };
        done.and(joined)
    }

    /// Routed experts for larger steps and for packed experts: pairs sorted by expert, one
    /// projection pair per used expert; reads the routes from `experts`, writes each pair's output
    /// to its row of `slot_out`.
    fn moe_grouped(
        &mut self,
        c: &Glm5Config,
        w: &Moe,
        u: u64,
        n: usize,
        (experts, slot_out): (u64, u64),
        l: usize,
    ) -> Result<(), BackendError> {
        let (d, k, inter) = (c.hidden_size, c.num_experts_per_tok, w.inter);
        let mut routes = vec![0i32; n * k];
        self.gpu.copy_dtoh(&mut routes, experts)?;
        self.profile_experts(l, &routes);
        let mut by_expert: Vec<Vec<i32>> = vec![Vec::new(); c.n_routed_experts];
        for (p, &ex) in routes.iter().enumerate() {
            let ex = usize::try_from(ex).ok().filter(|&x| x < c.n_routed_experts).ok_or_else(|| {
                BackendError::Device(format!("the router chose expert {ex}, outside 0..{}", c.n_routed_experts))
            })?;
            by_expert[ex].push(p as i32);
        }
        // Token rows (gather) and pair rows (scatter), expert by expert.
        let pair_idx: Vec<i32> = by_expert.iter().flatten().copied().collect();
        let token_idx: Vec<i32> = pair_idx.iter().map(|&p| p / k as i32).collect();
        let pair_p = self.scratch.put(&self.gpu, "moe_pair_idx", &pair_idx)?;
        let token_p = self.scratch.put(&self.gpu, "moe_token_idx", &token_idx)?;
        let eb = self.prec.bytes();
        let pairs = pair_idx.len();
        // (expert, first sorted pair, pairs) of every used expert.
        let used: Vec<(usize, usize, usize)> = by_expert
            .iter()
            .enumerate()
            .filter(|(_, list)| !list.is_empty())
            .scan(0usize, |row, (ex, list)| {
                let start = *row;
                *row += list.len();
                Some((ex, start, list.len()))
            })
            .collect();
        let tiles = moe_tiles(&used);
        let packed = matches!(w.experts, Experts::PerExpert { .. });
        if self.prec == Precision::Bf16 && grouped_tiles_pay(self.moe_gemm, pairs, used.len(), packed) {
            if let Some(weights) = grouped_weights(&w.experts, d, inter, tiles.len() / 4) {
                let x = GroupedInput { u, n, token_of_pair: token_p, slot_of_pair: pair_p };
                return self.moe_tensor_core(c, weights, inter, &x, &tiles, slot_out);
            }
        }
        // Every used expert's gate/up product, one SwiGLU over all pairs (their rows are
        // contiguous), then every down product.
        let xg = self.scratch.get(&self.gpu, "moe_xg", eb * pairs * d)?;
        let gu = self.scratch.get(&self.gpu, "moe_gu_g", 4 * pairs * 2 * inter)?;
        let act = self.scratch.get(&self.gpu, "moe_act_g", eb * pairs * inter)?;
        let out = self.scratch.get(&self.gpu, "moe_out_g", 4 * pairs * d)?;
        let dequant = self.dequant_ptr();
        let gather = self.gpu.func("glm5", &format!("gather_rows_{}", self.prec.suffix()))?;
        let di = d as i32;
        launch!(self.gpu, gather, cfg((pairs as u32, 1), BLOCK, 0), &u, &token_p, &xg, &di)?;
        // One expert's GEMM fills a fraction of the GPU at prefill sizes (~200 rows), so dense
        // experts' GEMMs are spread over the side lanes and run side by side; each writes its
        // own rows, so the results are those of one stream. Packed experts share the dequantize
        // scratch and stay on the main stream.
        let lanes = match w.experts {
            Experts::Stacked { .. } => self.moe_lanes,
            Experts::PerExpert { .. } => 1,
        };
        self.gpu.ensure_side_lanes(lanes - 1)?;
        self.on_lanes(lanes, |b, lane| {
            for &(ex, row, m) in used.iter().skip(lane).step_by(lanes) {
                let (x_r, gu_r) = (xg + (eb * row * d) as u64, gu + (4 * row * 2 * inter) as u64);
                b.expert_matmul(&w.experts, Projection::GateUp, (ex, lane), m, (x_r, gu_r), (2 * inter, d), dequant)?;
            }
            Ok(())
        })?;
        let sw = self.gpu.func("glm5", &format!("swiglu_clamped_{}", self.prec.suffix()))?;
        let (ii, pi) = (inter as i32, pairs as i32);
        let grid = cfg((grid_for(inter, BLOCK).min(64), (pairs as u32).min(65_535)), BLOCK, 0);
        launch!(self.gpu, sw, grid, &gu, &act, &ii, &pi, &c.swiglu_limit)?;
        self.on_lanes(lanes, |b, lane| {
            for &(ex, row, m) in used.iter().skip(lane).step_by(lanes) {
                let (act_r, out_r) = (act + (eb * row * inter) as u64, out + (4 * row * d) as u64);
                b.expert_matmul(&w.experts, Projection::Down, (ex, lane), m, (act_r, out_r), (d, inter), dequant)?;
            }
            Ok(())
        })?;
        let scatter = self.gpu.func("glm5", "scatter_rows")?;
        launch!(self.gpu, scatter, cfg((pairs as u32, 1), BLOCK, 0), &out, &pair_p, &slot_out, &di)
    }

    /// The routed experts of a large step in the grouped tensor-core kernels (dense bf16 or
    /// packed experts): the token rows cast to bf16 once, then one launch per projection over
    /// every tile of `tiles` (gate/up with the clamped SwiGLU in its epilogue, down writing each
    /// pair's row of `slot_out`).
    fn moe_tensor_core(
        &mut self,
        c: &Glm5Config,
        (format, gate_up, down): (&'static str, MoeWeightsArg, MoeWeightsArg),
        inter: usize,
        x: &GroupedInput,
        tiles: &[i32],
        slot_out: u64,
    ) -> Result<(), BackendError> {
        let d = c.hidden_size;
        let n_tiles = (tiles.len() / 4) as u32;
        let pairs = tiles.chunks(4).map(|t| t[2] as usize).sum::<usize>();
        let tiles_p = self.scratch.put(&self.gpu, "moe_tiles", tiles)?;
        let xb = self.scratch.get(&self.gpu, "moe_xb", 2 * x.n * d)?;
        let cast = self.gpu.func("glm5", "cast_bf16")?;
        let len = (x.n * d) as i64;
        launch!(self.gpu, cast, cfg((grid_for(x.n * d, BLOCK), 1), BLOCK, 0), &x.u, &xb, &len)?;
        let act = self.scratch.get(&self.gpu, "moe_act_g", 2 * pairs * inter)?;
        let (di, ii) = (d as i32, inter as i32);
        let smem = moe_gemm_smem(format);
        let f = self.gpu.func("glm5_moe", &format!("moe_gate_up_swiglu_{format}"))?;
        allow_dynamic_smem(&f, smem)?;
        let grid = cfg(((inter / 64) as u32, n_tiles), 256, smem);
        launch!(self.gpu, f, grid, &xb, &x.token_of_pair, &gate_up, &tiles_p, &di, &ii, &act, &c.swiglu_limit)?;
        let f = self.gpu.func("glm5_moe", &format!("moe_down_scatter_{format}"))?;
        allow_dynamic_smem(&f, smem)?;
        let grid = cfg(((d / 128) as u32, n_tiles), 256, smem);
        launch!(self.gpu, f, grid, &act, &down, &tiles_p, &ii, &di, &slot_out, &x.slot_of_pair)
    }
}

#[cfg(test)]
mod tests {
    use super::{grouped_tiles_pay, moe_tiles};

    #[test]
    fn auto_takes_the_tiles_for_packed_experts_up_to_one_tile_an_expert_forced_from_a_quarter_tile() {
        use super::MoeGemm::{Auto, Grouped, PerExpert};
        // 2k- and 8k-token prefills at top 8 over 288 experts (~57 and ~228 pairs each).
        assert!(grouped_tiles_pay(Auto, 2048 * 8, 288, true));
        assert!(!grouped_tiles_pay(Auto, 8192 * 8, 288, true));
        assert!(!grouped_tiles_pay(Auto, 2048 * 8, 288, false), "dense experts stay on cuBLAS");
        assert!(grouped_tiles_pay(Auto, 128 * 5, 5, true));
        assert!(!grouped_tiles_pay(Auto, 128 * 5 + 1, 5, true));
        // Forced: dense from 32 pairs an expert, packed always; per expert: never.
        assert!(grouped_tiles_pay(Grouped, 8192 * 8, 288, false));
        assert!(!grouped_tiles_pay(Grouped, 128 * 8, 288, false));
        assert!(grouped_tiles_pay(Grouped, 128 * 8, 288, true));
        assert!(grouped_tiles_pay(Grouped, 32 * 5, 5, false));
        assert!(!grouped_tiles_pay(Grouped, 32 * 5 - 1, 5, false));
        assert!(!grouped_tiles_pay(PerExpert, 2048 * 8, 288, true));
    }

    #[test]
    fn tiles_cut_each_experts_pairs_into_runs_of_at_most_128() {
        let used = [(3, 0, 300), (7, 300, 1), (9, 301, 128), (10, 429, 129)];
        #[rustfmt::skip]
        let expected = vec![
            3, 0, 128, 0, 3, 128, 128, 0, 3, 256, 44, 0,
            7, 300, 1, 0,
            9, 301, 128, 0,
            10, 429, 128, 0, 10, 557, 1, 0,
        ];
        assert_eq!(moe_tiles(&used), expected);
        assert!(moe_tiles(&[]).is_empty());
    }
}
