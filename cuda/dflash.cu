// The DFlash block drafter's kernels (src/backend/cuda/dflash.rs); the GEMMs are cuBLAS and the
// embedding, RMSNorm and SwiGLU kernels are llama.cu's. Rows are f32 (the drafter's residual
// stream, q/k/v); `T` is the storage type of GEMM inputs. A sequence's context cache is one f32
// buffer: per layer its K plane then its V plane (`cap` rows of `kvd` each), then the `cap`
// positions of its rows (int). The CPU drafter (src/spec/dflash/model.rs) is the reference.

// Offset (in floats) of layer `l`'s K (`which` 0) or V (1) plane in a cache of `cap` rows.
__device__ __forceinline__ i64 df_plane(int l, int which, int cap, int kvd) {
    return ((i64)l * 2 + which) * cap * kvd;
}

// Per-head RMSNorm (when `nw`) and rotate-half RoPE of one head of `hd` floats at position `p`, in
// place, by one warp. Angles as the CPU drafter: `p · inv_freq[j]`.
__device__ void df_norm_rope_head(float* x, const float* nw, const float* inv_freq, float p, float eps, int hd) {
    const int lane = threadIdx.x & 31, half = hd / 2;
    float inv = 1.f;
    if (nw) {
        float ss = 0.f;
        for (int j = lane; j < hd; j += 32) ss += x[j] * x[j];
        ss = warp_sum(ss);
        inv = 1.0f / sqrtf(ss / (float)hd + eps);
    }
    __syncwarp();
    for (int j = lane; j < half; j += 32) {
        float a = x[j], b = x[j + half];
        if (nw) {
            a = (a * inv) * nw[j];
            b = (b * inv) * nw[j + half];
        }
        float s, c;
        sincosf(p * inv_freq[j], &s, &c);
        x[j] = a * c - b * s;
        x[j + half] = b * c + a * s;
    }
    __syncwarp();
}

// Context rows into their sequences' caches, for layer `l`: `kv` holds each row's k then v
// (`[rows, 2·kvd]`, the k/v projection of the normed context features); `dst` per row: the cache
// address (as i64), its capacity, the row's slot and its position. k is normed and rotated in
// place first. One block per row, one warp per kv head.
extern "C" __global__ void df_ctx_store(float* kv, const i64* dst, const float* k_norm, const float* inv_freq,
                                        float eps, int nkv, int hd, int l) {
    const int r = blockIdx.x, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5, kvd = nkv * hd;
    float* row = kv + (i64)r * 2 * kvd;
    float* cache = (float*)dst[4 * r];
    const int cap = (int)dst[4 * r + 1], slot = (int)dst[4 * r + 2], pos = (int)dst[4 * r + 3];
    for (int h = warp; h < nkv; h += nwarps) df_norm_rope_head(row + h * hd, k_norm, inv_freq, (float)pos, eps, hd);
    __syncthreads();
    float* k = cache + df_plane(l, 0, cap, kvd) + (i64)slot * kvd;
    float* v = cache + df_plane(l, 1, cap, kvd) + (i64)slot * kvd;
    for (int i = threadIdx.x; i < kvd; i += blockDim.x) {
        k[i] = row[i];
        v[i] = row[kvd + i];
    }
}

// Record each context row's position after the last layer's planes (`layers` of them).
extern "C" __global__ void df_ctx_positions(const i64* dst, int layers, int kvd, int rows) {
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float* cache = (float*)dst[4 * r];
    const int cap = (int)dst[4 * r + 1], slot = (int)dst[4 * r + 2], pos = (int)dst[4 * r + 3];
    int* positions = (int*)(cache + df_plane(layers, 0, cap, kvd));
    positions[slot] = pos;
}

// The block rows' q and k heads (`qkv` rows: q, k, v) normed and rotated in place at `pos`. One
// block per row, one warp per head.
extern "C" __global__ void df_block_qk(float* qkv, const int* pos, const float* q_norm, const float* k_norm,
                                       const float* inv_freq, float eps, int nh, int nkv, int hd) {
    const int r = blockIdx.x, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    float* row = qkv + (i64)r * (nh + 2 * nkv) * hd;
    for (int h = warp; h < nh + nkv; h += nwarps)
        df_norm_rope_head(row + h * hd, h < nh ? q_norm : k_norm, inv_freq, (float)pos[r], eps, hd);
}

// Whether query position `qp` sees key position `kp` (the CPU drafter's `visible`).
__device__ __forceinline__ bool df_visible(int qp, int kp, int window, int causal) {
    if (causal && kp > qp) return false;
    if (window > 0) {
        if (qp - kp >= window) return false;
        if (!causal && kp - qp >= window) return false;
    }
    return true;
}

#define DF_MAX_HD 256
#define DF_WARPS 4

// Attention of one block row (blockIdx.x, `bs` rows per sequence) and one q head (blockIdx.y)
// over its sequence's context cache and then the block's own keys, with online softmax: each warp
// takes every DF_WARPS-th key, the warps' partial sums are combined in a fixed order. `seqs` per
// sequence: cache address, capacity, context rows, anchor position (i64 each).
template <typename T>
__device__ void df_attention_impl(const float* qkv, const i64* seqs, T* out, int bs, int nh, int nkv, int hd,
                                  int l, int layers, int window, int causal, float scale) {
    __shared__ float part_m[DF_WARPS], part_l[DF_WARPS];
    __shared__ float part_acc[DF_WARPS][DF_MAX_HD];
    const int r = blockIdx.x, head = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int si = r / bs, kvd = nkv * hd, width = (nh + 2 * nkv) * hd, kh = head / (nh / nkv);
    const float* cache = (const float*)seqs[4 * si];
    const int cap = (int)seqs[4 * si + 1], n_ctx = (int)seqs[4 * si + 2], anchor = (int)seqs[4 * si + 3];
    const int* ctx_pos = cache ? (const int*)(cache + df_plane(layers, 0, cap, kvd)) : nullptr;
    const int qp = anchor + r % bs;
    const float* q = qkv + (i64)r * width + head * hd;
    const float* block = qkv + (i64)si * bs * width;
    float qv[DF_MAX_HD / 32], acc[DF_MAX_HD / 32];
    const int per = (hd + 31) / 32;
#pragma unroll
    for (int c = 0; c < DF_MAX_HD / 32; ++c) {
        const int j = lane + 32 * c;
        qv[c] = (c < per && j < hd) ? q[j] : 0.f;
        acc[c] = 0.f;
    }
    float m = -INFINITY, sum = 0.f;
    const int n = n_ctx + bs;
    for (int key = warp; key < n; key += DF_WARPS) {
        const float *k, *v;
        int kp;
        if (key < n_ctx) {
            k = cache + df_plane(l, 0, cap, kvd) + (i64)key * kvd + kh * hd;
            v = cache + df_plane(l, 1, cap, kvd) + (i64)key * kvd + kh * hd;
            kp = ctx_pos[key];
        } else {
            const float* row = block + (i64)(key - n_ctx) * width;
            k = row + nh * hd + kh * hd;
            v = row + nh * hd + kvd + kh * hd;
            kp = anchor + key - n_ctx;
        }
        if (!df_visible(qp, kp, window, causal)) continue;
        float dot = 0.f;
#pragma unroll
        for (int c = 0; c < DF_MAX_HD / 32; ++c) {
            const int j = lane + 32 * c;
            if (c < per && j < hd) dot += qv[c] * k[j];
        }
        const float s = warp_sum(dot) * scale;
        const float nm = fmaxf(m, s);
        const float corr = expf(m - nm), p = expf(s - nm);
        sum = sum * corr + p;
#pragma unroll
        for (int c = 0; c < DF_MAX_HD / 32; ++c) {
            const int j = lane + 32 * c;
            acc[c] = acc[c] * corr + ((c < per && j < hd) ? p * v[j] : 0.f);
        }
        m = nm;
    }
    if (lane == 0) {
        part_m[warp] = m;
        part_l[warp] = sum;
    }
#pragma unroll
    for (int c = 0; c < DF_MAX_HD / 32; ++c) {
        const int j = lane + 32 * c;
        if (c < per && j < hd) part_acc[warp][j] = acc[c];
    }
    __syncthreads();
    if (warp == 0) {
        float gm = -INFINITY;
        for (int w = 0; w < DF_WARPS; ++w) gm = fmaxf(gm, part_m[w]);
        float total = 0.f;
        for (int w = 0; w < DF_WARPS; ++w) total += part_m[w] == -INFINITY ? 0.f : part_l[w] * expf(part_m[w] - gm);
        for (int j = lane; j < hd; j += 32) {
            float o = 0.f;
            for (int w = 0; w < DF_WARPS; ++w)
                if (part_m[w] != -INFINITY) o += part_acc[w][j] * expf(part_m[w] - gm);
            out[(i64)r * nh * hd + head * hd + j] = from_f<T>(total > 0.f ? o / total : 0.f);
        }
    }
}

// Logits scaled by the output multiplier, then soft-capped (`cap` 0: none).
extern "C" __global__ void df_logit_post(float* logits, i64 n, float mult, float cap) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float v = logits[i] * mult;
        if (cap > 0.f) v = tanhf(v / cap) * cap;
        logits[i] = v;
    }
}

// Scale the embedded rows (`input_embedding_scale`).
extern "C" __global__ void df_scale(float* x, i64 n, float s) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) x[i] *= s;
}

#define DFLASH_KERNELS(T, S)                                                                                 \
    extern "C" __global__ void df_attention_##S(const float* qkv, const i64* seqs, T* out, int bs, int nh,   \
                                                int nkv, int hd, int l, int layers, int window, int causal,   \
                                                float scale) {                                               \
        df_attention_impl<T>(qkv, seqs, out, bs, nh, nkv, hd, l, layers, window, causal, scale);             \
    }                                                                                                        \
    extern "C" __global__ void df_cast_##S(const float* x, T* y, i64 n) {                                    \
        for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)    \
            y[i] = from_f<T>(x[i]);                                                                          \
    }
FOR_STORAGE_TYPES(DFLASH_KERNELS)
