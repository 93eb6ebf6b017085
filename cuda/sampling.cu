// Logits → token on the device, so only ids cross to the host. `argmax_rows`: greedy, the
// lowest index among equal maxima (as the host sampler picks), one block per logits row.
extern "C" __global__ void argmax_rows(const float* logits, int vocab, int* out) {
    const float* row = logits + (long long)blockIdx.x * vocab;
    float best = -INFINITY;
    int idx = 0x7fffffff;
    // Eight loads in flight per thread before comparing (one block reads the whole row).
    for (int i0 = threadIdx.x; i0 < vocab; i0 += 8 * blockDim.x) {
        float v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = i0 + u * blockDim.x;
            v[u] = i < vocab ? row[i] : -INFINITY;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int i = i0 + u * blockDim.x;
            if (i < vocab && (v[u] > best || (v[u] == best && i < idx))) { best = v[u]; idx = i; }
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
    }
    __shared__ float sb[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sb[warp] = best; si[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        best = lane < nw ? sb[lane] : -INFINITY;
        idx = lane < nw ? si[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
            if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
        }
        if (lane == 0) out[blockIdx.x] = idx == 0x7fffffff ? 0 : idx;
    }
}

// ---------------------------------------------------------------------------------------------
// `sample_rows`: the host sampling pipeline (src/sampling/pipeline.rs) for one logits row per
// block, so only ids (and, when asked, logprobs) cross to the host. Same order of operations:
// logit bias -> repetition -> presence/frequency -> greedy argmax | temperature -> top-k -> top-p
// -> min-p -> inverse-CDF draw over ascending ids with the host's `uniform(seed, step)` (passed
// in). Every float op the host does in f32 is written with `_rn` intrinsics so NVRTC cannot
// contract it into an FMA: adjusted logits and weights are bitwise the host's. Sums are f64 like
// the host's but in a different (fixed) order, so a draw can differ only where the CDF boundary
// lies within that rounding. Every reduction has a fixed shape: the same row gives the same
// token whatever else the step holds. Blocks are SAMPLE_THREADS threads; passes that only reduce
// read the row strided (coalesced); the draw's prefix and the top-p tie ranks need id order, so
// there thread t owns the contiguous ids [t*chunk, (t+1)*chunk).

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define SPEC_WORDS 20
#define SEARCH_WAYS 16

// Per-row spec words (packed by src/backend/cuda/sample.rs; floats as bits).
#define S_ROW 0        // logits row index in the step's logits buffer
#define S_GREEDY 1     // 1: argmax of the adjusted logits
#define S_TOP_K 2      // 0: off (also off when >= vocab)
#define S_INV_T 3      // f32 1 / temperature
#define S_TOP_P 4      // f32, >= 1: off
#define S_MIN_P 5      // f32, <= 0: off
#define S_REP 6        // f32 repetition penalty
#define S_PRESENCE 7   // f32
#define S_FREQUENCY 8  // f32
#define S_UNIFORM 9    // f32 uniform(seed, step)
#define S_BIAS_OFF 10  // bias entries: (id, f32 bits) pairs at hist[off..off + 2n]
#define S_BIAS_N 11
#define S_SEEN_OFF 12  // distinct prompt + output ids at hist[off..off + n]
#define S_SEEN_N 13
#define S_OUT_OFF 14   // (id, count) pairs of output tokens at hist[off..off + 2n]
#define S_OUT_N 15
#define S_LOGPROBS 16  // -1: none; n >= 0: chosen logprob + top n

__device__ __forceinline__ float spec_f(const int* s, int i) { return __int_as_float(s[i]); }

// The host's `exp_f32` (Cephes expf), op for op.
__device__ __forceinline__ float host_exp(float x) {
    const float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
    const float ROUND = 12582912.0f;
    const unsigned ROUND_BITS = 0x4B400000u;
    const bool underflow = x < -87.0f;
    const float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float t = __fadd_rn(__fmul_rn(xc, LOG2E), ROUND);
    const float n = __fsub_rn(t, ROUND);
    const float r = __fsub_rn(__fsub_rn(xc, __fmul_rn(n, LN2_HI)), __fmul_rn(n, LN2_LO));
    float p = 1.9875691e-4f;
    p = __fadd_rn(__fmul_rn(p, r), 1.3981999e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 8.333452e-3f);
    p = __fadd_rn(__fmul_rn(p, r), 4.1665796e-2f);
    p = __fadd_rn(__fmul_rn(p, r), 1.6666665e-1f);
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    const float y = __fadd_rn(__fadd_rn(__fmul_rn(__fmul_rn(p, r), r), r), 1.0f);
    const float scale = __uint_as_float((__float_as_uint(t) - ROUND_BITS + 127u) << 23);
    const unsigned keep = underflow ? 0u : 0xffffffffu;
    return __uint_as_float(__float_as_uint(__fmul_rn(y, scale)) & keep);
}

// The host's `weight`: exp((min(x, FLT_MAX) - max) * inv_t), 0 for NaN.
__device__ __forceinline__ float host_weight(float x, float mx, float inv_t) {
    if (isnan(x)) return 0.0f;
    const float z = __fmul_rn(__fsub_rn(fminf(x, 3.402823466e38f), mx), inv_t);
    if (isnan(z)) return 0.0f;
    return host_exp(z);
}

// Float -> u32 whose unsigned order is the float order (-0 folded onto +0, as the host's
// partial_cmp treats them).
__device__ __forceinline__ unsigned order_key(float x) {
    const unsigned b = __float_as_uint(x == 0.0f ? 0.0f : x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Block reductions with a fixed shape (deterministic).
__device__ double block_sum_d(double v, double* sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = sh[lane];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) sh[32] = v;
    }
    __syncthreads();
    return sh[32];
}

__device__ long long block_sum_ll(long long v, long long* sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = sh[lane];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) sh[32] = v;
    }
    __syncthreads();
    return sh[32];
}

__device__ float block_max_f(float v, float* sh) {
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = sh[lane];
        for (int o = 16; o > 0; o >>= 1) {
            const float w = __shfl_xor_sync(0xffffffffu, v, o);
            v = w > v ? w : v;
        }
        if (lane == 0) sh[32] = v;
    }
    __syncthreads();
    return sh[32];
}

// Best (value desc, id asc) pair over the block; NaN values never win.
__device__ void block_best(float& v, int& id, float* shv, int* shi) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, id, o);
        if (ov > v || (ov == v && oi < id)) { v = ov; id = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) { shv[warp] = v; shi[warp] = id; }
    __syncthreads();
    if (warp == 0) {
        v = shv[lane]; id = shi[lane];
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, v, o);
            const int oi = __shfl_xor_sync(0xffffffffu, id, o);
            if (ov > v || (ov == v && oi < id)) { v = ov; id = oi; }
        }
        if (lane == 0) { shv[32] = v; shi[32] = id; }
    }
    __syncthreads();
    v = shv[32]; id = shi[32];
    __syncthreads();
}

// Exclusive prefix over threads (thread order = id order) of a per-thread f64 value.
__device__ double block_exclusive_d(double v, double* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    double inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        const double u = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += u;
    }
    __syncthreads();
    if (lane == 31) sh[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        double w = sh[lane], winc = w;
        for (int o = 1; o < 32; o <<= 1) {
            const double u = __shfl_up_sync(0xffffffffu, winc, o);
            if (lane >= o) winc += u;
        }
        sh[lane] = winc - w;  // exclusive over warps
    }
    __syncthreads();
    const double out = sh[warp] + (inc - v);
    __syncthreads();
    return out;
}

__device__ long long block_exclusive_ll(long long v, long long* sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    long long inc = v;
    for (int o = 1; o < 32; o <<= 1) {
        const long long u = __shfl_up_sync(0xffffffffu, inc, o);
        if (lane >= o) inc += u;
    }
    __syncthreads();
    if (lane == 31) sh[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        long long w = sh[lane], winc = w;
        for (int o = 1; o < 32; o <<= 1) {
            const long long u = __shfl_up_sync(0xffffffffu, winc, o);
            if (lane >= o) winc += u;
        }
        sh[lane] = winc - w;
    }
    __syncthreads();
    const long long out = sh[warp] + (inc - v);
    __syncthreads();
    return out;
}

// First index of the largest non-NaN value (the host's `argmax_or_zero`: all -inf -> the first
// -inf, all NaN -> 0).
__device__ int block_argmax(const float* x, int vocab, float* shv, int* shi) {
    float best = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
        const float v = x[i];
        if (v > best || (v == best && i < idx)) { best = v; idx = i; }
    }
    block_best(best, idx, shv, shi);
    return idx == 0x7fffffff ? 0 : idx;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_rows(const float* logits, int vocab, float* work_all, const int* specs, const int* hist,
            int max_top, int* out_token, float* out_logprob, int* out_top_id, float* out_top_lp) {
    __shared__ double shd[33];
    __shared__ long long shl[33 * SEARCH_WAYS];
    __shared__ float shf[33];
    __shared__ int shi[33];
    __shared__ int token_sh;
    const int* s = specs + blockIdx.x * SPEC_WORDS;
    const float* raw = logits + (long long)s[S_ROW] * vocab;
    float* w = work_all + (long long)blockIdx.x * vocab;
    const int chunk = (vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int lo = min(vocab, (int)threadIdx.x * chunk), hi = min(vocab, lo + chunk);
    const float FMAX = 3.402823466e38f;

    // 1. Adjusted logits: bias (in list order: an id listed twice gets both), repetition over the
    //    distinct seen ids, presence/frequency over the distinct output ids.
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) w[i] = raw[i];
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int j = 0; j < s[S_BIAS_N]; ++j) {
            const int id = hist[s[S_BIAS_OFF] + 2 * j];
            if (id >= 0 && id < vocab) w[id] = __fadd_rn(w[id], __int_as_float(hist[s[S_BIAS_OFF] + 2 * j + 1]));
        }
    }
    __syncthreads();
    const float rep = spec_f(s, S_REP);
    if (rep != 1.0f) {
        for (int j = threadIdx.x; j < s[S_SEEN_N]; j += SAMPLE_THREADS) {
            const int id = hist[s[S_SEEN_OFF] + j];
            if (id >= 0 && id < vocab) {
                const float x = w[id];
                w[id] = x > 0.0f ? __fdiv_rn(x, rep) : __fmul_rn(x, rep);
            }
        }
    }
    __syncthreads();
    const float pres = spec_f(s, S_PRESENCE), freq = spec_f(s, S_FREQUENCY);
    if (pres != 0.0f || freq != 0.0f) {
        for (int j = threadIdx.x; j < s[S_OUT_N]; j += SAMPLE_THREADS) {
            const int id = hist[s[S_OUT_OFF] + 2 * j];
            const int count = hist[s[S_OUT_OFF] + 2 * j + 1];
            if (id >= 0 && id < vocab) w[id] = __fsub_rn(w[id], __fadd_rn(__fmul_rn(freq, (float)count), pres));
        }
    }
    __syncthreads();

    // 2. Max of the adjusted row; greedy, or nothing left, decide here.
    float m = -INFINITY;
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) m = w[i] > m ? w[i] : m;
    m = block_max_f(m, shf);
    int token = -1;
    if (m == -INFINITY) {
        token = block_argmax(raw, vocab, shf, shi);
    } else if (s[S_GREEDY]) {
        token = block_argmax(w, vocab, shf, shi);
    }
    if (token < 0) {
        const float mx = fminf(m, FMAX);
        const float inv_t = spec_f(s, S_INV_T);
        const int top_k = s[S_TOP_K];
        const bool top_k_on = top_k > 0 && top_k < vocab;
        // 3. top-k: the k largest finite (not NaN, not -inf) values plus ties with the k-th, found
        //    as the largest key K with count(key >= K) >= k by a 16-way search over key space.
        unsigned long long kmin = 0;  // keys >= kmin are candidates (0: everything finite)
        if (top_k_on) {
            unsigned long long klo = order_key(-FMAX), khi = (unsigned long long)order_key(INFINITY) + 1;
            long long finite = 0;
            for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) finite += (!isnan(w[i]) && w[i] != -INFINITY);
            finite = block_sum_ll(finite, shl);
            if (finite > top_k) {
                while (khi - klo > 1) {
                    const unsigned long long step = (khi - klo + SEARCH_WAYS - 1) / SEARCH_WAYS;
                    long long cnt[SEARCH_WAYS];
#pragma unroll
                    for (int j = 0; j < SEARCH_WAYS; ++j) cnt[j] = 0;
                    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
                        const float x = w[i];
                        if (isnan(x) || x == -INFINITY) continue;
                        const unsigned long long k = order_key(x);
#pragma unroll
                        for (int j = 1; j < SEARCH_WAYS; ++j) cnt[j] += (k >= klo + j * step);
                    }
                    // One fixed-shape block reduction per way.
                    for (int j = 1; j < SEARCH_WAYS; ++j) cnt[j] = block_sum_ll(cnt[j], shl);
                    unsigned long long nlo = klo, nhi = khi;
                    for (int j = 1; j < SEARCH_WAYS; ++j) {
                        const unsigned long long t = klo + j * step;
                        if (t >= khi) break;
                        if (cnt[j] >= top_k) nlo = t; else { nhi = t; break; }
                    }
                    klo = nlo; khi = nhi;
                }
                kmin = klo;
            }
        }
        // 4. Weights (0 for removed tokens).
        for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
            const float x = w[i];
            const bool cand = !top_k_on || kmin == 0 || (!isnan(x) && x != -INFINITY && order_key(x) >= kmin);
            w[i] = cand ? host_weight(x, mx, inv_t) : 0.0f;
        }
        __syncthreads();
        // 5. top-p: keep a token iff the mass before it in (weight desc, id asc) order is below
        //    top_p * total. The boundary weight w* is the smallest V with mass(w > V) < limit.
        const float top_p = spec_f(s, S_TOP_P);
        if (top_p < 1.0f) {
            double part = 0.0;
            for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) part += (double)w[i];
            const double total = block_sum_d(part, shd);
            const double limit = (double)top_p * total;
            unsigned long long vlo = 0, vhi = __float_as_uint(1.0f);
            while (vhi - vlo > 1) {
                const unsigned long long step = (vhi - vlo + SEARCH_WAYS - 1) / SEARCH_WAYS;
                double mass[SEARCH_WAYS];
#pragma unroll
                for (int j = 0; j < SEARCH_WAYS; ++j) mass[j] = 0.0;
                for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
                    const unsigned k = __float_as_uint(w[i]);
#pragma unroll
                    for (int j = 1; j < SEARCH_WAYS; ++j) mass[j] += (k > vlo + j * step) ? (double)w[i] : 0.0;
                }
                for (int j = 1; j < SEARCH_WAYS; ++j) mass[j] = block_sum_d(mass[j], shd);
                unsigned long long nlo = vlo, nhi = vhi;
                for (int j = 1; j < SEARCH_WAYS; ++j) {
                    const unsigned long long t = vlo + j * step;
                    if (t >= vhi) break;
                    if (mass[j] >= limit) nlo = t; else { nhi = t; break; }
                }
                vlo = nlo; vhi = nhi;
            }
            const unsigned wstar_bits = (unsigned)vhi;
            const float wstar = __uint_as_float(wstar_bits);
            // The mass above w*, summed exactly as the search summed it (same threads, same
            // order), so it is below the limit and the walk keeps at least one token.
            double above = 0.0;
            for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS)
                above += (__float_as_uint(w[i]) > wstar_bits) ? (double)w[i] : 0.0;
            above = block_sum_d(above, shd);
            // Ties at w* are kept lowest id first: rank them over contiguous id ranges.
            long long ties = 0;
            for (int i = lo; i < hi; ++i) ties += (__float_as_uint(w[i]) == wstar_bits);
            const long long tie_before = block_exclusive_ll(ties, shl);
            const long long tie_total = block_sum_ll(ties, shl);
            // How many tied tokens the host's walk keeps: it adds w* per tie while the mass
            // before is below the limit (at most every tie).
            if (threadIdx.x == 0) {
                double cum = above;
                long long keep = 0;
                while (cum < limit && keep < tie_total) { cum += (double)wstar; ++keep; }
                shl[32 * SEARCH_WAYS] = keep;
            }
            __syncthreads();
            const long long keep = shl[32 * SEARCH_WAYS];
            long long rank = tie_before;
            for (int i = lo; i < hi; ++i) {
                const unsigned k = __float_as_uint(w[i]);
                if (k < wstar_bits) w[i] = 0.0f;
                else if (k == wstar_bits) { if (rank >= keep) w[i] = 0.0f; ++rank; }
            }
            __syncthreads();
        }
        // 6. min-p: the best token (weight 1) always survives.
        const float min_p = spec_f(s, S_MIN_P);
        if (min_p > 0.0f) {
            for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) if (w[i] < min_p && w[i] < 1.0f) w[i] = 0.0f;
            __syncthreads();
        }
        // 7. Inverse CDF over ascending ids: the first kept id whose cumulative weight exceeds
        //    u * total; the last id with weight when rounding runs past the end.
        double part = 0.0;
        for (int i = lo; i < hi; ++i) part += (double)w[i];
        const double total = block_sum_d(part, shd);
        const double target = (double)spec_f(s, S_UNIFORM) * total;
        const double before = block_exclusive_d(part, shd);
        int found = 0x7fffffff, last = -1;
        double cum = before;
        for (int i = lo; i < hi; ++i) {
            const float x = w[i];
            cum += (double)x;
            if (x > 0.0f) {
                last = i;
                if (cum > target && found == 0x7fffffff) found = i;
            }
        }
        // The lowest id any thread found: as a (value desc, id asc) best with value 0 for finders.
        float fv = found == 0x7fffffff ? -INFINITY : 0.0f;
        int fi = found;
        block_best(fv, fi, shf, shi);
        if (fi != 0x7fffffff && fv == 0.0f) {
            token = fi;
        } else {
            float lv = last < 0 ? -INFINITY : (float)last;
            int li = last < 0 ? 0x7fffffff : 0;
            block_best(lv, li, shf, shi);
            token = lv == -INFINITY ? 0 : (int)lv;
        }
    }
    if (threadIdx.x == 0) { out_token[blockIdx.x] = token; token_sh = token; }
    __syncthreads();

    // 8. Raw logprobs (unmodified logits): the chosen token's and the top n by (logprob desc, id
    //    asc), NaN counted as -inf and +inf clamped to FLT_MAX.
    const int n = s[S_LOGPROBS];
    if (n < 0) return;
    float rm = -INFINITY;
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) rm = raw[i] > rm ? raw[i] : rm;
    rm = fminf(block_max_f(rm, shf), FMAX);
    float* top_lp = out_top_lp + (long long)blockIdx.x * max_top;
    int* top_id = out_top_id + (long long)blockIdx.x * max_top;
    if (rm == -INFINITY) {
        if (threadIdx.x == 0) {
            out_logprob[blockIdx.x] = -INFINITY;
            for (int j = 0; j < n && j < vocab; ++j) { top_id[j] = j; top_lp[j] = -INFINITY; }
            for (int j = min(n, vocab); j < max_top; ++j) top_id[j] = -1;
        }
        return;
    }
    double se = 0.0;
    for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
        const float x = raw[i];
        const float e = host_exp(__fsub_rn(fminf(x, FMAX), rm));
        se += isnan(x) ? 0.0 : (double)e;
    }
    se = block_sum_d(se, shd);
    const double lse = (double)rm + log(se);
    if (threadIdx.x == 0) {
        const float x = raw[token_sh];
        const float c = isnan(x) ? -INFINITY : fminf(x, FMAX);
        out_logprob[blockIdx.x] = (float)((double)c - lse);
    }
    float pv = INFINITY;
    int pi = -1;
    for (int j = 0; j < max_top; ++j) {
        if (j >= n) { if (threadIdx.x == 0) top_id[j] = -1; continue; }
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int i = threadIdx.x; i < vocab; i += SAMPLE_THREADS) {
            const float x = isnan(raw[i]) ? -INFINITY : fminf(raw[i], FMAX);
            const bool after = x < pv || (x == pv && i > pi);
            if (after && (x > bv || (x == bv && i < bi))) { bv = x; bi = i; }
        }
        block_best(bv, bi, shf, shi);
        if (bi == 0x7fffffff) { if (threadIdx.x == 0) top_id[j] = -1; continue; }
        if (threadIdx.x == 0) { top_id[j] = bi; top_lp[j] = (float)((double)bv - lse); }
        pv = bv; pi = bi;
    }
}
