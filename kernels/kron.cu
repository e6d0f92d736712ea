// Kronecker-factor accumulation (SPEC §1, §5.1): Λ ← εΛ + α·AᵀA with α = (1−ε)/m, for A of
// shape m x n (row-major, f32 or bf16) and Λ n x n (row-major f32). The CPU oracle is
// src/cpu/kron.rs `syrk_ema`. The batch gradient (1/m)EᵀA reuses precond.cu's GEMM.
//
// Both kernels share one scheme: a 1-D grid over the nt(nt+1)/2 lower-triangle 64x64 tile
// pairs (bi ≥ bj, nt = ceil(n/64)), so the upper triangle costs no FLOPs; each block stages
// its α·AᵀA tile in shared memory and the epilogue writes the EMA result into the lower
// tile and, transposed through shared memory, into the mirrored upper tile — both with
// coalesced row writes. The value written at (i, j) and (j, i) is the same float, so Λ is
// exactly symmetric. Only the lower triangle of the old Λ is read, and only when ε ≠ 0
// (ε = 0 replaces Λ, which may then hold NaN). Blocks write disjoint tiles: no atomics.
//
// Launchers: src/cuda/kron.rs.
#include "common.cuh"

#define KRON_T 64  // output tile (rows and columns)

// Lower-triangle tile pair of linear block b: b = bi(bi+1)/2 + bj with 0 ≤ bj ≤ bi.
__device__ __forceinline__ void kron_tri_tile(int b, int& bi, int& bj) {
    long long i = (long long)((sqrtf(8.0f * (float)b + 1.0f) - 1.0f) * 0.5f);
    // The float square root can be off by one for large b: correct it exactly.
    while (i * (i + 1) / 2 > b) --i;
    while ((i + 1) * (i + 2) / 2 <= b) ++i;
    bi = (int)i;
    bj = (int)(b - i * (i + 1) / 2);
}

// Epilogue. S holds α·(AᵀA) of tile (bi, bj): S[r*lds + c] for row bi*64 + r, column
// bj*64 + c. Pass 1 writes the lower tile (for a diagonal tile, c ≤ r) as ε·Λ_old + S, read
// and written along rows, and keeps the result in S; pass 2 writes the upper tile (bj, bi)
// from S transposed (for a diagonal tile, c > r). Every thread of the block must call it.
__device__ __forceinline__ void kron_ema_mirror_store(float* S, int lds, float* __restrict__ L,
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
    kron_syrk_ema_f32(const float* __restrict__ A, float* __restrict__ L, int m, int n,
                      float alpha, float eps) {
    // Main loop: As, Bs (2 x 16 x 68 floats); epilogue: the 64 x 65 staging tile.
    __align__(16) __shared__ float smem[KRON_T * KF_SLD];
    float* As = smem;
    float* Bs = smem + KF_BK * KF_LDS;
    int bi, bj;
    kron_tri_tile(blockIdx.x, bi, bj);
    const bool diag = bi == bj;
    const float* Bt = diag ? As : Bs;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;

    float acc[4][4];
GRNG_UNROLL
    for (int r = 0; r < 4; ++r)
GRNG_UNROLL
        for (int c = 0; c < 4; ++c) acc[r][c] = 0.0f;

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
    kron_ema_mirror_store(smem, KF_SLD, L, n, bi, bj, eps);
}
GRNG_EMU_ENTRY(kron_syrk_ema_f32, (const float*, float*, int, int, float, float))

// ---------------------------------------------------------------------------------------
// bf16 tensor-core path (WMMA m16n16k16, bf16 inputs, f32 accumulation). 128 threads =
// 4 warps in a 2x2 layout, each owning a 32x32 quarter of the tile (2x2 accumulator
// fragments); 32-deep sample slices. Tiles are staged in shared memory zero-padded, which
// handles ragged m and n and any alignment of A (WMMA needs 32-byte aligned tiles with
// 16-byte multiple strides; rows of 72 bf16 = 144 bytes keep every 16x16 fragment aligned
// and stagger the banks). Global → shared moves 8 bf16 (16 bytes) per access when n % 8 == 0
// and A is 16-byte aligned, else element by element; the next slice is prefetched into
// registers during the MMAs. Aᵀ's 16x16 fragment (rows i, depth s) is the column-major view
// of the staged A[s][i]; A's fragment (depth s, columns j) the row-major view.
#define KT_BK 32
#define KT_LDA (KRON_T + 8)  // bf16 elements per staged row
#define KT_THREADS 128
#define KT_SLD (KRON_T + 4)  // f32 staging stride: a multiple of 4 as WMMA stores need
#define KT_STAGE_BYTES (KRON_T * KT_SLD * 4)
#define KT_TILE_ELEMS (KT_BK * KT_LDA)

// Loads the 32x64 slice A[s0.., c0..] as 2 chunks of 8 bf16 per thread (bits, zero padded).
__device__ __forceinline__ void kt_load(const __nv_bfloat16* __restrict__ A, int m, int n,
                                        int s0, int c0, bool vec, uint4 (&r)[2]) {
GRNG_UNROLL
    for (int l = 0; l < 2; ++l) {
        const int ch = threadIdx.x + KT_THREADS * l;  // 256 chunks: 32 rows x 8 chunks
        const int s = s0 + ch / 8, c = c0 + (ch % 8) * 8;
        const __nv_bfloat16* p = A + (long long)s * n + c;
        if (vec && s < m && c + 8 <= n) {
            r[l] = *reinterpret_cast<const uint4*>(p);
        } else {
            unsigned w[4];
GRNG_UNROLL
            for (int q = 0; q < 4; ++q) {
                const unsigned lo =
                    (s < m && c + 2 * q < n) ? __bfloat16_as_ushort(p[2 * q]) : 0u;
                const unsigned hi =
                    (s < m && c + 2 * q + 1 < n) ? __bfloat16_as_ushort(p[2 * q + 1]) : 0u;
                w[q] = lo | (hi << 16);
            }
            r[l] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
}

__device__ __forceinline__ void kt_store(__nv_bfloat16* T, const uint4 (&r)[2]) {
GRNG_UNROLL
    for (int l = 0; l < 2; ++l) {
        const int ch = threadIdx.x + KT_THREADS * l;
        *reinterpret_cast<uint4*>(T + (ch / 8) * KT_LDA + (ch % 8) * 8) = r[l];
    }
}

// Grid (nt(nt+1)/2), block 128, no dynamic shared memory.
extern "C" __global__ void __launch_bounds__(KT_THREADS)
    kron_syrk_ema_tc(const __nv_bfloat16* __restrict__ A, float* __restrict__ L, int m, int n,
                     float alpha, float eps) {
    using namespace nvcuda;
    // Main loop: As, Bs (2 x 32 x 72 bf16 = 9 KiB); epilogue: the 64 x 68 f32 staging tile.
    __align__(128) __shared__ unsigned char smem_raw[KT_STAGE_BYTES];
    __nv_bfloat16* As = reinterpret_cast<__nv_bfloat16*>(smem_raw);
    __nv_bfloat16* Bs = As + KT_TILE_ELEMS;
    float* S = reinterpret_cast<float*>(smem_raw);
    int bi, bj;
    kron_tri_tile(blockIdx.x, bi, bj);
    const bool diag = bi == bj;
    const __nv_bfloat16* Bt = diag ? As : Bs;
    const int warp = threadIdx.x / 32;
    const int wm = (warp / 2) * 32, wn = (warp % 2) * 32;
    const bool vec = (n % 8 == 0) && (reinterpret_cast<unsigned long long>(A) % 16 == 0);

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
GRNG_UNROLL
    for (int fi = 0; fi < 2; ++fi)
GRNG_UNROLL
        for (int fj = 0; fj < 2; ++fj) wmma::fill_fragment(acc[fi][fj], 0.0f);

    uint4 ra[2], rb[2];
    kt_load(A, m, n, 0, bi * KRON_T, vec, ra);
    if (!diag) kt_load(A, m, n, 0, bj * KRON_T, vec, rb);
    for (int s0 = 0; s0 < m; s0 += KT_BK) {
        __syncthreads();
        kt_store(As, ra);
        if (!diag) kt_store(Bs, rb);
        __syncthreads();
        if (s0 + KT_BK < m) {
            kt_load(A, m, n, s0 + KT_BK, bi * KRON_T, vec, ra);
            if (!diag) kt_load(A, m, n, s0 + KT_BK, bj * KRON_T, vec, rb);
        }
GRNG_UNROLL
        for (int ks = 0; ks < KT_BK; ks += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::col_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb[2];
GRNG_UNROLL
            for (int f = 0; f < 2; ++f) {
                wmma::load_matrix_sync(fa[f], As + ks * KT_LDA + wm + 16 * f, KT_LDA);
                wmma::load_matrix_sync(fb[f], Bt + ks * KT_LDA + wn + 16 * f, KT_LDA);
            }
GRNG_UNROLL
            for (int fi = 0; fi < 2; ++fi)
GRNG_UNROLL
                for (int fj = 0; fj < 2; ++fj)
                    wmma::mma_sync(acc[fi][fj], fa[fi], fb[fj], acc[fi][fj]);
        }
    }

    __syncthreads();  // the staging tile overlays As/Bs
GRNG_UNROLL
    for (int fi = 0; fi < 2; ++fi)
GRNG_UNROLL
        for (int fj = 0; fj < 2; ++fj) {
            for (int t = 0; t < acc[fi][fj].num_elements; ++t) acc[fi][fj].x[t] *= alpha;
            wmma::store_matrix_sync(S + (wm + 16 * fi) * KT_SLD + wn + 16 * fj, acc[fi][fj],
                                    KT_SLD, wmma::mem_row_major);
        }
    __syncthreads();
    kron_ema_mirror_store(S, KT_SLD, L, n, bi, bj, eps);
}
GRNG_EMU_ENTRY(kron_syrk_ema_tc, (const __nv_bfloat16*, float*, int, int, float, float))
