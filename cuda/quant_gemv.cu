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
// quant_gemv_<fmt>_r<R>_<T>: y[r, col] (+)= x[r, :] · W[col, :] for m ≤ R ≤ 8 token rows, x in T
// (the storage type, as the cuBLAS path takes it), y f32 with row stride `ldy`. Codes are read
// with 16-byte streaming loads and decoded to f32 in registers; nothing is widened in memory.
// One block of 256 threads computes QG_COLS weight rows for every token row: thread t takes the
// 16-byte chunks t, t + 256, ... of each row (16 FP8 or 32 4-bit weights), and for each 8-weight
// piece adds `scale · Σ w·x` (an FMA chain) to its accumulator. Each output is then reduced over
// the block in an order fixed by k alone (per-thread chunks, warp tree, warps in order), so a
// token row's result never depends on m or on the other rows of the batch.
//
// quant_dequant_<fmt>_<T>: out[n, k] in T = the same f32 weights (rounded to T): the interim
// prefill path dequantizes one matrix at a time into a scratch and runs the cuBLAS GEMM on it.

#define QG_THREADS 256
#define QG_WARPS (QG_THREADS / 32)
#define QG_COLS 8

#define FMT_FP8 0
#define FMT_INT4 1
#define FMT_NVFP4 2

typedef unsigned char u8;

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

// Weights per 16-byte chunk of codes.
template <int FMT> struct Fmt;
template <> struct Fmt<FMT_FP8> { static const int W = 16; };
template <> struct Fmt<FMT_INT4> { static const int W = 32; };
template <> struct Fmt<FMT_NVFP4> { static const int W = 32; };

__device__ __forceinline__ uint4 qg_ld_stream(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// The value of an e4m3fn byte (no NaN codes: refused at load). Its bits shifted into an f32's
// exponent/mantissa place read as 2⁻¹²⁰ × the value (subnormals included: the f32 is then
// subnormal too, and the GPU keeps subnormals without --ftz), so one exact multiply restores it.
__device__ __forceinline__ float e4m3_value(unsigned b) {
    return __int_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20)) * __int_as_float((127 + 120) << 23);
}

// The value of an E2M1 nibble, the same way (2⁻¹²⁶ × the value; 0, ±0.5 … ±6 exactly).
__device__ __forceinline__ float e2m1_value(unsigned q) {
    return __int_as_float(((q & 0x8u) << 28) | ((q & 0x7u) << 22)) * __int_as_float((127 + 126) << 23);
}

// q − 8 for an int4 nibble, exactly: 2²³ + q read as a float, minus 2²³ + 8.
__device__ __forceinline__ float int4_value(unsigned q) { return __int_as_float(0x4b000000u | q) - 8388616.0f; }

__device__ __forceinline__ unsigned word_of(const uint4& u, int i) {
    return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}

// The 8 weights of piece `p` of a chunk (FP8: pieces 0-1 of 8 bytes; 4-bit: pieces 0-3 of 4
// bytes), decoded to f32 (unscaled).
template <int FMT>
__device__ __forceinline__ void decode8(const uint4& c, int p, float* w) {
    if (FMT == FMT_FP8) {
        const unsigned lo = word_of(c, 2 * p), hi = word_of(c, 2 * p + 1);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            w[e] = e4m3_value((lo >> (8 * e)) & 0xffu);
            w[4 + e] = e4m3_value((hi >> (8 * e)) & 0xffu);
        }
    } else {
        const unsigned v = word_of(c, p);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const unsigned q = (v >> (4 * e)) & 0xfu;
            w[e] = FMT == FMT_INT4 ? int4_value(q) : e2m1_value(q);
        }
    }
}

// The scale of group `g` of row `row`, as the tools multiply it: FP8 / int4 the checkpoint's f32,
// NVFP4 e4m3(s₈) / global (IEEE division, as the CPU).
template <int FMT>
__device__ __forceinline__ float group_scale(const QuantArgs& a, int row, int g) {
    const i64 groups = a.k / a.group;
    if (FMT == FMT_NVFP4) return __fdiv_rn(e4m3_value(a.scale_codes[row * groups + g]), a.row_global[row]);
    return a.scales[row * groups + g];
}

// 8 consecutive x values of one row as f32.
__device__ __forceinline__ void qg_load8(const float* p, float* o) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
    o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}
__device__ __forceinline__ void qg_load8(const bf16* p, float* o) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const unsigned w = word_of(u, j);
        o[2 * j] = __uint_as_float(w << 16);
        o[2 * j + 1] = __uint_as_float(w & 0xffff0000u);
    }
}

template <typename T, int FMT, int MAXR>
__device__ void quant_gemv_impl(const QuantArgs a) {
    __shared__ float red[QG_WARPS][MAXR * QG_COLS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int m = min(a.m, MAXR), k = a.k;
    const int W = Fmt<FMT>::W, chunks = k / W, row_bytes = FMT == FMT_FP8 ? k : k / 2;
    const T* x = (const T*)a.x;
    int rows[QG_COLS];
#pragma unroll
    for (int j = 0; j < QG_COLS; ++j) {
        const int r = blockIdx.x * QG_COLS + j;
        rows[j] = r < a.n ? r : 0;  // rows past n read row 0 and are dropped
    }
    float acc[MAXR][QG_COLS];
#pragma unroll
    for (int r = 0; r < MAXR; ++r)
#pragma unroll
        for (int j = 0; j < QG_COLS; ++j) acc[r][j] = 0.f;

    for (int c = tid; c < chunks; c += QG_THREADS) {
        uint4 code[QG_COLS];
#pragma unroll
        for (int j = 0; j < QG_COLS; ++j) code[j] = qg_ld_stream(a.codes + (i64)rows[j] * row_bytes + (i64)c * 16);
        // Scales of this chunk's group(s): one (FP8, int4: a chunk never straddles a group),
        // two for NVFP4 (16-weight groups, pieces 0-1 and 2-3).
        float s0[QG_COLS], s1[QG_COLS];
#pragma unroll
        for (int j = 0; j < QG_COLS; ++j) {
            const int g = c * W / a.group;
            s0[j] = group_scale<FMT>(a, rows[j], g);
            s1[j] = FMT == FMT_NVFP4 ? group_scale<FMT>(a, rows[j], g + 1) : s0[j];
        }
#pragma unroll
        for (int p = 0; p < W / 8; ++p) {
            float xv[MAXR][8];
#pragma unroll
            for (int r = 0; r < MAXR; ++r)
                if (r < m) qg_load8(x + (i64)r * k + c * W + p * 8, xv[r]);
#pragma unroll
            for (int j = 0; j < QG_COLS; ++j) {
                float w[8];
                decode8<FMT>(code[j], p, w);
                const float s = (FMT == FMT_NVFP4 && p >= 2) ? s1[j] : s0[j];
#pragma unroll
                for (int r = 0; r < MAXR; ++r) {
                    if (r >= m) break;
                    float d = 0.f;
#pragma unroll
                    for (int e = 0; e < 8; ++e) d = fmaf(w[e], xv[r][e], d);
                    acc[r][j] = fmaf(s, d, acc[r][j]);
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
        if (r >= m) break;
#pragma unroll
        for (int j = 0; j < QG_COLS; ++j) {
            const float v = warp_sum(acc[r][j]);
            if (lane == 0) red[warp][r * QG_COLS + j] = v;
        }
    }
    __syncthreads();
    if (tid < m * QG_COLS) {
        const int r = tid / QG_COLS, col = blockIdx.x * QG_COLS + tid % QG_COLS;
        float s = 0.f;
        for (int i = 0; i < QG_WARPS; ++i) s += red[i][tid];
        if (col < a.n) {
            float* y = (float*)a.y + (i64)r * a.ldy + col;
            *y = a.accumulate ? *y + s : s;
        }
    }
}

// One thread per 16-byte chunk of codes (grid-stride): its W weights, scaled, rounded to T.
template <typename T, int FMT>
__device__ void quant_dequant_impl(const QuantArgs a) {
    const int W = Fmt<FMT>::W, chunks = a.k / W, row_bytes = FMT == FMT_FP8 ? a.k : a.k / 2;
    const i64 total = (i64)a.n * chunks;
    T* out = (T*)a.y;
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const int row = (int)(i / chunks), c = (int)(i % chunks);
        const uint4 code = qg_ld_stream(a.codes + (i64)row * row_bytes + (i64)c * 16);
        const int g = c * W / a.group;
        const float s0 = group_scale<FMT>(a, row, g);
        const float s1 = FMT == FMT_NVFP4 ? group_scale<FMT>(a, row, g + 1) : s0;
        T* o = out + (i64)row * a.k + (i64)c * W;
#pragma unroll
        for (int p = 0; p < W / 8; ++p) {
            float w[8];
            decode8<FMT>(code, p, w);
            const float s = (FMT == FMT_NVFP4 && p >= 2) ? s1 : s0;
#pragma unroll
            for (int e = 0; e < 8; ++e) o[p * 8 + e] = from_f<T>(w[e] * s);
        }
    }
}

// Launch bounds: the 1-2 row builds at two blocks per SM (≤ 128 registers), the 4-8 row builds
// at one (their accumulators and activations need more).
#define QUANT_KERNELS(T, S, F, FMT)                                                                   \
    extern "C" __global__ void __launch_bounds__(QG_THREADS, 2) quant_gemv_##F##_r1_##S(const QuantArgs a) { \
        quant_gemv_impl<T, FMT, 1>(a);                                                                \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(QG_THREADS, 2) quant_gemv_##F##_r2_##S(const QuantArgs a) { \
        quant_gemv_impl<T, FMT, 2>(a);                                                                \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(QG_THREADS, 1) quant_gemv_##F##_r4_##S(const QuantArgs a) { \
        quant_gemv_impl<T, FMT, 4>(a);                                                                \
    }                                                                                                 \
    extern "C" __global__ void __launch_bounds__(QG_THREADS, 1) quant_gemv_##F##_r8_##S(const QuantArgs a) { \
        quant_gemv_impl<T, FMT, 8>(a);                                                                \
    }                                                                                                 \
    extern "C" __global__ void quant_dequant_##F##_##S(const QuantArgs a) { quant_dequant_impl<T, FMT>(a); }

#define QUANT_ALL_FORMATS(T, S)          \
    QUANT_KERNELS(T, S, fp8, FMT_FP8)    \
    QUANT_KERNELS(T, S, int4, FMT_INT4)  \
    QUANT_KERNELS(T, S, nvfp4, FMT_NVFP4)
FOR_STORAGE_TYPES(QUANT_ALL_FORMATS)

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
