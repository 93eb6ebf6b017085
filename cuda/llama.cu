// Llama-family layer kernels other than attention and GEMMs: embedding gather, RMSNorm,
// q/k norm + RoPE + KV-cache store, SwiGLU, bias add, and seeded random fill for benchmark
// weights. The residual stream is f32; `T` is the storage type of weights, KV cache and GEMM
// inputs (f32 in the validation mode, bf16 otherwise). Each output row is computed by one block
// with a fixed reduction order, so a row never depends on the other rows of the batch.

template <typename T>
__device__ void embed_impl(const int* ids, const T* table, float* x, int h) {
    pdl_launch_dependents();  // the first layer's GEMV may start loading its weights
    const T* row = table + (i64)ids[blockIdx.x] * h;
    float* out = x + (i64)blockIdx.x * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) out[i] = to_f(row[i]);
}

// out[r] = w · x[src] / sqrt(mean(x[src]²) + eps), src = rows ? rows[r] : r.
template <typename T>
__device__ void rmsnorm_impl(const float* x, const int* rows, const float* w, T* out, int h, float eps) {
    const int src = rows ? rows[blockIdx.x] : blockIdx.x;
    const float* xr = x + (i64)src * h;
    float ss = 0.f;
#pragma unroll 4
    for (int i = threadIdx.x; i < h; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)h + eps);
    T* o = out + (i64)blockIdx.x * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) o[i] = from_f<T>(w[i] * (xr[i] * inv));
}

// silu(gate) · up, gate and up side by side in each row of `gu` ([rows, 2·inter]).
// Rows by blockIdx.y (grid-stride), columns by x; four columns per thread with 16-byte loads
// when `inter` allows (a 64-bit divide per element made this kernel 3× its bandwidth time).
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }
template <typename T>
__device__ void swiglu_impl(const float* gu, T* out, int inter, int rows) {
    const int vec = inter % 4 == 0 ? 4 : 1, cols = inter / vec;
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const float* g = gu + (i64)r * 2 * inter;
        const float* u = g + inter;
        T* o = out + (i64)r * inter;
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x) {
            if (vec == 4) {
                const float4 gv = reinterpret_cast<const float4*>(g)[c], uv = reinterpret_cast<const float4*>(u)[c];
                o[4 * c] = from_f<T>(silu_mul(gv.x, uv.x));
                o[4 * c + 1] = from_f<T>(silu_mul(gv.y, uv.y));
                o[4 * c + 2] = from_f<T>(silu_mul(gv.z, uv.z));
                o[4 * c + 3] = from_f<T>(silu_mul(gv.w, uv.w));
            } else {
                o[c] = from_f<T>(silu_mul(g[c], u[c]));
            }
        }
    }
}

// One block per token; one warp per head. q heads are normed (optional), rotated and written to
// `q_out` (f32); k heads likewise but stored into the paged cache at element offset `row_off[t]`
// from this layer's K (and V) base; v is copied.
template <typename T>
__device__ void qkv_rope_store_impl(const float* qkv, float* q_out, T* k_cache, T* v_cache, const i64* row_off,
                                    const int* pos, const float* q_norm, const float* k_norm, const float* freqs,
                                    RopeParams rp, float eps, int nh, int nkv, int hd) {
    const int t = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int qd = nh * hd, kvd = nkv * hd, width = qd + 2 * kvd, half = hd / 2;
    const float* row = qkv + (i64)t * width;
    const i64 slot = row_off[t];
    const float p = (float)pos[t];
    for (int h = warp; h < nh + nkv; h += nwarps) {
        const float* x = row + h * hd;
        const float* nw = h < nh ? q_norm : k_norm;
        float inv = 1.f;
        if (nw) {
            float ss = 0.f;
            for (int j = lane; j < hd; j += 32) ss += x[j] * x[j];
            ss = warp_sum(ss);
            inv = 1.0f / sqrtf(ss / (float)hd + eps);
        }
        for (int j = lane; j < half; j += 32) {
            float a = x[j], b = x[j + half];
            if (nw) {
                a = nw[j] * (a * inv);
                b = nw[j + half] * (b * inv);
            }
            float na = a, nb = b;
            rope_rotate(rope_angle(rp, freqs, p, j), na, nb);
            if (h < nh) {
                q_out[(i64)t * qd + h * hd + j] = na;
                q_out[(i64)t * qd + h * hd + j + half] = nb;
            } else {
                T* k = k_cache + slot + (h - nh) * hd;
                k[j] = from_f<T>(na);
                k[j + half] = from_f<T>(nb);
            }
        }
    }
    const float* v = row + qd + kvd;
    for (int i = threadIdx.x; i < kvd; i += blockDim.x) v_cache[slot + i] = from_f<T>(v[i]);
}

// splitmix64 of (seed, index) → uniform in [−1, 1): benchmark weights made on the device.
__device__ __forceinline__ float uniform_pm1(unsigned long long seed, unsigned long long i) {
    unsigned long long z = seed * 0x9E3779B97F4A7C15ull + i + 1;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

template <typename T>
__device__ void fill_uniform_impl(T* p, i64 n, unsigned long long seed, float center, float scale) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        p[i] = from_f<T>(center + scale * uniform_pm1(seed, (unsigned long long)i));
}

#define LLAMA_KERNELS(T, S)                                                                                  \
    extern "C" __global__ void embed_##S(const int* ids, const T* table, float* x, int h) {                  \
        embed_impl<T>(ids, table, x, h);                                                                     \
    }                                                                                                        \
    extern "C" __global__ void rmsnorm_##S(const float* x, const int* rows, const float* w, T* out, int h,   \
                                           float eps) {                                                      \
        rmsnorm_impl<T>(x, rows, w, out, h, eps);                                                            \
    }                                                                                                        \
    extern "C" __global__ void swiglu_##S(const float* gu, T* out, int inter, int rows) {                    \
        swiglu_impl<T>(gu, out, inter, rows);                                                                \
    }                                                                                                        \
    extern "C" __global__ void qkv_rope_store_##S(const float* qkv, float* q_out, T* k_cache, T* v_cache,    \
                                                  const i64* row_off, const int* pos, const float* q_norm,     \
                                                  const float* k_norm, const float* freqs, RopeParams rp,    \
                                                  float eps, int nh, int nkv, int hd) {                      \
        qkv_rope_store_impl<T>(qkv, q_out, k_cache, v_cache, row_off, pos, q_norm, k_norm, freqs, rp, eps, nh, \
                               nkv, hd);                                                                     \
    }                                                                                                        \
    extern "C" __global__ void fill_uniform_##S(T* p, i64 n, unsigned long long seed, float center,          \
                                                float scale) {                                               \
        fill_uniform_impl<T>(p, n, seed, center, scale);                                                     \
    }
FOR_STORAGE_TYPES(LLAMA_KERNELS)

// y[r, c] += bias[c] for a row-major [rows, cols] f32 matrix.
extern "C" __global__ void add_bias(float* y, const float* bias, int cols, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] += bias[i % cols];
}

// Copy whole KV blocks (contiguous, every layer's K and V) between the cache and a staging
// buffer, for KV images: `dir` 0 gathers cache → staging, 1 scatters staging → cache.
extern "C" __global__ void copy_blocks(unsigned char* cache, unsigned char* staging, const int* blocks,
                                       i64 block_bytes, int dir) {
    const i64 b = blockIdx.y;
    unsigned char* c = cache + (i64)blocks[b] * block_bytes;
    unsigned char* s = staging + b * block_bytes;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < block_bytes; i += (i64)gridDim.x * blockDim.x) {
        if (dir == 0) s[i] = c[i]; else c[i] = s[i];
    }
}
