#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
// Shared helpers for every kernel module: prepended to each module's source before NVRTC
// compiles it, so no CUDA headers are needed at run time. bf16 is handled as raw bits
// (round-to-nearest-even on store), which keeps the conversion identical to the host's `half`.
typedef unsigned short bf16;
typedef long long i64;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __uint_as_float(((unsigned)x) << 16); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// The reduction tree is fixed by the block size, so the result does not depend on other rows.
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = threadIdx.x < nwarps ? partial[threadIdx.x] : 0.f;
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) partial[0] = v;
    __syncthreads();
    const float r = partial[0];
    __syncthreads();
    return r;
}

// Programmatic dependent launch (sm_90 and later; no-ops before). A kernel the host launches
// as a dependent (`Gpu::launch_params` with `dependent`) may start while the kernel before it
// drains. Before `pdl_wait()` it may only read what no kernel of the step writes (weights, the
// host-uploaded item lists and block tables, K/V rows of earlier steps) and must write nothing; after it, everything its
// predecessors wrote is visible. `pdl_launch_dependents()` lets the next dependent kernel start
// as soon as every block of this one is running.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Dimensions of a paged attention launch (both attention modules; `AttnDims` in
// src/backend/cuda/decode.rs).
struct AttnDims {
    i64 block_stride;  // elements from one KV block to the next (all layers' K and V)
    int nh, nkv, hd, block_size, window;  // window 0 = no sliding window
    int total_tokens;
    float scale;
};

// Element offset of key `p`'s K (or V) row in this layer's paged cache: its block from the
// sequence's block table, then its slot (rows of `kvd` elements).
__device__ __forceinline__ i64 kv_row_offset(int p, const int* table, const AttnDims& d, int kvd) {
    return table[p / d.block_size] * d.block_stride + (i64)(p % d.block_size) * kvd;
}

// Instantiate `name_f32` and `name_bf16` from a template `name_impl<T>` whose storage type is T.
#define FOR_STORAGE_TYPES(X) X(float, f32) X(bf16, bf16)

// How RoPE angles are computed (mirrors the CPU backend's `RopeAngles`); shared by the RoPE
// kernel in llama.cu and the fused q/k/v GEMV in gemv.cu so both rotate identically.
struct RopeParams {
    int mode;           // 0: angle = pos · inv_freq[j] (HF); 1: GGML's iterated θ (llama.cpp)
    float theta_scale;  // GGML: base^(−2/d)
    float freq_scale;   // GGML: 1 / linear factor
};

// Angle of rotation pair `j` at position `p` (freqs: HF inverse frequencies, or GGML's Llama 3
// factors, or null).
__device__ __forceinline__ float rope_angle(RopeParams rp, const float* freqs, float p, int j) {
    if (rp.mode == 0) return p * freqs[j];
    float theta = p;
    for (int k = 0; k < j; ++k) theta *= rp.theta_scale;
    return rp.freq_scale * (freqs ? theta / freqs[j] : theta);
}

// Rotate the pair (a, b) by the angle whose cosine and sine are `c` and `s`:
// a' = a·cos − b·sin, b' = a·sin + b·cos.
__device__ __forceinline__ void rope_rotate_cs(float c, float s, float& a, float& b) {
    const float na = fmaf(a, c, -(b * s)), nb = fmaf(a, s, b * c);
    a = na;
    b = nb;
}
__device__ __forceinline__ void rope_rotate(float ang, float& a, float& b) { rope_rotate_cs(cosf(ang), sinf(ang), a, b); }

// 16 bytes that no other block reads again (weights streamed once): skip L1 so what is reused
// (the activations) stays there.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
        : "l"(p));
    return r;
}

// Tensor-core helpers (sm_80+): bf16 packing, mma.sync m16n8k16 (bf16 in, f32 accumulate), shared
// memory addresses, cp.async and ldmatrix. Used by attention_mma.cu and glm5_mla.cu.
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

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bytes global → shared without registers; `ok` false fills zeros (reads nothing).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(ok ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

// Packed weight codes (layouts: cuda/quant_gemv.cu's header), shared by the packed GEMVs and the
// grouped expert GEMMs of cuda/glm5_moe.cu.
#define FMT_FP8 0
#define FMT_INT4 1
#define FMT_NVFP4 2

typedef unsigned char u8;

// 2^e as a float (e in the normal range).
__device__ __forceinline__ float qg_pow2(int e) { return __int_as_float((127 + e) << 23); }

// An e4m3fn byte (no NaN codes: refused at load) with its bits in an f32's exponent/mantissa
// place: 2⁻¹²⁰ × its value exactly (subnormals included: the f32 is then subnormal too, and the
// GPU keeps subnormals without --ftz).
__device__ __forceinline__ float e4m3_raw(unsigned b) {
    return __int_as_float(((b & 0x80u) << 24) | ((b & 0x7fu) << 20));
}
__device__ __forceinline__ float e4m3_value(unsigned b) { return e4m3_raw(b) * qg_pow2(120); }

// An E2M1 nibble the same way: 2⁻¹²⁶ × its value (0, ±0.5 … ±6).
__device__ __forceinline__ float e2m1_raw(unsigned q) {
    return __int_as_float(((q & 0x8u) << 28) | ((q & 0x7u) << 22));
}

// One expert's packed matrix (all experts of a checkpoint in one format and shape), found by
// expert id through a table on the device.
struct ExpertPacked {
    const u8* codes;
    const float* scales;
    const u8* scale_codes;
    const float* row_global;
};
