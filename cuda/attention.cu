// Paged causal attention (GQA, ragged batches, sliding window) in two passes:
//  1. `attn_partial`: one block per work item = (sequence, kv head, tile of query tokens, key
//     split). The block streams the split's keys through shared memory in tiles of KT positions
//     and keeps an online softmax per query row (row = token × q head of the kv head's group);
//     it writes the unnormalised partial (max, sum, acc) of every row.
//  2. `attn_combine`: merges a row's splits in split order and writes the normalised output.
// Split boundaries are fixed multiples of a split length chosen from the sequence's own step
// (decode and prefill differ), tiles start at fixed offsets inside a split, and masked keys add
// exact zeros: a row's result never depends on which other rows or sequences share the launch.

#define KT 32          // keys per shared-memory tile (one per lane in the score stage)
#define ROWS_PER_WARP 4
#define WARPS 4
#define ROWS_PER_PASS (ROWS_PER_WARP * WARPS)

struct AttnDims {
    i64 block_stride;  // elements from one KV block to the next (all layers' K and V)
    int nh, nkv, hd, block_size, window;  // window 0 = no sliding window
    int total_tokens;
    float scale;
};

__device__ __forceinline__ void load8(const bf16* p, float* o) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        o[2 * j] = __uint_as_float(w[j] << 16);
        o[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
}

__device__ __forceinline__ void load8(const float* p, float* o) {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
    o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}

// Work item: seq, first token (global index), token count, kv head, key begin, key end, split.
#define ITEM_INTS 8

template <typename T, int C>
__device__ void attn_partial_impl(const int* items, const float* q, const T* k_cache, const T* v_cache,
                                  const int* tables, const int* table_off, const int* positions, AttnDims d,
                                  float* part_acc, float* part_ml) {
    extern __shared__ float smem[];
    const int hd = d.hd, ld = hd + 1;
    float* ks = smem;                      // [KT][hd + 1]
    float* vs = ks + KT * ld;              // [KT][hd + 1]
    float* qs = vs + KT * ld;              // [ROWS_PER_PASS][hd]
    __shared__ i64 off_s[KT];
    __shared__ int pos_s[ROWS_PER_PASS];

    const int* it = items + blockIdx.x * ITEM_INTS;
    const int seq = it[0], tok0 = it[1], ntok = it[2], kvh = it[3], key0 = it[4], key1 = it[5], split = it[6];
    const int group = d.nh / d.nkv, rows = ntok * group, kvd = d.nkv * hd;
    const int* table = tables + table_off[seq];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

    for (int pass0 = 0; pass0 < rows; pass0 += ROWS_PER_PASS) {
        const int prow = min(ROWS_PER_PASS, rows - pass0);
        __syncthreads();
        for (int i = threadIdx.x; i < ROWS_PER_PASS * hd; i += blockDim.x) {
            const int r = i / hd, c = i % hd;
            float v = 0.f;
            if (r < prow) {
                const int row = pass0 + r, tok = tok0 + row / group, head = kvh * group + row % group;
                v = q[((long long)tok * d.nh + head) * hd + c];
            }
            qs[i] = v;
        }
        if (threadIdx.x < ROWS_PER_PASS) {
            const int r = threadIdx.x;
            pos_s[r] = r < prow ? positions[tok0 + (pass0 + r) / group] : -1;
        }
        // Rows r·WARPS + warp of this pass belong to this warp; `nr` of them are real.
        const int nr = prow > warp ? (prow - warp + WARPS - 1) / WARPS : 0;
        float m[ROWS_PER_WARP], l[ROWS_PER_WARP], acc[ROWS_PER_WARP][C];
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            m[r] = -INFINITY;
            l[r] = 0.f;
#pragma unroll
            for (int c = 0; c < C; ++c) acc[r][c] = 0.f;
        }
        for (int kt0 = key0; kt0 < key1; kt0 += KT) {
            __syncthreads();
            if (threadIdx.x < KT) {
                const int p = kt0 + threadIdx.x;
                off_s[threadIdx.x] = p < key1 ? table[p / d.block_size] * d.block_stride + (i64)(p % d.block_size) * kvd : -1;
            }
            __syncthreads();
            if ((hd & 7) == 0) {
                // 16-byte loads of 8 elements (rows start at multiples of 8 elements).
                const int vec = hd >> 3;
                for (int i = threadIdx.x; i < KT * vec; i += blockDim.x) {
                    const int k = i / vec, c = (i - k * vec) * 8;
                    const i64 row = off_s[k];
                    float kv[8], vv[8];
                    if (row >= 0) {
                        load8(k_cache + row + kvh * hd + c, kv);
                        load8(v_cache + row + kvh * hd + c, vv);
                    } else {
#pragma unroll
                        for (int j = 0; j < 8; ++j) kv[j] = vv[j] = 0.f;
                    }
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        ks[k * ld + c + j] = kv[j];
                        vs[k * ld + c + j] = vv[j];
                    }
                }
            } else {
                for (int i = threadIdx.x; i < KT * hd; i += blockDim.x) {
                    const int k = i / hd, c = i % hd;
                    const i64 row = off_s[k];
                    float kv = 0.f, vv = 0.f;
                    if (row >= 0) {
                        const i64 off = row + kvh * hd + c;
                        kv = to_f(k_cache[off]);
                        vv = to_f(v_cache[off]);
                    }
                    ks[k * ld + c] = kv;
                    vs[k * ld + c] = vv;
                }
            }
            __syncthreads();
            const int p = kt0 + lane;
            float s[ROWS_PER_WARP];
#pragma unroll
            for (int r = 0; r < ROWS_PER_WARP; ++r) s[r] = 0.f;
            const float* kr = ks + lane * ld;
#pragma unroll 8
            for (int c = 0; c < hd; ++c) {
                const float kv = kr[c];
#pragma unroll
                for (int r = 0; r < ROWS_PER_WARP; ++r)
                    if (r < nr) s[r] += qs[(r * WARPS + warp) * hd + c] * kv;
            }
            float pr[ROWS_PER_WARP];
#pragma unroll
            for (int r = 0; r < ROWS_PER_WARP; ++r) {
                const int qp = pos_s[r * WARPS + warp];
                const int lo = d.window > 0 ? qp + 1 - d.window : 0;
                const bool valid = qp >= 0 && p < key1 && p <= qp && p >= lo;
                const float sc = valid ? s[r] * d.scale : -INFINITY;
                const float tmax = warp_max(sc);
                pr[r] = 0.f;
                if (r >= nr || tmax == -INFINITY) continue;  // every key of this tile is masked for the row
                const float nm = fmaxf(m[r], tmax);
                const float corr = expf(m[r] - nm);
                pr[r] = valid ? expf(sc - nm) : 0.f;
                l[r] = l[r] * corr + warp_sum(pr[r]);
                m[r] = nm;
#pragma unroll
                for (int c = 0; c < C; ++c) acc[r][c] *= corr;
            }
#pragma unroll 4
            for (int k = 0; k < KT; ++k) {
                const float* vr = vs + k * ld;
                float vv[C];
#pragma unroll
                for (int c = 0; c < C; ++c) vv[c] = (lane + 32 * c) < hd ? vr[lane + 32 * c] : 0.f;
#pragma unroll
                for (int r = 0; r < ROWS_PER_WARP; ++r) {
                    if (r >= nr) break;
                    const float pk = __shfl_sync(0xffffffffu, pr[r], k);
#pragma unroll
                    for (int c = 0; c < C; ++c) acc[r][c] += pk * vv[c];
                }
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            const int pr_ = r * WARPS + warp;
            if (pr_ >= prow) continue;
            const int row = pass0 + pr_, tok = tok0 + row / group, head = kvh * group + row % group;
            const long long pidx = ((long long)split * d.total_tokens + tok) * d.nh + head;
#pragma unroll
            for (int c = 0; c < C; ++c)
                if (lane + 32 * c < hd) part_acc[pidx * hd + lane + 32 * c] = acc[r][c];
            if (lane == 0) {
                part_ml[pidx * 2] = m[r];
                part_ml[pidx * 2 + 1] = l[r];
            }
        }
    }
}

// One block per (token, head), one thread per head dimension. The splits' maxima and weights
// are read in parallel (a decode step at 8k context has 128 splits, and a loop of dependent
// loads over them cost more than the attention itself); the weighted sums still run in split
// order, so the result is the same as a sequential merge.
#define COMBINE_CHUNK 128
template <typename T>
__device__ void attn_combine_impl(const float* part_acc, const float* part_ml, const int* splits, T* out,
                                  AttnDims d) {
    __shared__ float w_s[COMBINE_CHUNK], l_s[COMBINE_CHUNK], red[32];
    const int tok = blockIdx.x, head = blockIdx.y, c = threadIdx.x;
    const int ns = splits[tok];
    const long long row = (long long)tok * d.nh + head, stride = (long long)d.total_tokens * d.nh;
    float mx = -INFINITY;
    for (int s = threadIdx.x; s < ns; s += blockDim.x) mx = fmaxf(mx, part_ml[(s * stride + row) * 2]);
    mx = warp_max(mx);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
    __syncthreads();
    mx = -INFINITY;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) mx = fmaxf(mx, red[i]);
    float sum = 0.f, acc = 0.f;
    for (int s0 = 0; s0 < ns; s0 += COMBINE_CHUNK) {
        const int n = min(COMBINE_CHUNK, ns - s0);
        __syncthreads();
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const long long pidx = (s0 + j) * stride + row;
            w_s[j] = expf(part_ml[pidx * 2] - mx);
            l_s[j] = part_ml[pidx * 2 + 1];
        }
        __syncthreads();
        const float* pa = part_acc + ((long long)s0 * stride + row) * d.hd + c;
#pragma unroll 16
        for (int j = 0; j < n; ++j) {
            sum += l_s[j] * w_s[j];
            if (c < d.hd) acc += pa[(long long)j * stride * d.hd] * w_s[j];
        }
    }
    if (c < d.hd) out[row * d.hd + c] = from_f<T>(acc / sum);
}

#define ATTN_KERNELS(T, S)                                                                                     \
    extern "C" __global__ void __launch_bounds__(128) attn_partial_c1_##S(                                    \
        const int* items, const float* q, const T* kc, const T* vc, const int* tables, const int* toff,        \
        const int* pos, AttnDims d, float* pa, float* pm) {                                                    \
        attn_partial_impl<T, 1>(items, q, kc, vc, tables, toff, pos, d, pa, pm);                               \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_partial_c2_##S(                                    \
        const int* items, const float* q, const T* kc, const T* vc, const int* tables, const int* toff,        \
        const int* pos, AttnDims d, float* pa, float* pm) {                                                    \
        attn_partial_impl<T, 2>(items, q, kc, vc, tables, toff, pos, d, pa, pm);                               \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_partial_c4_##S(                                    \
        const int* items, const float* q, const T* kc, const T* vc, const int* tables, const int* toff,        \
        const int* pos, AttnDims d, float* pa, float* pm) {                                                    \
        attn_partial_impl<T, 4>(items, q, kc, vc, tables, toff, pos, d, pa, pm);                               \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attn_partial_c8_##S(                                    \
        const int* items, const float* q, const T* kc, const T* vc, const int* tables, const int* toff,        \
        const int* pos, AttnDims d, float* pa, float* pm) {                                                    \
        attn_partial_impl<T, 8>(items, q, kc, vc, tables, toff, pos, d, pa, pm);                               \
    }                                                                                                          \
    extern "C" __global__ void attn_combine_##S(const float* pa, const float* pm, const int* splits, T* out,   \
                                                AttnDims d) {                                                  \
        attn_combine_impl<T>(pa, pm, splits, out, d);                                                          \
    }
FOR_STORAGE_TYPES(ATTN_KERNELS)
