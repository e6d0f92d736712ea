// Included first by every kernel file (see kernels/README.md for the conventions).
//
// Two builds of the same sources:
// - CUDA (NVRTC or nvcc → PTX): the real headers. No host standard headers here: NVRTC
//   has none.
// - GRNG_EMU (g++ → CPU, for tests): emu/cuda_emu.h provides the subset of CUDA we use.
#pragma once

#ifdef GRNG_EMU
#include "emu/cuda_emu.h"
#else
// bf16 is converted explicitly (__float2bfloat16 / __bfloat162float) in both builds: the
// emulated type has no implicit conversions or operators, and neither has CUDA's with these.
#define __CUDA_NO_BFLOAT16_CONVERSIONS__
#define __CUDA_NO_BFLOAT16_OPERATORS__
#include <cuda_bf16.h>
#include <mma.h>

// The emulation entry point exists only in the CPU build.
#define GRNG_EMU_ENTRY(...)

// Dynamic shared memory of the launch (LaunchConfig::shared_mem bytes), 128-byte aligned.
#define GRNG_DYN_SHARED(T, name)                                          \
    extern __shared__ __align__(128) unsigned char grng_dyn_smem_raw_[]; \
    T* name = reinterpret_cast<T*>(grng_dyn_smem_raw_)
#endif

#define GRNG_FULL_MASK 0xffffffffu

// Full unrolling of the constant-trip loops (g++ of the emulator build has no such pragma).
#ifdef GRNG_EMU
#define GRNG_UNROLL
#else
#define GRNG_UNROLL _Pragma("unroll")
#endif

// ceil(a / b) for positive b.
__host__ __device__ __forceinline__ int grng_ceil_div(int a, int b) { return (a + b - 1) / b; }

// Sum of `v` over the 32 lanes of a full warp, returned to every lane.
__device__ __forceinline__ float grng_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(GRNG_FULL_MASK, v, o);
    return v;
}

// Maximum of `v` over a full warp, returned to every lane.
__device__ __forceinline__ float grng_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(GRNG_FULL_MASK, v, o));
    return v;
}

// `v` reduced over the whole block by the warp reduction `Warp`, returned to every thread;
// `identity` stands in for the warps a block does not have. blockDim.x * blockDim.y *
// blockDim.z must be a multiple of 32; `scratch` is shared memory of at least 32 floats.
// Every thread of the block must call it (it contains __syncthreads); scratch may be reused
// right after it returns.
template <float (*Warp)(float)>
__device__ __forceinline__ float grng_block_reduce(float v, float* scratch, float identity) {
    const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int nwarps = (blockDim.x * blockDim.y * blockDim.z) / 32;
    v = Warp(v);
    if ((tid & 31) == 0) scratch[tid >> 5] = v;
    __syncthreads();
    float t = (tid & 31) < nwarps ? scratch[tid & 31] : identity;
    t = Warp(t);
    __syncthreads();
    return t;
}

// Sum of `v` over the whole block (grng_block_reduce's contract).
__device__ __forceinline__ float grng_block_sum(float v, float* scratch) {
    return grng_block_reduce<grng_warp_sum>(v, scratch, 0.0f);
}

// Maximum of `v` over the whole block (grng_block_reduce's contract).
__device__ __forceinline__ float grng_block_max(float v, float* scratch) {
    return grng_block_reduce<grng_warp_max>(v, scratch, __int_as_float(0xff800000));  // -inf
}

// A float buffer used as f64 scratch: its first 8-byte aligned address (host buffers of the
// emulator are only 4-byte aligned; the launchers allocate one spare float for this).
__device__ __forceinline__ const double* grng_as_f64(const float* p) {
    const unsigned long long a = (reinterpret_cast<unsigned long long>(p) + 7ull) & ~7ull;
    return reinterpret_cast<const double*>(a);
}
__device__ __forceinline__ double* grng_as_f64(float* p) {
    return const_cast<double*>(grng_as_f64(static_cast<const float*>(p)));
}

// "No bad index" in a first-bad-index status slot (INT_MAX; NVRTC has no <climits>).
#define GRNG_NONE 0x7fffffff

// Safety in the same pass: the warp minimum of each lane's first bad index `v` (GRNG_NONE:
// none), then one atomicMin into `*slot` (global or shared) by lane 0 when a lane saw one.
// Integer min is order-independent, so the slot ends at the first bad index whatever the
// schedule. Every lane of the warp must call it.
__device__ __forceinline__ void grng_flag_first(int* slot, int v) {
    const int m = __reduce_min_sync(GRNG_FULL_MASK, v);
    if ((threadIdx.x & 31) == 0 && m != GRNG_NONE) atomicMin(slot, m);
}

// bf16 ⇄ f32 element access (round-to-nearest-even when narrowing).
__device__ __forceinline__ float grng_ld_bf16(const __nv_bfloat16* p) {
    return __bfloat162float(*p);
}
__device__ __forceinline__ void grng_st_bf16(__nv_bfloat16* p, float v) {
    *p = __float2bfloat16_rn(v);
}

// The three split3 bf16 planes of x (x = hi + mid + lo, exact for normal floats; the f32-accurate
// products of gemm/engine.cuh read them): hi = bf16(x), mid = bf16(x − hi), lo = bf16(x − hi − mid)
// (the differences are exact in f32).
__device__ __forceinline__ void grng_split3(float x, __nv_bfloat16& hi, __nv_bfloat16& mid,
                                            __nv_bfloat16& lo) {
    hi = __float2bfloat16_rn(x);
    const float r = x - __bfloat162float(hi);
    mid = __float2bfloat16_rn(r);
    lo = __float2bfloat16_rn(r - __bfloat162float(mid));
}

// Stores the three planes of x at planes[o], planes[plane + o], planes[2·plane + o]: the
// layout gemm_split3 writes and the split products read (one f32 matrix, plane p at p·plane).
__device__ __forceinline__ void grng_store_split3(__nv_bfloat16* __restrict__ planes,
                                                  long long o, long long plane, float x) {
    __nv_bfloat16 hi, mid, lo;
    grng_split3(x, hi, mid, lo);
    planes[o] = hi;
    planes[plane + o] = mid;
    planes[2 * plane + o] = lo;
}

// Two adjacent bf16 values as floats; `p` must be 4-byte aligned.
__device__ __forceinline__ float2 grng_ld_bf16x2(const __nv_bfloat16* p) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}

// One staged k slice of a 4x4 register block (the fp32 GEMM of precond.cu and the SYRK of
// kron.cu): acc[r][c] += As[kk][ty*4 + r] · Bs[kk][tx*4 + c] for kk < BK, both operands
// stored k-major in shared memory with rows LDS floats apart (16-byte aligned float4 reads).
template <int BK, int LDS>
__device__ __forceinline__ void grng_fma_slice_4x4(const float* As, const float* Bs, int ty,
                                                   int tx, float (&acc)[4][4]) {
GRNG_UNROLL
    for (int kk = 0; kk < BK; ++kk) {
        const float4 a = *reinterpret_cast<const float4*>(&As[kk * LDS + ty * 4]);
        const float4 b = *reinterpret_cast<const float4*>(&Bs[kk * LDS + tx * 4]);
        const float av[4] = {a.x, a.y, a.z, a.w};
        const float bv[4] = {b.x, b.y, b.z, b.w};
GRNG_UNROLL
        for (int r = 0; r < 4; ++r)
GRNG_UNROLL
            for (int c = 0; c < 4; ++c) acc[r][c] = fmaf(av[r], bv[c], acc[r][c]);
    }
}
