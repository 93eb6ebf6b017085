// glm5_next MLA attention over the DSA-selected positions on the tensor cores (bf16 storage).
//
// In the absorbed form every head of a token attends over the same latent records c_τ (the MLA
// cache is one shared "key" and "value" per position), so one block takes one token and all its
// heads at once: the heads are the M dimension of mma.sync m16n8k16 (padded to 64), 64 selected
// positions are a tile, and
//   S = Q̃ · Cᵀ (K = the latent rank r),  online softmax per head,  Ô += P · C (N = r).
// q̃ = W^Kᵀ q and o = W^V ĉ are batched GEMMs around it (`mla.rs`). Q̃ and C are rounded to bf16
// here (the cache stays f32), P is rounded to bf16 before P·C and the row sums add the rounded P.
// Each token's output depends on its own q̃ and selection only: rows never see the batch.

#define MLA_HEADS_PAD 64  // heads per block (M); a model with fewer leaves the rest zero
#define MLA_TILE 64       // selected positions per tile
#define MLA_MMA_THREADS 256
#define MLA_MAX_NTILES 32  // r / 16 ≤ 32, i.e. r ≤ 512
#define MLA_LOAD_BATCH 16  // latent loads each thread has in flight while a tile is read

// `DsaRow` of glm5.cu: a batch row's absolute position and where its block table starts.
struct MlaRow {
    int pos, table;
};

__device__ __forceinline__ i64 mla_record(const int* table, int p, int block_size, int token_stride) {
    return ((i64)table[p / block_size] * block_size + p % block_size) * token_stride;
}

// Grid: one block per batch row. qt: [rows, h, r] bf16; out ĉ: [rows, h, r] bf16, normalised.
// Requires h ≤ 64 and r a multiple of 32, r ≤ 512 (checked by the caller). Dynamic shared
// memory: `mla_mma_smem(r)` bytes (see mla.rs).
extern "C" __global__ void __launch_bounds__(MLA_MMA_THREADS)
    mla_attend_mma(const bf16* qt, const float* kv, const MlaRow* rows, const int* tables, const int* sel,
                   const int* sel_count, bf16* out, int block_size, int token_stride, int latent_off, int h, int r,
                   int max_sel, float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int RS = r + 8;              // bf16 row stride of Q̃ and C: 16-byte rows, no bank conflicts
    const int PS = MLA_TILE + 8;       // bf16 row stride of P
    const int SS = MLA_TILE + 4;       // f32 row stride of S
    bf16* qs = reinterpret_cast<bf16*>(smem);
    bf16* cs = qs + MLA_HEADS_PAD * RS;
    float* ss = reinterpret_cast<float*>(cs + MLA_TILE * RS);
    bf16* ps = reinterpret_cast<bf16*>(ss + MLA_HEADS_PAD * SS);
    float* row_m = reinterpret_cast<float*>(ps + MLA_HEADS_PAD * PS);
    float* row_l = row_m + MLA_HEADS_PAD;
    float* row_a = row_l + MLA_HEADS_PAD;
    i64* rec = reinterpret_cast<i64*>(row_a + MLA_HEADS_PAD);

    const int b = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int n = sel_count[b];
    const MlaRow row = rows[b];
    const int* table = tables + row.table;
    const int* chosen = sel + (i64)b * max_sel;

    // Q̃ of this token, 16 bytes at a time; rows past h are zero.
    const bf16* q_src = qt + (i64)b * h * r;
    const int q_chunks = r / 8;
    for (int i = tid; i < MLA_HEADS_PAD * q_chunks; i += MLA_MMA_THREADS) {
        const int hh = i / q_chunks, c = (i % q_chunks) * 8;
        uint4 v = {0u, 0u, 0u, 0u};
        if (hh < h) v = *reinterpret_cast<const uint4*>(q_src + (i64)hh * r + c);
        *reinterpret_cast<uint4*>(qs + hh * RS + c) = v;
    }
    if (tid < MLA_HEADS_PAD) {
        row_m[tid] = -INFINITY;
        row_l[tid] = 0.f;
    }

    // Warp roles: heads [ht·16, ht·16 + 16); S over positions [half·32, +32); Ô over columns
    // [half·r/2, +r/2) — 16 × r/2 f32 accumulators per warp, r/16 n-tiles of 8.
    const int ht = warp & 3, half = warp >> 2;
    const int n_tiles = r / 16, col0 = half * (r / 2);
    float acc[MLA_MAX_NTILES][4];
#pragma unroll
    for (int j = 0; j < MLA_MAX_NTILES; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    const bool vec4 = ((token_stride | latent_off | r) & 3) == 0;

    for (int x0 = 0; x0 < n; x0 += MLA_TILE) {
        const int cnt = min(MLA_TILE, n - x0);
        __syncthreads();  // the previous tile's C and P are read; Q̃ and the row state are written
        if (tid < MLA_TILE)
            rec[tid] = tid < cnt ? mla_record(table, chosen[x0 + tid], block_size, token_stride) + latent_off : 0;
        __syncthreads();
        // The tile's latents, f32 → bf16; rows past cnt are zero (P is zero there too).
        if (vec4) {
            // MLA_LOAD_BATCH loads in flight per thread before any is converted: the tile is
            // latency-bound otherwise (one 16-byte load waited for at a time).
            const int chunks = r / 4, total = MLA_TILE * chunks;
            for (int i0 = tid; i0 < total; i0 += MLA_MMA_THREADS * MLA_LOAD_BATCH) {
                float4 v[MLA_LOAD_BATCH];
#pragma unroll
                for (int u = 0; u < MLA_LOAD_BATCH; ++u) {
                    const int i = i0 + u * MLA_MMA_THREADS, p = i / chunks, c = (i % chunks) * 4;
                    v[u] = i < total && p < cnt ? *reinterpret_cast<const float4*>(kv + rec[p] + c)
                                                : make_float4(0.f, 0.f, 0.f, 0.f);
                }
#pragma unroll
                for (int u = 0; u < MLA_LOAD_BATCH; ++u) {
                    const int i = i0 + u * MLA_MMA_THREADS, p = i / chunks, c = (i % chunks) * 4;
                    if (i < total) {
                        uint2 packed;
                        packed.x = pack_bf16(v[u].x, v[u].y);
                        packed.y = pack_bf16(v[u].z, v[u].w);
                        *reinterpret_cast<uint2*>(cs + p * RS + c) = packed;
                    }
                }
            }
        } else {
            for (int i = tid; i < MLA_TILE * r; i += MLA_MMA_THREADS) {
                const int p = i / r, c = i % r;
                cs[p * RS + c] = from_f<bf16>(p < cnt ? kv[rec[p] + c] : 0.f);
            }
        }
        __syncthreads();

        // S = Q̃ · Cᵀ for this warp's 16 heads × 32 positions, scaled; positions past cnt masked.
        {
            float s[4][4];
#pragma unroll
            for (int j = 0; j < 4; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
            const int pos0 = half * 32;
            for (int k0 = 0; k0 < r; k0 += 16) {
                unsigned a[4];
                ldmatrix_x4(a, qs + (ht * 16 + (lane & 15)) * RS + k0 + (lane >> 4) * 8);
#pragma unroll
                for (int j = 0; j < 4; j += 2) {
                    unsigned bq[4];
                    ldmatrix_x4(bq, cs + (pos0 + j * 8 + (lane & 7) + ((lane >> 4) << 3)) * RS + k0 +
                                        ((lane >> 3) & 1) * 8);
                    mma_bf16(s[j], a, bq[0], bq[1]);
                    mma_bf16(s[j + 1], a, bq[2], bq[3]);
                }
            }
            const int h0 = ht * 16 + g;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int c = pos0 + j * 8 + 2 * t;
                ss[h0 * SS + c] = c < cnt ? s[j][0] * scale : -INFINITY;
                ss[h0 * SS + c + 1] = c + 1 < cnt ? s[j][1] * scale : -INFINITY;
                ss[(h0 + 8) * SS + c] = c < cnt ? s[j][2] * scale : -INFINITY;
                ss[(h0 + 8) * SS + c + 1] = c + 1 < cnt ? s[j][3] * scale : -INFINITY;
            }
        }
        __syncthreads();

        // Online softmax: four threads per head row, 16 positions each.
        {
            const int i = tid >> 2, part = tid & 3;
            const float* srow = ss + i * SS + part * 16;
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < 16; ++j) mx = fmaxf(mx, srow[j]);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_old = row_m[i], m_new = fmaxf(m_old, mx);
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const bf16 p = from_f<bf16>(expf(srow[j] - m_new));
                ps[i * PS + part * 16 + j] = p;
                sum += to_f(p);
            }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            if (part == 0) {
                const float alpha = expf(m_old - m_new);
                row_a[i] = alpha;
                row_l[i] = row_l[i] * alpha + sum;
                row_m[i] = m_new;
            }
        }
        __syncthreads();

        // Ô = Ô·α + P · C over this warp's heads and columns.
        {
            const float a0 = row_a[ht * 16 + g], a1 = row_a[ht * 16 + g + 8];
#pragma unroll
            for (int j = 0; j < MLA_MAX_NTILES; ++j) {
                acc[j][0] *= a0;
                acc[j][1] *= a0;
                acc[j][2] *= a1;
                acc[j][3] *= a1;
            }
            for (int k0 = 0; k0 < MLA_TILE; k0 += 16) {
                unsigned a[4];
                ldmatrix_x4(a, ps + (ht * 16 + (lane & 15)) * PS + k0 + (lane >> 4) * 8);
#pragma unroll
                for (int j = 0; j < MLA_MAX_NTILES; j += 2) {
                    if (j < n_tiles) {
                        unsigned bv[4];
                        ldmatrix_x4_trans(bv, cs + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * RS + col0 + j * 8 +
                                                  (lane >> 4) * 8);
                        mma_bf16(acc[j], a, bv[0], bv[1]);
                        mma_bf16(acc[j + 1], a, bv[2], bv[3]);
                    }
                }
            }
        }
    }
    __syncthreads();

    // ĉ = Ô / l for the real heads (a row with nothing selected gets zeros).
    const int h0 = ht * 16 + g, h1 = h0 + 8;
    const float l0 = row_l[h0], l1 = row_l[h1];
    const float inv0 = l0 > 0.f ? 1.0f / l0 : 0.f, inv1 = l1 > 0.f ? 1.0f / l1 : 0.f;
#pragma unroll
    for (int j = 0; j < MLA_MAX_NTILES; ++j) {
        if (j < n_tiles) {
            const int c = col0 + j * 8 + 2 * t;
            if (h0 < h)
                *reinterpret_cast<unsigned*>(out + ((i64)b * h + h0) * r + c) =
                    pack_bf16(acc[j][0] * inv0, acc[j][1] * inv0);
            if (h1 < h)
                *reinterpret_cast<unsigned*>(out + ((i64)b * h + h1) * r + c) =
                    pack_bf16(acc[j][2] * inv1, acc[j][3] * inv1);
        }
    }
}
