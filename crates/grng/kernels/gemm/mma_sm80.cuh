// sm_80 warp-level matrix primitives of the GEMM engine (kernels/gemm/engine.cuh), one
// __device__ function each: inline PTX on CUDA, the emulator's per-lane model under GRNG_EMU
// (kernels/emu/cuda_emu.cpp, checked by kernels/emu/selftest.cu and tests/emu_primitives.rs).
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16", bf16): lane p, groupID
// g = p / 4, threadID in group t = p % 4; a register holds two bf16, the lower column (A, C)
// or row (B) in the low half.
//   A 16x16 (row): a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..],
//                  a[3] = A[g+8][2t+8..]
//   B 16x8 (col):  b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g]
//   C, D 16x8:     c[0], c[1] = C[g][2t], C[g][2t+1]; c[2], c[3] = C[g+8][2t], C[g+8][2t+1]
// ldmatrix.x4: lane l gives the address of row l % 8 of 8x8 matrix l / 8 (16 bytes, 16-byte
// aligned shared memory) and receives r[j] = row p / 4, elements 2t, 2t+1 of matrix j
// (.trans: elements (2t, p/4), (2t+1, p/4)), i.e. matrix j in the fragment layout above.
#pragma once

#include "../common.cuh"

// D = A·B + C on one warp (all 32 lanes, converged); d may alias c.
__device__ __forceinline__ void grng_mma_bf16_16816(float (&d)[4], const unsigned (&a)[4],
                                                    const unsigned (&b)[2], const float (&c)[4]) {
#ifdef GRNG_EMU
    grng_emu::mma_m16n8k16_bf16(d, a, b, c);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
          "f"(c[1]), "f"(c[2]), "f"(c[3]));
#endif
}

// grng_ldmatrix_x4 at byte offset `off` of the shared buffer `base`, whose shared-window
// address `base_s` (__cvta_generic_to_shared) the caller converted once: the mainloop's
// fragment addresses are per-lane constants plus the stage offset, so each ldmatrix is one
// add and the load.
template <bool Trans>
__device__ __forceinline__ void grng_ldmatrix_x4_at(unsigned (&r)[4], const void* base,
                                                    unsigned base_s, int off) {
#ifdef GRNG_EMU
    (void)base_s;
    grng_emu::ldmatrix_x4(r, static_cast<const char*>(base) + off, Trans);
#else
    (void)base;
    const unsigned s = base_s + (unsigned)off;
    if (Trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(s));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(s));
#endif
}

// The shared-window address of a shared-memory pointer (0 in the emulator, which addresses
// shared memory by pointer: grng_ldmatrix_x4_at ignores it there).
__device__ __forceinline__ unsigned grng_shared_u32(const void* p) {
#ifdef GRNG_EMU
    (void)p;
    return 0u;
#else
    return (unsigned)__cvta_generic_to_shared(p);
#endif
}

// Four 8x8 b16 matrices from shared memory (row = this lane's row address, see above).
template <bool Trans>
__device__ __forceinline__ void grng_ldmatrix_x4(unsigned (&r)[4], const void* row) {
    grng_ldmatrix_x4_at<Trans>(r, row, grng_shared_u32(row), 0);
}

// 16 bytes global → shared, asynchronously, to byte offset `off` of the shared buffer `base`
// (shared-window address `base_s`, see grng_ldmatrix_x4_at): src_bytes (0..16) are read, the
// rest zero-filled. Both addresses 16-byte aligned; src must be a valid address even when
// src_bytes = 0.
__device__ __forceinline__ void grng_cp_async_16_at(void* base, unsigned base_s, int off,
                                                    const void* gmem, int src_bytes) {
#ifdef GRNG_EMU
    (void)base_s;
    grng_emu::cp_async_16(static_cast<char*>(base) + off, gmem, src_bytes);
#else
    (void)base;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(base_s + (unsigned)off),
                 "l"(gmem), "r"(src_bytes));
#endif
}

// grng_cp_async_16_at to the shared address smem.
__device__ __forceinline__ void grng_cp_async_16(void* smem, const void* gmem, int src_bytes) {
    grng_cp_async_16_at(smem, grng_shared_u32(smem), 0, gmem, src_bytes);
}

// Closes the group of this thread's cp.async issued since the last commit.
__device__ __forceinline__ void grng_cp_async_commit() {
#ifdef GRNG_EMU
    grng_emu::cp_async_commit();
#else
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most N of this thread's committed groups are still in flight. Other
// threads' copies need a __syncthreads after it to be visible.
template <int N>
__device__ __forceinline__ void grng_cp_async_wait() {
#ifdef GRNG_EMU
    grng_emu::cp_async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// Element offset of 16-byte chunk `chunk` of row `row` in a shared tile whose rows hold
// Chunks chunks (8 bf16 each). The XOR permutes chunks within a row so that the 8 rows one
// ldmatrix matrix reads (same logical chunk, consecutive rows) land in 8 different 16-byte
// bank groups of the 128-byte bank window: conflict-free ldmatrix and cp.async without
// padding. Chunks is a power of two ≥ 2; rows sharing a 128-byte window (Chunks < 8) are
// told apart by the bits above them.
template <int Chunks>
__device__ __forceinline__ int grng_swizzle(int row, int chunk) {
    static_assert(Chunks >= 2 && (Chunks & (Chunks - 1)) == 0, "Chunks: a power of two >= 2");
    constexpr int kRowsPerWindow = Chunks >= 8 ? 1 : 8 / Chunks;
    constexpr int kMask = Chunks >= 8 ? 7 : Chunks - 1;
    return (row * Chunks + (chunk ^ ((row / kRowsPerWindow) & kMask))) * 8;
}
