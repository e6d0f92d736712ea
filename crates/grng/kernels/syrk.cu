// Kronecker-factor accumulation (docs/math.md §1, §5.1): Λ ← εΛ + α·AᵀA with α = (1−ε)/m, for A of
// shape m x n (row-major, f32 or bf16) and Λ n x n (row-major f32). The CPU oracle is
// src/cpu/syrk.rs `syrk_ema`. The batch gradient (1/m)EᵀA reuses precond.cu's GEMM.
//
// Both kernels share one scheme: a 1-D grid over the nt(nt+1)/2 lower-triangle tile pairs
// (bi ≥ bj; 64x64 tiles for f32, the GEMM engine's 128x128 for bf16), so the upper triangle
// costs no FLOPs; the epilogue writes the EMA result into the lower tile and the same float
// into the mirrored upper tile, so Λ is exactly symmetric. Only the lower triangle of the old
// Λ is read, and only when ε ≠ 0 (ε = 0 replaces Λ, which may then hold NaN). Blocks write
// disjoint tiles: no atomics. The f32 kernel stages its tile in shared memory and writes
// both halves with coalesced rows.
//
// Launchers: src/cuda/syrk.rs.
#include "common.cuh"
#include "gemm/engine.cuh"
#include "gemm/wgmma_sm90.cuh"

#define KRON_T 64  // output tile of the f32 kernel (rows and columns)

// Epilogue. S holds α·(AᵀA) of tile (bi, bj): S[r*lds + c] for row bi*64 + r, column
// bj*64 + c. Pass 1 writes the lower tile (for a diagonal tile, c ≤ r) as ε·Λ_old + S, read
// and written along rows, and keeps the result in S; pass 2 writes the upper tile (bj, bi)
// from S transposed (for a diagonal tile, c > r). Every thread of the block must call it.
__device__ __forceinline__ void syrk_ema_mirror_store(float* S, int lds, float* __restrict__ L,
                                                      int n, int bi, int bj, float eps) {
    const int i0 = bi * KRON_T, j0 = bj * KRON_T;
    const bool diag = bi == bj;
    for (int e = threadIdx.x; e < KRON_T * KRON_T; e += blockDim.x) {
        const int r = e / KRON_T, c = e % KRON_T;
        const int i = i0 + r, j = j0 + c;
        if (i < n && j < n && (!diag || c <= r)) {
            float v = S[r * lds + c];
            float* p = L + (long long)i * n + j;
            if (eps != 0.0f) v = fmaf(eps, *p, v);
            *p = v;
            S[r * lds + c] = v;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < KRON_T * KRON_T; e += blockDim.x) {
        const int r = e / KRON_T, c = e % KRON_T;  // upper element (j0 + r, i0 + c)
        const int row = j0 + r, col = i0 + c;
        if (row < n && col < n && (!diag || c > r)) L[(long long)row * n + col] = S[c * lds + r];
    }
}

// ---------------------------------------------------------------------------------------
// fp32 path. 256 threads, each a 4x4 register block of the 64x64 tile; 16-deep slices of
// the m (sample) dimension. Both operand tiles are column blocks of the same row-major A,
// so loading A[s0..s0+16, i0..i0+64] row by row is coalesced and lands k-major in shared
// memory as the micro-kernel wants it (float4 reads, rows padded to 68 floats). A diagonal
// tile loads one operand only. The next slice is prefetched into registers.
#define KF_BK 16
#define KF_LDS (KRON_T + 4)
#define KF_THREADS 256
#define KF_SLD (KRON_T + 1)  // epilogue staging: odd stride, conflict-free transposed reads

__device__ __forceinline__ void kf_load(const float* __restrict__ A, int m, int n, int s0,
                                        int c0, float (&r)[4]) {
GRNG_UNROLL
    for (int l = 0; l < 4; ++l) {
        const int e = threadIdx.x + KF_THREADS * l;
        const int s = s0 + e / KRON_T, c = c0 + e % KRON_T;
        r[l] = (s < m && c < n) ? A[(long long)s * n + c] : 0.0f;
    }
}

__device__ __forceinline__ void kf_store(float* T, const float (&r)[4]) {
GRNG_UNROLL
    for (int l = 0; l < 4; ++l) {
        const int e = threadIdx.x + KF_THREADS * l;
        T[(e / KRON_T) * KF_LDS + e % KRON_T] = r[l];
    }
}

// Grid (nt(nt+1)/2), block 256, no dynamic shared memory.
extern "C" __global__ void __launch_bounds__(KF_THREADS)
    syrk_ema_f32(const float* __restrict__ A, float* __restrict__ L, int m, int n,
                      float alpha, float eps) {
    // Main loop: As, Bs (2 x 16 x 68 floats); epilogue: the 64 x 65 staging tile.
    __align__(16) __shared__ float smem[KRON_T * KF_SLD];
    float* As = smem;
    float* Bs = smem + KF_BK * KF_LDS;
    int bi, bj;
    grng_tri_tile(blockIdx.x, bi, bj);
    const bool diag = bi == bj;
    const float* Bt = diag ? As : Bs;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;

    float acc[4][4] = {};

    float ra[4], rb[4];
    kf_load(A, m, n, 0, bi * KRON_T, ra);
    if (!diag) kf_load(A, m, n, 0, bj * KRON_T, rb);
    for (int s0 = 0; s0 < m; s0 += KF_BK) {
        __syncthreads();
        kf_store(As, ra);
        if (!diag) kf_store(Bs, rb);
        __syncthreads();
        if (s0 + KF_BK < m) {
            kf_load(A, m, n, s0 + KF_BK, bi * KRON_T, ra);
            if (!diag) kf_load(A, m, n, s0 + KF_BK, bj * KRON_T, rb);
        }
        grng_fma_slice_4x4<KF_BK, KF_LDS>(As, Bt, ty, tx, acc);
    }

    __syncthreads();  // the staging tile overlays As/Bs
GRNG_UNROLL
    for (int r = 0; r < 4; ++r)
GRNG_UNROLL
        for (int c = 0; c < 4; ++c) smem[(ty * 4 + r) * KF_SLD + tx * 4 + c] = alpha * acc[r][c];
    __syncthreads();
    syrk_ema_mirror_store(smem, KF_SLD, L, n, bi, bj, eps);
}
GRNG_EMU_ENTRY(syrk_ema_f32, (const float*, float*, int, int, float, float))

// ---------------------------------------------------------------------------------------
// bf16 tensor-core path: the GEMM engine (kernels/gemm/engine.cuh) on 128x128 lower-triangle
// tiles, Aᵀ·A with both operands read k-outer from the row-major A (m x n, ld n). The EMA
// and the mirror are applied from the accumulator registers: element (i, j ≤ i) is read
// once (ε ≠ 0), written to (i, j) and, off the diagonal, to (j, i) — the same float, so Λ is
// exactly symmetric. Elements j > i of a diagonal tile are the mirror's business.
struct KronEmaMirror {
    float* __restrict__ L;
    int n;
    float alpha, eps;
    __device__ __forceinline__ void operator()(int i, int j, float acc) {
        if (j > i) return;
        float v = alpha * acc;
        float* p = L + (long long)i * n + j;
        if (eps != 0.0f) v = fmaf(eps, *p, v);
        *p = v;
        if (j < i) L[(long long)j * n + i] = v;
    }
    __device__ __forceinline__ void finish() {}
};

// The tensor-core SYRK entry points: the mainloop TILE (grng_gemm_tile, or the sm_90a
// grng_wg_gemm_tile) on the lower-triangle tile of blockIdx.x, __launch_bounds__(__VA_ARGS__).
#define SYRK_EMA_TC(name, TILE, ...)                                                           \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__)                                  \
        name(const __nv_bfloat16* __restrict__ A, float* __restrict__ L, int m, int n,          \
             float alpha, float eps) {                                                         \
        GRNG_DYN_SHARED(__nv_bfloat16, smem);                                                  \
        int bi, bj;                                                                            \
        grng_tri_tile(blockIdx.x, bi, bj);                                                     \
        KronEmaMirror epi{L, n, alpha, eps};                                                   \
        TILE<GrngKOuter, GrngKOuter, 1>(A, n, 0, A, n, 0, n, n, m, bi * GRNG_GEMM_BM,          \
                                        bj * GRNG_GEMM_BM, smem, epi);                         \
    }

// Grid (nt(nt+1)/2) with nt = ceil(n/128), block 256, GRNG_GEMM_SMEM bytes of dynamic
// shared memory.
SYRK_EMA_TC(syrk_ema_tc, grng_gemm_tile, GRNG_GEMM_THREADS)
GRNG_EMU_ENTRY(syrk_ema_tc, (const __nv_bfloat16*, float*, int, int, float, float))

// ---------------------------------------------------------------------------------------
// y = bf16(x), round-to-nearest-even, `count` elements, grid-stride: the f32 statistics of a
// KronOptimizer with stats_precision = Bf16, rounded once so the factor runs syrk_ema_tc
// (bandwidth-bound: 6 bytes per element). Any grid, block a multiple of 32.
extern "C" __global__ void syrk_round_bf16(const float* __restrict__ x,
                                           __nv_bfloat16* __restrict__ y, long long count) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x)
        grng_st_bf16(&y[i], x[i]);
}
GRNG_EMU_ENTRY(syrk_round_bf16, (const float*, __nv_bfloat16*, long long))

#ifdef GRNG_SM90A
// The sm_90a instance (kernels/gemm/wgmma_sm90.cuh), same parameters, grid and epilogue;
// block 384, GRNG_WG_SMEM bytes of dynamic shared memory. Only in the compute_90a build.
SYRK_EMA_TC(syrk_ema_wg_tc, grng_wg_gemm_tile, GRNG_WG_THREADS, 1)
#endif
