// Routed experts of large glm5_next steps (prefill, big batches) as grouped tensor-core GEMMs:
// every used expert's row tiles in one launch, so ~288 small GEMMs fill the GPU together instead
// of one after another. The host groups the step's (token, slot) pairs by expert and lists
// `MoeTile`s of at most MG_BM pairs each; a block computes one tile × MG_BN output columns with
// mma.sync m16n8k16 (bf16 in, f32 accumulate) over a cp.async pipeline of MG_STAGES k-slices.
//
// `moe_gate_up_swiglu` reads the tokens' bf16 rows through the pairs' token indices and applies
// the clamped SwiGLU in its epilogue: its 128 columns are 64 gate rows interleaved (8 by 8) with
// the 64 matching up rows, so the thread that holds gate column c also holds up column c, and
// the f32 gate/up product never reaches memory. `moe_down_scatter` reads the activations in pair
// order and writes each pair's f32 row to its slot. A row's sums run in one fixed order (k-slice
// by k-slice), so its result does not depend on the other rows of the step.
//
// Packed experts (FP8, int4, NVFP4; `ExpertPacked`, layouts in cuda/quant_gemv.cu) take the same
// kernels with a different weight loader: a thread loads 16 weights' codes of the next k-slice
// into registers while the tensor cores work on this one, then decodes them with their group
// scale to exactly the bf16 weights `quant_dequant_<fmt>_bf16` makes (value × scale in f32,
// rounded once) and stores them to a double-buffered shared tile. The weights stay packed in
// memory and are read once per tile of pairs, with no dequantized copy of the matrix.

#define MG_BM 128
#define MG_BN 128
#define MG_BK 32
#define MG_LD (MG_BK + 8)  // bf16 per shared row: 80 bytes keeps ldmatrix free of bank conflicts
#define MG_STAGES 4
#define MG_THREADS 256
#define MG_BF16 (-1)  // FMT of dense bf16 experts (packed ones: FMT_FP8, FMT_INT4, FMT_NVFP4)

// One tile of pairs: `rows` (≤ MG_BM) consecutive sorted pairs from `row0`, all routed to `expert`.
struct MoeTile {
    int expert, row0, rows, pad;
};

// The SwiGLU of glm5.cu's `swiglu_clamped` (x · σ(x), σ with expf).
__device__ __forceinline__ float moe_silu(float x) { return x * (1.0f / (1.0f + expf(-x))); }

// Row `r` (0..MG_BN) of a block's weight tile: gate/up interleaves 8 gate rows with the 8 up rows
// of the same columns (`inter` rows apart); down takes the block's 128 rows in order.
template <bool GATE_UP>
__device__ __forceinline__ int moe_weight_row(int r, int inter) {
    if (GATE_UP) return ((r >> 3) & 1) * inter + blockIdx.x * (MG_BN / 2) + (r >> 4) * 8 + (r & 7);
    return blockIdx.x * MG_BN + r;
}

// Where a block's weights come from: the stacked dense experts [E, n_w, k] (bf16), or one
// `ExpertPacked` per expert in format FMT with `group` columns per scale (int4).
struct MoeWeights {
    const bf16* dense;
    const ExpertPacked* packed;
    int group;
};

// The 16 weights of a packed row from column `col` (a multiple of 16) in registers: FP8 16 code
// bytes, 4-bit 8; with the scales they need.
template <int FMT>
struct PackedSlice {
    uint4 codes;
    float scale;
};

template <int FMT>
__device__ __forceinline__ PackedSlice<FMT> packed_load(const ExpertPacked& e, int row, int col, int k, int group) {
    PackedSlice<FMT> p;
    if (FMT == FMT_FP8) {
        p.codes = ld_stream(e.codes + (i64)row * k + col);
        p.scale = __ldg(e.scales + (i64)row * (k / 128) + col / 128);
    } else {
        const uint2 c = *reinterpret_cast<const uint2*>(e.codes + (i64)row * (k / 2) + col / 2);
        p.codes = make_uint4(c.x, c.y, 0u, 0u);
        if (FMT == FMT_INT4) {
            p.scale = __ldg(e.scales + (i64)row * (k / group) + col / group);
        } else {
            p.scale = __fdiv_rn(e4m3_value(e.scale_codes[(i64)row * (k / 16) + col / 16]), __ldg(e.row_global + row));
        }
    }
    return p;
}

// Decode a slice to 16 bf16 (value × scale in f32, rounded once) and store them at `dst`.
template <int FMT>
__device__ __forceinline__ void packed_store(const PackedSlice<FMT>& p, bf16* dst) {
    unsigned out[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float v[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int e = 2 * j + h;  // weight index 0..15
            if (FMT == FMT_FP8) {
                const unsigned word = e < 4 ? p.codes.x : e < 8 ? p.codes.y : e < 12 ? p.codes.z : p.codes.w;
                v[h] = e4m3_value((word >> (8 * (e & 3))) & 0xffu) * p.scale;
            } else {
                // Element 2i in the low nibble of byte i, 2i + 1 in the high one.
                const unsigned word = e < 8 ? p.codes.x : p.codes.y;
                const unsigned q = (word >> (4 * (e & 7))) & 0xfu;
                v[h] = FMT == FMT_INT4 ? (float)((int)q - 8) * p.scale : e2m1_raw(q) * qg_pow2(126) * p.scale;
            }
        }
        out[j] = pack_bf16(v[0], v[1]);
    }
    reinterpret_cast<uint4*>(dst)[0] = make_uint4(out[0], out[1], out[2], out[3]);
    reinterpret_cast<uint4*>(dst)[1] = make_uint4(out[4], out[5], out[6], out[7]);
}

// a: GATE_UP: the step's token rows [tokens, k] (bf16), pair i reads row a_idx[i];
//    down: the activations [pairs, k] in sorted pair order (a_idx unused).
// GATE_UP writes act[pair, inter] (bf16, sorted pair order); down y[out_idx[pair], n_w] (f32).
template <bool GATE_UP, int FMT>
__device__ __forceinline__ void moe_gemm_impl(const bf16* __restrict__ a, const int* __restrict__ a_idx,
                                              const MoeWeights w, const MoeTile* __restrict__ tiles, int k, int n_w,
                                              int inter, bf16* __restrict__ act, float* __restrict__ y,
                                              const int* __restrict__ out_idx, float limit) {
    constexpr bool PACKED = FMT != MG_BF16;
    // Shared: MG_STAGES slices of A, then B: MG_STAGES slices (dense) or 2 decoded ones (packed).
    extern __shared__ __align__(16) unsigned char moe_smem[];
    bf16* as = reinterpret_cast<bf16*>(moe_smem);
    bf16* bs = as + MG_STAGES * MG_BM * MG_LD;
    const MoeTile tile = tiles[blockIdx.y];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    // A (and dense B): this thread's two rows, the same 16 bytes of each per k-slice.
    const int col8 = (tid & 3) * 8, r0 = tid >> 2;
    const bf16* a_row[2];
    const bf16* b_row[2];
    bool a_ok[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = r0 + i * 64;
        a_ok[i] = r < tile.rows;
        const i64 src = !a_ok[i] ? 0 : GATE_UP ? (i64)a_idx[tile.row0 + r] : (i64)(tile.row0 + r);
        a_row[i] = a + src * k + col8;
        if (!PACKED) b_row[i] = w.dense + ((i64)tile.expert * n_w + moe_weight_row<GATE_UP>(r, inter)) * k + col8;
    }
    // Packed B: this thread's row (tid / 2) and 16 columns ((tid % 2) · 16) of each k-slice.
    const int pb_row = tid >> 1, pb_col = (tid & 1) * 16;
    const int pb_w_row = moe_weight_row<GATE_UP>(pb_row, inter);
    ExpertPacked pe = {};
    if (PACKED) pe = w.packed[tile.expert];

    auto load_slice = [&](int stage, int kt) {
        const int off = kt * MG_BK;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int r = r0 + i * 64;
            cp_async16(as + (stage * MG_BM + r) * MG_LD + col8, a_row[i] + off, a_ok[i]);
            if (!PACKED) cp_async16(bs + (stage * MG_BN + r) * MG_LD + col8, b_row[i] + off, true);
        }
    };

    // 8 warps as 2 (rows) × 4 (columns), 64 × 32 outputs each: 4 × 4 mma tiles.
    const int wm = (warp & 1) * 64, wn = (warp >> 1) * 32;
    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

    const int slices = k / MG_BK;
#pragma unroll
    for (int s = 0; s < MG_STAGES - 1; ++s) {
        if (s < slices) load_slice(s, s);
        cp_async_commit();
    }
    PackedSlice<PACKED ? FMT : FMT_FP8> next;
    if (PACKED) next = packed_load<PACKED ? FMT : FMT_FP8>(pe, pb_w_row, pb_col, k, w.group);
    // ldmatrix lane roles. A (row-major m16×k16): rows lane%16, k half lane/16. B ([n][k], two n8
    // tiles per x4): n row lane%8 + 8·(lane/16), k half (lane/8)%2.
    const int a_r = lane & 15, a_k = (lane >> 4) * 8;
    const int b_n = (lane & 7) + (lane >> 4) * 8, b_k = ((lane >> 3) & 1) * 8;
    for (int kt = 0; kt < slices; ++kt) {
        if (PACKED) {
            // Buffer kt % 2 was last read in iteration kt − 2, which every warp finished before
            // the barrier of iteration kt − 1.
            packed_store(next, bs + ((kt & 1) * MG_BN + pb_row) * MG_LD + pb_col);
            if (kt + 1 < slices) next = packed_load<PACKED ? FMT : FMT_FP8>(pe, pb_w_row, (kt + 1) * MG_BK + pb_col, k, w.group);
        }
        cp_async_wait<MG_STAGES - 2>();
        __syncthreads();
        // Refill the stage every warp finished with in the previous iteration.
        if (kt + MG_STAGES - 1 < slices) load_slice((kt + MG_STAGES - 1) % MG_STAGES, kt + MG_STAGES - 1);
        cp_async_commit();
        const bf16* at = as + (kt % MG_STAGES) * MG_BM * MG_LD;
        const bf16* bt = bs + (PACKED ? (kt & 1) : kt % MG_STAGES) * MG_BN * MG_LD;
#pragma unroll
        for (int kk = 0; kk < MG_BK; kk += 16) {
            unsigned af[4][4], bfr[2][4];
#pragma unroll
            for (int mi = 0; mi < 4; ++mi) ldmatrix_x4(af[mi], at + (wm + mi * 16 + a_r) * MG_LD + kk + a_k);
#pragma unroll
            for (int p = 0; p < 2; ++p) ldmatrix_x4(bfr[p], bt + (wn + p * 16 + b_n) * MG_LD + kk + b_k);
#pragma unroll
            for (int mi = 0; mi < 4; ++mi)
#pragma unroll
                for (int nj = 0; nj < 4; ++nj)
                    mma_bf16(acc[mi][nj], af[mi], bfr[nj >> 1][(nj & 1) * 2], bfr[nj >> 1][(nj & 1) * 2 + 1]);
        }
    }
    cp_async_wait<0>();

    // Accumulator (mi, nj): elements 0,1 at row g, columns 2q, 2q+1 of the 8-column tile; 2,3 at
    // row g + 8.
    const int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = wm + mi * 16 + g + h * 8;
            if (r >= tile.rows) continue;
            const i64 pair = tile.row0 + r;
            if (GATE_UP) {
#pragma unroll
                for (int t = 0; t < 2; ++t) {
                    const float* gate = acc[mi][2 * t];
                    const float* up = acc[mi][2 * t + 1];
                    float v[2];
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float gv = fminf(gate[2 * h + e], limit);
                        const float uv = fminf(fmaxf(up[2 * h + e], -limit), limit);
                        v[e] = moe_silu(gv) * uv;
                    }
                    const int col = blockIdx.x * (MG_BN / 2) + (wn / 16 + t) * 8 + 2 * q;
                    *reinterpret_cast<unsigned*>(act + pair * inter + col) = pack_bf16(v[0], v[1]);
                }
            } else {
                const i64 dst = out_idx[pair];
#pragma unroll
                for (int nj = 0; nj < 4; ++nj) {
                    const int col = blockIdx.x * MG_BN + wn + nj * 8 + 2 * q;
                    *reinterpret_cast<float2*>(y + dst * n_w + col) = make_float2(acc[mi][nj][2 * h], acc[mi][nj][2 * h + 1]);
                }
            }
        }
    }
}

// Gate/up: grid (inter / 64, tiles), k = the hidden size; down: grid (hidden / 128, tiles),
// k = inter. Shared memory: `moe_gemm_smem` in src/backend/cuda/glm5_next/moe.rs.
#define MOE_GEMM_KERNELS(NAME, FMT)                                                                              \
    extern "C" __global__ void __launch_bounds__(MG_THREADS, 2)                                                  \
        moe_gate_up_swiglu_##NAME(const bf16* x, const int* token_of_pair, const MoeWeights w, const MoeTile* tiles, \
                                  int k, int inter, bf16* act, float limit) {                                    \
        moe_gemm_impl<true, FMT>(x, token_of_pair, w, tiles, k, 2 * inter, inter, act, nullptr, nullptr, limit); \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(MG_THREADS, 2)                                                  \
        moe_down_scatter_##NAME(const bf16* act, const MoeWeights w, const MoeTile* tiles, int k, int n_out,     \
                                float* y, const int* slot_of_pair) {                                             \
        moe_gemm_impl<false, FMT>(act, nullptr, w, tiles, k, n_out, 0, nullptr, y, slot_of_pair, 0.f);           \
    }
MOE_GEMM_KERNELS(bf16, MG_BF16)
MOE_GEMM_KERNELS(fp8, FMT_FP8)
MOE_GEMM_KERNELS(int4, FMT_INT4)
MOE_GEMM_KERNELS(nvfp4, FMT_NVFP4)
