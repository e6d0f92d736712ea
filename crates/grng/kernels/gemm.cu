// Preconditioning kernels (docs/math.md §1-2, §5 "small kernels"): the f32-accurate tensor-core
// GEMM (split3 planes on the GEMM engine) behind P = Γ̃⁻¹ G Λ̃⁻¹ and the damped-inverse update
// X ← X − dλ·X·X, and the plain bf16 one (Device::gemm on bf16 operands); the fp32 SIMT
// GEMM behind the batch gradient (1/m)EᵀA and the f32 Newton products; the diagonal helpers
// (A ← A + λI, trace).
//
// Launchers: src/cuda/gemm.rs.
#include "common.cuh"
#include "gemm/engine.cuh"
#include "gemm/wgmma_sm90.cuh"

// ---------------------------------------------------------------------------------------
// *p ← α·acc + β·*p (returned too), the GEMM epilogue of both paths (β = 0 never reads *p).
__device__ __forceinline__ float gemm_axpby(float* p, float alpha, float acc, float beta) {
    float v = alpha * acc;
    if (beta != 0.0f) v = fmaf(beta, *p, v);
    *p = v;
    return v;
}

// ---------------------------------------------------------------------------------------
// fp32 GEMM: C (M x N) ← α·op(A)·op(B) + β·C, op(A) M x K, op(B) K x N, all row-major with
// leading dimensions lda/ldb/ldc. β = 0 never reads C; the launcher passes K = 0 for α = 0
// so A and B are never read then either.
//
// Block tile 64x64 with 16-deep k slices, 256 threads, each owning a 4x4 register block
// (rows ty*4.., cols tx*4..): per k step a thread does 2 float4 shared loads for 16 FMAs,
// and the 64x64 tile keeps enough blocks in flight at the factor sizes of the paper
// (d = 64..1024: 1..256 blocks) where a 128x128 tile would leave most SMs idle. The next
// k slice is prefetched into registers while the current one is consumed (one shared
// buffer, two barriers per slice). Global loads are coalesced for every transpose case:
// each operand tile is read along its contiguous dimension and stored k-major in shared
// memory (padded rows of 68 floats keep the 16-byte alignment of the float4 reads).
#define PG_BM 64
#define PG_BN 64
#define PG_BK 16
#define PG_LDS (PG_BM + 4)
#define PG_THREADS 256
static_assert(PG_BN == PG_BM, "pg_load reads op(B)'s slice as op(A)'s, transposed");

// One operand's 64x16 slice of the tile (op(A)[m0.., k0..], or op(B)[k0.., n0..] as its
// transpose, since PG_BN == PG_BM): the 64 values along the tile's edge (rows i of op(A),
// columns j of op(B)) by 16 along k. KOuter: the operand is stored k-major (X[k·ld + i]:
// Aᵀ stored for op(A) = Aᵀ, B stored for op(B) = B), else i-major (X[i·ld + k]).
// Element e = tid + 256 l of the slice is (i, kk); the mapping follows X's contiguous
// dimension so consecutive threads read consecutive addresses.
template <bool KOuter>
__device__ __forceinline__ void pg_slice_at(int l, int& i, int& kk) {
    const int e = threadIdx.x + PG_THREADS * l;
    i = KOuter ? e % PG_BM : e / PG_BK;
    kk = KOuter ? e / PG_BM : e % PG_BK;
}

// Loads the slice of X (`rows` x K along the edge and k, leading dimension ld) at edge
// offset o0, depth k0 into registers (zero outside the matrix).
template <bool KOuter>
__device__ __forceinline__ void pg_load(const float* __restrict__ X, int rows, int K, int ld,
                                        int o0, int k0, float (&r)[4]) {
GRNG_UNROLL
    for (int l = 0; l < 4; ++l) {
        int i, kk;
        pg_slice_at<KOuter>(l, i, kk);
        const int gi = o0 + i, gk = k0 + kk;
        float v = 0.0f;
        if (gi < rows && gk < K)
            v = KOuter ? X[(long long)gk * ld + gi] : X[(long long)gi * ld + gk];
        r[l] = v;
    }
}

// Stores a loaded slice k-major in shared memory: Xs[kk·PG_LDS + i].
template <bool KOuter>
__device__ __forceinline__ void pg_store(float* Xs, const float (&r)[4]) {
GRNG_UNROLL
    for (int l = 0; l < 4; ++l) {
        int i, kk;
        pg_slice_at<KOuter>(l, i, kk);
        Xs[kk * PG_LDS + i] = r[l];
    }
}

template <bool TA, bool TB>
__device__ __forceinline__ void gemm_body(const float* __restrict__ A,
                                                  const float* __restrict__ B,
                                                  float* __restrict__ C, int M, int N, int K,
                                                  int lda, int ldb, int ldc, float alpha,
                                                  float beta) {
    __align__(16) __shared__ float As[PG_BK * PG_LDS];
    __align__(16) __shared__ float Bs[PG_BK * PG_LDS];
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int m0 = blockIdx.y * PG_BM, n0 = blockIdx.x * PG_BN;

    float acc[4][4] = {};

    float ra[4], rb[4];
    if (K > 0) {
        pg_load<TA>(A, M, K, lda, m0, 0, ra);
        pg_load<!TB>(B, N, K, ldb, n0, 0, rb);
    }
    for (int k0 = 0; k0 < K; k0 += PG_BK) {
        __syncthreads();  // the previous slice has been consumed
        pg_store<TA>(As, ra);
        pg_store<!TB>(Bs, rb);
        __syncthreads();
        if (k0 + PG_BK < K) {  // prefetch the next slice; its latency hides behind the FMAs
            pg_load<TA>(A, M, K, lda, m0, k0 + PG_BK, ra);
            pg_load<!TB>(B, N, K, ldb, n0, k0 + PG_BK, rb);
        }
        grng_fma_slice_4x4<PG_BK, PG_LDS>(As, Bs, ty, tx, acc);
    }

GRNG_UNROLL
    for (int r = 0; r < 4; ++r) {
        const int i = m0 + ty * 4 + r;
        if (i >= M) continue;
GRNG_UNROLL
        for (int c = 0; c < 4; ++c) {
            const int j = n0 + tx * 4 + c;
            if (j >= N) continue;
            gemm_axpby(C + (long long)i * ldc + j, alpha, acc[r][c], beta);
        }
    }
}

// One entry point per transpose combination (n = op(X) = X, t = op(X) = Xᵀ); grid
// (ceil(N/64), ceil(M/64)), block 256, no dynamic shared memory.
#define PRECOND_GEMM(name, TA, TB)                                                           \
    extern "C" __global__ void __launch_bounds__(PG_THREADS)                                 \
        name(const float* __restrict__ A, const float* __restrict__ B, float* __restrict__ C, \
             int M, int N, int K, int lda, int ldb, int ldc, float alpha, float beta) {      \
        gemm_body<TA, TB>(A, B, C, M, N, K, lda, ldb, ldc, alpha, beta);             \
    }                                                                                        \
    GRNG_EMU_ENTRY(name, (const float*, const float*, float*, int, int, int, int, int, int,  \
                          float, float))

PRECOND_GEMM(gemm_nn, false, false)
PRECOND_GEMM(gemm_nt, false, true)
PRECOND_GEMM(gemm_tn, true, false)
PRECOND_GEMM(gemm_tt, true, true)

// ---------------------------------------------------------------------------------------
// f32-accurate products on the tensor cores (preconditioning, damped-inverse update): each
// f32 operand is split once into three bf16 planes (gemm_split3), then gemm3_tc
// runs the GEMM engine over the 6 significant plane products (engine.cuh, "Split
// products"), f32 accumulation, with the same α·C + β·C_old epilogue as the fp32 GEMM.

// planes[p·count + i] = plane p (hi, mid, lo) of x[i], i < count. Grid-stride, block 256.
extern "C" __global__ void __launch_bounds__(256)
    gemm_split3(const float* __restrict__ x, __nv_bfloat16* __restrict__ planes,
                   long long count) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x) {
        grng_store_split3(planes, i, count, x[i]);
    }
}
GRNG_EMU_ENTRY(gemm_split3, (const float*, __nv_bfloat16*, long long))

// The six plane products of a split3 product as ONE bf16 operand with K concatenated (K' = 6K),
// for a plain bf16 GEMM (cuBLAS's, or gemm_tc) to sum them in one accumulator: term t of
// the order above is K block t, holding plane (role_b ? GRNG_SPLIT3_B_PLANES :
// GRNG_SPLIT3_A_PLANES) of term t. x is rows x cols, row-major; with k_rows K runs along
// the rows (op(A) = Aᵀ, op(B) = B): out is 6·rows x cols, block t rows t·rows..; else along
// the columns (op(A) = A, op(B) = Bᵀ): out is rows x 6·cols, block t columns t·cols... Both
// operands of a product built so are aligned term by term, and a K loop in order sums the
// small products first, as gemm3_tc does. Grid-stride over rows·cols, block 256.
extern "C" __global__ void __launch_bounds__(256)
    gemm_split3_cat(const float* __restrict__ x, __nv_bfloat16* __restrict__ out,
                    long long rows, long long cols, int role_b, int k_rows) {
    const int order = role_b ? GRNG_SPLIT3_B_PLANES : GRNG_SPLIT3_A_PLANES;
    const long long count = rows * cols;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x) {
        __nv_bfloat16 hi, mid, lo;
        grng_split3(x[i], hi, mid, lo);
        // Term t's element: at t·count + i (K along rows), or at row·6·cols + t·cols + col.
        const long long base = k_rows ? i : i + 5 * cols * (i / cols);
        const long long step = k_rows ? count : cols;
        GRNG_UNROLL
        for (int t = 0; t < GRNG_SPLIT3_TERMS; ++t) {
            // Selects, not an array indexed at run time (which would live in local memory).
            const int q = (order >> (2 * t)) & 3;
            out[base + t * step] = q == 0 ? hi : (q == 1 ? mid : lo);
        }
    }
}
GRNG_EMU_ENTRY(gemm_split3_cat,
               (const float*, __nv_bfloat16*, long long, long long, int, int))

// C (M x N, ld ldc) ← α·acc + β·C. With a status (not null), the first flat index
// i·ldc + j of a NaN/Inf written is flagged while the tile is stored (the result check in
// the same pass: a per-thread minimum, then a warp minimum and one atomicMin per warp that
// saw one, grng_flag_first); the caller passes ldc = N, so it is the row-major index.
// Split (the split products only): with planes (not null), the split3 planes of each value
// stored are written too (grng_store_split3, plane p at p·M·ldc), so that a product reading
// C next does not split it (a gemm_split3 launch and 10 bytes per element); with mirror (a
// product symmetric in exact arithmetic, M = N, whose grid runs the lower-triangle tile
// pairs only: GEMM_MIRROR), each accumulator at (i, j), j < i, is stored at (i, j) and at
// (j, i), each with its own position's β·C, planes and flag, and those above the diagonal
// (the diagonal tiles' upper halves) are skipped: C is exactly symmetric.
template <bool Split>
struct PrecondAxpby {
    float* __restrict__ C;
    int ldc;
    float alpha, beta;
    int* __restrict__ status;
    __nv_bfloat16* __restrict__ planes;
    long long plane;
    bool mirror;
    int bad = GRNG_NONE;
    __device__ __forceinline__ void put(int i, int j, float acc) {
        const long long o = (long long)i * ldc + j;
        const float v = gemm_axpby(C + o, alpha, acc, beta);
        if (Split && planes != nullptr) grng_store_split3(planes, o, plane, v);
        // A thread's elements do not come in index order (fragment layout): keep the least.
        if (status != nullptr && !isfinite(v)) bad = min(bad, i * ldc + j);
    }
    __device__ __forceinline__ void operator()(int i, int j, float acc) {
        if (Split && mirror) {
            if (j > i) return;
            if (j < i) put(j, i, acc);
        }
        put(i, j, acc);
    }
    // Every thread calls it; `status` is the same for the whole grid, so the warp agrees.
    __device__ __forceinline__ void finish() {
        if (status != nullptr) grng_flag_first(status, bad);
    }
};

// The entry points of the bf16 products: one signature and epilogue (PrecondAxpby), the
// block tile TILE (GrngTileSm80 or GrngTileSm90a, grng_gemm_tile_layouts) over TERMS plane
// products, __launch_bounds__(__VA_ARGS__). Each sm_80 kernel has an sm_90a instance
// (kernels/gemm/wgmma_sm90.cuh) that only the compute_90a build compiles: same parameters,
// grid and epilogue; block 384, GRNG_WG_SMEM bytes of dynamic shared memory.
#define GEMM_MIRROR 4
#define GEMM_TC(name, TILE, TERMS, ...)                                                       \
    extern "C" __global__ void __launch_bounds__(__VA_ARGS__)                                 \
        name(const __nv_bfloat16* __restrict__ a, int lda, long long a_plane,                 \
             const __nv_bfloat16* __restrict__ b, int ldb, long long b_plane,                 \
             float* __restrict__ c, int ldc, int M, int N, int K, float alpha, float beta,    \
             int trans, int* __restrict__ status, __nv_bfloat16* __restrict__ planes) {       \
        GRNG_DYN_SHARED(__nv_bfloat16, smem);                                                 \
        const bool mirror = TERMS > 1 && (trans & GEMM_MIRROR);                               \
        PrecondAxpby<(TERMS > 1)> epi{c, ldc, alpha, beta, status,                            \
                                      planes, (long long)M * ldc, mirror};                    \
        int bi = blockIdx.y, bj = blockIdx.x;                                                 \
        if (mirror) grng_tri_tile(blockIdx.x, bi, bj);                                        \
        grng_gemm_tile_layouts<TILE, TERMS>(a, lda, a_plane, b, ldb, b_plane, M, N, K, trans,  \
                                            bi * GRNG_GEMM_BM, bj * GRNG_GEMM_BM, smem, epi);  \
    }
#define GEMM_TC_TYPES                                                                          \
    (const __nv_bfloat16*, int, long long, const __nv_bfloat16*, int, long long, float*, int, \
     int, int, int, float, float, int, int*, __nv_bfloat16*)

// C ← α·op(A)·op(B) + β·C with A, B given as split3 planes (a_plane, b_plane elements
// apart; lda, ldb the stored row lengths). trans bit 0: op(A) = Aᵀ, bit 1: op(B) = Bᵀ,
// bit 2 (GEMM_MIRROR, gemm3_tc only): the product is symmetric, M = N, and the grid is 1-D
// over the nt(nt+1)/2 lower-triangle tile pairs (grng_tri_tile), mirrored by PrecondAxpby.
// status: null, or an int preset to GRNG_NONE that gets the first flat index of a NaN/Inf
// in C (PrecondAxpby; M·N must fit an int then). planes: null, or 3·M·N bf16 that get the
// split3 planes of C as stored (ldc = N; gemm_tc ignores it). Grid
// (ceil(N/128), ceil(M/128)), block 256, GRNG_GEMM_SMEM bytes of dynamic shared memory.
GEMM_TC(gemm3_tc, GrngTileSm80, GRNG_SPLIT3_TERMS, GRNG_GEMM_THREADS)
GRNG_EMU_ENTRY(gemm3_tc, GEMM_TC_TYPES)

// The plain bf16 product (Device::gemm on bf16 operands): gemm3_tc's parameters,
// layouts, grid, block and shared memory with one term, so a_plane and b_plane are unused.
GEMM_TC(gemm_tc, GrngTileSm80, 1, GRNG_GEMM_THREADS)
GRNG_EMU_ENTRY(gemm_tc, GEMM_TC_TYPES)

#ifdef GRNG_SM90A
GEMM_TC(gemm3_wg_tc, GrngTileSm90a, GRNG_SPLIT3_TERMS, GRNG_WG_THREADS, 1)
GEMM_TC(gemm_wg_tc, GrngTileSm90a, 1, GRNG_WG_THREADS, 1)
#endif

// ---------------------------------------------------------------------------------------
// a[i, i] += lambda for i < n (a is n x n with leading dimension ld). Grid-stride over the
// diagonal: n strided elements, each its own memory sector anyway.
extern "C" __global__ void gemm_add_diagonal(float* __restrict__ a, int n, int ld,
                                                float lambda) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        a[(long long)i * (ld + 1)] += lambda;
}
GRNG_EMU_ENTRY(gemm_add_diagonal, (float*, int, int, float))

// ---------------------------------------------------------------------------------------
// Trace of an n x n matrix (leading dimension ld), one block (blockDim.x a multiple of 32,
// at most 1024). The finite diagonal entries are summed in f64 (like the CPU backend; an
// f32 sum of f32 values cannot overflow f64), and the smallest index of a non-finite entry
// is found alongside, so the host learns both from one 3-float read-back:
// out[0] = the sum rounded to f32, out[1] = that index as int bits (−1: none),
// out[2] = the offending value (0 when none).
extern "C" __global__ void __launch_bounds__(1024)
    gemm_trace(const float* __restrict__ a, int n, int ld, float* __restrict__ out) {
    __shared__ double wsum[32];
    __shared__ int wbad[32];
    double s = 0.0;
    int bad = 0x7fffffff;
    // Ascending per thread, so the first non-finite entry a thread meets is its smallest.
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = a[(long long)i * (ld + 1)];
        if (fabsf(v) <= 3.402823466e38f) {
            s += (double)v;
        } else if (bad == 0x7fffffff) {
            bad = i;
        }
    }
GRNG_UNROLL
    for (int o = 16; o > 0; o >>= 1) {
        s += __shfl_xor_sync(GRNG_FULL_MASK, s, o);
        bad = min(bad, __shfl_xor_sync(GRNG_FULL_MASK, bad, o));
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    if (lane == 0) {
        wsum[warp] = s;
        wbad[warp] = bad;
    }
    __syncthreads();
    if (warp == 0) {
        s = lane < nwarps ? wsum[lane] : 0.0;
        bad = lane < nwarps ? wbad[lane] : 0x7fffffff;
GRNG_UNROLL
        for (int o = 16; o > 0; o >>= 1) {
            s += __shfl_xor_sync(GRNG_FULL_MASK, s, o);
            bad = min(bad, __shfl_xor_sync(GRNG_FULL_MASK, bad, o));
        }
        if (lane == 0) {
            const bool none = bad == 0x7fffffff;
            out[0] = (float)s;
            out[1] = __int_as_float(none ? -1 : bad);
            out[2] = none ? 0.0f : a[(long long)bad * (ld + 1)];
        }
    }
}
GRNG_EMU_ENTRY(gemm_trace, (const float*, int, int, float*))
