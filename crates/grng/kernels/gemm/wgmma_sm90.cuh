// The GEMM engine's sm_90a mainloop: the block tile of engine.cuh's grng_gemm_tile (128x128,
// bf16 operands, f32 accumulation, the SAME epilogue functors and the same (i0, j0) tile
// scheduling, lower-triangle grids included), on Hopper's warpgroup MMA. Compiled only for
// compute_90a (build.rs builds the files that include this header a second time for it):
// elsewhere, and in the emulator, GRNG_SM90A stays undefined and the header is empty.
// Design and floor: docs/gpu.md "GEMM engine", sm_90a.
//
// - Block 384 threads = 3 warpgroups, warp-specialized: warpgroup 0 is the producer (loads
//   only), warpgroups 1 and 2 the consumers, each owning 64 rows x 128 columns of the tile as
//   wgmma.mma_async m64n128k16 accumulators (64 f32 registers per thread).
// - K slices of 64 (128 bytes of bf16: one 128B-swizzle row), GRNG_WG_STAGES = 4 stages of a
//   128x64 tile per operand (GRNG_WG_SMEM = 129 KiB with the alignment slack, one block per
//   SM). Stage hand-off through mbarriers: full[s] (128 producer arrivals: the stage is in
//   shared memory) and empty[s] (one arrival per consumer warp: the wgmma reading it retired).
//   Consumers keep one wgmma batch in flight (wait_group 1) and release the previous stage.
// - Loads: the producer warpgroup moves 16-byte chunks with cp.async, each thread ending a
//   stage with cp.async.mbarrier.arrive.noinc (the arrival fires when its copies land). Not
//   TMA: a tensor map needs 16-byte-multiple global strides and a 128-byte kernel parameter
//   (or a per-launch upload of it), and grng's operands have arbitrary ld (n % 8 != 0 happens,
//   e.g. the ragged Kronecker factors) while its kernels take 8-byte scalar and pointer
//   parameters only (kernels/README.md). cp.async keeps the sm_80 engine's zero-fill at the
//   M, N, K edges and its element-wise fallback for unaligned operands; at 128x128x64 per
//   stage the 128 producer threads issue 16 chunks each per stage, far below what the
//   consumers take to multiply it (docs/gpu.md).
// - Shared layout: the canonical 128B-swizzled wgmma layouts (PTX ISA, "Shared Memory Matrix
//   Layout"; CUTLASS's Layout_K_SW128_Atom / Layout_MN_SW128_Atom): 1024-byte atoms of 8 rows
//   x 128 bytes in which 16-byte chunk c of row r sits at chunk c ^ r, so the swizzle is the
//   hardware's address XOR (bits 4-6 ^= bits 7-9) on 1024-byte aligned atoms. K-inner
//   operands (k contiguous) are K-major: row o of the tile = 64 k values, atoms stacked every
//   8 rows (SBO = 1024). K-outer operands (o contiguous) are MN-major: a row = 64 o values of
//   one k, atoms [o block of 64][k group of 8] at 8192 · ob + 1024 · kg (LBO = 8192 between
//   o blocks, SBO = 1024 between k groups); wgmma's transpose bit reads them.
#pragma once

#include "engine.cuh"

#if !defined(GRNG_EMU) && defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GRNG_SM90A 1

#define GRNG_WG_THREADS 384  // producer warpgroup + 2 consumer warpgroups
#define GRNG_WG_BK 64        // K slice: one 128-byte swizzle row of bf16
#define GRNG_WG_STAGES 4
#define GRNG_WG_TILE_BYTES (GRNG_GEMM_BM * GRNG_WG_BK * 2)  // one operand's stage: 16 KiB
// Stages plus 1 KiB so the tiles can be aligned to the 1024-byte swizzle atom (the dynamic
// shared memory is only guaranteed 128-byte aligned). src/cuda/launch.rs: WG_SMEM.
#define GRNG_WG_SMEM (GRNG_WG_STAGES * 2 * GRNG_WG_TILE_BYTES + 1024)

// mbarrier (PTX ISA "Parallel Synchronization and Communication Instructions: mbarrier").
__device__ __forceinline__ void grng_mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(grng_shared_u32(bar)),
                 "r"(count));
}
__device__ __forceinline__ void grng_mbar_arrive(unsigned long long* bar) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(
                     grng_shared_u32(bar))
                 : "memory");
}
// One arrival on `bar` once every cp.async this thread issued before has completed; .noinc:
// the arrival counts against the barrier's expected count like an ordinary arrive.
__device__ __forceinline__ void grng_mbar_arrive_cp_async(unsigned long long* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(
                     grng_shared_u32(bar))
                 : "memory");
}
// Waits until the phase of parity `parity` has completed (the phase before the current one
// counts as completed, so waiting on parity 1 of a fresh barrier returns at once). With
// Trap, a phase that does not complete within 2^35 cycles (about 17 s at 2 GHz, far beyond any
// working stage hand-off) traps instead of hanging: a pipeline bug (this path was never run
// on hardware to rule one out) becomes a failed launch (the self-check counts and reports it;
// a trap loses the CUDA context, so later calls fail too: an error, never a hang or a wrong
// product). Only the producer traps: a trap between a consumer's
// wgmma issue and its wait makes ptxas serialize the wgmmas (C7515); the producer's final
// waits on every release bound the consumers too.
template <bool Trap>
__device__ __forceinline__ void grng_mbar_wait(unsigned long long* bar, unsigned parity) {
    if (Trap)
        asm volatile(
            "{\n.reg .pred done, late;\n.reg .u64 t0, t;\n"
            "mov.u64 t0, %%clock64;\n"
            "wait_%=:\n"
            "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
            "@done bra end_%=;\n"
            "mov.u64 t, %%clock64;\n"
            "sub.u64 t, t, t0;\n"
            "setp.gt.u64 late, t, 34359738368;\n"
            "@late trap;\n"
            "bra wait_%=;\n"
            "end_%=:\n}\n" ::"r"(grng_shared_u32(bar)),
            "r"(parity)
            : "memory");
    else
        asm volatile(
            "{\n.reg .pred done;\nwait_%=:\n"
            "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
            "@!done bra wait_%=;\n}\n" ::"r"(grng_shared_u32(bar)),
            "r"(parity)
            : "memory");
}

// wgmma (PTX ISA "Asynchronous Warpgroup Level Matrix Multiply-Accumulate").
__device__ __forceinline__ void grng_wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void grng_wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void grng_wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins the accumulators in place across the asynchronous MMAs: the compiler may not move
// their reads or writes over this point (CUTLASS's warpgroup_fence_operand).
__device__ __forceinline__ void grng_wgmma_fence_operands(float (&d)[64]) {
GRNG_UNROLL
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared memory matrix descriptor (PTX ISA "Matrix Descriptor Format"): start address, leading
// and stride byte offsets in 16-byte units (14 bits each), base offset 0 (1024-byte aligned
// atoms), layout 1 = 128B swizzle in bits 62-63.
__device__ __forceinline__ unsigned long long grng_wg_desc(unsigned addr, unsigned lbo,
                                                           unsigned sbo) {
    return (unsigned long long)((addr >> 4) & 0x3FFF) |
           ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16) |
           ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// D += A·B on one warpgroup: A 64x16 and B 16x128 from shared memory (descriptors), bf16,
// f32 accumulators. TransA / TransB = 1: the operand is MN-major (wgmma's imm-trans). D
// fragment: d[4i + 2h + e] is row 16·warp + lane/4 + 8h, column 8i + 2(lane%4) + e.
template <int TransA, int TransB>
__device__ __forceinline__ void grng_wgmma_m64n128k16(float (&d)[64], unsigned long long da,
                                                      unsigned long long db) {
    // scale-d = 1 (D accumulates; the accumulators start at zero).
    asm volatile(
        "{\n.reg .pred sd;\nsetp.ne.b32 sd, %68, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
        "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
        "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "
        "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, sd, 1, 1, %66, %67;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
          "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
          "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
          "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
          "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]),
          "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),
          "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
          "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),
          "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]),
          "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "n"(TransA), "n"(TransB), "r"(1));
}

// Byte offset of 16-byte chunk `chunk` of swizzle row `row` in a 1024-byte aligned region of
// 128-byte rows: the hardware's 128B swizzle.
__device__ __forceinline__ int grng_wg_swz(int row, int chunk) {
    return row * 128 + ((chunk ^ (row & 7)) << 4);
}

// The producer's copy of one operand's 128 (o) x 64 (k) stage tile, as the engine's layout
// tags say where element (o, k) lives in global memory. kTrans: wgmma's transpose bit;
// dst(o, c8): byte offset of the chunk holding k = 8·c8.. of row o (K-major) or o = 8·c8..
// of row k (MN-major, there c8 < 16 and the "row" is k).
template <class L>
struct GrngWgLayout;

template <>
struct GrngWgLayout<GrngKInner> {
    static constexpr int kTrans = 0;
    // 128 rows (o) x 8 chunks (k): rows 128 bytes apart, 8-row atoms contiguous.
    __device__ static int chunk_off(int r, int c) { return grng_wg_swz(r, c); }
    static constexpr int kRows = GRNG_GEMM_BM, kChunks = GRNG_WG_BK / 8;
    // Rows of the global matrix are o, columns k.
    __device__ static void coords(int o0, int k0, int r, int c, int& grow, int& gcol) {
        grow = o0 + r;
        gcol = k0 + 8 * c;
    }
    __device__ static void extents(int no, int nk, int& nrows, int& ncols) {
        nrows = no;
        ncols = nk;
    }
    // Descriptor of the 64- or 128-row operand starting at tile row o (multiple of 64) for
    // the k16 step kk: K-major, SBO = 1024 between 8-row atoms, LBO unused (1).
    __device__ static unsigned long long desc(unsigned tile, int o, int kk) {
        return grng_wg_desc(tile + o * 128 + kk * 32, 16, 1024);
    }
};

template <>
struct GrngWgLayout<GrngKOuter> {
    static constexpr int kTrans = 1;
    // 64 rows (k) x 16 chunks (o): chunk c of row k in atom [c / 8][k / 8].
    __device__ static int chunk_off(int r, int c) {
        return 8192 * (c >> 3) + 1024 * (r >> 3) + grng_wg_swz(r & 7, c & 7);
    }
    static constexpr int kRows = GRNG_WG_BK, kChunks = GRNG_GEMM_BM / 8;
    // Rows of the global matrix are k, columns o.
    __device__ static void coords(int o0, int k0, int r, int c, int& grow, int& gcol) {
        grow = k0 + r;
        gcol = o0 + 8 * c;
    }
    __device__ static void extents(int no, int nk, int& nrows, int& ncols) {
        nrows = nk;
        ncols = no;
    }
    // MN-major: LBO = 8192 between 64-wide o blocks, SBO = 1024 between 8-deep k groups;
    // the k16 step kk starts at k group 2·kk.
    __device__ static unsigned long long desc(unsigned tile, int o, int kk) {
        return grng_wg_desc(tile + 8192 * (o >> 6) + 2048 * kk, 8192, 1024);
    }
};

// Producer, gathering: one operand's stage tile (o0.., k0..) of p (element (row, col) at
// p[row·ld + col]) into the swizzled tile at `tile` (bytes), by the 128 producer threads
// (pt = 0..127), element by element (grng_gemm_gather_chunk).
template <class L>
__device__ __forceinline__ void grng_wg_gather(unsigned char* tile, const __nv_bfloat16* p,
                                               int ld, int o0, int k0, int no, int nk, int pt) {
    using W = GrngWgLayout<L>;
    constexpr int kPer = W::kRows * W::kChunks / 128;
    int nrows, ncols;
    W::extents(no, nk, nrows, ncols);
GRNG_UNROLL
    for (int q = 0; q < kPer; ++q) {
        const int ch = pt + 128 * q;
        const int r = ch / W::kChunks, c = ch % W::kChunks;
        int row, col;
        W::coords(o0, k0, r, c, row, col);
        unsigned char* dst = tile + W::chunk_off(r, c);
        grng_gemm_gather_chunk(dst, p, ld, row, col, nrows, ncols);
    }
}

// The producer warpgroup's loop (pt = 0..127): each slice's two operand tiles into stage
// v % STAGES once the consumers released it, then the stage's full barrier. Vec: cp.async
// from per-thread plans made once per tile (GrngLoadPlan: an address add, a select and a
// cp.async per chunk); else element-wise gathers,
// made visible by the release of an ordinary arrive.
template <class AL, class BL, int Terms, bool Vec>
__device__ __forceinline__ void grng_wg_produce(const __nv_bfloat16* __restrict__ A, int lda,
                                                long long a_plane,
                                                const __nv_bfloat16* __restrict__ B, int ldb,
                                                long long b_plane, int M, int N, int K, int i0,
                                                int j0, unsigned char* base,
                                                unsigned long long* full,
                                                unsigned long long* empty, int pt) {
    using WA = GrngWgLayout<AL>;
    using WB = GrngWgLayout<BL>;
    GrngLoadPlan<AL::kRowsAreK, WA::kRows, WA::kChunks, 128> pa;
    GrngLoadPlan<BL::kRowsAreK, WB::kRows, WB::kChunks, 128> pb;
    if (Vec) {
        pa.init(A, lda, i0, M, K, GRNG_WG_BK, pt, [](int r, int c) { return WA::chunk_off(r, c); });
        pb.init(B, ldb, j0, N, K, GRNG_WG_BK, pt, [](int r, int c) { return WB::chunk_off(r, c); });
    }
    const unsigned base_s = grng_shared_u32(base);
    const int nslices = Terms * grng_ceil_div(K, GRNG_WG_BK);
    int s = 0, round = 0, term = 0, k0 = 0;
    for (int v = 0; v < nslices; ++v) {
        // Slot s was last read in round − 1 (returns at once in round 0).
        grng_mbar_wait<true>(&empty[s], (round & 1) ^ 1);
        const int tile = 2 * s * GRNG_WG_TILE_BYTES;
        const int pla = (GRNG_SPLIT3_A_PLANES >> (2 * term)) & 3;
        const int plb = (GRNG_SPLIT3_B_PLANES >> (2 * term)) & 3;
        const long long oa = Terms == 1 ? 0 : pla * a_plane;
        const long long ob = Terms == 1 ? 0 : plb * b_plane;
        if (Vec) {
            const bool last = k0 + GRNG_WG_BK >= K;
            pa.copy(base, base_s, tile, k0, last, lda, oa, A);
            pb.copy(base, base_s, tile + GRNG_WG_TILE_BYTES, k0, last, ldb, ob, B);
            grng_mbar_arrive_cp_async(&full[s]);
        } else {
            grng_wg_gather<AL>(base + tile, A + oa, lda, i0, k0, M, K, pt);
            grng_wg_gather<BL>(base + tile + GRNG_WG_TILE_BYTES, B + ob, ldb, j0, k0, N, K, pt);
            grng_mbar_arrive(&full[s]);
        }
        if (++s == GRNG_WG_STAGES) {
            s = 0;
            ++round;
        }
        k0 += GRNG_WG_BK;
        if (k0 >= K) {
            k0 = 0;
            ++term;
        }
    }
    // Wait for the release of the last STAGES slices (as if loading STAGES more): the
    // consumers' progress is bounded by the trap too.
    for (int v = nslices; v < nslices + GRNG_WG_STAGES; ++v)
        grng_mbar_wait<true>(&empty[v % GRNG_WG_STAGES], ((v / GRNG_WG_STAGES) & 1) ^ 1);
}

// grng_gemm_tile's contract on the sm_90a mainloop: the block's 128x128 tile of
// C = op(A)·op(B) at (i0, j0) handed to epi(i, j, value) for i < M, j < N, then epi.finish()
// by every thread. Terms = 1: plain bf16 operands (a_plane, b_plane unused); Terms =
// GRNG_SPLIT3_TERMS: split3 planes a_plane / b_plane elements apart, and the slices run over
// the 6 plane products in turn, smallest first — engine.cuh's order, so one accumulator sums
// them as the sm_80 engine does. smem: GRNG_WG_SMEM bytes of dynamic shared memory; every
// thread of the 384-thread block must call it.
template <class AL, class BL, int Terms, class Epi>
__device__ __forceinline__ void grng_wg_gemm_tile(GRNG_GEMM_TILE_PARAMS) {
    static_assert(Terms == 1 || Terms == GRNG_SPLIT3_TERMS, "plain or split3 products");
    __shared__ __align__(8) unsigned long long full[GRNG_WG_STAGES], empty[GRNG_WG_STAGES];
    // Stage s: A tile at base + 2s·TILE, B tile right after it; base 1024-byte aligned.
    unsigned char* smem_raw = reinterpret_cast<unsigned char*>(smem);
    const unsigned raw = grng_shared_u32(smem_raw);
    unsigned char* base = smem_raw + (((raw + 1023u) & ~1023u) - raw);
    const int wg = threadIdx.x / 128, t = threadIdx.x % 128;
    const int nk = grng_ceil_div(K, GRNG_WG_BK);
    const int nslices = Terms * nk;  // slice v: term v / nk, K slice v % nk
    if (threadIdx.x == 0) {
        for (int s = 0; s < GRNG_WG_STAGES; ++s) {
            grng_mbar_init(&full[s], 128);
            grng_mbar_init(&empty[s], 8);  // lane 0 of each of the 8 consumer warps
        }
    }
    __syncthreads();

    float acc[64];
GRNG_UNROLL
    for (int i = 0; i < 64; ++i) acc[i] = 0.0f;

    if (wg == 0) {
        if (grng_gemm_operands_vec<Terms>(A, lda, a_plane, B, ldb, b_plane))
            grng_wg_produce<AL, BL, Terms, true>(A, lda, a_plane, B, ldb, b_plane, M, N, K, i0,
                                                 j0, base, full, empty, t);
        else
            grng_wg_produce<AL, BL, Terms, false>(A, lda, a_plane, B, ldb, b_plane, M, N, K, i0,
                                                  j0, base, full, empty, t);
    } else {
        // Consumer warpgroup c = wg − 1: tile rows 64c..64c+63.
        const int c = wg - 1;
        for (int v = 0; v < nslices; ++v) {
            const int s = v % GRNG_WG_STAGES;
            grng_mbar_wait<false>(&full[s], (v / GRNG_WG_STAGES) & 1);
            // The stage was written through the generic proxy (cp.async, st.shared) and is
            // read by wgmma through the async proxy.
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            const unsigned sa = grng_shared_u32(base + 2 * s * GRNG_WG_TILE_BYTES);
            const unsigned sb = sa + GRNG_WG_TILE_BYTES;
            grng_wgmma_fence();
GRNG_UNROLL
            for (int kk = 0; kk < GRNG_WG_BK / 16; ++kk)
                grng_wgmma_m64n128k16<GrngWgLayout<AL>::kTrans, GrngWgLayout<BL>::kTrans>(
                    acc, GrngWgLayout<AL>::desc(sa, 64 * c, kk),
                    GrngWgLayout<BL>::desc(sb, 0, kk));
            grng_wgmma_commit();
            // One batch stays in flight; the one before it has retired: release its stage.
            grng_wgmma_wait<1>();
            grng_wgmma_fence_operands(acc);
            if (v > 0 && (threadIdx.x & 31) == 0)
                grng_mbar_arrive(&empty[(v - 1) % GRNG_WG_STAGES]);
        }
        grng_wgmma_wait<0>();
        grng_wgmma_fence_operands(acc);
        if ((threadIdx.x & 31) == 0) grng_mbar_arrive(&empty[(nslices - 1) % GRNG_WG_STAGES]);

        const int warp = (t >> 5), lane = t & 31;
        const int row0 = i0 + 64 * c + 16 * warp + (lane >> 2);
        const int col0 = j0 + 2 * (lane & 3);
GRNG_UNROLL
        for (int i = 0; i < 16; ++i)
GRNG_UNROLL
            for (int h = 0; h < 2; ++h) {
                const int r = row0 + 8 * h, col = col0 + 8 * i;
                if (r < M) {
                    if (col < N) epi(r, col, acc[4 * i + 2 * h]);
                    if (col + 1 < N) epi(r, col + 1, acc[4 * i + 2 * h + 1]);
                }
            }
    }
    epi.finish();
}

// grng_wg_gemm_tile as a type, for grng_gemm_tile_layouts (engine.cuh's GrngTileSm80 on the
// sm_90a mainloop).
struct GrngTileSm90a {
    template <class AL, class BL, int Terms, class Epi>
    __device__ static __forceinline__ void run(GRNG_GEMM_TILE_PARAMS) {
        grng_wg_gemm_tile<AL, BL, Terms>(GRNG_GEMM_TILE_ARGS);
    }
};

#endif  // compute_90a
