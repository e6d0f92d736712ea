// Newton–Schulz inversion of SPD matrices (docs/math.md §2, §5.2) and power iteration.
//
// One step from X with E = I − AX is X ← X + X·F, F = E (quadratic), E + E² (cubic),
// E + E² + E³ (quartic) — the CPU oracle's form (src/cpu/newton.rs): the small correction F,
// not p(AX) ≈ I, is what gets rounded to bf16. Every product is one GEMM launch whose
// epilogue applies the step's algebra:
//   T-product   E  = I − A·X        → E (f32 + bf16 copy) and per-block Σ E² (the residual)
//   cubic       F  = E·E + E        → F (bf16, or f32 in f32 mode)
//   quartic     G  = E·E; F = G·E + G + E   (two nested fused epilogues)
//   update      X' = X·F + X        → X' (f32 + bf16 copy) into another buffer
// so no pass over n² elements runs outside the GEMMs. In f32 mode an epilogue also writes its
// output's split3 planes (NEWTON_OUT_SPLIT3) while the engine runs the products, and the next
// product reads them: only A and a start are split (gemm_split3), once per inversion.
// All products run on the tensor-core
// GEMM engine (kernels/gemm/engine.cuh: mma.sync m16n8k16 on 128x128 tiles, f32
// accumulation): newton_gemm_tc on the bf16 copies the epilogues wrote (bf16 mode);
// newton_gemm3_tc on split3 planes of f32 operands, f32-accurate (f32 mode, and the bf16
// run's f32 residual and polish) — no SIMT GEMM and no extra pass over the product. The
// residual partials are reduced in a fixed order by newton_residual, whose single float is
// the only per-iteration transfer to the host. Where the GEMM plan (src/cuda/gemm_plan.rs)
// runs a product on cuBLAS instead, newton_epilogue applies the same epilogue to it.
//
// Setup kernels: newton_sym_stats (symmetric part, bf16 copy, max|a|, asymmetry, first
// non-finite), newton_abs_norms (‖·‖∞, ‖·‖₁, ‖·‖_F partials), newton_init_x (X₀ = αA or cI);
// power iteration: newton_power_step, one launch per step (w = Av, whose last block to finish
// sums the partials and normalizes v; the Rayleigh quotient and ‖Av‖ as double-float pairs for
// the host's stop test, one slot per step of a batch read back at once).
#include "common.cuh"
#include "gemm/engine.cuh"
#include "gemm/wgmma_sm90.cuh"

// Output tile of the tensor-core GEMM (the engine's): one residual partial per tile.
#define NEWTON_TILE GRNG_GEMM_BM

// Epilogue flags (the `flags` parameter of newton_gemm_tc and newton_gemm3_tc).
#define NEWTON_ADD1 1       // v += add1[r, c]
#define NEWTON_ADD2 2       // v += add2[r, c]
#define NEWTON_OUT_F32 4    // out[r, c] = v
#define NEWTON_OUT_BF16 8   // out_bf[r, c] = bf16(v)
#define NEWTON_RESID 16     // partial[block] = Σ v² over the block's tile
#define NEWTON_MIRROR 32    // symmetric product: lower-triangle tiles only, C[c, r] = C[r, c]
#define NEWTON_OUT_SPLIT3 64  // out_bf holds 3 planes n² apart: grng_split3(v), gemm_split3's

// v = alpha·c + diag·[r = col] + add1 + add2 at (r, col), the additions in the CPU's order.
__device__ __forceinline__ float newton_epi_value(float c, int r, int col, int n, float alpha,
                                                  float diag, const float* __restrict__ add1,
                                                  const float* __restrict__ add2, int flags) {
    float v = alpha * c;
    if (r == col) v += diag;
    const size_t o = (size_t)r * n + col;
    if (flags & NEWTON_ADD1) v += add1[o];
    if (flags & NEWTON_ADD2) v += add2[o];
    return v;
}

// NEWTON_OUT_SPLIT3 (AllowSplit kernels only: the f32 products and the vendor's epilogue) writes
// the planes a later f32 product reads, so it does not split this output again (a launch and
// 10 bytes per element). The flag replaces NEWTON_OUT_BF16 (bf16 mode), whose pointer it takes.
template <bool AllowSplit>
__device__ __forceinline__ void newton_epi_store(float* __restrict__ out,
                                                 __nv_bfloat16* __restrict__ out_bf, size_t o,
                                                 size_t plane, float v, int flags) {
    if (flags & NEWTON_OUT_F32) out[o] = v;
    if (flags & NEWTON_OUT_BF16) grng_st_bf16(&out_bf[o], v);
    if (AllowSplit && (flags & NEWTON_OUT_SPLIT3)) grng_store_split3(out_bf, o, plane, v);
}

// partial[block] = Σ over the block's threads of sq, when flags ask for the residual. Every
// thread of the block calls it.
__device__ __forceinline__ void newton_store_partial(float sq, float* __restrict__ partial,
                                                     int flags) {
    if (flags & NEWTON_RESID) {
        __shared__ float scratch[32];
        const float s = grng_block_sum(sq, scratch);
        if (threadIdx.x == 0) partial[blockIdx.y * gridDim.x + blockIdx.x] = s;
    }
}

// ---------------------------------------------------------------------------------------
// bf16 tensor-core GEMM with the fused epilogue: C = A·B for n x n row-major bf16 A, B on
// the GEMM engine (kernels/gemm/engine.cuh; A k-inner, B k-outer), the epilogue applied
// from the accumulator registers. Grid (ceil(n/128), ceil(n/128)), block 256,
// GRNG_GEMM_SMEM bytes of dynamic shared memory.
//
// NEWTON_MIRROR (newton_gemm3_tc only: the f32 products, where the driver uses it; the bf16
// kernel keeps the plain epilogue and its 2-blocks-per-SM register budget, which the mirror's
// second store would overflow): the product is known to be symmetric, so only the
// nt(nt+1)/2 lower-triangle tile pairs run (1-D grid, grng_tri_tile, as the SYRK) and the epilogue writes each
// accumulator C[r, c] (c ≤ r) at (r, c) and at (c, r), each with its own position's
// algebra (diag, add1, add2 read at that position): the product is mirrored, the additions
// are not. C = A·B is symmetric when A and B are polynomials in the same symmetric matrix —
// for Newton the powers of E = I − AX while X is a polynomial in A (scaled-identity or αA
// start, not a warm start); the driver (src/iteration.rs) sets it only then, and only in the
// early f32 phase (T = AX and X·F stay full: see src/cpu/newton.rs for why). The diagonal
// tiles' upper halves are skipped (the mirror writes them). No residual with the mirror
// (the launcher refuses the combination). Saves (nt − 1)/(2nt) of the tiles.
// AllowSplit: NEWTON_OUT_SPLIT3 is honoured (not in the bf16 products, which keep their
// register budget as for the mirror).
template <bool AllowMirror, bool AllowSplit>
struct NewtonEpi {
    const float* __restrict__ add1;
    const float* __restrict__ add2;
    float* __restrict__ out;
    __nv_bfloat16* __restrict__ out_bf;
    float* __restrict__ partial;
    int n;
    float alpha, diag;
    int flags;
    float sq;  // this thread's Σ v²
    __device__ __forceinline__ void put(int r, int c, float acc) {
        const float v = newton_epi_value(acc, r, c, n, alpha, diag, add1, add2, flags);
        newton_epi_store<AllowSplit>(out, out_bf, (size_t)r * n + c, (size_t)n * n, v, flags);
        sq = fmaf(v, v, sq);
    }
    __device__ __forceinline__ void operator()(int r, int c, float acc) {
        if (AllowMirror && (flags & NEWTON_MIRROR)) {
            if (c > r) return;
            if (c < r) put(c, r, acc);
        }
        put(r, c, acc);
    }
    __device__ __forceinline__ void finish() { newton_store_partial(sq, partial, flags); }
};

// The parameters of the four product entries (bf16 operands, or split3 planes n² elements
// apart, then the epilogue's buffers and scalars), their emulator type list, and the
// epilogue they build from them: one signature, so the Rust launchers pass one argument list.
#define NEWTON_GEMM_PARAMS                                                                       \
    const __nv_bfloat16 *__restrict__ a, const __nv_bfloat16 *__restrict__ b,                   \
        const float *__restrict__ add1, const float *__restrict__ add2,                         \
        float *__restrict__ out, __nv_bfloat16 *__restrict__ out_bf,                            \
        float *__restrict__ partial, int n, float alpha, float diag, int flags
#define NEWTON_GEMM_TYPES                                                                        \
    (const __nv_bfloat16*, const __nv_bfloat16*, const float*, const float*, float*,             \
     __nv_bfloat16*, float*, int, float, float, int)
#define NEWTON_EPI(AllowMirror, AllowSplit)                                                      \
    NewtonEpi<AllowMirror, AllowSplit> epi { add1, add2, out, out_bf, partial, n, alpha, diag,   \
                                             flags, 0.0f }

// Both entries share this body: Terms = 1 for bf16 operands, GRNG_SPLIT3_TERMS for f32
// operands given as split3 planes n² elements apart (f32-accurate, engine.cuh).
template <int Terms, bool AllowMirror, bool AllowSplit>
__device__ __forceinline__ void newton_gemm_body(const __nv_bfloat16* __restrict__ a,
                                                 const __nv_bfloat16* __restrict__ b,
                                                 long long plane,
                                                 NewtonEpi<AllowMirror, AllowSplit>& epi) {
    GRNG_DYN_SHARED(__nv_bfloat16, smem);
    const int n = epi.n;
    int bi = blockIdx.y, bj = blockIdx.x;
    if (AllowMirror && (epi.flags & NEWTON_MIRROR)) grng_tri_tile(blockIdx.x, bi, bj);
    grng_gemm_tile<GrngKInner, GrngKOuter, Terms>(a, n, plane, b, n, plane, n, n, n,
                                                  bi * NEWTON_TILE, bj * NEWTON_TILE, smem,
                                                  epi);
}

extern "C" __global__ void __launch_bounds__(GRNG_GEMM_THREADS, 2)
    newton_gemm_tc(NEWTON_GEMM_PARAMS) {
    NEWTON_EPI(false, false);
    newton_gemm_body<1>(a, b, 0, epi);
}
GRNG_EMU_ENTRY(newton_gemm_tc, NEWTON_GEMM_TYPES)

#ifdef GRNG_SM90A
// A template like newton_gemm_body: the dynamic shared memory must be declared with the
// same linkage in both. Terms and AllowMirror as there.
template <int Terms, bool AllowMirror, bool AllowSplit>
__device__ __forceinline__ void newton_gemm_wg_body(const __nv_bfloat16* __restrict__ a,
                                                    const __nv_bfloat16* __restrict__ b,
                                                    long long plane,
                                                    NewtonEpi<AllowMirror, AllowSplit>& epi) {
    GRNG_DYN_SHARED(__nv_bfloat16, smem);
    int bi = blockIdx.y, bj = blockIdx.x;
    if (AllowMirror && (epi.flags & NEWTON_MIRROR)) grng_tri_tile(blockIdx.x, bi, bj);
    grng_wg_gemm_tile<GrngKInner, GrngKOuter, Terms>(a, epi.n, plane, b, epi.n, plane, epi.n,
                                                     epi.n, epi.n, bi * NEWTON_TILE,
                                                     bj * NEWTON_TILE, smem, epi);
}

// The sm_90a instances (kernels/gemm/wgmma_sm90.cuh), same parameters, grids and epilogues
// as newton_gemm_tc and newton_gemm3_tc; block 384, GRNG_WG_SMEM bytes of dynamic shared
// memory. Only in the compute_90a build.
extern "C" __global__ void __launch_bounds__(GRNG_WG_THREADS, 1)
    newton_gemm_wg_tc(NEWTON_GEMM_PARAMS) {
    // Full products only, as newton_gemm_tc (the mirror and the planes are split3-only).
    NEWTON_EPI(false, false);
    newton_gemm_wg_body<1, false>(a, b, 0, epi);
}

extern "C" __global__ void __launch_bounds__(GRNG_WG_THREADS, 1)
    newton_gemm3_wg_tc(NEWTON_GEMM_PARAMS) {
    NEWTON_EPI(true, true);
    newton_gemm_wg_body<GRNG_SPLIT3_TERMS, true>(a, b, (long long)n * n, epi);
}
#endif

// The f32 products (f32 mode, the bf16 run's f32 residual and polish): a, b hold the three
// split3 planes of the f32 A and B (plane p at p·n²). Same grid, block and shared memory.
extern "C" __global__ void __launch_bounds__(GRNG_GEMM_THREADS)
    newton_gemm3_tc(NEWTON_GEMM_PARAMS) {
    NEWTON_EPI(true, true);
    newton_gemm_body<GRNG_SPLIT3_TERMS>(a, b, (long long)n * n, epi);
}
GRNG_EMU_ENTRY(newton_gemm3_tc, NEWTON_GEMM_TYPES)

// The epilogue alone, over a product computed elsewhere: the GEMM plan's vendor candidate
// (src/cuda/gemm_plan.rs) has cuBLAS write C = A·B into the f32 matrix c, then this applies
// NewtonEpi's algebra (its put and finish: one definition) with the same flags, outputs and
// residual partials: one per 128x128 tile, at the index the fused kernels' grid gives it, so
// newton_residual reduces either. Grid (ceil(n/128), ceil(n/128)), block 256; each block
// walks its tile in 32x32 sub-tiles staged in shared memory (coalesced loads).
// NEWTON_MIRROR: c is a full product, but the engine's mirrored one is built from its lower
// triangle only, so this reads the lower triangle only too: (r, col) above the diagonal takes
// c[col, r] (the partner sub-tile, loaded coalesced, read transposed). Both candidates then
// agree within their products' rounding even where the operands are not exactly symmetric.
extern "C" __global__ void __launch_bounds__(256)
    newton_epilogue(const float* __restrict__ c, const float* __restrict__ add1,
                    const float* __restrict__ add2, float* __restrict__ out,
                    __nv_bfloat16* __restrict__ out_bf, float* __restrict__ partial, int n,
                    float alpha, float diag, int flags) {
    constexpr int S = 32, PER = NEWTON_TILE / S;
    __shared__ float t[S][S + 1];
    NEWTON_EPI(false, true);
    const int tx = threadIdx.x % S, ty = threadIdx.x / S, rows = blockDim.x / S;
    const bool mirror = flags & NEWTON_MIRROR;
    for (int s = 0; s < PER * PER; ++s) {
        const int si = blockIdx.y * PER + s / PER, sj = blockIdx.x * PER + s % PER;
        // Block-uniform: every thread takes the same branch, so the barriers below match.
        if (si * S >= n || sj * S >= n) continue;
        // A sub-tile wholly above the diagonal (mirror): its values come from the partner.
        const bool flip = mirror && sj > si;
        const int r0 = S * (flip ? sj : si), c0 = S * (flip ? si : sj);
        for (int dy = ty; dy < S; dy += rows) {
            const int r = r0 + dy, col = c0 + tx;
            t[dy][tx] = (r < n && col < n) ? c[(size_t)r * n + col] : 0.0f;
        }
        __syncthreads();
        for (int dy = ty; dy < S; dy += rows) {
            const int r = si * S + dy, col = sj * S + tx;
            if (r < n && col < n) {
                const bool upper = flip || (mirror && si == sj && tx > dy);
                epi.put(r, col, upper ? t[tx][dy] : t[dy][tx]);
            }
        }
        __syncthreads();
    }
    epi.finish();
}
GRNG_EMU_ENTRY(newton_epilogue, (const float*, const float*, const float*, float*,
                                 __nv_bfloat16*, float*, int, float, float, int))

// ---------------------------------------------------------------------------------------
// Reductions in double with a fixed tree (deterministic for a given launch shape).
__device__ __forceinline__ double newton_warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(GRNG_FULL_MASK, v, o);
    return v;
}

// Block sum of `v`, returned to every thread; blockDim.x a multiple of 32; every thread calls.
__device__ __forceinline__ double newton_block_sum_d(double v) {
    __shared__ double scratch[32];
    const int tid = threadIdx.x, nwarps = blockDim.x / 32;
    v = newton_warp_sum_d(v);
    if ((tid & 31) == 0) scratch[tid >> 5] = v;
    __syncthreads();
    double t = (tid & 31) < nwarps ? scratch[tid & 31] : 0.0;
    t = newton_warp_sum_d(t);
    __syncthreads();
    return t;
}

// res[0] = sqrt(Σ partial[0..count) / n): the residual ‖I − AX‖_F/√n from the T-product's
// per-block Σ E². One block of 256 threads.
extern "C" __global__ void __launch_bounds__(256)
    newton_residual(const float* __restrict__ partial, int count, int n, float* __restrict__ res) {
    double s = 0.0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) s += (double)partial[i];
    s = newton_block_sum_d(s);
    if (threadIdx.x == 0) res[0] = (float)sqrt(s / (double)n);
}
GRNG_EMU_ENTRY(newton_residual, (const float*, int, int, float*))

// ---------------------------------------------------------------------------------------
// Symmetric part and input checks. Block (32, 8) per row band of 32 rows (grid ceil(n/32)):
// for each 32x32 tile (band, j) the tile and its mirror (j, band) are read coalesced into
// shared memory. Writes sym = (a + aᵀ)/2 (flags & 1) and its bf16 rounding (flags & 2), and
// per block stats[6b..6b+6] = max |a_ij|, max |a_ij − a_ji|, the first (row-major) index of a
// non-finite element as int bits (INT_MAX when none), that element, the band's largest finite
// diagonal element (−f32::MAX when none) and its row as int bits (the first on ties; the power
// iteration's lower bound on λ_max and its restart).
extern "C" __global__ void __launch_bounds__(256)
    newton_sym_stats(const float* __restrict__ a, int n, float* __restrict__ sym,
                     __nv_bfloat16* __restrict__ sym_bf, float* __restrict__ stats, int flags) {
    __shared__ float t0[32][33];
    __shared__ float t1[32][33];
    __shared__ float red[4][256];
    __shared__ int bad_idx[256];
    __shared__ int diag_row[256];
    const int tx = threadIdx.x, ty = threadIdx.y, tid = ty * 32 + tx;
    const int i0 = blockIdx.x * 32;
    float mx = 0.0f, asym = 0.0f, bad_val = 0.0f, dmax = -3.402823466e38f;
    int bad = 0x7fffffff, drow = 0x7fffffff;
    for (int j0 = 0; j0 < n; j0 += 32) {
        for (int dy = ty; dy < 32; dy += 8) {
            const int r = i0 + dy, c = j0 + tx;
            t0[dy][tx] = (r < n && c < n) ? a[(size_t)r * n + c] : 0.0f;
            const int r2 = j0 + dy, c2 = i0 + tx;
            t1[dy][tx] = (r2 < n && c2 < n) ? a[(size_t)r2 * n + c2] : 0.0f;
        }
        __syncthreads();
        for (int dy = ty; dy < 32; dy += 8) {
            const int r = i0 + dy, c = j0 + tx;
            if (r < n && c < n) {
                const float x = t0[dy][tx], y = t1[tx][dy];
                const int idx = r * n + c;
                if ((__float_as_uint(x) & 0x7f800000u) == 0x7f800000u) {
                    if (idx < bad) {
                        bad = idx;
                        bad_val = x;
                    }
                } else {
                    mx = fmaxf(mx, fabsf(x));
                    asym = fmaxf(asym, fabsf(x - y));
                    // Rows grow along this thread's walk, so `>` keeps the first on ties.
                    if (r == c && x > dmax) {
                        dmax = x;
                        drow = r;
                    }
                }
                const float s = 0.5f * (x + y);
                if (flags & 1) sym[idx] = s;
                if (flags & 2) grng_st_bf16(&sym_bf[idx], s);
            }
        }
        __syncthreads();
    }
    red[0][tid] = mx;
    red[1][tid] = asym;
    red[2][tid] = bad_val;
    red[3][tid] = dmax;
    bad_idx[tid] = bad;
    diag_row[tid] = drow;
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (tid < s) {
            red[0][tid] = fmaxf(red[0][tid], red[0][tid + s]);
            red[1][tid] = fmaxf(red[1][tid], red[1][tid + s]);
            if (bad_idx[tid + s] < bad_idx[tid]) {
                bad_idx[tid] = bad_idx[tid + s];
                red[2][tid] = red[2][tid + s];
            }
            const float d = red[3][tid + s];
            if (d > red[3][tid] || (d == red[3][tid] && diag_row[tid + s] < diag_row[tid])) {
                red[3][tid] = d;
                diag_row[tid] = diag_row[tid + s];
            }
        }
        __syncthreads();
    }
    if (tid == 0) {
        float* o = stats + 6 * blockIdx.x;
        o[0] = red[0][0];
        o[1] = red[1][0];
        o[2] = __int_as_float(bad_idx[0]);
        o[3] = red[2][0];
        o[4] = red[3][0];
        o[5] = __int_as_float(diag_row[0]);
    }
}
GRNG_EMU_ENTRY(newton_sym_stats, (const float*, int, float*, __nv_bfloat16*, float*, int))

// ‖m‖∞, ‖m‖₁, ‖m‖_F and tr m partials (the λ_max bound of the Newton start needs all but ‖m‖₁).
// Block (32, 8) per band b of 32 rows and 32 columns (grid ceil(n/32)): row sums of |m| and
// of m² for rows 32b.. (a warp per row, lanes across the row), column sums of |m| for columns
// 32b.. (lane = column, warps down the rows, fixed-order combine), all in double.
// partial[4b] = the band's largest row sum, partial[4b + 1] its largest column sum,
// partial[4b + 2] its rows' Σ m², partial[4b + 3] its diagonal's sum.
extern "C" __global__ void __launch_bounds__(256)
    newton_abs_norms(const float* __restrict__ m, int n, float* __restrict__ partial) {
    __shared__ double cols[8][32];
    __shared__ double rows[32];
    __shared__ double squares[32];
    __shared__ double diag[32];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const int b0 = blockIdx.x * 32;
    for (int i = ty; i < 32; i += 8) {
        const int r = b0 + i;
        double s = 0.0, q = 0.0, d = 0.0;
        if (r < n)
            for (int c = tx; c < n; c += 32) {
                const double v = (double)m[(size_t)r * n + c];
                s += fabs(v);
                q += v * v;
                if (c == r) d = v;
            }
        s = newton_warp_sum_d(s);
        q = newton_warp_sum_d(q);
        d = newton_warp_sum_d(d);
        if (tx == 0) {
            rows[i] = s;
            squares[i] = q;
            diag[i] = d;
        }
    }
    double cs = 0.0;
    const int c = b0 + tx;
    if (c < n)
        for (int r = ty; r < n; r += 8) cs += (double)fabsf(m[(size_t)r * n + c]);
    cols[ty][tx] = cs;
    __syncthreads();
    if (ty == 0) {
        double col = 0.0;
        for (int k = 0; k < 8; ++k) col += cols[k][tx];
        double row = rows[tx];
        double sq = squares[tx];
        double tr = diag[tx];
        for (int o = 16; o > 0; o >>= 1) {
            col = fmax(col, __shfl_xor_sync(GRNG_FULL_MASK, col, o));
            row = fmax(row, __shfl_xor_sync(GRNG_FULL_MASK, row, o));
        }
        sq = newton_warp_sum_d(sq);
        tr = newton_warp_sum_d(tr);
        if (tx == 0) {
            partial[4 * blockIdx.x] = (float)row;
            partial[4 * blockIdx.x + 1] = (float)col;
            partial[4 * blockIdx.x + 2] = (float)sq;
            partial[4 * blockIdx.x + 3] = (float)tr;
        }
    }
}
GRNG_EMU_ENTRY(newton_abs_norms, (const float*, int, float*))

// X₀ (and its bf16 copy when flags & 2): flags & 1 → X = f32(alpha · a) (the paper's start
// for a symmetric a, alpha in double like the CPU), else X = c·I. Grid-stride over n².
extern "C" __global__ void __launch_bounds__(256)
    newton_init_x(const float* __restrict__ a, float* __restrict__ x,
                  __nv_bfloat16* __restrict__ x_bf, int n, double alpha, float c, int flags) {
    const size_t nn = (size_t)n * n;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < nn;
         i += (size_t)gridDim.x * blockDim.x) {
        float v;
        if (flags & 1)
            v = (float)((double)a[i] * alpha);
        else
            v = (i / n == i % n) ? c : 0.0f;
        x[i] = v;
        if (flags & 2) grng_st_bf16(&x_bf[i], v);
    }
}
GRNG_EMU_ENTRY(newton_init_x, (const float*, float*, __nv_bfloat16*, int, double, float, int))

// ---------------------------------------------------------------------------------------
// Power iteration: one launch per step. w = A v (a warp per row, grid-stride, double
// accumulation; w stored f32) with per-block partials of vᵀw and wᵀw as double-float pairs
// (hi, lo): partial[4b..4b+4] = (vᵀw hi, lo, wᵀw hi, lo). partial[4·gridDim.x] is a counter
// (unsigned int bits, 0 at the launch): the block whose count is the last one sums the
// partials in a fixed order (thread t over b = t, t + 256, …, then newton_block_sum_d) into
// scal = (vᵀw hi, lo, ‖w‖ hi, lo) (the step's slot of the batch's buffer: the launcher passes
// its address), resets the counter to 0 for the next step and, when ‖w‖ > 0, normalizes
// v = w / ‖w‖. Every block's reads of v and writes of w precede its count (__syncthreads), so
// the last block writes v only after all reads of it. Block 256.
__device__ __forceinline__ void newton_store_df(float* p, double v) {
    const float hi = (float)v;
    p[0] = hi;
    p[1] = (float)(v - (double)hi);
}

extern "C" __global__ void __launch_bounds__(256)
    newton_power_step(const float* __restrict__ a, float* v, float* w, float* partial,
                      float* __restrict__ scal, int n) {
    __shared__ double red[2][8];
    __shared__ int last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    double vw = 0.0, ww = 0.0;
    for (int r = blockIdx.x * nwarps + warp; r < n; r += gridDim.x * nwarps) {
        double s = 0.0;
        const float* row = a + (size_t)r * n;
        for (int c = lane; c < n; c += 32) s += (double)row[c] * (double)v[c];
        s = newton_warp_sum_d(s);
        if (lane == 0) {
            w[r] = (float)s;
            vw += (double)v[r] * s;
            ww += s * s;
        }
    }
    if (lane == 0) {
        red[0][warp] = vw;
        red[1][warp] = ww;
    }
    // Every read of v and write of w of this block is done before thread 0 counts. Each
    // thread fences its own rows of w first: __threadfence orders the calling thread's
    // writes, and the last block reads every block's w.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        double s0 = 0.0, s1 = 0.0;
        for (int k = 0; k < nwarps; ++k) {
            s0 += red[0][k];
            s1 += red[1][k];
        }
        newton_store_df(partial + 4 * blockIdx.x, s0);
        newton_store_df(partial + 4 * blockIdx.x + 2, s1);
        // Release: this block's partial and rows of w are visible device-wide before the
        // count says they are there.
        __threadfence();
        unsigned int* count = reinterpret_cast<unsigned int*>(partial + 4 * gridDim.x);
        last = atomicAdd(count, 1u) == gridDim.x - 1;
        if (last) {
            // Every block has counted: reset for the next step (stream order publishes it).
            *count = 0u;
            // Acquire: the partials and w the count has seen are visible from here.
            __threadfence();
        }
    }
    __syncthreads();
    if (!last) return;
    // volatile: read from memory, not from a cache line this SM may hold.
    const volatile float* p = partial;
    const volatile float* wv = w;
    const int count = (int)gridDim.x;
    double svw = 0.0, sww = 0.0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        svw += (double)p[4 * i] + (double)p[4 * i + 1];
        sww += (double)p[4 * i + 2] + (double)p[4 * i + 3];
    }
    svw = newton_block_sum_d(svw);
    sww = newton_block_sum_d(sww);
    const double wn = sqrt(sww);
    if (threadIdx.x == 0) {
        newton_store_df(scal, svw);
        newton_store_df(scal + 2, wn);
    }
    if (wn > 0.0)
        for (int i = threadIdx.x; i < n; i += blockDim.x) v[i] = (float)((double)wv[i] / wn);
}
GRNG_EMU_ENTRY(newton_power_step, (const float*, float*, float*, float*, float*, int))

// ---------------------------------------------------------------------------------------
// a[j, i] = a[i, j] for i > j: the lower triangle (row-major) copied onto the upper one, for
// cuSOLVER's potri, which writes one triangle of the inverse (src/cuda/cholesky.rs). One
// thread per element of the strict upper triangle, grid-stride over the n x n index space.
extern "C" __global__ void __launch_bounds__(256)
    newton_mirror_lower(float* __restrict__ a, int n) {
    const long long count = (long long)n * n;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < count;
         e += (long long)gridDim.x * blockDim.x) {
        const long long r = e / n, c = e % n;
        if (c > r) a[e] = a[c * n + r];
    }
}
GRNG_EMU_ENTRY(newton_mirror_lower, (float*, int))
