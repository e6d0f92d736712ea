// The tensor-core GEMM engine (sm_80 path): C = op(A)·op(B), bf16 operands, f32
// accumulation, one 128x128 output tile per block, the result handed element by element to
// an epilogue functor instead of being stored. Users: syrk_ema_tc (kernels/syrk.cu,
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
// - What a K slice issues is its copies, ldmatrix, mma and their address adds: the loads are
//   planned once per tile (GrngLoadPlan), fragment offsets are per-lane constants, and the
//   gather path is a separate instantiation (docs/gpu.md "Issue budget").
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

// The parameters of a block tile's product, in a template over the epilogue type Epi:
// grng_gemm_mainloop's, grng_gemm_tile's and the sm_90a mainloop's (grng_wg_gemm_tile,
// gemm/wgmma_sm90.cuh); GRNG_GEMM_TILE_ARGS passes them on.
#define GRNG_GEMM_TILE_PARAMS                                                                    \
    const __nv_bfloat16 *__restrict__ A, int lda, long long a_plane,                             \
        const __nv_bfloat16 *__restrict__ B, int ldb, long long b_plane, int M, int N, int K,    \
        int i0, int j0, __nv_bfloat16 *smem, Epi &epi
#define GRNG_GEMM_TILE_ARGS A, lda, a_plane, B, ldb, b_plane, M, N, K, i0, j0, smem, epi

// One 16-byte chunk (8 bf16) of a tile gathered element by element: elements
// (row, col..col+8) of p into the shared dst, zero past nrows x ncols — the loader for rows
// that 16-byte copies would straddle (ld % 8 ≠ 0 or a base not 16-byte aligned), shared by
// the sm_80 engine and the sm_90a producer (wgmma_sm90.cuh).
__device__ __forceinline__ void grng_gemm_gather_chunk(void* dst,
                                                       const __nv_bfloat16* __restrict__ p,
                                                       int ld, int row, int col, int nrows,
                                                       int ncols) {
    const bool in_row = row < nrows;
    unsigned w[4] = {0u, 0u, 0u, 0u};
    for (int e = 0; e < 8; ++e)
        if (in_row && col + e < ncols)
            w[e >> 1] |= (unsigned)__bfloat16_as_ushort(p[(long long)row * ld + col + e])
                         << (16 * (e & 1));
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Gathers the chunks of a Rows x Cols (bf16) tile at global (row0, col0) of a matrix with
// element (row, col) at p[row·ld + col] (rows < nrows, cols < ncols exist) into the swizzled
// shared tile st (synchronous shared stores: the engine's barriers order them).
template <int Rows, int Cols>
__device__ __forceinline__ void grng_gemm_gather_tile(__nv_bfloat16* st,
                                                      const __nv_bfloat16* __restrict__ p,
                                                      int ld, int row0, int col0, int nrows,
                                                      int ncols) {
    constexpr int kChunks = Cols / 8;
    constexpr int kPerThread = Rows * kChunks / GRNG_GEMM_THREADS;
    static_assert(kPerThread * GRNG_GEMM_THREADS == Rows * kChunks, "tile / thread mismatch");
GRNG_UNROLL
    for (int q = 0; q < kPerThread; ++q) {
        const int ch = threadIdx.x + GRNG_GEMM_THREADS * q;
        const int r = ch / kChunks, c = ch % kChunks;
        grng_gemm_gather_chunk(st + grng_swizzle<kChunks>(r, c), p, ld, row0 + r, col0 + 8 * c,
                               nrows, ncols);
    }
}

// Element (o, k) of an operand at p[o·ld + k] (RowsAreK false, GrngKInner: shared tile
// [128 o][32 k]) or at p[k·ld + o] (RowsAreK true, GrngKOuter: shared tile [32 k][128 o]): the
// tile's rows are k when RowsAreK, else o, and its chunks the other index.
template <bool RowsAreK>
struct GrngKLayout {
    static constexpr bool kRowsAreK = RowsAreK;
    static constexpr int kRows = RowsAreK ? GRNG_GEMM_BK : GRNG_GEMM_BM;
    static constexpr int kChunks = (RowsAreK ? GRNG_GEMM_BM : GRNG_GEMM_BK) / 8;
    // The gathered stage tile (grng_gemm_gather_tile).
    __device__ static void gather(__nv_bfloat16* st, const __nv_bfloat16* p, int ld, int o0,
                                  int k0, int no, int nk) {
        if constexpr (RowsAreK)
            grng_gemm_gather_tile<kRows, 8 * kChunks>(st, p, ld, k0, o0, nk, no);
        else
            grng_gemm_gather_tile<kRows, 8 * kChunks>(st, p, ld, o0, k0, no, nk);
    }
    // Four 8x8 matrices; matrix j covers o0 + oo[j].., k0 + ko[j]..: lane l addresses row
    // l%8 of matrix l/8, a tile row o (k-inner: k contiguous, so no .trans) or k (k-outer:
    // .trans hands out the (o, k) fragment). Element offset in the stage tile.
    __device__ static int frag_off(int o0, int k0, int oo, int ko, int lane_row) {
        if constexpr (RowsAreK)
            return grng_swizzle<kChunks>(k0 + ko + lane_row, (o0 + oo) / 8);
        else
            return grng_swizzle<kChunks>(o0 + oo + lane_row, (k0 + ko) / 8);
    }
};
using GrngKInner = GrngKLayout<false>;
using GrngKOuter = GrngKLayout<true>;

// One thread's share of an operand's stage tiles (Rows x Chunks 16-byte chunks, the tile's
// rows k when RowsAreK, else o), planned once per block tile so that a stage's copies cost an
// address add, a select and a cp.async each: chunk q's global address at K offset 0 (the
// operand's first plane), its byte offset in the stage tile (Swz: element offset of chunk
// (r, c)), and how many of its 8 elements exist in a K slice wholly inside K (`have`: 0 past
// the o edge) and in the last slice of K (`tail`, which the K edge may cut).
template <bool RowsAreK, int Rows, int Chunks, int Threads>
struct GrngLoadPlan {
    static constexpr int kPer = Rows * Chunks / Threads;
    static_assert(kPer * Threads == Rows * Chunks, "tile / thread mismatch");
    const __nv_bfloat16* g[kPer];
    int dst[kPer], have[kPer], tail[kPer];

    // p: element (row, col) of the operand at p[row·ld + col] (rows k when RowsAreK); o0: the
    // tile's first o, no: the o extent; nk: the K extent, bk: the K slice; thread: this
    // thread's index among Threads; swz(r, c): the chunk's byte offset in the stage tile.
    template <class Swz>
    __device__ __forceinline__ void init(const __nv_bfloat16* p, int ld, int o0, int no, int nk,
                                         int bk, int thread, Swz swz) {
        const int k_last = (grng_ceil_div(nk, bk) - 1) * bk;  // the last slice's first k
GRNG_UNROLL
        for (int q = 0; q < kPer; ++q) {
            const int ch = thread + Threads * q, r = ch / Chunks, c = ch % Chunks;
            dst[q] = swz(r, c);
            long long at;
            if (RowsAreK) {
                have[q] = min(max(no - o0 - 8 * c, 0), 8);
                tail[q] = k_last + r < nk ? have[q] : 0;
                at = (long long)r * ld + o0 + 8 * c;
            } else {
                have[q] = o0 + r < no ? 8 : 0;
                tail[q] = have[q] > 0 ? min(max(nk - k_last - 8 * c, 0), 8) : 0;
                at = (long long)(o0 + r) * ld + 8 * c;
            }
            // A chunk with nothing to read keeps a valid address (cp.async's contract).
            g[q] = have[q] > 0 ? p + at : p;
        }
    }

    // The copies of the K slice at k0 (`last`: K's last slice) of the plane `plane` elements
    // past the planned one, into the stage tile at byte offset `tile` of the shared buffer
    // (base, base_s), zero-filled past the edges. `fallback`: a valid address for chunks with
    // nothing to read.
    __device__ __forceinline__ void copy(void* base, unsigned base_s, int tile, int k0, bool last,
                                         int ld, long long plane,
                                         const __nv_bfloat16* fallback) const {
        const long long off = (RowsAreK ? (long long)k0 * ld : (long long)k0) + plane;
GRNG_UNROLL
        for (int q = 0; q < kPer; ++q) {
            const int h = last ? tail[q] : have[q];
            grng_cp_async_16_at(base, base_s, tile + dst[q], h > 0 ? g[q] + off : fallback,
                                2 * h);
        }
    }
};

__device__ __forceinline__ bool grng_gemm_vec_ok(const __nv_bfloat16* p, int ld) {
    return (ld & 7) == 0 && (reinterpret_cast<unsigned long long>(p) & 15) == 0;
}

// Whether both operands of a product take the 16-byte cp.async loads: every plane 16-byte
// aligned with ld % 8 == 0 (for split3 operands, Terms > 1, the plane strides too).
template <int Terms>
__device__ __forceinline__ bool grng_gemm_operands_vec(const __nv_bfloat16* A, int lda,
                                                       long long a_plane,
                                                       const __nv_bfloat16* B, int ldb,
                                                       long long b_plane) {
    return grng_gemm_vec_ok(A, lda) && grng_gemm_vec_ok(B, ldb) &&
           (Terms == 1 || ((a_plane | b_plane) & 7) == 0);
}

// Split products (f32 accuracy on bf16 tensor cores): an f32 operand x is stored as three
// bf16 planes x = hi + mid + lo (grng_split3; 24 significant bits, exact for normal floats),
// plane p at base + p·plane. Of the 9 plane products the 6 above 2^-24 relative are summed,
// the small ones first so their roundings stay ~2^-8 below the final sum's:
// mid·mid, hi·lo, lo·hi, hi·mid, mid·hi, hi·hi. Term t's planes: 2-bit fields of these masks.
#define GRNG_SPLIT3_TERMS 6
#define GRNG_SPLIT3_A_PLANES 0x121  // t = 0..5 → 1, 0, 2, 0, 1, 0
#define GRNG_SPLIT3_B_PLANES 0x049  // t = 0..5 → 1, 2, 0, 1, 0, 0

// The mainloop of grng_gemm_tile for one loader: Vec (every operand plane 16-byte aligned
// with ld % 8 == 0) copies by cp.async from per-thread plans (GrngLoadPlan), else the
// element-wise gathers. The per-lane fragment offsets and the loader's plans are computed
// once per tile, and the stage and slice counters advance by adds: what runs per K slice is
// the copies, 12 ldmatrix, 32 mma and their address adds. On CUDA every fragment and K step
// is computed: tiles past the M, N, K edges read the zeros the loader filled in, which add
// nothing. The emulator, which runs each mma in software, skips that all-zero work
// (warp-uniform tests, the same results) to keep the tests fast.
template <class AL, class BL, int Terms, bool Vec, class Epi>
__device__ __forceinline__ void grng_gemm_mainloop(GRNG_GEMM_TILE_PARAMS) {
    constexpr int kStageBytes = 2 * GRNG_GEMM_STAGE_ELEMS;
    constexpr int kBTile = 2 * GRNG_GEMM_BM * GRNG_GEMM_BK;  // B's byte offset in a stage
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = (warp & 1) * 64, wn = (warp >> 1) * 32;
    const int nk = grng_ceil_div(K, GRNG_GEMM_BK);
    const int nslices = Terms * nk;  // slice v: term v / nk, K slice v % nk
    const unsigned smem_s = grng_shared_u32(smem);

    float acc[4][4][4];
GRNG_UNROLL
    for (int mi = 0; mi < 4; ++mi)
GRNG_UNROLL
        for (int nj = 0; nj < 4; ++nj)
GRNG_UNROLL
            for (int e = 0; e < 4; ++e) acc[mi][nj][e] = 0.0f;

    using PlanA = GrngLoadPlan<AL::kRowsAreK, AL::kRows, AL::kChunks, GRNG_GEMM_THREADS>;
    using PlanB = GrngLoadPlan<BL::kRowsAreK, BL::kRows, BL::kChunks, GRNG_GEMM_THREADS>;
    PlanA pa;
    PlanB pb;
    if (Vec) {
        pa.init(A, lda, i0, M, K, GRNG_GEMM_BK, threadIdx.x,
                [](int r, int c) { return 2 * grng_swizzle<AL::kChunks>(r, c); });
        pb.init(B, ldb, j0, N, K, GRNG_GEMM_BK, threadIdx.x,
                [](int r, int c) { return 2 * grng_swizzle<BL::kChunks>(r, c); });
    }
    // The next slice to load: its stage, term and K offset, advanced by adds.
    int ld_stage = 0, ld_term = 0, ld_k0 = 0;
    auto load_next = [&]() {
        const int pla = (GRNG_SPLIT3_A_PLANES >> (2 * ld_term)) & 3;
        const int plb = (GRNG_SPLIT3_B_PLANES >> (2 * ld_term)) & 3;
        const long long oa = Terms == 1 ? 0 : pla * a_plane;
        const long long ob = Terms == 1 ? 0 : plb * b_plane;
        const int tile = ld_stage * kStageBytes;
        if (Vec) {
            const bool last = ld_k0 + GRNG_GEMM_BK >= K;
            pa.copy(smem, smem_s, tile, ld_k0, last, lda, oa, A);
            pb.copy(smem, smem_s, tile + kBTile, ld_k0, last, ldb, ob, B);
        } else {
            __nv_bfloat16* st = smem + ld_stage * GRNG_GEMM_STAGE_ELEMS;
            AL::gather(st, A + oa, lda, i0, ld_k0, M, K);
            BL::gather(st + GRNG_GEMM_BM * GRNG_GEMM_BK, B + ob, ldb, j0, ld_k0, N, K);
        }
        ld_stage = ld_stage + 1 == GRNG_GEMM_STAGES ? 0 : ld_stage + 1;
        ld_k0 += GRNG_GEMM_BK;
        if (ld_k0 >= K) {
            ld_k0 = 0;
            ++ld_term;
        }
    };
GRNG_UNROLL
    for (int s = 0; s < GRNG_GEMM_STAGES - 1; ++s) {
        if (s < nslices) load_next();
        grng_cp_async_commit();
    }

    // ldmatrix x4 register j: A covers (m + 8(j&1), k + 8(j>>1)), a pair of B n8 tiles
    // (k + 8(j&1), n + 8(j>>1)) — the a[0..3] and b[0..1], b'[0..1] fragment orders. A
    // fragment's byte offset in a stage is affine in the tile's row index (the swizzle's XOR
    // depends on the row's low 3 bits only): 16 rows on is `step` bytes on. So a lane keeps
    // the offsets of its 16-row A fragments mi / B pairs np at k step h = 0 for k-outer tiles
    // (rows k: step h adds `step`), or of steps h at mi = np = 0 for k-inner tiles (rows o).
    const int lrow = lane & 7, lj = lane >> 3;
    constexpr int kStepA = 2 * 16 * AL::kChunks * 8, kStepB = 2 * 16 * BL::kChunks * 8;
    int a_tab[4], b_tab[2];
GRNG_UNROLL
    for (int i = 0; i < 4; ++i) {
        const int o = wm + 16 * (AL::kRowsAreK ? i : 0), k = AL::kRowsAreK ? 0 : 16 * i;
        if (i < (AL::kRowsAreK ? 4 : 2))
            a_tab[i] = 2 * AL::frag_off(o, k, 8 * (lj & 1), 8 * (lj >> 1), lrow);
    }
GRNG_UNROLL
    for (int i = 0; i < 2; ++i) {
        const int o = wn + 16 * (BL::kRowsAreK ? i : 0), k = BL::kRowsAreK ? 0 : 16 * i;
        b_tab[i] = kBTile + 2 * BL::frag_off(o, k, 8 * (lj >> 1), 8 * (lj & 1), lrow);
    }
    // Byte offsets of A fragment mi and B pair np at k step h.
    auto a_off = [&](int mi, int h) {
        return AL::kRowsAreK ? a_tab[mi] + h * kStepA : a_tab[h] + mi * kStepA;
    };
    auto b_off = [&](int np, int h) {
        return BL::kRowsAreK ? b_tab[np] + h * kStepB : b_tab[h] + np * kStepB;
    };
#ifdef GRNG_EMU
    const int rows_left = M - i0 - wm, cols_left = N - j0 - wn;  // of this warp's tile
    int rd_k0 = 0;
#endif
    int rd_stage = 0;
    for (int kt = 0; kt < nslices; ++kt) {
        // Slice kt's group is complete once at most STAGES-2 younger ones are in flight; the
        // barrier also retires every warp's reads of the stage the next load overwrites.
        grng_cp_async_wait<GRNG_GEMM_STAGES - 2>();
        __syncthreads();
        if (kt + GRNG_GEMM_STAGES - 1 < nslices) load_next();
        grng_cp_async_commit();

        const int st = rd_stage * kStageBytes;
        rd_stage = rd_stage + 1 == GRNG_GEMM_STAGES ? 0 : rd_stage + 1;
#ifdef GRNG_EMU
        const int k_left = K - rd_k0;
        rd_k0 = rd_k0 + GRNG_GEMM_BK >= K ? 0 : rd_k0 + GRNG_GEMM_BK;
#endif
GRNG_UNROLL
        for (int h = 0; h < 2; ++h) {
            unsigned af[4][4], bf[4][2];
#ifdef GRNG_EMU
            if (16 * h >= k_left) break;
            const bool emu_skip = true;
#else
            const int rows_left = 64, cols_left = 32;
            const bool emu_skip = false;
#endif
GRNG_UNROLL
            for (int mi = 0; mi < 4; ++mi)
                if (!emu_skip || 16 * mi < rows_left)
                    grng_ldmatrix_x4_at<AL::kRowsAreK>(af[mi], smem, smem_s, st + a_off(mi, h));
GRNG_UNROLL
            for (int np = 0; np < 2; ++np) {
                if (emu_skip && 16 * np >= cols_left) continue;
                unsigned r[4];
                grng_ldmatrix_x4_at<BL::kRowsAreK>(r, smem, smem_s, st + b_off(np, h));
                bf[2 * np][0] = r[0];
                bf[2 * np][1] = r[1];
                bf[2 * np + 1][0] = r[2];
                bf[2 * np + 1][1] = r[3];
            }
GRNG_UNROLL
            for (int mi = 0; mi < 4; ++mi)
GRNG_UNROLL
                for (int nj = 0; nj < 4; ++nj)
                    if (!emu_skip || (16 * mi < rows_left && 8 * nj < cols_left))
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

// The block's 128x128 tile of C = op(A)·op(B) at rows i0.., columns j0.. (op(A) M x K,
// op(B) K x N), handed to epi(i, j, value) for every i < M, j < N of the tile; then
// epi.finish() is called by every thread (block reductions). Terms = 1: plain bf16 operands
// (a_plane, b_plane unused); Terms = GRNG_SPLIT3_TERMS: A and B are split3 planes a_plane /
// b_plane elements apart, and the K loop runs over the 6 plane products in turn. smem:
// GRNG_GEMM_SMEM bytes of dynamic shared memory. Every thread of the 256-thread block must
// call it.
template <class AL, class BL, int Terms, class Epi>
__device__ __forceinline__ void grng_gemm_tile(GRNG_GEMM_TILE_PARAMS) {
    static_assert(Terms == 1 || Terms == GRNG_SPLIT3_TERMS, "plain or split3 products");
    if (grng_gemm_operands_vec<Terms>(A, lda, a_plane, B, ldb, b_plane))
        grng_gemm_mainloop<AL, BL, Terms, true>(GRNG_GEMM_TILE_ARGS);
    else
        grng_gemm_mainloop<AL, BL, Terms, false>(GRNG_GEMM_TILE_ARGS);
}

// grng_gemm_tile as a type (Tile::run<AL, BL, Terms>), for grng_gemm_tile_layouts; the sm_90a
// mainloop's is GrngTileSm90a (gemm/wgmma_sm90.cuh).
struct GrngTileSm80 {
    template <class AL, class BL, int Terms, class Epi>
    __device__ static __forceinline__ void run(GRNG_GEMM_TILE_PARAMS) {
        grng_gemm_tile<AL, BL, Terms>(GRNG_GEMM_TILE_ARGS);
    }
};

// Tile's block tile (Tile::run<AL, BL, Terms>, grng_gemm_tile's contract) with the operand
// layouts chosen at run time: layouts bit 0 → A k-outer (op(A) = Aᵀ of a K x M row-major A),
// else k-inner; bit 1 → B k-inner (op(B) = Bᵀ of an N x K row-major B), else k-outer. The
// tile at rows i0.., columns j0.. (the caller's block mapping: (blockIdx.y, blockIdx.x)·128
// for a full grid, grng_tri_tile for the lower-triangle tile pairs).
template <class Tile, int Terms, class Epi>
__device__ __forceinline__ void grng_gemm_tile_layouts(const __nv_bfloat16* __restrict__ A,
                                                       int lda, long long a_plane,
                                                       const __nv_bfloat16* __restrict__ B,
                                                       int ldb, long long b_plane, int M, int N,
                                                       int K, int layouts, int i0, int j0,
                                                       __nv_bfloat16* smem, Epi& epi) {
    switch (layouts & 3) {
        case 0:
            Tile::template run<GrngKInner, GrngKOuter, Terms>(GRNG_GEMM_TILE_ARGS);
            break;
        case 1:
            Tile::template run<GrngKOuter, GrngKOuter, Terms>(GRNG_GEMM_TILE_ARGS);
            break;
        case 2:
            Tile::template run<GrngKInner, GrngKInner, Terms>(GRNG_GEMM_TILE_ARGS);
            break;
        default:
            Tile::template run<GrngKOuter, GrngKInner, Terms>(GRNG_GEMM_TILE_ARGS);
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
