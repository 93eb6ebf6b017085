// Prefill attention on the tensor cores (bf16 storage only): the same work items and partial
// outputs as `attn_partial` in attention.cu, but 64 query rows per block (16 per warp) and
// 64-key tiles, with S = Q·Kᵀ and O += P·V as mma.sync m16n8k16 (bf16 in, f32 accumulate) and
// an online softmax in registers. q is rounded to bf16 here; P is rounded to bf16 before P·V.
// Each output row depends only on its own q row and keys, so batch invariance is kept.

#define MMA_ROWS 64
#define MKT 64
#define ITEM_INTS 8

struct AttnDims {
    i64 block_stride;
    int nh, nkv, hd, block_size, window;
    int total_tokens;
    float scale;
};

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    return (unsigned)from_f<bf16>(lo) | ((unsigned)from_f<bf16>(hi) << 16);
}

__device__ __forceinline__ void mma_bf16(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int HD>
__device__ void attn_prefill_mma_impl(const int* items, const float* q, const bf16* k_cache, const bf16* v_cache,
                                      const int* tables, const int* table_off, const int* positions, AttnDims d,
                                      float* part_acc, float* part_ml) {
    constexpr int KLD = HD + 8;   // bf16 per K row in shared memory (padding: no bank conflicts)
    constexpr int VLD = MKT + 8;  // bf16 per transposed V row
    __shared__ __align__(16) bf16 ks[MKT * KLD];
    __shared__ __align__(16) bf16 vt[HD * VLD];
    __shared__ i64 off_s[MKT];
    __shared__ int pos_s[MMA_ROWS];

    const int* it = items + blockIdx.x * ITEM_INTS;
    const int seq = it[0], tok0 = it[1], ntok = it[2], kvh = it[3], key0 = it[4], key1 = it[5], split = it[6];
    const int group = d.nh / d.nkv, rows = ntok * group, kvd = d.nkv * HD;
    const int* table = tables + table_off[seq];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;

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
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
    __syncthreads();
    const int p0 = pos_s[r0 < MMA_ROWS ? r0 : 0], p1 = pos_s[r1 < MMA_ROWS ? r1 : 0];
    const int lo0 = d.window > 0 ? p0 + 1 - d.window : 0, lo1 = d.window > 0 ? p1 + 1 - d.window : 0;

    for (int kt0 = key0; kt0 < key1; kt0 += MKT) {
        __syncthreads();
        if (threadIdx.x < MKT) {
            const int p = kt0 + threadIdx.x;
            off_s[threadIdx.x] = p < key1 ? table[p / d.block_size] * d.block_stride + (i64)(p % d.block_size) * kvd : -1;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < MKT * (HD / 8); i += blockDim.x) {
            const int k = i / (HD / 8), c = (i % (HD / 8)) * 8;
            const i64 row = off_s[k];
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (row >= 0) {
                kv = *reinterpret_cast<const uint4*>(k_cache + row + kvh * HD + c);
                vv = *reinterpret_cast<const uint4*>(v_cache + row + kvh * HD + c);
            }
            *reinterpret_cast<uint4*>(ks + k * KLD + c) = kv;
            const unsigned w[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                vt[(c + 2 * j) * VLD + k] = (bf16)(w[j] & 0xffffu);
                vt[(c + 2 * j + 1) * VLD + k] = (bf16)(w[j] >> 16);
            }
        }
        __syncthreads();
        // S = Q·Kᵀ for 8 tiles of 8 keys.
        float s[MKT / 8][4];
#pragma unroll
        for (int n = 0; n < MKT / 8; ++n) {
            s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
            const bf16* kr = ks + (n * 8 + g) * KLD + 2 * t;
#pragma unroll
            for (int kk = 0; kk < HD / 16; ++kk) {
                const unsigned b0 = *reinterpret_cast<const unsigned*>(kr + kk * 16);
                const unsigned b1 = *reinterpret_cast<const unsigned*>(kr + kk * 16 + 8);
                mma_bf16(s[n], qa[kk], b0, b1);
            }
        }
        // Mask, scale, online softmax (rows g and g + 8; a row's 4 threads share it via shuffles).
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int n = 0; n < MKT / 8; ++n) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int key = kt0 + n * 8 + 2 * t + j;
                const bool v0 = key < key1 && key <= p0 && key >= lo0;
                const bool v1 = key < key1 && key <= p1 && key >= lo1;
                s[n][j] = v0 ? s[n][j] * d.scale : -INFINITY;
                s[n][2 + j] = v1 ? s[n][2 + j] * d.scale : -INFINITY;
                mx0 = fmaxf(mx0, s[n][j]);
                mx1 = fmaxf(mx1, s[n][2 + j]);
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float nm0 = fmaxf(m0, mx0), nm1 = fmaxf(m1, mx1);
        const float c0 = nm0 == -INFINITY ? 1.f : expf(m0 - nm0), c1 = nm1 == -INFINITY ? 1.f : expf(m1 - nm1);
        float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
        for (int n = 0; n < MKT / 8; ++n) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                s[n][j] = s[n][j] == -INFINITY ? 0.f : expf(s[n][j] - nm0);
                s[n][2 + j] = s[n][2 + j] == -INFINITY ? 0.f : expf(s[n][2 + j] - nm1);
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
        // O += P·V: P's accumulator layout of two adjacent key tiles is the A layout of one k-step.
#pragma unroll
        for (int kk = 0; kk < MKT / 16; ++kk) {
            const unsigned pa[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                                    pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < HD / 8; ++n) {
                const bf16* vr = vt + (n * 8 + g) * VLD + kk * 16 + 2 * t;
                mma_bf16(o[n], pa, *reinterpret_cast<const unsigned*>(vr), *reinterpret_cast<const unsigned*>(vr + 8));
            }
        }
    }
    // Partial results for the combine kernel (attention.cu's layout).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = half ? r1 : r0;
        if (r >= rows) continue;
        const int tok = tok0 + r / group, head = kvh * group + r % group;
        const i64 pidx = ((i64)split * d.total_tokens + tok) * d.nh + head;
#pragma unroll
        for (int n = 0; n < HD / 8; ++n) {
            part_acc[pidx * HD + n * 8 + 2 * t] = o[n][2 * half];
            part_acc[pidx * HD + n * 8 + 2 * t + 1] = o[n][2 * half + 1];
        }
        if (t == 0) {
            part_ml[pidx * 2] = half ? m1 : m0;
            part_ml[pidx * 2 + 1] = half ? l1 : l0;
        }
    }
}

extern "C" __global__ void __launch_bounds__(128) attn_prefill_mma_d64(const int* items, const float* q, const bf16* kc,
                                                                       const bf16* vc, const int* tables, const int* toff,
                                                                       const int* pos, AttnDims d, float* pa, float* pm) {
    attn_prefill_mma_impl<64>(items, q, kc, vc, tables, toff, pos, d, pa, pm);
}

extern "C" __global__ void __launch_bounds__(128) attn_prefill_mma_d128(const int* items, const float* q, const bf16* kc,
                                                                        const bf16* vc, const int* tables, const int* toff,
                                                                        const int* pos, AttnDims d, float* pa, float* pm) {
    attn_prefill_mma_impl<128>(items, q, kc, vc, tables, toff, pos, d, pa, pm);
}
