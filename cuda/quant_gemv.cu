// Weight-only quantized linears kept packed on the device, in the CPU's `PackedRows` layout
// (src/model/quant/packed.rs): row-major codes (`row_bytes` per row), and per (row, group)
// scales:
//   FP8   : float8_e4m3fn codes, one byte per weight; f32 checkpoint scale per 128 columns.
//   INT4  : symmetric int4 `q + 8`, two per byte (element 2i in the low nibble); f32 scale per
//           `group` (32, 64 or 128) columns.
//   NVFP4 : E2M1 codes two per byte (same nibble order); one E4M3 scale byte per 16 columns and
//           one f32 global divisor per row (`row_global`: per row so stacked projections keep
//           their own).
// A weight is `code value × group scale` exactly as the tools (and the CPU's `dequantize_row`)
// compute it in f32: FP8 `e4m3 · s`, int4 `(q − 8) · s`, NVFP4 `e2m1 · (s₈ / g)`.
//
// quant_gemv_<fmt>_r<R>_<T>: y[r, col] (+)= x[r, :] · W[col, :] for the token rows of the step
// (x in T, the storage type, as the cuBLAS path takes it; y f32 with row stride `ldy`).
// Weight-only GEMV is bound by memory and, for 4-bit codes, by instruction issue (40 weights per
// clock per SM at full bandwidth), so the layout is built for both:
//   * one warp owns NR (2 or 4) weight rows (no __syncthreads, no shared memory); lane l takes the
//     16-byte chunks l, l + 32, ... of each row (or, in the piece layout, its 8-weight pieces
//     l, l + 32, ...), U units of every row loaded before the first is used (NR·U independent
//     streaming loads in flight per lane);
//   * token rows come in tiles of R (grid x, fastest, so the tiles of one weight block run side by
//     side and re-read its codes from L2), weight blocks of QG_WARPS·NR rows on grid y;
//   * codes are decoded to f32 in registers, the x values of a piece shared by the warp's NR rows:
//     int4 through `prmt` into the 2²³ magic float (two ops a weight); FP8 and E2M1 by moving
//     their bits into an f32's exponent and mantissa, which reads as value · 2⁻¹²⁰ (resp. 2⁻¹²⁶):
//     instead of one multiply per weight, x is taken × 2^XS and the group scale × 2^XS (XS = 60,
//     63: exact powers of two, so every product and sum is the same float as unscaled, far from
//     overflow and underflow for activations and scales of real models).
// A piece of 8 weights adds `scale · Σ w·x` (an 8-FMA chain) to the lane's accumulator; the 32
// lanes are then summed by the xor tree of `warp_sum`. The order is fixed by k and the build's
// layout alone (units in increasing order per lane, the same tree), and every build of a layout
// sums alike, so a token row's result never depends on m, on the tile it falls in, or on the
// other rows of the batch (the two layouts sum in different orders: a switch between them is a
// deployment choice, never made per step).
//
// quant_dequant_<fmt>_<T>: out[n, k] in T = the same f32 weights (rounded to T): the prefill
// path dequantizes one matrix at a time into a reused scratch and runs the cuBLAS GEMM on it;
// one thread per 16-byte chunk, 16-byte stores.

#define QG_THREADS 128
#define QG_WARPS (QG_THREADS / 32)
// Weight rows per warp: 2 in the 1-2 token-row builds (twice the warps for the small matrices,
// whose grids would otherwise leave the SMs under-filled), 4 in the others (x shared by more
// rows). `gemv_warp_rows` in src/backend/cuda/quant.rs: the grid depends on it.
#define QG_NR_SMALL 2
#define QG_NR_LARGE 4
// Lane layout of each build: 0 = lane l takes the 16-byte chunks l, l + 32, ... of a row (x read
// as 16-byte pieces 32 or 64 bytes apart across the lanes: 2-4× the L1 wavefronts of the
// codes' bytes); 1 = lane l takes the 8-weight pieces l, l + 32, ... (4 or 8 bytes of codes,
// x read contiguously across the warp). The grid does not depend on it. Measured on the H200
// (8B llama, session 13), the piece layout is slower: batch-1 decode int4 3.53 ms against 3.19,
// FP8 4.19 / 4.04, batch 8 int4 14.7 / 10.8 ms; the GEMV alone on one layer at m = 1 int4 85 µs
// against 64, NVFP4 119 / 90 µs (NVFP4's batch-1 step was the exception, 4.36 / 4.76 ms, one
// run each: not taken without a second look).
#ifndef QG_PIECES_SMALL
#define QG_PIECES_SMALL 0
#endif
#ifndef QG_PIECES_LARGE
#define QG_PIECES_LARGE 0
#endif
// Units (chunks or pieces) of each row a lane loads before using the first, per build (the
// 8-row piece build at one: more spills registers). These and the layouts are switchable
// through SHELFSERVE_CUDA_DEFINES for measurements.
#ifndef QG_U_R1
#define QG_U_R1 (QG_PIECES_SMALL ? 8 : 4)
#endif
#ifndef QG_U_R2
#define QG_U_R2 (QG_PIECES_SMALL ? 8 : 4)
#endif
#ifndef QG_U_R4
#define QG_U_R4 (QG_PIECES_LARGE ? 2 : 1)
#endif
#ifndef QG_U_R8
#define QG_U_R8 1
#endif
#ifndef QG_BLOCKS_R1
#define QG_BLOCKS_R1 5
#endif

// Matches `QuantArgs` in src/backend/cuda/quant.rs: pointers first, then 4-byte fields.
struct QuantArgs {
    const void* x;            // gemv: T [m, k]
    const u8* codes;          // [n, row_bytes]
    const float* scales;      // FP8 / int4: [n, k / group]
    const u8* scale_codes;    // NVFP4: e4m3 [n, k / 16]
    const float* row_global;  // NVFP4: [n]
    void* y;                  // gemv: f32, row r at y + r·ldy; dequant: T [n, k]
    int m, n, k, ldy;
    int group;                // columns per scale (FP8 128, int4 32/64/128, NVFP4 16)
    int accumulate;           // gemv: y += instead of y =
};

// Weights per 16-byte chunk of codes, and XS: the decoded code is value · 2^-2XS (see above).
template <int FMT> struct Fmt;
template <> struct Fmt<FMT_FP8> { static const int W = 16; static const int XS = 60; };
template <> struct Fmt<FMT_INT4> { static const int W = 32; static const int XS = 0; };
template <> struct Fmt<FMT_NVFP4> { static const int W = 32; static const int XS = 63; };

__device__ __forceinline__ unsigned word_of(const uint4& u, int i) {
    return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}

// The 8 weights of piece `p` of a chunk (FP8: pieces 0-1 of 8 bytes; 4-bit: pieces 0-3 of 4
// bytes), unscaled: FP8 value · 2⁻¹²⁰, NVFP4 value · 2⁻¹²⁶, int4 q − 8 exactly.
template <int FMT>
__device__ __forceinline__ void decode8(const uint4& c, int p, float* w) {
    if (FMT == FMT_FP8) {
        const unsigned lo = word_of(c, 2 * p), hi = word_of(c, 2 * p + 1);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            w[e] = e4m3_raw((lo >> (8 * e)) & 0xffu);
            w[4 + e] = e4m3_raw((hi >> (8 * e)) & 0xffu);
        }
    } else if (FMT == FMT_INT4) {
        // Even elements are the low nibbles of the word's bytes, odd ones the high nibbles:
        // `prmt` puts byte i of each half under the exponent of 2²³ (0x4B0000qq = 2²³ + q).
        const unsigned v = word_of(c, p), lo = v & 0x0f0f0f0fu, hi = (v >> 4) & 0x0f0f0f0fu;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[2 * i] = __int_as_float(__byte_perm(lo, 0x4b000000u, 0x7440 + i)) - 8388616.0f;
            w[2 * i + 1] = __int_as_float(__byte_perm(hi, 0x4b000000u, 0x7440 + i)) - 8388616.0f;
        }
    } else {
        const unsigned v = word_of(c, p);
#pragma unroll
        for (int e = 0; e < 8; ++e) w[e] = e2m1_raw(v >> (4 * e));
    }
}

// The scale of group `g` of row `row` as the tools multiply it (FP8 / int4 the checkpoint's
// f32, NVFP4 e4m3(s₈) / global with IEEE division, as the CPU), times 2^XS.
template <int FMT>
__device__ __forceinline__ float group_scale(const QuantArgs& a, int row, int g, float global) {
    const i64 groups = a.k / a.group;
    if (FMT == FMT_NVFP4) return __fdiv_rn(e4m3_value(a.scale_codes[row * groups + g]), global) * qg_pow2(Fmt<FMT>::XS);
    return __ldg(a.scales + row * groups + g) * qg_pow2(Fmt<FMT>::XS);
}

// 8 consecutive x values of one row as f32, times 2^XS.
template <int XS>
__device__ __forceinline__ void qg_load8(const float* p, float* o) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
    o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
    if (XS != 0) {
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] *= qg_pow2(XS);
    }
}
template <int XS>
__device__ __forceinline__ void qg_load8(const bf16* p, float* o) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const unsigned w = word_of(u, j);
        o[2 * j] = __uint_as_float(w << 16);
        o[2 * j + 1] = __uint_as_float(w & 0xffff0000u);
    }
    if (XS != 0) {
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] *= qg_pow2(XS);
    }
}

// Σ w·x over a piece of 8, then acc += s · that: the one accumulation order of every build.
__device__ __forceinline__ float qg_piece(const float* w, const float* x, float s, float acc) {
    float d = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) d = fmaf(w[e], x[e], d);
    return fmaf(s, d, acc);
}

// The unit of codes a lane loads at once: a 16-byte chunk (W weights), or one 8-weight piece
// (FP8 8 bytes, 4-bit 4 bytes).
template <int FMT, int PIECE> struct Unit {
    static const int BYTES = PIECE ? (FMT == FMT_FP8 ? 8 : 4) : 16;
    static const int WEIGHTS = PIECE ? 8 : Fmt<FMT>::W;
};

template <int BYTES>
__device__ __forceinline__ uint4 qg_ld_unit(const void* p) {
    if (BYTES == 16) return ld_stream(p);
    uint4 r = make_uint4(0, 0, 0, 0);
    if (BYTES == 8) {
        asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    } else {
        asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r.x) : "l"(p));
    }
    return r;
}

template <typename T, int FMT, int MAXR, int QG_NR, int U, int PIECE>
__device__ __forceinline__ void quant_gemv_impl(const QuantArgs a) {
    pdl_launch_dependents();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = (blockIdx.y * QG_WARPS + warp) * QG_NR;
    if (row0 >= a.n) return;  // writes nothing, reads nothing of its predecessors
    const int r0 = blockIdx.x * MAXR, m = min(a.m - r0, MAXR), k = a.k;
    // `chunks`, `W`: the lane's load units and their weights (16-byte chunks or 8-weight pieces).
    const int UB = Unit<FMT, PIECE>::BYTES;
    const int W = Unit<FMT, PIECE>::WEIGHTS, XS = Fmt<FMT>::XS, chunks = k / W;
    const int row_bytes = FMT == FMT_FP8 ? k : k / 2;
    const T* x = (const T*)a.x + (i64)r0 * k;
    int rows[QG_NR];
    float global[QG_NR];
#pragma unroll
    for (int j = 0; j < QG_NR; ++j) {
        rows[j] = min(row0 + j, a.n - 1);  // rows past n repeat the last one and are dropped
        global[j] = FMT == FMT_NVFP4 ? a.row_global[rows[j]] : 1.f;
    }
    float acc[MAXR][QG_NR];
#pragma unroll
    for (int r = 0; r < MAXR; ++r)
#pragma unroll
        for (int j = 0; j < QG_NR; ++j) acc[r][j] = 0.f;

    bool waited = false;
    for (int c0 = lane; c0 < chunks; c0 += 32 * U) {
        // Every load of this round first (weights only: allowed before pdl_wait).
        uint4 code[U][QG_NR];
        float s0[U][QG_NR], s1[U][QG_NR];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + 32 * u;
#pragma unroll
            for (int j = 0; j < QG_NR; ++j) {
                if (c < chunks) code[u][j] = qg_ld_unit<UB>(a.codes + (i64)rows[j] * row_bytes + (i64)c * UB);
                else code[u][j] = make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = min(c0 + 32 * u, chunks - 1), g = c * W / a.group;
#pragma unroll
            for (int j = 0; j < QG_NR; ++j) {
                // Scales of this unit's group(s): one (FP8, int4: a chunk never straddles a
                // group; nor does a piece), two for an NVFP4 chunk (16-weight groups, pieces 0-1
                // and 2-3).
                s0[u][j] = group_scale<FMT>(a, rows[j], g, global[j]);
                s1[u][j] = FMT == FMT_NVFP4 && !PIECE ? group_scale<FMT>(a, rows[j], g + 1, global[j]) : s0[u][j];
            }
        }
        if (!waited) {
            pdl_wait();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + 32 * u;
            if (c >= chunks) break;
#pragma unroll
            for (int p = 0; p < W / 8; ++p) {
                const T* xp = x + c * W + p * 8;
                if (MAXR <= 2) {
                    // Few token rows: hold their x, decode one weight row at a time.
                    float xv[MAXR][8];
#pragma unroll
                    for (int r = 0; r < MAXR; ++r)
                        if (r < m) qg_load8<XS>(xp + (i64)r * k, xv[r]);
#pragma unroll
                    for (int j = 0; j < QG_NR; ++j) {
                        float w[8];
                        decode8<FMT>(code[u][j], p, w);
                        const float s = (FMT == FMT_NVFP4 && p >= 2) ? s1[u][j] : s0[u][j];
#pragma unroll
                        for (int r = 0; r < MAXR; ++r)
                            if (r < m) acc[r][j] = qg_piece(w, xv[r], s, acc[r][j]);
                    }
                } else {
                    // Many: decode the NR rows' piece once, then one token row's x at a time.
                    float w[QG_NR][8];
#pragma unroll
                    for (int j = 0; j < QG_NR; ++j) decode8<FMT>(code[u][j], p, w[j]);
#pragma unroll
                    for (int r = 0; r < MAXR; ++r) {
                        if (r < m) {
                            float xv[8];
                            qg_load8<XS>(xp + (i64)r * k, xv);
#pragma unroll
                            for (int j = 0; j < QG_NR; ++j) {
                                const float s = (FMT == FMT_NVFP4 && p >= 2) ? s1[u][j] : s0[u][j];
                                acc[r][j] = qg_piece(w[j], xv, s, acc[r][j]);
                            }
                        }
                    }
                }
            }
        }
    }
    if (!waited) pdl_wait();  // lanes past the last chunk (k < 32 chunks)

    // Every lane gets each sum (xor tree); lane (r·NR + j) mod 32 writes it.
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
        if (r >= m) break;
#pragma unroll
        for (int j = 0; j < QG_NR; ++j) {
            const float v = warp_sum(acc[r][j]);
            if (lane == ((r * QG_NR + j) & 31) && row0 + j < a.n) {
                float* y = (float*)a.y + (i64)(r0 + r) * a.ldy + row0 + j;
                *y = a.accumulate ? *y + v : v;
            }
        }
    }
}

// 8 values rounded to T, in 16-byte stores (`p` 16-byte aligned: rows are whole chunks).
__device__ __forceinline__ void qg_store8(float* p, const float* v) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void qg_store8(bf16* p, const float* v) {
    unsigned u[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) u[j] = (unsigned)from_f<bf16>(v[2 * j]) | ((unsigned)from_f<bf16>(v[2 * j + 1]) << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(u[0], u[1], u[2], u[3]);
}

// One thread per 16-byte chunk of codes (grid-stride): its W weights, scaled, rounded to T and
// stored 16 bytes at a time.
template <typename T, int FMT>
__device__ void quant_dequant_impl(const QuantArgs a) {
    const int W = Fmt<FMT>::W, chunks = a.k / W, row_bytes = FMT == FMT_FP8 ? a.k : a.k / 2;
    const i64 total = (i64)a.n * chunks;
    T* out = (T*)a.y;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const int row = (int)(i / chunks), c = (int)(i % chunks);
        const uint4 code = ld_stream(a.codes + (i64)row * row_bytes + (i64)c * 16);
        const int g = c * W / a.group;
        const float global = FMT == FMT_NVFP4 ? a.row_global[row] : 1.f;
        // The group scale × 2^XS, and the decoded code × 2^-2XS: undo both exactly.
        const float unscale = qg_pow2(-Fmt<FMT>::XS), code_scale = qg_pow2(2 * Fmt<FMT>::XS);
        const float s0 = group_scale<FMT>(a, row, g, global) * unscale;
        const float s1 = FMT == FMT_NVFP4 ? group_scale<FMT>(a, row, g + 1, global) * unscale : s0;
        T* o = out + (i64)row * a.k + (i64)c * W;
#pragma unroll
        for (int p = 0; p < W / 8; ++p) {
            float w[8];
            decode8<FMT>(code, p, w);
            const float s = (FMT == FMT_NVFP4 && p >= 2) ? s1 : s0;
#pragma unroll
            for (int e = 0; e < 8; ++e) w[e] = (Fmt<FMT>::XS ? w[e] * code_scale : w[e]) * s;
            qg_store8(o + p * 8, w);
        }
    }
}

// Launch bounds: the 1-row builds at QG_BLOCKS_R1 blocks of 128 threads per SM (≤ 102
// registers at 5), the others at four (≤ 128).
#define QUANT_KERNELS(T, S, F, FMT)                                                                          \
    extern "C" __global__ void __launch_bounds__(QG_THREADS, QG_BLOCKS_R1) quant_gemv_##F##_r1_##S(const QuantArgs a) { \
        quant_gemv_impl<T, FMT, 1, QG_NR_SMALL, QG_U_R1, QG_PIECES_SMALL>(a);                                                              \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(QG_THREADS, 4) quant_gemv_##F##_r2_##S(const QuantArgs a) { \
        quant_gemv_impl<T, FMT, 2, QG_NR_SMALL, QG_U_R2, QG_PIECES_SMALL>(a);                                                              \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(QG_THREADS, 4) quant_gemv_##F##_r4_##S(const QuantArgs a) { \
        quant_gemv_impl<T, FMT, 4, QG_NR_LARGE, QG_U_R4, QG_PIECES_LARGE>(a);                                                              \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(QG_THREADS, 4) quant_gemv_##F##_r8_##S(const QuantArgs a) { \
        quant_gemv_impl<T, FMT, 8, QG_NR_LARGE, QG_U_R8, QG_PIECES_LARGE>(a);                                                              \
    }                                                                                                        \
    extern "C" __global__ void quant_dequant_##F##_##S(const QuantArgs a) { quant_dequant_impl<T, FMT>(a); }

#define QUANT_ALL_FORMATS(T, S)          \
    QUANT_KERNELS(T, S, fp8, FMT_FP8)    \
    QUANT_KERNELS(T, S, int4, FMT_INT4)  \
    QUANT_KERNELS(T, S, nvfp4, FMT_NVFP4)
FOR_STORAGE_TYPES(QUANT_ALL_FORMATS)

// Routed experts of a MoE layer stored packed, for decode-sized steps (glm5_next,
// src/backend/cuda/glm5_next/moe.rs): `moe_sort` (cuda/glm5.cu) grouped the step's (token, slot)
// pairs by expert on the device; block (x, u) takes output rows of used expert `groups[u]` and
// computes them for each of its pairs, the row's codes re-read from L1 (one expert's row serves
// all of its pairs). The per-expert matrices are found through `experts` (one `ExpertPacked` per
// expert, all of one format and shape). A pair's dot product takes the order of the chunk layout
// of `quant_gemv` (lane l: chunks l, l + 32, ... in order, pieces in order, then the xor tree),
// so it equals the single-row GEMV's bitwise and never depends on the batch.
// Weight rows per warp (sharing each x piece's load).
#ifndef QM_NR
#define QM_NR 4
#endif

template <int FMT>
__device__ void quant_moe_grouped_impl(const float* x, int x_div, const int* order, const int3* groups,
                                       const int* n_used, const ExpertPacked* experts, int group, float* y,
                                       int n_out, int k_in) {
    if ((int)blockIdx.y >= n_used[0]) return;
    const int3 g = groups[blockIdx.y];
    const ExpertPacked e = experts[g.x];
    QuantArgs a;
    a.codes = e.codes;
    a.scales = e.scales;
    a.scale_codes = e.scale_codes;
    a.row_global = e.row_global;
    a.k = k_in;
    a.group = group;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int W = Fmt<FMT>::W, XS = Fmt<FMT>::XS, chunks = k_in / W;
    const int row_bytes = FMT == FMT_FP8 ? k_in : k_in / 2;
    // A warp takes QM_NR consecutive rows: each x piece is loaded (and scaled) once for all of them.
    for (int o0 = (blockIdx.x * nwarps + warp) * QM_NR; o0 < n_out; o0 += gridDim.x * nwarps * QM_NR) {
        int rows[QM_NR];
        float global[QM_NR];
#pragma unroll
        for (int r = 0; r < QM_NR; ++r) {
            rows[r] = min(o0 + r, n_out - 1);  // rows past n_out repeat the last and are dropped
            global[r] = FMT == FMT_NVFP4 ? e.row_global[rows[r]] : 1.f;
        }
        for (int j = 0; j < g.z; ++j) {
            const int p = order[g.y + j];
            const float* xr = x + (i64)(p / x_div) * k_in;
            float acc[QM_NR];
#pragma unroll
            for (int r = 0; r < QM_NR; ++r) acc[r] = 0.f;
            for (int c = lane; c < chunks; c += 32) {
                const int gi = c * W / group;
                uint4 code[QM_NR];
                float s0[QM_NR], s1[QM_NR];
#pragma unroll
                for (int r = 0; r < QM_NR; ++r) {
                    code[r] = __ldg(reinterpret_cast<const uint4*>(e.codes + (i64)rows[r] * row_bytes + (i64)c * 16));
                    s0[r] = group_scale<FMT>(a, rows[r], gi, global[r]);
                    s1[r] = FMT == FMT_NVFP4 ? group_scale<FMT>(a, rows[r], gi + 1, global[r]) : s0[r];
                }
#pragma unroll
                for (int pc = 0; pc < W / 8; ++pc) {
                    float xv[8];
                    qg_load8<XS>(xr + c * W + pc * 8, xv);
#pragma unroll
                    for (int r = 0; r < QM_NR; ++r) {
                        float w[8];
                        decode8<FMT>(code[r], pc, w);
                        acc[r] = qg_piece(w, xv, (FMT == FMT_NVFP4 && pc >= 2) ? s1[r] : s0[r], acc[r]);
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < QM_NR; ++r) {
                const float v = warp_sum(acc[r]);
                if (lane == r && o0 + r < n_out) y[(i64)p * n_out + o0 + r] = v;
            }
        }
    }
}

#define QUANT_MOE_KERNEL(F, FMT)                                                                             \
    extern "C" __global__ void quant_moe_grouped_##F(const float* x, int x_div, const int* order,            \
                                                     const int3* groups, const int* n_used,                  \
                                                     const ExpertPacked* experts, int group, float* y,       \
                                                     int n_out, int k_in) {                                  \
        quant_moe_grouped_impl<FMT>(x, x_div, order, groups, n_used, experts, group, y, n_out, k_in);         \
    }
QUANT_MOE_KERNEL(fp8, FMT_FP8)
QUANT_MOE_KERNEL(int4, FMT_INT4)
QUANT_MOE_KERNEL(nvfp4, FMT_NVFP4)

// Seeded random code bytes for benchmark weights (`DeviceWeights::synthetic_packed`): byte i is
// a hash of (seed, i), then `(h & and_mask) | or_mask` — FP8 codes clear the top exponent bit
// (|value| < 2, never the NaN codes 0x7F/0xFF), NVFP4 scale bytes get a fixed positive exponent.
extern "C" __global__ void quant_fill_bytes(u8* p, i64 n, unsigned long long seed, unsigned and_mask, unsigned or_mask) {
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        unsigned long long z = seed * 0x9e3779b97f4a7c15ull + (unsigned long long)i;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        p[i] = (u8)(((unsigned)z & and_mask) | or_mask);
    }
}
