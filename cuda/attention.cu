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
                off_s[threadIdx.x] = p < key1 ? kv_row_offset(p, table, d, kvd) : -1;
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
    if (ns == 0) return;  // a streamed decode row: `attn_decode_*` wrote it already
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

// ---------------------------------------------------------------------------------------------
// Streaming decode attention (decode and short verification tiles), the split combine folded in.
// One block of 4 warps per work item = (tile of ≤ 16 query rows, kv head, key split); the split
// length follows the sequence's context and the SM count (src/backend/cuda/plan.rs), never the
// batch. Each K/V row is read once per kv head for all of the group's q heads, as 16-byte loads:
// HD/8 lanes hold one key row (8 elements each), so a warp reads 32/(HD/8) keys per load and the
// block's NS = 4·32/(HD/8) key streams each keep their own online softmax (scores in log2 units)
// over steps of U keys, the next step's loads in flight while one computes. The streams are
// merged in stream order; a tile with one split writes its normalised output directly, otherwise
// each block writes its partial and the last block of the tile to finish (atomic counter, reset
// by that block) merges the splits in split order. Which block comes last changes nothing: the arithmetic is fixed by the item.
#define DEC_THREADS 128
#define DEC_WARPS (DEC_THREADS / 32)
#define DEC_ROWS 4         // query rows per pass (one decode token of a GQA-4 group)
#define DEC_MAX_ROWS 16    // ROWS_PER_ITEM in plan.rs
#define DEC_MAX_SPLITS 64  // STREAM_MAX_SPLITS in plan.rs
#define DEC_MAX_TOKENS 16  // DECODE_MAX_TOKENS in plan.rs: most tokens of a sequence in a streamed step

// 8 consecutive K or V elements, raw until used (bf16: one 16-byte load; f32: two).
template <typename T> struct Kv8;
template <> struct Kv8<bf16> {
    uint4 a;
    __device__ __forceinline__ void load(const bf16* p) { a = *reinterpret_cast<const uint4*>(p); }
    __device__ __forceinline__ void zero() { a.x = a.y = a.z = a.w = 0u; }
    __device__ __forceinline__ void get(float* o) const {
        const unsigned w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            o[2 * j] = __uint_as_float(w[j] << 16);
            o[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
        }
    }
};
template <> struct Kv8<float> {
    float4 a, b;
    __device__ __forceinline__ void load(const float* p) {
        a = reinterpret_cast<const float4*>(p)[0];
        b = reinterpret_cast<const float4*>(p)[1];
    }
    __device__ __forceinline__ void zero() { a.x = a.y = a.z = a.w = b.x = b.y = b.z = b.w = 0.f; }
    __device__ __forceinline__ void get(float* o) const {
        o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
        o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
    }
};

// Loads from L2 (other blocks' partials of this launch: never from a possibly stale L1 line).
__device__ __forceinline__ float ld_l2(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float4 ld_l2x4(const float* p) {
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

// Issue the loads of one step's keys (U per stream, NS streams apart); keys past `key1` read
// nothing and hold zeros.
template <typename T, int U, int NS>
__device__ __forceinline__ void fetch_keys(int kb, int stream, int key1, const int* table, const AttnDims& d, int kvd,
                                           i64 kv_col, const T* k_cache, const T* v_cache, Kv8<T>* kr, Kv8<T>* vr,
                                           int* kp) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        kp[u] = kb + u * NS + stream;
        if (kp[u] < key1) {
            const i64 off = kv_row_offset(kp[u], table, d, kvd) + kv_col;
            kr[u].load(k_cache + off);
            vr[u].load(v_cache + off);
        } else {
            kr[u].zero();
            vr[u].zero();
        }
    }
}

template <typename T, int HD>
__device__ void attn_decode_impl(const int* items, const float* q, const T* k_cache, const T* v_cache,
                                 const int* tables, const int* table_off, const int* positions, AttnDims d,
                                 float* part_acc, float* part_ml, int* counters, T* out) {
    constexpr int LPK = HD / 8;                    // lanes per key row
    constexpr int KPW = 32 / LPK;                  // keys per warp per load
    constexpr int NS = DEC_WARPS * KPW;            // key streams per block
    constexpr int U = sizeof(T) == 2 ? 4 : 2;      // keys per stream per step (16-32 B each of K, V)
    constexpr int STEP = NS * U;
    __shared__ float st_acc[NS][DEC_ROWS][HD];
    __shared__ float st_m[NS][DEC_ROWS], st_l[NS][DEC_ROWS];
    __shared__ float w_s[DEC_MAX_ROWS][DEC_MAX_SPLITS], l_s[DEC_MAX_ROWS][DEC_MAX_SPLITS], sum_s[DEC_MAX_ROWS];
    __shared__ int last_s;

    const int* it = items + blockIdx.x * ITEM_INTS;
    const int seq = it[0], tok0 = it[1], ntok = it[2], kvh = it[3], key0 = it[4], key1 = it[5], split = it[6];
    const int nsplit = it[7];
    const int group = d.nh / d.nkv, rows = ntok * group, kvd = d.nkv * HD;
    const int* table = tables + table_off[seq];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int stream = warp * KPW + lane / LPK, c0 = (lane % LPK) * 8;
    const float sl2 = d.scale * 1.4426950408889634f;
    const i64 kv_col = (i64)kvh * HD + c0;

    // While the q/k/v kernel drains (programmatic dependent launch), load the first step's K/V
    // rows that no kernel of this step writes: a streamed tile's sequence has at most
    // DEC_MAX_TOKENS tokens in the step, none before positions[tok0] + 1 - DEC_MAX_TOKENS (the
    // positions, item list and block tables come from the host). Then wait for q and the new rows.
    pdl_launch_dependents();
    const int settled = positions[tok0] + 1 - DEC_MAX_TOKENS;
    Kv8<T> kr[U], vr[U];
    int kp[U];
    fetch_keys<T, U, NS>(key0, stream, min(key1, settled), table, d, kvd, kv_col, k_cache, v_cache, kr, vr, kp);
    pdl_wait();
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (kp[u] >= settled && kp[u] < key1) {
            const i64 off = kv_row_offset(kp[u], table, d, kvd) + kv_col;
            kr[u].load(k_cache + off);
            vr[u].load(v_cache + off);
        }
    }

    for (int pass0 = 0; pass0 < rows; pass0 += DEC_ROWS) {
        const int prow = min(DEC_ROWS, rows - pass0);  // uniform over the block
        float qv[DEC_ROWS][8], m[DEC_ROWS], l[DEC_ROWS], acc[DEC_ROWS][8];
        int qp[DEC_ROWS], lo[DEC_ROWS];
#pragma unroll
        for (int r = 0; r < DEC_ROWS; ++r) {
            qp[r] = -1;
            if (r < prow) {
                const int row = pass0 + r, tok = tok0 + row / group, head = kvh * group + row % group;
                load8(q + ((i64)tok * d.nh + head) * HD + c0, qv[r]);
                qp[r] = positions[tok];
            } else {
#pragma unroll
                for (int e = 0; e < 8; ++e) qv[r][e] = 0.f;
            }
            lo[r] = d.window > 0 ? qp[r] + 1 - d.window : 0;
            m[r] = -INFINITY;
            l[r] = 0.f;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[r][e] = 0.f;
        }
        // Two steps in flight: the next step's K/V loads are issued before this step computes.
        if (pass0 > 0) fetch_keys<T, U, NS>(key0, stream, key1, table, d, kvd, kv_col, k_cache, v_cache, kr, vr, kp);
        for (int kb = key0; kb < key1; kb += STEP) {
            Kv8<T> kn[U], vn[U];
            int np[U];
            fetch_keys<T, U, NS>(kb + STEP, stream, key1, table, d, kvd, kv_col, k_cache, v_cache, kn, vn, np);
            float s[DEC_ROWS][U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float kf[8];
                kr[u].get(kf);
#pragma unroll
                for (int r = 0; r < DEC_ROWS; ++r) {
                    s[r][u] = -INFINITY;
                    if (r >= prow) continue;  // block-uniform: the shuffles below see every lane
                    float dot = 0.f;
#pragma unroll
                    for (int e = 0; e < 8; ++e) dot = fmaf(qv[r][e], kf[e], dot);
#pragma unroll
                    for (int o = LPK / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
                    const bool valid = kp[u] < key1 && kp[u] <= qp[r] && kp[u] >= lo[r];
                    s[r][u] = valid ? dot * sl2 : -INFINITY;
                }
            }
#pragma unroll
            for (int r = 0; r < DEC_ROWS; ++r) {
                if (r >= prow) break;
                float mx = m[r];
#pragma unroll
                for (int u = 0; u < U; ++u) mx = fmaxf(mx, s[r][u]);
                const bool any = mx != -INFINITY;
                const float corr = any ? exp2f(m[r] - mx) : 1.f;
                l[r] *= corr;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][e] *= corr;
#pragma unroll
                for (int u = 0; u < U; ++u) s[r][u] = any ? exp2f(s[r][u] - mx) : 0.f;  // now weights
                if (any) m[r] = mx;
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float vf[8];
                vr[u].get(vf);
#pragma unroll
                for (int r = 0; r < DEC_ROWS; ++r) {
                    if (r >= prow) break;
                    l[r] += s[r][u];
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(s[r][u], vf[e], acc[r][e]);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                kr[u] = kn[u];
                vr[u] = vn[u];
                kp[u] = np[u];
            }
        }
        // Merge the streams in stream order.
#pragma unroll
        for (int r = 0; r < DEC_ROWS; ++r) {
#pragma unroll
            for (int e = 0; e < 8; ++e) st_acc[stream][r][c0 + e] = acc[r][e];
            if (lane % LPK == 0) {
                st_m[stream][r] = m[r];
                st_l[stream][r] = l[r];
            }
        }
        __syncthreads();
        for (int i = threadIdx.x; i < prow * HD; i += DEC_THREADS) {
            const int r = i / HD, c = i % HD;
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < NS; ++j) mx = fmaxf(mx, st_m[j][r]);
            float sum = 0.f, a = 0.f;
#pragma unroll
            for (int j = 0; j < NS; ++j) {
                const float ms = st_m[j][r];
                const float w = ms == -INFINITY ? 0.f : exp2f(ms - mx);
                sum = fmaf(st_l[j][r], w, sum);
                a = fmaf(st_acc[j][r][c], w, a);
            }
            const int row = pass0 + r, tok = tok0 + row / group, head = kvh * group + row % group;
            if (nsplit == 1) {
                out[((i64)tok * d.nh + head) * HD + c] = from_f<T>(a / sum);
            } else {
                const i64 pidx = ((i64)split * d.total_tokens + tok) * d.nh + head;
                part_acc[pidx * HD + c] = a;
                if (c == 0) {
                    part_ml[pidx * 2] = mx;
                    part_ml[pidx * 2 + 1] = sum;
                }
            }
        }
        __syncthreads();
    }
    if (nsplit == 1) return;

    // Fold in the combine: the tile's last block to finish merges every split.
    __threadfence();
    __syncthreads();
    int* ctr = counters + (i64)tok0 * d.nkv + kvh;
    if (threadIdx.x == 0) last_s = atomicAdd(ctr, 1) == nsplit - 1;
    __syncthreads();
    if (!last_s) return;
    __threadfence();
    const i64 stride = (i64)d.total_tokens * d.nh;  // partial rows per split
    for (int i = threadIdx.x; i < rows * nsplit; i += DEC_THREADS) {
        const int r = i / nsplit, sp = i % nsplit;
        const i64 pidx = sp * stride + (i64)(tok0 + r / group) * d.nh + kvh * group + r % group;
        w_s[r][sp] = ld_l2(part_ml + pidx * 2);
        l_s[r][sp] = ld_l2(part_ml + pidx * 2 + 1);
    }
    __syncthreads();
    if (threadIdx.x < rows) {
        const int r = threadIdx.x;
        float mx = -INFINITY;
        for (int sp = 0; sp < nsplit; ++sp) mx = fmaxf(mx, w_s[r][sp]);
        float sum = 0.f;
        for (int sp = 0; sp < nsplit; ++sp) {
            const float ms = w_s[r][sp];
            const float w = ms == -INFINITY ? 0.f : exp2f(ms - mx);
            sum = fmaf(l_s[r][sp], w, sum);
            w_s[r][sp] = w;
        }
        sum_s[r] = sum;
    }
    __syncthreads();
    constexpr int V4 = HD / 4;
    for (int i = threadIdx.x; i < rows * V4; i += DEC_THREADS) {
        const int r = i / V4, c = (i % V4) * 4;
        const i64 orow = (i64)(tok0 + r / group) * d.nh + kvh * group + r % group;
        const float* pa = part_acc + orow * HD + c;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma unroll 8
        for (int sp = 0; sp < nsplit; ++sp) {
            const float4 v = ld_l2x4(pa + sp * stride * HD);
            const float w = w_s[r][sp];
            a0 = fmaf(v.x, w, a0);
            a1 = fmaf(v.y, w, a1);
            a2 = fmaf(v.z, w, a2);
            a3 = fmaf(v.w, w, a3);
        }
        const float sum = sum_s[r];
        T* o = out + orow * HD + c;
        o[0] = from_f<T>(a0 / sum);
        o[1] = from_f<T>(a1 / sum);
        o[2] = from_f<T>(a2 / sum);
        o[3] = from_f<T>(a3 / sum);
    }
    if (threadIdx.x == 0) *ctr = 0;  // ready for the next launch (a replayed graph reuses it)
}

#define ATTN_DECODE_KERNEL(T, S, HD)                                                                          \
    extern "C" __global__ void __launch_bounds__(DEC_THREADS, 3) attn_decode_d##HD##_##S(                        \
        const int* items, const float* q, const T* kc, const T* vc, const int* tables, const int* toff,        \
        const int* pos, AttnDims d, float* pa, float* pm, int* counters, T* out) {                             \
        attn_decode_impl<T, HD>(items, q, kc, vc, tables, toff, pos, d, pa, pm, counters, out);               \
    }
#define ATTN_DECODE_KERNELS(T, S) ATTN_DECODE_KERNEL(T, S, 64) ATTN_DECODE_KERNEL(T, S, 128)
FOR_STORAGE_TYPES(ATTN_DECODE_KERNELS)
