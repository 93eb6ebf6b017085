// glm5_next (GLM-5.3-Flash) vision tower kernels other than dense GEMMs (cuBLAS): bias and
// residual adds, RMSNorm into the GEMM input type, the q/k/v preparation (biases, per-head q/k
// RMSNorm, 2-D axial RoPE from host tables), bidirectional attention over variable-length
// segments (`cu_seqlens`: one per frame, so an image never attends to another), the clamped
// SwiGLU, the 2×2 merge-window regroup, LayerNorm + exact GELU, and the placement of image
// embeddings into the text model's mHC streams.
//
// Every formula follows the CPU tower (`src/backend/cpu/glm5_next/vision.rs`, the reference).
// Activations between kernels are f32; `T` is the storage type of the weights, so a kernel whose
// output only feeds a GEMM writes it in `T` directly (no separate cast).

__device__ __forceinline__ float vis_silu(float x) { return x / (1.0f + expf(-x)); }

// x[r, c] = x[r, c] + b[c] written as `T` into out (out may alias x when T is float).
template <typename T>
__device__ void vis_add_bias_impl(const float* x, const float* b, T* out, i64 total, int d) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x)
        out[i] = from_f<T>(b ? x[i] + b[i % d] : x[i]);
}

// The residual add of a block: x += (y + b), the bias (may be null) added to the branch first as
// the CPU's affine does.
extern "C" __global__ void vis_residual(float* x, const float* y, const float* b, i64 total, int d) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x)
        x[i] += b ? y[i] + b[i % d] : y[i];
}

// One block per row: out = w ⊙ x / sqrt(mean(x²) + eps), as `T`.
template <typename T>
__device__ void vis_rms_norm_impl(const float* x, const float* w, T* out, int d, float eps) {
    const float* xr = x + (i64)blockIdx.x * d;
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[(i64)blockIdx.x * d + i] = from_f<T>(w[i] * (xr[i] * r));
}

// q/k/v of one (patch, part·heads + head) per block (blockDim a multiple of 32, ≥ hd; dynamic
// shared memory hd floats), in place in qkv [N, 3·D]: the bias added; for q and k the head is
// RMS-normalised with its norm weight, then rotated by the axial RoPE in rotate-half form with
// the patch's `cos`/`sin` rows ([N, hd]).
extern "C" __global__ void vis_qkv_prep(float* qkv, const float* bias, const float* q_norm, const float* k_norm,
                                        const float* cos_t, const float* sin_t, int heads, int hd, float eps) {
    extern __shared__ float head[];
    const int row = blockIdx.x, part = blockIdx.y / heads, h = blockIdx.y % heads, i = threadIdx.x;
    const int d = heads * hd;
    float* v = qkv + (i64)row * 3 * d + part * d + h * hd;
    float x = 0.f;
    if (i < hd) x = v[i] + (bias ? bias[part * d + h * hd + i] : 0.f);
    if (part == 2) {
        if (i < hd) v[i] = x;
        return;
    }
    const float ss = block_sum(i < hd ? x * x : 0.f);
    const float r = 1.0f / sqrtf(ss / (float)hd + eps);
    const float* w = part == 0 ? q_norm : k_norm;
    if (i < hd) head[i] = w[i] * (x * r);
    __syncthreads();
    if (i < hd) {
        const int half = hd / 2;
        const float rot = i < half ? -head[i + half] : head[i - half];
        v[i] = head[i] * cos_t[(i64)row * hd + i] + rot * sin_t[(i64)row * hd + i];
    }
}

#define VIS_QT 32   // queries per block
#define VIS_KT 32   // keys per shared-memory tile (one per lane)
#define VIS_WARPS 4
#define VIS_QPW (VIS_QT / VIS_WARPS)
#define VIS_HD_CHUNKS 4  // head_dim ≤ 128: each lane holds 4 output values per query

// Bidirectional attention within segments, all heads, one launch: block (segment·heads + head,
// query tile of VIS_QT), VIS_WARPS warps of VIS_QPW queries each. Key/value tiles of VIS_KT rows
// go through shared memory; lane j scores key j, the softmax is online (running max and sum per
// query, rescaled per tile), and lane l accumulates output dims l, l+32, …. q, k and v are read
// from qkv [N, 3·D] (prepared by vis_qkv_prep); the output [N, D] is written as `T` (the proj
// GEMM's input). Dynamic shared memory: (VIS_KT·(hd+1) + VIS_KT·hd + VIS_QT·hd) floats.
template <typename T>
__device__ void vis_attention_impl(const float* qkv, const int* cu, T* out, int heads, int hd, float scale) {
    extern __shared__ float sh[];
    float* ks = sh;                      // [KT][hd + 1] (padded: lane j reads row j)
    float* vs = ks + VIS_KT * (hd + 1);  // [KT][hd]
    float* qs = vs + VIS_KT * hd;        // [QT][hd]
    const int seg = blockIdx.x / heads, h = blockIdx.x % heads;
    const int s0 = cu[seg], len = cu[seg + 1] - s0;
    const int q0 = blockIdx.y * VIS_QT;
    if (q0 >= len) return;
    const int d = heads * hd, stride = 3 * d;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int i = threadIdx.x; i < VIS_QT * hd; i += blockDim.x) {
        const int qi = i / hd, c = i % hd;
        qs[i] = q0 + qi < len ? qkv[(i64)(s0 + q0 + qi) * stride + h * hd + c] : 0.f;
    }
    float mx[VIS_QPW], sum[VIS_QPW], acc[VIS_QPW][VIS_HD_CHUNKS];
#pragma unroll
    for (int qq = 0; qq < VIS_QPW; ++qq) {
        mx[qq] = -INFINITY;
        sum[qq] = 0.f;
#pragma unroll
        for (int ch = 0; ch < VIS_HD_CHUNKS; ++ch) acc[qq][ch] = 0.f;
    }
    for (int k0 = 0; k0 < len; k0 += VIS_KT) {
        __syncthreads();
        for (int i = threadIdx.x; i < VIS_KT * hd; i += blockDim.x) {
            const int kj = i / hd, c = i % hd;
            const bool ok = k0 + kj < len;
            const i64 at = (i64)(s0 + k0 + kj) * stride + h * hd + c;
            ks[kj * (hd + 1) + c] = ok ? qkv[at + d] : 0.f;
            vs[kj * hd + c] = ok ? qkv[at + 2 * d] : 0.f;
        }
        __syncthreads();
        const bool valid = k0 + lane < len;
#pragma unroll
        for (int qq = 0; qq < VIS_QPW; ++qq) {
            const float* q = qs + (warp * VIS_QPW + qq) * hd;
            const float* k = ks + lane * (hd + 1);
            float s = 0.f;
            for (int c = 0; c < hd; ++c) s += q[c] * k[c];
            s = valid ? s * scale : -INFINITY;
            const float m_new = fmaxf(mx[qq], warp_max(s));  // lane 0's key is always valid
            const float corr = expf(mx[qq] - m_new);
            const float p = valid ? expf(s - m_new) : 0.f;
            sum[qq] = sum[qq] * corr + warp_sum(p);
#pragma unroll
            for (int ch = 0; ch < VIS_HD_CHUNKS; ++ch) acc[qq][ch] *= corr;
            for (int j = 0; j < VIS_KT; ++j) {
                const float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
                for (int ch = 0; ch < VIS_HD_CHUNKS; ++ch) {
                    const int c = lane + 32 * ch;
                    if (c < hd) acc[qq][ch] += pj * vs[j * hd + c];
                }
            }
            mx[qq] = m_new;
        }
    }
#pragma unroll
    for (int qq = 0; qq < VIS_QPW; ++qq) {
        const int qi = q0 + warp * VIS_QPW + qq;
        if (qi >= len) continue;
        T* o = out + (i64)(s0 + qi) * d + h * hd;
#pragma unroll
        for (int ch = 0; ch < VIS_HD_CHUNKS; ++ch) {
            const int c = lane + 32 * ch;
            if (c < hd) o[c] = from_f<T>(acc[qq][ch] / sum[qq]);
        }
    }
}

// silu(min(g + bg, λ)) · clip(u + bu, −λ, λ) per row of [gate | up] (`rows` rows of 2·inter;
// bias [2·inter] or null), as `T`.
template <typename T>
__device__ void vis_swiglu_impl(const float* gu, const float* bias, T* out, int inter, i64 total, float limit) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < total; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / inter;
        const int c = (int)(i % inter);
        float g = gu[r * 2 * inter + c], u = gu[r * 2 * inter + inter + c];
        if (bias) {
            g += bias[c];
            u += bias[inter + c];
        }
        out[i] = from_f<T>(vis_silu(fminf(g, limit)) * fminf(fmaxf(u, -limit), limit));
    }
}

// One block per merge window g of mm consecutive patches: out[g, ch·mm + k] = x[g·mm + k, ch]
// (the Conv2d downsample's input, channel-major).
template <typename T>
__device__ void vis_windows_impl(const float* x, T* out, int d, int mm) {
    const i64 g = blockIdx.x;
    for (int i = threadIdx.x; i < d * mm; i += blockDim.x) {
        const int ch = i / mm, k = i % mm;
        out[g * d * mm + i] = from_f<T>(x[(g * mm + k) * d + ch]);
    }
}

// One block per row: LayerNorm (w, b, eps) then exact GELU 0.5·x·(1 + erf(x/√2)) (in double, as
// the CPU does), as `T`.
template <typename T>
__device__ void vis_ln_gelu_impl(const float* x, const float* w, const float* b, T* out, int d, float eps) {
    const float* xr = x + (i64)blockIdx.x * d;
    float s = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += xr[i];
    const float mean = block_sum(s) / (float)d;
    float v = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) v += (xr[i] - mean) * (xr[i] - mean);
    const float r = 1.0f / sqrtf(block_sum(v) / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const double y = (double)((xr[i] - mean) * r * w[i] + b[i]);
        out[(i64)blockIdx.x * d + i] = from_f<T>((float)(0.5 * y * (1.0 + erf(y * 0.70710678118654752440))));
    }
}

// One block per embedded row i: the embedding src[i] ([d]) copied into all m mHC streams of step
// row rows[i] of x ([n, m·d]), replacing the token embedding.
extern "C" __global__ void vis_place_rows(const float* src, const int* rows, float* x, int m, int d) {
    const float* e = src + (i64)blockIdx.x * d;
    float* out = x + (i64)rows[blockIdx.x] * m * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        const float v = e[c];
        for (int s = 0; s < m; ++s) out[(i64)s * d + c] = v;
    }
}

#define VISION_KERNELS(T, S)                                                                                \
    extern "C" __global__ void vis_add_bias_##S(const float* x, const float* b, T* out, i64 total, int d) {  \
        vis_add_bias_impl<T>(x, b, out, total, d);                                                          \
    }                                                                                                       \
    extern "C" __global__ void vis_rms_norm_##S(const float* x, const float* w, T* out, int d, float eps) {  \
        vis_rms_norm_impl<T>(x, w, out, d, eps);                                                            \
    }                                                                                                       \
    extern "C" __global__ void vis_attention_##S(const float* qkv, const int* cu, T* out, int heads, int hd, \
                                                 float scale) {                                             \
        vis_attention_impl<T>(qkv, cu, out, heads, hd, scale);                                              \
    }                                                                                                       \
    extern "C" __global__ void vis_swiglu_##S(const float* gu, const float* bias, T* out, int inter,         \
                                              i64 total, float limit) {                                     \
        vis_swiglu_impl<T>(gu, bias, out, inter, total, limit);                                             \
    }                                                                                                       \
    extern "C" __global__ void vis_windows_##S(const float* x, T* out, int d, int mm) {                     \
        vis_windows_impl<T>(x, out, d, mm);                                                                 \
    }                                                                                                       \
    extern "C" __global__ void vis_ln_gelu_##S(const float* x, const float* w, const float* b, T* out, int d, \
                                               float eps) {                                                 \
        vis_ln_gelu_impl<T>(x, w, b, out, d, eps);                                                          \
    }
FOR_STORAGE_TYPES(VISION_KERNELS)
