// The tensor-core GEMM engine (sm_80 path): C = op(A)·op(B), bf16 operands, f32
// accumulation, one 128x128 output tile per block, the result handed element by element to
// an epilogue functor instead of being stored. Users: kron_syrk_ema_tc (kernels/kron.cu,
// lower-triangle tiles, EMA + mirror epilogue) and newton_gemm_tc (kernels/newton.cu, the
// Newton algebra epilogue). Design and analytical floor: docs/gpu.md "GEMM engine".
//
// - Block 256 threads = 8 warps in 2 (M) x 4 (N), each a 64x32 warp tile = 4x4 mma.m16n8k16
//   accumulators (64 f32 registers per thread).
// - K slices of 32, a 3-stage cp.async pipeline (GRNG_GEMM_SMEM = 48 KiB of dynamic shared
//   memory): while the tensor cores work on slice k, slices k+1 and k+2 are in flight.
// - Shared tiles are stored with the k or the m/n dimension contiguous, whichever is
//   contiguous in global memory (so each thread moves 16-byte chunks), XOR-swizzled
//   (grng_swizzle) so that cp.async writes and ldmatrix reads are bank-conflict free without
//   padding; ldmatrix (.trans for the k-outer layout) produces the mma fragments directly.
// - Ragged M, N, K: rows past the edge are zero-filled by cp.async's src-size (a partial
//   chunk reads only what exists), so the K tail adds zeros and edge tiles compute garbage-
//   free zeros that the epilogue skips. When a row stride is not a multiple of 8 elements or
//   a base is not 16-byte aligned, 16-byte chunks would straddle rows: the loader then
//   gathers the chunk element by element (synchronous shared stores, same barriers).
//
// Operand layouts (template parameters): GrngKInner stores element (o, k) at p[o·ld + k]
// (k contiguous: A row-major, or B transposed), GrngKOuter at p[k·ld + o] (o contiguous: B
// row-major, or Aᵀ as the A operand — the SYRK's AᵀA reads the row-major A twice this way).
#pragma once

#include "mma_sm80.cuh"

#define GRNG_GEMM_BM 128  // block tile rows (M) and columns (N)
#define GRNG_GEMM_BK 32   // K slice
#define GRNG_GEMM_STAGES 3
#define GRNG_GEMM_THREADS 256
// One stage holds a 128x32 tile of each operand (bf16).
#define GRNG_GEMM_STAGE_ELEMS (2 * GRNG_GEMM_BM * GRNG_GEMM_BK)
#define GRNG_GEMM_SMEM (GRNG_GEMM_STAGES * GRNG_GEMM_STAGE_ELEMS * 2)

// One 16-byte chunk (8 bf16) of a tile: elements (row, col..col+8) of p into the shared dst,
// zero past nrows x ncols. `vec` (16-byte aligned rows) takes cp.async (zero-filled past the
// edge); otherwise element-wise loads packed into one 16-byte store. Shared by the sm_80
// engine and the sm_90a loader (wgmma_sm90.cuh).
__device__ __forceinline__ void grng_gemm_load_chunk(void* dst,
                                                     const __nv_bfloat16* __restrict__ p, int ld,
                                                     int row, int col, int nrows, int ncols,
                                                     bool vec) {
    const bool in_row = row < nrows;
    if (vec) {
        const int have = in_row ? min(max(ncols - col, 0), 8) : 0;
        grng_cp_async_16(dst, have > 0 ? p + (long long)row * ld + col : p, 2 * have);
    } else {
        unsigned w[4] = {0u, 0u, 0u, 0u};
        for (int e = 0; e < 8; ++e)
            if (in_row && col + e < ncols)
                w[e >> 1] |= (unsigned)__bfloat16_as_ushort(p[(long long)row * ld + col + e])
                             << (16 * (e & 1));
        *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// Moves the 16-byte chunks of a Rows x Cols (bf16) tile at global (row0, col0) of a matrix
// with element (row, col) at p[row·ld + col] (rows < nrows, cols < ncols exist) into the
// swizzled shared tile st. vec: cp.async (needs ld % 8 == 0 and p 16-byte aligned); else
// element-wise gathers.
template <int Rows, int Cols>
__device__ __forceinline__ void grng_gemm_load_tile(__nv_bfloat16* st,
                                                    const __nv_bfloat16* __restrict__ p, int ld,
                                                    int row0, int col0, int nrows, int ncols,
                                                    bool vec) {
    constexpr int kChunks = Cols / 8;
    constexpr int kPerThread = Rows * kChunks / GRNG_GEMM_THREADS;
    static_assert(kPerThread * GRNG_GEMM_THREADS == Rows * kChunks, "tile / thread mismatch");
GRNG_UNROLL
    for (int q = 0; q < kPerThread; ++q) {
        const int ch = threadIdx.x + GRNG_GEMM_THREADS * q;
        const int r = ch / kChunks, c = ch % kChunks;
        const int row = row0 + r, col = col0 + 8 * c;
        __nv_bfloat16* dst = st + grng_swizzle<kChunks>(r, c);
        grng_gemm_load_chunk(dst, p, ld, row, col, nrows, ncols, vec);
    }
}

// Element (o, k) of an operand at p[o·ld + k]: shared tile [128 o][32 k].
struct GrngKInner {
    static constexpr int kChunks = GRNG_GEMM_BK / 8;
    __device__ static void load(__nv_bfloat16* st, const __nv_bfloat16* p, int ld, int o0,
                                int k0, int no, int nk, bool vec) {
        grng_gemm_load_tile<GRNG_GEMM_BM, GRNG_GEMM_BK>(st, p, ld, o0, k0, no, nk, vec);
    }
    // Four 8x8 matrices; matrix j covers o0 + oo[j].., k0 + ko[j]..: lane l addresses row
    // o0 + oo[l/8] + l%8 (k contiguous, so no .trans).
    __device__ static void frag(unsigned (&r)[4], const __nv_bfloat16* st, int o0, int k0,
                                int oo, int ko, int lane_row) {
        grng_ldmatrix_x4<false>(r, st + grng_swizzle<kChunks>(o0 + oo + lane_row, (k0 + ko) / 8));
    }
};

// Element (o, k) of an operand at p[k·ld + o]: shared tile [32 k][128 o].
struct GrngKOuter {
    static constexpr int kChunks = GRNG_GEMM_BM / 8;
    __device__ static void load(__nv_bfloat16* st, const __nv_bfloat16* p, int ld, int o0,
                                int k0, int no, int nk, bool vec) {
        grng_gemm_load_tile<GRNG_GEMM_BK, GRNG_GEMM_BM>(st, p, ld, k0, o0, nk, no, vec);
    }
    // Rows are k here: lane l addresses row k0 + ko[l/8] + l%8, and .trans hands out the
    // (o, k) fragment.
    __device__ static void frag(unsigned (&r)[4], const __nv_bfloat16* st, int o0, int k0,
                                int oo, int ko, int lane_row) {
        grng_ldmatrix_x4<true>(r, st + grng_swizzle<kChunks>(k0 + ko + lane_row, (o0 + oo) / 8));
    }
};

__device__ __forceinline__ bool grng_gemm_vec_ok(const __nv_bfloat16* p, int ld) {
    return (ld & 7) == 0 && (reinterpret_cast<unsigned long long>(p) & 15) == 0;
}

// Split products (f32 accuracy on bf16 tensor cores): an f32 operand x is stored as three
// bf16 planes x = hi + mid + lo (grng_split3; 24 significant bits, exact for normal floats),
// plane p at base + p·plane. Of the 9 plane products the 6 above 2^-24 relative are summed,
// the small ones first so their roundings stay ~2^-8 below the final sum's:
// mid·mid, hi·lo, lo·hi, hi·mid, mid·hi, hi·hi. Term t's planes: 2-bit fields of these masks.
#define GRNG_SPLIT3_TERMS 6
#define GRNG_SPLIT3_A_PLANES 0x121  // t = 0..5 → 1, 0, 2, 0, 1, 0
#define GRNG_SPLIT3_B_PLANES 0x049  // t = 0..5 → 1, 2, 0, 1, 0, 0

// The three bf16 planes of x: hi = bf16(x), mid = bf16(x − hi), lo = bf16(x − hi − mid) (the
// differences are exact in f32).
__device__ __forceinline__ void grng_split3(float x, __nv_bfloat16& hi, __nv_bfloat16& mid,
                                            __nv_bfloat16& lo) {
    hi = __float2bfloat16_rn(x);
    const float r = x - __bfloat162float(hi);
    mid = __float2bfloat16_rn(r);
    lo = __float2bfloat16_rn(r - __bfloat162float(mid));
}

// The block's 128x128 tile of C = op(A)·op(B) at rows i0.., columns j0.. (op(A) M x K,
// op(B) K x N), handed to epi(i, j, value) for every i < M, j < N of the tile; then
// epi.finish() is called by every thread (block reductions). Terms = 1: plain bf16 operands
// (a_plane, b_plane unused); Terms = GRNG_SPLIT3_TERMS: A and B are split3 planes a_plane /
// b_plane elements apart, and the K loop runs over the 6 plane products in turn. smem:
// GRNG_GEMM_SMEM bytes of dynamic shared memory. Every thread of the 256-thread block must
// call it.
template <class AL, class BL, int Terms, class Epi>
__device__ __forceinline__ void grng_gemm_tile(const __nv_bfloat16* __restrict__ A, int lda,
                                               long long a_plane,
                                               const __nv_bfloat16* __restrict__ B, int ldb,
                                               long long b_plane, int M, int N, int K, int i0,
                                               int j0, __nv_bfloat16* smem, Epi& epi) {
    static_assert(Terms == 1 || Terms == GRNG_SPLIT3_TERMS, "plain or split3 products");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = (warp & 1) * 64, wn = (warp >> 1) * 32;
    const int rows_left = M - i0 - wm, cols_left = N - j0 - wn;  // of this warp's tile
    // Every plane must be 16-byte aligned for cp.async: the plane stride too.
    const bool vec_a = grng_gemm_vec_ok(A, lda) && (Terms == 1 || (a_plane & 7) == 0);
    const bool vec_b = grng_gemm_vec_ok(B, ldb) && (Terms == 1 || (b_plane & 7) == 0);
    const int nk = grng_ceil_div(K, GRNG_GEMM_BK);
    const int nslices = Terms * nk;  // slice v: term v / nk, K slice v % nk

    float acc[4][4][4];
GRNG_UNROLL
    for (int mi = 0; mi < 4; ++mi)
GRNG_UNROLL
        for (int nj = 0; nj < 4; ++nj)
GRNG_UNROLL
            for (int e = 0; e < 4; ++e) acc[mi][nj][e] = 0.0f;

    // Stage s: A tile at smem + s·STAGE_ELEMS, B tile right after it.
    auto load_stage = [&](int s, int v) {
        __nv_bfloat16* st = smem + s * GRNG_GEMM_STAGE_ELEMS;
        const int t = v / nk, k0 = (v - t * nk) * GRNG_GEMM_BK;
        const int pa = (GRNG_SPLIT3_A_PLANES >> (2 * t)) & 3;
        const int pb = (GRNG_SPLIT3_B_PLANES >> (2 * t)) & 3;
        const __nv_bfloat16* a = Terms == 1 ? A : A + pa * a_plane;
        const __nv_bfloat16* b = Terms == 1 ? B : B + pb * b_plane;
        AL::load(st, a, lda, i0, k0, M, K, vec_a);
        BL::load(st + GRNG_GEMM_BM * GRNG_GEMM_BK, b, ldb, j0, k0, N, K, vec_b);
    };
GRNG_UNROLL
    for (int s = 0; s < GRNG_GEMM_STAGES - 1; ++s) {
        if (s < nslices) load_stage(s, s);
        grng_cp_async_commit();
    }

    // ldmatrix x4 register j: A covers (m + 8(j&1), k + 8(j>>1)), a pair of B n8 tiles
    // (k + 8(j&1), n + 8(j>>1)) — the a[0..3] and b[0..1], b'[0..1] fragment orders.
    const int lrow = lane & 7, lj = lane >> 3;
    const int a_oo = 8 * (lj & 1), a_ko = 8 * (lj >> 1);
    const int b_oo = 8 * (lj >> 1), b_ko = 8 * (lj & 1);
    for (int kt = 0; kt < nslices; ++kt) {
        // Slice kt's group is complete once at most STAGES-2 younger ones are in flight; the
        // barrier also retires every warp's reads of the stage the next load overwrites.
        grng_cp_async_wait<GRNG_GEMM_STAGES - 2>();
        __syncthreads();
        const int next = kt + GRNG_GEMM_STAGES - 1;
        if (next < nslices) load_stage(next % GRNG_GEMM_STAGES, next);
        grng_cp_async_commit();

        const __nv_bfloat16* sa = smem + (kt % GRNG_GEMM_STAGES) * GRNG_GEMM_STAGE_ELEMS;
        const __nv_bfloat16* sb = sa + GRNG_GEMM_BM * GRNG_GEMM_BK;
        const int k_left = K - (kt % nk) * GRNG_GEMM_BK;
GRNG_UNROLL
        for (int kk = 0; kk < GRNG_GEMM_BK; kk += 16) {
            // Warp-uniform skips of all-zero work past the M, N, K edges (ragged and small
            // shapes): 16-row A fragments, 16-column B pairs, 16-deep steps.
            if (kk >= k_left) break;
            unsigned af[4][4] = {}, bf[4][2] = {};
GRNG_UNROLL
            for (int mi = 0; mi < 4; ++mi)
                if (16 * mi < rows_left) AL::frag(af[mi], sa, wm + 16 * mi, kk, a_oo, a_ko, lrow);
GRNG_UNROLL
            for (int np = 0; np < 2; ++np) {
                if (16 * np >= cols_left) continue;
                unsigned r[4];
                BL::frag(r, sb, wn + 16 * np, kk, b_oo, b_ko, lrow);
                bf[2 * np][0] = r[0];
                bf[2 * np][1] = r[1];
                bf[2 * np + 1][0] = r[2];
                bf[2 * np + 1][1] = r[3];
            }
GRNG_UNROLL
            for (int mi = 0; mi < 4; ++mi)
GRNG_UNROLL
                for (int nj = 0; nj < 4; ++nj)
                    if (16 * mi < rows_left && 8 * nj < cols_left)
                        grng_mma_bf16_16816(acc[mi][nj], af[mi], bf[nj], acc[mi][nj]);
        }
    }
    grng_cp_async_wait<0>();  // only empty groups remain; leaves nothing in flight

    // D fragment: c[2h + e] is row g + 8h, column 2t + e of the 16x8 tile.
    const int g = lane >> 2, t = lane & 3;
GRNG_UNROLL
    for (int mi = 0; mi < 4; ++mi)
GRNG_UNROLL
        for (int nj = 0; nj < 4; ++nj)
GRNG_UNROLL
            for (int h = 0; h < 2; ++h) {
                const int i = i0 + wm + 16 * mi + g + 8 * h;
                const int j = j0 + wn + 8 * nj + 2 * t;
                if (i < M) {
                    if (j < N) epi(i, j, acc[mi][nj][2 * h]);
                    if (j + 1 < N) epi(i, j + 1, acc[mi][nj][2 * h + 1]);
                }
            }
    epi.finish();
}

// grng_gemm_tile with the operand layouts chosen at run time: layouts bit 0 → A k-outer
// (op(A) = Aᵀ of a K x M row-major A), else k-inner; bit 1 → B k-inner (op(B) = Bᵀ of an
// N x K row-major B), else k-outer. Block (x, y) computes tile (y, x).
template <int Terms, class Epi>
__device__ __forceinline__ void grng_gemm_tile_any(const __nv_bfloat16* __restrict__ A, int lda,
                                                   long long a_plane,
                                                   const __nv_bfloat16* __restrict__ B, int ldb,
                                                   long long b_plane, int M, int N, int K,
                                                   int layouts, __nv_bfloat16* smem, Epi& epi) {
    const int i0 = blockIdx.y * GRNG_GEMM_BM, j0 = blockIdx.x * GRNG_GEMM_BM;
    switch (layouts & 3) {
        case 0:
            grng_gemm_tile<GrngKInner, GrngKOuter, Terms>(A, lda, a_plane, B, ldb, b_plane, M, N,
                                                          K, i0, j0, smem, epi);
            break;
        case 1:
            grng_gemm_tile<GrngKOuter, GrngKOuter, Terms>(A, lda, a_plane, B, ldb, b_plane, M, N,
                                                          K, i0, j0, smem, epi);
            break;
        case 2:
            grng_gemm_tile<GrngKInner, GrngKInner, Terms>(A, lda, a_plane, B, ldb, b_plane, M, N,
                                                          K, i0, j0, smem, epi);
            break;
        default:
            grng_gemm_tile<GrngKOuter, GrngKInner, Terms>(A, lda, a_plane, B, ldb, b_plane, M, N,
                                                          K, i0, j0, smem, epi);
            break;
    }
}

// Lower-triangle tile pair of linear block b of a triangular grid: b = bi(bi+1)/2 + bj,
// 0 ≤ bj ≤ bi (symmetric outputs compute these tiles only and mirror them).
__device__ __forceinline__ void grng_tri_tile(int b, int& bi, int& bj) {
    long long i = (long long)((sqrtf(8.0f * (float)b + 1.0f) - 1.0f) * 0.5f);
    // The float square root can be off by one for large b: correct it exactly.
    while (i * (i + 1) / 2 > b) --i;
    while ((i + 1) * (i + 2) / 2 <= b) ++i;
    bi = (int)i;
    bj = (int)(b - i * (i + 1) / 2);
}
