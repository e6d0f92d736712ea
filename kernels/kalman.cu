// Khatri–Rao diagonal Kalman gain (SPEC §3 steps 3–7, §5.3): one R-Kalman step for n
// parameters observed through d_o ≤ 64 outputs, H the d_o x n row-major Jacobian.
// Launchers: src/cuda/kalman.rs; CPU oracle: src/cpu/kalman.rs.
//
// Four kernels, queued back to back; the host reads one status buffer at the end:
// 1. kalman_gram_partial — P = H diag(σ + q) Hᵀ as a grid reduction over column chunks. A
//    block stages a chunk of H (d_o x tc, rows padded to a multiple of 4 with zeros) and σ⁻
//    in shared memory; each thread owns a 4x4 tile of P's upper triangle and a column lane,
//    accumulates the chunk in f32 registers (FMA), adds each chunk's sum into f64 (as the CPU
//    adds its chunk sums in f64), and the lanes of a tile (one warp) are reduced by
//    shuffles. One f64 partial per block and upper-triangle entry; no atomics. σ is checked
//    (NaN/Inf, ≤ 0) on the way, since it is read here anyway.
// 2. kalman_gram_reduce — one warp per entry sums the block partials in a fixed order (grid
//    and chunking depend on n and d_o only: deterministic), writes P (f64, symmetric).
// 3. kalman_solve — ONE block does the d_o x d_o algebra in f64 shared memory, exactly the
//    CPU's sequence: R ← βR_sym + (1−β)(vvᵀ + P), R̃ (exact through the Cholesky factor of
//    I + ρR, or Neumann), S = P + R̃, Cholesky of S + δI with the jitter escalated x10 on
//    failure (in-kernel, up to max_esc times), L⁻¹, w = S⁻¹v, vᵀS⁻¹v. It writes R (f32),
//    L⁻¹ and w (f32, for pass 4) and the status; solve_ok gates pass 4.
// 4. kalman_update_d{8,16,32,64} — ONE fused streaming pass over H: per column i, h_i in
//    registers (D ≥ d_o, compile-time so the arrays stay in registers), z = L⁻¹h_i against
//    L⁻¹ in shared memory (broadcast float4 reads), μ_i ← μ_i + σ⁻_i h_iᵀw,
//    σ_i ← max(σ⁻_i(1 − σ⁻_i‖z‖²), min(floor, σ⁻_i)). Writes only the posterior buffers
//    (the caller's spares: the state is committed by the host on success only), counts the
//    floored entries and records the first non-finite μ (always) and posterior entries.
//
// Status (ints at float offset KAL_ISTAT of the status buffer; f64 values at its 8-byte
// aligned start): see the KAL_S_* slots. First-index slots start at KAL_NONE and only
// decrease (atomicMin), counters only increase (atomicAdd): order-independent.
#include "common.cuh"

#define KAL_NONE 0x7fffffff
#define KAL_MAX_DO 64
#define KAL_THREADS 256

// Status slots (ints).
#define KAL_S_MU 0          // first non-finite μ
#define KAL_S_SIGMA 1       // first non-finite σ
#define KAL_S_R 2           // first non-finite R
#define KAL_S_INNOV 3       // first non-finite innovation
#define KAL_S_SIGMA_POS 4   // first σ ≤ 0
#define KAL_S_P 5           // 1 when P has a NaN/Inf entry
#define KAL_S_M_SPD 6       // Cholesky of I + ρR failed at this index (-1: did not)
#define KAL_S_S_SPD 7       // Cholesky of S + δI failed after every escalation (-1: did not)
#define KAL_S_ESC 8         // jitter escalations used
#define KAL_S_FLOORED 9     // σ entries set by the floor
#define KAL_S_POST_MU 10    // first non-finite posterior μ
#define KAL_S_POST_SIGMA 11 // first non-finite posterior σ
#define KAL_S_POST_R 12     // first non-finite posterior R
#define KAL_S_OK 13         // 1 when pass 4 must update
#define KAL_ISTAT 10        // float offset of the int slots
// f64 values: 0 δ, 1 vᵀS⁻¹v, 2 pivot of I + ρR, 3 pivot of S + δI.

__device__ __forceinline__ double* kal_f64(float* p) {
    const unsigned long long a = (reinterpret_cast<unsigned long long>(p) + 7ull) & ~7ull;
    return reinterpret_cast<double*>(a);
}
__device__ __forceinline__ const double* kal_f64(const float* p) {
    const unsigned long long a = (reinterpret_cast<unsigned long long>(p) + 7ull) & ~7ull;
    return reinterpret_cast<const double*>(a);
}
__device__ __forceinline__ int* kal_istat(float* status) {
    return reinterpret_cast<int*>(status + KAL_ISTAT);
}

// Warp minimum of an index, one atomicMin per warp (every lane of the warp must call).
__device__ __forceinline__ void kal_min_index(int* slot, int v) {
    const int m = __reduce_min_sync(GRNG_FULL_MASK, v);
    if ((threadIdx.x & 31) == 0 && m != KAL_NONE) atomicMin(slot, m);
}

// Packed index of the upper-triangle entry (j, k), j ≤ k < d_o, row by row.
__device__ __forceinline__ int kal_pair(int j, int k, int d_o) {
    return j * d_o - j * (j - 1) / 2 + (k - j);
}

// ---------------------------------------------------------------------------------------
// Pass 1. Dynamic shared memory: tc floats of σ⁻, then r4 rows of tc + 1 floats of H
// (r4 = d_o rounded up to 4; the +1 pad keeps the tiles' row reads on distinct banks).
// partial: f64, [pair * gridDim.x + block]. blockDim.x = KAL_THREADS.
extern "C" __global__ void kalman_gram_partial(const float* __restrict__ h,
                                               const float* __restrict__ sigma, float q,
                                               int d_o, int n, int tc,
                                               float* __restrict__ partial,
                                               float* __restrict__ status) {
    GRNG_DYN_SHARED(float, smem);
    const int nt = (d_o + 3) / 4, r4 = 4 * nt, ld = tc + 1;
    float* sS = smem;
    float* sH = smem + tc;
    const int ntiles = nt * (nt + 1) / 2;
    int nlanes = 32;  // lanes per tile: a power of two ≤ 32 with ntiles * nlanes ≤ 256
    while (nlanes > 1 && ntiles * nlanes > KAL_THREADS) nlanes >>= 1;
    const int tid = threadIdx.x;
    const int lane = tid % nlanes, tile = tid / nlanes;
    const bool active = tile < ntiles;
    int ti = 0, rem = active ? tile : 0;  // tile → (row block ti, column block tk ≥ ti)
    while (rem >= nt - ti) rem -= nt - ti, ++ti;
    const int tk = ti + rem;

    double accd[4][4];
    GRNG_UNROLL
    for (int x = 0; x < 4; ++x)
        GRNG_UNROLL
        for (int y = 0; y < 4; ++y) accd[x][y] = 0.0;
    int bad_nf = KAL_NONE, bad_pos = KAL_NONE;

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
            sH[j * ld + c] = (j < d_o && i < n) ? h[static_cast<long long>(j) * n + i] : 0.0f;
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
        double* out = kal_f64(partial);
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
    int* istat = kal_istat(status);
    kal_min_index(&istat[KAL_S_SIGMA], bad_nf);
    kal_min_index(&istat[KAL_S_SIGMA_POS], bad_pos);
}
GRNG_EMU_ENTRY(kalman_gram_partial,
               (const float*, const float*, float, int, int, int, float*, float*))

// Pass 2. One warp per upper-triangle entry: P[j][k] = P[k][j] = Σ_b partial[pair][b] (f64,
// fixed order: lane strides, then an xor tree). p: f64 d_o x d_o at p's aligned start.
extern "C" __global__ void kalman_gram_reduce(const float* __restrict__ partial, int nblocks,
                                              int d_o, float* __restrict__ p) {
    const int warps = blockDim.x / 32;
    const int pair = blockIdx.x * warps + threadIdx.x / 32, lane = threadIdx.x & 31;
    const int npairs = d_o * (d_o + 1) / 2;
    if (pair >= npairs) return;  // warp-uniform; no barrier follows
    const double* src = kal_f64(partial) + static_cast<long long>(pair) * nblocks;
    double acc = 0.0;
    for (int b = lane; b < nblocks; b += 32) acc += src[b];
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(GRNG_FULL_MASK, acc, off);
    if (lane == 0) {
        int j = 0, rest = pair;
        while (rest >= d_o - j) rest -= d_o - j, ++j;
        const int k = j + rest;
        double* P = kal_f64(p);
        P[j * d_o + k] = acc;
        P[k * d_o + j] = acc;
    }
}
GRNG_EMU_ENTRY(kalman_gram_reduce, (const float*, int, int, float*))

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

// Pass 3: one block of KAL_THREADS. Dynamic shared memory: (3 d_o² + 2 d_o) doubles.
// p: f64 P (pass 2). gain: L⁻¹ (f32 d_o x d_o, zeros above the diagonal) then w (f32 d_o).
extern "C" __global__ void kalman_solve(const float* __restrict__ p, const float* __restrict__ r,
                                        const float* __restrict__ innov, int d_o, float beta,
                                        float rho, int exact, float jitter, int max_esc,
                                        float* __restrict__ r_out, float* __restrict__ gain,
                                        float* __restrict__ status) {
    GRNG_DYN_SHARED(double, X1);
    const int dd = d_o * d_o, tid = threadIdx.x;
    double* X2 = X1 + dd;
    double* X3 = X2 + dd;
    double* sv = X3 + dd;
    double* sy = sv + d_o;
    const double* P = kal_f64(p);
    double* dstat = kal_f64(status);
    int* istat = kal_istat(status);
    __shared__ double s_delta;

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
                           istat[KAL_S_R] == KAL_NONE && istat[KAL_S_INNOV] == KAL_NONE &&
                           istat[KAL_S_P] == 0;
        istat[KAL_S_OK] = (clean && fail < 0) ? 1 : 0;
    }
}
GRNG_EMU_ENTRY(kalman_solve, (const float*, const float*, const float*, int, float, float, int,
                              float, int, float*, float*, float*))

// ---------------------------------------------------------------------------------------
// Pass 4, D ≥ d_o a multiple of 4: one thread per column, grid-stride. μ is checked even
// when the solve failed (the CPU reports a non-finite μ first); nothing else runs then.
template <int D>
__device__ __forceinline__ void kal_update(const float* __restrict__ h,
                                           const float* __restrict__ mu,
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
    int mu_bad = KAL_NONE, post_mu = KAL_NONE, post_sig = KAL_NONE, floored = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x) {
        const float m = mu[i];
        if (!isfinite(m) && mu_bad == KAL_NONE) mu_bad = i;
        if (!ok) continue;
        // Keeps the compiler from hoisting the (loop-invariant) L⁻¹ reads out of the column
        // loop into registers, which would need D²/2 of them and spill.
        __threadfence_block();
        float hv[D];
        GRNG_UNROLL
        for (int j = 0; j < D; ++j) hv[j] = j < d_o ? h[static_cast<long long>(j) * n + i] : 0.0f;
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
        const float sp = sigma[i] + q;
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
    kal_min_index(&istat[KAL_S_MU], mu_bad);
    kal_min_index(&istat[KAL_S_POST_MU], post_mu);
    kal_min_index(&istat[KAL_S_POST_SIGMA], post_sig);
    const int f = __reduce_add_sync(GRNG_FULL_MASK, floored);
    if ((threadIdx.x & 31) == 0 && f != 0) atomicAdd(&istat[KAL_S_FLOORED], f);
}

#define KAL_UPDATE(D)                                                                           \
    extern "C" __global__ void kalman_update_d##D(                                              \
        const float* __restrict__ h, const float* __restrict__ mu,                              \
        const float* __restrict__ sigma, const float* __restrict__ gain, float q, float floor_, \
        int d_o, int n, float* __restrict__ mu_out, float* __restrict__ sigma_out,              \
        float* __restrict__ status) {                                                           \
        kal_update<D>(h, mu, sigma, gain, q, floor_, d_o, n, mu_out, sigma_out, status);        \
    }                                                                                           \
    GRNG_EMU_ENTRY(kalman_update_d##D, (const float*, const float*, const float*, const float*, \
                                        float, float, int, int, float*, float*, float*))
KAL_UPDATE(8)
KAL_UPDATE(16)
KAL_UPDATE(32)
KAL_UPDATE(64)
