// Decode-step matrix products (m ≤ 4 token rows: memory-bound, every weight byte read once) with
// their neighbours fused in, so a decode layer is 6 launches instead of 10:
//   IN  plain: x is the GEMM input in T, [m, k].
//       norm : x is the f32 residual stream; the block computes each row's RMSNorm itself and
//              rounds x·w/rms to T exactly as `rmsnorm` in llama.cu does (no normed copy).
//   OUT store: y[r, col] = acc (+ bias), f32.
//       add  : y[r, col] += acc (+ bias), f32 (residual add).
//       swiglu: the block's columns are gate rows c and up rows inter + c; writes silu(g)·u in T.
//       rope : the block's columns are rotation pairs (j, j + hd/2) of one head of the stacked
//              q/k/v matrix; rotates q and k, writes q (f32) and k/v into the paged cache.
// One block of 256 threads computes GEMV_COLS weight rows for all m token rows: each thread
// holds 16 bytes of each of the 8 rows per sweep (128 bytes in flight, reused for every token
// row), weights are streamed past L1 so x and the norm weights stay there. Each output is
// reduced in an order fixed by k alone (per-thread chunks, warp tree, then warps in order), so
// a row's result never depends on m or on the rest of the batch.

// Blocks per SM the 1-row builds are compiled for, per fusion (2: ≤ 128 registers; 3: ≤ 80,
// with a few bytes of spills in some), switchable through SHELFSERVE_CUDA_DEFINES. Measured on
// the H200 (8B, batch-1 decode, A/B in one run): q/k/v at three per SM +1.5-2 % (80 registers,
// no spills); gate/up at three per SM a further +3.5-4 % (60 bytes of spills); the LM head no
// change; o_proj/down at three per SM 3 % slower.
#ifndef GEMV_R1_BLOCKS_ROPE
#define GEMV_R1_BLOCKS_ROPE 3
#endif
#ifndef GEMV_R1_BLOCKS_NORM
#define GEMV_R1_BLOCKS_NORM 2
#endif
#ifndef GEMV_R1_BLOCKS_ADD
#define GEMV_R1_BLOCKS_ADD 2
#endif
#ifndef GEMV_R1_BLOCKS_SWIGLU
#define GEMV_R1_BLOCKS_SWIGLU 3
#endif

#define GEMV_THREADS 256
#define GEMV_WARPS (GEMV_THREADS / 32)
#define GEMV_COLS 8
#define GEMV_SWEEP (GEMV_THREADS * 8)

#define IN_PLAIN 0
#define IN_NORM 1
#define OUT_STORE 0
#define OUT_ADD 1
#define OUT_SWIGLU 2
#define OUT_ROPE 3

// Every pointer first (8-byte aligned), then the 4-byte fields: matches `GemvArgs` in
// src/backend/cuda/decode.rs.
struct GemvArgs {
    const void* x;          // IN plain: T [m, k]; IN norm: f32 [rows, k]
    const int* rows;        // IN norm: source row of each output row (null: row r)
    const float* norm_w;    // IN norm: [k]
    const void* w;          // T [n, k]
    const float* bias;      // [n] or null
    void* y;                // store/add: f32 [m, n]; swiglu: T [m, n/2]; rope: q f32 [m, nh·hd]
    void* k_cache;          // rope: this layer's K and V bases
    void* v_cache;
    const i64* row_off;     // rope: per token, element offset of its K/V row
    const int* pos;         // rope: per token position
    const float* freqs;     // rope: as `rope_angle`
    int m, n, k;
    float eps;
    RopeParams rp;
    int nh, nkv, hd;
};

// 8 consecutive weights, raw (bf16: one 16-byte load; f32: two).
template <typename T> struct Raw8;
template <> struct Raw8<bf16> {
    uint4 a;
    __device__ __forceinline__ void load(const bf16* p) { a = ld_stream(p); }
    __device__ __forceinline__ float get(int j) const {
        const unsigned w = j < 2 ? a.x : j < 4 ? a.y : j < 6 ? a.z : a.w;
        return (j & 1) ? __uint_as_float(w & 0xffff0000u) : __uint_as_float(w << 16);
    }
};
template <> struct Raw8<float> {
    uint4 a, b;
    __device__ __forceinline__ void load(const float* p) {
        a = ld_stream(p);
        b = ld_stream(p + 4);
    }
    __device__ __forceinline__ float get(int j) const {
        const uint4& u = j < 4 ? a : b;
        const int i = j & 3;
        return __uint_as_float(i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w);
    }
};

__device__ __forceinline__ void load8f(const float* p, float* o) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
    o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}
__device__ __forceinline__ void load8x(const float* p, float* o) { load8f(p, o); }
__device__ __forceinline__ void load8x(const bf16* p, float* o) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        o[2 * j] = __uint_as_float(w[j] << 16);
        o[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
}

// Weight row of the block's column `j` in each output mode.
template <int OUT>
__device__ __forceinline__ int gemv_row(const GemvArgs& a, int j) {
    if (OUT == OUT_STORE || OUT == OUT_ADD) return blockIdx.x * GEMV_COLS + j;
    const int p = blockIdx.x * (GEMV_COLS / 2) + (j % (GEMV_COLS / 2));  // output column / pair
    const int second = j >= GEMV_COLS / 2;
    if (OUT == OUT_SWIGLU) return p + (second ? a.n / 2 : 0);
    const int half = a.hd / 2, head = p / half, jp = p % half;  // OUT_ROPE
    return head * a.hd + jp + (second ? half : 0);
}

template <typename T, int MAXR, int IN, int OUT>
__device__ void gemv_impl(const GemvArgs a) {
    __shared__ float red[GEMV_WARPS][MAXR * GEMV_COLS];
    __shared__ float out[MAXR * GEMV_COLS];
    __shared__ float inv_s[MAXR];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int m = min(a.m, MAXR), k = a.k;
    const float* xf = (const float*)a.x;
    const T* xt = (const T*)a.x;
    const T* w = (const T*)a.w;

    // Weight rows of this block's columns (rows past n read row 0 and are dropped).
    const T* wr[GEMV_COLS];
#pragma unroll
    for (int j = 0; j < GEMV_COLS; ++j) {
        const int row = gemv_row<OUT>(a, j);
        wr[j] = w + (i64)(row < a.n ? row : 0) * k;
    }
    // Weights do not depend on the previous kernel: the first sweep's are loaded while that
    // kernel drains (programmatic dependent launch) and before the norm's reduction. (Loading a
    // second sweep here as well, into registers or into L2, measured slower on the H200.)
    pdl_launch_dependents();
    Raw8<T> first[GEMV_COLS];
    const int c0 = tid * 8;
    if (c0 < k) {
#pragma unroll
        for (int j = 0; j < GEMV_COLS; ++j) first[j].load(wr[j] + c0);
    }
    // Also independent of the previous kernel, so read before the wait as well: the first sweep
    // of the norm weights, the logits rows and positions (uploaded by the host), and from those
    // the cosine and sine of this thread's RoPE pair (the epilogue's threads, see below).
    float g_first[8];
    if (IN == IN_NORM && c0 < k) load8f(a.norm_w + c0, g_first);
    int src[MAXR];
#pragma unroll
    for (int r = 0; r < MAXR; ++r) src[r] = r < m ? (IN == IN_NORM && a.rows ? a.rows[r] : r) : 0;
    float rope_c = 1.f, rope_s = 0.f;
    const bool rope_thread = OUT == OUT_ROPE && tid < m * (GEMV_COLS / 2);
    if (rope_thread) {
        const int p = blockIdx.x * (GEMV_COLS / 2) + tid % (GEMV_COLS / 2), half = a.hd / 2;
        const float ang = rope_angle(a.rp, a.freqs, (float)a.pos[tid / (GEMV_COLS / 2)], p % half);
        rope_c = cosf(ang);
        rope_s = sinf(ang);
    }
    pdl_wait();
    float inv[MAXR];
    if (IN == IN_NORM) {
        float ss[MAXR];
#pragma unroll
        for (int r = 0; r < MAXR; ++r) ss[r] = 0.f;
        for (int c = c0; c < k; c += GEMV_SWEEP) {
#pragma unroll
            for (int r = 0; r < MAXR; ++r) {
                if (r >= m) break;
                float xv[8];
                load8f(xf + (i64)src[r] * k + c, xv);
#pragma unroll
                for (int e = 0; e < 8; ++e) ss[r] = fmaf(xv[e], xv[e], ss[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < MAXR; ++r) {
            const float v = warp_sum(ss[r]);
            if (lane == 0) red[warp][r] = v;
        }
        __syncthreads();
        if (tid < m) {
            float s = 0.f;
            for (int i = 0; i < GEMV_WARPS; ++i) s += red[i][tid];
            inv_s[tid] = 1.0f / sqrtf(s / (float)k + a.eps);
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < MAXR; ++r) inv[r] = r < m ? inv_s[r] : 0.f;
    }

    float acc[MAXR][GEMV_COLS];
#pragma unroll
    for (int r = 0; r < MAXR; ++r)
#pragma unroll
        for (int j = 0; j < GEMV_COLS; ++j) acc[r][j] = 0.f;

    // acc += this sweep's weights (columns c..c+7 of every row) · the block's input rows
    // (`g_pre`: the norm weights of these columns, if already loaded).
    auto fma_sweep = [&](const Raw8<T>* wv, int c, const float* g_pre) {
#pragma unroll
        for (int r = 0; r < MAXR; ++r) {
            if (r >= m) break;
            float xv[8];
            if (IN == IN_NORM) {
                float g[8];
                load8f(xf + (i64)src[r] * k + c, xv);
                if (g_pre) {
#pragma unroll
                    for (int e = 0; e < 8; ++e) g[e] = g_pre[e];
                } else {
                    load8f(a.norm_w + c, g);
                }
#pragma unroll
                for (int e = 0; e < 8; ++e) xv[e] = to_f(from_f<T>(g[e] * (xv[e] * inv[r])));
            } else {
                load8x(xt + (i64)r * k + c, xv);
            }
#pragma unroll
            for (int j = 0; j < GEMV_COLS; ++j)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][j] = fmaf(wv[j].get(e), xv[e], acc[r][j]);
        }
    };
    if (c0 < k) fma_sweep(first, c0, IN == IN_NORM ? g_first : nullptr);
#pragma unroll 2
    for (int c = c0 + GEMV_SWEEP; c < k; c += GEMV_SWEEP) {
        Raw8<T> wv[GEMV_COLS];
#pragma unroll
        for (int j = 0; j < GEMV_COLS; ++j) wv[j].load(wr[j] + c);
        fma_sweep(wv, c, nullptr);
    }

    // Reduce each output over the block in a fixed order.
#pragma unroll
    for (int r = 0; r < MAXR; ++r) {
        if (r >= m) break;
#pragma unroll
        for (int j = 0; j < GEMV_COLS; ++j) {
            const float v = warp_sum(acc[r][j]);
            if (lane == 0) red[warp][r * GEMV_COLS + j] = v;
        }
    }
    __syncthreads();
    if (tid < m * GEMV_COLS) {
        float s = 0.f;
        for (int i = 0; i < GEMV_WARPS; ++i) s += red[i][tid];
        const int row = gemv_row<OUT>(a, tid % GEMV_COLS);
        if (a.bias && row < a.n && OUT != OUT_ADD) s += a.bias[row];
        out[tid] = s;
    }
    __syncthreads();

    if (OUT == OUT_STORE || OUT == OUT_ADD) {
        if (tid < m * GEMV_COLS) {
            const int r = tid / GEMV_COLS, col = gemv_row<OUT>(a, tid % GEMV_COLS);
            if (col < a.n) {
                float* y = (float*)a.y + (i64)r * a.n + col;
                if (OUT == OUT_ADD) {
                    // As the unfused path: y = (y + x·w) + bias.
                    float o = *y + out[tid];
                    if (a.bias) o += a.bias[col];
                    *y = o;
                } else {
                    *y = out[tid];
                }
            }
        }
        return;
    }
    // Pairs: (r, jj) with column jj and its partner jj + COLS/2.
    if (tid >= m * (GEMV_COLS / 2)) return;
    const int r = tid / (GEMV_COLS / 2), jj = tid % (GEMV_COLS / 2);
    const int p = blockIdx.x * (GEMV_COLS / 2) + jj;
    if (p >= a.n / 2) return;
    float va = out[r * GEMV_COLS + jj], vb = out[r * GEMV_COLS + jj + GEMV_COLS / 2];
    if (OUT == OUT_SWIGLU) {
        const int inter = a.n / 2;
        ((T*)a.y)[(i64)r * inter + p] = from_f<T>(va / (1.0f + expf(-va)) * vb);
        return;
    }
    // OUT_ROPE: head `head` of the stacked q | k | v rows, pair (jp, jp + half).
    const int half = a.hd / 2, head = p / half, jp = p % half;
    if (head < a.nh + a.nkv) rope_rotate_cs(rope_c, rope_s, va, vb);
    if (head < a.nh) {
        float* q = (float*)a.y + (i64)r * a.nh * a.hd + head * a.hd;
        q[jp] = va;
        q[jp + half] = vb;
    } else {
        const bool is_k = head < a.nh + a.nkv;
        T* dst = (T*)(is_k ? a.k_cache : a.v_cache) + a.row_off[r] + (head - a.nh - (is_k ? 0 : a.nkv)) * a.hd;
        dst[jp] = from_f<T>(va);
        dst[jp + half] = from_f<T>(vb);
    }
}

// name_r{1,2,4}_{f32,bf16}: one, two, or three-four token rows. The 2- and 4-row builds fit two
// blocks per SM (≤ 128 registers; the 4-row build spills a few bytes, and still ran batch 4
// 1.32× faster on the H200 than at one block per SM); the 1-row builds as GEMV_R1_BLOCKS_*
// says per fusion.
#define GEMV_KERNEL(T, S, NAME, IN, OUT, R1_BLOCKS)                                                       \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, R1_BLOCKS) NAME##_r1_##S(const GemvArgs a) {\
        gemv_impl<T, 1, IN, OUT>(a);                                                                     \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 2) NAME##_r2_##S(const GemvArgs a) {     \
        gemv_impl<T, 2, IN, OUT>(a);                                                                     \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, 2) NAME##_r4_##S(const GemvArgs a) {     \
        gemv_impl<T, 4, IN, OUT>(a);                                                                     \
    }
#define GEMV_KERNELS(T, S)                                        \
    GEMV_KERNEL(T, S, gemv_norm_rope, IN_NORM, OUT_ROPE, GEMV_R1_BLOCKS_ROPE)          \
    GEMV_KERNEL(T, S, gemv_norm, IN_NORM, OUT_STORE, GEMV_R1_BLOCKS_NORM)              \
    GEMV_KERNEL(T, S, gemv_add, IN_PLAIN, OUT_ADD, GEMV_R1_BLOCKS_ADD)                 \
    GEMV_KERNEL(T, S, gemv_norm_swiglu, IN_NORM, OUT_SWIGLU, GEMV_R1_BLOCKS_SWIGLU)
// The backend compiles only its own storage type (this module is the slowest to compile).
#if defined(GEMV_STORAGE_bf16)
GEMV_KERNELS(bf16, bf16)
#elif defined(GEMV_STORAGE_f32)
GEMV_KERNELS(float, f32)
#else
FOR_STORAGE_TYPES(GEMV_KERNELS)
#endif
