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

// One block per token: the M·D stream values divided by their RMS (eps = rms_norm_eps).
extern "C" __global__ void hc_normalize(const float* x, float* xn, int md, float eps) {
    const float* xr = x + (i64)blockIdx.x * md;
    float ss = 0.f;
    for (int i = threadIdx.x; i < md; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    const float r = 1.0f / sqrtf(ss / (float)md + eps);
    float* o = xn + (i64)blockIdx.x * md;
    for (int i = threadIdx.x; i < md; i += blockDim.x) o[i] = xr[i] * r;
}

#define HC_MAX 8

// One block per token: from the projected map `mix` ((2+M)·M values) the pre weights, the post
// weights β and the Sinkhorn-normalised comb C (spec §2.6, the CPU's op order); the collapsed
// input Σ pre_s X_s, RMS-normalised with `norm`, goes to `u`; β and C to `hcw` ([M + M·M] per
// token).
extern "C" __global__ void hc_site(const float* x, const float* mix, const float* base, float s_pre, float s_post,
                                   float s_comb, const float* norm, float* u, float* hcw, int m, int d,
                                   float hc_eps, int iters, float eps) {
    __shared__ float pre[HC_MAX], comb[HC_MAX * HC_MAX];
    const int t = blockIdx.x, n = (2 + m) * m;
    const float* mx = mix + (i64)t * n;
    float* w = hcw + (i64)t * (m + m * m);
    if (threadIdx.x == 0) {
        for (int i = 0; i < m; ++i) pre[i] = sigmoidf_(mx[i] * s_pre + base[i]) + hc_eps;
        for (int i = 0; i < m; ++i) w[i] = 2.0f * sigmoidf_(mx[m + i] * s_post + base[m + i]);
        for (int k = 0; k < m * m; ++k) comb[k] = mx[2 * m + k] * s_comb + base[2 * m + k];
        for (int i = 0; i < m; ++i) {
            float* row = comb + i * m;
            float mxv = -INFINITY;
            for (int j = 0; j < m; ++j) mxv = fmaxf(mxv, row[j]);
            float sum = 0.f;
            for (int j = 0; j < m; ++j) {
                row[j] = expf(row[j] - mxv);
                sum += row[j];
            }
            for (int j = 0; j < m; ++j) row[j] = row[j] / sum + hc_eps;
        }
        // One column normalisation, then (iters − 1) row + column rounds, as the CPU.
        const int rounds = iters > 1 ? iters : 1;
        for (int it = 0; it < rounds; ++it) {
            if (it > 0) {
                for (int i = 0; i < m; ++i) {
                    float s = 0.f;
                    for (int j = 0; j < m; ++j) s += comb[i * m + j];
                    s += hc_eps;
                    for (int j = 0; j < m; ++j) comb[i * m + j] /= s;
                }
            }
            for (int j = 0; j < m; ++j) {
                float s = 0.f;
                for (int i = 0; i < m; ++i) s += comb[i * m + j];
                s += hc_eps;
                for (int i = 0; i < m; ++i) comb[i * m + j] /= s;
            }
        }
        for (int k = 0; k < m * m; ++k) w[m + k] = comb[k];
    }
    __syncthreads();
    const float* xr = x + (i64)t * m * d;
    float* ur = u + (i64)t * d;
    float ss = 0.f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float v = 0.f;
        for (int s = 0; s < m; ++s) v += pre[s] * xr[(i64)s * d + c];
        ur[c] = v;
        ss += v * v;
    }
    ss = block_sum(ss);
    const float r = 1.0f / sqrtf(ss / (float)d + eps);
    for (int c = threadIdx.x; c < d; c += blockDim.x) ur[c] = norm[c] * (ur[c] * r);
}

// One block per token: X'_j = β_j·y + Σ_i C_ij X_i (out must not alias x).
extern "C" __global__ void hc_expand(const float* x, const float* y, const float* hcw, float* out, int m, int d) {
    const int t = blockIdx.x;
    const float* w = hcw + (i64)t * (m + m * m);
    const float* xr = x + (i64)t * m * d;
    const float* yr = y + (i64)t * d;
    float* o = out + (i64)t * m * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
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
// verification checkpoints start (element offset into the checkpoint buffer, or -1).
struct KdaSeq {
    int row0, n, slot;
    i64 checkpoints;
};

// Grid (channel blocks, sequences). Each thread owns one of the 3Q channels: the causal conv over
// the slot's window of K−1 raw projections plus the token's own, SiLU, then the window shifts.
// During verification the window after every token but the last goes to the checkpoints.
extern "C" __global__ void kda_conv(const float* raw, float* conv, float* state, float* ckpt, const KdaSeq* seqs,
                                   const float* taps, int q3, int kw, i64 slot_stride, i64 conv_off) {
    const KdaSeq s = seqs[blockIdx.y];
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= q3) return;
    float* window = state + (i64)s.slot * slot_stride + conv_off;
    const float* tp = taps + (i64)ch * kw;
    for (int t = 0; t < s.n; ++t) {
        const float r = raw[(i64)(s.row0 + t) * q3 + ch];
        float acc = 0.f;
        for (int j = 0; j < kw - 1; ++j) acc += tp[j] * window[(i64)j * q3 + ch];
        acc += tp[kw - 1] * r;
        conv[(i64)(s.row0 + t) * q3 + ch] = siluf_(acc);
        if (kw > 1) {
            for (int j = 0; j + 1 < kw - 1; ++j) window[(i64)j * q3 + ch] = window[(i64)(j + 1) * q3 + ch];
            window[(i64)(kw - 2) * q3 + ch] = r;
        }
        if (s.checkpoints >= 0 && t + 1 < s.n) {
            float* img = ckpt + s.checkpoints + (i64)t * slot_stride + conv_off;
            for (int j = 0; j < kw - 1; ++j) img[(i64)j * q3 + ch] = window[(i64)j * q3 + ch];
        }
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
                                        float* ckpt, const KdaSeq* seqs, float* core, int q, int heads,
                                        i64 slot_stride, i64 state_off, int has_lb, float lb, float eps, int hd) {
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
        if (live && s.checkpoints >= 0 && t + 1 < s.n) {
            float* img = ckpt + s.checkpoints + (i64)t * slot_stride + state_off + (i64)h * hd * hd;
            for (int i = 0; i < hd; ++i) img[(i64)i * hd + j] = S[(i64)i * hd + j];
        }
        __syncthreads();
    }
}

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

// One block per batch row: the DSA selection. Scores of the complete pools (ReLU'd per indexer
// head, weighted by the head weights scaled by H_I^-1/2), the best `budget` kept (ties to the
// earlier pool, as the CPU's stable order), expanded to positions in ascending order plus the
// raw tail of the query's own incomplete pool. `scores` has `2·max_pools` floats per row (scores,
// then kept flags); `sel` has `max_sel` ints per row and `sel_count` the number used.
extern "C" __global__ void dsa_select(const float* qi, const float* kgw, const float* kv, const DsaRow* rows,
                                      const int* tables, float* scores, int* sel, int* sel_count, int block_size,
                                      int token_stride, int ix_off, int hi, int di, int kgw_width, int pool,
                                      int budget, int tail, int max_pools, int max_sel) {
    const DsaRow row = rows[blockIdx.x];
    const int* table = tables + row.table;
    const int complete = (row.pos + 1) / pool;
    float* sc = scores + (i64)blockIdx.x * 2 * max_pools;
    float* kept = sc + max_pools;
    int* out = sel + (i64)blockIdx.x * max_sel;
    const float* q = qi + (i64)blockIdx.x * hi * di;
    const float* wraw = kgw + (i64)blockIdx.x * kgw_width + 2 * di;
    const float wscale = 1.0f / sqrtf((float)hi), qscale = 1.0f / sqrtf((float)di);
    const bool sparse = complete > budget;
    if (sparse) {
        for (int p = threadIdx.x; p < complete; p += blockDim.x) {
            const float* key =
                kv + record_offset(table, p * pool + pool - 1, block_size, token_stride) + ix_off + 2 * di;
            float total = 0.f;
            for (int hh = 0; hh < hi; ++hh) {
                float dot = 0.f;
                for (int c = 0; c < di; ++c) dot += q[(i64)hh * di + c] * key[c];
                total += wraw[hh] * wscale * fmaxf(dot * qscale, 0.f);
            }
            sc[p] = total;
        }
        __syncthreads();
        // Rank of each pool under (score descending, index ascending); keep ranks < budget.
        for (int p = threadIdx.x; p < complete; p += blockDim.x) {
            const float v = sc[p];
            int rank = 0;
            for (int o = 0; o < complete && rank < budget; ++o) rank += (sc[o] > v || (sc[o] == v && o < p));
            kept[p] = rank < budget ? 1.f : 0.f;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        int n = 0;
        if (sparse) {
            for (int p = 0; p < complete; ++p)
                if (kept[p] != 0.f)
                    for (int x = 0; x < pool; ++x) out[n++] = p * pool + x;
        } else {
            for (int x = 0; x < complete * pool; ++x) out[n++] = x;
        }
        if (tail)
            for (int x = complete * pool; x <= row.pos; ++x) out[n++] = x;
        sel_count[blockIdx.x] = n;
    }
}

// Grid (heads, batch rows), 256 threads: attention in the absorbed form over the selected
// latents. q̃ = W^Kᵀ q_h (r values, shared), scores q̃·c_τ / sqrt(d_n) per selected position (one
// warp each, in shared memory), softmax, ĉ = Σ_τ p_τ c_τ in ascending position order, o = W^V ĉ.
// Dynamic shared memory: 2·r + max_sel floats.
template <typename T>
__device__ void mla_attend_impl(const float* q, const T* kv_b, const float* kv, const DsaRow* rows,
                                const int* tables, const int* sel, const int* sel_count, float* out, int block_size,
                                int token_stride, int latent_off, int h, int dn, int dv, int r, int max_sel) {
    extern __shared__ float sh[];
    float* qt = sh;
    float* ctx = sh + r;
    float* sc = sh + 2 * r;
    const int hh = blockIdx.x, b = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5,
              nwarps = blockDim.x >> 5;
    const DsaRow row = rows[b];
    const int* table = tables + row.table;
    const int n = sel_count[b];
    const int* ps = sel + (i64)b * max_sel;
    float* o = out + (i64)b * h * dv + (i64)hh * dv;
    if (n == 0) {
        for (int jj = threadIdx.x; jj < dv; jj += blockDim.x) o[jj] = 0.f;
        return;
    }
    const T* wk = kv_b + (i64)hh * (dn + dv) * r;
    const T* wv = wk + (i64)dn * r;
    const float* qh = q + (i64)b * h * dn + (i64)hh * dn;
    for (int a = threadIdx.x; a < r; a += blockDim.x) {
        float v = 0.f;
        for (int i = 0; i < dn; ++i) v += qh[i] * to_f(wk[(i64)i * r + a]);
        qt[a] = v;
    }
    __syncthreads();
    const float scale = 1.0f / sqrtf((float)dn);
    for (int x = warp; x < n; x += nwarps) {
        const float* c = kv + record_offset(table, ps[x], block_size, token_stride) + latent_off;
        float dot = 0.f;
        for (int a = lane; a < r; a += 32) dot += c[a] * qt[a];
        dot = warp_sum(dot);
        if (lane == 0) sc[x] = dot * scale;
    }
    __syncthreads();
    float mx = -INFINITY;
    for (int x = threadIdx.x; x < n; x += blockDim.x) mx = fmaxf(mx, sc[x]);
    mx = block_max(mx);
    float part = 0.f;
    for (int x = threadIdx.x; x < n; x += blockDim.x) {
        const float e = expf(sc[x] - mx);
        sc[x] = e;
        part += e;
    }
    const float sum = block_sum(part);
    for (int a = threadIdx.x; a < r; a += blockDim.x) {
        float v = 0.f;
        for (int x = 0; x < n; ++x) {
            const float* c = kv + record_offset(table, ps[x], block_size, token_stride) + latent_off;
            v += sc[x] / sum * c[a];
        }
        ctx[a] = v;
    }
    __syncthreads();
    for (int jj = warp; jj < dv; jj += nwarps) {
        float v = 0.f;
        for (int a = lane; a < r; a += 32) v += to_f(wv[(i64)jj * r + a]) * ctx[a];
        v = warp_sum(v);
        if (lane == 0) o[jj] = v;
    }
}

// ---------------------------------------------------------------------------------------------
// MoE

// One block per token (thread 0 does the work; dynamic shared memory 3·E floats): sigmoid scores,
// selection by score + correction bias, groups ranked by the sum of their two best, the best
// `topk_group` groups kept, the top k experts of those (ties to the lower index), sorted by
// expert; weights normalised over the chosen scores (when `norm`) and scaled. Writes the chosen
// experts and weights ([rows, k] each).
extern "C" __global__ void moe_route(const float* logits, const float* bias, int* experts, float* weights, int e,
                                     int n_group, int topk_group, int k, int norm, float scaling) {
    if (threadIdx.x != 0) return;
    extern __shared__ float sh[];
    float* score = sh;
    float* choice = sh + e;
    float* gscore = sh + 2 * e;  // n_group ≤ e
    const float* l = logits + (i64)blockIdx.x * e;
    for (int i = 0; i < e; ++i) {
        score[i] = sigmoidf_(l[i]);
        choice[i] = score[i] + bias[i];
    }
    const int per = e / n_group;
    for (int g = 0; g < n_group; ++g) {
        // Two best of the group, the first maximum winning ties.
        int b1 = -1;
        for (int i = 0; i < per; ++i)
            if (b1 < 0 || choice[g * per + i] > choice[g * per + b1]) b1 = i;
        int b2 = -1;
        for (int i = 0; i < per; ++i)
            if (i != b1 && (b2 < 0 || choice[g * per + i] > choice[g * per + b2])) b2 = i;
        gscore[g] = choice[g * per + b1] + (b2 >= 0 ? choice[g * per + b2] : 0.f);
    }
    // Keep the best topk_group groups: mark dropped groups' experts with −inf in `choice`.
    for (int g = 0; g < n_group; ++g) {
        int rank = 0;
        for (int o = 0; o < n_group; ++o) rank += (gscore[o] > gscore[g] || (gscore[o] == gscore[g] && o < g));
        if (rank >= topk_group)
            for (int i = 0; i < per; ++i) choice[g * per + i] = -INFINITY;
    }
    int* ex = experts + (i64)blockIdx.x * k;
    float* wt = weights + (i64)blockIdx.x * k;
    int chosen = 0;
    for (int i = 0; i < e && chosen < k; ++i) {
        int rank = 0;
        for (int o = 0; o < e && rank < k; ++o) rank += (choice[o] > choice[i] || (choice[o] == choice[i] && o < i));
        if (rank < k) ex[chosen++] = i;  // ascending expert order
    }
    float denom = 1.f;
    if (norm) {
        denom = 0.f;
        for (int s = 0; s < chosen; ++s) denom += score[ex[s]];
        denom += 1e-20f;
    }
    for (int s = 0; s < chosen; ++s) wt[s] = score[ex[s]] / denom * scaling;
}

// Routed-expert GEMV for small batches, reading only the chosen experts' rows. Grid
// (output chunks, pairs); pair p = row·k + slot uses expert experts[p] and input row p / x_div
// of `x` (x_div = k: the token's input for gate/up; 1: the pair's activation for down). One warp
// per output element, each lane over 16-byte pieces of the row, f32 accumulation.
template <typename T>
__device__ void moe_gemv_impl(const float* x, int x_div, const int* experts, const T* w, i64 expert_stride,
                              float* y, int n_out, int k_in) {
    const int p = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const T* we = w + (i64)experts[p] * expert_stride;
    const float* xr = x + (i64)(p / x_div) * k_in;
    // 16-byte loads (8 bf16 or 4 f32 per lane) when rows allow it: a warp then reads 512 B of a
    // row per load instead of 64, which the scalar loop left latency-bound at ~13 % of bandwidth.
    constexpr int V = 16 / sizeof(T);
    const bool vec = k_in % (32 * V) == 0 && ((unsigned long long)we & 15) == 0 && ((unsigned long long)xr & 15) == 0;
    for (int o = blockIdx.x * nwarps + warp; o < n_out; o += gridDim.x * nwarps) {
        const T* wr = we + (i64)o * k_in;
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
        acc = warp_sum(acc);
        if (lane == 0) y[(i64)p * n_out + o] = acc;
    }
}

// y[row] += Σ_slot weight·expert_out in slot (ascending expert) order; y holds the shared
// expert's output.
extern "C" __global__ void moe_combine(const float* slot_out, const float* weights, float* y, int k, int d) {
    const int row = blockIdx.x;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
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
    extern "C" __global__ void mla_attend_##S(const float* q, const T* kv_b, const float* kv,                \
                                              const DsaRow* rows, const int* tables, const int* sel,         \
                                              const int* sel_count, float* out, int block_size,              \
                                              int token_stride, int latent_off, int h, int dn, int dv, int r, \
                                              int max_sel) {                                                 \
        mla_attend_impl<T>(q, kv_b, kv, rows, tables, sel, sel_count, out, block_size, token_stride,         \
                           latent_off, h, dn, dv, r, max_sel);                                               \
    }                                                                                                        \
    extern "C" __global__ void moe_gemv_##S(const float* x, int x_div, const int* experts, const T* w,       \
                                            i64 expert_stride, float* y, int n_out, int k_in) {              \
        moe_gemv_impl<T>(x, x_div, experts, w, expert_stride, y, n_out, k_in);                               \
    }                                                                                                        \
    extern "C" __global__ void gather_rows_##S(const float* x, const int* idx, T* out, int n) {              \
        gather_rows_impl<T>(x, idx, out, n);                                                                 \
    }
FOR_STORAGE_TYPES(GLM5_KERNELS)
