// Prefill attention on the tensor cores (bf16 storage only): the same work items and partial
// outputs as `attn_partial` in attention.cu, but 128 query rows per block (8 warps of 16 rows, so
// each K/V tile in shared memory serves 128 rows) and 64-key tiles, with S = Q·Kᵀ and O += P·V as mma.sync m16n8k16 (bf16 in, f32 accumulate) and
// an online softmax in registers (base 2). q is rounded to bf16 here; P is rounded to bf16
// before P·V. FlashAttention-2 style: K and V tiles stay row-major in shared memory, two stages
// deep, filled by cp.async while the previous tile computes; B fragments come from ldmatrix
// (.trans for V). A tile whose item has one key split (its last int is 1: every prefill tile
// today) writes the normalised bf16 output itself, exactly what the combine kernel would write
// for one split (acc / sum with weight exp(0) = 1), so the combine skips its rows. Causal and window masks cost only where a tile crosses a warp's row bounds:
// a tile no row of a warp can see is skipped by that warp (exactly what masking all of it would
// give: nothing changes), and a tile every row sees in full is not masked. Each output row
// depends only on its own q row and keys, so batch invariance is kept.

#define MMA_MAX_ROWS 128
#define MKT 64
#define ITEM_INTS 8
#define LOG2E 1.4426950408889634f

// WARPS × 16 query rows per block (`MmaTiles::rows` in src/backend/cuda/plan.rs).
template <int HD, int WARPS>
__device__ void attn_prefill_mma_impl(const int* items, const float* q, const bf16* k_cache, const bf16* v_cache,
                                      const int* tables, const int* table_off, const int* positions, AttnDims d,
                                      float* part_acc, float* part_ml, bf16* out) {
    constexpr int LD = HD + 8;  // bf16 per K/V row in shared memory (16-byte pad: no bank conflicts)
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* ks = reinterpret_cast<bf16*>(smem_raw);  // [2 stages][MKT keys][LD]
    bf16* vs = ks + 2 * MKT * LD;                  // [2 stages][MKT keys][LD]
    __shared__ int pos_s[MMA_MAX_ROWS];
    constexpr int MMA_ROWS = WARPS * 16;

    const int* it = items + blockIdx.x * ITEM_INTS;
    const int seq = it[0], tok0 = it[1], ntok = it[2], kvh = it[3], key0 = it[4], key1 = it[5], split = it[6];
    const bool direct = it[7] != 0;
    const int group = d.nh / d.nkv, rows = ntok * group, kvd = d.nkv * HD;
    const int* table = tables + table_off[seq];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;

    // Issue the copies of the tile starting at key `kt0` into `stage` (one commit group).
    auto load_tile = [&](int kt0, int stage) {
        for (int i = threadIdx.x; i < MKT * (HD / 8); i += blockDim.x) {
            const int k = i / (HD / 8), c = (i % (HD / 8)) * 8;
            const int p = kt0 + k;
            const bool ok = p < key1;
            const i64 off = ok ? kv_row_offset(p, table, d, kvd) + kvh * HD + c : 0;
            cp_async16(ks + (stage * MKT + k) * LD + c, k_cache + off, ok);
            cp_async16(vs + (stage * MKT + k) * LD + c, v_cache + off, ok);
        }
        cp_async_commit();
    };
    const int ntiles = (key1 - key0 + MKT - 1) / MKT;
    if (ntiles > 0) load_tile(key0, 0);

    if (threadIdx.x < MMA_ROWS) {
        const int r = threadIdx.x;
        pos_s[r] = r < rows ? positions[tok0 + r / group] : -1;
    }
    // This thread's two rows (g and g + 8 of the warp's 16) and their q fragments.
    const int r0 = warp * 16 + g, r1 = r0 + 8;
    unsigned qa[HD / 16][4];
    {
        const float* q0 = r0 < rows ? q + ((i64)(tok0 + r0 / group) * d.nh + kvh * group + r0 % group) * HD : nullptr;
        const float* q1 = r1 < rows ? q + ((i64)(tok0 + r1 / group) * d.nh + kvh * group + r1 % group) * HD : nullptr;
#pragma unroll
        for (int s = 0; s < HD / 16; ++s) {
            const int c = s * 16 + 2 * t;
            qa[s][0] = q0 ? pack_bf16(q0[c], q0[c + 1]) : 0u;
            qa[s][1] = q1 ? pack_bf16(q1[c], q1[c + 1]) : 0u;
            qa[s][2] = q0 ? pack_bf16(q0[c + 8], q0[c + 9]) : 0u;
            qa[s][3] = q1 ? pack_bf16(q1[c + 8], q1[c + 9]) : 0u;
        }
    }
    float o[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    // Running max (base-2 units of scaled scores) and sum of rows g and g + 8.
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    const float sl2 = d.scale * LOG2E;
    __syncthreads();
    const int p0 = pos_s[r0 < MMA_ROWS ? r0 : 0], p1 = pos_s[r1 < MMA_ROWS ? r1 : 0];
    const int lo0 = d.window > 0 ? p0 + 1 - d.window : 0, lo1 = d.window > 0 ? p1 + 1 - d.window : 0;
    // ldmatrix lane roles: matrix lane/8, row lane%8 of it.
    const int lm = lane >> 3, lr = lane & 7;
    // The warp's rows are consecutive tokens of one sequence, so its first and last valid rows
    // bound every row's visible keys (warp-uniform, so skipping keeps the warp converged).
    const int wfirst = warp * 16, wlast = min(wfirst + 15, rows - 1);
    const bool warp_has_rows = wfirst < rows;
    const int wmin = warp_has_rows ? pos_s[wfirst] : -1, wmax = warp_has_rows ? pos_s[wlast] : -1;
    const int wlo_min = d.window > 0 ? wmin + 1 - d.window : 0, wlo_max = d.window > 0 ? wmax + 1 - d.window : 0;

    for (int ti = 0; ti < ntiles; ++ti) {
        const int stage = ti & 1, kt0 = key0 + ti * MKT;
        if (ti + 1 < ntiles) {
            load_tile(kt0 + MKT, stage ^ 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        // Skip (no row of this warp sees a key of the tile) or compute, masked only if some key is
        // out of some row's reach.
        const bool unseen = !warp_has_rows || kt0 > wmax || kt0 + MKT - 1 < wlo_min;
        const bool full = kt0 + MKT <= key1 && kt0 + MKT - 1 <= wmin && kt0 >= wlo_max;
        if (!unseen) {
        const bf16* kst = ks + stage * MKT * LD;
        const bf16* vst = vs + stage * MKT * LD;
        // S = Q·Kᵀ for 8 tiles of 8 keys; one ldmatrix.x4 feeds two k-steps.
        float s[MKT / 8][4];
#pragma unroll
        for (int n = 0; n < MKT / 8; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < HD / 16; kk += 2) {
                unsigned b[4];
                ldmatrix_x4(b, kst + (n * 8 + lr) * LD + (kk + (lm >> 1)) * 16 + (lm & 1) * 8);
                mma_bf16(s[n], qa[kk], b[0], b[1]);
                mma_bf16(s[n], qa[kk + 1], b[2], b[3]);
            }
        }
        // Mask, scale, online softmax (rows g and g + 8; a row's 4 threads share it via shuffles).
        float mx0 = -INFINITY, mx1 = -INFINITY;
        if (full) {
#pragma unroll
            for (int n = 0; n < MKT / 8; ++n) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    s[n][j] *= sl2;
                    s[n][2 + j] *= sl2;
                    mx0 = fmaxf(mx0, s[n][j]);
                    mx1 = fmaxf(mx1, s[n][2 + j]);
                }
            }
        } else {
#pragma unroll
            for (int n = 0; n < MKT / 8; ++n) {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int key = kt0 + n * 8 + 2 * t + j;
                    const bool v0 = key < key1 && key <= p0 && key >= lo0;
                    const bool v1 = key < key1 && key <= p1 && key >= lo1;
                    s[n][j] = v0 ? s[n][j] * sl2 : -INFINITY;
                    s[n][2 + j] = v1 ? s[n][2 + j] * sl2 : -INFINITY;
                    mx0 = fmaxf(mx0, s[n][j]);
                    mx1 = fmaxf(mx1, s[n][2 + j]);
                }
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float nm0 = fmaxf(m0, mx0), nm1 = fmaxf(m1, mx1);
        const float c0 = nm0 == -INFINITY ? 1.f : exp2f(m0 - nm0), c1 = nm1 == -INFINITY ? 1.f : exp2f(m1 - nm1);
        float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
        for (int n = 0; n < MKT / 8; ++n) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                s[n][j] = s[n][j] == -INFINITY ? 0.f : exp2f(s[n][j] - nm0);
                s[n][2 + j] = s[n][2 + j] == -INFINITY ? 0.f : exp2f(s[n][2 + j] - nm1);
                sum0 += s[n][j];
                sum1 += s[n][2 + j];
            }
        }
        sum0 += __shfl_xor_sync(0xffffffffu, sum0, 1);
        sum0 += __shfl_xor_sync(0xffffffffu, sum0, 2);
        sum1 += __shfl_xor_sync(0xffffffffu, sum1, 1);
        sum1 += __shfl_xor_sync(0xffffffffu, sum1, 2);
        l0 = l0 * c0 + sum0;
        l1 = l1 * c1 + sum1;
        m0 = nm0;
        m1 = nm1;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            o[n][0] *= c0;
            o[n][1] *= c0;
            o[n][2] *= c1;
            o[n][3] *= c1;
        }
        // O += P·V: P's accumulator layout of two adjacent key tiles is the A layout of one k-step;
        // one ldmatrix.x4.trans of row-major V feeds two 8-wide dim tiles.
#pragma unroll
        for (int kk = 0; kk < MKT / 16; ++kk) {
            const unsigned pa[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                                    pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < HD / 8; n += 2) {
                unsigned b[4];
                ldmatrix_x4_trans(b, vst + (kk * 16 + (lm & 1) * 8 + lr) * LD + (n + (lm >> 1)) * 8);
                mma_bf16(o[n], pa, b[0], b[1]);
                mma_bf16(o[n + 1], pa, b[2], b[3]);
            }
        }
        }
        // Everyone is done with this stage before the next iteration refills it.
        __syncthreads();
    }
    // Partial results for the combine kernel (attention.cu's layout; max back in natural units).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = half ? r1 : r0;
        if (r >= rows) continue;
        const int tok = tok0 + r / group, head = kvh * group + r % group;
        if (direct) {
            const float l = half ? l1 : l0;
            unsigned* orow = reinterpret_cast<unsigned*>(out + ((i64)tok * d.nh + head) * HD);
#pragma unroll
            for (int n = 0; n < HD / 8; ++n)
                orow[(n * 8 + 2 * t) / 2] = pack_bf16(o[n][2 * half] / l, o[n][2 * half + 1] / l);
            continue;
        }
        const i64 pidx = ((i64)split * d.total_tokens + tok) * d.nh + head;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            part_acc[pidx * HD + n * 8 + 2 * t] = o[n][2 * half];
            part_acc[pidx * HD + n * 8 + 2 * t + 1] = o[n][2 * half + 1];
        }
        if (t == 0) {
            const float mm = half ? m1 : m0;
            part_ml[pidx * 2] = mm == -INFINITY ? mm : mm / LOG2E;
            part_ml[pidx * 2 + 1] = half ? l1 : l0;
        }
    }
}

// Dynamic shared memory: 2 stages × (K + V) × MKT × (HD + 8) bf16 (`mma_attention_smem` in
// src/backend/cuda/decode.rs). Block shapes (`MmaTiles` in src/backend/cuda/plan.rs): 8 warps
// (the default); 8 warps capped at 128 registers so two blocks share an SM (`_b2`); 4 warps
// (`_r64`, the previous shape, kept for comparison).
#define MMA_ENTRY(NAME, HD, WARPS, MINB)                                                                            \
    extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)                                                  \
        NAME(const int* items, const float* q, const bf16* kc, const bf16* vc, const int* tables, const int* toff,   \
             const int* pos, AttnDims d, float* pa, float* pm, bf16* out) {                                          \
        attn_prefill_mma_impl<HD, WARPS>(items, q, kc, vc, tables, toff, pos, d, pa, pm, out);                       \
    }
MMA_ENTRY(attn_prefill_mma_d64, 64, 8, 1)
MMA_ENTRY(attn_prefill_mma_d128, 128, 8, 1)
MMA_ENTRY(attn_prefill_mma_d64_b2, 64, 8, 2)
MMA_ENTRY(attn_prefill_mma_d128_b2, 128, 8, 2)
MMA_ENTRY(attn_prefill_mma_d64_r64, 64, 4, 1)
MMA_ENTRY(attn_prefill_mma_d128_r64, 128, 4, 1)
