// glm5_next (GLM-5.3-Flash) layer kernels other than dense GEMMs (cuBLAS): embedding into the
// mHC streams, the mHC site (RMS of the streams, pre/post/comb maps, Sinkhorn in f32, collapse,
// block-input RMSNorm) and expand, the KDA short conv and per-token delta-rule recurrence with
// its gated output norm, the MLA + DSA cache store, pooled indexer keys, pool selection and
// absorbed latent attention over the selected positions, the MoE router, routed-expert GEMVs,
// clamped SwiGLU and the weighted combine, and the final stream mean + norm.
//
// Every formula follows the CPU backend (`src/backend/cpu/glm5_next/`, the reference) in the
// same order of operations where a row's result could depend on it: sums over positions, state
// rows and experts run in ascending order, one block per output row, so a row never depends on
// the rest of the batch. The residual stream, the caches and the recurrent state are f32; `T` is
// the storage type of the big weights (f32 in the validation mode, bf16 otherwise).

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x * sigmoidf_(x); }

// Maximum over the block (same shape rules as block_sum); every thread gets the result.
__device__ float block_max(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = threadIdx.x < nwarps ? partial[threadIdx.x] : -INFINITY;
    if (warp == 0) v = warp_max(v);
    if (threadIdx.x == 0) partial[0] = v;
    __syncthreads();
    const float r = partial[0];
    __syncthreads();
    return r;
}

// Element offset of position `p`'s record in the paged per-token cache.
__device__ __forceinline__ i64 record_offset(const int* table, int p, int block_size, int token_stride) {
    return ((i64)table[p / block_size] * block_size + p % block_size) * token_stride;
}

// ---------------------------------------------------------------------------------------------
// Embedding and mHC

// One block per token: the embedding row copied into all `m` streams.
template <typename T>
__device__ void glm5_embed_impl(const int* ids, const T* table, float* x, int m, int d) {
    const T* row = table + (i64)ids[blockIdx.x] * d;
    float* out = x + (i64)blockIdx.x * m * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        const float v = to_f(row[c]);
        for (int s = 0; s < m; ++s) out[(i64)s * d + c] = v;
    }
}

// The mHC kernels split each token's row into chunks of HC_CHUNK columns, one block per
// (token, chunk), so a batch-1 step fills the GPU instead of one SM. An RMS over a row is the sum
// of the chunks' partial sums of squares taken in chunk order: it depends on the row's length
// only, never on the batch.
#define HC_CHUNK 256
#define HC_MAX 8

// Grid (tokens, groups of blockDim/32 chunks), one warp per chunk: partial[t·chunks + c] = Σ x²
// over chunk c of row t (`len` values; `chunks` = ⌈len / HC_CHUNK⌉).
extern "C" __global__ void rms_partial(const float* x, float* partial, int len, int chunks) {
    const int t = blockIdx.x, chunk = blockIdx.y * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x & 31;
    if (chunk >= chunks) return;
    const int c0 = chunk * HC_CHUNK, c1 = min(len, c0 + HC_CHUNK);
    const float* xr = x + (i64)t * len;
    float ss = 0.f;
    for (int i = c0 + lane; i < c1; i += 32) ss += xr[i] * xr[i];
    ss = warp_sum(ss);
    if (lane == 0) partial[(i64)t * chunks + chunk] = ss;
}

// Grid (tokens, chunks): out = (w ⊙) x / sqrt(Σ partials / len + eps); `w` may be null.
extern "C" __global__ void rms_apply(const float* x, const float* partial, const float* w, float* out, int len,
                                     float eps) {
    const int t = blockIdx.x, c0 = blockIdx.y * HC_CHUNK, c1 = min(len, c0 + HC_CHUNK);
    float ss = 0.f;
    for (int c = 0; c < (int)gridDim.y; ++c) ss += partial[(i64)t * gridDim.y + c];
    const float r = 1.0f / sqrtf(ss / (float)len + eps);
    const float* xr = x + (i64)t * len;
    float* o = out + (i64)t * len;
    for (int i = c0 + threadIdx.x; i < c1; i += blockDim.x) o[i] = w ? w[i] * (xr[i] * r) : xr[i] * r;
}

// One block of HC_MAX² threads per token: from the projected map `mix` ((2+M)·M values) the pre
// weights (to `pre`, [M] per token), the post weights β and the Sinkhorn-normalised comb C (spec
// §2.6, the CPU's op order: each row and column sum runs in index order) to `hcw` ([M + M·M] per
// token). Thread i·M + j owns C_ij.
// `mix` is the projection of the raw streams; the RMS norm of the M·D stream values is a scalar
// per token, applied here: 1/sqrt(Σ partials / (M·D) + eps) from `rms_partial`'s chunk sums,
// added in chunk order.
extern "C" __global__ void hc_maps(const float* mix, const float* partial, int chunks, float eps,
                                   const float* base, float s_pre, float s_post, float s_comb, float* pre, float* hcw,
                                   int m, int d, float hc_eps, int iters) {
    __shared__ float comb[HC_MAX * HC_MAX];
    const int t = blockIdx.x, n = (2 + m) * m, tid = threadIdx.x;
    const float* mx = mix + (i64)t * n;
    float* w = hcw + (i64)t * (m + m * m);
    float ss = 0.f;
    for (int c = 0; c < chunks; ++c) ss += partial[(i64)t * chunks + c];
    const float rs = 1.0f / sqrtf(ss / (float)(m * d) + eps);
    if (tid < m) {
        pre[(i64)t * m + tid] = sigmoidf_(mx[tid] * rs * s_pre + base[tid]) + hc_eps;
        w[tid] = 2.0f * sigmoidf_(mx[m + tid] * rs * s_post + base[m + tid]);
    }
    const bool own = tid < m * m;
    const int i = own ? tid / m : 0, j = own ? tid % m : 0;
    if (own) comb[tid] = mx[2 * m + tid] * rs * s_comb + base[2 * m + tid];
    __syncthreads();
    float v = 0.f, sum = 0.f;
    if (own) {
        float mxv = -INFINITY;
        for (int jj = 0; jj < m; ++jj) mxv = fmaxf(mxv, comb[i * m + jj]);
        for (int jj = 0; jj < m; ++jj) sum += expf(comb[i * m + jj] - mxv);
        v = expf(comb[tid] - mxv);
    }
    __syncthreads();
    if (own) comb[tid] = v / sum + hc_eps;
    __syncthreads();
    // One column normalisation, then (iters − 1) row + column rounds, as the CPU.
    const int rounds = iters > 1 ? iters : 1;
    for (int it = 0; it < rounds; ++it) {
        if (it > 0) {
            float rs = 0.f;
            if (own) {
                for (int jj = 0; jj < m; ++jj) rs += comb[i * m + jj];
                rs += hc_eps;
            }
            __syncthreads();
            if (own) comb[tid] /= rs;
            __syncthreads();
        }
        float cs = 0.f;
        if (own) {
            for (int ii = 0; ii < m; ++ii) cs += comb[ii * m + j];
            cs += hc_eps;
        }
        __syncthreads();
        if (own) comb[tid] /= cs;
        __syncthreads();
    }
    if (own) w[m + tid] = comb[tid];
}

// Grid (tokens, chunks of d): u = Σ_s pre_s X_s over the chunk (the collapsed block input, still
// to be RMS-normalised by rms_apply) and the chunk's Σ u² to `partial`.
extern "C" __global__ void hc_collapse(const float* x, const float* pre, float* u, float* partial, int m, int d) {
    const int t = blockIdx.x, c0 = blockIdx.y * HC_CHUNK, c1 = min(d, c0 + HC_CHUNK);
    const float* xr = x + (i64)t * m * d;
    const float* p = pre + (i64)t * m;
    float* ur = u + (i64)t * d;
    float ss = 0.f;
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        float v = 0.f;
        for (int s = 0; s < m; ++s) v += p[s] * xr[(i64)s * d + c];
        ur[c] = v;
        ss += v * v;
    }
    ss = block_sum(ss);
    if (threadIdx.x == 0) partial[(i64)t * gridDim.y + blockIdx.y] = ss;
}

// Grid (tokens, chunks of d): X'_j = β_j·y + Σ_i C_ij X_i (out must not alias x).
extern "C" __global__ void hc_expand(const float* x, const float* y, const float* hcw, float* out, int m, int d) {
    const int t = blockIdx.x, c0 = blockIdx.y * HC_CHUNK, c1 = min(d, c0 + HC_CHUNK);
    const float* w = hcw + (i64)t * (m + m * m);
    const float* xr = x + (i64)t * m * d;
    const float* yr = y + (i64)t * d;
    float* o = out + (i64)t * m * d;
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        for (int j = 0; j < m; ++j) {
            float mixed = 0.f;
            for (int i = 0; i < m; ++i) mixed += w[m + i * m + j] * xr[(i64)i * d + c];
            o[(i64)j * d + c] = w[j] * yr[c] + mixed;
        }
    }
}

// One block per logits row: the mean of the streams of token rows[r], RMS-normalised with `w`,
// written as the LM head's input.
template <typename T>
__device__ void glm5_final_norm_impl(const float* x, const int* rows, const float* w, T* out, int m, int d, float eps) {
    const float* xr = x + (i64)rows[blockIdx.x] * m * d;
    extern __shared__ float h[];
    float ss = 0.f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float v = 0.f;
        for (int s = 0; s < m; ++s) v += xr[(i64)s * d + c];
        v /= (float)m;
        h[c] = v;
        ss += v * v;
    }
    ss = block_sum(ss);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    T* o = out + (i64)blockIdx.x * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) o[c] = from_f<T>(w[c] * (h[c] * r));
}

// In place per row of `n`: w ⊙ x / sqrt(mean(x²) + eps); also written as T to `out` when given.
template <typename T>
__device__ void rms_rows_impl(float* x, const float* w, T* out, int n, float eps) {
    float* xr = x + (i64)blockIdx.x * n;
    float ss = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = w[i] * (xr[i] * r);
        xr[i] = v;
        if (out) out[(i64)blockIdx.x * n + i] = from_f<T>(v);
    }
}

// GEMM inputs in the storage type.
template <typename T>
__device__ void cast_impl(const float* x, T* y, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        y[i] = from_f<T>(x[i]);
}

// silu(min(g, λ)) · clip(u, −λ, λ) per row of [gate | up] (`rows` rows of 2·inter).
template <typename T>
__device__ void swiglu_clamped_impl(const float* gu, T* out, int inter, int rows, float limit) {
    for (int r = blockIdx.y; r < rows; r += gridDim.y) {
        const float* g = gu + (i64)r * 2 * inter;
        const float* up = g + inter;
        for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < inter; c += gridDim.x * blockDim.x) {
            const float gv = fminf(g[c], limit), uv = fminf(fmaxf(up[c], -limit), limit);
            out[(i64)r * inter + c] = from_f<T>(siluf_(gv) * uv);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// KDA

// Per sequence of the step: its first batch row, its token count, its state slot and where its
// slot images start (element offset into the checkpoint buffer, or -1 for none). `ckpt_map[row]`
// says which of the sequence's images the state after that row's token goes to (-1: none): after
// every token but the last of a verified sequence (rollback), or after the tokens that end a
// prefix-cache page inside the step (snapshots).
struct KdaSeq {
    int row0, n, slot;
    i64 checkpoints;
};

// Tokens per block of `kda_conv` (grid z).
#define KDA_CONV_TOKENS 32

// Grid (channel blocks, sequences, token chunks). Each thread owns one of the 3Q channels for up
// to KDA_CONV_TOKENS tokens: the causal conv over the K−1 inputs before the token and its own,
// then SiLU. Inputs before the step come from the slot's window, which this kernel only reads
// (`kda_conv_window` shifts it afterwards), so every token is computed in parallel with the sums
// in the order of a token-by-token pass. The window after a token goes to the slot image
// `ckpt_map` names for it.
extern "C" __global__ void kda_conv(const float* raw, float* conv, const float* state, float* ckpt,
                                   const int* ckpt_map, const KdaSeq* seqs, const float* taps, int q3, int kw,
                                   i64 slot_stride, i64 conv_off) {
    const KdaSeq s = seqs[blockIdx.y];
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    const int t0 = blockIdx.z * KDA_CONV_TOKENS;
    if (ch >= q3 || t0 >= s.n) return;
    const float* window = state + (i64)s.slot * slot_stride + conv_off;
    const float* tp = taps + (i64)ch * kw;
    // The input at step-relative position tau: this step's raw projection, or the window's.
    auto input = [&](int tau) {
        return tau >= 0 ? raw[(i64)(s.row0 + tau) * q3 + ch] : window[(i64)(kw - 1 + tau) * q3 + ch];
    };
    const int t1 = min(t0 + KDA_CONV_TOKENS, s.n);
    for (int t = t0; t < t1; ++t) {
        float acc = 0.f;
        for (int j = 0; j < kw; ++j) acc += tp[j] * input(t - (kw - 1) + j);
        conv[(i64)(s.row0 + t) * q3 + ch] = siluf_(acc);
        const int image = s.checkpoints >= 0 ? ckpt_map[s.row0 + t] : -1;
        if (image >= 0) {
            float* img = ckpt + s.checkpoints + (i64)image * slot_stride + conv_off;
            for (int j = 0; j < kw - 1; ++j) img[(i64)j * q3 + ch] = input(t + 1 - (kw - 1) + j);
        }
    }
}

// Grid (channel blocks, sequences), after `kda_conv`: the slot's window becomes the last K−1
// inputs (in place, ascending: entry j reads entry j + n ≥ j, not yet written).
extern "C" __global__ void kda_conv_window(const float* raw, float* state, const KdaSeq* seqs, int q3, int kw,
                                          i64 slot_stride, i64 conv_off) {
    const KdaSeq s = seqs[blockIdx.y];
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= q3) return;
    float* window = state + (i64)s.slot * slot_stride + conv_off;
    for (int j = 0; j < kw - 1; ++j) {
        const int tau = s.n - (kw - 1) + j;
        window[(i64)j * q3 + ch] = tau >= 0 ? raw[(i64)(s.row0 + tau) * q3 + ch] : window[(i64)(kw - 1 + tau) * q3 + ch];
    }
}

// Log-decay of one channel: lb·σ(e^A·f) with a lower bound, else −e^A·softplus(f).
__device__ __forceinline__ float kda_forget(float f, float a_log, int has_lb, float lb) {
    const float rate = expf(a_log);
    if (has_lb) return lb * sigmoidf_(rate * f);
    const float sp = f > 20.f ? f : logf(1.0f + expf(f));
    return -rate * sp;
}

// Grid (heads, sequences), one thread per value channel j (blockDim = the head dim rounded up to
// a multiple of 32; threads past it only join the reductions): thread j owns column j of the
// head's [d_k, d_v] state. Per token in order: l2-normalised q
// (scaled by d^-1/2) and k, the forget gates and β; S ← Diag(e^g) S; e = β (v − Sᵀk);
// S ← S + k eᵀ; o = Sᵀq; then the gated output RMSNorm with σ(z). Same order as the CPU.
extern "C" __global__ void kda_recurrent(const float* conv, const float* f, const float* b, const float* z,
                                        const float* dt_bias, const float* a_log, const float* o_norm, float* state,
                                        float* ckpt, const int* ckpt_map, const KdaSeq* seqs, float* core, int q,
                                        int heads, i64 slot_stride, i64 state_off, int has_lb, float lb, float eps,
                                        int hd) {
    extern __shared__ float sh[];
    const int h = blockIdx.x, j = threadIdx.x;
    const bool live = j < hd;
    float* sq = sh;
    float* sk = sh + hd;
    float* sg = sh + 2 * hd;
    const KdaSeq s = seqs[blockIdx.y];
    float* S = state + (i64)s.slot * slot_stride + state_off + (i64)h * hd * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    const int q3 = 3 * q;
    for (int t = 0; t < s.n; ++t) {
        const i64 row = s.row0 + t;
        const float* cv = conv + row * q3;
        const int ch = h * hd + j;
        const float qv = live ? cv[ch] : 0.f, kv = live ? cv[q + ch] : 0.f, vv = live ? cv[2 * q + ch] : 0.f;
        const float qn = 1.0f / sqrtf(block_sum(qv * qv) + 1e-6f);
        const float kn = 1.0f / sqrtf(block_sum(kv * kv) + 1e-6f);
        if (live) {
            sq[j] = qv * qn * scale;
            sk[j] = kv * kn;
            sg[j] = kda_forget(f[row * q + ch] + dt_bias[ch], a_log[h], has_lb, lb);
        }
        const float beta = sigmoidf_(b[row * heads + h]);
        __syncthreads();
        float err = vv;
        float o = 0.f;
        if (live) {
        for (int i = 0; i < hd; ++i) {
            const float x = S[(i64)i * hd + j] * expf(sg[i]);
            S[(i64)i * hd + j] = x;
        }
        for (int i = 0; i < hd; ++i) err -= S[(i64)i * hd + j] * sk[i];
        err *= beta;
        for (int i = 0; i < hd; ++i) {
            const float x = S[(i64)i * hd + j] + sk[i] * err;
            S[(i64)i * hd + j] = x;
        }
        for (int i = 0; i < hd; ++i) o += S[(i64)i * hd + j] * sq[i];
        }
        const float r = 1.0f / sqrtf(block_sum(o * o) / (float)hd + eps);
        if (live) core[row * q + ch] = o_norm[j] * (o * r) * sigmoidf_(z[row * q + ch]);
        const int image = s.checkpoints >= 0 ? ckpt_map[row] : -1;
        if (live && image >= 0) {
            float* img = ckpt + s.checkpoints + (i64)image * slot_stride + state_off + (i64)h * hd * hd;
            for (int i = 0; i < hd; ++i) img[(i64)i * hd + j] = S[(i64)i * hd + j];
        }
        __syncthreads();
    }
}

// The KDA recurrence for head dims 16, 32, 64 and 128 in three kernels, so that the token-serial
// part does nothing a token's neighbours could do in parallel:
//   kda_prep      grid (rows, heads): from the conv outputs, l2-normalised q (scaled by d^-1/2)
//                 and k and the decays e^g, written over the raw projections (dead after
//                 `kda_conv_window`), and β per token;
//   kda_scan      grid (heads · HD/32 column groups, sequences): the delta rule token by token;
//   kda_out_norm  grid (rows, heads): the gated output RMSNorm with σ(z).
// The state's columns (value channels) evolve independently, so a head's columns are split over
// blocks of 32 columns, and each column over KDA_R lanes of one warp holding HD/KDA_R state rows
// in registers; a column's dot
// products are the lanes' partial sums added by a butterfly, which leaves every lane the same
// value. Every step (decode, prefill, verification) runs these kernels, so a token's result does
// not depend on how its sequence was cut into steps or batched with others.
#define KDA_R 4
// Tokens staged in shared memory per round of `kda_scan`, and the rounds in flight (cp.async).
#define KDA_TT 8
#define KDA_STAGES 3

// 4 bytes global → shared without waiting (zeros when `ok` is false).
__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(ok ? 4 : 0)
                 : "memory");
}

template <int HD>
__device__ void kda_prep_impl(const float* conv, float* qkd, const float* f, float* beta, const float* b,
                              const float* dt_bias, const float* a_log, int q, int heads, int has_lb, float lb) {
    const int row = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
    const bool live = j < HD;
    const float* cv = conv + (i64)row * 3 * q;
    float* out = qkd + (i64)row * 3 * q;
    const int ch = h * HD + j;
    const float qv = live ? cv[ch] : 0.f, kv = live ? cv[q + ch] : 0.f;
    const float qn = 1.0f / sqrtf(block_sum(qv * qv) + 1e-6f);
    const float kn = 1.0f / sqrtf(block_sum(kv * kv) + 1e-6f);
    if (live) {
        out[ch] = qv * qn * (1.0f / sqrtf((float)HD));
        out[q + ch] = kv * kn;
        out[2 * q + ch] = expf(kda_forget(f[(i64)row * q + ch] + dt_bias[ch], a_log[h], has_lb, lb));
    }
    if (j == 0) beta[(i64)row * heads + h] = sigmoidf_(b[(i64)row * heads + h]);
}

// Block: 32 columns (HD if smaller) × KDA_R lanes; lane r of a column holds state rows
// [r·M, r·M + M). Per token: S ← Diag(e^g) S; e = β (v − Sᵀk); S ← S + k eᵀ; o = Sᵀq (raw,
// normalised by kda_out_norm). A staged q, k or decay row keeps each lane's M values contiguous
// with 4 floats of padding after them, so a lane reads them 16 bytes at a time and the lanes of a
// warp hit distinct banks.
template <int HD>
__device__ void kda_scan_impl(const float* conv, const float* qkd, const float* beta, float* state, float* ckpt,
                              const int* ckpt_map, const KdaSeq* seqs, float* core, int q, int heads,
                              i64 slot_stride, i64 state_off) {
    constexpr int CB = HD < 32 ? HD : 32, R = KDA_R, M = HD / R, GROUPS = HD / CB, ROW = HD + 4 * R;
    __shared__ __align__(16) float s_qkd[KDA_STAGES][KDA_TT][3][ROW];
    __shared__ __align__(16) float s_v[KDA_STAGES][KDA_TT][CB];
    __shared__ float s_beta[KDA_STAGES][KDA_TT];
    __shared__ int s_image[KDA_STAGES][KDA_TT];
    const int h = blockIdx.x / GROUPS, c0 = (blockIdx.x % GROUPS) * CB;
    const int c = threadIdx.x / R, r = threadIdx.x % R, j = c0 + c;
    const KdaSeq s = seqs[blockIdx.y];
    const bool images = s.checkpoints >= 0;
    float* S = state + (i64)s.slot * slot_stride + state_off + (i64)h * HD * HD;
    const int q3 = 3 * q;
    float col[M];
#pragma unroll
    for (int m = 0; m < M; ++m) col[m] = S[(i64)(r * M + m) * HD + j];
    // Stage tokens [t0, t0 + KDA_TT) into buffer `buf` asynchronously (zeros past the sequence's
    // end, never read) and commit them as one group.
    auto stage = [&](int buf, int t0) {
        constexpr int ROW_PIECES = 3 * HD / 4, V_PIECES = CB / 4;
        for (int i = threadIdx.x; i < KDA_TT * (ROW_PIECES + V_PIECES); i += CB * R) {
            const int tt = i / (ROW_PIECES + V_PIECES), p = i % (ROW_PIECES + V_PIECES);
            const bool ok = t0 + tt < s.n;
            const i64 row = s.row0 + (ok ? t0 + tt : 0);
            if (p < ROW_PIECES) {
                const int part = p / (HD / 4), e = 4 * (p % (HD / 4));
                cp_async16(&s_qkd[buf][tt][part][e + (e / M) * 4], qkd + row * q3 + (i64)part * q + h * HD + e, ok);
            } else {
                const int e = 4 * (p - ROW_PIECES);
                cp_async16(&s_v[buf][tt][e], conv + row * q3 + 2 * q + h * HD + c0 + e, ok);
            }
        }
        if (threadIdx.x < KDA_TT) {
            const int t = t0 + threadIdx.x;
            const bool ok = t < s.n;
            const i64 row = s.row0 + (ok ? t : 0);
            cp_async4(&s_beta[buf][threadIdx.x], beta + row * heads + h, ok);
            if (images) cp_async4(&s_image[buf][threadIdx.x], ckpt_map + row, ok);
        }
        cp_async_commit();
    };
    // One token: separate partial sums per float4 lane shorten the dependent chains.
    auto token = [&](int buf, int tt, i64 row, bool with_images) {
        const float4* sq = reinterpret_cast<const float4*>(&s_qkd[buf][tt][0][r * (M + 4)]);
        const float4* sk = reinterpret_cast<const float4*>(&s_qkd[buf][tt][1][r * (M + 4)]);
        const float4* sd = reinterpret_cast<const float4*>(&s_qkd[buf][tt][2][r * (M + 4)]);
        float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
#pragma unroll
        for (int m4 = 0; m4 < M / 4; ++m4) {
            const float4 d = sd[m4], k = sk[m4];
            col[4 * m4] *= d.x;
            col[4 * m4 + 1] *= d.y;
            col[4 * m4 + 2] *= d.z;
            col[4 * m4 + 3] *= d.w;
            d0 += col[4 * m4] * k.x;
            d1 += col[4 * m4 + 1] * k.y;
            d2 += col[4 * m4 + 2] * k.z;
            d3 += col[4 * m4 + 3] * k.w;
        }
        float dot = (d0 + d1) + (d2 + d3);
#pragma unroll
        for (int off = 1; off < R; off <<= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
        const float err = s_beta[buf][tt] * (s_v[buf][tt][c] - dot);
        float o0 = 0.f, o1 = 0.f, o2 = 0.f, o3 = 0.f;
#pragma unroll
        for (int m4 = 0; m4 < M / 4; ++m4) {
            const float4 k = sk[m4], qq = sq[m4];
            col[4 * m4] += k.x * err;
            col[4 * m4 + 1] += k.y * err;
            col[4 * m4 + 2] += k.z * err;
            col[4 * m4 + 3] += k.w * err;
            o0 += col[4 * m4] * qq.x;
            o1 += col[4 * m4 + 1] * qq.y;
            o2 += col[4 * m4 + 2] * qq.z;
            o3 += col[4 * m4 + 3] * qq.w;
        }
        float o = (o0 + o1) + (o2 + o3);
#pragma unroll
        for (int off = 1; off < R; off <<= 1) o += __shfl_xor_sync(0xffffffffu, o, off);
        if (r == 0) core[row * q + h * HD + j] = o;
        const int image = with_images ? s_image[buf][tt] : -1;
        if (image >= 0) {
            float* img = ckpt + s.checkpoints + (i64)image * slot_stride + state_off + (i64)h * HD * HD;
#pragma unroll
            for (int m = 0; m < M; ++m) img[(i64)(r * M + m) * HD + j] = col[m];
        }
    };
#pragma unroll
    for (int k = 0; k + 1 < KDA_STAGES; ++k) stage(k, k * KDA_TT);
    for (int k = 0, t0 = 0; t0 < s.n; ++k, t0 += KDA_TT) {
        // Chunk k's group is complete once at most the KDA_STAGES − 2 later ones are pending;
        // the barrier also ends every thread's reads of the buffer the next stage overwrites.
        cp_async_wait<KDA_STAGES - 2>();
        __syncthreads();
        stage((k + KDA_STAGES - 1) % KDA_STAGES, t0 + (KDA_STAGES - 1) * KDA_TT);
        const int buf = k % KDA_STAGES;
        if (!images && s.n - t0 >= KDA_TT) {
            // Unrolled and branch-free, so one token's output reduction and the next token's
            // shared-memory reads overlap the update in between.
#pragma unroll
            for (int tt = 0; tt < KDA_TT; ++tt) token(buf, tt, s.row0 + t0 + tt, false);
        } else {
            for (int tt = 0; tt < min(KDA_TT, s.n - t0); ++tt) token(buf, tt, s.row0 + t0 + tt, images);
        }
    }
    cp_async_wait<0>();  // the stages past the end (zero fills) land before the block exits
#pragma unroll
    for (int m = 0; m < M; ++m) S[(i64)(r * M + m) * HD + j] = col[m];
}

// Grid (rows, heads), blockDim = the head dim rounded up to 32: core ← o_norm ⊙ o / rms(o) ⊙ σ(z).
extern "C" __global__ void kda_out_norm(float* core, const float* z, const float* o_norm, int q, int hd,
                                       float eps) {
    const int row = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
    const bool live = j < hd;
    const i64 at = (i64)row * q + h * hd + j;
    const float o = live ? core[at] : 0.f;
    const float r = 1.0f / sqrtf(block_sum(o * o) / (float)hd + eps);
    if (live) core[at] = o_norm[j] * (o * r) * sigmoidf_(z[at]);
}

#define KDA_SPLIT(HD)                                                                                         \
    extern "C" __global__ void kda_prep_##HD(const float* conv, float* qkd, const float* f, float* beta,      \
                                             const float* b, const float* dt_bias, const float* a_log, int q,  \
                                             int heads, int has_lb, float lb) {                                \
        kda_prep_impl<HD>(conv, qkd, f, beta, b, dt_bias, a_log, q, heads, has_lb, lb);                        \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__((HD < 32 ? HD : 32) * KDA_R) kda_scan_##HD(                   \
        const float* conv, const float* qkd, const float* beta, float* state, float* ckpt, const int* ckpt_map, \
        const KdaSeq* seqs, float* core, int q, int heads, i64 slot_stride, i64 state_off) {                   \
        kda_scan_impl<HD>(conv, qkd, beta, state, ckpt, ckpt_map, seqs, core, q, heads, slot_stride, state_off); \
    }
KDA_SPLIT(16)
KDA_SPLIT(32)
KDA_SPLIT(64)
KDA_SPLIT(128)

// ---------------------------------------------------------------------------------------------
// MLA + DSA

// Per batch row: its absolute position and where its sequence's block table starts in `tables`.
struct DsaRow {
    int pos, table;
};

// One block per batch row: the normalised latent into the record; for a full-indexer layer the
// LayerNorm'd indexer key (eps 1e-6, biased variance) and the raw gate logits after it.
extern "C" __global__ void dsa_store(const float* latent, const float* kgw, const float* k_norm_w,
                                     const float* k_norm_b, float* kv, const DsaRow* rows, const int* tables,
                                     int block_size, int token_stride, int latent_off, int ix_off, int r, int di,
                                     int kgw_width) {
    const DsaRow row = rows[blockIdx.x];
    float* rec = kv + record_offset(tables + row.table, row.pos, block_size, token_stride);
    const float* lat = latent + (i64)blockIdx.x * r;
    for (int i = threadIdx.x; i < r; i += blockDim.x) rec[latent_off + i] = lat[i];
    if (ix_off < 0) return;
    const float* k = kgw + (i64)blockIdx.x * kgw_width;
    float sum = 0.f;
    for (int i = threadIdx.x; i < di; i += blockDim.x) sum += k[i];
    const float mean = block_sum(sum) / (float)di;
    float var = 0.f;
    for (int i = threadIdx.x; i < di; i += blockDim.x) var += (k[i] - mean) * (k[i] - mean);
    var = block_sum(var) / (float)di;
    const float rs = 1.0f / sqrtf(var + 1e-6f);
    for (int i = threadIdx.x; i < di; i += blockDim.x) {
        rec[ix_off + i] = (k[i] - mean) * rs * k_norm_w[i] + k_norm_b[i];
        rec[ix_off + di + i] = k[di + i];
    }
}

// One block per pool completed this step (`pool_recs` holds each pool's `p` record offsets in
// position order): per channel the softmax over the pool's tokens of γ + ape, times the keys,
// stored after the pool's last token's key and gate.
extern "C" __global__ void dsa_pool(float* kv, const i64* pool_recs, const float* ape, int ix_off, int di, int p) {
    const i64* recs = pool_recs + (i64)blockIdx.x * p;
    if (recs[0] < 0) return;  // a graph step's sequence that completes no pool
    for (int c = threadIdx.x; c < di; c += blockDim.x) {
        float mx = -INFINITY;
        for (int j = 0; j < p; ++j) mx = fmaxf(mx, kv[recs[j] + ix_off + di + c] + ape[(i64)j * di + c]);
        float sum = 0.f;
        for (int j = 0; j < p; ++j) sum += expf(kv[recs[j] + ix_off + di + c] + ape[(i64)j * di + c] - mx);
        float o = 0.f;
        for (int j = 0; j < p; ++j)
            o += expf(kv[recs[j] + ix_off + di + c] + ape[(i64)j * di + c] - mx) / sum * kv[recs[j] + ix_off + c];
        kv[recs[p - 1] + ix_off + 2 * di + c] = o;
    }
}

// The DSA selection in two kernels: `dsa_score` scores every complete pool of every row (many
// blocks per row, so a batch-1 decode step at long context fills the GPU), then `dsa_select`
// keeps the best `budget` pools of each row by a radix select and expands them to positions.
#define DSA_SCORE_POOLS 128
// Indexer heads whose dot products one thread carries at once.
#define DSA_HEAD_GROUP 16

// Grid (rows, pool chunks of DSA_SCORE_POOLS), DSA_SCORE_POOLS threads, one pool each; dynamic
// shared memory: the row's indexer query, hi·di floats, transposed to [channel][head]. A pool's
// score is Σ_h w_h H_I^-1/2 ReLU(q_h·k / sqrt(d_I)) over its pooled key, each dot summed over the
// channels in order and the heads in order (the CPU's order). Only rows whose complete pools
// outnumber the budget are scored: the others keep every pool.
extern "C" __global__ void dsa_score(const float* qi, const float* kgw, const float* kv, const DsaRow* rows,
                                     const int* tables, float* scores, int block_size, int token_stride, int ix_off,
                                     int hi, int di, int kgw_width, int pool, int budget, int max_pools) {
    extern __shared__ float q_t[];
    const DsaRow row = rows[blockIdx.x];
    const int complete = (row.pos + 1) / pool;
    const int p0 = blockIdx.y * DSA_SCORE_POOLS;
    if (complete <= budget || p0 >= complete) return;
    const float* q = qi + (i64)blockIdx.x * hi * di;
    for (int i = threadIdx.x; i < hi * di; i += blockDim.x) q_t[(i % di) * hi + i / di] = q[i];
    __syncthreads();
    const int p = p0 + threadIdx.x;
    if (p >= complete) return;
    const float* key = kv + record_offset(tables + row.table, p * pool + pool - 1, block_size, token_stride) + ix_off + 2 * di;
    const float* wraw = kgw + (i64)blockIdx.x * kgw_width + 2 * di;
    const float wscale = 1.0f / sqrtf((float)hi), qscale = 1.0f / sqrtf((float)di);
    float total = 0.f;
    for (int h0 = 0; h0 < hi; h0 += DSA_HEAD_GROUP) {
        float dot[DSA_HEAD_GROUP];
#pragma unroll
        for (int u = 0; u < DSA_HEAD_GROUP; ++u) dot[u] = 0.f;
        for (int c = 0; c < di; ++c) {
            const float k = key[c];
            const float* qc = q_t + c * hi + h0;
#pragma unroll
            for (int u = 0; u < DSA_HEAD_GROUP; ++u)
                if (h0 + u < hi) dot[u] += qc[u] * k;
        }
#pragma unroll
        for (int u = 0; u < DSA_HEAD_GROUP; ++u)
            if (h0 + u < hi) total += wraw[h0 + u] * wscale * fmaxf(dot[u] * qscale, 0.f);
    }
    scores[(i64)blockIdx.x * max_pools + p] = total;
}

// A float's bits as an unsigned that orders like the float (−0 taken as +0, as `==` does).
__device__ __forceinline__ unsigned dsa_order_key(float v) {
    const unsigned b = v == 0.f ? 0u : __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Exclusive prefix sum of one int per thread over the block (blockDim a multiple of 32, ≤ 1024);
// `total` gets the block's sum.
__device__ int block_exclusive_scan(int v, int& total) {
    __shared__ int warp_sums[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int x = v;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, off);
        if (lane >= off) x += y;
    }
    __syncthreads();
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, w, off);
            if (lane >= off) w += y;
        }
        if (lane < nwarps) warp_sums[lane] = w;
    }
    __syncthreads();
    total = warp_sums[nwarps - 1];
    const int before = (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
    __syncthreads();
    return before;
}

// One block per batch row: the best `budget` of the row's complete pools under (score
// descending, index ascending — ties to the earlier pool, as the CPU's stable order), found by a
// radix select over the scores' order keys (four 8-bit digits), expanded to positions in
// ascending order, then the raw tail of the query's own incomplete pool. Each thread owns a
// contiguous run of pools, so the order-dependent counts are prefix sums over the runs. `sel` has
// `max_sel` ints per row and `sel_count` the number used.
extern "C" __global__ void dsa_select(const float* scores, const DsaRow* rows, int* sel, int* sel_count, int pool,
                                      int budget, int tail, int max_pools, int max_sel) {
    __shared__ unsigned hist[256];
    __shared__ unsigned s_digit, s_remaining;
    const DsaRow row = rows[blockIdx.x];
    const int complete = (row.pos + 1) / pool;
    const float* sc = scores + (i64)blockIdx.x * max_pools;
    int* out = sel + (i64)blockIdx.x * max_sel;
    int kept_pools;
    if (complete > budget) {
        unsigned prefix = 0, mask = 0, remaining = budget;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
            __syncthreads();
            for (int p = threadIdx.x; p < complete; p += blockDim.x) {
                const unsigned k = dsa_order_key(sc[p]);
                if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1u);
            }
            __syncthreads();
            if (threadIdx.x == 0) {
                unsigned above = 0;
                int b = 255;
                for (; b > 0 && above + hist[b] < remaining; --b) above += hist[b];
                s_digit = b;
                s_remaining = remaining - above;
            }
            __syncthreads();
            prefix |= s_digit << shift;
            mask |= 255u << shift;
            remaining = s_remaining;
            __syncthreads();
        }
        // `prefix` is the key of the budget-th pool; the first `remaining` pools with that key
        // (by index) are kept with every pool above it.
        const int run = (complete + blockDim.x - 1) / blockDim.x;
        const int r0 = min((int)threadIdx.x * run, complete), r1 = min(r0 + run, complete);
        int ties = 0;
        for (int p = r0; p < r1; ++p) ties += dsa_order_key(sc[p]) == prefix;
        int total;
        int ties_before = block_exclusive_scan(ties, total);
        int kept = 0;
        for (int p = r0; p < r1; ++p) {
            const unsigned k = dsa_order_key(sc[p]);
            kept += k > prefix || (k == prefix && ties_before++ < (int)remaining);
        }
        int before = block_exclusive_scan(kept, kept_pools);
        ties_before = block_exclusive_scan(ties, total);
        for (int p = r0; p < r1; ++p) {
            const unsigned k = dsa_order_key(sc[p]);
            if (k > prefix || (k == prefix && ties_before++ < (int)remaining)) {
                for (int x = 0; x < pool; ++x) out[before * pool + x] = p * pool + x;
                ++before;
            }
        }
    } else {
        kept_pools = complete;
        for (int x = threadIdx.x; x < complete * pool; x += blockDim.x) out[x] = x;
    }
    const int n0 = kept_pools * pool;
    const int tail_len = tail ? row.pos + 1 - complete * pool : 0;
    for (int i = threadIdx.x; i < tail_len; i += blockDim.x) out[n0 + i] = complete * pool + i;
    if (threadIdx.x == 0) sel_count[blockIdx.x] = n0 + tail_len;
}

// Absorbed MLA attention over the selected latents, split over positions so a batch-1 decode
// step fills the GPU (flash-decoding): q̃ = W^Kᵀ q_h (mla_qt), then per (head, row, split of
// MLA_SPLIT selected positions) the scores q̃·c_τ / sqrt(d_n), their max, Σ exp and the
// exp-weighted latent sum (mla_attend_part), then per (head, row) the splits merged in split order
// and o = W^V ĉ (mla_attend_combine). The splits depend on the row's selection only, never on the
// batch. Rows are `row0 + blockIdx.y`: a step's rows may be taken in tiles.
#define MLA_SPLIT 64

// Grid (heads, rows, column groups of blockDim): each thread one of the r values.
template <typename T>
__device__ void mla_qt_impl(const float* q, const T* kv_b, float* qt, int row0, int h, int dn, int dv, int r) {
    const int hh = blockIdx.x, b = row0 + blockIdx.y, a = blockIdx.z * blockDim.x + threadIdx.x;
    if (a >= r) return;
    const T* wk = kv_b + (i64)hh * (dn + dv) * r;
    const float* qh = q + (i64)b * h * dn + (i64)hh * dn;
    float v = 0.f;
#pragma unroll 8
    for (int i = 0; i < dn; ++i) v += qh[i] * to_f(wk[(i64)i * r + a]);
    qt[((i64)b * h + hh) * r + a] = v;
}

// Grid (heads, rows of the tile, splits): for selected positions [s·MLA_SPLIT, …) of the row,
// part = (max score, Σ exp(score − max), Σ exp(score − max)·c_τ[0..r)) at
// part + ((y·h + head)·splits + s)·(r + 2); scale = 1/sqrt(d_n). Dynamic shared memory: r + MLA_SPLIT floats
// (rounded up to an even count) and MLA_SPLIT record offsets.
extern "C" __global__ void mla_attend_part(const float* qt, const float* kv, const DsaRow* rows, const int* tables,
                                           const int* sel, const int* sel_count, float* part, int row0, int block_size,
                                           int token_stride, int latent_off, int h, int r, int max_sel, int splits,
                                           float scale) {
    extern __shared__ float sh[];
    float* q = sh;
    float* sc = sh + r;
    i64* rec = reinterpret_cast<i64*>(sh + ((r + MLA_SPLIT + 1) & ~1));
    const int hh = blockIdx.x, b = row0 + blockIdx.y, s = blockIdx.z, lane = threadIdx.x & 31,
              warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int n = sel_count[b], x0 = s * MLA_SPLIT;
    if (x0 >= n) return;  // the combine reads only the splits the row has
    const int cnt = min(MLA_SPLIT, n - x0);
    const DsaRow row = rows[b];
    const int* table = tables + row.table;
    const int* ps = sel + (i64)b * max_sel + x0;
    const float* qs = qt + ((i64)b * h + hh) * r;
    for (int a = threadIdx.x; a < r; a += blockDim.x) q[a] = qs[a];
    for (int x = threadIdx.x; x < cnt; x += blockDim.x) rec[x] = record_offset(table, ps[x], block_size, token_stride) + latent_off;
    __syncthreads();
    for (int x = warp; x < cnt; x += nwarps) {
        const float* c = kv + rec[x];
        float dot = 0.f;
        for (int a = lane; a < r; a += 32) dot += c[a] * q[a];
        dot = warp_sum(dot);
        if (lane == 0) sc[x] = dot * scale;
    }
    __syncthreads();
    float mx = -INFINITY;
    for (int x = threadIdx.x; x < cnt; x += blockDim.x) mx = fmaxf(mx, sc[x]);
    mx = block_max(mx);
    float e_part = 0.f;
    for (int x = threadIdx.x; x < cnt; x += blockDim.x) {
        const float e = expf(sc[x] - mx);
        sc[x] = e;
        e_part += e;
    }
    const float sum = block_sum(e_part);
    float* out = part + (((i64)blockIdx.y * h + hh) * splits + s) * (r + 2);
    for (int a = threadIdx.x; a < r; a += blockDim.x) {
        float v = 0.f;
        for (int x = 0; x < cnt; ++x) v += sc[x] * kv[rec[x] + a];
        out[2 + a] = v;
    }
    if (threadIdx.x == 0) {
        out[0] = mx;
        out[1] = sum;
    }
}

// Grid (heads, rows of the tile, groups of output channels): the row's splits merged in split
// order into ĉ (each block of the row the same way), then its channels of o = W^V_h ĉ. Dynamic
// shared memory: r floats.
template <typename T>
__device__ void mla_attend_combine_impl(const float* part, const T* kv_b, const int* sel_count, float* out, int row0,
                                        int h, int dn, int dv, int r, int splits) {
    extern __shared__ float ctx[];
    const int hh = blockIdx.x, b = row0 + blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5,
              nwarps = blockDim.x >> 5;
    float* o = out + (i64)b * h * dv + (i64)hh * dv;
    const int n = sel_count[b];
    const int per = (dv + gridDim.z - 1) / gridDim.z, j0 = blockIdx.z * per, j1 = min(dv, j0 + per);
    if (n == 0) {
        for (int jj = j0 + threadIdx.x; jj < j1; jj += blockDim.x) o[jj] = 0.f;
        return;
    }
    const int used = (n + MLA_SPLIT - 1) / MLA_SPLIT;
    const float* pr = part + ((i64)blockIdx.y * h + hh) * splits * (r + 2);
    float mx = -INFINITY;
    for (int s = 0; s < used; ++s) mx = fmaxf(mx, pr[(i64)s * (r + 2)]);
    float total = 0.f;
    for (int s = 0; s < used; ++s) total += pr[(i64)s * (r + 2) + 1] * expf(pr[(i64)s * (r + 2)] - mx);
    for (int a = threadIdx.x; a < r; a += blockDim.x) {
        float v = 0.f;
        for (int s = 0; s < used; ++s) v += expf(pr[(i64)s * (r + 2)] - mx) * pr[(i64)s * (r + 2) + 2 + a];
        ctx[a] = v / total;
    }
    __syncthreads();
    const T* wv = kv_b + (i64)hh * (dn + dv) * r + (i64)dn * r;
    for (int jj = j0 + warp; jj < j1; jj += nwarps) {
        float v = 0.f;
        for (int a = lane; a < r; a += 32) v += to_f(wv[(i64)jj * r + a]) * ctx[a];
        v = warp_sum(v);
        if (lane == 0) o[jj] = v;
    }
}

// ---------------------------------------------------------------------------------------------
// MoE

// One block per token (dynamic shared memory 3·E floats): sigmoid scores, selection by
// score + correction bias, groups ranked by the sum of their two best, the best `topk_group`
// groups kept, the top k experts of those (ties to the lower index), sorted by expert; weights
// normalised over the chosen scores (when `norm`) and scaled. Writes the chosen experts and
// weights ([rows, k] each). The top k come from k rounds of a block arg-max under the serial
// definition's order (a rank count per expert took ~30 µs a token at 288 experts), so the choice
// is the same.
extern "C" __global__ void moe_route(const float* logits, const float* bias, int* experts, float* weights, int e,
                                     int n_group, int topk_group, int k, int norm, float scaling) {
    extern __shared__ float sh[];
    float* score = sh;
    float* choice = sh + e;
    float* gscore = sh + 2 * e;  // n_group ≤ e
    const float* l = logits + (i64)blockIdx.x * e;
    for (int i = threadIdx.x; i < e; i += blockDim.x) {
        score[i] = sigmoidf_(l[i]);
        choice[i] = score[i] + bias[i];
    }
    __syncthreads();
    const int per = e / n_group;
    // With n_group ≤ topk_group every group is kept: nothing to rank.
    for (int g = threadIdx.x; g < n_group && n_group > topk_group; g += blockDim.x) {
        // Two best of the group, the first maximum winning ties.
        int b1 = -1;
        for (int i = 0; i < per; ++i)
            if (b1 < 0 || choice[g * per + i] > choice[g * per + b1]) b1 = i;
        int b2 = -1;
        for (int i = 0; i < per; ++i)
            if (i != b1 && (b2 < 0 || choice[g * per + i] > choice[g * per + b2])) b2 = i;
        gscore[g] = choice[g * per + b1] + (b2 >= 0 ? choice[g * per + b2] : 0.f);
    }
    __syncthreads();
    // Keep the best topk_group groups: dropped groups' experts get −inf.
    for (int i = threadIdx.x; i < e && n_group > topk_group; i += blockDim.x) {
        const int g = i / per;
        int gr = 0;
        for (int o = 0; o < n_group; ++o) gr += (gscore[o] > gscore[g] || (gscore[o] == gscore[g] && o < g));
        if (gr >= topk_group) choice[i] = -INFINITY;
    }
    __syncthreads();
    // The k best under (choice descending, index ascending) — the serial definition's set — by
    // k rounds of a block arg-max; a taken expert's choice becomes NaN, which never wins.
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    int* ex = experts + (i64)blockIdx.x * k;
    float* wt = weights + (i64)blockIdx.x * k;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    const int chosen = min(k, e);
    for (int s = 0; s < chosen; ++s) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int i = threadIdx.x; i < e; i += blockDim.x) {
            const float v = choice[i];
            if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) { best_v[warp] = bv; best_i[warp] = bi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < nwarps; ++w)
                if (best_v[w] > bv || (best_v[w] == bv && best_i[w] < bi)) { bv = best_v[w]; bi = best_i[w]; }
            ex[s] = bi;
            choice[bi] = __int_as_float(0x7fc00000);
        }
        __syncthreads();
    }
    if (threadIdx.x != 0) return;
    // In ascending expert order, as the serial scan takes them.
    for (int s = 1; s < chosen; ++s) {
        const int v = ex[s];
        int t = s;
        for (; t > 0 && ex[t - 1] > v; --t) ex[t] = ex[t - 1];
        ex[t] = v;
    }

    float denom = 1.f;
    if (norm) {
        denom = 0.f;
        for (int s = 0; s < chosen; ++s) denom += score[ex[s]];
        denom += 1e-20f;
    }
    for (int s = 0; s < chosen; ++s) wt[s] = score[ex[s]] / denom * scaling;
}

// Routed experts for decode-sized steps without a host round trip: moe_sort groups the step's
// (token, slot) pairs by expert on the device, then moe_gemv_grouped reads each used expert's
// rows once for all of its pairs (a weight row stays in L1 while the expert's pairs use it).
// A pair's dot product is the same whatever else the step routes (fixed lane order, warp tree):
// a row's result never depends on the batch.

// One block: for pairs [0, pairs) with experts[p], order = the pairs grouped by ascending expert,
// ascending pair within an expert; groups[u] = (expert, first index in order, count) for the
// used experts in ascending order, n_used[0] their number. Shared memory: 2·e ints.
extern "C" __global__ void moe_sort(const int* experts, int pairs, int e, int* order, int3* groups, int* n_used) {
    extern __shared__ int cnt[];
    int* start = cnt + e;
    for (int i = threadIdx.x; i < e; i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) atomicAdd(&cnt[experts[p]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int at = 0, used = 0;
        for (int i = 0; i < e; ++i) {
            start[i] = at;
            if (cnt[i] > 0) groups[used++] = make_int3(i, at, cnt[i]);
            at += cnt[i];
        }
        n_used[0] = used;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int ex = experts[p];
        int before = 0;
        for (int q = 0; q < p; ++q) before += experts[q] == ex;
        order[start[ex] + before] = p;
    }
}

// One warp's dot product of a weight row with an f32 input row (16-byte weight loads where the
// row allows it), f32 accumulation in a fixed order; every lane gets the sum.
template <typename T>
__device__ __forceinline__ float warp_row_dot(const T* wr, const float* xr, int k_in, bool vec, int lane) {
    constexpr int V = 16 / sizeof(T);
    float acc = 0.f;
    if (vec) {
#pragma unroll 4
        for (int i = lane * V; i < k_in; i += 32 * V) {
            const uint4 raw = *reinterpret_cast<const uint4*>(wr + i);
            float wf[V];
            if constexpr (sizeof(T) == 2) {
                const unsigned u[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    wf[2 * j] = __uint_as_float(u[j] << 16);
                    wf[2 * j + 1] = __uint_as_float(u[j] & 0xffff0000u);
                }
            } else {
                wf[0] = __uint_as_float(raw.x);
                wf[1] = __uint_as_float(raw.y);
                wf[2] = __uint_as_float(raw.z);
                wf[3] = __uint_as_float(raw.w);
            }
#pragma unroll
            for (int j = 0; j < V; j += 4) {
                const float4 xv = *reinterpret_cast<const float4*>(xr + i + j);
                acc = fmaf(wf[j], xv.x, acc);
                acc = fmaf(wf[j + 1], xv.y, acc);
                acc = fmaf(wf[j + 2], xv.z, acc);
                acc = fmaf(wf[j + 3], xv.w, acc);
            }
        }
    } else {
        for (int i = lane; i < k_in; i += 32) acc += to_f(wr[i]) * xr[i];
    }
    return warp_sum(acc);
}

// Grid (output chunks, used-expert slots ≥ n_used): for used expert u, every output row o of
// its matrix (one warp per row) against each of its pairs p: y[p·n_out + o] = W_e[o] · x[p / x_div]
// (x_div = k: the token's input for gate/up; 1: the pair's own activation for down).
template <typename T>
__device__ void moe_gemv_grouped_impl(const float* x, int x_div, const int* order, const int3* groups,
                                      const int* n_used, const T* w, i64 expert_stride, float* y, int n_out, int k_in) {
    if ((int)blockIdx.y >= n_used[0]) return;
    const int3 g = groups[blockIdx.y];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const T* we = w + (i64)g.x * expert_stride;
    constexpr int V = 16 / sizeof(T);
    const bool vec = k_in % (32 * V) == 0 && ((unsigned long long)we & 15) == 0 && ((unsigned long long)x & 15) == 0;
    for (int o = blockIdx.x * nwarps + warp; o < n_out; o += gridDim.x * nwarps) {
        const T* wr = we + (i64)o * k_in;
        for (int j = 0; j < g.z; ++j) {
            const int p = order[g.y + j];
            const float acc = warp_row_dot<T>(wr, x + (i64)(p / x_div) * k_in, k_in, vec, lane);
            if (lane == 0) y[(i64)p * n_out + o] = acc;
        }
    }
}

// Grid (tokens, chunks of d): y[row] += Σ_slot weight·expert_out in slot (ascending expert)
// order; y holds the shared expert's output.
extern "C" __global__ void moe_combine(const float* slot_out, const float* weights, float* y, int k, int d) {
    const int row = blockIdx.x, c0 = blockIdx.y * HC_CHUNK, c1 = min(d, c0 + HC_CHUNK);
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < k; ++s) acc += weights[(i64)row * k + s] * slot_out[((i64)row * k + s) * d + c];
        y[(i64)row * d + c] += acc;
    }
}

// Gather rows idx[i] of x ([*, n] f32) into out[i] (storage type, a grouped GEMM's input).
template <typename T>
__device__ void gather_rows_impl(const float* x, const int* idx, T* out, int n) {
    const float* src = x + (i64)idx[blockIdx.x] * n;
    for (int c = threadIdx.x; c < n; c += blockDim.x) out[(i64)blockIdx.x * n + c] = from_f<T>(src[c]);
}

// Scatter rows i of src ([*, n]) to rows idx[i] of out.
extern "C" __global__ void scatter_rows(const float* src, const int* idx, float* out, int n) {
    const float* s = src + (i64)blockIdx.x * n;
    for (int c = threadIdx.x; c < n; c += blockDim.x) out[(i64)idx[blockIdx.x] * n + c] = s[c];
}

#define GLM5_KERNELS(T, S)                                                                                   \
    extern "C" __global__ void glm5_embed_##S(const int* ids, const T* table, float* x, int m, int d) {       \
        glm5_embed_impl<T>(ids, table, x, m, d);                                                             \
    }                                                                                                        \
    extern "C" __global__ void glm5_final_norm_##S(const float* x, const int* rows, const float* w, T* out,  \
                                                   int m, int d, float eps) {                                \
        glm5_final_norm_impl<T>(x, rows, w, out, m, d, eps);                                                 \
    }                                                                                                        \
    extern "C" __global__ void rms_rows_##S(float* x, const float* w, T* out, int n, float eps) {            \
        rms_rows_impl<T>(x, w, out, n, eps);                                                                 \
    }                                                                                                        \
    extern "C" __global__ void cast_##S(const float* x, T* y, i64 n) { cast_impl<T>(x, y, n); }               \
    extern "C" __global__ void swiglu_clamped_##S(const float* gu, T* out, int inter, int rows, float limit) { \
        swiglu_clamped_impl<T>(gu, out, inter, rows, limit);                                                 \
    }                                                                                                        \
    extern "C" __global__ void mla_qt_##S(const float* q, const T* kv_b, float* qt, int row0, int h, int dn,  \
                                          int dv, int r) {                                                   \
        mla_qt_impl<T>(q, kv_b, qt, row0, h, dn, dv, r);                                                     \
    }                                                                                                        \
    extern "C" __global__ void mla_attend_combine_##S(const float* part, const T* kv_b, const int* sel_count, \
                                                      float* out, int row0, int h, int dn, int dv, int r,    \
                                                      int splits) {                                          \
        mla_attend_combine_impl<T>(part, kv_b, sel_count, out, row0, h, dn, dv, r, splits);                  \
    }                                                                                                        \
    extern "C" __global__ void moe_gemv_grouped_##S(const float* x, int x_div, const int* order,              \
                                                    const int3* groups, const int* n_used, const T* w,          \
                                                    i64 expert_stride, float* y, int n_out, int k_in) {         \
        moe_gemv_grouped_impl<T>(x, x_div, order, groups, n_used, w, expert_stride, y, n_out, k_in);           \
    }                                                                                                        \
    extern "C" __global__ void gather_rows_##S(const float* x, const int* idx, T* out, int n) {              \
        gather_rows_impl<T>(x, idx, out, n);                                                                 \
    }
FOR_STORAGE_TYPES(GLM5_KERNELS)
