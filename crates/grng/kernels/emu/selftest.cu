// Self-test kernels: each exercises one emulated CUDA primitive so tests/emu_primitives.rs
// can check it against its CUDA definition (and, on a GPU, the same tests check the
// hardware). Valid CUDA: build.rs compiles this file to PTX too (ptx::SELFTEST) and the audit
// covers it (selftest_wmma_tc proves the HMMA check works), but no optimizer uses it.
#include "common.cuh"
#include "gemm/engine.cuh"

// Tiled transpose through a padded shared tile: out (cols x rows) = in (rows x cols)ᵀ.
// Block (32, 8), grid (ceil(cols/32), ceil(rows/32)).
extern "C" __global__ void selftest_transpose(const float* __restrict__ in,
                                              float* __restrict__ out, int rows, int cols) {
    __shared__ float tile[32][33];
    const int c0 = blockIdx.x * 32, r0 = blockIdx.y * 32;
    for (int dy = threadIdx.y; dy < 32; dy += blockDim.y) {
        const int r = r0 + dy, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[dy][threadIdx.x] = in[r * cols + c];
    }
    __syncthreads();
    for (int dy = threadIdx.y; dy < 32; dy += blockDim.y) {
        const int c = c0 + dy, r = r0 + threadIdx.x;  // out row c, column r
        if (c < cols && r < rows) out[c * rows + r] = tile[threadIdx.x][dy];
    }
}
GRNG_EMU_ENTRY(selftest_transpose, (const float*, float*, int, int))

// Each block reverses its chunk of `chunk` elements (chunk floats of dynamic shared memory).
extern "C" __global__ void selftest_dyn_smem_reverse(const float* __restrict__ in,
                                                     float* __restrict__ out, int n, int chunk) {
    GRNG_DYN_SHARED(float, s);
    const int base = blockIdx.x * chunk;
    const int len = min(chunk, n - base);
    for (int i = threadIdx.x; i < len; i += blockDim.x) s[i] = in[base + i];
    __syncthreads();
    for (int i = threadIdx.x; i < len; i += blockDim.x) out[base + i] = s[len - 1 - i];
}
GRNG_EMU_ENTRY(selftest_dyn_smem_reverse)

// Shuffles. For test case t = (op, b, width) in cases[3t..3t+3], thread g writes
// out[t * nthreads + g] (int) and out64[2 (t * nthreads + g) + {0, 1}] (low and high words of
// a 64-bit shuffle of (v ^ 0x5a5a5a5a) << 32 | ~v, to exercise 8-byte values).
// op: 0 idx with srcLane = b + 3 * lane, 1 up by b, 2 down by b, 3 xor b, 4 xor b with the
// two half-warps shuffling separately (masks 0x0000ffff / 0xffff0000, width <= 16).
extern "C" __global__ void selftest_shfl(const int* __restrict__ in, int* __restrict__ out,
                                         int* __restrict__ out64, const int* __restrict__ cases,
                                         int ncases) {
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    const int nthreads = gridDim.x * blockDim.x;
    const int lane = threadIdx.x & 31;
    const int v = in[g];
    const long long w = (long long)(((unsigned long long)(unsigned)(v ^ 0x5a5a5a5a) << 32) | (unsigned)~v);
    for (int t = 0; t < ncases; ++t) {
        const int op = cases[3 * t], b = cases[3 * t + 1], width = cases[3 * t + 2];
        int r = 0;
        long long r64 = 0;
        if (op == 0) {
            r = __shfl_sync(GRNG_FULL_MASK, v, b + 3 * lane, width);
            r64 = __shfl_sync(GRNG_FULL_MASK, w, b + 3 * lane, width);
        } else if (op == 1) {
            r = __shfl_up_sync(GRNG_FULL_MASK, v, (unsigned)b, width);
            r64 = __shfl_up_sync(GRNG_FULL_MASK, w, (unsigned)b, width);
        } else if (op == 2) {
            r = __shfl_down_sync(GRNG_FULL_MASK, v, (unsigned)b, width);
            r64 = __shfl_down_sync(GRNG_FULL_MASK, w, (unsigned)b, width);
        } else if (op == 3) {
            r = __shfl_xor_sync(GRNG_FULL_MASK, v, b, width);
            r64 = __shfl_xor_sync(GRNG_FULL_MASK, w, b, width);
        } else {
            const unsigned half = lane < 16 ? 0x0000ffffu : 0xffff0000u;
            r = __shfl_xor_sync(half, v, b, width);
            r64 = __shfl_xor_sync(half, w, b, width);
        }
        out[t * nthreads + g] = r;
        out64[2 * (t * nthreads + g)] = (int)(unsigned)((unsigned long long)r64 & 0xffffffffull);
        out64[2 * (t * nthreads + g) + 1] = (int)(unsigned)((unsigned long long)r64 >> 32);
    }
}
GRNG_EMU_ENTRY(selftest_shfl)

// Votes and warp reductions over pred = in[g] with the full mask and with `mask` (lanes
// outside `mask` write -1), then block votes. Per thread g, out[9 g + k] for k =
// 0 ballot(full) 1 any(full) 2 all(full) 3 ballot(mask) 4 all(mask) 5 reduce_add(full)
// 6 reduce_max(full, signed) 7 reduce_min(full, unsigned) 8 __syncthreads_count;
// and blk[3 * block + k] = __syncthreads_count / _and / _or of (in[g] > 0).
extern "C" __global__ void selftest_vote(const int* __restrict__ in, int* __restrict__ out,
                                         int* __restrict__ blk, unsigned mask) {
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = threadIdx.x & 31;
    const int v = in[g];
    int* o = out + 9 * g;
    o[0] = (int)__ballot_sync(GRNG_FULL_MASK, v & 1);
    o[1] = __any_sync(GRNG_FULL_MASK, v > 1000000);
    o[2] = __all_sync(GRNG_FULL_MASK, v > -1000000);
    if ((mask >> lane) & 1u) {
        o[3] = (int)__ballot_sync(mask, v & 2);
        o[4] = __all_sync(mask, v & 4);
    } else {
        o[3] = -1;
        o[4] = -1;
    }
    o[5] = (int)__reduce_add_sync(GRNG_FULL_MASK, (unsigned)v);
    o[6] = __reduce_max_sync(GRNG_FULL_MASK, v);
    o[7] = (int)__reduce_min_sync(GRNG_FULL_MASK, (unsigned)v);
    const int count = __syncthreads_count(v > 0);
    const int all = __syncthreads_and(v > 0);
    const int any = __syncthreads_or(v > 0);
    o[8] = count;
    if (threadIdx.x == 0) {
        blk[3 * blockIdx.x] = count;
        blk[3 * blockIdx.x + 1] = all;
        blk[3 * blockIdx.x + 2] = any;
    }
}
GRNG_EMU_ENTRY(selftest_vote)

// Atomics from every thread of a grid-stride loop: acc[0] += x (float), iacc[0] += k,
// iacc[1] = max k, iacc[2] = min k, and slot[atomicAdd(&iacc[3], 1)] = i (the returned old
// values must be a permutation of 0..n when iacc[3] starts at 0).
extern "C" __global__ void selftest_atomics(const float* __restrict__ x, const int* __restrict__ k,
                                            int n, float* acc, int* iacc, int* slot) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        atomicAdd(&acc[0], x[i]);
        atomicAdd(&iacc[0], k[i]);
        atomicMax(&iacc[1], k[i]);
        atomicMin(&iacc[2], k[i]);
        const int old = atomicAdd(&iacc[3], 1);
        if (old >= 0 && old < n) slot[old] = i;
    }
}
GRNG_EMU_ENTRY(selftest_atomics)

// bf16 conversions: out[i] = bf16(in[i]) (round to nearest even), back[i] = f32(out[i]),
// pair[i] = f32 of __floats2bfloat162_rn(in[i], -in[i]) read back through grng_ld_bf16x2.
extern "C" __global__ void selftest_bf16(const float* __restrict__ in,
                                         __nv_bfloat16* __restrict__ out, float* __restrict__ back,
                                         float* __restrict__ pair, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    grng_st_bf16(&out[i], in[i]);
    back[i] = grng_ld_bf16(&out[i]);
    __nv_bfloat162 p2 = __floats2bfloat162_rn(in[i], -in[i]);
    const float2 f = grng_ld_bf16x2(reinterpret_cast<const __nv_bfloat16*>(&p2));
    pair[2 * i] = f.x;
    pair[2 * i + 1] = f.y;
}
GRNG_EMU_ENTRY(selftest_bf16)

// WMMA: D = alpha * (A B + C) for M x N tiles of 16, K a multiple of 16, one warp per 16x16
// tile (grid (N/16, M/16), block 32). A is M x K, row-major (ld K) or col-major (ld M); B is
// K x N, row-major (ld N) or col-major (ld K); C and D are M x N, row-major (ld N) or
// col-major (ld M), chosen by the flags.
template <class LA, class LB>
__device__ void selftest_wmma_body(const __nv_bfloat16* a, const __nv_bfloat16* b,
                                   const float* c, float* d, int M, int N, int K, bool a_col,
                                   bool b_col, int c_col, int d_col, float alpha) {
    using namespace nvcuda;
    const int tm = blockIdx.y * 16, tn = blockIdx.x * 16;
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, LA> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, LB> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    const float* cp = c_col ? c + tm + (size_t)tn * M : c + (size_t)tm * N + tn;
    wmma::load_matrix_sync(acc, cp, c_col ? M : N, c_col ? wmma::mem_col_major : wmma::mem_row_major);
    for (int k = 0; k < K; k += 16) {
        wmma::load_matrix_sync(fa, a_col ? a + tm + (size_t)k * M : a + (size_t)tm * K + k,
                               a_col ? M : K);
        wmma::load_matrix_sync(fb, b_col ? b + k + (size_t)tn * K : b + (size_t)k * N + tn,
                               b_col ? K : N);
        wmma::mma_sync(acc, fa, fb, acc);
    }
    for (int i = 0; i < acc.num_elements; ++i) acc.x[i] *= alpha;
    float* dp = d_col ? d + tm + (size_t)tn * M : d + (size_t)tm * N + tn;
    wmma::store_matrix_sync(dp, acc, d_col ? M : N, d_col ? wmma::mem_col_major : wmma::mem_row_major);
}

extern "C" __global__ void selftest_wmma_tc(const __nv_bfloat16* __restrict__ a,
                                            const __nv_bfloat16* __restrict__ b,
                                            const float* __restrict__ c, float* __restrict__ d,
                                            int M, int N, int K, int layouts, float alpha) {
    using namespace nvcuda;
    // layouts bits: 1 A col-major, 2 B col-major, 4 C col-major, 8 D col-major.
    const int c_col = (layouts >> 2) & 1, d_col = (layouts >> 3) & 1;
    switch (layouts & 3) {
        case 0:
            selftest_wmma_body<wmma::row_major, wmma::row_major>(a, b, c, d, M, N, K, false, false,
                                                                     c_col, d_col, alpha);
            break;
        case 1:
            selftest_wmma_body<wmma::col_major, wmma::row_major>(a, b, c, d, M, N, K, true, false,
                                                                     c_col, d_col, alpha);
            break;
        case 2:
            selftest_wmma_body<wmma::row_major, wmma::col_major>(a, b, c, d, M, N, K, false, true,
                                                                     c_col, d_col, alpha);
            break;
        default:
            selftest_wmma_body<wmma::col_major, wmma::col_major>(a, b, c, d, M, N, K, true, true,
                                                                     c_col, d_col, alpha);
            break;
    }
}
GRNG_EMU_ENTRY(selftest_wmma_tc)

// Many barriers in a loop: a ring stencil in shared memory, with __syncwarp and a block sum
// (common.cuh) every iteration. Block b works on x[b * blockDim.x ...] (blockDim.x a multiple
// of 32); out gets the final values, sums[b * iters + it] the block sum of iteration it and
// wmax[warp] the warp maximum of the final values.
extern "C" __global__ void selftest_barriers(const float* __restrict__ x, float* __restrict__ out,
                                             float* __restrict__ sums, float* __restrict__ wmax,
                                             int iters) {
    __shared__ float ring[1024];
    __shared__ float scratch[32];
    const int n = blockDim.x, t = threadIdx.x;
    float v = x[blockIdx.x * n + t];
    for (int it = 0; it < iters; ++it) {
        ring[t] = v;
        __syncthreads();
        v = 0.5f * v + 0.25f * (ring[(t + 1) % n] + ring[(t + n - 1) % n]);
        __syncwarp();
        const float s = grng_block_sum(v, scratch);
        if (t == 0) sums[blockIdx.x * iters + it] = s;
        __syncthreads();  // ring is rewritten next iteration
    }
    out[blockIdx.x * n + t] = v;
    const float m = grng_warp_max(v);
    if ((t & 31) == 0) wmax[(blockIdx.x * n + t) / 32] = m;
}
GRNG_EMU_ENTRY(selftest_barriers)

// Built-in variables and scalar parameter passing. Thread g (linear over the 3-D grid and
// block) writes out[8 g ..]: threadIdx.xyz, blockIdx.xyz, blockDim packed as
// x + 100 y + 10000 z, gridDim packed the same way. Thread 0 of block 0 also writes
// params[0..6] = (i, u, f, ll, ull, d) as floats.
extern "C" __global__ void selftest_dims(float* __restrict__ out, float* __restrict__ params,
                                         int i, unsigned u, float f, long long ll,
                                         unsigned long long ull, double d) {
    const int tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int bid = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int g = bid * blockDim.x * blockDim.y * blockDim.z + tid;
    float* o = out + 8 * g;
    o[0] = threadIdx.x;
    o[1] = threadIdx.y;
    o[2] = threadIdx.z;
    o[3] = blockIdx.x;
    o[4] = blockIdx.y;
    o[5] = blockIdx.z;
    o[6] = blockDim.x + 100 * blockDim.y + 10000 * blockDim.z;
    o[7] = gridDim.x + 100 * gridDim.y + 10000 * gridDim.z;
    if (g == 0) {
        params[0] = (float)i;
        params[1] = (float)u;
        params[2] = f;
        params[3] = (float)ll;
        params[4] = (float)ull;
        params[5] = (float)d;
    }
}
GRNG_EMU_ENTRY(selftest_dims)

// Launch overhead: one store per thread, optionally around `barriers` __syncthreads.
extern "C" __global__ void selftest_overhead(float* __restrict__ out, int barriers) {
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    for (int i = 0; i < barriers; ++i) __syncthreads();
    out[g] = (float)threadIdx.x;
}
GRNG_EMU_ENTRY(selftest_overhead)

// Misuse the emulator must report (abort with a message) instead of running wrongly; CUDA
// leaves all of these undefined. Never launched on a GPU. mode 0: __syncthreads reached by
// odd threads only; 1: a shuffle reading a lane outside its mask; 2: __syncwarp with a mask
// that does not name the calling lane; 3: mma_sync on fragments changed per lane.
extern "C" __global__ void selftest_misuse(float* __restrict__ out, int mode) {
    const int t = threadIdx.x;
    if (mode == 0) {
        if (t & 1) __syncthreads();
    } else if (mode == 1) {
        if (t < 16) out[t] = __shfl_sync(0x0000ffffu, (float)t, 20);
    } else if (mode == 2) {
        __syncwarp(1u << ((t + 1) & 31));
    } else {
        using namespace nvcuda;
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::fill_fragment(fa, __float2bfloat16(1.0f));
        wmma::fill_fragment(fb, __float2bfloat16(1.0f));
        wmma::fill_fragment(acc, 0.0f);
        fa.x[0] = __float2bfloat16((float)t);
        wmma::mma_sync(acc, fa, fb, acc);
        wmma::store_matrix_sync(out, acc, 16, wmma::mem_row_major);
    }
}
GRNG_EMU_ENTRY(selftest_misuse)

// ---------------------------------------------------------------------------------------
// sm_80 matrix primitives (kernels/gemm/mma_sm80.cuh).

// One mma.m16n8k16 per block of 32 threads: block b reads A (16x16 row-major bf16) at
// a + 256 b, B (16x8, stored k-major: B[k][n] at b + 128 b + 8 k + n), C (16x8 row-major
// f32) at c + 128 b, builds each lane's fragments by the ISA layout (mma_sm80.cuh) and
// stores its D elements at d + 128 b by the same layout.
extern "C" __global__ void selftest_mma_tc(const __nv_bfloat16* __restrict__ a,
                                           const __nv_bfloat16* __restrict__ b,
                                           const float* __restrict__ c, float* __restrict__ d) {
    const int p = threadIdx.x, g = p / 4, t = p % 4;
    const __nv_bfloat16* A = a + 256 * blockIdx.x;
    const __nv_bfloat16* B = b + 128 * blockIdx.x;
    const float* C = c + 128 * blockIdx.x;
    float* D = d + 128 * blockIdx.x;
    auto pack = [](__nv_bfloat16 lo, __nv_bfloat16 hi) {
        return (unsigned)__bfloat16_as_ushort(lo) | ((unsigned)__bfloat16_as_ushort(hi) << 16);
    };
    unsigned af[4], bf[2];
    float cf[4], df[4];
    for (int h = 0; h < 2; ++h) {
        const int r = g + 8 * h;
        af[h] = pack(A[r * 16 + 2 * t], A[r * 16 + 2 * t + 1]);
        af[h + 2] = pack(A[r * 16 + 2 * t + 8], A[r * 16 + 2 * t + 9]);
        bf[h] = pack(B[(2 * t + 8 * h) * 8 + g], B[(2 * t + 8 * h + 1) * 8 + g]);
        cf[2 * h] = C[r * 8 + 2 * t];
        cf[2 * h + 1] = C[r * 8 + 2 * t + 1];
    }
    grng_mma_bf16_16816(df, af, bf, cf);
    for (int h = 0; h < 2; ++h) {
        D[(g + 8 * h) * 8 + 2 * t] = df[2 * h];
        D[(g + 8 * h) * 8 + 2 * t + 1] = df[2 * h + 1];
    }
}
GRNG_EMU_ENTRY(selftest_mma_tc)

// ldmatrix.x4 on one warp: the 64 rows of 8 bf16 in `in` are staged in dynamic shared
// memory (1 KiB), lane l passes the address of row rows[l]; out[4 l + j] = register j
// without .trans, out[128 + 4 l + j] with .trans (u32 bits).
extern "C" __global__ void selftest_ldmatrix(const __nv_bfloat16* __restrict__ in,
                                             const int* __restrict__ rows,
                                             unsigned* __restrict__ out) {
    GRNG_DYN_SHARED(__nv_bfloat16, s);
    const int l = threadIdx.x;
    for (int i = l; i < 64 * 8; i += 32) s[i] = in[i];
    __syncwarp();
    unsigned r[4], rt[4];
    grng_ldmatrix_x4<false>(r, s + 8 * rows[l]);
    grng_ldmatrix_x4<true>(rt, s + 8 * rows[l]);
    for (int j = 0; j < 4; ++j) {
        out[4 * l + j] = r[j];
        out[128 + 4 * l + j] = rt[j];
    }
}
GRNG_EMU_ENTRY(selftest_ldmatrix)

// cp.async groups, one block of `blockDim.x` threads, 3 chunks of 16 bytes per thread:
// thread t copies chunk t + T q (T = blockDim.x) of `src` in group q with bytes[t + T q]
// source bytes (the rest zero-filled), committing after each q. After wait_group 2, 1, 0
// (each followed by __syncthreads) it copies group 0, 1, 2 of shared memory to out; right
// after wait_group 2 it also copies group 2's chunk to early (still in flight: its content is
// undefined on a GPU, the emulator's NaN poison). Dynamic shared memory: 48 T bytes.
extern "C" __global__ void selftest_cp_async(const uint4* __restrict__ src,
                                             const int* __restrict__ bytes,
                                             uint4* __restrict__ out,
                                             uint4* __restrict__ early) {
    GRNG_DYN_SHARED(uint4, s);
    const int t = threadIdx.x, T = blockDim.x;
    for (int q = 0; q < 3; ++q) {
        grng_cp_async_16(s + t + T * q, src + t + T * q, bytes[t + T * q]);
        grng_cp_async_commit();
    }
    grng_cp_async_wait<2>();
    early[t] = s[t + 2 * T];
    __syncthreads();
    out[t] = s[t];
    grng_cp_async_wait<1>();
    __syncthreads();
    out[t + T] = s[t + T];
    grng_cp_async_wait<0>();
    __syncthreads();
    out[t + 2 * T] = s[t + 2 * T];
}
GRNG_EMU_ENTRY(selftest_cp_async)

// The engine's shared-memory swizzle: out[(k * 64 + row) * 16 + chunk] = element offset of
// (row, chunk) in a tile of 2^(k+1) chunks per row (k = 0..3, rows 0..63, chunk < 2^(k+1);
// other slots untouched). One thread per (row, chunk).
extern "C" __global__ void selftest_swizzle(int* __restrict__ out) {
    const int row = threadIdx.x / 16, chunk = threadIdx.x % 16;
    int* o = out + row * 16 + chunk;
    if (chunk < 2) o[0] = grng_swizzle<2>(row, chunk);
    if (chunk < 4) o[64 * 16] = grng_swizzle<4>(row, chunk);
    if (chunk < 8) o[2 * 64 * 16] = grng_swizzle<8>(row, chunk);
    o[3 * 64 * 16] = grng_swizzle<16>(row, chunk);
}
GRNG_EMU_ENTRY(selftest_swizzle)

// The GEMM engine with a plain store: d (M x N row-major f32) = op(A)·op(B). layouts bit 0:
// A stored k-outer (element (i, k) at a[k·lda + i]) instead of k-inner (a[i·lda + k]); bit 1:
// B stored k-inner (element (k, j) at b[j·ldb + k]) instead of k-outer (b[k·ldb + j]).
// Grid (ceil(N/128), ceil(M/128)), block 256, GRNG_GEMM_SMEM bytes of dynamic shared memory.
struct SelftestStore {
    float* d;
    int ldd;
    __device__ __forceinline__ void operator()(int i, int j, float v) { d[(long long)i * ldd + j] = v; }
    __device__ __forceinline__ void finish() {}
};

extern "C" __global__ void __launch_bounds__(GRNG_GEMM_THREADS)
    selftest_gemm_tc(const __nv_bfloat16* __restrict__ a, int lda,
                     const __nv_bfloat16* __restrict__ b, int ldb, float* __restrict__ d, int M,
                     int N, int K, int layouts) {
    GRNG_DYN_SHARED(__nv_bfloat16, smem);
    SelftestStore epi{d, N};
    grng_gemm_tile_layouts<GrngTileSm80, 1>(a, lda, 0, b, ldb, 0, M, N, K, layouts,
                                            blockIdx.y * GRNG_GEMM_BM, blockIdx.x * GRNG_GEMM_BM,
                                            smem, epi);
}
GRNG_EMU_ENTRY(selftest_gemm_tc)
