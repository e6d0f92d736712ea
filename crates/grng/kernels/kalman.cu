// Khatri–Rao diagonal Kalman gain (docs/math.md §3 steps 3–7, §5.3): one R-Kalman step for n
// parameters observed through d_o ≤ 256 outputs, H the d_o x n row-major Jacobian in f32 or
// bf16 (every kernel reading H comes in both; products and sums are f32/f64 either way).
// Launchers: src/cuda/kalman.rs; CPU oracle: src/cpu/kalman.rs.
//
// Four kernels, queued back to back; the host reads one status buffer at the end. Every
// input is checked for NaN/Inf by the pass that reads it anyway (no check pass), and the
// status needs no reset of its own: each slot is (re)initialized by the kernel that owns it.
// 1. kalman_gram_partial_{f32,bf16} — P = H diag(σ + q) Hᵀ as a grid reduction over column
//    chunks. A block stages a chunk of H (d_o x tc, rows padded to a multiple of 4 with
//    zeros) and σ⁻ in shared memory; each thread owns a 4x4 tile of P's upper triangle and a
//    column lane, accumulates the chunk in f32 registers (FMA), adds each chunk's sum into
//    f64 (as the CPU adds its chunk sums in f64), and the lanes of a tile (one warp) are
//    reduced by shuffles. One f64 partial per block and upper-triangle entry; no atomics.
//    More than 256 tiles (d_o > 88) are split over gridDim.y groups of 256. Blocks of group 0
//    record the first non-finite H entry (flat index j·n + i) and the first non-finite and
//    non-positive σ of their chunks into per-block flags.
// 2. kalman_gram_reduce — one warp per entry sums the block partials in a fixed order (grid
//    and chunking depend on n and d_o only: deterministic), writes P (f64, symmetric); one
//    more warp takes the minimum of the block flags into the status (plain stores).
// 3. kalman_solve — ONE block does the d_o x d_o algebra in f64, exactly the CPU's sequence:
//    R ← βR_sym + (1−β)(vvᵀ + P), R̃ (exact through the Cholesky factor of I + ρR, or
//    Neumann), S = P + R̃, Cholesky of S + δI with the jitter escalated x10 on failure
//    (in-kernel, up to max_esc times), L⁻¹, w = S⁻¹v, vᵀS⁻¹v. Its three d_o x d_o matrices live
//    in shared memory for d_o ≤ KAL_SMEM_DO (the fast path), else in a global workspace (L2
//    resident: 1.5 MiB at d_o = 256), same code. It writes R (f32), L⁻¹ and w (f32, for pass
//    4), initializes its own and pass 4's status slots, and sets solve_ok, which gates pass 4.
// 4. kalman_update_d{8,16,32,64}_{f32,bf16} — ONE fused streaming pass over H: per column i,
//    h_i in registers (D ≥ d_o, compile-time so the arrays stay in registers), z = L⁻¹h_i
//    against L⁻¹ in shared memory (broadcast float4 reads), μ_i ← μ_i + σ⁻_i h_iᵀw,
//    σ_i ← max(σ⁻_i(1 − σ⁻_i‖z‖²), min(floor, σ⁻_i)). For d_o > 64 (too many registers)
//    kalman_update_wide_{f32,bf16} stages 32 columns of H in shared memory and splits the rows
//    of L⁻¹ over the block's warps. Writes only the posterior buffers (the caller's spares:
//    the state is committed by the host on success only), counts the floored entries and
//    records the first non-finite μ (always) and posterior entries.
//
// Status (ints at float offset KAL_ISTAT of the status buffer; f64 values at its 8-byte
// aligned start): see the KAL_S_* slots. First-index slots only decrease (atomicMin through
// grng_flag_first), counters only increase (atomicAdd): order-independent.
#include "common.cuh"

#define KAL_NONE GRNG_NONE
#define KAL_SMEM_DO 64  // largest d_o whose solve runs in shared memory (96 KiB)
#define KAL_THREADS 256
#define KAL_WIDE_TW 32  // columns per block step of kalman_update_wide

// Status slots (ints).
#define KAL_S_MU 0          // first non-finite μ
#define KAL_S_SIGMA 1       // first non-finite σ
#define KAL_S_R 2           // first non-finite R
#define KAL_S_INNOV 3       // first non-finite innovation
#define KAL_S_SIGMA_POS 4   // first σ ≤ 0
#define KAL_S_P 5           // 1 when P has a NaN/Inf entry (H finite: P overflowed)
#define KAL_S_M_SPD 6       // Cholesky of I + ρR failed at this index (-1: did not)
#define KAL_S_S_SPD 7       // Cholesky of S + δI failed after every escalation (-1: did not)
#define KAL_S_ESC 8         // jitter escalations used
#define KAL_S_FLOORED 9     // σ entries set by the floor
#define KAL_S_POST_MU 10    // first non-finite posterior μ
#define KAL_S_POST_SIGMA 11 // first non-finite posterior σ
#define KAL_S_POST_R 12     // first non-finite posterior R
#define KAL_S_OK 13         // 1 when pass 4 must update
#define KAL_S_H 14          // first non-finite H entry (flat row-major index)
#define KAL_ISTAT 10        // float offset of the int slots
// f64 values: 0 δ, 1 vᵀS⁻¹v, 2 pivot of I + ρR, 3 pivot of S + δI.
// Per-block flags of pass 1 (ints after the partials): first bad σ, σ ≤ 0, H.
#define KAL_NFLAGS 3

__device__ __forceinline__ int* kal_istat(float* status) {
    return reinterpret_cast<int*>(status + KAL_ISTAT);
}

// One element of H, widened to f32 (exact for bf16).
__device__ __forceinline__ float kal_ld(const float* p) { return *p; }
__device__ __forceinline__ float kal_ld(const __nv_bfloat16* p) { return grng_ld_bf16(p); }

// Packed index of the upper-triangle entry (j, k), j ≤ k < d_o, row by row.
__device__ __forceinline__ int kal_pair(int j, int k, int d_o) {
    return j * d_o - j * (j - 1) / 2 + (k - j);
}

// ---------------------------------------------------------------------------------------
// Pass 1. Dynamic shared memory (smem, declared by the entry point): tc floats of σ⁻, then
// r4 rows of tc + 1 floats of H
// (r4 = d_o rounded up to 4; the +1 pad keeps the tiles' row reads on distinct banks).
// partial: f64, [pair * gridDim.x + block], then (float offset flag_off) KAL_NFLAGS ints per
// block x. blockDim.x = KAL_THREADS; gridDim.y = tile groups.
template <typename HT>
__device__ __forceinline__ void kal_gram_partial(const HT* __restrict__ h,
                                                 const float* __restrict__ sigma, float q,
                                                 int d_o, int n, int tc, int flag_off,
                                                 float* __restrict__ partial, float* smem) {
    __shared__ int s_bad[KAL_NFLAGS];
    const int nt = (d_o + 3) / 4, r4 = 4 * nt, ld = tc + 1;
    float* sS = smem;
    float* sH = smem + tc;
    const int ntiles = nt * (nt + 1) / 2;
    int nlanes = 32;  // lanes per tile: a power of two ≤ 32 with ntiles * nlanes ≤ 256
    while (nlanes > 1 && ntiles * nlanes > KAL_THREADS) nlanes >>= 1;
    const int tid = threadIdx.x;
    const int lane = tid % nlanes, tile = blockIdx.y * (KAL_THREADS / nlanes) + tid / nlanes;
    const bool active = tile < ntiles;
    const bool checker = blockIdx.y == 0;  // every group reads the same H and σ
    int ti = 0, rem = active ? tile : 0;  // tile → (row block ti, column block tk ≥ ti)
    while (rem >= nt - ti) rem -= nt - ti, ++ti;
    const int tk = ti + rem;
    if (tid < KAL_NFLAGS) s_bad[tid] = KAL_NONE;
    __syncthreads();

    double accd[4][4];
    GRNG_UNROLL
    for (int x = 0; x < 4; ++x)
        GRNG_UNROLL
        for (int y = 0; y < 4; ++y) accd[x][y] = 0.0;
    int bad_nf = KAL_NONE, bad_pos = KAL_NONE, bad_h = KAL_NONE;

    const int nchunks = (n + tc - 1) / tc;
    for (int chunk = blockIdx.x; chunk < nchunks; chunk += gridDim.x) {
        const int c0 = chunk * tc;
        for (int c = tid; c < tc; c += KAL_THREADS) {
            const int i = c0 + c;
            float s = 0.0f;
            if (i < n) {
                s = sigma[i];
                if (!isfinite(s) && bad_nf == KAL_NONE) bad_nf = i;
                if (s <= 0.0f && bad_pos == KAL_NONE) bad_pos = i;
                s = s + q;
            }
            sS[c] = s;
        }
        for (int idx = tid; idx < r4 * tc; idx += KAL_THREADS) {
            const int j = idx / tc, c = idx - j * tc, i = c0 + c;
            float x = 0.0f;
            if (j < d_o && i < n) {
                const int flat = j * n + i;  // < 2^31 (checked by the launcher)
                x = kal_ld(h + flat);
                // Later chunks revisit smaller rows: keep the minimum, not the first hit.
                if (!isfinite(x)) bad_h = min(bad_h, flat);
            }
            sH[j * ld + c] = x;
        }
        __syncthreads();
        if (active) {
            float acc[4][4];
            GRNG_UNROLL
            for (int x = 0; x < 4; ++x)
                GRNG_UNROLL
                for (int y = 0; y < 4; ++y) acc[x][y] = 0.0f;
            for (int c = lane; c < tc; c += nlanes) {
                const float s = sS[c];
                float a[4], b[4];
                GRNG_UNROLL
                for (int x = 0; x < 4; ++x) {
                    a[x] = s * sH[(4 * ti + x) * ld + c];  // g_j = σ⁻ h_j, as the CPU forms it
                    b[x] = sH[(4 * tk + x) * ld + c];
                }
                GRNG_UNROLL
                for (int x = 0; x < 4; ++x)
                    GRNG_UNROLL
                    for (int y = 0; y < 4; ++y) acc[x][y] = fmaf(a[x], b[y], acc[x][y]);
            }
            GRNG_UNROLL
            for (int x = 0; x < 4; ++x)
                GRNG_UNROLL
                for (int y = 0; y < 4; ++y) accd[x][y] += static_cast<double>(acc[x][y]);
        }
        __syncthreads();
    }
    // Lanes of one tile are nlanes consecutive threads of one warp: xor tree, fixed order.
    for (int off = nlanes / 2; off > 0; off >>= 1)
        GRNG_UNROLL
        for (int x = 0; x < 4; ++x)
            GRNG_UNROLL
            for (int y = 0; y < 4; ++y)
                accd[x][y] += __shfl_xor_sync(GRNG_FULL_MASK, accd[x][y], off);
    if (active && lane == 0) {
        double* out = grng_as_f64(partial);
        GRNG_UNROLL
        for (int x = 0; x < 4; ++x)
            GRNG_UNROLL
            for (int y = 0; y < 4; ++y) {
                const int j = 4 * ti + x, k = 4 * tk + y;
                if (j < d_o && k < d_o && j <= k)
                    out[static_cast<long long>(kal_pair(j, k, d_o)) * gridDim.x + blockIdx.x] =
                        accd[x][y];
            }
    }
    if (checker) {
        grng_flag_first(&s_bad[0], bad_nf);
        grng_flag_first(&s_bad[1], bad_pos);
        grng_flag_first(&s_bad[2], bad_h);
        __syncthreads();
        if (tid < KAL_NFLAGS)
            reinterpret_cast<int*>(partial + flag_off)[blockIdx.x * KAL_NFLAGS + tid] = s_bad[tid];
    }
}

#define KAL_GRAM_PARTIAL(NAME, HT)                                                              \
    extern "C" __global__ void NAME(const HT* __restrict__ h, const float* __restrict__ sigma,  \
                                    float q, int d_o, int n, int tc, int flag_off,             \
                                    float* __restrict__ partial) {                             \
        GRNG_DYN_SHARED(float, smem);                                                          \
        kal_gram_partial<HT>(h, sigma, q, d_o, n, tc, flag_off, partial, smem);                \
    }                                                                                          \
    GRNG_EMU_ENTRY(NAME, (const HT*, const float*, float, int, int, int, int, float*))
KAL_GRAM_PARTIAL(kalman_gram_partial_f32, float)
KAL_GRAM_PARTIAL(kalman_gram_partial_bf16, __nv_bfloat16)

// Pass 2. One warp per upper-triangle entry: P[j][k] = P[k][j] = Σ_b partial[pair][b] (f64,
// fixed order: lane strides, then an xor tree). p: f64 d_o x d_o at p's aligned start. Warp
// npairs takes the minimum of the block flags into the status slots of σ and H.
extern "C" __global__ void kalman_gram_reduce(const float* __restrict__ partial, int nblocks,
                                              int flag_off, int d_o, float* __restrict__ p,
                                              float* __restrict__ status) {
    const int warps = blockDim.x / 32;
    const int pair = blockIdx.x * warps + threadIdx.x / 32, lane = threadIdx.x & 31;
    const int npairs = d_o * (d_o + 1) / 2;
    if (pair > npairs) return;  // warp-uniform; no barrier follows
    if (pair == npairs) {
        const int* flags = reinterpret_cast<const int*>(partial + flag_off);
        const int slots[KAL_NFLAGS] = {KAL_S_SIGMA, KAL_S_SIGMA_POS, KAL_S_H};
        for (int f = 0; f < KAL_NFLAGS; ++f) {
            int m = KAL_NONE;
            for (int b = lane; b < nblocks; b += 32) m = min(m, flags[b * KAL_NFLAGS + f]);
            m = __reduce_min_sync(GRNG_FULL_MASK, m);
            if (lane == 0) kal_istat(status)[slots[f]] = m;
        }
        return;
    }
    const double* src = grng_as_f64(partial) + static_cast<long long>(pair) * nblocks;
    double acc = 0.0;
    for (int b = lane; b < nblocks; b += 32) acc += src[b];
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(GRNG_FULL_MASK, acc, off);
    if (lane == 0) {
        int j = 0, rest = pair;
        while (rest >= d_o - j) rest -= d_o - j, ++j;
        const int k = j + rest;
        double* P = grng_as_f64(p);
        P[j * d_o + k] = acc;
        P[k * d_o + j] = acc;
    }
}
GRNG_EMU_ENTRY(kalman_gram_reduce, (const float*, int, int, int, float*, float*))

// ---------------------------------------------------------------------------------------
// Pass 3 helpers (one block, f64 shared memory, every thread calls each).

// In-place lower Cholesky of the d x d matrix a (upper part left as it was). Returns -1, or
// the first index whose pivot is not finite and positive (its value in *pivot).
__device__ int kal_cholesky(double* a, int d, double* pivot) {
    __shared__ int fail;
    __shared__ double piv;
    for (int j = 0; j < d; ++j) {
        if (threadIdx.x == 0) {
            double s = 0.0;
            for (int k = 0; k < j; ++k) s += a[j * d + k] * a[j * d + k];
            const double dj = a[j * d + j] - s;
            fail = (dj > 0.0 && isfinite(dj)) ? -1 : j;
            piv = dj;
            if (fail < 0) a[j * d + j] = sqrt(dj);
        }
        __syncthreads();
        if (fail >= 0) {
            const int f = fail;
            *pivot = piv;
            __syncthreads();  // everyone has read `fail` before a later call rewrites it
            return f;
        }
        const double djj = a[j * d + j];
        for (int i = j + 1 + threadIdx.x; i < d; i += blockDim.x) {
            double s = 0.0;
            for (int k = 0; k < j; ++k) s += a[i * d + k] * a[j * d + k];
            a[i * d + j] = (a[i * d + j] - s) / djj;
        }
        __syncthreads();
    }
    return -1;
}

// inv ← L⁻¹ (lower, zeros above the diagonal) by forward substitution, one column per thread.
__device__ void kal_lower_inverse(const double* l, int d, double* inv) {
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        for (int i = 0; i < c; ++i) inv[i * d + c] = 0.0;
        for (int i = c; i < d; ++i) {
            double s = 0.0;
            for (int k = c; k < i; ++k) s += l[i * d + k] * inv[k * d + c];
            inv[i * d + c] = ((i == c ? 1.0 : 0.0) - s) / l[i * d + i];
        }
    }
    __syncthreads();
}

// a ← (a + aᵀ)/2.
__device__ void kal_symmetrize(double* a, int d) {
    for (int e = threadIdx.x; e < d * d; e += blockDim.x) {
        const int i = e / d, j = e - i * d;
        if (j < i) {
            const double m = 0.5 * (a[i * d + j] + a[j * d + i]);
            a[i * d + j] = m;
            a[j * d + i] = m;
        }
    }
    __syncthreads();
}

// Pass 3: one block of KAL_THREADS. Workspace: (3 d_o² + 2 d_o) doubles, in dynamic shared
// memory for d_o ≤ KAL_SMEM_DO, else at work's aligned start. p: f64 P (pass 2). gain: L⁻¹
// (f32 d_o x d_o, zeros above the diagonal) then w (f32 d_o).
extern "C" __global__ void kalman_solve(const float* __restrict__ p, const float* __restrict__ r,
                                        const float* __restrict__ innov, int d_o, float beta,
                                        float rho, int exact, float jitter, int max_esc,
                                        float* __restrict__ r_out, float* __restrict__ gain,
                                        float* __restrict__ work, float* __restrict__ status) {
    GRNG_DYN_SHARED(double, smem);
    const int dd = d_o * d_o, tid = threadIdx.x;
    // Global memory written by one thread is visible to the block after __syncthreads, as
    // shared memory is: the algorithm below does not depend on where X1..sy live.
    double* X1 = d_o <= KAL_SMEM_DO ? smem : grng_as_f64(work);
    double* X2 = X1 + dd;
    double* X3 = X2 + dd;
    double* sv = X3 + dd;
    double* sy = sv + d_o;
    const double* P = grng_as_f64(p);
    double* dstat = grng_as_f64(status);
    int* istat = kal_istat(status);
    __shared__ double s_delta;

    if (tid == 0) {  // this pass's slots and pass 4's (pass 2 wrote σ's and H's)
        istat[KAL_S_MU] = KAL_NONE;
        istat[KAL_S_R] = KAL_NONE;
        istat[KAL_S_INNOV] = KAL_NONE;
        istat[KAL_S_P] = 0;
        istat[KAL_S_M_SPD] = -1;
        istat[KAL_S_S_SPD] = -1;
        istat[KAL_S_ESC] = 0;
        istat[KAL_S_FLOORED] = 0;
        istat[KAL_S_POST_MU] = KAL_NONE;
        istat[KAL_S_POST_SIGMA] = KAL_NONE;
        istat[KAL_S_POST_R] = KAL_NONE;
        istat[KAL_S_OK] = 0;
    }
    __syncthreads();
    for (int j = tid; j < d_o; j += blockDim.x) {
        const float x = innov[j];
        if (!isfinite(x)) atomicMin(&istat[KAL_S_INNOV], j);
        sv[j] = x;
    }
    __syncthreads();
    // R ← β R_sym + (1 − β)(v vᵀ + P), exactly symmetric; written out in f32.
    const double b = beta;
    for (int e = tid; e < dd; e += blockDim.x) {
        const int j = e / d_o, k = e - j * d_o;
        if (!isfinite(r[e])) atomicMin(&istat[KAL_S_R], e);
        if (!isfinite(P[e])) atomicMax(&istat[KAL_S_P], 1);
        const double rs = 0.5 * (static_cast<double>(r[j * d_o + k]) + r[k * d_o + j]);
        const double rn = b * rs + (1.0 - b) * (sv[j] * sv[k] + P[e]);
        X1[e] = rn;
        const float rf = static_cast<float>(rn);
        r_out[e] = rf;
        if (!isfinite(rf)) atomicMin(&istat[KAL_S_POST_R], e);
    }
    __syncthreads();

    // R̃ into X3.
    const double rh = rho;
    int fail = -1;
    if (rh == 0.0) {
        for (int e = tid; e < dd; e += blockDim.x) X3[e] = X1[e];
        __syncthreads();
    } else if (!exact) {
        for (int e = tid; e < dd; e += blockDim.x) {  // R − ρR²
            const int i = e / d_o, j = e - i * d_o;
            double s = 0.0;
            for (int k = 0; k < d_o; ++k) s += X1[i * d_o + k] * X1[k * d_o + j];
            X3[e] = X1[e] - rh * s;
        }
        __syncthreads();
        kal_symmetrize(X3, d_o);
    } else {
        // M = I + ρR is SPD for a PSD R and commutes with R: R̃ = M⁻¹R = L⁻ᵀL⁻¹R.
        for (int e = tid; e < dd; e += blockDim.x) {
            const int i = e / d_o, j = e - i * d_o;
            X2[e] = rh * X1[e] + (i == j ? 1.0 : 0.0);
        }
        __syncthreads();
        double piv = 0.0;
        fail = kal_cholesky(X2, d_o, &piv);
        if (fail >= 0) {
            if (tid == 0) {
                istat[KAL_S_M_SPD] = fail;
                dstat[2] = piv;
            }
        } else {
            kal_lower_inverse(X2, d_o, X3);
            for (int e = tid; e < dd; e += blockDim.x) {  // M⁻¹ into X2
                const int i = e / d_o, j = e - i * d_o;
                double s = 0.0;
                for (int k = i > j ? i : j; k < d_o; ++k) s += X3[k * d_o + i] * X3[k * d_o + j];
                X2[e] = s;
            }
            __syncthreads();
            for (int e = tid; e < dd; e += blockDim.x) {  // M⁻¹R into X3
                const int i = e / d_o, j = e - i * d_o;
                double s = 0.0;
                for (int k = 0; k < d_o; ++k) s += X2[i * d_o + k] * X1[k * d_o + j];
                X3[e] = s;
            }
            __syncthreads();
            kal_symmetrize(X3, d_o);
        }
    }

    if (fail < 0) {
        // S = P + R̃ (symmetrized), δ = jitter · mean(diag S) (or jitter), escalated x10.
        for (int e = tid; e < dd; e += blockDim.x) X3[e] = P[e] + X3[e];
        __syncthreads();
        kal_symmetrize(X3, d_o);
        if (tid == 0) {
            double md = 0.0;
            for (int j = 0; j < d_o; ++j) md += X3[j * d_o + j];
            md /= d_o;
            s_delta = static_cast<double>(jitter) * (md > 0.0 ? md : 1.0);
        }
        __syncthreads();
        double delta = s_delta, piv = 0.0;
        int esc = 0;
        for (;;) {
            for (int e = tid; e < dd; e += blockDim.x) {
                const int i = e / d_o, j = e - i * d_o;
                X2[e] = X3[e] + (i == j ? delta : 0.0);
            }
            __syncthreads();
            fail = kal_cholesky(X2, d_o, &piv);
            if (fail < 0 || esc == max_esc) break;
            ++esc;
            delta *= 10.0;
        }
        if (tid == 0) {
            istat[KAL_S_ESC] = esc;
            dstat[0] = delta;
            if (fail >= 0) {
                istat[KAL_S_S_SPD] = fail;
                dstat[3] = piv;
            }
        }
        if (fail < 0) {
            kal_lower_inverse(X2, d_o, X1);  // R (X1) is already written out
            for (int i = tid; i < d_o; i += blockDim.x) {  // y = L⁻¹v
                double s = 0.0;
                for (int j = 0; j <= i; ++j) s += X1[i * d_o + j] * sv[j];
                sy[i] = s;
            }
            __syncthreads();
            for (int j = tid; j < d_o; j += blockDim.x) {  // w = L⁻ᵀy
                double s = 0.0;
                for (int i = j; i < d_o; ++i) s += X1[i * d_o + j] * sy[i];
                gain[dd + j] = static_cast<float>(s);
            }
            for (int e = tid; e < dd; e += blockDim.x) gain[e] = static_cast<float>(X1[e]);
            if (tid == 0) {
                double nis = 0.0;
                for (int i = 0; i < d_o; ++i) nis += sy[i] * sy[i];
                dstat[1] = nis;
            }
        }
    }
    __syncthreads();  // the atomics above are visible to thread 0 after the barrier
    if (tid == 0) {
        const bool clean = istat[KAL_S_SIGMA] == KAL_NONE && istat[KAL_S_SIGMA_POS] == KAL_NONE &&
                           istat[KAL_S_H] == KAL_NONE && istat[KAL_S_R] == KAL_NONE &&
                           istat[KAL_S_INNOV] == KAL_NONE && istat[KAL_S_P] == 0;
        istat[KAL_S_OK] = (clean && fail < 0) ? 1 : 0;
    }
}
GRNG_EMU_ENTRY(kalman_solve, (const float*, const float*, const float*, int, float, float, int,
                              float, int, float*, float*, float*, float*))

// ---------------------------------------------------------------------------------------
// Pass 4 (both variants). Per column i, from t = h_iᵀw and zz = ‖L⁻¹h_i‖²: the posterior
// μ_i, σ_i (floored), the floor count and the first non-finite posterior entries.
struct KalPost {
    int post_mu = KAL_NONE, post_sig = KAL_NONE, floored = 0;
    __device__ __forceinline__ void column(int i, float m, float sg, float t, float zz, float q,
                                           float floor_, float* mu_out, float* sigma_out) {
        const float sp = sg + q;
        const float mo = m + sp * t;
        const float post = sp * (1.0f - sp * zz);
        const float lo = fminf(floor_, sp);
        const bool keep = post > lo;  // false for NaN too
        const float so = keep ? post : lo;
        floored += keep ? 0 : 1;
        mu_out[i] = mo;
        sigma_out[i] = so;
        if (!isfinite(mo) && post_mu == KAL_NONE) post_mu = i;
        if (!isfinite(so) && post_sig == KAL_NONE) post_sig = i;
    }
    // Every lane of the warp must call it.
    __device__ __forceinline__ void flush(int* istat, int mu_bad) const {
        grng_flag_first(&istat[KAL_S_MU], mu_bad);
        grng_flag_first(&istat[KAL_S_POST_MU], post_mu);
        grng_flag_first(&istat[KAL_S_POST_SIGMA], post_sig);
        const int f = __reduce_add_sync(GRNG_FULL_MASK, floored);
        if ((threadIdx.x & 31) == 0 && f != 0) atomicAdd(&istat[KAL_S_FLOORED], f);
    }
};

// d_o ≤ 64, D ≥ d_o a multiple of 4: one thread per column, grid-stride. μ is checked even
// when the solve failed (the CPU reports a non-finite μ first); nothing else runs then.
template <int D, typename HT>
__device__ __forceinline__ void kal_update(const HT* __restrict__ h, const float* __restrict__ mu,
                                           const float* __restrict__ sigma,
                                           const float* __restrict__ gain, float q, float floor_,
                                           int d_o, int n, float* __restrict__ mu_out,
                                           float* __restrict__ sigma_out, float* status) {
    __shared__ float4 sL4[D * D / 4];  // float4 storage: rows are 16-byte aligned
    float* sL = reinterpret_cast<float*>(sL4);
    __shared__ float sW[D];
    for (int e = threadIdx.x; e < D * D; e += blockDim.x) {
        const int r = e / D, j = e - r * D;
        sL[e] = (r < d_o && j <= r) ? gain[r * d_o + j] : 0.0f;
    }
    for (int j = threadIdx.x; j < D; j += blockDim.x) sW[j] = j < d_o ? gain[d_o * d_o + j] : 0.0f;
    __syncthreads();
    int* istat = kal_istat(status);
    const bool ok = istat[KAL_S_OK] == 1;
    int mu_bad = KAL_NONE;
    KalPost out;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        const float m = mu[i];
        if (!isfinite(m) && mu_bad == KAL_NONE) mu_bad = i;
        if (!ok) continue;
        // Keeps the compiler from hoisting the (loop-invariant) L⁻¹ reads out of the column
        // loop into registers, which would need D²/2 of them and spill.
        __threadfence_block();
        float hv[D];
        GRNG_UNROLL
        for (int j = 0; j < D; ++j) hv[j] = j < d_o ? kal_ld(h + static_cast<long long>(j) * n + i) : 0.0f;
        float t = 0.0f, zz = 0.0f;
        GRNG_UNROLL
        for (int r = 0; r < D; ++r) {
            if (r < d_o) {
                t = fmaf(sW[r], hv[r], t);
                float z = 0.0f;
                const float4* row = &sL4[r * (D / 4)];
                GRNG_UNROLL
                for (int jb = 0; jb < D / 4; ++jb) {
                    if (4 * jb <= r) {  // L⁻¹ is zero above the diagonal
                        const float4 l = row[jb];
                        z = fmaf(l.x, hv[4 * jb], z);
                        z = fmaf(l.y, hv[4 * jb + 1], z);
                        z = fmaf(l.z, hv[4 * jb + 2], z);
                        z = fmaf(l.w, hv[4 * jb + 3], z);
                    }
                }
                zz = fmaf(z, z, zz);
            }
        }
        out.column(i, m, sigma[i], t, zz, q, floor_, mu_out, sigma_out);
    }
    out.flush(istat, mu_bad);
}

// d_o > 64: the block walks KAL_WIDE_TW columns at a time (block-uniform loop), stages them
// (d_o x KAL_WIDE_TW, widened to f32) in dynamic shared memory, and warp w computes z_r for the
// rows r ≡ w (mod 8), lane = column: conflict-free column reads, warp-uniform (broadcast) L⁻¹
// reads. The 8 warps' partial t and ‖z‖² are summed in a fixed order by warp 0. Dynamic
// shared memory (sH, declared by the entry point): d_o · KAL_WIDE_TW + 2 · KAL_THREADS floats.
template <typename HT>
__device__ __forceinline__ void kal_update_wide(const HT* __restrict__ h,
                                                const float* __restrict__ mu,
                                                const float* __restrict__ sigma,
                                                const float* __restrict__ gain, float q,
                                                float floor_, int d_o, int n,
                                                float* __restrict__ mu_out,
                                                float* __restrict__ sigma_out, float* status,
                                                float* sH) {
    float* sT = sH + d_o * KAL_WIDE_TW;
    float* sZ = sT + KAL_THREADS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = KAL_THREADS / 32;
    int* istat = kal_istat(status);
    const bool ok = istat[KAL_S_OK] == 1;
    const float* w = gain + d_o * d_o;
    int mu_bad = KAL_NONE;
    KalPost out;
    for (int c0 = blockIdx.x * KAL_WIDE_TW; c0 < n; c0 += gridDim.x * KAL_WIDE_TW) {
        const int i = c0 + lane;
        if (warp == 0 && i < n && mu_bad == KAL_NONE && !isfinite(mu[i])) mu_bad = i;
        if (!ok) continue;  // block-uniform
        for (int e = tid; e < d_o * KAL_WIDE_TW; e += KAL_THREADS) {
            const int j = e / KAL_WIDE_TW, c = e - j * KAL_WIDE_TW;
            sH[e] = c0 + c < n ? kal_ld(h + static_cast<long long>(j) * n + c0 + c) : 0.0f;
        }
        __syncthreads();
        float t = 0.0f, zz = 0.0f;
        for (int r = warp; r < d_o; r += nw) {
            const float* lr = gain + r * d_o;
            float z = 0.0f;
            for (int j = 0; j <= r; ++j) z = fmaf(lr[j], sH[j * KAL_WIDE_TW + lane], z);
            zz = fmaf(z, z, zz);
            t = fmaf(w[r], sH[r * KAL_WIDE_TW + lane], t);
        }
        sT[tid] = t;
        sZ[tid] = zz;
        __syncthreads();
        if (warp == 0 && i < n) {
            float ts = 0.0f, zs = 0.0f;
            for (int k = 0; k < nw; ++k) ts += sT[k * 32 + lane], zs += sZ[k * 32 + lane];
            out.column(i, mu[i], sigma[i], ts, zs, q, floor_, mu_out, sigma_out);
        }
        __syncthreads();  // sH, sT, sZ are rewritten by the next step
    }
    out.flush(istat, mu_bad);
}

#define KAL_UPDATE_ARGS(HT)                                                                     \
    const HT *__restrict__ h, const float *__restrict__ mu, const float *__restrict__ sigma,    \
        const float *__restrict__ gain, float q, float floor_, int d_o, int n,                  \
        float *__restrict__ mu_out, float *__restrict__ sigma_out, float *__restrict__ status
#define KAL_UPDATE_ENTRY(NAME, HT) \
    GRNG_EMU_ENTRY(NAME, (const HT*, const float*, const float*, const float*, float, float, int, \
                          int, float*, float*, float*))
#define KAL_UPDATE(D, HT, SUF)                                                                  \
    extern "C" __global__ void kalman_update_d##D##_##SUF(KAL_UPDATE_ARGS(HT)) {                \
        kal_update<D, HT>(h, mu, sigma, gain, q, floor_, d_o, n, mu_out, sigma_out, status);    \
    }                                                                                           \
    KAL_UPDATE_ENTRY(kalman_update_d##D##_##SUF, HT)
#define KAL_UPDATE_WIDE(HT, SUF)                                                                \
    extern "C" __global__ void kalman_update_wide_##SUF(KAL_UPDATE_ARGS(HT)) {                  \
        GRNG_DYN_SHARED(float, sH);                                                             \
        kal_update_wide<HT>(h, mu, sigma, gain, q, floor_, d_o, n, mu_out, sigma_out, status,   \
                            sH);                                                                \
    }                                                                                           \
    KAL_UPDATE_ENTRY(kalman_update_wide_##SUF, HT)
KAL_UPDATE(8, float, f32)
KAL_UPDATE(16, float, f32)
KAL_UPDATE(32, float, f32)
KAL_UPDATE(64, float, f32)
KAL_UPDATE_WIDE(float, f32)
KAL_UPDATE(8, __nv_bfloat16, bf16)
KAL_UPDATE(16, __nv_bfloat16, bf16)
KAL_UPDATE(32, __nv_bfloat16, bf16)
KAL_UPDATE(64, __nv_bfloat16, bf16)
KAL_UPDATE_WIDE(__nv_bfloat16, bf16)
